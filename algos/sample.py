"""Sample strategies: what a train step takes from the experience DB (Trinity-RFT's
SAMPLE_STRATEGY).

A strategy is fn(step, cfg) -> a dict the trainer's reader (train.Source) follows; keys it may hold:
    min_version     claim only experiences of this weights version or newer (staler ones are dropped)
    refill_rounds   drop claimed groups whose rewards all tie and claim replacements, up to this many times
    expert          (auxiliary buffer name, fraction of the batch): expert SFT rows added to the batch
Strategies:
    default            {}                       oldest pending first (or the priority queue)
    staleness_control  {"min_version": v_min}   v_min = max(step - 1 - max_staleness, 0)
    dynamic_sampling   {"refill_rounds": n}     DAPO's dynamic sampling (Yu et al., arXiv 2503.14476,
                       §3.2): a group whose rewards all tie has zero GRPO advantage, so it is dropped
                       (claimed by the step, never trained on) and the batch refilled with fresh groups
    mix                {"expert": (sft_dataset_name, expert_data_ratio)}   Trinity-RFT's MIX: expert
                       rows (marked expert; their loss is the mix loss's SFT part) make up
                       expert_data_ratio of the batch

Staleness: train step `step` updates the weights of version step - 1 (the trainer's weights after
step - 1 optimizer steps), so an experience of version v is (step - 1 - v) versions stale. Pending
experiences staler than max_staleness are dropped (marked in the DB, counted, never trained on), as
Trinity's queue does; the trainer logs sample/model_version/{min,mean,max} and batch/staleness/*.

Deviations from Trinity-RFT:
- staleness_control states the bound on the logged staleness itself (Trinity: model_version >=
  step - max_staleness with its own step counting): max_staleness 0 means strictly on-policy (only
  the newest weights), 1 allows one-step-off-policy pipelining (sync_offset 1).
- mix: the batch is train_batch_size RL experiences (one explorer step's worth) PLUS
  round(train_batch_size * r / (1 - r)) expert rows, so experts are the fraction r of the whole
  batch; Trinity takes both out of train_batch_size, which leaves the explorer's output unconsumed
  in synchronous runs.
- dynamic_sampling refills only from what the explorers have already written, without waiting (it
  cannot ask the explorer for more rollouts, as DAPO's generation loop does): with a synchronous
  explorer (sync_offset 0) nothing is there, and the tied groups are dropped, leaving a smaller batch;
  with an explorer ahead (sync_offset >= 1, or asynchronous) they are replaced. Tied groups left after
  refill_rounds stay in the batch with zero advantage, as does a batch in which every group tied.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Config:
    """sample_strategy_args."""

    max_staleness: int = 4
    """staleness_control: the most versions an experience may lag the weights being trained (>= 0)."""
    refill_rounds: int = 4
    """dynamic_sampling: how many times tied groups are dropped and replaced in one step."""
    expert_data_ratio: float = 0.5
    """mix: r, the fraction of each batch that is expert SFT rows (0 <= r < 1)."""
    sft_dataset_name: str = "sft_dataset"
    """mix: the buffer.trainer_input.auxiliary_buffers entry that holds the expert data."""


def default(step: int, cfg: Config) -> dict[str, Any]:
    return {}


def staleness_control(step: int, cfg: Config) -> dict[str, Any]:
    if cfg.max_staleness < 0:
        raise ValueError(f"algorithm.sample_strategy_args.max_staleness must be >= 0, got {cfg.max_staleness}")
    return {"min_version": max(step - 1 - cfg.max_staleness, 0)}


def dynamic_sampling(step: int, cfg: Config) -> dict[str, Any]:
    return {"refill_rounds": max(cfg.refill_rounds, 0)}


def mix(step: int, cfg: Config) -> dict[str, Any]:
    if not 0 <= cfg.expert_data_ratio < 1:
        raise ValueError(
            f"algorithm.sample_strategy_args.expert_data_ratio must be in [0, 1), got {cfg.expert_data_ratio}"
        )
    return {"expert": (cfg.sft_dataset_name, cfg.expert_data_ratio)}


def tied_groups(groups: list[str], rewards: list[float]) -> set[str]:
    """dynamic_sampling: the groups (of more than one experience) whose rewards all tie."""
    by_group: dict[str, list[float]] = {}
    for g, r in zip(groups, rewards):
        by_group.setdefault(g, []).append(r)
    return {g for g, r in by_group.items() if len(r) > 1 and max(r) == min(r)}
