"""The experience pipeline's built-in operators (Trinity-RFT's buffer/operators): filters and mappers over one batch
of an explore step's scored experiences (buffer.Experience), before they are written. Each is the one interface of
pipelines/__init__.py: `process(exps) -> (kept, metrics)`; the pipeline (pipelines/experience.py) counts kept and
dropped, an operator returns only its own numbers (logged as pipeline/<op>/<key>).

A group is one task's experiences (the same group_id: the runner stamps it, explore.stamp). The pipeline runs on
whole groups (every experience of a task that ran is in the same batch), so a group statistic sees the whole group.

Deviations from Trinity-RFT:
- reward_shaping_mapper also reads exp.metrics[stats_key] when exp.info lacks it (a nanorft addition: the reward
  components nanorft's reward functions return, e.g. `accuracy`, `format`, live in exp.metrics); a stat found in
  neither is counted (`missing`) and warned once, where Trinity skips it silently; a bad op_type or a config without
  stats_key is a ConfigError at start, where Trinity fails (KeyError) on the first experience or skips it.
- Trinity's filters return `filtered_count`; here the pipeline counts pipeline/<op>/dropped for every operator.
- pass_rate_calculator writes each group's pass rate into exp.info["pass_rate"] (Trinity hands it to its task
  scheduler as a metric keyed by task); its metrics are over the groups.
"""

from __future__ import annotations

import logging
import math
import statistics
from typing import Any

from buffer import Experience
from errors import ConfigError, DataError

log = logging.getLogger("nanorft.pipelines")

OP_TYPES = ("ADD", "SUB", "MUL", "DIV")


def groups_of(exps: list[Experience]) -> dict[str, list[Experience]]:
    """The experiences by group_id (a task's group), in order of first appearance."""
    out: dict[str, list[Experience]] = {}
    for x in exps:
        out.setdefault(x.group_id, []).append(x)
    return out


def spread(values: list[float], key: str) -> dict[str, float]:
    """<key>/mean|min|max of `values` (none when empty: a metric of nothing is left out, not 0)."""
    if not values:
        return {}
    return {f"{key}/mean": statistics.fmean(values), f"{key}/min": min(values), f"{key}/max": max(values)}


class RewardFilter:
    """Keep the experiences whose reward >= threshold (Trinity's reward_filter)."""

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = float(threshold)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        return [x for x in exps if x.reward is not None and x.reward >= self.threshold], {}


class RewardStdFilter:
    """Drop the groups whose reward standard deviation (population std, numpy's default ddof 0) is <= threshold:
    at threshold 0 the groups whose rewards all tie, whose GRPO advantages are all zero (Trinity's reward_std_filter).
    NOTE: as Trinity's, a group of ONE experience is dropped (its std is 0 <= any threshold >= 0): it has no
    baseline to learn from. (DAPO's dynamic sampling, explore.varied, keeps a group of one instead.)"""

    def __init__(self, threshold: float = 0.0) -> None:
        self.threshold = float(threshold)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        kept: list[Experience] = []
        dropped = 0
        for group in groups_of(exps).values():
            if len(group) > 1 and statistics.pstdev([x.reward for x in group]) > self.threshold:
                kept += group
            else:
                dropped += 1
        return kept, {"dropped_groups": dropped, "kept_groups": len(groups_of(kept))}


class InvalidRewardFilter:
    """Drop the experiences whose reward is None, NaN or +-inf (Trinity's invalid_reward_filter drops None and NaN).
    NOTE: a workflow's reward that is not a finite number already drops its task before the pipeline (explore.py:
    a `reward` drop); what this catches is a reward an earlier operator made invalid (a shaping stat that is NaN)."""

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        return [x for x in exps if isinstance(x.reward, (int, float)) and math.isfinite(x.reward)], {}


