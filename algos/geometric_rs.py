"""Geometric-mean sequence rejection (veRL's rollout_rs "geometric" mode, veRL docs "Rollout Correction"; the
length-normalised sequence ratio of GSPO, Zheng et al. 2025, arXiv:2507.18071, used as a filter): a sequence is
dropped when the geometric mean of its token ratios leaves a narrow band around 1.

With log r_t = old_logprobs_t - rollout_logprobs_t over the n_b valid tokens of sequence b:
    g_b      = exp( (1 / n_b) sum_t log r_t )                     (geometric mean ratio)
    keep_b,t = [lower <= g_b <= upper]
Unlike the product (rollout_rs: sequence) g_b does not drift with the length, so one band suits short and long
responses; it must be narrow: a mean log-ratio of 0.01 per token is already a product of e^10 over 1,000 tokens.
Defaults: upper 1.01, lower 1 / 1.01 (ours: veRL leaves them to the user and its examples use values this close
to 1). The trainer multiplies each token's advantage by keep (algos/correction.py, rollout_rs_mask).

Deviation: as rollout_rs.py, a dropped sequence's advantages are zeroed rather than its response_mask.
Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import masked_mean, outside


@dataclasses.dataclass
class Config:
    """The band of kept geometric-mean ratios (rollout_rs_threshold_lower, rollout_rs_threshold)."""

    lower: float = 1 / 1.01
    """lower: sequences whose geometric-mean ratio is below are dropped."""
    upper: float = 1.01
    """upper: sequences whose geometric-mean ratio is above are dropped."""


def mask(log_r: torch.Tensor, mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """keep [B,T] bool: every token of the sequences whose geometric-mean ratio over the valid tokens is inside
    [lower, upper] (a sequence without valid tokens: mean 0, kept)."""
    mean = masked_mean(log_r, mask, dim=-1)[:, None]  # [B,1] mean log-ratio
    return ~outside(mean, cfg.lower, cfg.upper).expand_as(log_r)  # [B,T]
