"""The explorer: real explore/bench runs as separate processes, SIGKILL and restart, runner failure modes, eval
metrics."""

import dataclasses
import json
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import entry
import pytest
import torch

import explore
import sync
import wire
import workflows
from buffer import Experience, ExperienceDB
from configs import cli, resolve_stages
from engines import EngineHandle, HFEngine
from helpers import kill_explorer_before_write, make_task, run_explorer, write_config
from models import load_tokenizer
from monitor import read_history
from sampling import PromptTooLong
from tasksets import TaskReader, load_tasks

ROOT = Path(__file__).resolve().parents[1]


def db_rows(tmp_path: Path) -> list[tuple]:
    db = next((tmp_path / "ck").rglob("*.db"))
    return (
        sqlite3.connect(db)
        .execute("SELECT group_id, run_id, model_version, explorer FROM experiences ORDER BY id")
        .fetchall()
    )


@pytest.mark.slow
def test_explore_mode_fills_the_db(tiny_model_dir, tmp_path):
    out = run_explorer(write_config(tmp_path, tiny_model_dir, **{"buffer.total_steps": 2}))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = db_rows(tmp_path)
    assert len(rows) == 2 * 3 * 2  # steps x tasks x repeat_times
    groups = [g for g, *_ in rows]
    assert len(set(groups)) == 6 and all(groups.count(g) == 2 for g in groups)  # one group per task
    assert {(r, v, e) for _, r, v, e in rows} == {(0, 0, "explorer"), (1, 0, "explorer")}
    meta = json.loads((tmp_path / "ck/p/e/explorer_meta.json").read_text())
    assert meta["latest_iteration"] == 2 and meta["reader"]["index"] == 6
    logged = next((tmp_path / "ck").rglob("log/explorer.log")).read_text()
    assert "eval/arith_test/accuracy/mean@2" in logged  # the final evaluation, in the role's log file
    assert "acc " in out.stderr  # and its accuracy on the console's short line


def expected_groups(config: Path, steps: int, batch: int) -> list[str]:
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=10**9)
    return [f"explorer/{t.epoch}/{t.task_id}" for t in reader.read(steps * batch)]


@pytest.mark.slow
def test_sigkill_mid_step_then_restart_neither_repeats_nor_skips(tiny_model_dir, tmp_path):
    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{"buffer.total_steps": 4, "buffer.explorer_input.taskset.data_selector": {"selector_type": "shuffle"}},
    )
    kill_explorer_before_write(config, tmp_path, 3)  # a known place: mid-step 3, generated but not in the DB
    killed_at = len(db_rows(tmp_path)) // 6
    assert killed_at == 2
    out = run_explorer(config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming explorer explorer after step {killed_at}" in out.stderr
    groups = list(dict.fromkeys(g for g, *_ in db_rows(tmp_path)))
    assert groups == expected_groups(config, steps=4, batch=3)  # every task once, in reading order
    assert len(db_rows(tmp_path)) == 4 * 3 * 2


@pytest.mark.slow
def test_bench_prints_accuracy_and_throughput(tiny_model_dir, tmp_path):
    """In this process (test_launch's stages test runs a bench stage through explore.py)."""
    out = run_explorer(write_config(tmp_path, tiny_model_dir, mode="bench"))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("bench step 0"))
    shown = json.loads(line.split(": ", 1)[1])
    assert 0.0 <= shown["bench/arith_test/accuracy/mean@2"] <= 1.0 and shown["bench/tokens_per_s"] > 0


# --- runners: failures never crash the explorer and never write partial experiences


class Raises(workflows.Workflow):
    def run(self):
        raise RuntimeError("boom")


class Hangs(workflows.Workflow):
    def run(self):
        time.sleep(60)


class Garbage(workflows.Workflow):
    def run(self):
        return [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=float("nan"))]


class FlakyOnce(workflows.Workflow):
    calls = 0

    def run(self):
        FlakyOnce.calls += 1
        if FlakyOnce.calls == 1:
            raise RuntimeError("first attempt fails")
        return [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=1.0, metrics={"accuracy": 1.0})]


class TooLong(workflows.Workflow):
    calls = 0

    def run(self):
        TooLong.calls += 1
        raise PromptTooLong("a prompt of 999 tokens exceeds model.max_prompt_tokens (16)")


def test_an_over_long_prompt_fails_once_without_retries(monkeypatch):
    monkeypatch.setitem(workflows.WORKFLOWS, "too_long", TooLong)
    exps, error = explore.run_task(make_task(workflow="too_long"), None, timeout=10, retries=3)
    assert (
        exps is None and "exceeds model.max_prompt_tokens" in error and TooLong.calls == 1
    )  # the same input: no retry


class LateThenGood:
    """Attempt 1 hangs past the timeout and fails late, while attempt 2 runs; attempt 2 succeeds after that failure.
    The order is chosen by events, not by sleeps (under load, a sleep's margin could put the late failure after
    attempt 2's end, and the test would pass without exercising the bug)."""

    calls = 0
    first: threading.Thread | None = None
    second_started = threading.Event()

    def __init__(self, task, model, auxiliary_models=None):
        pass

    def run(self):
        LateThenGood.calls += 1
        if LateThenGood.calls == 1:
            LateThenGood.first = threading.current_thread()
            LateThenGood.second_started.wait(60)  # abandoned at its timeout; fails once attempt 2 has started
            raise RuntimeError("attempt 1, abandoned at its timeout, failing late")
        LateThenGood.second_started.set()
        LateThenGood.first.join(60)  # attempt 1's thread has failed and stored its error (in its own box)
        return [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, reward=1.0)]


