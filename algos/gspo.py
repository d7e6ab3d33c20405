"""GSPO-token policy loss (Zheng et al., Group Sequence Policy Optimization, arXiv 2507.18071).

Objective, per response token t of sequence b (minimised):
    s_b   = masked mean over t of (logp - old_logp)              (log of the length-normalised sequence ratio)
    r_b,t = exp(sg[s_b] + logp_b,t - sg[logp_b,t])               (VALUE = the sequence ratio exp(s_b) on every
                                                                  token; GRADIENT = exp(s_b) * grad logp_b,t)
    L_b,t = max(-A_b,t * r_b,t, -A_b,t * clip(r_b,t, 1 - eps_low, 1 + eps_high))
    loss  = seq-mean-token-mean of L (the paper's 1/G sum_b 1/|y_b| sum_t)
With a per-sequence advantage GSPO-token equals GSPO (the sequence-level objective) in value and gradient;
per-token advantages are what the "-token" variant adds. Token log-ratios are clamped to +-20 (as ppo_loss).
Metrics (Trinity names): pg_loss, pg_clipfrac (fraction of valid tokens where the clipped term is larger),
ppo_kl (masked token mean of old_logp - logp), ppo_kl_seq (mean over non-empty sequences of -s_b).

Deviations:
- Aggregation is always seq-mean-token-mean, as in the paper and Trinity-RFT's GSPOLossFn default; the
  loss_agg_mode argument is accepted and ignored. NOTE: Trinity's config validator overwrites the loss's
  loss_agg_mode with algorithm.loss_agg_mode (default token-mean), so a stock Trinity run actually uses
  token-mean. Set algorithm.loss_agg_mode: seq-mean-token-mean so train.py weighs micro-batches by
  sequences (it weighs them by tokens under token-mean).
- ppo_kl_seq averages over non-empty sequences (Trinity: over all rows, an empty row counting 0).
- The token gradient term logp - sg[logp] is zeroed on masked tokens so a -inf padding log-prob cannot
  put NaN into the gradient (no effect on valid tokens).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `gspo`."""

    AGG: ClassVar[str] = "seq-mean-token-mean"  # fixed aggregation: the trainer weighs micro-batches by sequences

    clip_range: float | None = None
    """eps: symmetric clip width, used for whichever of eps_low / eps_high is None."""
    clip_range_low: float | None = 3e-4
    """eps_low: the sequence ratio is clipped below at 1 - eps_low (paper: 3e-4)."""
    clip_range_high: float | None = 4e-4
    """eps_high: the sequence ratio is clipped above at 1 + eps_high (paper: 4e-4)."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """Ignored: GSPO always aggregates with seq-mean-token-mean (kept so Trinity YAMLs validate)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar GSPO-token loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    eps_low = cfg.clip_range if cfg.clip_range_low is None else cfg.clip_range_low
    eps_high = cfg.clip_range if cfg.clip_range_high is None else cfg.clip_range_high
    if eps_low is None or eps_high is None:
        raise ValueError("gspo: set clip_range, or both clip_range_low and clip_range_high")
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    valid = mask.to(torch.bool)  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0)  # [B,T]
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # [B] s_b
    token_grad = torch.where(valid, logprobs - logprobs.detach(), torch.zeros_like(logprobs))  # [B,T] value 0
    ratio = torch.exp(seq_log_ratio.detach()[:, None] + token_grad)  # [B,T] value exp(s_b)
    loss_unclipped = -adv * ratio  # [B,T]
    loss_clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # [B,T]
    loss = torch.maximum(loss_unclipped, loss_clipped)  # [B,T]
    pg_loss = aggregate(loss, mask, "seq-mean-token-mean")  # []
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)  # []
        ppo_kl = masked_mean(-log_ratio, mask)  # []
        ppo_kl_seq = masked_mean(-seq_log_ratio, valid.any(-1))  # []
    metrics = {
        "pg_loss": pg_loss.item(),
        "pg_clipfrac": clipfrac.item(),
        "ppo_kl": ppo_kl.item(),
        "ppo_kl_seq": ppo_kl_seq.item(),
    }
    return pg_loss, metrics
