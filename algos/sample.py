"""Sample strategies: which experiences a train step may take from the experience DB
(Trinity-RFT's SAMPLE_STRATEGY, ../shared/reference/trinity-inventory.md §4.6).

A strategy is fn(step, cfg) -> the filter the trainer passes to `ExperienceDB.claim`:
    default            {}                       oldest pending first (or the priority queue)
    staleness_control  {"min_version": v_min}   v_min = max(step - 1 - max_staleness, 0)

Staleness: train step `step` updates the weights of version step - 1 (the trainer's weights after
step - 1 optimizer steps), so an experience of version v is (step - 1 - v) versions stale. Pending
experiences staler than max_staleness are dropped (marked in the DB, counted, never trained on), as
Trinity's queue does; the trainer logs sample/model_version/{min,mean,max} and batch/staleness/*.

Deviation: Trinity states the bound as model_version >= step - max_staleness with its own step
counting; here the bound is on the logged staleness itself, so max_staleness 0 means strictly
on-policy (only the newest weights) and 1 allows one-step-off-policy pipelining (sync_offset 1).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Config:
    max_staleness: int = 4
    """staleness_control: the most versions an experience may lag the weights being trained (>= 0)."""


def default(step: int, cfg: Config) -> dict[str, int]:
    return {}


def staleness_control(step: int, cfg: Config) -> dict[str, int]:
    if cfg.max_staleness < 0:
        raise ValueError(f"algorithm.sample_strategy_args.max_staleness must be >= 0, got {cfg.max_staleness}")
    return {"min_version": max(step - 1 - cfg.max_staleness, 0)}
