"""JSD advantage for on-policy distillation: a per-token generalised Jensen-Shannon divergence between the student and
a teacher on the student's sampled tokens (the generalised JSD_beta of Agarwal et al., GKD, arXiv 2306.13649;
Trinity-RFT's JSDAdvantage, which follows ms-swift's GKD).

Generalised JSD (M = beta pi_T + (1 - beta) pi_S, per position):
    JSD_beta(pi_S, pi_T) = beta KL(pi_T || M) + (1 - beta) KL(pi_S || M)
On a sampled token, with s = old_logprobs[b,t] / tau and t = teacher_logprobs[b,t] / tau (tau = temperature, the
teacher's log-probs from on_policy_distill_workflow), beta = lambda_coef, c = kl_coef:
    log m = logsumexp(log(1 - beta) + s, log(beta) + t)      (the mixture's probability of the token)
estimator "trinity" (Trinity-RFT's):  A[b,t] = -c * j[b,t] * mask[b,t], returns = advantages, with
    j = beta (t - log m) + (1 - beta) (s - log m)      0 < beta < 1
      = s - t                                          beta = 0 (Trinity: KL(student || teacher))
      = t - s                                          beta = 1 (Trinity: KL(teacher || student))
estimator "gradient" (the default): the per-token signal whose policy gradient E_{y~pi_S}[A grad log pi_S(y)] is -c
times the gradient of the divergence at that position (checked by enumerating a vocabulary in
tests/test_algos_advantage.py), A[b,t] = c * g[b,t] * mask[b,t], returns = advantages, with g:
    A = c (1 - beta) (log m - s)     0 < beta < 1   (d JSD_beta / d pi_S(y) = (1 - beta) log(pi_S(y) / M(y)))
      = c (t - s)                    beta = 0       (reverse KL(pi_S || pi_T): on_policy_distill's signal)
      = c exp(t - s)                 beta = 1       (forward KL(pi_T || pi_S): the importance weight pi_T / pi_S,
                                                     log-ratio clamped to +-20)
NOTE: "trinity"'s j is a plug-in of the divergence on one token, not a gradient estimator: its beta (t - log m) term
has no such role (KL(pi_T || M) is an expectation under the teacher), and its expected update differs from
-grad JSD_beta, in some directions with the opposite sign (the enumeration test shows it); for 0 < beta < 1, j <= 0 on
every token (the mean of two logs is at most the log of their mean), so A >= 0 grows with the student's and teacher's
disagreement either way, and at beta = 1 its A = s - t raises the reverse KL. Measured on the embedded task
(docs/LOG.md, 2026-11-26): in 12 steps "trinity" moved an untrained student AWAY from an SFT-trained teacher (per-token
reverse KL 3.8 -> 6.2 nats), "gradient" towards it (3.8 -> 0.12). Hence "gradient" is the default here; "trinity"
reproduces Trinity-RFT's numbers.
Example (beta 0.5, c 1, tau 1): s = log 0.2, t = log 0.6 -> log m = log 0.4, j = 0.5 log 1.5 + 0.5 log 0.5 =
-0.14384, A = 0.14384 ("trinity"); A = 0.5 log 2 = 0.34657 ("gradient").
Metrics (Trinity's names, logged as critic/jsd/mean ...): jsd/mean, jsd/std = mean / std over sequences of
sum_t j (std 0 for one sequence).

Deviations from Trinity-RFT: the "gradient" estimator, and its being the default, are this file's (estimator: trinity
gives Trinity's advantages exactly); Trinity's chunk_size (a memory option of its
loop over tokens) is not a key here (the computation is elementwise on [B,T]): a YAML that sets it fails, naming it;
no advantages/mean metric (the trainer logs critic/advantages/mean); a row without teacher log-probs is a BatchError.
As Trinity's, temperature divides the log-probs of the sampled tokens (not the logits: the result is not a
re-tempered distribution's log-prob).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

import torch

from algos.on_policy_distill import teacher_batch
from algos.utils import masked_sum


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `jsd`."""

    NEEDS: ClassVar = ("old_logprobs", "teacher_logprobs")
    lambda_coef: float = 0.5
    """beta: the mixture M = beta pi_T + (1 - beta) pi_S; 0 and 1 are the two KLs (see the module docstring)."""
    kl_coef: float = 1.0
    """c: scales the advantages."""
    temperature: float = 1.0
    """tau: both log-probs are divided by it first (Trinity's; 1.0 = none)."""
    estimator: Literal["trinity", "gradient"] = "gradient"
    """"gradient": the policy-gradient signal of JSD_beta (descends it); "trinity": A = -c * (per-token JSD), Trinity's
    plug-in (see the NOTE in the module docstring)."""


def divergence(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """Trinity's per-token j [B,T] of student / teacher log-probs s, t [B,T] (module docstring)."""
    if beta == 0.0:
        return s - t  # [B,T]
    if beta == 1.0:
        return t - s  # [B,T]
    log_m = torch.logaddexp(s + math.log(1.0 - beta), t + math.log(beta))  # [B,T]
    return beta * (t - log_m) + (1.0 - beta) * (s - log_m)  # [B,T]


def gradient_signal(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-token advantage (before c) whose policy gradient descends D_beta, s, t [B,T] (module docstring)."""
    if beta == 0.0:
        return t - s  # [B,T]
    if beta == 1.0:
        return (t - s).clamp(-20.0, 20.0).exp()  # [B,T]
    log_m = torch.logaddexp(s + math.log(1.0 - beta), t + math.log(beta))  # [B,T]
    return (1.0 - beta) * (log_m - s)  # [B,T]


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-token advantages from batch old_logprobs / teacher_logprobs / response_mask [B,T]."""
    if not 0.0 <= cfg.lambda_coef <= 1.0 or cfg.temperature <= 0:
        raise ValueError(f"lambda_coef must be in [0, 1] and temperature > 0, got {cfg.lambda_coef}, {cfg.temperature}")
    if cfg.estimator not in ("trinity", "gradient"):
        raise ValueError(f"estimator must be 'trinity' or 'gradient', got {cfg.estimator!r}")
    old, teacher, mask = teacher_batch(batch, "jsd")
    valid = mask.bool()  # [B,T]
    s = torch.where(valid, old, torch.zeros_like(old)) / cfg.temperature  # [B,T] (padding: 0, never NaN)
    t = torch.where(valid, teacher, torch.zeros_like(teacher)) / cfg.temperature  # [B,T]
    j = divergence(s, t, cfg.lambda_coef)  # [B,T]
    signal = -j if cfg.estimator == "trinity" else gradient_signal(s, t, cfg.lambda_coef)  # [B,T]
    adv = torch.where(valid, cfg.kl_coef * signal, torch.zeros_like(signal))  # [B,T]
    j_seq = masked_sum(j, mask, dim=-1)  # [B]
    metrics = {
        "jsd/mean": j_seq.mean().item() if j_seq.numel() else 0.0,
        "jsd/std": j_seq.std().item() if j_seq.numel() > 1 else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone()}, metrics
