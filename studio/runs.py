"""The run page's data (studio/run_page.py): a job directory's stages, their monitor histories as series on one
global step axis, the run's state and its summary. Plain Python: no streamlit here, so that tests read it directly.

What `bash run.sh` / launch.py leaves, and what is read of it:
  <root>/<project>/<name>/           the run directory (launch.run_dir): summary.json and reward_accuracy.png at the
                                     end, launch.lock (launch_<side>.lock) while a launcher holds it
  <root>/<project>/<name>/<stage>/   a stage's job dir: config.yaml, monitor/<role>.jsonl (trainer, explorer,
                                     explorer_bench), log/launch.log and a log per process
A single stage's job dir (a config without stages, or one stage of a run) is read the same way, as a run of one.

Global steps as summary.json counts them (launch.summarize): a stage's steps start where the previous stage's
last recorded step ended, a bench stage's single evaluation at its start.
Reading is incremental (`RunReader.poll`): each history is tailed from where the last poll stopped
(monitor.HistoryTail: only complete lines, so a line being written is left for the next poll; a garbled line is
skipped with monitor.records' warning), so that the page can poll every second or two while a run writes.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from errors import DataError
from launch import eval_key
from monitor import HistoryTail, numbers_of

SUMMARY = "summary.json"
PLOT = "reward_accuracy.png"
LOG_LINES = 20  # the lines of each log that a failed or stopped run shows


# --- where runs are


def is_job_dir(path: Path) -> bool:
    """A stage's job dir: it has a monitor/ folder (its processes' histories) or the stage's config.yaml."""
    return (path / "monitor").is_dir() or any(path.glob("config*.yaml"))


def find_runs(root: str | Path, depth: int = 4) -> list[Path]:
    """The run dirs (or lone job dirs) under `root` (./checkpoints), newest first: the parent of job dirs when it
    is a run dir (it holds summary.json or a launcher's lock), else the job dir itself. Looks `depth` levels down
    only (<root>/<project>/<name>/<stage>/monitor), not the whole tree of checkpoint files."""
    root, found = Path(root), set()
    for level in range(1, depth + 1):
        for monitor in root.glob("/".join(["*"] * level) + "/monitor"):
            job = monitor.parent
            found.add(job.parent if is_run_dir(job.parent) else job)
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def is_run_dir(path: Path) -> bool:
    """The directory a launcher ran in (launch.run_dir): its summary.json or its lock file."""
    return (path / SUMMARY).is_file() or any(path.glob("launch*.lock"))


def stage_dirs(path: Path, summary: dict | None) -> list[Path]:
    """The stages' job dirs of run dir `path` in the order they ran: summary.json's order when the run has ended,
    else the order their config.yaml was written (each stage writes it when it starts); [path] for a job dir.
    DataError when `path` is neither (what to give instead)."""
    if not path.is_dir():
        raise DataError(f"{path}: no such directory; give a run directory (<root>/<project>/<name>) or a job dir")
    subs = [p for p in path.iterdir() if p.is_dir() and is_job_dir(p)]
    if not subs and (path / "monitor").is_dir():
        return [path]
    if not subs:
        raise DataError(
            f"{path} is not a job directory: it has no monitor/ folder and no stage folder with one; give a run "
            "directory as launch.py leaves it (<root>/<project>/<name>, e.g. checkpoints/nanorft/tiny) or one "
            "stage's job dir"
        )
    named = {p.name: p for p in subs}
    order = [s["name"].rsplit("/", 1)[-1] for s in (summary or {}).get("stages", [])]
    ranked = [named.pop(n) for n in order if n in named]
    return ranked + sorted(named.values(), key=started_at)


def started_at(job: Path) -> float:
    """When a stage started: its config.yaml's time (written at its start), else the folder's."""
    return min((p.stat().st_mtime for p in job.glob("config*.yaml")), default=job.stat().st_mtime)


# --- the histories


