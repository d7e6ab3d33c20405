"""sPPO policy loss: a REINFORCE step on the log-ratio, restricted to a ratio trust band.

Source: Trinity-RFT's sPPOPolicyLossFn ("sPPO-token"; its docstring points to arXiv 2108.05828). Not the
Self-Play Preference Optimization of arXiv 2405.00675, which is a different algorithm.
Per response token (minimised; aggregated with utils.aggregate):
    r   = exp(logp - old_logp)                                   (no gradient through r)
    L   = -A * (logp - old_logp) * 1[1 / (1 + eps) <= r <= 1 + eps]
Inside the band the gradient is REINFORCE's -A * grad logp (old_logp is a constant); outside it is 0.
The band is symmetric in log space: |log r| <= log(1 + eps). Metrics: pg_loss, pg_clipfrac (fraction of
valid tokens outside the band).

Deviations from Trinity-RFT: Trinity averages with token-mean always; here the algorithm-level
loss_agg_mode (default token-mean). The log-ratio is clamped to +-20 before r is taken (as ppo_loss;
it changes no in-band token).
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class Config:
    """policy_loss_fn_args for `sppo`."""

    epsilon: float = 0.3
    """eps: tokens count only while 1 / (1 + eps) <= r <= 1 + eps (> 0)."""


def compute(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar sPPO loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0)  # [B,T]
    ratio = torch.exp(log_ratio.detach())  # [B,T]
    in_band = (ratio >= 1.0 / (1.0 + cfg.epsilon)) & (ratio <= 1.0 + cfg.epsilon)  # [B,T]
    loss = torch.where(in_band, -adv * log_ratio, torch.zeros_like(log_ratio))  # [B,T]
    pg_loss = aggregate(loss, mask, loss_agg_mode)  # []
    clipfrac = masked_mean((~in_band).float(), mask)  # []
    return pg_loss, {"pg_loss": pg_loss.item(), "pg_clipfrac": clipfrac.item()}
