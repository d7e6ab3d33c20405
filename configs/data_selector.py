"""data_selector's arguments, checked at load (configs/checks.py) and read by the selectors (selection.py): which
feature_keys and kwargs each selector_type takes; difficulty_based's kwargs by Trinity-RFT's names."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from errors import ConfigError

if TYPE_CHECKING:
    from configs.schema import DataSelectorConfig

ORDERED = ("sequential", "shuffle", "random")  # nanorft's own per-epoch orders: no feature_keys, no kwargs


@dataclasses.dataclass(frozen=True)
class DifficultyArgs:
    """data_selector.kwargs of `difficulty_based`, Trinity's names and defaults (but `m`)."""

    m: int | None = None
    """Rollouts behind one pass rate (the pseudo-count scale of an observation). None: the taskset's repeat_times."""
    lamb: float = 0.2
    """Discount of the past estimate per update, in [0, 1]: alpha <- (1 - lamb) * alpha + lamb + ..."""
    rho: float = 0.2
    """Weight of the prior's pseudo counts, in [0, 1] (the rest is the observed pass rate)."""
    target_reward: float = 1.0
    """The pass rate to aim at, in [0, 1]: tasks whose predicted pass rate is nearest it are picked first."""
    tau: float = 1.0
    """Temperature, >= 0: 0 picks the nearest tasks greedily, > 0 samples softmax(-|target - predicted| / tau)."""
    do_sample: bool = False
    """Thompson sampling: predict each pass rate by a draw from its Beta instead of the Beta's mean."""
    adaptive_rho: bool = False
    """Halve rho whenever the prior's mean absolute error on a batch's tasks is >= 0.25."""
    cap_coef_update_discount: float = 0.9
    """d in cap_coef <- d * cap_coef + (1 - d) * cap_estimate, in [0, 1]."""


_RANGES = {
    "m": (lambda v: v is None or v >= 1, ">= 1"),
    "lamb": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "rho": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "target_reward": (lambda v: 0 <= v <= 1, "in [0, 1] (a pass rate)"),
    "tau": (lambda v: v >= 0, ">= 0"),
    "cap_coef_update_discount": (lambda v: 0 <= v <= 1, "in [0, 1]"),
}


def difficulty_args(kwargs: dict, where: str) -> DifficultyArgs:
    """`kwargs` as DifficultyArgs, or a ConfigError naming the key at `where` (data_selector.kwargs' path): an unknown
    name (with the known ones), a value of the wrong type, or out of range."""
    known = {f.name: f for f in dataclasses.fields(DifficultyArgs)}
    for key, value in kwargs.items():
        if key not in known:
            raise ConfigError(
                f"{where}.{key}: unknown argument of difficulty_based; known: {', '.join(known)} (Trinity's names)"
            )
        want = known[key].type
        ok = (
            isinstance(value, bool)
            if want == "bool"
            else not isinstance(value, bool) and isinstance(value, int if want == "int | None" else (int, float))
        )
        if not ok:
            raise ConfigError(f"{where}.{key}: {value!r} is not a {want.replace(' | None', '')}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: {value!r} is not a finite number")
        test, allowed = _RANGES.get(key, (lambda v: True, ""))
        if not test(value):
            raise ConfigError(f"{where}.{key}: {value!r} is out of range; allowed: {allowed}")
    return DifficultyArgs(**kwargs)


def check(sel: DataSelectorConfig, where: str) -> None:
    """A ConfigError naming the key under `where` (a taskset's data_selector path) when feature_keys or kwargs do not
    fit selector_type: kwargs are read by difficulty_based only (refused by name elsewhere), feature_keys by
    offline_easy2hard (one or more) and difficulty_based (none: a flat prior, or exactly two)."""
    kind, keys = sel.selector_type, sel.feature_keys
    if kind == "difficulty_based":
        difficulty_args(sel.kwargs, f"{where}.kwargs")
        if len(keys) not in (0, 2):
            raise ConfigError(
                f"{where}.feature_keys: {keys!r}: difficulty_based reads two prior pass-rate columns (a weaker and a "
                "stronger reference's), interpolated by the run's capability estimate; or none (a flat prior 0.5)"
            )
        return
    if sel.kwargs:
        raise ConfigError(
            f"{where}.kwargs: {sorted(sel.kwargs)} refused: selector_type {kind!r} takes no arguments "
            "(only difficulty_based reads kwargs)"
        )
    if kind == "offline_easy2hard" and not keys:
        raise ConfigError(f"{where}.feature_keys: offline_easy2hard sorts by these columns: name one or more")
    if kind in ORDERED and keys:
        raise ConfigError(
            f"{where}.feature_keys: {keys!r} has no effect with selector_type {kind!r}: only offline_easy2hard and "
            "difficulty_based read feature columns"
        )
