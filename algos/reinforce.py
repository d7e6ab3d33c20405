"""REINFORCE advantage: the raw reward, no baseline (Williams 1992; used by TOPR, arXiv 2503.14286).

Objective (one scalar reward r_i per response i):
    A_i = r_i;   advantages[i, t] = A_i * mask[i, t];   returns = advantages
Example: rewards [1, 0] -> advantages 1 on every valid token of response 0, 0 on response 1.

Deviations from Trinity-RFT's REINFORCEGroupAdvantage:
- Works on a padded batch instead of a list of Experience objects; groups are not used.
- Metric reward_mean is the batch mean (Trinity: mean of per-group means).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `reinforce` (no knobs)."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A = r from batch["rewards"] [B], broadcast over batch["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    adv = r[:, None] * batch["response_mask"].to(torch.float32)  # [B,T]
    metrics = {"reward_mean": float(r.mean().item()) if r.numel() else 0.0}
    return {"advantages": adv, "returns": adv.clone()}, metrics
