"""MIX policy loss: PPO on the explorer's rollouts plus SFT on expert demonstrations in one batch
(Trinity-RFT's `mix` algorithm; the CHORD paper, arXiv 2508.11408, studies this mixing with mu).

Objective (minimised):
    m_u  = response_mask * (1 - expert_mask)               (tokens of usual RL rows)
    m_e  = response_mask * expert_mask                     (tokens of expert SFT rows)
    L    = (1 - mu) * PPO(logp; m_u) + mu * SFT(logp; m_e)
PPO is ppo_loss.compute (dual-clip, clip-higher) and SFT is sft_loss.compute (mean NLL), each aggregated
with loss_agg_mode over ITS OWN tokens (an empty part contributes 0). batch["expert_mask"] [B,T] is 1.0 on
every token of an expert row and 0 on RL rows. Metrics: usual/<ppo metric> (pg_loss, pg_clipfrac, ppo_kl,
pg_clipfrac_lower), expert/sft_loss, mu; always all keys (0 for an empty part).

Deviations from Trinity-RFT's MIXPolicyLossFn:
- Trinity multiplies each part by n_rows_in_micro_batch * w, w = gradient_accumulation /
  train_batch_size_{usual,expert} (or ppo_mini_batch_size / (B_micro * train_batch_size_...) with dynamic
  batch size), so that summing over micro-batches gives the mean over each kind's rows of the whole
  step; the user must set those batch sizes in policy_loss_fn_args. Here each part is the loss_agg_mode
  mean over its tokens in this micro-batch, and train.py weighs micro-batches; those args are not taken.
- Trinity's SFT part defaults to a per-sequence mean (use_token_level_loss_in_sft = False); here it
  uses loss_agg_mode like the PPO part.
- Trinity omits a part's metrics when the micro-batch has none of its rows, scales the metrics by the
  same weights, and also logs `loss`; here the keys are fixed, the values unscaled, no `loss`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from algos import ppo_loss, sft_loss


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `mix`."""

    mu: float = 0.1
    """mu: weight of the expert SFT loss; the PPO loss gets 1 - mu."""
    clip_range: float = 0.2
    """eps: PPO symmetric clip width, used for whichever of eps_low / eps_high is None."""
    clip_range_low: float | None = None
    """eps_low: PPO lower clip 1 - eps_low."""
    clip_range_high: float | None = None
    """eps_high: PPO upper clip 1 + eps_high."""
    clip_ratio_c: float = 3.0
    """c: PPO dual-clip bound for A < 0 (> 1)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar MIX loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask / expert_mask [B,T]."""
    return mixed(logprobs, batch, cfg, (sft_loss.compute, sft_loss.Config()), cfg.mu, loss_agg_mode)


def mixed(
    logprobs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: Config,
    sft: tuple[Callable, Any],
    mu: float,
    loss_agg_mode: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(1 - mu) PPO(usual rows' tokens) + mu SFT(expert rows' tokens), `sft` = (an sft_loss function, its Config):
    the MIX objective (mix_chord's too, with its mu and sft_phi)."""
    mask = batch["response_mask"].to(logprobs.dtype)  # [B,T]
    expert = batch["expert_mask"].to(logprobs.dtype)  # [B,T]
    ppo_cfg = ppo_loss.Config(
        clip_range=cfg.clip_range,
        clip_range_low=cfg.clip_range_low,
        clip_range_high=cfg.clip_range_high,
        clip_ratio_c=cfg.clip_ratio_c,
    )
    usual, um = ppo_loss.compute(
        logprobs, {**batch, "response_mask": mask * (1.0 - expert)}, ppo_cfg, loss_agg_mode
    )  # []
    sft_fn, sft_cfg = sft
    sft_value, sm = sft_fn(logprobs, {"response_mask": mask * expert}, sft_cfg, loss_agg_mode)  # []
    loss = (1.0 - mu) * usual + mu * sft_value  # []
    metrics = {f"usual/{k}": v for k, v in um.items()} | {f"expert/{k}": v for k, v in sm.items()} | {"mu": mu}
    return loss, metrics