@dataclass
class Stage:
    """One stage's histories as read so far: role (the history's file name) -> its records."""

    name: str
    path: Path
    records: dict[str, list[dict]] = field(default_factory=dict)
    tails: dict[str, HistoryTail] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # the metrics its records hold (`numbers`), kept as they come

    def poll(self) -> int:
        """Read what the stage's histories gained since the last poll; returns the number of new records. A history
        that shrank (a fresh run in the same folder) is read again from its start."""
        new = 0
        for file in sorted(self.path.glob("monitor/*.jsonl")):
            role, tail = file.stem, self.tails.get(file.stem)
            if tail is None or file.stat().st_size < tail.offset:
                tail = self.tails[role] = HistoryTail(file, from_start=True)
                self.records[role] = []
            got = tail.read()
            self.records[role].extend(got)
            self.keys.update(k for r in got for k in numbers(r))
            new += len(got)
        return new

    def steps(self) -> int:
        """The stage's last recorded step (launch.summarize's span of the stage)."""
        return max((r["step"] for rs in self.records.values() for r in rs), default=0)


def numbers(record: dict) -> dict[str, float]:
    """A record's plottable numbers (monitor.numbers_of: the finite ones), its step and total aside."""
    return {k: v for k, v in numbers_of(record).items() if k not in ("step", "total_steps")}


class RunReader:
    """A run (or job) directory, read incrementally: `poll` reads what was added (new stages too), `series` the
    picked metrics on the global step axis. Kept in the page's session so that each refresh reads only new lines."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.summary = read_summary(self.path)
        stage_dirs(self.path, self.summary)  # DataError now when it is no job dir
        self.stages: dict[Path, Stage] = {}

    def poll(self) -> int:
        """Read new stages and new records; returns the number of new records."""
        self.summary = read_summary(self.path)
        order = stage_dirs(self.path, self.summary)
        self.stages = {job: self.stages.get(job) or Stage(job.name, job) for job in order}
        return sum(st.poll() for st in self.stages.values())

    def spans(self) -> list[dict]:
        """Each stage's global steps as summary.json's "stages" holds them: name, first_step, steps."""
        out, offset = [], 0
        for st in self.stages.values():
            out.append({"name": st.name, "first_step": offset, "steps": st.steps()})
            offset += st.steps()
        return out

    def metrics(self) -> list[str]:
        """Every metric some record holds, sorted."""
        return sorted(set().union(*(st.keys for st in self.stages.values())))

    def series(self, metric: str) -> list[dict]:
        """`metric` (a metric's name, or a GROUPS name) over the run: rows {global_step, step, stage, role, metric,
        line, value}; `line` names the curve: the stage, the metric when a group has several (the losses), and the
        role when two roles of the stage write it (response_length/mean)."""
        keys = group_keys(metric, self.metrics())
        rows = []
        for st, span in zip(self.stages.values(), self.spans()):
            got = {role: [(r, k, v) for r in rs for k, v in picked(r, metric, keys)] for role, rs in st.records.items()}
            got = {role: vals for role, vals in got.items() if vals}
            for role, vals in got.items():
                for r, key, v in vals:
                    line = " · ".join([st.name] + ([key] if len(keys) > 1 else []) + ([role] if len(got) > 1 else []))
                    rows.append({"global_step": span["first_step"] + r["step"], "step": r["step"], "stage": st.name,
                                 "role": role, "metric": key, "line": line, "value": v})  # fmt: skip
        return rows


# --- the metric groups: the page's defaults

# the curves reward_accuracy.png draws (the SFT loss among the losses), and what the trainer writes
GROUPS = {
    "reward": "the rollout reward (rollout/reward/mean, as reward_accuracy.png draws it; else critic/reward_mean)",
    "accuracy": "the held-out accuracy: each evaluation's eval|bench/<taskset>/accuracy/mean@k (launch.eval_key)",
    "loss": "the trainer's losses: actor/pg_loss, actor/kl_loss, actor/sft_loss, ...",
}


def group_keys(name: str, metrics: list[str]) -> list[str]:
    """The metrics a curve name stands for: a group's (GROUPS) as this run has them, else [name] itself; for
    "accuracy", ["accuracy"]: each record's key is launch.eval_key's (a bench stage's and an eval's on one curve)."""
    if name == "reward":
        return [next((k for k in ("rollout/reward/mean", "critic/reward_mean") if k in metrics), "rollout/reward/mean")]
    if name == "loss":
        return [k for k in metrics if k.endswith("_loss") or k.endswith("/loss")]
    return [name]


def picked(record: dict, name: str, keys: list[str]) -> list[tuple[str, float]]:
    """The (metric, value) pairs of `record` that curve `name` (of `keys`, group_keys) draws."""
    nums = numbers(record)
    if name == "accuracy":
        key = eval_key(record)
        return [(key, nums[key])] if key in nums else []
    return [(k, nums[k]) for k in keys if k in nums]


# --- the run's state and summary


def read_summary(path: Path) -> dict | None:
    """summary.json (launch.write_summary writes it whole, atomically); None when the run has not written one."""
    try:
        return json.loads((path / SUMMARY).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"{path / SUMMARY}: unreadable ({e}); launch.py writes it whole: was it edited?") from e


def launcher_alive(path: Path) -> str | None:
    """The lock line ("pid N on host H") of a launcher of this machine that holds `path` now, else None. NOTE: read
    only (a flock taken here, even briefly, could turn a launcher starting meanwhile away); a pid reused since by
    another process reads as alive."""
    for lock in path.glob("launch*.lock"):
        words = lock.read_text(errors="replace").split()
        if len(words) == 5 and words[0] == "pid" and words[1].isdigit() and words[4] == socket.gethostname():
            try:
                os.kill(int(words[1]), 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            return " ".join(words)
    return None


@dataclass
class State:
    """How the run stands: status running | finished | failed | stopped (no launcher and no summary), the current
    (last) stage and its step / total, a line that says it, and the logs' last lines when it failed or stopped."""

    status: str
    stage: str | None
    step: int | None
    total: int | None
    line: str
    logs: dict[str, str] = field(default_factory=dict)