def test_an_abandoned_attempt_does_not_write_into_the_next_one(monkeypatch):
    """A timed-out attempt's thread is abandoned, not killed: when it fails later, its error stays its own (each
    attempt's closure binds its own result box; before, the late error landed in the next attempt's box and failed
    an attempt that had succeeded)."""
    monkeypatch.setitem(workflows.WORKFLOWS, "late_then_good", LateThenGood)
    task = make_task(workflow="late_then_good")
    exps, error = explore.run_task(task, None, timeout=1, retries=1)
    assert LateThenGood.calls == 2 and not LateThenGood.first.is_alive()
    assert error == "" and [x.reward for x in exps] == [1.0]


class Responses(workflows.Workflow):
    """Returns task.raw["runs"] experiences, each with info["episode"] = its entry (None: no episode)."""

    def run(self):
        out = [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, reward=1.0) for _ in self.task.raw["runs"]]
        for x, episode in zip(out, self.task.raw["runs"]):
            if episode is not None:
                x.info["episode"] = episode
        return out


@pytest.mark.parametrize(
    "runs, refused",
    [
        ([None, None, None], True),
        ([None, None], False),
        ([0, 0, 1, 1, 1], False),
        ([0, 1, 2], True),
        ([0, 0, None, None], True),
    ],
)
def test_more_responses_than_repeat_times_is_a_named_drop(monkeypatch, runs, refused):
    """A workflow returning more responses than the task's repeat_times (a multi-turn episode's turns, one
    info["episode"], are one response) is refused by name, not written as a bigger group (before: accepted)."""
    monkeypatch.setitem(workflows.WORKFLOWS, "responses", Responses)
    task = make_task(workflow="responses", repeat_times=2, raw={"runs": runs})
    exps, error = explore.run_task(task, None, timeout=10, retries=1)
    if not refused:
        assert len(exps) == len(runs) and error == ""
        return
    assert exps is None and error.reason == "output"
    assert "workflow responses returned 3 responses for a task of repeat_times 2" in error


class Blocked(workflows.Workflow):
    """Hangs until the test sets `release` (a workflow stuck past its timeout), counting its attempts."""

    release, calls = threading.Event(), 0

    def run(self):
        Blocked.calls += 1
        Blocked.release.wait(60)
        return [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, reward=1.0)]


def test_a_timed_out_task_is_not_retried_past_max_abandoned_threads(monkeypatch, caplog):
    """Each timed-out attempt leaves a thread that cannot be killed: once MAX_ABANDONED of them run, a timed-out task
    is dropped without a retry (one more stuck thread each), saying so (before: every retry left one more)."""
    monkeypatch.setitem(workflows.WORKFLOWS, "blocked", Blocked)
    monkeypatch.setattr(explore, "MAX_ABANDONED", explore.abandoned() + 2)
    Blocked.release.clear()
    try:
        with caplog.at_level("WARNING", logger="nanorft.explore"):
            first = explore.run_task(make_task(workflow="blocked", index=0), None, timeout=0.3, retries=3)
            assert Blocked.calls == 2  # two attempts: two abandoned threads, the most allowed
            second = explore.run_task(make_task(workflow="blocked", index=1), None, timeout=0.3, retries=3)
        assert Blocked.calls == 3 and first[0] is None and second[1].reason == "timeout"
        assert "task t/1: not retried:" in caplog.text and "abandoned: 3 such now" in second[1]
    finally:
        Blocked.release.set()
    deadline = time.monotonic() + 10
    while explore.abandoned() and time.monotonic() < deadline:  # released: they end
        time.sleep(0.05)
    assert explore.abandoned() == 0


SPIN_REWARD = """
def spin_reward(response, reference):
    while response == "spin":  # a CPU-bound reward that never ends
        pass
    return {"accuracy": 1.0}
"""


def test_a_reward_stuck_in_a_loop_ends_with_its_attempt(tmp_path):
    """A CPU-bound reward of the user's own runs in a worker process, killed when the task's attempt is up: the task
    is dropped for "reward" by name, and nothing of it runs on (before: its thread was abandoned, spinning for good
    and taking the GIL from the engine and every later task)."""
    path = tmp_path / "rewards.py"
    path.write_text(SPIN_REWARD)
    task = make_task(workflow="simple_workflow", reward_fn=f"{path}:spin_reward", repeat_times=2)

    class Spins:  # the model: one response of the two makes the reward spin
        model_version = 0

        def chat(self, messages, n=1, **sampling):
            return [
                Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, response_text=t) for t in ("ok", "spin")
            ]

    start = time.monotonic()
    exps, error = explore.run_task(task, Spins(), timeout=3, retries=1)
    assert exps is None and error.reason == "reward" and "spin_reward' gave no result within" in error, error
    assert time.monotonic() - start < 10  # two attempts of 3 s, the reward's worker started once or twice
    assert not [t for t in threading.enumerate() if t.name.startswith("workflow-")]  # no attempt runs on
    cpu = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - cpu < 0.3  # nothing spins in this process


