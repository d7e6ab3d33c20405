"""Crash-safety soak of asynchronous RFT: SIGKILL the explorer, the trainer or both at random moments,
restart them, let the run finish, then check that nothing was lost, repeated or skipped.

    python scripts/soak_async.py --cycles 20 --seed 0                 # the soak of docs/LOG.md (~10 min, 2 CPUs)
    python scripts/soak_async.py --cycles 3 --schedule explorer,trainer,both --steps 6   # what CI runs
    python scripts/soak_async.py --cycles 20 --db-url postgresql://user@host/db        # on a PostgreSQL DB

The run is configs/async/tiny_{trainer,explorer}.yaml (mode train + mode explore, checkpoint sync,
one-step-ahead explorer, staleness control) on a fresh tiny model with small batches, checkpoints every
3 steps and a short max_read_timeout. Each cycle waits until the victim has made progress since its
(re)start, or, one time in four, only a random moment of its start-up; then it waits a random
fraction of a step more and SIGKILLs the victim's whole process group (mid-rollout, mid-DB-write,
mid-checkpoint: wherever it happens to be), and restarts it. Afterwards both run to the end.
The cycles of --schedule (what CI runs) kill at points the script chooses instead, never after a clock
delay: cycle c (0, 1, ...) waits until its trigger, the trainer for victim trainer, else the explorer, is
paused (NANORFT_TEST_PAUSE_AT, sync.pause_for_test) at `train.after_read:<c + 2>` (step c + 2's batch
claimed, not trained) or `explore.before_write:<c + 2>` (generated, not written); --steps >= cycles + 2.
NOTE: victim `both` is timed by the explorer's pause alone; the trainer dies wherever it is then (waiting for a
batch, mid-step, mid-checkpoint: it cannot have finished, as the paused explorer has written too few steps). That
is by design: the checks below are invariants of any kill point, and nothing the CI test asserts (moments, start
counts, the final counts, the claims released at each restart) depends on where the trainer was.

Checks (`check`, also usable on any finished async run):
- every experience is pending, claimed by exactly one train step, or dropped (stale); no id is claimed
  twice; use_count agrees with the claims table;
- train steps 1..T each claimed exactly train_batch_size experiences, and T is the final checkpoint;
- each explorer's groups, in DB order, are exactly the first K tasks of its taskset order (none skipped,
  none explored twice), each with repeat_times experiences, and K matches its saved position.
Prints and writes <out>/soak_result.json; exit code 1 if a check failed or a process failed by itself.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from buffer import ExperienceDB, is_postgres, sqlite_path  # noqa: E402
from configs import cli, resolve_stages  # noqa: E402
from tasksets import TaskReader  # noqa: E402


def write_configs(out: Path, model: str, data: str, steps: int, db_url: str) -> dict[str, Path]:
    """The async tiny pair, made small and fast, writing under `out` (the experience DB at `db_url`; "": the
    default SQLite file in the job dir)."""
    files = {}
    for role, name in (("trainer", "tiny_trainer.yaml"), ("explorer", "tiny_explorer.yaml")):
        cfg = yaml.safe_load((ROOT / "configs/async" / name).read_text())
        cfg.update(checkpoint_root_dir=str(out / "ck"), name="soak")
        cfg["model"].update(model_path=model, max_response_tokens=12)
        cfg["buffer"].update(total_steps=steps, batch_size=3)
        cfg["algorithm"]["repeat_times"] = 2
        for ts in [cfg["buffer"]["explorer_input"]["taskset"], *cfg["buffer"]["explorer_input"]["eval_tasksets"]]:
            ts["path"] = data
        cfg["buffer"]["trainer_input"]["experience_buffer"]["max_read_timeout"] = 300
        if db_url:
            cfg["buffer"]["trainer_input"]["experience_buffer"]["path"] = db_url
        cfg["synchronizer"]["sync_timeout"] = 300
        cfg["explorer"].update(runner_per_model=6, eval_interval=1000, eval_on_startup=False)
        cfg["trainer"]["save_interval"] = 3
        cfg["monitor"] = {"monitor_type": "none"}
        files[role] = out / f"{role}.yaml"
        files[role].write_text(yaml.safe_dump(cfg))
    return files


class Proc:
    """One side of the run as a user starts it (its own process group, so a kill takes all of it)."""

    def __init__(self, role: str, config: Path, logs: Path) -> None:
        self.role, self.config, self.log, self.p = role, config, logs / f"{role}.log", None
        self.starts, self.pause, self.marker = 0, "", logs / f"{role}.paused"

    def start(self, pause: str = "") -> None:
        """Start the process; with `pause` (<point>:<step>) it touches self.marker there and waits to be killed."""
        self.pause, self.marker = pause, self.log.parent / f"{self.role}_{self.starts}.paused"
        env = {"NANORFT_TEST_PAUSE_AT": pause, "NANORFT_TEST_PAUSE_MARKER": str(self.marker)} if pause else {}
        script = "train.py" if self.role == "trainer" else "explore.py"
        with self.log.open("a") as f:
            f.write(f"\n===== start {self.starts} at {time.strftime('%H:%M:%S')} =====\n")
        self.p = subprocess.Popen(
            [sys.executable, script, "--config", str(self.config)],
            cwd=ROOT,
            stdout=self.log.open("a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        )
        self.starts += 1

    def kill(self) -> None:
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait()


def progress(url: str, role: str) -> int:
    """The trainer's last finished step or the explorer's last written step, from the DB (-1: none)."""
    if not is_postgres(url) and not Path(sqlite_path(url)).exists():  # NOTE: opening would create the file
        return -1
    with ExperienceDB(url) as db:
        state = db.trainer_status() if role == "trainer" else db.explorer_states().get("explorer")
    return state["step"] if state else -1


def trigger(victim: str) -> str:
    """The side whose pause point times a scheduled kill of `victim`."""
    return "trainer" if victim == "trainer" else "explorer"


def pause_for(role: str, schedule: list[str], after: int) -> str:
    """The pause point of `role`'s next scheduled trigger after cycle `after` ("": none)."""
    point = "train.after_read" if role == "trainer" else "explore.before_write"
    return next((f"{point}:{c + 2}" for c in range(after + 1, len(schedule)) if trigger(schedule[c]) == role), "")


