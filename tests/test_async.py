"""Asynchronous RFT with real processes: the trainer (mode train) and explorers (mode explore) started
separately, in either order, a second explorer joining, SIGKILL + restart of either side (the soak
script), and the failure modes: no explorer, no trainer, a DB of another model or schema. The tests that meet
through the experience DB run on a back-end each (`url`: the default SQLite file, a PostgreSQL database), the kills
and the refusals on both. NOTE: each back-end under several writer and reader processes, its claims, staleness and
upgrades are tests/test_buffer_db.py's, on both; what these add is the processes' own story, the same on either."""

import json
import time
from pathlib import Path

import entry
import pytest
import safetensors.torch
import torch
import yaml

from buffer import SCHEMA_VERSION, ExperienceDB
from helpers import (
    Entry,
    both_config,
    raw,
    run_explorer,
    run_train,
    write_yaml,
)
from monitor import read_history

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    """The run's experience DB: the SQLite file that the config derives in the job dir, or a new PostgreSQL
    database (which `pair` then sets as buffer.trainer_input.experience_buffer.path)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/ck/nanorft/tiny_async/buffer/tiny_async_buffer.db"
    return request.getfixturevalue("postgres").database()


def pair(tmp_path: Path, tiny_model_dir: str, url: str = "", **over) -> dict[str, Path]:
    """configs/async/tiny_{trainer,explorer,explorer_new}.yaml made small: 6 train steps of 3 tasks x 2; a
    PostgreSQL `url` as the experience DB."""
    if url.startswith("postgresql://"):
        over = {"buffer.trainer_input.experience_buffer.path": url, **over}
    data = str(Path(tiny_model_dir).parent / "arith")
    files = {}
    for role in ("trainer", "explorer", "explorer_new"):
        cfg = yaml.safe_load((ROOT / f"configs/async/tiny_{role}.yaml").read_text())
        for ts in [cfg["buffer"]["explorer_input"]["taskset"], *cfg["buffer"]["explorer_input"]["eval_tasksets"]]:
            ts["path"] = data
        files[role] = write_yaml(
            tmp_path / f"{role}.yaml",
            cfg,
            {
                "checkpoint_root_dir": str(tmp_path / "ck"),
                "model.model_path": tiny_model_dir,
                "model.max_response_tokens": 12,
                "buffer.total_steps": 6,
                "buffer.batch_size": 3,
                "algorithm.repeat_times": 2,
                "explorer.runner_per_model": 6,
                "explorer.eval_interval": 1000,
                "explorer.eval_on_startup": False,
                "trainer.save_interval": 3,
                "monitor.monitor_type": "none",
                "buffer.trainer_input.experience_buffer.max_read_timeout": 120,
                "synchronizer.sync_timeout": 120,
                **over,
            },
        )
    return files


# train.py as the launcher starts it: the trainer itself. NOTE: without it, train.py hands over to the launcher, which
# starts the trainer as a second process (~5 s of CPU more); test_trainer_first_then_two_explorers keeps that way in
LAUNCHED = {"NANORFT_LAUNCHED": "1"}


def start(config: Path, script: str, log: Path, env: dict | None = None) -> Entry:
    return entry.start(script, "--config", str(config), log=log, env=env)


def meta(url: str, key: str) -> str | None:
    """A meta value of the DB as another process sees it (None while the file or table is missing)."""
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return None  # NOTE: connecting would create an empty file
    try:
        rows = raw(url, "SELECT value FROM meta WHERE key = ?", (key,))
    except Exception as e:  # sqlite3.OperationalError, psycopg.errors.UndefinedTable: no meta table yet
        if "meta" not in str(e):
            raise
        return None
    return rows[0][0] if rows else None


def wait_for(predicate, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.parametrize("url", ["postgresql"], indirect=True)  # where several explorers write (docs/scale-out.md)
@pytest.mark.slow
def test_trainer_first_then_two_explorers(tmp_path, tiny_model_dir, url):
    """Trainer before any explorer (it waits and says so); explorer joins; a second explorer (another name,
    another task order) joins while they run; the trainer ends after its steps and the explorers stop at
    their next sync point. Metrics are kept per explorer; the trainer logs versions, staleness and the
    rollout-vs-trainer mismatch."""
    files, job = pair(tmp_path, tiny_model_dir, url), tmp_path / "ck/nanorft/tiny_async"
    logs = {r: tmp_path / f"{r}.log" for r in files}
    trainer = start(files["trainer"], "train.py", logs["trainer"])  # through the launcher, as a user starts it
    wait_for(
        lambda: "waiting for experiences: 0 of 6 ready" in logs["trainer"].read_text(), "the trainer's waiting note"
    )
    assert "explorers: none has written to this DB yet" in logs["trainer"].read_text()
    explorer = start(files["explorer"], "explore.py", logs["explorer"])
    wait_for(lambda: meta(url, "explorer/explorer") is not None, "the first explorer step")
    new = start(files["explorer_new"], "explore.py", logs["explorer_new"])
    codes = [p.wait(timeout=300) for p in (trainer, explorer, new)]
    assert codes == [0, 0, 0], {r: logs[r].read_text()[-2000:] for r in logs}

    with ExperienceDB(url) as d:
        writers = dict(d.query("SELECT explorer, COUNT(*) FROM experiences GROUP BY explorer"))
        states = {k: json.loads(v) for k, v in d.meta_items("explorer/").items()}
        assert json.loads(d.get_meta("trainer"))["status"] == "finished"
        assert d.counts()["claims"] == 6 * 6
    assert set(writers) == {"explorer", "explorer_new"} and all(n % 2 == 0 for n in writers.values()), writers
    assert all(s["finished"] for s in states.values()) and set(states) == {"explorer/explorer", "explorer/explorer_new"}
    assert (
        json.loads((job / "explorer_new_meta.json").read_text())["latest_iteration"]
        == states["explorer/explorer_new"]["step"]
    )
    # per-explorer metrics: each explorer's own history; the trainer counts where its batches came from
    for name in ("explorer", "explorer_new"):
        assert any("rollout/reward/mean" in r for r in read_history(job / f"monitor/{name}.jsonl"))
    history = read_history(job / "monitor/trainer.jsonl")
    assert [r["step"] for r in history] == list(range(1, 7))
    assert all(
        r["sample/model_version/min"] <= r["sample/model_version/mean"] <= r["sample/model_version/max"] < r["step"]
        and r["batch/staleness/max"] <= 4
        for r in history
    )  # staleness_control max_staleness 4
    assert {k for r in history for k in r if k.startswith("sample/experience_count/")} >= {
        "sample/experience_count/explorer"
    }
    for r in history:  # the correction is on (token TIS); its mismatch metrics are finite and small
        assert abs(r["rollout_corr/kl"]) < 0.5 and 0 < r["rollout_corr/rollout_is_mean"] <= 2.0
    text = logs["explorer"].read_text() + logs["explorer_new"].read_text()
    assert "the trainer finished at step 6" in text or "explorer explorer finished at step 6" in text


# NOTE: each back-end with one style (not all four pairs): the DB holds the same rows in either style
@pytest.mark.parametrize("url, style", [("sqlite", "fixed"), ("postgresql", "explorer_driven")], indirect=["url"])
@pytest.mark.slow
def test_explorer_first_trainer_later_and_restart_of_a_finished_run(tmp_path, tiny_model_dir, style, url):
    """Explorer first: it waits at its first sync point (saying for what) until the trainer comes. A
    second start of the finished trainer does nothing: it resumes at its last step. explorer_driven:
    at each sync point the explorer takes any newer weights (waits only when there are none)."""
    files, job = (
        pair(tmp_path, tiny_model_dir, url, **{"synchronizer.sync_style": style}),
        tmp_path / "ck/nanorft/tiny_async",
    )
    logs = {r: tmp_path / f"{r}.log" for r in ("trainer", "explorer")}
    explorer = start(files["explorer"], "explore.py", logs["explorer"])
    wait_for(
        lambda: "waiting for the trainer's weights of step 1" in logs["explorer"].read_text(), "the explorer's note"
    )
    assert "no trainer has used this DB yet" in logs["explorer"].read_text()
    trainer = start(files["trainer"], "train.py", logs["trainer"], LAUNCHED)
    assert [p.wait(timeout=300) for p in (trainer, explorer)] == [0, 0], {r: logs[r].read_text()[-2000:] for r in logs}
    again = run_train(files["trainer"])
    assert again.returncode == 0 and "resumed from checkpoint step 6" in again.stderr, again.stderr[-2000:]
    assert [r["step"] for r in read_history(job / "monitor/trainer.jsonl")] == list(range(1, 7))
    versions = [r["rollout/model_version"] for r in read_history(job / "monitor/explorer.jsonl")]
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] >= 4, versions


@pytest.mark.parametrize("url", ["sqlite"], indirect=True)
@pytest.mark.slow
def test_trainer_driven_explorer_never_waits_and_stale_experiences_are_dropped(tmp_path, tiny_model_dir, url):
    """trainer_driven: the explorer loads new weights whenever the trainer has published some and never
    waits, so a fast explorer runs ahead; staleness_control (max_staleness 1 here) then drops what is too
    old, the trainer ends when the explorer has finished and nothing usable is left, and saves that step."""
    files, job = (
        pair(
            tmp_path,
            tiny_model_dir,
            url,
            **{"synchronizer.sync_style": "trainer_driven", "algorithm.sample_strategy_args.max_staleness": 1},
        ),
        tmp_path / "ck/nanorft/tiny_async",
    )
    logs = {r: tmp_path / f"{r}.log" for r in ("trainer", "explorer")}
    explorer = start(files["explorer"], "explore.py", logs["explorer"])
    assert explorer.wait(timeout=300) == 0, logs["explorer"].read_text()[-2000:]
    assert "waiting for the trainer's weights" not in logs["explorer"].read_text()
    trainer = start(files["trainer"], "train.py", logs["trainer"], LAUNCHED)
    assert trainer.wait(timeout=300) == 0, logs["trainer"].read_text()[-2000:]
    # all 36 experiences are version 0: steps 1 and 2 may use them (staleness 0, 1); step 3 drops the rest
    with ExperienceDB(url) as d:
        assert d.counts() == {"total": 36, "pending": 0, "claimed": 12, "dropped": 24, "claims": 12}
    assert (
        "every explorer writing to the experience DB has finished and no experiences are left: "
        "training ends after step 2 of 6" in logs["trainer"].read_text()
    )
    assert (job / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert json.loads(meta(url, "trainer"))["status"] == "finished"


@pytest.mark.slow(seconds=65)
def test_kill_and_restart_explorer_and_trainer_keeps_every_invariant(tmp_path, url):
    """scripts/soak_async.py with a fixed schedule: SIGKILL the explorer, the trainer, then both, each at a
    pause point (NANORFT_TEST_PAUSE_AT: never a clock delay, so the run cannot end before a kill), restart
    them, run to the end, check: experiences written = claimed + pending (+ dropped), none used twice, train
    steps 1..T each with a full batch, no task skipped or repeated. NOTE: in the `both` cycle the trainer dies
    wherever it is when the explorer pauses (scripts/soak_async.py's docstring): every assertion here holds for
    any such point, so the outcome does not depend on timing."""
    db = ["--db-url", url] if url.startswith("postgresql://") else []  # sqlite: the script's default file
    args = ["--cycles", "3", "--schedule", "explorer,trainer,both", "--out", str(tmp_path / "soak"), *db]
    args += ["--steps", "5"]  # the fewest the schedule allows (cycles + 2)
    # its trainer starts are the trainer itself, not a launcher starting it
    out = entry.run_process("scripts/soak_async.py", *args, env=LAUNCHED, timeout=900)
    result = json.loads((tmp_path / "soak/soak_result.json").read_text())
    assert out.returncode == 0 and result["ok"], (result.get("error"), out.stdout[-3000:])
    assert [k["victim"] for k in result["kills"]] == ["explorer", "trainer", "both"]
    assert [k["moment"] for k in result["kills"]] == [  # step 2 generated, not written; step 3 claimed, not trained
        "explorer paused at explore.before_write:2",
        "trainer paused at train.after_read:3",
        "explorer paused at explore.before_write:4",
    ]
    assert result["starts"] == {"trainer": 3, "explorer": 3}
    inv = result["invariants"]
    assert (
        inv["train_steps"] == 5
        and inv["claimed"] == 5 * 6
        and inv["experiences"] == inv["claimed"] + inv["pending"] + inv["dropped"]
    )
    trainer_log = (tmp_path / "soak/logs/trainer.log").read_text()
    assert "experience claims of steps after" in trainer_log  # every restart gave back what later steps took


@pytest.mark.slow
def test_no_trainer_the_explorer_reports_and_stops(tmp_path, tiny_model_dir):
    files = pair(tmp_path, tiny_model_dir, **{"synchronizer.sync_timeout": 1})
    out = run_explorer(files["explorer"])
    assert out.returncode == 1
    assert (
        "explorer explorer stops after step 2: no weights of step 1 after 1 s (synchronizer.sync_timeout); "
        "no trainer has used this DB yet. Restart to continue after step 2."
    ) in out.stderr


def refusal(script: str, config: Path, url: str, caplog) -> tuple[int, str]:
    """(exit code, what it wrote) of `script` refusing to start on the DB (in this process: entry.run)."""
    out = entry.run(script, "--config", str(config), env=LAUNCHED, timeout=300)
    return out.returncode, out.stderr


@pytest.mark.slow
def test_db_of_another_model_or_schema_is_refused(tmp_path, tiny_model_dir, url, caplog):
    files = pair(tmp_path, tiny_model_dir, url)
    with ExperienceDB(url) as d:
        d.check_identity({"model_type": "llama", "vocab_size": 32000}, "another explorer")
    for script, role in (("explore.py", "explorer"), ("train.py", "trainer")):
        code, err = refusal(script, files[role], url, caplog)
        assert code == 2 and "Traceback" not in err, err[-2000:]
        assert "this experience DB was written for another model or tokenizer (" in err
        assert (
            "model_type: DB has 'llama', "
            + ("explorer explorer" if role == "explorer" else "the trainer")
            + " has 'qwen2'"
            in err
        )
    raw(url, "UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    code, err = refusal("explore.py", files["explorer"], url, caplog)
    assert code == 2 and f"experience DB has schema version 1, this buffer.py expects {SCHEMA_VERSION}" in err


@pytest.mark.slow
def test_an_explorer_whose_advantages_the_trainer_would_not_read_is_refused(tmp_path, tiny_model_dir):
    """A trainer of step_wise_grpo (advantages computed in the explorer) stored that in the DB; an explorer whose
    config has grpo (its experiences would carry none) is refused at start with both sides named, no traceback."""
    files = pair(tmp_path, tiny_model_dir)
    url = f"sqlite:///{tmp_path}/ck/nanorft/tiny_async/buffer/tiny_async_buffer.db"
    Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True)
    with ExperienceDB(url) as d:
        d.check_advantages('the explorer: step_wise_grpo {"epsilon": 1e-06}', "the trainer")
    out = run_explorer(files["explorer"], env=LAUNCHED)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert (
        'the advantages of this DB\'s experiences come from the explorer: step_wise_grpo {"epsilon": 1e-06} '
        "(stored by the trainer), and explorer explorer has them from the trainer"
    ) in out.stderr


def test_wait_for_trainer_returns_the_version_or_says_why_not(tmp_path, tiny_model_dir, db_url):
    """The explorer's wait at a checkpoint sync point: the newest published version once it is >= want;
    exit code 0 when the trainer has finished first; 1 with the trainer's last state after the timeout."""
    import threading

    import sync
    from models import load_model, load_tokenizer

    db = ExperienceDB(db_url)
    version, why, code = sync.wait_for_trainer(str(tmp_path), db, 1, step=1, timeout=0.3)
    assert (version, code) == (0, 1) and why == (
        "no weights of step 1 after 0.3 s (synchronizer.sync_timeout); no trainer has used this DB yet"
    )
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    t = threading.Timer(0.3, lambda: sync.publish_hf(model, tok, tmp_path, step=2))
    t.start()
    assert sync.wait_for_trainer(str(tmp_path), db, 1, step=1, timeout=30) == (2, "", 0)
    t.join()
    db.set_meta("trainer", json.dumps({"step": 5, "status": "finished", "time": time.time(), "pid": 1}))
    version, why, code = sync.wait_for_trainer(str(tmp_path), db, 6, step=7, timeout=30)
    assert (version, code) == (0, 0) and why == "the trainer finished at step 5 (newest weights: step 2)"


@pytest.mark.slow
def test_dynamic_sampling_and_replay_by_group_with_separate_processes(tmp_path, tiny_model_dir):
    """Explorer (mode explore, never waiting: trainer_driven) and trainer (mode train) as separate processes on one
    SQLite DB. The explorer over-samples (dynamic_sampling; tests/data/dapo_reward.py: tasks 0 and 1 tie, the
    others' 2 responses flip coins), is SIGKILLed before writing step 2 and restarted: every step holds 2 groups
    that vary, and its saved position is past every task run, none written twice. Then the trainer replays with the
    priority queue (cooldown 0) for 5 steps on the 6 groups: each step claims 2 whole groups (the newest first, then
    the reused), and stores each experience's GRPO advantages of its first use (over its whole group) for reuse."""
    base = yaml.safe_load(
        both_config(
            tmp_path,
            tiny_model_dir,
            **{
                "continue_from_checkpoint": True,
                "algorithm.sample_strategy": "dynamic_sampling",
                "buffer.default_reward_fn_type": f"{ROOT}/tests/data/dapo_reward.py:tie_or_coin",
                "buffer.explorer_input.taskset.reward_fn_args": {"tied_below": 2},
                "buffer.explorer_input.eval_tasksets": [],
                "buffer.trainer_input.experience_buffer.use_priority_queue": True,
                "buffer.trainer_input.experience_buffer.reuse_cooldown_time": 0.0,
                "synchronizer.sync_style": "trainer_driven",
            },
        ).read_text()
    )
    explorer = write_yaml(tmp_path / "explorer.yaml", base, {"mode": "explore"})
    trainer = write_yaml(tmp_path / "trainer.yaml", base, {"mode": "train", "buffer.total_steps": 5})
    job, marker = tmp_path / "ck/p/run", tmp_path / "paused"
    pause = {"NANORFT_TEST_PAUSE_AT": "explore.before_write:2", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    killed = entry.start("explore.py", "--config", str(explorer), log=tmp_path / "killed.log", env=pause)
    wait_for(lambda: marker.exists() or killed.poll() is not None, "the explorer's pause before writing step 2")
    killed.kill()
    assert killed.wait() != 0 and marker.exists()
    for script, config in (("explore.py", explorer), ("train.py", trainer)):
        out = entry.run(script, "--config", str(config), env=LAUNCHED, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    # the explorer: 3 steps of 2 varied groups; the position counts every task run, the dropped ones too
    dapo = {r["step"]: r for r in read_history(job / "monitor/explorer.jsonl")}  # the killed run logged step 1 only
    assert sorted(dapo) == [1, 2, 3] and dapo[1]["rollout/dynamic_sampling/extra_tasks"] >= 2
    assert all(r["rollout/dynamic_sampling/cap_hit"] == 0 for r in dapo.values())
    url = f"sqlite:///{job}/buffer/exp.db"
    with ExperienceDB(url) as d:
        groups = d.query("SELECT group_id, COUNT(*), MIN(reward) < MAX(reward) FROM experiences GROUP BY group_id")
        index = d.explorer_states()["explorer"]["reader"]["index"]
        claims = d.query(
            "SELECT c.step, e.group_id, e.id, e.reward FROM claims c JOIN experiences e ON e.id = c.exp_id"
        )
        replays = d.query("SELECT exp_id, step, advantages FROM replays")
    assert len(groups) == 6 and all(n == 2 and varied for _, n, varied in groups), groups
    assert index == sum(2 + r["rollout/dynamic_sampling/extra_tasks"] for r in dapo.values())
    # the trainer: each step 2 whole groups; steps 1-3 the 6 fresh ones, newest first; 4-5 reuse steps 1-2's
    by_step: dict[int, dict[str, list[int]]] = {}
    for step, group, exp, _ in claims:
        by_step.setdefault(step, {}).setdefault(group, []).append(exp)
    assert sorted(by_step) == [1, 2, 3, 4, 5] and all(
        len(g) == 2 and all(len(ids) == 2 for ids in g.values()) for g in by_step.values()
    ), by_step
    assert len({g for s in (1, 2, 3) for g in by_step[s]}) == 6
    assert by_step[4].keys() == by_step[1].keys() and by_step[5].keys() == by_step[2].keys()
    first = {exp: min(s for s, _, e, _ in claims if e == exp) for _, _, exp, _ in claims}
    reward = {exp: r for _, _, exp, r in claims}
    assert len(replays) == 12
    for exp, step, blob in replays:  # GRPO over the whole group of 2 rewards 0 and 1: (r - 0.5) / 0.7071 = +-0.7071
        advantages = safetensors.torch.load(bytes(blob))["advantages"]
        assert step == first[exp] and torch.allclose(
            advantages, torch.full_like(advantages, (reward[exp] - 0.5) / 0.5**0.5), atol=1e-5
        )
    trainer_rows = read_history(job / "monitor/trainer.jsonl")
    assert [(r["batch/size"], r["sample/dropped_tied_groups"]) for r in trainer_rows] == [(4, 0)] * 5
