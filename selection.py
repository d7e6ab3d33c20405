"""selection.py: which rows of a training taskset are read, pick by pick (data_selector.selector_type).

    sel = make(ts, n, columns)        # one per training taskset (tasksets.TaskReader builds them)
    rows = sel.pick(epoch, ks)        # the rows of the epoch's picks ks (k-th pick of the taskset in the epoch)
    sel.feedback({row: pass_rate})    # after a batch of tasks ran: difficulty_based learns, the others ignore it
    sel.state(); sel.load_state(s)    # JSON, saved with the reader's position in the step's DB transaction
    sel.metrics()                     # selection/<taskset>/...: of the picks (and feedback) since the last call

TaskReader interleaves the tasksets by size (an epoch is len(taskset) picks of each) and asks each taskset's
selector which row each pick is. The selectors, after Trinity-RFT's (trinity/buffer/selector/selector.py):

- `sequential`: file order. `shuffle`: a seeded permutation per epoch. `random`: seeded sampling with replacement
  per epoch. (nanorft's own orders, unchanged: seeded by f"{seed}/{epoch}", not Trinity's numpy seeds.)
- `offline_easy2hard`: the rows sorted once by `feature_keys`, highest first (the first key, ties by the next, and
  full ties by the higher row first, as Trinity's descending sort of [features..., row]). Trinity reads a higher
  value as EASIER (a pass rate, a confidence): easy first, hard last, the same order every epoch. Trinity has no
  switch to flip it; for hard-first (or for a column where higher means harder, e.g. a difficulty score) give a
  column holding the value negated.
- `difficulty_based` (Trinity's BOTS selector, `DifficultyBasedSelector` + `InterpolationBetaPREstimator`): each
  task's pass rate is a Beta(alpha, beta); every pick reads the predicted pass rate (the mean alpha / (alpha + beta),
  or with `do_sample` a draw from the Beta: Thompson sampling) and scores a task by -|target_reward - predicted|:
  `tau: 0` takes the best-scored tasks (ties: the lower row first), `tau > 0` samples softmax(score / tau) without
  replacement (Gumbel top-k, seeded by seed + picks so far, as Trinity seeds by seed + current_index). An epoch is
  len(taskset) picks; a task may be picked again in later batches (never twice in one batch, unless the batch
  asks for more tasks than the taskset has).

difficulty_based's update after each batch of tasks run (`feedback`: explore.py hands each task's group of raw
rewards, before any experience pipeline; a task's pass rate = its group's mean reward clipped to [0, 1], so
math_reward's 1.1 for right + formatted counts 1; a task that failed, no experiences, gives none):

    p~_i    = clip(f0_i + cap_coef * (f1_i - f0_i), 0, 1)   the prior: two feature_keys columns (a weaker and a
                                                            stronger reference's pass rates), interpolated
    cap_coef <- cap_estimate on the first update, else d * cap_coef + (1 - d) * cap_estimate (d 0.9), where
                cap_estimate = (mean r - mean f0) / (mean f1 - mean f0 + 1e-6) over the batch's tasks
    p~_i    = r_i for the batch's tasks (their observed pass rate)
    alpha_i <- (1 - lamb) * alpha_i + lamb + (1 - rho) * m * r_i [batch's tasks] + rho * m * p~_i
    beta_i  <- (1 - lamb) * beta_i  + lamb + (1 - rho) * m * (1 - r_i) [batch's tasks] + rho * m * (1 - p~_i)

(alpha = beta = 1 at the start: every task predicts 0.5 until the first update, as Trinity's.) With
`adaptive_rho`, rho halves whenever the prior's mean error on the batch's tasks is >= 0.25. With no feature_keys
the prior is flat: p~ = 0.5 for every task not in the batch (no cap_coef). A task in a batch twice counts once, with
the mean of its pass rates. Deviations from Trinity: `m` defaults to the taskset's repeat_times (Trinity: 16) since
a pass rate is the mean of that many rollouts; the estimator's state (alphas, betas, cap_coef, rho, picks) is saved
and restored (Trinity saves only its position and rebuilds the estimate from nothing).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from configs.data_selector import check, difficulty_args
from errors import DataError

if TYPE_CHECKING:
    from configs.schema import TasksetConfig

# a taskset's feature columns: keys -> [n tasks, len(keys)] float64 (tasksets.feature_columns: a DataError names the
# row and key of a value that is not a finite number)
Columns = Callable[[list[str]], np.ndarray]


class Ordered:
    """sequential / shuffle / random / offline_easy2hard: a fixed order per epoch, picked by position."""

    def __init__(self, ts: TasksetConfig, n: int, columns: Columns) -> None:
        sel = ts.data_selector
        self.name, self.kind, self.seed, self.n = ts.name, sel.selector_type, sel.seed, n
        # random samples with replacement: a task read twice in an epoch gets its slot in its group id (Task.read_at),
        # else its two groups would merge (the buffer claims, and the experience pipeline regroups, by group id)
        self.repeats = self.kind == "random"
        self.keys = list(sel.feature_keys) if self.kind == "offline_easy2hard" else []
        self.features = columns(self.keys) if self.keys else None
        self.sorted = sorted(range(self.n), key=lambda r: (*self.features[r], r), reverse=True) if self.keys else []
        self._order: tuple[int, list[int]] = (-1, [])
        self._picked: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """The rows of one epoch, in picking order."""
        if self.kind == "offline_easy2hard":
            return self.sorted
        rng = random.Random(f"{self.seed}/{epoch}")  # NOTE: str seeds hash deterministically across runs
        if self.kind == "sequential":
            return list(range(self.n))
        # NOTE: the very calls of the reader before selection.py: existing runs resume into the same orders
        return rng.sample(range(self.n), self.n) if self.kind == "shuffle" else rng.choices(range(self.n), k=self.n)

    def pick(self, epoch: int, ks: list[int]) -> list[int]:
        if self._order[0] != epoch:
            self._order = (epoch, self.order(epoch))
        rows = [self._order[1][k] for k in ks]
        self._picked += rows
        return rows

    def feedback(self, rates: dict[int, float]) -> None:
        """Nothing to learn: the order is fixed."""

    def state(self) -> dict:
        return {"type": self.kind}  # the order is a function of (seed, epoch): the reader's position is enough

    def load_state(self, state: dict) -> None:
        """Nothing to restore (see state)."""

    def metrics(self) -> dict[str, float]:
        """offline_easy2hard: the mean of each feature over the rows picked since the last call (Trinity's feat1,
        feat2), under selection/<taskset>/feature/<key>/mean."""
        picked, self._picked = self._picked, []
        if self.features is None or not picked:
            return {}
        means = self.features[picked].mean(axis=0)
        return {f"selection/{self.name}/feature/{key}/mean": float(v) for key, v in zip(self.keys, means)}


class DifficultyBased:
    """difficulty_based: Beta pass-rate estimates per task, fed back from each batch's rewards (module docstring)."""

    repeats = True  # the same task is picked again while it stays nearest the target: one group id per read

    def __init__(self, ts: TasksetConfig, n: int, columns: Columns) -> None:
        sel = ts.data_selector
        self.name, self.seed, self.n = ts.name, sel.seed, n
        self.args = difficulty_args(sel.kwargs, f"taskset {ts.name}: data_selector.kwargs")
        self.m = self.args.m or ts.repeat_times or 1
        self.keys = list(sel.feature_keys)
        self.features = columns(self.keys) if self.keys else None  # [n, 2]: f0, f1
        self.alphas, self.betas = np.ones(self.n), np.ones(self.n)
        self.cap_coef: float | None = None
        self.rho = self.args.rho
        self.picks = 0  # picks so far: seeds the next pick's sampling (Trinity's current_index)
        self.seen = np.zeros(self.n, dtype=bool)  # tasks that gave feedback at least once
        self._picked: list[tuple[float, float]] = []  # (predicted pass rate, |target - predicted|) of each pick
        self._observed: list[float] = []  # pass rates fed back since the last metrics()

    def predicted(self, rng: np.random.Generator | None = None) -> np.ndarray:
        """[n] predicted pass rates: the Betas' means, or draws from them with `rng` (do_sample)."""
        if rng is not None:
            return rng.beta(self.alphas, self.betas)
        return self.alphas / (self.alphas + self.betas)

    def choose(self, count: int) -> list[int]:
        """`count` distinct rows (count <= n): the best-scored at tau 0, else sampled without replacement."""
        rng = np.random.default_rng(self.seed + self.picks)
        pred = self.predicted(rng if self.args.do_sample else None)
        score = -np.abs(self.args.target_reward - pred)  # [n], in [-1, 0]
        if self.args.tau > 0:  # Gumbel top-k: sampling softmax(score / tau) without replacement, draw by draw
            score = score / self.args.tau + rng.gumbel(size=self.n)
        rows = np.argsort(-score, kind="stable")[:count].tolist()  # NOTE: stable: a tie goes to the lower row
        mean = self.predicted()
        self._picked += [(float(mean[r]), abs(self.args.target_reward - float(mean[r]))) for r in rows]
        self.picks += count
        return rows

    def pick(self, epoch: int, ks: list[int]) -> list[int]:
        """Rows for len(ks) picks, chosen now (an online selector: which pick of the epoch they are does not matter)."""
        rows: list[int] = []
        while len(rows) < len(ks):  # more picks than tasks: rounds of distinct rows
            rows += self.choose(min(len(ks) - len(rows), self.n))
        return rows

    def feedback(self, rates: dict[int, float]) -> None:
        """One update of the estimate from the pass rates (row -> pass rate in [0, 1]) of a batch's tasks."""
        if not rates:
            return
        rows, r = np.array(list(rates), dtype=int), np.array(list(rates.values()), dtype=np.float64)
        a = self.args
        if self.features is None:
            prior = np.full(self.n, 0.5)  # flat
        else:
            f0, f1 = self.features[:, 0], self.features[:, 1]
            anchor0, anchor1 = f0[rows].mean(), f1[rows].mean()
            estimate = float((r.mean() - anchor0) / (anchor1 - anchor0 + 1e-6))
            d = a.cap_coef_update_discount
            self.cap_coef = estimate if self.cap_coef is None else d * self.cap_coef + (1 - d) * estimate
            prior = np.clip(f0 + self.cap_coef * (f1 - f0), 0.0, 1.0)
        if a.adaptive_rho and np.abs(prior[rows] - r).mean() >= 0.25:
            self.rho *= 0.5
        prior[rows] = r
        s_bar, f_bar = np.zeros(self.n), np.zeros(self.n)
        s_bar[rows], f_bar[rows] = r * self.m, (1 - r) * self.m
        self.alphas = (1 - a.lamb) * self.alphas + a.lamb + (1 - self.rho) * s_bar + self.rho * prior * self.m
        self.betas = (1 - a.lamb) * self.betas + a.lamb + (1 - self.rho) * f_bar + self.rho * (1 - prior) * self.m
        self.seen[rows] = True
        self._observed += r.tolist()

    def state(self) -> dict:
        """Everything the next picks depend on, exactly (JSON floats round-trip)."""
        return {
            "type": "difficulty_based",
            "alphas": self.alphas.tolist(),
            "betas": self.betas.tolist(),
            "cap_coef": self.cap_coef,
            "rho": self.rho,
            "picks": self.picks,
            "seen": np.flatnonzero(self.seen).tolist(),
        }

    def load_state(self, state: dict) -> None:
        if state.get("type") != "difficulty_based":  # saved by another selector (or before selection.py): fresh
            return
        if len(state["alphas"]) != self.n:
            raise DataError(
                f"taskset {self.name}: the saved difficulty_based estimate is for {len(state['alphas'])} tasks, "
                f"this taskset has {self.n}"
            )
        self.alphas, self.betas = np.array(state["alphas"], dtype=np.float64), np.array(state["betas"], np.float64)
        self.cap_coef, self.rho, self.picks = state["cap_coef"], float(state["rho"]), int(state["picks"])
        self.seen = np.zeros(self.n, dtype=bool)
        self.seen[state["seen"]] = True

    def metrics(self) -> dict[str, float]:
        """selection/<taskset>/...: the picks since the last call (their predicted pass rate, Trinity's `point`, and
        its distance to target_reward), the pass rates fed back since, and the estimator's state."""
        picked, observed, self._picked, self._observed = self._picked, self._observed, [], []
        p = f"selection/{self.name}"
        out = {
            f"{p}/seen_tasks": float(self.seen.sum()),
            f"{p}/rho": self.rho,
            f"{p}/alpha/mean": float(self.alphas.mean()),
            f"{p}/beta/mean": float(self.betas.mean()),
        }
        if self.cap_coef is not None:
            out[f"{p}/cap_coef"] = self.cap_coef
        if picked:
            out[f"{p}/predicted_pass_rate/mean"] = float(np.mean([x for x, _ in picked]))
            out[f"{p}/target_gap/mean"] = float(np.mean([g for _, g in picked]))
        if observed:
            out[f"{p}/observed_pass_rate/mean"] = float(np.mean(observed))
        return out


def make(ts: TasksetConfig, n: int, columns: Columns) -> Ordered | DifficultyBased:
    """The selector of a training taskset of n tasks (its data_selector checked first: configs/data_selector.check);
    `columns` reads the feature columns it needs."""
    check(ts.data_selector, f"taskset {ts.name}: data_selector")
    kind = DifficultyBased if ts.data_selector.selector_type == "difficulty_based" else Ordered
    return kind(ts, n, columns)


def pass_rate(rewards: list[float]) -> float:
    """A task's pass rate from its group's rewards: the mean, clipped to [0, 1] (math_reward's 1.1, right and
    formatted, is a pass; a negative format penalty a fail)."""
    return min(max(sum(rewards) / len(rewards), 0.0), 1.0)
