"""CISPO policy loss: clipped IS-weight policy optimisation (MiniMax-M1, arXiv 2506.13585).

Objective, per response token (minimised; aggregated with utils.aggregate):
    r   = exp(logp - old_logp)                                  (log-ratio clamped to +-20)
    w   = sg(clip(r, 1 - eps_low, 1 + eps_high))                (the clipped IS weight, no gradient)
    M   = 0 if (A > 0 and r > 1 + m_high) or (A < 0 and r < 1 - m_low), else 1    (enable_mask_clip only)
    L   = -A * w * M * logp
Unlike PPO no token loses its gradient to clipping (without the mask): every token's gradient is
-A * w * grad logp. eps_low = 1.0 (no lower bound, r >= 0), eps_high = 0.28: the paper only tunes the
upper bound. M is the token mask of the paper's unified formulation, off by default (plain CISPO: M = 1);
its band (m_low, m_high) has its own knobs, as in Trinity-RFT.
Metrics: pg_loss, pg_clipfrac (fraction of valid tokens whose weight was clipped, r outside the band),
ppo_kl (masked mean of old_logp - logp).

Deviations:
- The paper normalises by the total token count (token-mean); here the algorithm-level loss_agg_mode is
  used (token-mean by default, so the defaults agree), as Trinity-RFT's CISPOPolicyLossFn does.
- Trinity's metrics are cispo_loss / masked_frac; here pg_loss / pg_clipfrac (veRL names, as ppo_loss).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `cispo`."""

    clip_range_low: float = 1.0
    """eps_low: the IS weight is clipped below at 1 - eps_low (1.0: no lower bound)."""
    clip_range_high: float = 0.28
    """eps_high: the IS weight is clipped above at 1 + eps_high."""
    enable_mask_clip: bool = False
    """M: zero tokens with A > 0 and r > 1 + m_high, or A < 0 and r < 1 - m_low (the paper's unified formulation)."""
    mask_clip_range_low: float = 1.0
    """m_low: lower edge 1 - m_low of the mask band (1.0: never masks a negative-advantage token)."""
    mask_clip_range_high: float = 0.28
    """m_high: upper edge 1 + m_high of the mask band."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar CISPO loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    lo, hi = 1.0 - cfg.clip_range_low, 1.0 + cfg.clip_range_high
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0).detach()  # [B,T]
    ratio = torch.exp(log_ratio)  # [B,T]
    weight = ratio.clamp(lo, hi)  # [B,T] no grad
    if cfg.enable_mask_clip:
        m_lo, m_hi = 1.0 - cfg.mask_clip_range_low, 1.0 + cfg.mask_clip_range_high
        outside = ((adv > 0) & (ratio > m_hi)) | ((adv < 0) & (ratio < m_lo))  # [B,T]
        weight = torch.where(outside, torch.zeros_like(weight), weight)  # [B,T]
    loss = -adv * weight * logprobs  # [B,T]
    pg_loss = aggregate(loss, mask, loss_agg_mode)  # []
    clipfrac = masked_mean(((ratio < lo) | (ratio > hi)).float(), mask)  # []
    ppo_kl = masked_mean(-log_ratio, mask)  # []
    return pg_loss, {"pg_loss": pg_loss.item(), "pg_clipfrac": clipfrac.item(), "ppo_kl": ppo_kl.item()}
