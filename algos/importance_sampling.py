"""Plain importance-sampling policy loss (no clip), as Trinity-RFT's ImportanceSamplingLossFn, used for
on-policy distillation (advantage = teacher-student log-prob gap). The unclipped surrogate of
PPO (Schulman et al., arXiv 1707.06347, L^CPI) / off-policy policy gradient.

Objective, per response token (minimised; aggregated with utils.aggregate):
    r = exp(logp - old_logp)          (log-ratio clamped to +-20)
    L = -A * r
Gradient -A * r * grad logp: REINFORCE's at r = 1, unbounded as r grows (no trust region).
Metrics: pg_loss, ratio_mean (masked mean of r), approx_kl (masked mean of old_logp - logp).

Deviation from Trinity-RFT: its metric "ratio/mean" is named ratio_mean here, so that train.py files it
under actor/ (a key with "/" is logged as is).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `importance_sampling`."""

    loss_agg_mode: str = "token-mean"
    """Ignored: the algorithm-level loss_agg_mode overrides it (kept so Trinity YAMLs validate)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar IS loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0)  # [B,T]
    ratio = torch.exp(log_ratio)  # [B,T]
    pg_loss = aggregate(-batch["advantages"] * ratio, mask, loss_agg_mode)  # []
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
        }
    return pg_loss, metrics