def state(reader: RunReader) -> State:
    """The run's state from its lock, its summary.json and its last stage's histories and logs (`RunReader.poll`
    first)."""
    last = list(reader.stages.values())[-1] if reader.stages else None
    recs = [r for rs in (last.records.values() if last else []) for r in rs]
    step = max((r["step"] for r in recs), default=None)
    total = max((r["total_steps"] for r in recs if isinstance(r.get("total_steps"), int)), default=None)
    name = last.name if last else None
    at = f"stage {name}, " + (f"step {step}" + (f" / {total}" if total else "") if recs else "no step recorded")
    at = at if last else "no stage yet"
    if holder := launcher_alive(reader.path):
        return State("running", name, step, total, f"running: {at} (launcher {holder})")
    summary = reader.summary
    if summary is not None and not summary.get("exit_code"):
        return State("finished", name, step, total, f"finished in {summary.get('wall_seconds')} s: {at}")
    logs = log_tails(last.path) if last else {}
    if summary is not None:
        return State("failed", name, step, total, f"FAILED (exit code {summary['exit_code']}) at {at}", logs)
    return State("stopped", name, step, total, f"not running, no {SUMMARY}: stopped or killed at {at}", logs)


def log_tails(job: Path, lines: int = LOG_LINES) -> dict[str, str]:
    """The last `lines` lines of each log of a job dir (log/launch.log, log/trainer.log, ...)."""
    out = {}
    for file in sorted(job.glob("log/*.log")):
        with open(file, "rb") as f:
            f.seek(max(0, file.stat().st_size - 200 * lines))
            out[file.name] = "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    return out


SUMMARY_FIELDS = {
    "accuracy_before_sft": "accuracy before SFT",
    "accuracy_after_sft": "accuracy after SFT",
    "accuracy_after_rft": "accuracy after RFT",
    "wall_seconds": "wall time (s)",
    "steps": "steps",
}


def summary_view(summary: dict) -> dict[str, object]:
    """summary.json's headline figures as the page shows them, by label (a missing one: None)."""
    return {label: summary.get(key) for key, label in SUMMARY_FIELDS.items()}
