"""RLOO advantage: REINFORCE with a leave-one-out baseline (Ahmadian et al., arXiv 2402.14740).

Objective (one scalar reward r_i per response i in group g of size n):
    A_i = r_i - (1/(n-1)) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_g(r))
    advantages[i, t] = A_i * mask[i, t];   returns = advantages
Example: rewards [1, 0, 0] -> mean 1/3, A = 1.5 * [2/3, -1/3, -1/3] = [1, -0.5, -0.5].
Singleton group (n = 1): no other member to average, so the baseline is 0 and A = r (Trinity).

Deviations from Trinity-RFT's RLOOAdvantageFn:
- Works on a padded batch (rewards [B] + group_index) instead of summing token_level_rewards per
  uid; the two agree because the trainer's rewards already include any KL penalty.
- Metric reward_mean (batch mean; Trinity returns none).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import group_mean


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `rloo` (no knobs)."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Leave-one-out advantages from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mean, count = group_mean(r, gi)  # [num_groups], [num_groups]
    n = count[gi]  # [B] size of each response's group
    # n/(n-1) * (r - mean); n = 1 -> factor 1 and baseline 0, i.e. A = r
    factor = torch.where(n > 1, n / (n - 1.0).clamp(min=1.0), torch.ones_like(n))  # [B]
    baseline = torch.where(n > 1, mean[gi], torch.zeros_like(r))  # [B]
    score = factor * (r - baseline)  # [B]
    adv = score[:, None] * batch["response_mask"].to(torch.float32)  # [B,T]
    metrics = {"reward_mean": float(r.mean().item()) if r.numel() else 0.0}
    return {"advantages": adv, "returns": adv.clone()}, metrics
