"""REC: the group-relative REINFORCE family of Trinity-RFT's authors ("Group-relative REINFORCE is secretly
an off-policy algorithm", arXiv 2509.24203): its advantage `advantage` and its policy loss `loss`.

Advantage (one scalar reward r_i per response i in group g):
    A_i = r_i - mean_g(r)                    (std_normalize: divided by the population std_g(r) + epsilon)
    drop = "balance": a group with more below-mean (r_i < mean_g) than at/above-mean members drops the
    surplus, chosen at random: those rows get A = 0; mean_g and std_g are then taken over the kept rows.
    Example: rewards [1, 0, 0, 0], mean 0.25: 1 positive, 3 negative -> 2 negatives dropped; kept [1, 0]
    -> mean 0.5 -> A = [0.5, -0.5, 0, 0] (the two zeros at random among rows 1-3).
Loss, per response token (minimised; aggregated with utils.aggregate), r = sg(exp(logp - old_logp)),
the log-ratio clamped to +-20 (as ppo_loss; also inside k2):
    A' = A (weight none) | A * r (importance_sampling) | A * exp(A / temp) (advantage)
    L  = -A' * logp * 1[r in range] + regulariser
    range: none: all | two-side: 1 - eps_low <= r <= 1 + eps_high
           one-side: (A >= 0 and r <= 1 + eps_high) or (A <= 0 and r >= 1 - eps_low)
           ring: two-side, or (A >= 0 and r <= 1 - eps'_low) or (A <= 0 and r >= 1 + eps'_high)
    regulariser: none | k2: coef * (logp - old_logp)^2 | forward-kl: -coef * logp  (on every valid token)
Metrics: pg_loss, pg_clipfrac (fraction of valid tokens out of range); advantage: filtered_count (rows
dropped), drop_balance (their fraction of the batch), reward_mean, reward_std (over the batch).

Deviations from Trinity-RFT (RECGroupedAdvantage, RECPolicyLossFn):
- Left out: clip_mode "gspo-one-side" and weight "gspo_importance_sampling" (sequence-ratio variants,
  marked experimental in Trinity).
- The loss uses the algorithm-level loss_agg_mode; Trinity always uses token-mean (the default here).
- drop = "balance" draws from a torch.Generator seeded with `seed`, so every rank drops the same rows
  and a run is reproducible (Trinity: the global torch RNG). The same seed and group layout give the
  same draw every step; which responses sit in those slots is itself random.
- A singleton group gets A = r (mean 0, std 1), Trinity's intent (its code errors on that path).
- Dropped rows stay in the batch with A = 0 (as Trinity), no `keep` is returned, so they still count in
  the token-mean denominator. Metrics are batch-level (Trinity: per group).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from algos.utils import aggregate, masked_mean


@dataclasses.dataclass
class AdvantageConfig:
    """advantage_fn_args for `rec`."""

    epsilon: float = 1e-6
    """epsilon: added to std_g before dividing (std_normalize only)."""
    std_normalize: bool = False
    """Divide A by the population std_g(r) + epsilon of the (kept) group rewards."""
    drop: Literal["balance"] | None = None
    """"balance": randomly zero the surplus below-mean rows of a group so #below <= #at-or-above mean."""
    seed: int = 42
    """Seed of the generator that picks the rows drop = "balance" removes."""


def advantage(batch: dict[str, torch.Tensor], cfg: AdvantageConfig) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """REC advantages from batch["rewards"] [B], ["group_index"] [B], ["response_mask"] [B,T]."""
    if cfg.drop not in (None, "balance"):
        raise ValueError(f"rec drop must be None or 'balance', got {cfg.drop!r}")
    r = batch["rewards"].to(torch.float32)  # [B]
    gi = batch["group_index"].long()  # [B]
    gen = torch.Generator().manual_seed(cfg.seed)
    score = torch.zeros_like(r)  # [B]
    kept = torch.ones_like(r, dtype=torch.bool)  # [B]
    for g in torch.unique(gi).tolist():  # sorted group ids: a fixed draw order
        idx = (gi == g).nonzero(as_tuple=True)[0]  # [G]
        rg = r[idx]  # [G]
        if len(idx) > 1 and cfg.drop == "balance":
            neg = (rg < rg.mean()).nonzero(as_tuple=True)[0]  # [G_neg]
            extra = len(neg) - (len(idx) - len(neg))
            if extra > 0:
                kept[idx[neg[torch.randperm(len(neg), generator=gen)[:extra]]]] = False  # [B] `extra` random negatives
        sel = rg[kept[idx]]  # [G_kept]
        if len(sel) <= 1:  # singleton group: baseline 0, std 1
            mean, std = rg.new_zeros(()), rg.new_ones(())  # [], []
        else:  # NOTE: in float64, so that a tied group's mean is exact and its advantages are 0
            mean, std = sel.double().mean().float(), sel.double().std(unbiased=False).float()  # [], []
        s = rg - mean  # [G]
        s = s / (std + cfg.epsilon) if cfg.std_normalize else s  # [G]
        score[idx] = torch.where(kept[idx], s, torch.zeros_like(s))  # [G]
    adv = score[:, None] * batch["response_mask"].to(score.dtype)  # [B,T]
    n_drop = float((~kept).sum().item())
    metrics = {
        "filtered_count": n_drop,
        "drop_balance": n_drop / max(len(r), 1),
        "reward_mean": float(r.mean().item()) if r.numel() else 0.0,
        "reward_std": float(r.std().item()) if r.numel() > 1 else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone()}, metrics