class RewardShapingMapper:
    """reward <op>= weight * stat, for each of reward_shaping_configs in order (Trinity's reward_shaping_mapper):
    `{stats_key, op_type: ADD | SUB | MUL | DIV (default ADD), weight (default 1.0)}`. The stat is
    exp.info[stats_key], else exp.metrics[stats_key] (nanorft: the reward components). DIV by a zero divisor leaves
    the reward as it is (as Trinity) and is counted (`div_by_zero`); a stat in neither place is counted (`missing`)
    and warned once. Metrics: reward_diff/mean|min|max (shaped - original reward), missing, div_by_zero."""

    def __init__(self, reward_shaping_configs: list[dict] | None = None, context: Any = None) -> None:
        where = f"{getattr(context, 'where', 'reward_shaping_mapper')}.args.reward_shaping_configs"
        self.configs = [self._checked(c, f"{where}[{i}]") for i, c in enumerate(reward_shaping_configs or [])]
        self.warned: set[str] = set()

    @staticmethod
    def _checked(c: Any, where: str) -> tuple[str, str, float]:
        """(stats_key, op_type, weight) of one config entry, or a ConfigError naming what is wrong."""
        if not isinstance(c, dict) or not c.get("stats_key") or not isinstance(c["stats_key"], str):
            raise ConfigError(f"{where}: needs stats_key (the stat's key in the experience's info or metrics): {c!r}")
        if extra := set(c) - {"stats_key", "op_type", "weight"}:
            raise ConfigError(f"{where}: unknown key(s) {sorted(extra)}; the keys are stats_key, op_type, weight")
        op = str(c.get("op_type", "ADD")).upper()
        if op not in OP_TYPES:
            raise ConfigError(f"{where}: op_type {c.get('op_type')!r} is not one of {', '.join(OP_TYPES)}")
        try:
            weight = float(c.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: weight {c.get('weight')!r} is not a number") from None
        return c["stats_key"], op, weight

    def stat(self, x: Experience, key: str) -> float | None:
        """exp.info[key], else exp.metrics[key], as a float; None when neither has it."""
        value = x.info.get(key, x.metrics.get(key))
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(f"reward_shaping_mapper: task {x.task_id}: stat {key!r} is {value!r}, not a number")
        return float(value)

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        diffs, missing, by_zero = [], 0, 0
        for x in exps:
            before = x.reward
            for key, op, weight in self.configs:
                value = self.stat(x, key)
                if value is None:
                    missing += 1
                    if key not in self.warned:
                        self.warned.add(key)
                        log.warning("reward_shaping_mapper: task %s has no stat %r in info or metrics: its "
                                    "reward is not shaped by it (counted: pipeline/.../missing; warned once)",
                                    x.task_id, key)  # fmt: skip
                elif op == "ADD":
                    x.reward += weight * value
                elif op == "SUB":
                    x.reward -= weight * value
                elif op == "MUL":
                    x.reward *= weight * value
                elif weight * value == 0:  # DIV by zero: the reward as it is (Trinity's)
                    by_zero += 1
                else:
                    x.reward /= weight * value
            diffs.append(x.reward - before)
        return exps, {**spread(diffs, "reward_diff"), "missing": missing, "div_by_zero": by_zero}


class PassRateCalculator:
    """Each group's mean reward, written to every experience's info["pass_rate"] (with 0/1 rewards: the fraction of
    the task's responses that passed); keeps every experience. Metrics over the groups: pass_rate/mean|min|max,
    all_passed / all_failed (groups whose every reward is >= 1 / <= 0)."""

    def process(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        rates = []
        for group in groups_of(exps).values():
            rewards = [x.reward for x in group]
            rate = statistics.fmean(rewards)
            for x in group:
                x.info["pass_rate"] = rate
            rates.append((rate, min(rewards) >= 1, max(rewards) <= 0))
        return exps, {
            **spread([r for r, _, _ in rates], "pass_rate"),
            "all_passed": sum(p for _, p, _ in rates),
            "all_failed": sum(f for _, _, f in rates),
        }
