"""Sample strategies: what a train step takes from the experience DB (Trinity-RFT's
SAMPLE_STRATEGY).

A strategy is fn(step, cfg) -> a dict the trainer's reader (train.Source) and the explorer follow; keys it may hold:
    min_version          claim only experiences of this weights version or newer (staler ones are dropped)
    max_num_gen_batches  the explorer: run more tasks until a step has batch_size groups whose rewards do not all
                         tie, running at most this many batches of tasks per step (explore.py's dynamic_sampling)
    refill_rounds        the trainer: drop claimed groups whose rewards all tie and claim replacements, up to this
                         many times
    expert               (auxiliary buffer name, fraction of the batch): expert SFT rows added to the batch
Strategies:
    default            {}                       oldest pending first (or the priority queue)
    staleness_control  {"min_version": v_min}   v_min = max(step - 1 - max_staleness, 0)
    dynamic_sampling   {"max_num_gen_batches": m, "refill_rounds": n}   DAPO's dynamic sampling (Yu et al.,
                       arXiv 2503.14476, §3.2, Algorithm 1): a group whose rewards all tie has zero GRPO advantage
                       and only dilutes the batch, so the explorer over-samples: it drops such groups and runs
                       more tasks until the step holds batch_size groups with reward variance (veRL's
                       filter_groups loop, its max_num_gen_batches cap); the trainer drops any tied group it still
                       claims and refills from what is written
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
- dynamic_sampling, explorer side: an extra batch of tasks is only as large as the groups still missing (veRL
  generates whole gen_batch_size batches and discards the surplus); tasks are read from the taskset in its order,
  so an epoch ends in fewer steps. At the cap (max_num_gen_batches batches run) veRL stops the run; here the step is
  filled up with tied groups (a warning, rollout/dynamic_sampling/cap_hit), so that every step still writes
  batch_size groups and a synchronous trainer is never left waiting. Groups of one experience never tie.
- dynamic_sampling, trainer side: it refills from what the explorers have already written, without waiting;
  synchronously (sync_offset 0) nothing is there, so the tied groups of a capped step are dropped, leaving a
  smaller batch; with an explorer ahead (sync_offset >= 1, or asynchronous) they are replaced. Tied groups left
  after refill_rounds stay in the batch with zero advantage, as does a batch in which every group tied.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Config:
    """sample_strategy_args."""

    max_staleness: int = 4
    """staleness_control: the most versions an experience may lag the weights being trained (>= 0)."""
    max_num_gen_batches: int = 10
    """dynamic_sampling, the explorer: the most batches of tasks one explore step runs, the first included, to find
    buffer.batch_size groups whose rewards do not all tie (veRL's algorithm.filter_groups.max_num_gen_batches, but
    >= 1: unbounded over-sampling could run forever once every task is solved); 1 = no over-sampling."""
    refill_rounds: int = 4
    """dynamic_sampling, the trainer: how many times tied groups it claims are dropped and replaced in one step."""
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
    return {"max_num_gen_batches": cfg.max_num_gen_batches, "refill_rounds": max(cfg.refill_rounds, 0)}


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
