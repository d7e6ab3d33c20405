"""Step-wise GRPO advantage for multi-turn episodes kept as one experience per turn (Trinity-RFT's
`step_wise_grpo`, the advantage of its `multi_step_grpo` preset; GRPO: Shao et al., arXiv 2402.03300).

Objective: a task's group holds G episodes (runs); episode e has steps (turns) s = 1..S_e, each an experience.
    R_e = the episode's reward (every step of it carries it: workflows/tool_use.py with step_wise)
    A_e = (R_e - mean_g(R)) / (std_g(R) + epsilon)         # GRPO over episodes, NOT over steps
    A_e = A_e / S_e                                         # enable_step_norm
    advantages[b, t] = A_{e(b)} * mask[b, t]                # every step of episode e; returns = advantages
So an episode of 5 turns weighs no more in the group's statistics than one of 1 turn. The other options are
grpo.py's (std_threshold, norm_adv_by_std_in_grpo, std_cal_level), applied to the episodes.

Where it runs: compute() in the explorer, over each task's whole group before it is written (as Trinity's
multi_step_grpo computes its advantages in the explorer): one explore step writes a turn per experience, more than a
train step claims, so a group's turns may land in two train steps, and normalising each part alone would be wrong.
The trainer's side, from_explorer(), reads them back (batch["stored_advantages"]) and recomputes nothing; so the
trainer's reward shaping (KL penalty in the reward, overlong shaping) cannot reach them (configs refuse the two).

Deviations from Trinity-RFT: R_e is the mean of its steps' rewards (equal to the last step's, which Trinity
reads, when the steps carry the episode's reward); episodes are batch["episode_index"] [B] (numbered from each
experience's group and its info["episode"]), not experience-id strings.
"""

from __future__ import annotations

import dataclasses

import torch

from algos import grpo
from algos.utils import BatchError, group_mean


@dataclasses.dataclass
class Config(grpo.Config):
    """advantage_fn_args for `step_wise_grpo`: grpo's, and enable_step_norm."""

    enable_step_norm: bool = False
    """Divide each episode's advantage by its number of steps S_e."""


def compute(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Advantages from batch["rewards"] [B], ["group_index"] [B], ["episode_index"] [B], ["response_mask"] [B,T]."""
    r = batch["rewards"].to(torch.float32)  # [B]
    ei = batch["episode_index"].long()  # [B] episodes numbered 0..E-1
    reward, steps = group_mean(r, ei)  # [E], [E]
    group = torch.zeros_like(reward, dtype=torch.long).index_copy_(0, ei, batch["group_index"].long())  # [E]
    episodes = {"rewards": reward, "group_index": group, "response_mask": torch.ones(len(reward), 1)}
    out, metrics = grpo.compute(episodes, cfg)  # GRPO over the E episodes
    score = out["advantages"][:, 0]  # [E]
    if cfg.enable_step_norm:
        score = score / steps.clamp(min=1.0)  # [E]
    adv = score[ei][:, None] * batch["response_mask"].to(score.dtype)  # [B,T]
    metrics |= {"experience_count": float(len(r)), "episode_count": float(len(reward))}
    return {"advantages": adv, "returns": adv.clone(), "keep": out["keep"][ei]}, metrics


def from_explorer(batch: dict[str, torch.Tensor], cfg: Config) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The trainer's side: the advantages compute() gave each experience in the explorer, batch["stored_advantages"]
    [B,T] where batch["has_stored_advantages"] [B]; BatchError if a row has none (an explorer whose config has
    another advantage_fn wrote it: the trainer's source.Source.read refuses such a batch first, naming the explorer)."""
    has = batch["has_stored_advantages"]  # [B]
    if not has.all():
        raise BatchError(
            f"step_wise_grpo: {int((~has).sum())} of {len(has)} experiences carry no advantages; they are "
            "computed in the explorer (batching.group_advantages), by an explorer whose "
            "algorithm.advantage_fn is step_wise_grpo too"
        )
    adv = batch["stored_advantages"] * batch["response_mask"].to(torch.float32)  # [B,T]
    metrics = {"experience_count": float(len(has)), "episode_count": float(len(batch["episode_index"].unique()))}
    return {"advantages": adv, "returns": adv.clone()}, metrics
