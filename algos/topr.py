"""TOPR policy loss: Tapered Off-Policy REINFORCE (Le Roux et al., arXiv 2503.14286).

REINFORCE whose negative examples are importance-weighted with a ratio truncated to [0, 1], while
positive examples keep weight 1 (no ratio, so no variance blow-up and no vanishing gradient for good
samples). Per response token (minimised; aggregated with utils.aggregate):
    r     = exp(logp - old_logp)                        (log-ratio clamped to +-20)
    alpha = clip(r, 0, 1)  if A <= advantage_threshold  (negative examples)
          = 1              otherwise                    (positive examples)
    L     = -sg(alpha) * A * logp
At r = 1 every alpha is 1 and the gradient is REINFORCE's. Metrics: pg_loss, ppo_kl (masked mean of
old_logp - logp), pg_clipfrac (fraction of valid tokens whose alpha < 1, i.e. truncated), avg_alpha.

Deviations:
- The paper truncates the SEQUENCE ratio pi(y|x) / mu(y|x) and splits examples on the reward R(x, y)
  (with an optional baseline); as Trinity-RFT's TOPRPolicyLossFn, here alpha uses the TOKEN ratio and
  the split uses the advantage A (with Trinity's `reinforce` advantage, A = R).
- Trinity averages with token-mean always; here the algorithm-level loss_agg_mode (default token-mean).
- Trinity's metrics are topr_loss / avg_alpha / avg_ratio; here pg_loss / ppo_kl / pg_clipfrac / avg_alpha.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `topr`."""

    advantage_threshold: float = 0.0
    """tau_A: tokens with A <= tau_A are negative examples, weighted by the truncated ratio clip(r, 0, 1)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar TOPR loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0).detach()  # [B,T]
    ratio = torch.exp(log_ratio)  # [B,T]
    alpha = torch.where(adv <= cfg.advantage_threshold, ratio.clamp(0.0, 1.0), torch.ones_like(ratio))  # [B,T]
    pg_loss = aggregate(-alpha * adv * logprobs, mask, loss_agg_mode)  # []
    metrics = {
        "pg_loss": pg_loss.item(),
        "ppo_kl": masked_mean(-log_ratio, mask).item(),
        "pg_clipfrac": masked_mean((alpha < 1.0).float(), mask).item(),
        "avg_alpha": masked_mean(alpha, mask).item(),
    }
    return pg_loss, metrics
