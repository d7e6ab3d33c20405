"""OPMD (online / off-policy mirror descent): group-baseline advantage `advantage` and policy loss `loss`.

Papers: Kimi k1.5 (arXiv 2501.12599) derives the OPMD objective from KL-regularised policy mirror
descent; Trinity-RFT (arXiv 2505.17826) ships it as the `opmd` algorithm, and its authors' analysis
of group-relative REINFORCE as an off-policy method is arXiv 2509.24203.

Advantage objective (one scalar reward r_i per response i in group g of size n):
    A_i = r_i - b_g
    b_g = mean_g(r)                                          # opmd_baseline = "mean"
    b_g = tau * (logsumexp_{j in g}(r_j / tau) - log n)       # "logavgexp": tau * log mean exp(r / tau)
    advantages[i, t] = A_i * mask[i, t];   returns = advantages
The logavgexp baseline is Kimi k1.5's tau * log E[exp(r / tau)] (the optimal KL-regularised value):
it lies between mean_g (tau -> inf) and max_g (tau -> 0).
Example: rewards [1, 0], tau 1 -> b = log((e + 1) / 2) = 0.6201, A = [0.3799, -0.6201].
Singleton group (n = 1): b = 0, A = r (Trinity; logavgexp would give b = r, A = 0).

Loss (Trinity-RFT's OPMDPolicyLossFn), per response token, minimised:
    L = aggregate(-A * logp, mask) / (1 + tau)
A REINFORCE step on the group-baseline advantage, scaled by 1 / (1 + tau) (Trinity's comment: "for
regularization (w.r.t. current pi_theta)"); tau = 1 halves the REINFORCE gradient. Metric opmd_loss.
Deviation: Trinity averages with token-mean always; here the algorithm-level loss_agg_mode (default
token-mean). old_logprobs are unused, as in Trinity.

Deviations from Trinity-RFT's OPMDGroupAdvantage:
- Works on a padded batch (rewards [B] + group_index) instead of a list of Experience objects.
- Metrics: reward_mean over the batch and group_baseline = mean of b_g over the groups (Trinity
  logs per-group values; its singleton path references an undefined variable in the metrics).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from algos.utils import aggregate, baseline_advantages, group_mean


@dataclasses.dataclass
class AdvantageConfig:
    """advantage_fn_args for `opmd`."""

    opmd_baseline: Literal["mean", "logavgexp"] = "mean"
    """b_g: "mean" = mean_g(r); "logavgexp" = tau * log mean_g exp(r / tau)."""
    tau: float = 1.0
    """tau: temperature of the logavgexp baseline (> 0); unused by "mean"."""


def advantage(batch: dict[str, torch.Tensor], cfg: AdvantageConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A = r - b_g from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    mean, count = group_mean(r, gi)  # [num_groups], [num_groups]
    if cfg.opmd_baseline == "mean":
        base = mean  # [num_groups]
    elif cfg.opmd_baseline == "logavgexp":
        x = r / cfg.tau  # [B]
        # stable per-group logsumexp: subtract the group max before exp
        mx = torch.full_like(mean, -torch.inf).scatter_reduce(0, gi, x, "amax")  # [num_groups]
        mx = torch.where(count > 0, mx, torch.zeros_like(mx))  # [num_groups] empty id -> 0, not -inf
        s = torch.zeros_like(mean).index_add_(0, gi, torch.exp(x - mx[gi]))  # [num_groups]
        lse = mx + torch.log(s.clamp(min=1e-30))  # [num_groups]
        base = cfg.tau * (lse - torch.log(count.clamp(min=1.0)))  # [num_groups]
    else:
        raise ValueError(f"opmd_baseline must be 'mean' or 'logavgexp', got {cfg.opmd_baseline!r}")
    base = torch.where(count > 1, base, torch.zeros_like(base))  # [num_groups] singleton (or empty): b = 0
    return baseline_advantages(r, gi, base, count, batch["response_mask"])


@dataclasses.dataclass
class LossConfig:
    """policy_loss_fn_args for `opmd`."""

    tau: float = 1.0
    """tau: mirror-descent regularisation; the loss is divided by 1 + tau (> -1)."""


def loss(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: LossConfig, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """aggregate(-A * logp) / (1 + tau) from logprobs [B,T] and batch advantages / response_mask [B,T]."""
    pg = aggregate(-batch["advantages"] * logprobs, batch["response_mask"], loss_agg_mode)  # []
    opmd_loss = pg / (1.0 + cfg.tau)  # []
    return opmd_loss, {"opmd_loss": opmd_loss.item()}
