"""PPO advantage: Generalized Advantage Estimation over response tokens (Schulman et al., arXiv 1506.02438).

Objective (per response token t, critic value V_t of the state before token t, reward r_t):
    delta_t = r_t + gamma * V_{t+1} - V_t                (V_T = 0: nothing after the last token)
    A_t     = delta_t + gamma * lam * A_{t+1}            (A_T = 0)
    returns_t = A_t + V_t                                 (the critic's regression target)
    advantages = masked_whiten(A, mask)                   (batch mean 0, unbiased var 1 over valid tokens)
With gamma = lam = 1 (the defaults) A_t = sum_{s>=t} r_s - V_t: the Monte Carlo return minus the value.
Worked example (gamma 0.9, lam 0.8, r = [0, 0, 1], V = [0.5, 0.6, 0.7]) is in tests/test_algos_advantage.py.

Padding: values are multiplied by the mask first (veRL's critic does `values * response_mask`), so
padding has value 0; right padding has r = 0 too, so it contributes delta = 0 and leaves the valid
tokens' A unchanged. A masked token INSIDE a response (tool output in a multi-turn response) is,
as in Trinity's loop, an ordinary step with r = 0 and V = 0: with gamma = lam = 1 this equals
skipping it; with gamma < 1 every such token also discounts, and with lam < 1 the bootstrap value
after the gap enters the earlier tokens' A with an extra factor lam per masked token. Current veRL
instead carries V_{t+1} and A_{t+1} across masked tokens (skips them); not done here, to match
Trinity-RFT's numbers.

Deviations from Trinity-RFT's PPOAdvantageFn (compute_gae_advantage_return):
- values are multiplied by the mask here (Trinity leaves it to the critic; "TODO: may use in multi-turn").
- returns and advantages are set to 0 on masked tokens (Trinity leaves returns unmasked there;
  the critic loss masks them anyway).
- Metrics: reward_mean, returns/mean, values/mean (masked means; Trinity returns none).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from algos.utils import masked_mean, masked_whiten


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `ppo`."""

    NEEDS: ClassVar[tuple[str, ...]] = ("values",)  # the trainer builds a critic for batch["values"]

    gamma: float = 1.0
    """gamma: per-token discount factor in [0, 1]."""
    lam: float = 1.0
    """lambda: GAE bias/variance trade-off in [0, 1] (0: one-step TD, 1: Monte Carlo return minus V)."""


@torch.no_grad()
def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """GAE from batch["token_level_rewards"] [B,T], ["values"] [B,T], ["response_mask"] [B,T]."""
    rewards = batch["token_level_rewards"].to(torch.float32)  # [B,T]
    mask = batch["response_mask"].to(torch.float32)  # [B,T]
    values = batch["values"].to(torch.float32) * mask  # [B,T] padding has value 0
    T = rewards.shape[-1]
    lastgaelam = rewards.new_zeros(rewards.shape[0])  # [B]
    adv = torch.zeros_like(rewards)  # [B,T]
    # NOTE: backwards in t; A_{t+1} (lastgaelam) must be read before it is overwritten.
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(lastgaelam)  # [B]
        delta = rewards[:, t] + cfg.gamma * nextvalues - values[:, t]  # [B]
        lastgaelam = delta + cfg.gamma * cfg.lam * lastgaelam  # [B]
        adv[:, t] = lastgaelam  # [B]
    returns = (adv + values) * mask  # [B,T]
    adv = masked_whiten(adv, mask)  # [B,T] 0 on masked tokens
    r = batch["rewards"].to(torch.float32)  # [B]
    metrics = {
        "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
        "returns/mean": float(masked_mean(returns, mask).item()),
        "values/mean": float(masked_mean(values, mask).item()),
    }
    return {"advantages": adv, "returns": returns}, metrics
