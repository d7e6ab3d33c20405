"""DPO loss: Direct Preference Optimization (Rafailov et al., arXiv 2305.18290), with label smoothing =
conservative DPO (cDPO, Mitchell 2023; `label_smoothing` in TRL / Trinity-RFT).

Batch layout: rows are interleaved pairs, row 2i = chosen response y_w and row 2i+1 = rejected response
y_l of pair i (B even). Per pair i (log-probs summed over the response tokens, mask applied):
    c_i = sum_t logp(y_w),  c_ref_i = sum_t ref_logp(y_w);   r_i, r_ref_i likewise for y_l
    h_i = beta * ((c_i - c_ref_i) - (r_i - r_ref_i))
    L_i = -(1 - ls) * log sigmoid(h_i) - ls * log sigmoid(-h_i)
    loss = mean_i L_i
Metrics (Trinity names): dpo_loss; chosen_reward = mean_i beta * (c_i - c_ref_i); rejected_reward
likewise; accuracy_mean = fraction of pairs with chosen reward > rejected reward; reward_margin = mean_i
of their difference (= mean_i h_i).

Deviations:
- Trinity-RFT's DPOLossFn calls masked_sum without a dim, so it sums the log-probs over the whole
  micro-batch first: with P pairs it computes ONE h from all chosen minus all rejected tokens, i.e.
  -log sigmoid(sum_i h_i), not the paper's mean_i -log sigmoid(h_i). The two agree when P = 1.
- The loss is always the mean over pairs (the paper's expectation): loss_agg_mode is accepted and
  ignored. batch["advantages"] / ["old_logprobs"] are unused; batch["ref_logprobs"] is required.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F

from algos.utils import masked_sum


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `dpo`."""

    NEEDS: ClassVar[tuple[str, ...]] = ("ref_logprobs",)  # the trainer builds the reference model
    AGG: ClassVar[str] = "seq-mean-token-mean"  # a mean over pairs: the trainer weighs micro-batches by sequences

    beta: float = 0.1
    """beta: strength of the implicit KL constraint (scale of the implicit reward beta * log pi / pi_ref)."""
    label_smoothing: float = 0.0
    """ls: assumed probability that a preference label is flipped (cDPO); 0 gives the original DPO."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar DPO loss from logprobs [B,T] and batch ref_logprobs / response_mask [B,T], rows (chosen, rejected)."""
    if logprobs.shape[0] == 0 or logprobs.shape[0] % 2:
        raise ValueError(f"dpo needs interleaved (chosen, rejected) rows: an even B > 0, got B = {logprobs.shape[0]}")
    mask = batch["response_mask"]  # [B,T]
    seq = masked_sum(logprobs, mask, dim=-1)  # [B]
    seq_ref = masked_sum(batch["ref_logprobs"], mask, dim=-1)  # [B]
    chosen = seq[0::2] - seq_ref[0::2]  # [P] log pi/pi_ref of y_w, P = B/2 pairs
    rejected = seq[1::2] - seq_ref[1::2]  # [P]
    h = cfg.beta * (chosen - rejected)  # [P]
    losses = -(1.0 - cfg.label_smoothing) * F.logsigmoid(h) - cfg.label_smoothing * F.logsigmoid(-h)  # [P]
    loss = losses.mean()  # []
    with torch.no_grad():
        metrics = {
            "dpo_loss": loss.item(),
            "chosen_reward": (cfg.beta * chosen).mean().item(),
            "rejected_reward": (cfg.beta * rejected).mean().item(),
            "accuracy_mean": (chosen > rejected).float().mean().item(),
            "reward_margin": h.mean().item(),
        }
    return loss, metrics
