"""GRPO group advantage (Shao et al., DeepSeekMath, arXiv 2402.03300); Dr.GRPO variant (arXiv 2503.20783).

Objective (outcome supervision, one scalar reward r_i per response i in its group g):
    A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)      # norm_adv_by_std_in_grpo = True
    A_i =  r_i - mean_g(r)                              # False (Dr.GRPO: no std division)
    advantages[i, t] = A_i * mask[i, t];  returns = advantages
std_g is torch.std (unbiased, Bessel's correction) as in Trinity-RFT: rewards [1,0,0,1] have
std 0.5774, so A = +-0.5/0.5774 = +-0.866.
std_cal_level = "batch" replaces std_g by the std of every reward in the batch (torch.std, 1 when
B <= 1); the mean stays per group (arXiv 2508.08221: local mean, global std).
Singleton groups (G = 1) use mean 0 / std 1, i.e. A = r (Trinity); with "batch" they use mean 0
and the batch std, as Trinity does.

Deviations from Trinity-RFT's GRPOGroupedAdvantage:
- Works on a padded batch (tensors + group_index) instead of a list of Experience objects.
- std_threshold: Trinity DROPS groups with std <= threshold (and singleton groups) from the batch.
  A tensor function cannot drop rows, so those rows get advantage 0 and `keep` [B] bool = False is
  returned for the caller to drop them; metric `filtered_count` counts them (as Trinity). The
  threshold always tests the group std, also with std_cal_level = "batch" (as Trinity).
- Metrics reward_mean / reward_std are over the whole batch, not Trinity's mean of per-group values.
- Not implemented: duplicate_experiences, rank_penalty.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from algos.utils import group_mean


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `grpo`."""

    epsilon: float = 1e-6
    """epsilon: added to the std before dividing."""
    std_threshold: float | None = None
    """tau_std: groups whose reward std <= tau_std (and singleton groups) are filtered out (keep=False, A=0)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by the std (GRPO); False gives Dr.GRPO's A = r - mean_g."""
    std_cal_level: Literal["group", "batch"] = "group"
    """Scope of the std divided by: "group" = std_g per group, "batch" = std of all B rewards."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Group-normalised advantages from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    if cfg.std_cal_level not in ("group", "batch"):
        raise ValueError(f"std_cal_level must be 'group' or 'batch', got {cfg.std_cal_level!r}")
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mask = batch["response_mask"]  # [B,T]
    mean, count = group_mean(r, gi)  # [num_groups], [num_groups]
    sq, _ = group_mean((r - mean[gi]) ** 2, gi)  # [num_groups] mean squared deviation
    std = (sq * count / (count - 1.0).clamp(min=1.0)).sqrt()  # [num_groups] unbiased (torch.std)
    single = count <= 1  # [num_groups]
    mean = torch.where(single, torch.zeros_like(mean), mean)  # [num_groups] baseline 0 for G = 1
    std = torch.where(single, torch.ones_like(std), std)  # [num_groups] std 1 for G = 1
    div = std  # [num_groups]
    if cfg.std_cal_level == "batch":
        batch_std = r.std() if r.numel() > 1 else torch.ones((), device=r.device)  # []
        div = batch_std.expand_as(std)  # [num_groups]
    score = r - mean[gi]  # [B]
    if cfg.norm_adv_by_std_in_grpo:
        score = score / (div[gi] + cfg.epsilon)  # [B]
    keep = torch.ones_like(r, dtype=torch.bool)  # [B]
    if cfg.std_threshold is not None:
        keep = ~(single | (std <= cfg.std_threshold))[gi]  # [B]
        score = torch.where(keep, score, torch.zeros_like(score))  # [B]
    adv = score[:, None] * mask.to(score.dtype)  # [B,T]
    metrics = {
        "filtered_count": float((~keep).sum().item()),
        "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
        "reward_std": float(r.std().item()) if r.numel() > 1 else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone(), "keep": keep}, metrics
