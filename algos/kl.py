"""KL between the policy and the reference model: per-token estimators, the KL loss and the KL
reward penalty. Estimators from Schulman, "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html); the KL-regularised RL objective as in InstructGPT
(arXiv 2203.02155) and GRPO (arXiv 2402.03300, which uses k3).

Per token, with d = logp - ref_logp (samples drawn from the policy):
    k1 = d                     unbiased, high variance, can be negative
    k2 = d^2 / 2               biased, low variance
    k3 = exp(-d) - 1 + d       unbiased, >= 0, low variance  (= exp(D) - 1 - D, D = ref - logp)
    low_var_kl = k3 with D clamped to +-20 and the result clamped to [-10, 10] (veRL)
    abs = |d|;   none = 0
KL loss   (kl_loss_fn):    L = beta * aggregate(k(logp, ref), mask)                metric kl_loss
KL penalty (kl_penalty_fn): token_level_rewards = scores - beta * k(old_logp, ref) * mask   metric kl
Adaptive beta (Ziegler et al., arXiv 1909.08593, §2.2; veRL's AdaptiveKLController), after each step:
    e = clip(KL_measured / target_kl - 1, -0.2, 0.2);   beta <- beta * (1 + e * n / horizon)
with n the step's batch size (experiences). The trainer keeps beta in its checkpoint.
Deviations from Trinity-RFT: no corrected_k3 (it needs old log-probs inside the estimator). The
estimator kind is passed as an argument (the registry name), not stored in Config.
"""

from __future__ import annotations

import dataclasses

import torch

from algos.utils import aggregate, masked_mean

KINDS = ("none", "k1", "k2", "k3", "low_var_kl", "abs")


@dataclasses.dataclass
class Config:
    """kl_loss_fn_args / kl_penalty_fn_args for every KL kind."""

    kl_coef: float = 0.001
    """beta: weight of the KL term (loss) or of the per-token KL subtracted from the reward (penalty); the start value
    when adaptive."""
    adaptive: bool = False
    """Adapt beta after every step towards target_kl (adaptive KL controller)."""
    target_kl: float = 0.1
    """KL_target: the per-sequence KL (penalty) or aggregated KL (loss) the controller steers to."""
    horizon: int = 10000
    """H: experiences over which beta may change by at most 20 %."""


def estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B,T] of KL(policy || reference) from logprobs [B,T], ref_logprobs [B,T]."""
    d = logprobs - ref_logprobs  # [B,T]
    if kind == "none":
        return torch.zeros_like(d)  # [B,T]
    if kind == "k1":
        return d  # [B,T]
    if kind == "k2":
        return 0.5 * d.square()  # [B,T]
    if kind == "abs":
        return d.abs()  # [B,T]
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d  # [B,T]
    if kind == "low_var_kl":
        dd = (-d).clamp(-20.0, 20.0)  # [B,T] D = ref - logp, clamped
        return (torch.exp(dd) - 1.0 - dd).clamp(-10.0, 10.0)  # [B,T]
    raise ValueError(f"unknown KL kind {kind!r}; known: {', '.join(KINDS)}")


def loss(
    logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config, loss_agg_mode: str, kind: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """kl_coef * aggregate(KL(logprobs [B,T], batch["ref_logprobs"] [B,T]))."""
    kl = estimate(logprobs, batch["ref_logprobs"], kind)  # [B,T]
    agg = aggregate(kl, batch["response_mask"], loss_agg_mode)  # []
    return cfg.kl_coef * agg, {"kl_loss": agg.item(), "kl_coef": cfg.kl_coef}  # []


def penalty(batch: dict[str, torch.Tensor], cfg: Config, kind: str) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards [B,T] = scores - kl_coef * KL(old_logprobs, ref_logprobs) on valid tokens.

    scores: batch["token_level_scores"] [B,T] if given, else batch["rewards"] [B] placed on the last
    valid response token (veRL's convention). The KL uses batch["old_logprobs"] (the actor's
    recomputed log-probs, as veRL/Trinity), falling back to batch["logprobs"]; no gradient flows.
    """
    mask = batch["response_mask"].to(torch.float32)  # [B,T]
    logp = batch["old_logprobs"] if "old_logprobs" in batch else batch["logprobs"]  # [B,T]
    kl = estimate(logp.detach(), batch["ref_logprobs"].detach(), kind) * mask  # [B,T]
    if "token_level_scores" in batch:
        scores = batch["token_level_scores"].to(torch.float32)  # [B,T]
    else:
        scores = place_scores(batch["rewards"], mask)  # [B,T]
    rewards = scores - cfg.kl_coef * kl  # [B,T]
    seq_kl = masked_mean(kl, mask, dim=-1)  # [B]
    return rewards, {"kl": seq_kl.mean().item() if seq_kl.numel() else 0.0, "kl_coef": cfg.kl_coef}


def place_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level scores [B,T]: each scalar reward [B] on its sequence's last valid token (veRL)."""
    m = mask.to(torch.float32)  # [B,T]
    pos = torch.arange(m.shape[-1], dtype=torch.float32, device=m.device)  # [T]
    last = (m * (pos + 1.0)).argmax(-1)  # [B] index of the last valid token
    onehot = torch.nn.functional.one_hot(last, m.shape[-1]).to(torch.float32) * m  # [B,T]
    return rewards.to(torch.float32)[:, None] * onehot  # [B,T]


def adapt(coef: float, measured_kl: float, n: int, cfg: Config) -> float:
    """The next beta of the adaptive controller (see the module docstring); n = experiences in the step."""
    if cfg.target_kl <= 0 or cfg.horizon <= 0:
        raise ValueError("adaptive KL needs target_kl > 0 and horizon > 0")
    error = min(max(measured_kl / cfg.target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n / cfg.horizon)
