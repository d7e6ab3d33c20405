"""SAPO policy loss: Soft Adaptive Policy Optimization (arXiv 2511.20347).

A smooth, temperature-controlled gate on the token ratio replaces PPO's hard clip. Per response token
(minimised; aggregated with utils.aggregate):
    r   = exp(logp - old_logp)                          (log-ratio clamped to +-20)
    tau = tau_pos if A > 0 else tau_neg
    f   = sigmoid(tau * (r - 1)) * 4 / tau              (the soft gate; f(1) = 2 / tau)
    L   = -A * f(r)                                     (differentiable through r)
Gradient: -A * f'(r) * r * grad logp = -A * 4 sigmoid(.)(1 - sigmoid(.)) * r * grad logp, a weight that is
exactly 1 at r = 1 (on-policy SAPO equals REINFORCE, like PPO) and decays smoothly as r leaves 1 (faster
for the larger tau_neg: negative-advantage tokens are damped harder).
Metrics (Trinity names): pg_loss, avg_soft_gate (masked mean of f), avg_ratio (masked mean of r),
pos_adv_frac (fraction of valid tokens with A > 0).

Deviations:
- Trinity-RFT's SAPOPolicyLossFn minimises L = -A * sg(f(r)) * logp: its gradient weight is the gate
  VALUE f(r), not the paper's f'(r) * r. At r = 1 its gradient is 2 / tau times REINFORCE's (2x for
  A > 0, 1.90x for A < 0), and its weight grows with r up to 4 / tau instead of decaying. Here: the paper.
- The paper averages per sequence (1/G sum_i 1/|y_i| sum_t); here the algorithm-level loss_agg_mode
  (seq-mean-token-mean reproduces the paper; Trinity uses loss_agg_mode, default token-mean).
- Trinity also logs ppo_kl and names the loss sapo_loss; here pg_loss (veRL name).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `sapo`."""

    tau_pos: float = 1.0
    """tau_pos: gate temperature for tokens with A > 0 (> 0)."""
    tau_neg: float = 1.05
    """tau_neg: gate temperature for tokens with A <= 0 (>= tau_pos, as Trinity-RFT requires)."""
    loss_agg_mode: str = "token-mean"
    """Ignored: the algorithm-level loss_agg_mode overrides it (kept so Trinity YAMLs validate)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar SAPO loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    if not 0.0 < cfg.tau_pos <= cfg.tau_neg:
        raise ValueError(f"sapo needs 0 < tau_pos <= tau_neg, got {cfg.tau_pos}, {cfg.tau_neg}")
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    ratio = torch.exp((logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0))  # [B,T]
    tau = torch.where(adv > 0, torch.full_like(ratio, cfg.tau_pos), torch.full_like(ratio, cfg.tau_neg))  # [B,T]
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # [B,T]
    pg_loss = aggregate(-adv * gate, mask, loss_agg_mode)  # []
    with torch.no_grad():
        metrics = {
            "pg_loss": pg_loss.item(),
            "avg_soft_gate": masked_mean(gate, mask).item(),
            "avg_ratio": masked_mean(ratio, mask).item(),
            "pos_adv_frac": masked_mean((adv > 0).float(), mask).item(),
        }
    return pg_loss, metrics
