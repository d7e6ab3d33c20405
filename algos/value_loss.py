"""Clipped value loss of the PPO critic (Schulman et al., arXiv 1707.06347; the clipping as in OpenAI
baselines' ppo2 and veRL's compute_value_loss).

Objective, per response token (minimised; aggregated with utils.aggregate):
    v_clip = old_v + clip(v - old_v, -eps_v, +eps_v)
    L      = 0.5 * max((v - R)^2, (v_clip - R)^2)
with v the critic's current values, old_v its values before the update (batch["values"]) and R the
GAE returns (batch["returns"]). Metrics: vf_loss, vf_clipfrac (fraction of valid tokens where the
clipped term is the larger one), vpred_mean.
Deviation: none from veRL (Trinity uses veRL's critic).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """trainer.critic.cliprange_value."""

    cliprange_value: float = 0.5
    """eps_v: how far the values may move from the old values before the loss stops pulling them."""


def compute(
    values: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar value loss from values [B,T] and batch values (old) / returns / response_mask [B,T]."""
    old, returns, mask = batch["values"], batch["returns"], batch["response_mask"]  # [B,T] each
    clipped = old + (values - old).clamp(-cfg.cliprange_value, cfg.cliprange_value)  # [B,T]
    loss1 = (values - returns).square()  # [B,T]
    loss2 = (clipped - returns).square()  # [B,T]
    loss = 0.5 * aggregate(torch.maximum(loss1, loss2), mask, loss_agg_mode)  # []
    with torch.no_grad():
        clipfrac = masked_mean((loss2 > loss1).float(), mask)  # []
        vpred = masked_mean(values, mask)  # []
    return loss, {"vf_loss": loss.item(), "vf_clipfrac": clipfrac.item(), "vpred_mean": vpred.item()}
