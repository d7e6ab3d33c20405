"""Entropy bonus (maximum-entropy regularisation as in PPO, arXiv 1707.06347, eq. 9).

Objective (added to the policy loss, so higher entropy lowers the loss):
    L_ent = -beta_ent * aggregate(H[b,t], mask),   H = -sum_v p_v log p_v  (computed by the caller)
Trinity returns +beta_ent * agg(H) and the actor subtracts it; here the sign is folded in, so the
trainer always ADDS every loss term. Metric `entropy_loss` is agg(H) itself (Trinity's meaning: the
mean entropy, not the signed term). `none`: the entropy is not needed; returns 0 and no metrics.
`mix` (Trinity-RFT's MIX algorithm): the same bonus over the RL rows only, mask = response_mask *
(1 - expert_mask), so expert SFT demonstrations get no entropy term.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate


@dataclasses.dataclass
class Config:
    """entropy_loss_fn_args for `default`, `none` and `mix`."""

    entropy_coef: float = 0.0
    """beta_ent: weight of the entropy bonus (0 disables it but still logs the entropy)."""


def loss(
    entropy: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """-entropy_coef * aggregate(entropy [B,T], batch["response_mask"] [B,T])."""
    ent = aggregate(entropy, batch["response_mask"], loss_agg_mode)  # []
    return -cfg.entropy_coef * ent, {"entropy_loss": ent.item()}  # []


def none(
    entropy: torch.Tensor | None, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """No entropy term: a zero scalar (entropy may be None)."""
    return torch.zeros(()), {}  # []


def mix(
    entropy: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """`loss` over non-expert tokens: mask = response_mask [B,T] * (1 - expert_mask [B,T])."""
    mask = batch["response_mask"].to(entropy.dtype) * (1.0 - batch["expert_mask"].to(entropy.dtype))  # [B,T]
    return loss(entropy, {"response_mask": mask}, cfg, loss_agg_mode)
