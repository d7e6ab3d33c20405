"""AsymRE advantage: REINFORCE with a group-mean baseline shifted down (Arnal et al., arXiv 2506.20520).

Objective (one scalar reward r_i per response i in group g of size n):
    A_i = r_i - (mean_g(r) + delta)            delta = baseline_shift (< 0 by default)
    advantages[i, t] = A_i * mask[i, t];   returns = advantages
A baseline below the mean (delta < 0) weights positive rewards more than negative ones; the paper
finds this is the stable side for off-policy REINFORCE (baseline below the behaviour policy's value).
Example: rewards [1, 0], delta -0.1 -> b = 0.4,
A = [0.6, -0.4].
Singleton group (n = 1): b = 0 (no shift either), A = r (Trinity).

Deviations from Trinity-RFT's ASYMREGroupAdvantage:
- Works on a padded batch (rewards [B] + group_index) instead of a list of Experience objects.
- Metrics: reward_mean over the batch and group_baseline = mean of b_g over the groups (Trinity
  logs both per group).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import baseline_advantages, group_mean


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `asymre`."""

    baseline_shift: float = -0.1
    """delta: added to the group-mean baseline; negative favours positive-reward responses."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A = r - (mean_g + delta) from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mean, count = group_mean(r, gi)  # [num_groups], [num_groups]
    base = torch.where(count > 1, mean + cfg.baseline_shift, torch.zeros_like(mean))  # [num_groups] singleton: 0
    return baseline_advantages(r, gi, base, count, batch["response_mask"])