def wait_paused(proc: Proc, timeout: float = 300) -> bool:
    """Wait until `proc` is paused at its point (False: it exited or did not get there in `timeout` s)."""
    deadline = time.monotonic() + timeout
    while not proc.marker.exists() and proc.p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.marker.exists()


def pick_moment(
    cycle: int, victim: str, schedule: list[str], procs: dict[str, Proc], db: str, rng: random.Random
) -> str:
    """Wait for the moment of cycle's kill and say which it is ("": the scheduled pause did not come).
    Scheduled: a pause point; else after progress since the (re)start, or (1 in 4) somewhere in the start-up."""
    if cycle < len(schedule):
        side = procs[trigger(victim)]
        return f"{side.role} paused at {side.pause}" if wait_paused(side) else ""
    if rng.random() < 0.25:
        time.sleep(rng.uniform(0.0, 5.0))
        return "start-up"
    roles = ["explorer", "trainer"] if victim == "both" else [victim]
    base = {r: progress(db, r) for r in roles}
    deadline = time.monotonic() + 120
    while any(progress(db, r) <= base[r] for r in roles) and time.monotonic() < deadline:
        if any(procs[r].p.poll() is not None for r in roles):
            break
        time.sleep(0.1)
    time.sleep(rng.uniform(0.0, 1.5))
    return "after progress"


