"""Shared tensor helpers for every algos/ file: masked statistics and the one loss aggregation.

Shape legend (used in a comment on every tensor line in algos/):
    B  sequences (experiences) in the batch
    T  response tokens (padded length of the response)
    G  group size (responses sampled per task)
    V  vocabulary size
    num_groups  groups in the batch (B / G when every group is full)
`mask` is the response mask [B,T]: 1 for a token the loss should see, 0 for padding / prompt / tool
output. It may be bool or float; it is cast to the values' dtype.

Empty masks never give NaN: every division by a token count uses max(count, 1), so an all-masked
sequence (or batch) contributes 0 instead of 0/0.
"""

from __future__ import annotations

import math

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class BatchError(ValueError):
    """A batch a piece cannot use: a fault of the data (e.g. rows that an explorer of another algorithm wrote), not of
    the code. The trainer's data source checks what it can before (source.Source.read names the explorers)."""


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x where mask is set. NOTE: uses where(), not x*mask, so inf/NaN in padding cannot leak."""
    m = mask.to(torch.bool)  # [B,T]
    z = torch.where(m, x, torch.zeros_like(x))  # [B,T]
    return z.sum() if dim is None else z.sum(dim)  # [] or [B]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over the valid entries (0 where there are none)."""
    n = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)  # [] or [B]
    return masked_sum(x, mask, dim) / n.clamp(min=1.0)  # [] or [B]


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all valid entries (Bessel-corrected when unbiased and n > 1)."""
    mean = masked_mean(x, mask)  # []
    n = mask.to(x.dtype).sum()  # []
    ss = masked_sum((x - mean) ** 2, mask)  # []
    denom = (n - 1.0) if unbiased else n  # []
    return ss / denom.clamp(min=1.0)  # []


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid entries; padding is set to 0."""
    mean = masked_mean(x, mask)  # []
    w = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)  # [B,T]
    return torch.where(mask.to(torch.bool), w, torch.zeros_like(w))  # [B,T]


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss [B,T] to a scalar, counting only tokens where mask is set.

    token-mean:              sum_{b,t} m*l / sum_{b,t} m
    seq-mean-token-mean:     mean over non-empty sequences b of (sum_t m*l / sum_t m)
    seq-mean-token-sum:      mean over non-empty sequences b of sum_t m*l
    seq-mean-token-sum-norm: mean over non-empty sequences b of (sum_t m*l / T), T = mask.shape[-1]:
                             Dr.GRPO's constant, the maximum response length (the trainer's batches are
                             that wide: batching.step_batch), as TRL's dr_grpo: sum / (B * L_max).
    Deviations: the seq-mean modes average over sequences with at least one valid token (an empty
    sequence is not counted), so an all-padding row neither adds NaN nor dilutes the mean. veRL's and
    Trinity's seq-mean-token-sum-norm is sum_{b,t} m*l / T over a micro-batch, T its padded width, which
    changes with the cut into micro-batches; this mean over sequences does not (and is Dr.GRPO's own).
    """
    m = mask.to(loss.dtype)  # [B,T]
    if mode == "token-mean":
        return masked_mean(loss, mask)  # []
    n_tok = m.sum(-1)  # [B]
    seq = masked_sum(loss, mask, dim=-1)  # [B]
    if mode == "seq-mean-token-mean":
        seq = seq / n_tok.clamp(min=1.0)  # [B]
    elif mode == "seq-mean-token-sum-norm":
        seq = seq / loss.shape[-1]  # [B]
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(AGG_MODES)}")
    valid = n_tok > 0  # [B]
    return masked_mean(seq, valid)  # []


def group_mean(x: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group mean and member count of x [B], groups given by group_index [B] (ids 0..num_groups-1).

    num_groups = max(group_index) + 1 (0 for an empty batch); an id with no member has mean 0 and
    count 0. Index the result with group_index to broadcast back to [B].
    """
    # NOTE: summed in float64. index_add_ adds one member at a time, and in float32 eight rewards of -0.1 sum to a
    # mean 9e-9 off -0.1: a tied group then had a std of ~8e-9 and GRPO advantages of +-0.007 instead of 0. In
    # float64 the sum of a tied group's float32 values is exact, so its deviations are exactly 0.
    gi = group_index.long()  # [B]
    n = int(gi.max().item()) + 1 if gi.numel() else 0
    wide = x.to(torch.float64)  # [B]
    count = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(
        0, gi, torch.ones_like(wide)
    )  # [num_groups]
    total = torch.zeros(n, dtype=torch.float64, device=x.device).index_add_(0, gi, wide)  # [num_groups]
    return (total / count.clamp(min=1.0)).to(x.dtype), count.to(x.dtype)  # [num_groups], [num_groups]


def baseline_advantages(
    r: torch.Tensor, group_index: torch.Tensor, base: torch.Tensor, count: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A = r - base[group] on every valid token (returns = advantages), for group-baseline advantage fns;
    metrics reward_mean and group_baseline (mean baseline over groups with members)."""
    score = r - base[group_index.long()]  # [B]
    adv = score[:, None] * mask.to(torch.float32)  # [B,T]
    present = count > 0  # [num_groups]
    metrics = {
        "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
        "group_baseline": float(base[present].mean().item()) if present.any() else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone()}, metrics


def outside(log_x: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    """Where exp(log_x) lies outside [lower, upper] (bool, same shape), compared in log space so that a long
    sequence's log-ratio sum cannot overflow; lower 0 = no lower bound."""
    low = math.log(lower) if lower > 0 else -math.inf
    return (log_x < low) | (log_x > math.log(upper))
