"""veRL's rollout rejection sampling, token and sequence modes (veRL docs, "Rollout Correction":
algorithm.rollout_correction.rollout_rs; Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL
Collapse from the Training-Inference Mismatch", and Yao et al. 2025, "Your efficient RL framework secretly brings
you off-policy RL training"): instead of (or besides) re-weighting, drop what the rollout engine sampled too
differently from the trainer's policy.

With log r_t = old_logprobs_t - rollout_logprobs_t (log pi_old / pi_rollout) on response token t of sequence b:
    token:    keep_b,t = [lower <= r_t <= upper]
    sequence: keep_b,t = [lower <= prod_t' r_t' <= upper]        (the whole sequence kept or dropped)
lower = rollout_rs_threshold_lower (default 0.5 = 1 / upper, veRL's default), upper = rollout_rs_threshold (2.0).
The trainer multiplies each token's advantage by keep (and by the rollout_is weight, if on): a dropped token has no
policy-gradient term (algos/correction.py, rollout_rs_mask).

Deviation: veRL removes a dropped token from response_mask (out of the loss's token count, and out of the KL and
entropy terms); here its advantage is zeroed: it stays in the aggregation's denominator and in the KL / entropy
terms (the micro-batches' shares of the mini-batch are fixed before the old log-probs of a one-update step exist).
Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import outside


@dataclasses.dataclass
class Config:
    """The band of kept ratios (rollout_rs_threshold_lower, rollout_rs_threshold)."""

    lower: float = 0.5
    """lower: ratios below are dropped (0 = no lower bound)."""
    upper: float = 2.0
    """upper: ratios above are dropped."""


def token(log_r: torch.Tensor, mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """keep [B,T] bool: the valid tokens (mask) whose own ratio is inside [lower, upper], and every invalid one."""
    return ~(outside(log_r, cfg.lower, cfg.upper) & mask.bool())  # [B,T]


def sequence(log_r: torch.Tensor, mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """keep [B,T] bool: every token of the sequences whose product of ratios over the valid tokens is inside
    [lower, upper] (log_r summed where mask is set)."""
    seq = torch.where(mask.bool(), log_r, 0.0).sum(-1, keepdim=True)  # [B,1]
    return ~outside(seq, cfg.lower, cfg.upper).expand_as(log_r)  # [B,T]