def check(trainer_config: Path, explorer_config: Path) -> dict:
    """The invariants of a finished asynchronous run; returns counts, raises AssertionError on a violation."""
    (tc,) = resolve_stages(cli(["--config", str(trainer_config)])[0])
    (ec,) = resolve_stages(cli(["--config", str(explorer_config)])[0])
    job = Path(tc.checkpoint_job_dir)
    with ExperienceDB(tc.buffer.trainer_input.experience_buffer.path) as db:
        rows = db.query("SELECT id, use_count, dropped_step, group_id, explorer FROM experiences ORDER BY id")
        claims = db.query("SELECT exp_id, step FROM claims")
        state = db.explorer_states()["explorer"]
    by_exp = collections.Counter(e for e, _ in claims)
    assert max(by_exp.values(), default=1) == 1, (
        f"experiences used twice: {[e for e, c in by_exp.items() if c > 1][:5]}"
    )
    for id_, use, dropped, *_ in rows:
        assert use == by_exp.get(id_, 0), f"experience {id_}: use_count {use}, {by_exp.get(id_, 0)} claims"
        assert not (use and dropped is not None), f"experience {id_} both claimed and dropped"
    pending = sum(use == 0 and dropped is None for _, use, dropped, *_ in rows)
    claimed, dropped = len(by_exp), sum(d is not None for _, _, d, *_ in rows)
    assert len(rows) == claimed + pending + dropped
    per_step = collections.Counter(s for _, s in claims)
    total = tc.buffer.total_steps
    assert sorted(per_step) == list(range(1, total + 1)), f"train steps claimed: {sorted(per_step)}"
    assert set(per_step.values()) == {tc.buffer.train_batch_size}, f"claims per step: {dict(per_step)}"
    assert int((job / "latest_checkpointed_iteration.txt").read_text()) == total
    groups = list(dict.fromkeys(g for *_, g, _ in rows))
    sizes = collections.Counter(g for *_, g, _ in rows)
    assert set(sizes.values()) == {ec.algorithm.repeat_times}, f"group sizes: {collections.Counter(sizes.values())}"
    reader = TaskReader(ec.buffer.explorer_input.tasksets, total_epochs=10**9)
    expected = [f"{ec.explorer.name}/{t.epoch}/{t.task_id}" for t in reader.read(len(groups))]
    assert groups == expected, "tasks skipped or explored twice: " + str(
        next((i, g, e) for i, (g, e) in enumerate(zip(groups, expected)) if g != e)
    )
    assert state["reader"]["index"] + state["reader"]["epoch"] * len(reader) == len(groups), (state, len(groups))
    return {
        "experiences": len(rows),
        "claimed": claimed,
        "pending": pending,
        "dropped": dropped,
        "train_steps": total,
        "tasks": len(groups),
        "explorer_steps": state["step"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0, help="train steps of the run (default: 10 per cycle)")
    ap.add_argument("--schedule", default="", help="victims in order (explorer,trainer,both); default: random")
    ap.add_argument("--out", default="", help="work folder (default: a new one under /tmp)")
    ap.add_argument("--db-url", default="", help="the experience DB (default: a SQLite file in the run's job dir)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out or f"/tmp/nanorft_soak_{time.strftime('%Y%m%d-%H%M%S')}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    from tiny import build

    build(str(out / "assets"), n_train=200, n_test=10)
    files = write_configs(
        out, str(out / "assets/tiny-qwen2"), str(out / "assets/arith"), args.steps or 10 * args.cycles, args.db_url
    )
    db = args.db_url or f"sqlite:///{out / 'ck/nanorft/soak/buffer/tiny_async_buffer.db'}"
    procs = {role: Proc(role, files[role], out / "logs") for role in ("trainer", "explorer")}
    schedule = [v for v in args.schedule.split(",") if v]
    kills, start = [], time.monotonic()
    for role, p in procs.items():
        p.start(pause_for(role, schedule, -1))
    for cycle in range(args.cycles):
        victim = schedule[cycle] if cycle < len(schedule) else rng.choice(["explorer", "trainer", "both"])
        roles = ["explorer", "trainer"] if victim == "both" else [victim]
        if not (moment := pick_moment(cycle, victim, schedule, procs, db, rng)):
            print(f"cycle {cycle}: no pause at {procs[trigger(victim)].pause}; no more kills", flush=True)
            break
        exited = {r: procs[r].p.poll() for r in roles if procs[r].p.poll() is not None}
        if exited:  # finished (0) or failed on its own: the run is ending, no more kills
            print(f"cycle {cycle}: {exited} had already exited; no more kills", flush=True)
            break
        at = {r: progress(db, r) for r in ("trainer", "explorer")}
        for r in roles:
            procs[r].kill()
        kills.append(
            {
                "cycle": cycle,
                "victim": victim,
                "moment": moment,
                "trainer_step": at["trainer"],
                "explorer_step": at["explorer"],
                "t": round(time.monotonic() - start, 1),
            }
        )
        print(
            f"cycle {cycle}: SIGKILL {victim} ({moment}; trainer step {at['trainer']}, explorer step {at['explorer']})",
            flush=True,
        )
        if cycle >= len(schedule):
            time.sleep(rng.uniform(0.0, 2.0))
        for r in roles:
            procs[r].start(pause_for(r, schedule, cycle))
    # --- let both finish
    codes = {}
    for role, p in procs.items():
        try:
            codes[role] = p.p.wait(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            codes[role] = "timeout"
    result = {
        "cycles": args.cycles,
        "seed": args.seed,
        "steps": args.steps or 10 * args.cycles,
        "kills": kills,
        "exit_codes": codes,
        "starts": {r: p.starts for r, p in procs.items()},
        "seconds": round(time.monotonic() - start, 1),
        "out": str(out),
    }
    try:
        if any(codes.values()):
            raise AssertionError(f"a process failed by itself: {codes} (see {out / 'logs'})")
        if len(kills) < args.cycles:
            raise AssertionError(f"the run ended after {len(kills)} of {args.cycles} kills: give it more --steps")
        result["invariants"] = check(files["trainer"], files["explorer"])
        result["ok"] = True
    except AssertionError as e:
        result.update(ok=False, error=str(e))
    (out / "soak_result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
