"""SFT loss: negative log-likelihood of the response tokens (maximum likelihood; no paper needed,
cf. InstructGPT's SFT stage, arXiv 2203.02155).

Objective:  L = aggregate(-logp[b,t], mask)      (token-mean: the mean NLL per response token)
Same signature as a policy loss so the trainer can swap it in; batch["advantages"] and
batch["old_logprobs"] are unused. Deviation: none (Trinity's SFTLossFn computes the same).

Token-weighted variants (Trinity-RFT's SFTISLossFn / SFTPhiLossFn, studied in CHORD, arXiv 2508.11408),
p = exp(logp):
    sft_is:   L = aggregate(-sg(p) * logp, mask)                 (its gradient is that of -p)
    sft_phi:  L = aggregate(-sg(p * (1 - p)) * min(logp, log c), mask)
phi(p) = p(1 - p) down-weights tokens the policy finds near-certain or near-impossible. cutoff_prob c < 1
clamps logp at log c, as Trinity's code does: a token with p > c contributes the constant -phi(p) log c,
so NO gradient (our reading: stop pushing tokens that are already likely); c = 1 disables it.
Deviations: Trinity's use_token_level_loss (token-mean vs per-sequence mean) is replaced by
loss_agg_mode; metrics are Trinity's sft_is_loss / sft_phi_loss.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from algos.utils import aggregate


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `sft`."""

    loss_agg_mode: str = "token-mean"
    """Ignored: the algorithm-level loss_agg_mode overrides it."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar NLL from logprobs [B,T] and batch["response_mask"] [B,T]."""
    loss = aggregate(-logprobs, batch["response_mask"], loss_agg_mode)  # []
    return loss, {"sft_loss": loss.item()}


@dataclasses.dataclass
class PhiConfig:
    """policy_loss_fn_args for `sft_phi` (`sft_is` takes Config)."""

    cutoff_prob: float = 1.0
    """c: tokens with p > c get no gradient (logp clamped at log c); 1.0 disables it. In (0, 1]."""


def compute_is(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """sft_is: NLL weighted by sg(p), from logprobs [B,T] and batch["response_mask"] [B,T]."""
    loss = aggregate(-logprobs.detach().exp() * logprobs, batch["response_mask"], loss_agg_mode)  # []
    return loss, {"sft_is_loss": loss.item()}


def compute_phi(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: PhiConfig, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """sft_phi: NLL weighted by sg(p (1 - p)), logp clamped at log(cutoff_prob); logprobs [B,T]."""
    if not 0.0 < cfg.cutoff_prob <= 1.0:
        raise ValueError(f"cutoff_prob must be in (0, 1], got {cfg.cutoff_prob}")
    p = logprobs.detach().exp()  # [B,T]
    logp = logprobs.clamp(max=math.log(cfg.cutoff_prob)) if cfg.cutoff_prob < 1.0 else logprobs  # [B,T]
    loss = aggregate(-p * (1.0 - p) * logp, batch["response_mask"], loss_agg_mode)  # []
    return loss, {"sft_phi_loss": loss.item()}
