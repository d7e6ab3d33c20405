"""GRPO group advantage (Shao et al., DeepSeekMath, arXiv 2402.03300); Dr.GRPO variant (arXiv 2503.20783).

Objective (outcome supervision, one scalar reward r_i per response i in its group g):
    A_i = (r_i - mean_g(r)) / (std_g(r) + epsilon)      # norm_adv_by_std_in_grpo = True
    A_i =  r_i - mean_g(r)                              # False (Dr.GRPO: no std division)
    advantages[i, t] = A_i * mask[i, t];  returns = advantages
std_g is torch.std (unbiased, Bessel's correction) as in Trinity-RFT: rewards [1,0,0,1] have
std 0.5774, so A = +-0.5/0.5774 = +-0.866.
Singleton groups (G = 1) use mean 0 / std 1, i.e. A = r (Trinity).

Deviations from Trinity-RFT's GRPOGroupedAdvantage:
- Works on a padded batch (tensors + group_index) instead of a list of Experience objects.
- std_threshold: Trinity DROPS groups with std <= threshold (and singleton groups) from the batch.
  A tensor function cannot drop rows, so those rows get advantage 0 and `keep` [B] bool = False is
  returned for the caller to drop them; metric `filtered_count` counts them (as Trinity).
- Not implemented: duplicate_experiences, rank_penalty, std_cal_level="batch".
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `grpo`."""

    epsilon: float = 1e-6
    """epsilon: added to the group std before dividing."""
    std_threshold: float | None = None
    """tau_std: groups whose reward std <= tau_std (and singleton groups) are filtered out (keep=False, A=0)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide by std_g (GRPO); False gives Dr.GRPO's A = r - mean_g."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Group-normalised advantages from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mask = batch["response_mask"]  # [B,T]
    n_groups = int(gi.max().item()) + 1 if gi.numel() else 0
    count = torch.zeros(n_groups, device=r.device).index_add_(0, gi, torch.ones_like(r))  # [num_groups]
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, gi, r) / count.clamp(min=1.0)  # [num_groups]
    sq = torch.zeros(n_groups, device=r.device).index_add_(0, gi, (r - mean[gi]) ** 2)  # [num_groups]
    std = (sq / (count - 1.0).clamp(min=1.0)).sqrt()  # [num_groups] unbiased (torch.std)
    single = count <= 1  # [num_groups]
    mean = torch.where(single, torch.zeros_like(mean), mean)  # [num_groups] baseline 0 for G = 1
    std = torch.where(single, torch.ones_like(std), std)  # [num_groups] std 1 for G = 1
    score = r - mean[gi]  # [B]
    if cfg.norm_adv_by_std_in_grpo:
        score = score / (std[gi] + cfg.epsilon)  # [B]
    keep = torch.ones_like(r, dtype=torch.bool)  # [B]
    if cfg.std_threshold is not None:
        keep = ~(single | (std <= cfg.std_threshold))[gi]  # [B]
        score = torch.where(keep, score, torch.zeros_like(score))  # [B]
    adv = score[:, None] * mask.to(score.dtype)  # [B,T]
    metrics = {"filtered_count": float((~keep).sum().item()),
               "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
               "reward_std": float(r.std().item()) if r.numel() > 1 else 0.0}
    return {"advantages": adv, "returns": adv.clone(), "keep": keep}, metrics
