"""PPO clipped policy loss (Schulman et al., arXiv 1707.06347) with DAPO's asymmetric clip-higher
(arXiv 2503.14476) and dual clip for negative advantages (Ye et al., arXiv 1912.09729).

Objective, per response token (minimised; aggregated with utils.aggregate):
    r     = exp(logp - old_logp)                     (log-ratio clamped to +-20)
    L1    = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))
    L     = min(L1, -A * c)   if A < 0               (dual clip, c = clip_ratio_c > 1)
          = L1                otherwise
Metrics (veRL / Trinity names): pg_loss, pg_clipfrac (fraction of valid tokens where the clipped
term is the larger one), ppo_kl (masked mean of old_logp - logp), pg_clipfrac_lower (fraction of
valid tokens where the dual clip bounds the loss).

Deviations from Trinity-RFT's PPOPolicyLossFn: no enable_sequence_masking and no
fallback_to_policy_gradient options; loss_agg_mode is passed in by the caller (the algorithm-level
value), the Config field is kept only so Trinity YAMLs validate.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `ppo`."""

    clip_range: float = 0.2
    """eps: symmetric clip width, used for whichever of eps_low / eps_high is None."""
    clip_range_low: float | None = None
    """eps_low: the ratio is clipped below at 1 - eps_low."""
    clip_range_high: float | None = None
    """eps_high: the ratio is clipped above at 1 + eps_high (DAPO clip-higher: eps_high > eps_low)."""
    clip_ratio_c: float = 3.0
    """c: dual-clip bound for A < 0; the loss is at most -A * c. Must be > 1."""
    loss_agg_mode: str = "token-mean"
    """Ignored: the algorithm-level loss_agg_mode overrides it."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar PPO loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    if cfg.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {cfg.clip_ratio_c}")
    eps_low = cfg.clip_range if cfg.clip_range_low is None else cfg.clip_range_low
    eps_high = cfg.clip_range if cfg.clip_range_high is None else cfg.clip_range_high
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0)  # [B,T]
    ratio = torch.exp(log_ratio)  # [B,T]
    loss_unclipped = -adv * ratio  # [B,T]
    loss_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [B,T]
    loss1 = torch.maximum(loss_unclipped, loss_clipped)  # [B,T]
    loss_dual = -adv * cfg.clip_ratio_c  # [B,T]
    neg = adv < 0  # [B,T]
    loss = torch.where(neg, torch.minimum(loss1, loss_dual), loss1)  # [B,T]
    pg_loss = aggregate(loss, mask, loss_agg_mode)  # []
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)  # []
        clipfrac_lower = masked_mean(((loss1 > loss_dual) & neg).float(), mask)  # []
        ppo_kl = masked_mean(-log_ratio, mask)  # []
    metrics = {
        "pg_loss": pg_loss.item(),
        "pg_clipfrac": clipfrac.item(),
        "ppo_kl": ppo_kl.item(),
        "pg_clipfrac_lower": clipfrac_lower.item(),
    }
    return pg_loss, metrics
