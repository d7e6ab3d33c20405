"""REINFORCE++ advantage: whitened discounted return-to-go, no critic (Hu, arXiv 2501.03262).

Objective (per response token t, token reward r_t = outcome score on the last valid token minus
any per-token KL penalty):
    G_t = r_t + gamma * G_{t+1} * mask_{t+1}             (G_T = 0)
    advantages = masked_whiten(G, mask)                   (batch mean 0, unbiased var 1 over valid tokens)
    returns = G (0 on masked tokens)
Example (gamma 1): r = [0, -0.1, 1] -> G = [0.9, 0.9, 1.0], then whitened over the batch.

Padding: as veRL's loop, the running return is multiplied by the mask after each token
(`running = r_t + gamma * running; G_t = running; running *= mask_t`). Right padding (r = 0) is
unaffected. NOTE: a masked token INSIDE a response (tool output) therefore cuts the return: the
tokens before it do not see the rewards after it (e.g. an outcome reward at the end does not reach
earlier turns). Trinity-RFT's loop has no mask multiplication at all (the return runs through masked
tokens); delete the `running = running * mask[:, t]` line to get Trinity's numbers on such rows.

Deviations from Trinity-RFT's REINFORCEPLUSPLUSAdvantageFn:
- The veRL mask multiplication above (Trinity: none).
- returns are 0 on masked tokens (Trinity leaves them unmasked; without a critic they are unused).
- Metrics: reward_mean, returns/mean (Trinity returns none).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import masked_mean, masked_whiten


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `reinforceplusplus`."""

    gamma: float = 1.0
    """gamma: per-token discount factor in [0, 1]."""


@torch.no_grad()
def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Whitened return-to-go from batch["token_level_rewards"] [B,T] and ["response_mask"] [B,T]."""
    rewards = batch["token_level_rewards"].to(torch.float32)  # [B,T]
    mask = batch["response_mask"].to(torch.float32)  # [B,T]
    returns = torch.zeros_like(rewards)  # [B,T]
    running = rewards.new_zeros(rewards.shape[0])  # [B]
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[:, t] + cfg.gamma * running  # [B]
        returns[:, t] = running  # [B]
        running = running * mask[:, t]  # [B] NOTE: zero at a masked token (veRL's reset)
    returns = returns * mask  # [B,T]
    adv = masked_whiten(returns, mask)  # [B,T] 0 on masked tokens
    r = batch["rewards"].to(torch.float32)  # [B]
    metrics = {
        "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
        "returns/mean": float(masked_mean(returns, mask).item()),
    }
    return {"advantages": adv, "returns": returns}, metrics