STUCK_WORKFLOW = """
import time
from workflows.math import MathWorkflow

class StuckWorkflow(MathWorkflow):
    def run(self):
        if self.task.index == 1:
            while True:  # stuck in a loop for good, in the runner's thread (NOTE: one that never lets go of the GIL
                time.sleep(0.001)  # slows the engine in this process until it exits: docs/explorer.md)
        if self.task.index == 2:
            time.sleep(10**6)
        return super().run()
"""
ODD_REWARD = """
def spin_reward(response, reference):
    while str(reference)[-1] in "13579":  # tasks 4, 7, 8, 9, 13, 14, 17, 18 of the arith taskset: for good
        pass
    return {"accuracy": 1.0}
"""


@pytest.mark.slow
def test_stuck_user_code_neither_starves_the_other_tasks_nor_aborts_the_exit(tiny_model_dir, tmp_path):
    """An explorer process whose workflow is stuck on two tasks (a loop and a sleep, in threads that cannot be
    killed) and whose reward function spins on five others (in worker processes, killed at the attempt's
    timeout): every step writes the groups of every other task, the metrics name each drop and count the abandoned
    threads, and the process exits 0 within seconds of finishing (before: the spinning rewards' threads piled up
    until steps wrote 0 groups, and the exit aborted, SIGABRT, exit code 134)."""
    (tmp_path / "stuck.py").write_text(STUCK_WORKFLOW)
    (tmp_path / "odd.py").write_text(ODD_REWARD)
    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{
            "buffer.total_steps": 4,
            "buffer.batch_size": 6,
            "buffer.default_workflow_type": f"{tmp_path}/stuck.py:StuckWorkflow",
            "buffer.default_reward_fn_type": f"{tmp_path}/odd.py:spin_reward",
            "buffer.explorer_input.eval_tasksets": [],
            "explorer.max_timeout": 8,
            "explorer.max_retry_times": 0,
            "explorer.runner_per_model": 6,
            "explorer.max_refill_rounds": 0,  # the tasks as read: refills are test_dropped_tasks_are_refilled_...'s
        },
    )
    log = tmp_path / "explorer.log"
    proc = entry.start("explore.py", "--config", str(config), log=log)
    deadline = time.monotonic() + 400
    while "finished at step" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    finished = time.monotonic()
    code = proc.wait(60)
    exit_seconds = time.monotonic() - finished
    assert code == 0, log.read_text()[-3000:]
    assert exit_seconds < 15, exit_seconds  # measured: ~1 s
    written = sorted({int(g.rsplit("/", 1)[1]) for g, *_ in db_rows(tmp_path)})
    assert written == [0, 3, 5, 6, 10, 11, 12, 15, 16, 19, 20, 21, 22, 23], written  # all but 1, 2, odd rewards'
    history = read_history(next((tmp_path / "ck").rglob("monitor/explorer.jsonl")))
    assert [h["rollout/finished_task_count"] for h in history] == [3, 3, 3, 5]
    assert [h.get("rollout/dropped/reward", 0) for h in history] == [1, 3, 3, 1]
    assert history[0]["rollout/dropped/timeout"] == 2 and history[0]["rollout/abandoned_threads"] == 2
    assert "arith/1 (timeout)" in history[0]["rollout/dropped_errors"]
    assert "arith/4 (reward): RewardError: reward function" in history[0]["rollout/dropped_errors"]
    assert "workflow thread(s) abandoned at their timeout still run: the explorer exits without them" in log.read_text()


@pytest.fixture(scope="module")
def handle(tiny_model_dir):
    engine = HFEngine(tiny_model_dir)
    yield EngineHandle(engine, load_tokenizer(tiny_model_dir))
    engine.close()


def test_failing_workflows_are_counted_not_raised(tiny_model_dir, tmp_path, monkeypatch, handle):
    monkeypatch.setitem(workflows.WORKFLOWS, "raises", Raises)
    monkeypatch.setitem(workflows.WORKFLOWS, "hangs", Hangs)
    monkeypatch.setitem(workflows.WORKFLOWS, "garbage", Garbage)
    monkeypatch.setitem(workflows.WORKFLOWS, "flaky", FlakyOnce)
    (cfg,) = resolve_stages(
        cli(
            [
                "--config",
                str(write_config(tmp_path, tiny_model_dir)),
                "--explorer.max_timeout",
                "0.5",
                "--explorer.max_retry_times",
                "1",
            ]
        )[0]
    )
    tasks = load_tasks(cfg.buffer.explorer_input.tasksets[0])[:5]
    tasks = [
        dataclasses.replace(t, workflow=w)
        for t, w in zip(tasks, ["raises", "hangs", "garbage", "flaky", "math_workflow"])
    ]
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = explore.run_tasks(pool, tasks[:4], [handle], cfg)  # none of these does work: 0.5 s is ages
        assert time.monotonic() - start < 30  # the hung workflow (60 s) was abandoned after 2 x 0.5 s
        # NOTE: the real workflow without the 0.5 s limit: a generation on a busy machine can take longer
        results += explore.run_tasks(
            pool,
            tasks[4:],
            [handle],
            dataclasses.replace(cfg, explorer=dataclasses.replace(cfg.explorer, max_timeout=600)),
        )
    errors = [err for _, _, err in results]
    assert [got is None for _, got, _ in results] == [True, True, True, False, False]
    assert "boom" in errors[0] and "timed out after 0.5 s" in errors[1] and "not a finite number" in errors[2]
    assert FlakyOnce.calls == 2  # retried once, then succeeded
    metrics = explore.rollout_metrics(results, 1.0)
    assert metrics["rollout/failed_count"] == 3 and metrics["rollout/finished_task_count"] == 2


