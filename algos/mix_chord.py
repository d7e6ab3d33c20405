"""CHORD policy loss: the RL loss on the explorer's rollouts mixed with an SFT loss on expert demonstrations, the SFT
weight mu following a schedule and each expert token weighted by phi(p) = p (1 - p) (Zhang et al., "On-Policy RL
Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and Reinforcement Learning via Dynamic Weighting",
CHORD, arXiv 2508.11408; Trinity-RFT's MIXCHORDPolicyLossFn).

Objective (minimised), at train step s (1 = the first), p = exp(logp):
    L(s)  = (1 - mu(s)) * PPO(logp; m_u) + mu(s) * SFT_phi(logp; m_e)
    SFT_phi = aggregate(-sg(p (1 - p)) * logp, m_e)      (enable_phi_function; else the plain NLL, aggregate(-logp))
    m_u = response_mask * (1 - expert_mask),  m_e = response_mask * expert_mask    (mix.py's split)
    mu(s) = mu_peak * s / W                                          s < W            (linear warm-up)
          = mu_valley + (mu_peak - mu_valley) * (1 + cos(pi (s - W) / D)) / 2    W <= s < W + D  (cosine decay)
          = mu_valley                                                s >= W + D
with W = mu_warmup_steps, D = mu_decay_steps (Trinity's mu_schedule_function, the paper's global weight: SFT
dominates early, RL takes over). PPO is ppo_loss.compute (dual clip, clip-higher) and SFT_phi sft_loss.compute_phi,
each aggregated with loss_agg_mode over its own tokens (mix.mixed). phi down-weights tokens the policy already finds
near-certain or near-impossible, so that the expert data shapes the policy without overriding it (CHORD-phi).
Example: W = 2, D = 4, peak 0.5, valley 0.1: mu(1..7) = 0.25, 0.5, 0.4414, 0.3, 0.1586, 0.1, 0.1.
batch["step"] [B] is the train step (the trainer puts it in every batch); metrics: mix's (usual/<ppo metric>,
expert/sft_phi_loss or expert/sft_loss, mu).

Deviations from Trinity-RFT (as mix.py's): each part is a loss_agg_mode mean over its own tokens in the micro-batch
(train.py weighs micro-batches), so Trinity's per-micro-batch weights and the batch-size args they need
(ppo_mini_batch_size, ppo_micro_batch_size_per_gpu, ngpus_trainer, train_batch_size_usual / _expert, use_dynamic_bsz)
and use_token_level_loss_in_sft are not keys here: a YAML that sets one fails, naming it. The paper's CHORD-phi uses
phi without a cut-off, as here (sft_phi's cutoff_prob is 1).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from algos import mix, sft_loss
from algos.utils import BatchError


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `mix_chord`."""

    mu_warmup_steps: int = 0
    """W: steps of the linear warm-up of mu from 0 to mu_peak."""
    mu_decay_steps: int = 0
    """D: steps of the cosine decay of mu from mu_peak to mu_valley, after the warm-up."""
    mu_peak: float = 0.1
    """mu_peak: the SFT weight at the end of the warm-up."""
    mu_valley: float = 0.1
    """mu_valley: the SFT weight after the decay."""
    enable_phi_function: bool = True
    """Weight each expert token's NLL by phi(p) = p (1 - p) (CHORD-phi); False: the plain NLL (CHORD-mu)."""
    clip_range: float = 0.2
    """eps: PPO symmetric clip width, used for whichever of eps_low / eps_high is None."""
    clip_range_low: float | None = None
    """eps_low: PPO lower clip 1 - eps_low."""
    clip_range_high: float | None = None
    """eps_high: PPO upper clip 1 + eps_high."""
    clip_ratio_c: float = 3.0
    """c: PPO dual-clip bound for A < 0 (> 1)."""


def mu_at(step: int, cfg: Config) -> float:
    """mu(step): linear warm-up to mu_peak over W steps, cosine decay to mu_valley over D steps, then mu_valley."""
    W, D = cfg.mu_warmup_steps, cfg.mu_decay_steps
    if W < 0 or D < 0:
        raise ValueError(f"mu_warmup_steps and mu_decay_steps must be >= 0, got {W}, {D}")
    if step < W:
        return cfg.mu_peak * step / W
    if step >= W + D:
        return cfg.mu_valley
    return cfg.mu_valley + (cfg.mu_peak - cfg.mu_valley) * 0.5 * (1.0 + math.cos(math.pi * (step - W) / D))


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar CHORD loss from logprobs [B,T], batch old_logprobs / advantages / response_mask / expert_mask [B,T]
    and step [B] (the train step, the same in every row)."""
    steps = batch.get("step")  # [B]
    if steps is None or (steps.numel() and bool((steps != steps.flatten()[0]).any())):
        raise BatchError("mix_chord needs batch['step'], the train step, one value for the whole batch")
    mu = mu_at(int(steps.flatten()[0]) if steps.numel() else 0, cfg)
    ppo_cfg = mix.Config(
        mu=mu,
        clip_range=cfg.clip_range,
        clip_range_low=cfg.clip_range_low,
        clip_range_high=cfg.clip_range_high,
        clip_ratio_c=cfg.clip_ratio_c,
    )
    sft = (
        (sft_loss.compute_phi, sft_loss.PhiConfig())
        if cfg.enable_phi_function
        else (sft_loss.compute, sft_loss.Config())
    )
    return mix.mixed(logprobs, batch, ppo_cfg, sft, mu, loss_agg_mode)
