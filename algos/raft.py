"""RAFT's selection: of each task's group of responses, the best-rewarded one is kept for supervised fine-tuning, the
rest leave the loss (Dong et al., RAFT: Reward rAnked FineTuning, arXiv 2304.06767; Trinity-RFT's `raft` preset).

RAFT alternates (1) sampling K responses per prompt from the current policy, (2) ranking them by reward and keeping
the best one per prompt, (3) fine-tuning on the kept ones by maximum likelihood:
    max_theta  sum_{x in batch} log pi_theta(y*_x | x),   y*_x = argmax_{y_1..y_K ~ pi(.|x)} r(x, y_k)
Here (1) is the explorer (repeat_times = K), (2) this advantage fn, (3) the `sft` policy loss (mean NLL) on the rows
kept; the preset pairs them (algos/__init__.py). Per row b of group g:
    keep[b] = (b is the first row of g with r_b = max_g r) and (r_b >= reward_threshold, when set)
    advantages[b,t] = keep[b] * mask[b,t];  returns = advantages
Rows with keep False leave the loss (the trainer empties their response_mask), so the sft loss is the NLL of the
kept responses only. Example: group rewards [0.1, 1.1, 1.1, -0.1] -> keep [F, T, F, F]; with reward_threshold 1.0
and rewards [0.1, -0.1] -> keep [F, F] (no response of that task was good enough).
Metrics: kept_fraction (kept rows / rows), kept_reward_mean (mean reward of the kept rows; 0 when none),
reward_mean (over all rows).

Deviations: the paper keeps one response per prompt, breaking ties arbitrarily: here the first in batch order.
reward_threshold (keep only a best response that reaches it, as Trinity's RAFT workflows keep successful episodes
only) is an addition; None keeps every group's best, as the paper. Trinity-RFT's raft preset trains `sft` on every
experience the workflow returns and leaves the selection to the workflow; here any workflow's rollouts can be used.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import group_mean


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `raft`."""

    reward_threshold: float | None = None
    """r_min: a group's best response is kept only if its reward >= r_min; None: always (the paper's best-of-K)."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """keep [B] (each group's first best-rewarded row) and advantages = keep on every valid token, from
    batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mask = batch["response_mask"]  # [B,T]
    _, count = group_mean(r, gi)  # [num_groups]
    best = torch.full_like(count, -float("inf")).scatter_reduce(0, gi, r, reduce="amax")  # [num_groups]
    rows = torch.arange(len(r))  # [B]
    candidate = torch.where(r == best[gi], rows, len(r))  # [B] a best row's own index, else B
    first_best = torch.full_like(count, len(r), dtype=torch.long).scatter_reduce(0, gi, candidate, reduce="amin")
    first = rows == first_best[gi]  # [B] the first best row of its group (first_best: [num_groups])
    keep = first if cfg.reward_threshold is None else first & (r >= cfg.reward_threshold)  # [B]
    adv = keep[:, None].to(torch.float32) * mask.to(torch.float32)  # [B,T]
    metrics = {
        "kept_fraction": keep.float().mean().item() if r.numel() else 0.0,
        "kept_reward_mean": r[keep].mean().item() if keep.any() else 0.0,
        "reward_mean": r.mean().item() if r.numel() else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone(), "keep": keep}, metrics