def test_eval_metrics_by_hand():
    def exp(acc: float) -> Experience:
        return Experience(tokens=torch.tensor([1, 2]), prompt_length=1, reward=acc, metrics={"accuracy": acc})

    results = [(None, [exp(1), exp(0), exp(1), exp(1)], ""), (None, [exp(0)] * 4, ""), (None, None, "failed")]
    m = explore.eval_metrics("t", results, k=4)
    assert m["eval/t/accuracy/mean@4"] == pytest.approx((0.75 + 0.0) / 2)
    assert m["eval/t/accuracy/best@4"] == pytest.approx(0.5) and m["eval/t/accuracy/worst@4"] == 0.0
    assert m["eval/t/finished_task_count"] == 2 and m["eval/t/failed_count"] == 1
    assert not [k for k in m if "over_tasks" in k]
    d = explore.eval_metrics("t", results, k=4, detailed=True)  # monitor.detailed_stats: across the task means
    assert d["eval/t/accuracy/max_over_tasks@4"] == 0.75 and d["eval/t/accuracy/min_over_tasks@4"] == 0.0
    assert d["eval/t/accuracy/std_over_tasks@4"] == pytest.approx(0.375)


def test_a_reward_component_that_only_some_responses_have_is_averaged_over_those(tmp_path):
    """A reward function that adds a component to some responses only (before: the metrics took the first
    response's keys, a KeyError that stopped the explorer at every step, on every relaunch). Each task's value is
    the mean over its runs that have it; /count says how many responses had it when some did not."""

    def exp(reward: float, **metrics: float) -> Experience:
        return Experience(tokens=torch.tensor([1, 2]), prompt_length=1, reward=reward, metrics=dict(metrics))

    results = [
        (None, [exp(1, accuracy=1), exp(0.5, accuracy=0, bonus=0.5)], ""),
        (None, [exp(0, accuracy=0, note="text"), exp(0, accuracy=0)], ""),
        (None, [exp(2, accuracy=1, bonus=1.0), exp(1, accuracy=1)], ""),
    ]
    m = explore.rollout_metrics(results, 1.0)
    assert m["rollout/accuracy/mean"] == pytest.approx(0.5) and "rollout/accuracy/count" not in m
    assert m["rollout/bonus/mean"] == 0.75 and m["rollout/bonus/max"] == 1.0 and m["rollout/bonus/min"] == 0.5
    assert m["rollout/bonus/count"] == 2 and not [k for k in m if "note" in k]
    e = explore.eval_metrics("t", results, k=2)
    assert e["eval/t/bonus/mean@2"] == 0.75 and e["eval/t/bonus/count"] == 2 and e["eval/t/bonus/best@2"] == 0.75
    assert e["eval/t/accuracy/mean@2"] == pytest.approx(0.5) and "eval/t/accuracy/count" not in e


