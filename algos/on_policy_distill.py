"""On-policy distillation advantage: each token of the student's own sample is scored by a teacher, and the per-token
reverse-KL estimate is the signal (Agarwal et al., GKD, arXiv 2306.13649; Thinking Machines' "On-Policy
Distillation" with Tinker, 2025; Trinity-RFT's OnPolicyDistillAdvantage).

Objective: the student pi_S samples y ~ pi_S(.|x) and minimises the reverse KL to the teacher pi_T,
    KL(pi_S || pi_T) = E_{y ~ pi_S} sum_t [log pi_S(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)],
by policy gradient with the negative per-token log-ratio as each token's advantage (no discount, no baseline):
    A[b,t] = kl_coef * (teacher_logprobs[b,t] - old_logprobs[b,t]) * mask[b,t];   returns = advantages
old_logprobs are the student's (the trainer's, before the update: Config.NEEDS), teacher_logprobs the teacher's of
the same tokens (on_policy_distill_workflow writes them: workflows/distill.py). With the ppo (or importance_sampling)
loss at ratio 1 the gradient is -A grad log pi_S: E[that] is the gradient of the per-token reverse KL.
Example: student [-0.5, -1.0], teacher [-0.7, -0.4] -> A = [-0.2, 0.6]: the token the teacher finds likelier
than the student does is pushed up, the other down.
Metrics (Trinity's names, logged as critic/kl/mean ...): kl/mean, kl/std = mean / std over sequences of
sum_t (old - teacher) (the sequence's reverse-KL estimate; std 0 for one sequence).

Deviations from Trinity-RFT: a row without teacher log-probs is a BatchError naming the workflow that writes them
(Trinity fails on the missing key); std is 0, not NaN, for one sequence; no advantages/mean metric (Trinity's: the
mean over sequences of sum_t A), since the trainer logs critic/advantages/mean (the token mean) for every algorithm.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from algos.utils import BatchError, masked_sum


@dataclasses.dataclass
class Config:
    """advantage_fn_args for `on_policy_distill`."""

    NEEDS: ClassVar = ("old_logprobs", "teacher_logprobs")
    kl_coef: float = 1.0
    """c: scales the advantages, A = c (teacher - student) log-probs."""


def teacher_batch(batch: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old_logprobs, teacher_logprobs, response_mask) [B,T] of a distillation batch; BatchError when a row has no
    teacher log-probs (the explorer's workflow did not score it with a teacher)."""
    mask = batch["response_mask"]  # [B,T]
    has = batch.get("has_teacher_logprobs", torch.zeros(mask.shape[0], dtype=torch.bool))  # [B]
    if "teacher_logprobs" not in batch or not bool(has.all()):
        raise BatchError(
            f"advantage_fn {name} needs teacher log-probs on every experience, and {int((~has).sum())} of "
            f"{mask.shape[0]} have none: the explorer's workflow must score its responses with a teacher "
            "(buffer.default_workflow_type: on_policy_distill_workflow, with the teacher in explorer.auxiliary_models)"
        )
    return batch["old_logprobs"], batch["teacher_logprobs"], mask


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Per-token advantages from batch old_logprobs / teacher_logprobs / response_mask [B,T]."""
    old, teacher, mask = teacher_batch(batch, "on_policy_distill")
    gap = teacher - old  # [B,T]
    adv = torch.where(mask.bool(), cfg.kl_coef * gap, torch.zeros_like(gap))  # [B,T] (where: no NaN from padding)
    kl_seq = masked_sum(-gap, mask, dim=-1)  # [B]
    metrics = {
        "kl/mean": kl_seq.mean().item() if kl_seq.numel() else 0.0,
        "kl/std": kl_seq.std().item() if kl_seq.numel() > 1 else 0.0,
    }
    return {"advantages": adv, "returns": adv.clone()}, metrics
