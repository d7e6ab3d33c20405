"""SFT loss: negative log-likelihood of the response tokens (maximum likelihood; no paper needed,
cf. InstructGPT's SFT stage, arXiv 2203.02155).

Objective:  L = aggregate(-logp[b,t], mask)      (token-mean: the mean NLL per response token)
Same signature as a policy loss so the trainer can swap it in; batch["advantages"] and
batch["old_logprobs"] are unused. Deviation: none (Trinity's SFTLossFn computes the same).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `sft`."""

    loss_agg_mode: str = "token-mean"
    """Ignored: the algorithm-level loss_agg_mode overrides it."""


def compute(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config,
            loss_agg_mode: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar NLL from logprobs [B,T] and batch["response_mask"] [B,T]."""
    loss = aggregate(-logprobs, batch["response_mask"], loss_agg_mode)  # []
    return loss, {"sft_loss": loss.item()}