def test_env_vars_are_set_for_runners(tiny_model_dir, tmp_path, monkeypatch):
    seen = []

    class EnvCheck(workflows.Workflow):
        def run(self):
            seen.append(os.environ.get("NANORFT_TEST_VAR"))
            return [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=0.0)]

    monkeypatch.setitem(workflows.WORKFLOWS, "env_check", EnvCheck)
    monkeypatch.setenv("NANORFT_TEST_VAR", "unset")  # restored after the test
    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{
            "explorer.env_vars": {"NANORFT_TEST_VAR": "42"},
            "buffer.total_steps": 1,
            "buffer.default_workflow_type": "env_check",
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    assert explore.explore(cfg) == 0
    assert seen == ["42"] * 3


@pytest.mark.slow
def test_group_sync_versions_and_trainer_stop(tiny_model_dir, tmp_path):
    """sync_method nccl (gloo on CPU) with a fake trainer process: each step's experiences carry the version
    received at the previous sync point; when the trainer sends stop, the explorer exits 1 with one clear line."""
    over = {
        "mode": "both",
        "synchronizer.sync_method": "nccl",
        "synchronizer.sync_interval": 1,
        "synchronizer.sync_timeout": 60,
        "buffer.explorer_input.eval_tasksets": [],
        "buffer.total_steps": 3,
    }
    config = write_config(tmp_path, tiny_model_dir, **over)
    job = tmp_path / "ck/p/e"
    trainer = entry.start(
        "tests/test_sync.py", "fake_trainer", tiny_model_dir, str(job), "2", log=tmp_path / "trainer2.log"
    )
    out = run_explorer(config)  # 3 steps: sync points after steps 1, 2
    assert trainer.wait(timeout=60) == 0, trainer.out.read_text()[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    assert [v for _, _, v, _ in db_rows(tmp_path)] == [0] * 6 + [1] * 6 + [2] * 6
    # a restart for 3 more steps: this trainer (restarted without a checkpoint) sends one version, then stop; the
    # explorer, restarted after step 3, waits for version 3 before its first rollout (sync.ExplorerSync.resume)
    config = write_config(tmp_path, tiny_model_dir, **{**over, "buffer.total_steps": 6})
    trainer = entry.start(
        "tests/test_sync.py", "fake_trainer", tiny_model_dir, str(job), "1", log=tmp_path / "trainer1.log"
    )
    out = run_explorer(config)
    assert trainer.wait(timeout=60) == 0
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "the trainer finished and sent stop" in errors[0], errors


@pytest.mark.slow
def test_bad_input_stops_the_explorer_with_a_named_message_and_no_traceback(tiny_model_dir, tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    lines = (Path(tiny_model_dir).parent / "arith" / "train.jsonl").read_bytes().splitlines(keepends=True)
    (data / "train.jsonl").write_bytes(b"".join(lines[:4]) + b'{"question": "x", "answer": \n' + lines[4])
    out = run_explorer(write_config(tmp_path, tiny_model_dir, **{"buffer.explorer_input.taskset.path": str(data)}))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{data / 'train.jsonl'}: line 5: not valid JSON" in out.stderr
    db = tmp_path / "other.db"
    db.write_bytes(b"some notes\n")
    out = run_explorer(
        write_config(tmp_path, tiny_model_dir, **{"buffer.trainer_input.experience_buffer.path": f"sqlite:///{db}"})
    )
    code, err = out.returncode, out.stderr
    assert code == 2 and f"{db} is not a SQLite database" in err and db.read_bytes() == b"some notes\n"


# --- a restart in mode both: the weights of the interrupted sync point first (sync.ExplorerSync.resume)


class VersionEngine:
    """The engine surface sync.ExplorerSync uses: model_version, load_weights recording what came, and sleep / wake_up
    (a GPU shared with the trainer) recorded in the same list."""

    def __init__(self, version: int = 0) -> None:
        self.model_version, self.loaded = version, []

    def load_weights(self, source, version: int) -> None:
        self.loaded.append((version, "folder" if isinstance(source, str) else "group"))
        self.model_version = version

    def sleep(self) -> None:
        self.loaded.append("sleep")

    def wake_up(self) -> None:
        self.loaded.append("wake_up")


def restarted(
    tmp_path: Path,
    db_url: str,
    step: int,
    method: str,
    engine: VersionEngine,
    colocate: bool = False,
    timeout: float = 60,
):
    """An Explorer as set_up leaves it after a restart after `step` (sync_interval 1: it needs the weights of
    `step`); `colocate`: on one GPU with the trainer."""
    from types import SimpleNamespace

    from buffer import ExperienceDB

    cfg = SimpleNamespace(
        checkpoint_job_dir=str(tmp_path),
        explorer=SimpleNamespace(name="explorer"),
        synchronizer=SimpleNamespace(
            sync_method=method, sync_style="fixed", sync_interval=1, sync_offset=0, sync_timeout=timeout
        ),
        buffer=SimpleNamespace(batch_size=2, train_batch_size=4),
        algorithm=SimpleNamespace(repeat_times=2),
        cluster=SimpleNamespace(colocate=colocate),
    )
    db = ExperienceDB(db_url)
    return SimpleNamespace(
        cfg=cfg, db=db, step=step, engine=engine, sync=sync.ExplorerSync(cfg, db, engine), pipeline=None
    )


@pytest.mark.parametrize("colocate", [False, True])
def test_a_restarted_explorer_waits_for_the_weights_its_step_needs(tmp_path, tiny_model_dir, colocate):
    """Checkpoint sync, restarted after step 2, the trainer's checkpoint at 1: no rollout on the base model; it waits
    for the folder of 2, which the trainer publishes as it retrains (after the one of its resume, 1). On a GPU shared
    with the trainer, the engine sleeps while it waits (the trainer retrains on that GPU), and wakes up after."""
    import threading

    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    x = restarted(tmp_path, f"sqlite:///{tmp_path}/exp.db", 2, "checkpoint", VersionEngine(), colocate)

    def trainer() -> None:  # one after the other, as a trainer publishes (two threads could finish 2 before 1)
        for k in (1, 2):
            time.sleep(0.3)
            sync.publish_hf(model, tok, tmp_path, step=k)

    publisher = threading.Thread(target=trainer)
    publisher.start()
    assert x.sync.resume(x.step) is None
    publisher.join()
    assert x.engine.model_version == 2
    assert x.engine.loaded == (["sleep", (2, "folder"), "wake_up"] if colocate else [(2, "folder")])
    x.engine = x.sync.engine = VersionEngine(2)  # already there: nothing to wait for or load
    assert x.sync.resume(x.step) is None and x.engine.loaded == []


def test_a_restarted_explorer_stops_when_only_older_weights_load(tmp_path, tiny_model_dir, monkeypatch):
    """Checkpoint sync, restarted after step 2: the folder of 2 fails to load and the pointer meanwhile says 1 (a
    trainer rewinding), so load_published's retry loads 1: the explorer stops with exit code 1 naming it, not
    exit 0 as if the trainer had finished."""
    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for k in (1, 2):
        sync.publish_hf(model, tok, tmp_path, step=k)
    monkeypatch.setattr(sync.time, "sleep", lambda _: None)

    class Failing(VersionEngine):
        def load_weights(self, source, version: int) -> None:
            if version == 2:
                sync.set_latest(tmp_path, 1)
                raise OSError("being replaced")
            super().load_weights(source, version)

    x = restarted(tmp_path, f"sqlite:///{tmp_path}/exp.db", 2, "checkpoint", Failing())
    assert x.sync.resume(x.step) == 1
    assert x.engine.loaded == [(1, "folder")]


@pytest.mark.parametrize("damaged, colocate", [(False, False), (True, False), (False, True)])
def test_a_restarted_explorer_takes_the_retrained_versions_over_the_group(tmp_path, tiny_model_dir, damaged, colocate):
    """Process-group sync, restarted after step 3: the trainer resumes from its checkpoint at 1 (published at its
    resume) and sends versions 2 and 3 as it retrains; the explorer takes them in order before its first rollout.
    `damaged`: the checkpoint pointer says 2, whose checkpoint is damaged, so the trainer resumes from 1 all the
    same (checkpoint.latest_checkpoint skips it): the explorer goes by the step the trainer announces, not the
    pointer (it waited for the folder of 2, which never came, and stopped after sync_timeout). `colocate`: on a GPU
    shared with the trainer, the engine sleeps while the trainer retrains each version."""
    import threading

    import checkpoint
    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for step in (1, 2) if damaged else (1,):  # the killed run's checkpoints (the trainer state alone will do)
        state = tmp_path / f"global_step_{step}" / "actor" / "trainer_state.json"
        state.parent.mkdir(parents=True)
        state.write_text("{}")
        checkpoint.write_manifest(state.parent.parent)
        (tmp_path / checkpoint.CKPT_POINTER).write_text(f"{step}\n")
    if damaged:
        (tmp_path / "global_step_2" / "actor" / "trainer_state.json").write_text('{"x": 1}')
    resumed = checkpoint.latest_checkpoint(tmp_path)  # what train.py resumes from
    assert resumed == 1
    sync.publish_hf(model, tok, tmp_path, step=resumed)  # the trainer's resume: the pointer rewound to its step
    x = restarted(tmp_path, f"sqlite:///{tmp_path}/exp.db", 3, "nccl", VersionEngine(), colocate, timeout=10)
    sender = wire.open_sender(tmp_path, "cpu", 60, resumed=resumed)
    sending = threading.Thread(target=lambda: [wire.send_model(sender, model, v) for v in (2, 3)])
    sending.start()
    assert x.sync.resume(x.step) is None
    sending.join(60)
    wire.close_sender(sender, grace=0.1)
    each = ["sleep", "wake_up"] if colocate else []
    assert x.engine.loaded == [*each[:1], (2, "group"), *each[1:], *each[:1], (3, "group"), *each[1:]]
    assert x.sync.after_step(x.step) == (None, {})  # step 3's sync point: its weights are there, nothing to wait for


def test_a_restarted_explorer_behind_the_trainers_resume_loads_its_files(tmp_path, tiny_model_dir):
    """Process-group sync, restarted after step 2, the trainer resumed from its checkpoint at 3 (past 2): no version
    of 2 or 3 will come over the group; the explorer loads the folder the trainer published at its resume."""
    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    sync.publish_hf(model, tok, tmp_path, step=3)
    sender = wire.open_sender(tmp_path, "cpu", 60, resumed=3)
    x = restarted(tmp_path, f"sqlite:///{tmp_path}/exp.db", 2, "nccl", VersionEngine())
    assert x.sync.resume(x.step) is None
    wire.close_sender(sender, grace=0.1)
    assert x.engine.loaded == [(3, "folder")]


def damage_weights(folder: Path, how: str) -> None:
    """Damage a published HF folder as a disk or a person would: cut its weights file, overwrite its header, delete
    its config."""
    weights = folder / "model.safetensors"
    if how == "cut":
        os.truncate(weights, weights.stat().st_size // 2)
    elif how == "header":
        with open(weights, "r+b") as f:
            f.seek(8)
            f.write(b"\x00garbage" * 4)
    else:
        (folder / "config.json").unlink()


@pytest.mark.parametrize("how", ["cut", "header", "config"])
def test_the_explorer_falls_back_to_the_newest_undamaged_published_weights(
    tmp_path, tiny_model_dir, how, caplog, monkeypatch
):
    """As the trainer skips a damaged checkpoint: a restarted explorer starts from the newest undamaged published
    folder up to the pointer, naming the damaged one; at a sync point a damaged folder is skipped for the newest
    undamaged newer than the engine's, or the engine keeps its weights. Before, the explorer loaded the pointer's
    folder blindly and died with a raw SafetensorError (or HFValidationError for a missing step)."""
    import types

    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    for k in (2, 3):  # (publishing prunes all but the step before the newest)
        sync.publish_hf(model, tok, tmp_path, step=k)
    assert all(not sync.damage(sync.weights_path(tmp_path, k)) for k in (2, 3))
    damage_weights(sync.weights_path(tmp_path, 3), how)
    assert str(sync.weights_path(tmp_path, 3)) in sync.damage(sync.weights_path(tmp_path, 3))
    cfg = types.SimpleNamespace(checkpoint_job_dir=str(tmp_path))
    with caplog.at_level("WARNING"):
        assert sync.start_weights(cfg) == (str(sync.weights_path(tmp_path, 2)), 2)
    assert "the published weights of step 3 are damaged and skipped" in caplog.text
    monkeypatch.setattr(sync.time, "sleep", lambda _: None)
    engine = VersionEngine(1)
    assert sync.load_published(engine, str(tmp_path), 3) == 2 and engine.loaded == [(2, "folder")]
    engine = VersionEngine(2)
    assert sync.load_published(engine, str(tmp_path), 3) == 2 and engine.loaded == []
    assert "goes on with its weights" in caplog.text


def test_an_engine_whose_start_weights_are_pruned_as_it_loads_starts_on_the_newest(tmp_path, tiny_model_dir, caplog):
    """A restarted explorer picks the pointer's folder (step 1); before its engine has read it, the trainer publishes
    steps 2 and 3, and publishing 3 prunes step 1. The engine starts again on step 3. Seen in the kill-and-restart
    soak under load: the explorer died with an HFValidationError for the vanished folder. Any other failure is
    raised as it is."""
    import types

    from models import load_model

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    cfg = types.SimpleNamespace(checkpoint_job_dir=str(tmp_path))
    sync.publish_hf(model, tok, tmp_path, step=1)
    tried = []

    def make(path: str) -> str:
        tried.append(path)
        if len(tried) == 1:  # the trainer moves on while this engine starts
            for k in (2, 3):
                sync.publish_hf(model, tok, tmp_path, step=k)
            return str(load_model(path))  # the folder is gone: transformers' HFValidationError (an OSError)
        return "engine"

    with caplog.at_level("WARNING"):
        assert sync.start_engine(cfg, tiny_model_dir, make) == ("engine", 3)
    assert tried == [str(sync.weights_path(tmp_path, k)) for k in (1, 3)]
    assert "the weights of step 1 were deleted as the engine loaded them" in caplog.text

    def broken(path: str) -> str:
        raise RuntimeError("engine core failed")

    with pytest.raises(RuntimeError, match="engine core failed"):  # the folder is there: not the pruning
        sync.start_engine(cfg, tiny_model_dir, broken)


def test_a_pointer_naming_a_step_without_usable_weights_is_a_named_error(tmp_path, tiny_model_dir):
    import types

    from models import load_model
    from tasksets import DataError

    cfg = types.SimpleNamespace(checkpoint_job_dir=str(tmp_path))
    sync.set_latest(tmp_path, 7)  # a step whose folder was never written (or was deleted)
    with pytest.raises(DataError, match=r"latest_state_dict_iteration.txt names step 7, and no published weights"):
        sync.start_weights(cfg)
    sync.publish_hf(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), tmp_path, step=7)
    damage_weights(sync.weights_path(tmp_path, 7), "cut")
    with pytest.raises(DataError, match="restart the trainer"):
        sync.start_weights(cfg)


def test_a_full_disk_under_the_explorers_meta_file_warns_and_the_step_is_in_the_db(tmp_path, monkeypatch, caplog):
    """<name>_meta.json is for people and tools; the position a restart reads is in the DB, written first. A full
    disk there (the DB elsewhere) is a warning, not a traceback, and leaves no temporary file behind."""
    import errno

    x = restarted(tmp_path, f"sqlite:///{tmp_path}/exp.db", 3, "checkpoint", VersionEngine(0))
    x.reader = TaskReader([], total_epochs=1)

    def full(path):
        Path(path).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    real = sync.write_atomic
    monkeypatch.setattr(sync, "write_atomic", lambda path, write: real(path, lambda p: full(p)))
    with caplog.at_level("WARNING"):
        explore.write(x, [])
    assert "could not write" in caplog.text and "the explorer's position is in the DB" in caplog.text
    assert x.db.explorer_states()["explorer"]["step"] == 3
    assert not list(tmp_path.glob(".*tmp-*")) and not (tmp_path / "explorer_meta.json").exists()


# --- dynamic sampling (DAPO): the explorer over-samples


# each task's group rewards: "tie" (all 1.0), "vary" ([0, 1]), None (the task failed)
KINDS = ["tie", "vary", "tie", None, "vary", "tie", "vary", "vary"]


class Reader:
    """A taskset of len(KINDS) tasks, each its index, read in order."""

    def __init__(self, size: int = len(KINDS)) -> None:
        self.index, self.size = 0, size

    def read(self, n: int) -> list[int]:
        out = list(range(self.index, min(self.index + n, self.size)))
        self.index += len(out)
        return out


def fake_batch(x, tasks: list[int]) -> list:
    """explore.run_batch without runners: each task's group by KINDS."""
    x.batches.append(tasks)
    rewards = {"tie": [1.0, 1.0], "vary": [0.0, 1.0]}
    return [
        (t, None, "boom")
        if KINDS[t] is None
        else (t, [Experience(torch.arange(3), 1, reward=r, group_id=f"g{t}") for r in rewards[KINDS[t]]], "")
        for t in tasks
    ]


@pytest.mark.parametrize(
    "cap, size, written, metrics, note",
    [
        # 3 batches: [0 1 2] gives 1 varied group, [3 4] 1 more (3 failed), [5] none: the cap; tied 0 fills the step
        (3, 8, [0, 1, 4], (3, 3, 2, 1, 1.0), "max_num_gen_batches reached; 1 tied groups fill it"),
        # a fourth batch [6] completes it: no tied group is written
        (4, 8, [1, 4, 6], (4, 4, 3, 0, 0.0), None),
        # the taskset ends after task 3: the step is what there is, filled with the tied 0 and 2; not the cap
        (10, 4, [0, 1, 2], (2, 1, 0, 2, 0.0), "the tasksets ran out; 2 tied groups fill it"),
    ],
)
def test_dynamic_sampling_runs_more_tasks_until_the_step_has_varied_groups(
    monkeypatch, caplog, cap, size, written, metrics, note
):
    """fill_groups by hand: each extra batch is as many tasks as the varied groups still missing (batch_size 3);
    written are the varied groups, filled up with tied ones at the cap, in reading order; the metrics count the
    batches, extra tasks, dropped and kept tied groups and whether the cap was hit; the reader has moved past
    every task run."""
    monkeypatch.setattr(explore, "run_batch", fake_batch)
    cfg = cli(["--config", str(ROOT / "configs/tiny.yaml")])[0]
    cfg.buffer.batch_size = 3
    x = type(
        "X", (), {"cfg": cfg, "reader": Reader(size), "step": 6, "gen_batches": cap, "batches": [], "pipeline": None}
    )()
    first = explore.run_batch(x, x.reader.read(3))
    with caplog.at_level("WARNING", logger="nanorft.explore"):
        results, ran, got = explore.fill_groups(x, first)
    assert [t for t, _, _ in results] == written and [t for t, _, _ in ran] == [t for b in x.batches for t in b]
    keys = ("num_gen_batches", "extra_tasks", "dropped_groups", "tied_groups_kept", "cap_hit")
    assert tuple(got[f"rollout/dynamic_sampling/{k}"] for k in keys) == metrics
    assert x.reader.index == len(ran)
    assert (note is None and not caplog.text) or "dynamic sampling: step 7 has" in caplog.text and note in caplog.text


DROPPED = {1, 3, 4}  # the tasks whose workflow fails (after its retries) in test_dropped_tasks_are_refilled...


def dropping_batch(x, tasks: list[int]) -> list:
    """explore.run_batch without runners: tasks in DROPPED fail, the others give a group of two."""
    x.batches.append(tasks)
    return [
        (t, None, "boom")
        if t in DROPPED
        else (t, [Experience(torch.arange(3), 1, reward=1.0, group_id=f"g{t}") for _ in "ab"], "")
        for t in tasks
    ]


@pytest.mark.parametrize(
    "rounds, batches, written, metrics",
    [
        (0, [[0, 1, 2]], [0, 2], (1, 0, 1)),  # no refill: the step is short by task 1
        (2, [[0, 1, 2], [3], [4]], [0, 2], (3, 2, 1)),  # each round one more in place of the dropped one, all dropped
        (3, [[0, 1, 2], [3], [4], [5]], [0, 2, 5], (3, 3, 0)),  # the third round completes the step
    ],
)
def test_dropped_tasks_are_refilled_from_the_reader_up_to_max_refill_rounds(
    monkeypatch, rounds, batches, written, metrics
):
    """explore.rollout (no dynamic sampling): the tasks dropped are replaced by as many read next, for at most
    explorer.max_refill_rounds rounds; what is written are the groups that came, in reading order; the metrics count
    the dropped tasks, the extra ones and the groups still missing; the reader has moved past every task run, so that
    the position saved with the step neither repeats nor skips one."""
    monkeypatch.setattr(explore, "run_batch", dropping_batch)
    cfg = cli(["--config", str(ROOT / "configs/tiny.yaml")])[0]
    cfg.buffer.batch_size, cfg.explorer.max_refill_rounds = 3, rounds
    x = type("X", (), {"cfg": cfg, "reader": Reader(8), "step": 0, "gen_batches": 1, "batches": [], "pipeline": None})()
    exps, got = explore.rollout(x, x.reader.read(3))
    assert x.batches == batches and x.reader.index == sum(len(b) for b in batches)
    assert [x.group_id for x in exps] == [f"g{t}" for t in written for _ in "ab"]
    keys = ("failed_count", "refilled_tasks", "missing_tasks")
    assert tuple(got[f"rollout/{k}"] for k in keys) == metrics


def test_the_experiences_of_a_task_whose_prompt_was_cut_as_read_are_marked_prompt_truncated():
    """A prompt cut by characters as it was read (tasksets.prompt_bound) gets no loss, as the engine's own cut."""
    exps = [Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, reward=1.0) for _ in range(2)]
    explore.stamp(exps, make_task(prompt_cut=5_000_000), "e")
    assert [x.truncate_status for x in exps] == ["prompt_truncated"] * 2
    explore.stamp(more := [Experience(tokens=torch.tensor([1, 2]), prompt_length=1, reward=0.0)], make_task(), "e")
    assert more[0].truncate_status is None


def test_a_huge_question_is_cut_by_characters_before_the_engine_and_stored_cut(tmp_path, tiny_model_dir, caplog):
    """Issue 46: a 10 MB question was tokenised whole and its text stored repeat_times times. The explorer cuts it by
    characters as it reads the taskset (32 x max_prompt_tokens 160): its experiences hold the cut prompt, marked
    prompt_truncated, the others are as they were."""
    data = tmp_path / "data"
    data.mkdir()
    lines = (Path(tiny_model_dir).parent / "arith" / "train.jsonl").read_text().splitlines(keepends=True)
    huge = json.dumps({"question": "7 " * 2_500_000 + "What is 1+1?", "answer": "2"}) + "\n"
    (data / "train.jsonl").write_text(lines[0] + huge + lines[1])
    db = tmp_path / "e.db"
    over = {
        "buffer.explorer_input.taskset.path": str(data),
        "buffer.explorer_input.eval_tasksets": [],
        "buffer.total_steps": 1,
        "buffer.trainer_input.experience_buffer.path": f"sqlite:///{db}",
    }
    out = run_explorer(write_config(tmp_path, tiny_model_dir, **over))
    assert out.returncode == 0, out.stderr
    with ExperienceDB(f"sqlite:///{db}") as d:
        exps = d.get([r[0] for r in d.query("SELECT id FROM experiences")])
    by_task = {t: [x for x in exps if x.task_id == t] for t in ("arith/0", "arith/1", "arith/2")}
    assert [len(v) for v in by_task.values()] == [2, 2, 2]
    for x in by_task["arith/1"]:
        assert x.truncate_status == "prompt_truncated" and x.prompt_length <= 160
        assert 32 * 160 <= len(x.prompt_text) < 32 * 160 + 500 and x.prompt_text.rstrip().endswith("assistant")
    assert all(x.truncate_status != "prompt_truncated" for t in ("arith/0", "arith/2") for x in by_task[t])
