"""Rollout correction: truncated importance sampling (TIS) between the rollout engine's log-probs and
the trainer's, and the metrics of their mismatch (veRL's "rollout correction"; Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"; Espeholt et al. 2018, IMPALA's
truncated importance weights, arXiv:1802.01561).

The responses were sampled by the rollout weights pi_rollout (an older version, or the same weights
in another engine with other kernels), while the loss treats them as samples of pi_old (the
trainer's weights before this step). Per response token t of sequence i, with
    log r_t = old_logprobs_t - rollout_logprobs_t                     (log pi_old / pi_rollout)
the importance weight is
    token:    w_t = min(r_t, C)
    sequence: w_t = min(prod_t' r_t', C)       (the same for every token of the sequence)
with C = rollout_is_threshold. The weight is a constant (no gradient) multiplying each token's
policy-gradient term; the trainer applies it by scaling the advantages, which for the PPO clip loss
min(r A, clip(r) A) equals scaling the loss (w > 0), as veRL does.

Mismatch metrics (over response tokens that have rollout log-probs), logged whether or not the
correction is on:
    rollout_corr/kl         mean(rollout_logprobs - old_logprobs)   k1 estimate of KL(pi_rollout || pi_old)
    rollout_corr/k3_kl      mean(r - 1 - log r)                     k3 estimate (>= 0, low variance)
    rollout_corr/abs_diff   mean |log r|
    rollout_corr/ratio_mean mean r
With the correction on, also rollout_corr/rollout_is_mean (mean weight) and rollout_corr/
rollout_is_clip_frac (share of weights cut at C).

Rejection / masking (rollout_rs_mask): rollout_correction.rollout_rs names a mask of ROLLOUT_RS_FNS (one algos/ file
each: rollout_rs.py, veRL's token and sequence modes; geometric_rs.py, veRL's geometric mode; icepop.py, IcePop's
token band; trl_is_mask.py, TRL's token_mask and sequence_mask), with the band [rollout_rs_threshold_lower,
rollout_rs_threshold] (unset: the file's defaults). keep [B,T] (0/1) multiplies the advantages with the IS weight:
w_t * keep_t. Masked IS (TRL's *_mask, IcePop's M(k)) is a mask together with rollout_is at a threshold >= the
band's upper bound. Metrics: rollout_corr/rollout_rs_masked_frac (valid tokens dropped) and
rollout_corr/rollout_rs_seq_masked_frac (sequences with a dropped token).

The log-probs compared are of the same distribution on both sides: the engines' (vLLM's processed log-probs, the HF
engine's) and the trainer's both mask the EOS ids where min_tokens masked them (batching.eos_masked); top-k / top-p
and a repetition penalty remain unmatched on vLLM (configs/checks.py refuses the correction with them).

Deviation: a dropped token's advantage is zeroed (it stays in the loss's token count and in the KL / entropy
terms); veRL drops it from response_mask.
Shapes: B sequences, T response tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from algos import ROLLOUT_RS_FNS
from algos.utils import masked_mean


def rollout_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights [B,T], metrics). level: "none" (weights 1), "token" or "sequence"; mask [B,T] marks the
    response tokens that have rollout log-probs (elsewhere the weight is 1)."""
    if level not in ("none", "token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is: unknown {level!r}; known: none, token, sequence")
    mask = mask.bool()  # [B,T]
    log_r = torch.where(mask, old_logprobs.detach() - rollout_logprobs, 0.0)  # [B,T]
    ratio = log_r.exp()  # [B,T]
    metrics = {
        "rollout_corr/kl": masked_mean(-log_r, mask).item(),
        "rollout_corr/k3_kl": masked_mean(ratio - 1 - log_r, mask).item(),
        "rollout_corr/abs_diff": masked_mean(log_r.abs(), mask).item(),
        "rollout_corr/ratio_mean": masked_mean(ratio, mask).item(),
    }
    if level == "none":
        return torch.ones_like(log_r), metrics
    cap = math.log(threshold)
    if level == "token":
        log_w = log_r.clamp(max=cap)  # [B,T]
        clipped = (log_r > cap) & mask  # [B,T]
        weights, counted = log_w.exp(), mask
    else:  # NOTE: clamp the summed log-ratio before exp: a long sequence's product overflows float32
        seq = log_r.sum(-1, keepdim=True)  # [B,1]
        weights = seq.clamp(max=cap).exp().expand_as(log_r)  # [B,T]
        counted = mask.any(-1, keepdim=True)  # [B,1] sequences with rollout log-probs
        clipped = (seq > cap) & counted  # [B,1]
    weights = torch.where(mask, weights, 1.0)  # [B,T]
    metrics["rollout_corr/rollout_is_mean"] = masked_mean(weights, mask).item()
    metrics["rollout_corr/rollout_is_clip_frac"] = (clipped.sum() / counted.sum().clamp(min=1)).item()
    return weights.detach(), metrics


def rs_config(name: str, upper: float | None, lower: float | None) -> object:
    """The Config of mask `name` (ROLLOUT_RS_FNS) with the band's bounds that are set (the file's defaults else)."""
    fn, cls = ROLLOUT_RS_FNS[name]
    given = {k: v for k, v in (("upper", upper), ("lower", lower)) if v is not None}
    return dataclasses.replace(cls(), **given)


def rollout_rs_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    name: str,
    upper: float | None = None,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(keep [B,T] float 0/1, metrics): mask `name` of ROLLOUT_RS_FNS ("none": all kept, no metrics) on the ratios
    pi_old / pi_rollout of the valid tokens `mask` [B,T] (elsewhere kept), band [lower, upper] (None: the mask's
    default)."""
    if name == "none":
        return torch.ones_like(old_logprobs), {}
    if name not in ROLLOUT_RS_FNS:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs: unknown {name!r}; known: none, {', '.join(ROLLOUT_RS_FNS)}"
        )
    mask = mask.bool()  # [B,T]
    log_r = torch.where(mask, old_logprobs.detach() - rollout_logprobs, 0.0)  # [B,T]
    keep = ROLLOUT_RS_FNS[name][0](log_r, mask, rs_config(name, upper, lower)) | ~mask  # [B,T]
    dropped = ~keep & mask  # [B,T]
    seqs = mask.any(-1)  # [B] sequences with valid tokens
    metrics = {
        "rollout_corr/rollout_rs_masked_frac": (dropped.sum() / mask.sum().clamp(min=1)).item(),
        "rollout_corr/rollout_rs_seq_masked_frac": (dropped.any(-1).sum() / seqs.sum().clamp(min=1)).item(),
    }
    return keep.to(old_logprobs.dtype), metrics
