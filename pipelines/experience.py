"""The experience pipeline (data_processor.experience_pipeline): operators run in order over each batch of an explore
step's scored experiences, in the explorer, before the step's advantages (step_wise_grpo's) and its write.

Built once at the explorer's set-up (a bad operator name or argument is refused then, before any rollout). The
explorer calls `run` on every batch of tasks it runs (a step may run several: refills, DAPO's dynamic sampling);
`run` returns what the operators keep and that batch's metrics; `step_metrics` gives the step's (its batches
together) and forgets them. `state` / `load_state`: the cumulative kept / dropped counts, saved with the explorer's
position in the same DB transaction as the step's experiences (explore.write), so a restart continues them exactly.

Metrics, per operator (`label`: its name; a user operator's `module:attr` by its attr; a name used twice: name#2):
pipeline/<label>/kept, pipeline/<label>/dropped (experiences in and out of it), pipeline/<label>/<its own key>, and
the cumulative pipeline/<label>/kept_total, dropped_total; and pipeline/input/experiences, reward_mean (the step's
experiences and their mean reward as they came, before any operator) and pipeline/output/... (as written: what
rollout/reward/* is computed over). Over a step's batches, kept / dropped and an operator's
own keys add up, except keys ending in /mean (weighted by the experiences the operator saw), /min and /max.

An operator that raises stops the explorer with a DataError naming it (its traceback in the log): the step is not
written, so a restart runs its tasks again, and no experience is silently lost.
"""

from __future__ import annotations

import logging
import math
from statistics import fmean
from typing import Any

import configs
from buffer import Experience
from errors import ConfigError, DataError
from pipelines import Context, Operator, build
from pipelines.registry import EXPERIENCE_OPERATORS

log = logging.getLogger("nanorft.pipelines")


def mean(values: list[float]) -> float:
    return fmean(values) if values else 0.0


def labels(names: list[str]) -> list[str]:
    """Each operator's metric label: its name (a user's `module:attr` / `file.py:attr` by attr), #2, #3... for
    repeats."""
    out: list[str] = []
    for name in names:
        base = name.rpartition(":")[2] if ":" in name else name
        n = sum(o.split("#")[0] == base for o in out)
        out.append(f"{base}#{n + 1}" if n else base)
    return out


class ExperiencePipeline:
    """The operators of cfg.data_processor.experience_pipeline.operators, built; see the module docstring."""

    def __init__(self, cfg: configs.Config, models: dict[str, Any] | None = None) -> None:
        specs = cfg.data_processor.experience_pipeline.operators
        self.ops: list[tuple[str, Operator]] = [
            (
                label,
                build(
                    spec,
                    EXPERIENCE_OPERATORS,
                    Context(cfg, models or {}, f"data_processor.experience_pipeline.operators[{i}]"),
                ),
            )
            for i, (label, spec) in enumerate(zip(labels([s.name for s in specs]), specs))
        ]
        self.totals = {label: {"kept": 0, "dropped": 0} for label, _ in self.ops}
        self._step: dict[str, float] = {}  # this step's metrics so far (its batches together)
        self._seen: dict[str, int] = {}  # experiences each op saw this step: the weights of its /mean keys
        self._ends: dict[str, list[float]] = {"input": [], "output": []}  # this step's rewards into / out of it
        log.info("experience pipeline: %s", " -> ".join(label for label, _ in self.ops))

    def run(self, exps: list[Experience]) -> tuple[list[Experience], dict[str, float]]:
        """The operators in order over one batch: (the experiences kept, this batch's metrics)."""
        metrics: dict[str, float] = {}
        self._ends["input"] += [x.reward for x in exps]
        for i, (label, op) in enumerate(self.ops):
            n = len(exps)
            try:
                exps, own = op.process(exps)
            except (ConfigError, DataError) as e:
                raise type(e)(f"experience pipeline operator {label} (operators[{i}]): {e}") from e
            except Exception as e:
                log.exception("experience pipeline operator %s raised", label)
                raise DataError(
                    f"experience pipeline operator {label} (data_processor.experience_pipeline.operators[{i}]) "
                    f"raised {type(e).__name__}: {e}. The step is not written: a restart runs its tasks again"
                ) from e
            if not isinstance(exps, list) or not all(isinstance(x, Experience) for x in exps):
                raise DataError(f"experience pipeline operator {label}: process() must return (list of Experience, "
                                f"dict), not ({type(exps).__name__}, ...)")  # fmt: skip
            metrics |= {f"pipeline/{label}/kept": len(exps), f"pipeline/{label}/dropped": max(n - len(exps), 0)}
            metrics |= {f"pipeline/{label}/{k}": float(v) for k, v in (own or {}).items()}
            self._add(label, n, metrics)
        if bad := [x for x in exps if not isinstance(x.reward, (int, float)) or not math.isfinite(x.reward)]:
            raise DataError(
                f"after the experience pipeline, {len(bad)} experience(s) have a reward that is not a finite number "
                f"(task {bad[0].task_id}: {bad[0].reward!r}); end the pipeline with invalid_reward_filter to drop them"
            )
        self._ends["output"] += [x.reward for x in exps]
        return exps, metrics

    def _add(self, label: str, n: int, batch: dict[str, float]) -> None:
        """Add an operator's batch metrics to the step's and its kept / dropped to the totals."""
        prefix = f"pipeline/{label}/"
        seen = self._seen.get(label, 0)
        for key, v in batch.items():
            if not key.startswith(prefix):
                continue
            old = self._step.get(key)
            if old is None:
                self._step[key] = v
            elif key.endswith("/mean"):
                self._step[key] = (old * seen + v * n) / (seen + n) if seen + n else v
            elif key.endswith("/min") or key.endswith("/max"):
                self._step[key] = min(old, v) if key.endswith("/min") else max(old, v)
            else:
                self._step[key] = old + v
        self._seen[label] = seen + n
        self.totals[label]["kept"] += int(batch[prefix + "kept"])
        self.totals[label]["dropped"] += int(batch[prefix + "dropped"])

    def step_metrics(self) -> dict[str, float]:
        """The step's metrics (its batches together) and the cumulative totals; the step's are forgotten."""
        out, self._step, self._seen = self._step, {}, {}
        for end, rewards in self._ends.items():  # NOTE: rollout/reward/* is over what the pipeline kept (written)
            out |= {f"pipeline/{end}/experiences": len(rewards), f"pipeline/{end}/reward_mean": mean(rewards)}
        self._ends = {"input": [], "output": []}
        for label, t in self.totals.items():
            out |= {f"pipeline/{label}/kept_total": t["kept"], f"pipeline/{label}/dropped_total": t["dropped"]}
        return out

    def state(self) -> dict[str, dict[str, int]]:
        """The cumulative counts, for the explorer's saved state."""
        return {label: dict(t) for label, t in self.totals.items()}

    def load_state(self, saved: dict[str, dict[str, int]] | None) -> None:
        """The counts saved with the last written step (an operator added since starts from 0)."""
        for label, t in (saved or {}).items():
            if label in self.totals:
                self.totals[label] = {"kept": int(t["kept"]), "dropped": int(t["dropped"])}