@dataclasses.dataclass
class LossConfig:
    """policy_loss_fn_args for `rec`."""

    epsilon_low: float = 0.2
    """eps_low: lower edge 1 - eps_low of the ratio range (0 < eps_low <= 1)."""
    epsilon_high: float = 0.2
    """eps_high: upper edge 1 + eps_high of the ratio range (> 0)."""
    epsilon_low_prime: float = 0.6
    """eps'_low: ring mode also keeps A >= 0 tokens with r <= 1 - eps'_low (far below)."""
    epsilon_high_prime: float = 2.0
    """eps'_high: ring mode also keeps A <= 0 tokens with r >= 1 + eps'_high (far above)."""
    clip_mode: Literal["none", "one-side", "two-side", "ring"] = "none"
    """Which tokens count: all, a sign-aware one-side band, the two-side band, or the band plus a ring."""
    weight: Literal["none", "importance_sampling", "advantage"] = "none"
    """A' = A, A * r, or A * exp(A / temp)."""
    regularizer: Literal["none", "k2", "forward-kl"] = "none"
    """Extra per-token term: coef * (logp - old_logp)^2 (k2, Kimi's 1/2 folded into coef) or -coef * logp."""
    regularizer_coef: float = 0.0
    """coef: weight of the regulariser (>= 0)."""
    temp: float = 1.0
    """temp: temperature of the advantage weight exp(A / temp) (> 0)."""


def loss(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: LossConfig, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar REC loss from logprobs [B,T] and batch old_logprobs / advantages / response_mask [B,T]."""
    adv = batch["advantages"]  # [B,T]
    mask = batch["response_mask"]  # [B,T]
    log_ratio = (logprobs - batch["old_logprobs"]).clamp(-20.0, 20.0)  # [B,T]
    ratio = torch.exp(log_ratio.detach())  # [B,T]
    band = (ratio >= 1.0 - cfg.epsilon_low) & (ratio <= 1.0 + cfg.epsilon_high)  # [B,T]
    pos, neg = adv >= 0, adv <= 0  # [B,T], [B,T] (A = 0 is both)
    if cfg.clip_mode == "none":
        in_range = torch.ones_like(band)  # [B,T]
    elif cfg.clip_mode == "two-side":
        in_range = band  # [B,T]
    elif cfg.clip_mode == "one-side":
        in_range = (pos & (ratio <= 1.0 + cfg.epsilon_high)) | (neg & (ratio >= 1.0 - cfg.epsilon_low))  # [B,T]
    elif cfg.clip_mode == "ring":
        in_range = (
            band | (pos & (ratio <= 1.0 - cfg.epsilon_low_prime)) | (neg & (ratio >= 1.0 + cfg.epsilon_high_prime))
        )  # [B,T]
    else:
        raise ValueError(f"unknown rec clip_mode {cfg.clip_mode!r}")
    weights = {
        "none": adv,
        "importance_sampling": adv * ratio,
        "advantage": adv * torch.exp(adv / cfg.temp),
    }  # A' [B,T]
    if cfg.weight not in weights:
        raise ValueError(f"unknown rec weight {cfg.weight!r}")
    per_token = torch.where(in_range, -weights[cfg.weight] * logprobs, torch.zeros_like(logprobs))  # [B,T]
    if cfg.regularizer == "k2":
        per_token = per_token + cfg.regularizer_coef * log_ratio.square()  # [B,T]
    elif cfg.regularizer == "forward-kl":
        per_token = per_token - cfg.regularizer_coef * logprobs  # [B,T]
    elif cfg.regularizer != "none":
        raise ValueError(f"unknown rec regularizer {cfg.regularizer!r}")
    pg_loss = aggregate(per_token, mask, loss_agg_mode)  # []
    clipfrac = masked_mean((~in_range).float(), mask)  # []
    return pg_loss, {"pg_loss": pg_loss.item(), "pg_clipfrac": clipfrac.item()}
