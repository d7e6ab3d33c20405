"""Task selection (selection.py through tasksets.TaskReader): difficulty_based's estimate after hand-computed updates,
its greedy and sampled picks, offline_easy2hard's order, the refusals, and the selector state surviving a restart."""

import json
import math
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from buffer import ExperienceDB
from configs import cli, derive, from_dict, resolve_stages
from configs.schema import Config
from errors import ConfigError, DataError
from helpers import kill_explorer_before_write, run_explorer, write_config
from monitor import read_history
from tasksets import TaskReader

# Two prior pass-rate columns (a weaker and a stronger reference) of four tasks
F0 = [0.2, 0.4, 0.6, 0.0]
F1 = [0.6, 0.8, 1.0, 0.4]


def taskset(path: Path, selector: dict):
    """A derived training taskset (GRPO, 4 rollouts a task) with data_selector `selector`."""
    raw = {
        "model": {"model_path": "m", "max_model_len": 64},
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 4},
        "buffer": {
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {
                "taskset": {
                    "name": "ts",
                    "path": str(path),
                    "format": {"prompt_key": "question", "response_key": "answer"},
                    "data_selector": selector,
                }
            },
        },
    }
    return derive(from_dict(Config, raw)).buffer.explorer_input.tasksets[0]


def write(tmp_path: Path, rows: list[dict], name: str = "train.jsonl") -> Path:
    f = tmp_path / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text("".join(json.dumps({"question": f"q{i}", "answer": "1", **r}) + "\n" for i, r in enumerate(rows)))
    return f


def bots(tmp_path: Path, **kwargs) -> TaskReader:
    """A reader of the four tasks with difficulty_based (m 4, lamb 0.2, rho 0.2 unless given)."""
    path = write(tmp_path, [{"f0": a, "f1": b} for a, b in zip(F0, F1)])
    sel = {"selector_type": "difficulty_based", "feature_keys": ["f0", "f1"], "kwargs": {"m": 4, **kwargs}}
    return TaskReader([taskset(path, sel)], total_epochs=100)


def feed(reader: TaskReader, rewards: dict[int, list[float]]) -> None:
    """Feedback as the explorer gives it: (task, its group's rewards), for tasks by row."""
    tasks = reader.sets[0][1]
    reader.feedback([(tasks[row], r) for row, r in rewards.items()])


def estimator(reader: TaskReader):
    return reader.selectors[0]


def test_the_estimate_follows_the_update_formula_by_hand(tmp_path):
    reader = bots(tmp_path, tau=0)
    # update 1: task 0 passes 2 of 4 (0.5), task 1 3 of 4 (0.75)
    feed(reader, {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]})
    est = estimator(reader)
    # cap_estimate = (mean r - mean f0) / (mean f1 - mean f0 + 1e-6) = (0.625 - 0.3) / (0.7 - 0.3 + 1e-6)
    cap = 0.325 / 0.400001
    assert est.cap_coef == pytest.approx(cap, rel=1e-12)
    # seen tasks: alpha = 0.8 * 1 + 0.2 + m * r (the (1 - rho) observed and rho prior parts both use r)
    # task 0: 1 + 4 * 0.5 = 3, beta 1 + 4 * 0.5 = 3; task 1: 1 + 3 = 4, beta 1 + 1 = 2
    # unseen: alpha = 1 + rho * m * p~, p~ = clip(f0 + cap * (f1 - f0)): task 2: 0.6 + 0.4 cap, task 3: 0.4 cap
    p2, p3 = 0.6 + 0.4 * cap, 0.4 * cap
    assert est.alphas.tolist() == pytest.approx([3.0, 4.0, 1 + 0.8 * p2, 1 + 0.8 * p3], abs=1e-12)
    assert est.betas.tolist() == pytest.approx([3.0, 2.0, 1 + 0.8 * (1 - p2), 1 + 0.8 * (1 - p3)], abs=1e-12)
    assert est.alphas.tolist() == pytest.approx([3.0, 4.0, 1.74, 1.26], abs=1e-5)  # the same, rounded by hand
    # update 2: task 2's group gets 1.1 each (math_reward: right and formatted): pass rate clipped to 1
    feed(reader, {2: [1.1, 1.1, 1.1, 1.1]})
    # cap_estimate = (1 - 0.6) / (1.0 - 0.6 + 1e-6); cap <- 0.9 cap + 0.1 estimate
    cap2 = 0.9 * cap + 0.1 * (0.4 / 0.400001)
    assert est.cap_coef == pytest.approx(cap2, rel=1e-12)
    assert cap2 == pytest.approx(0.83125, abs=1e-5)
    # task 0 unseen this time: 0.8 * 3 + 0.2 + 0.2 * 4 * (0.2 + 0.4 cap2) = 3.026 (beta 2.974)
    # task 2 seen with r = 1: 0.8 * 1.74 + 0.2 + 4 * 1 = 5.592 (beta 0.8 * 1.06 + 0.2 = 1.048)
    assert est.alphas[[0, 2]].tolist() == pytest.approx([3.026, 5.592], abs=1e-5)
    assert est.betas[[0, 2]].tolist() == pytest.approx([2.974, 1.048], abs=1e-5)
    assert reader.metrics()["selection/ts/seen_tasks"] == 3


def test_greedy_picks_the_tasks_whose_predicted_pass_rate_is_nearest_the_target(tmp_path):
    reader = bots(tmp_path / "a", tau=0, target_reward=0.5)
    assert [t.index for t in reader.read(2)] == [0, 1]  # every task predicts 0.5 before any feedback: lowest rows
    feed(reader, {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]})
    # predicted (alpha / (alpha + beta)): 3/6 = 0.5, 4/6 = 0.667, 1.74/2.8 = 0.621, 1.26/2.8 = 0.45
    # |0.5 - p|: 0, 0.167, 0.121, 0.05 -> tasks 0 then 3
    assert [t.index for t in reader.read(2)] == [0, 3]
    m = reader.metrics()
    assert m["selection/ts/predicted_pass_rate/mean"] == pytest.approx((0.5 + 0.5 + 0.5 + 0.45) / 4, abs=1e-5)
    assert m["selection/ts/target_gap/mean"] == pytest.approx((0 + 0 + 0 + 0.05) / 4, abs=1e-5)
    assert m["selection/ts/observed_pass_rate/mean"] == pytest.approx(0.625)
    high = bots(tmp_path / "b", tau=0, target_reward=1.0)
    high.read(2)
    feed(high, {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]})
    assert [t.index for t in high.read(2)] == [1, 2]  # the highest predicted: 0.667, 0.621


def test_tau_sampling_is_seeded_reproducible_and_never_repeats_a_task_within_a_batch(tmp_path):
    runs = []
    for name, seed in (("a", 42), ("b", 42), ("c", 7)):
        reader = bots(tmp_path / name, tau=0.5, do_sample=True)
        reader.selectors[0].seed = seed
        picks = []
        for _ in range(6):
            batch = [t.index for t in reader.read(3)]
            assert len(set(batch)) == 3
            picks.append(batch)
            feed(reader, {row: [1.0, 0.0, 0.0, 0.0] for row in batch})
        runs.append(picks)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_tau_samples_each_task_with_its_softmax_probability(tmp_path):
    est = estimator(bots(tmp_path, tau=0.1, target_reward=0.5))
    est.alphas, est.betas = np.array([1.0, 3.0, 4.0, 1.0]), np.array([1.0, 2.0, 1.0, 4.0])  # predicted .5 .6 .8 .2
    # scores -|0.5 - p| = 0, -0.1, -0.3, -0.3; over tau 0.1: 0, -1, -3, -3 -> softmax
    weights = [math.exp(x) for x in (0, -1, -3, -3)]
    expected = [w / sum(weights) for w in weights]
    firsts = [est.choose(1)[0] for _ in range(4000)]  # each call seeded by seed + picks so far: a new draw
    assert [firsts.count(r) / 4000 for r in range(4)] == pytest.approx(expected, abs=0.025)


def test_a_cold_tau_samples_the_greedy_choice(tmp_path):
    reader = bots(tmp_path, tau=1e-4, target_reward=0.5)
    reader.read(2)
    feed(reader, {0: [1.0, 0.0, 1.0, 0.0], 1: [1.0, 1.0, 1.0, 0.0]})
    # gaps 0, 0.167, 0.121, 0.05 over tau 1e-4: the Gumbel noise (a few units) never bridges 500 units
    assert sorted(t.index for t in reader.read(2)) == [0, 3]


def test_difficulty_based_epochs_are_len_taskset_picks(tmp_path):
    path = write(tmp_path, [{} for _ in range(3)])
    ts = taskset(path, {"selector_type": "difficulty_based", "kwargs": {"tau": 0}})  # no feature_keys: flat prior
    reader = TaskReader([ts], total_epochs=2)
    got = reader.read(100)
    assert [t.epoch for t in got] == [0, 0, 0, 1, 1, 1]
    assert [t.read_at for t in got] == [0, 1, 2, 0, 1, 2]  # a task read twice in an epoch: two group ids (stamp)
    assert reader.exhausted
    feed(reader, {2: [0.0]})
    assert estimator(reader).cap_coef is None  # flat prior: unseen tasks stay at 0.5, no capability estimate
    assert estimator(reader).alphas.tolist() == pytest.approx([1 + 0.2 * 0.5 * 4] * 2 + [0.8 + 0.2], abs=1e-12)


def test_offline_easy2hard_sorts_once_by_the_feature_keys_highest_first(tmp_path):
    rows = [{"pr": 0.3, "x": 1}, {"pr": 0.9, "x": 0}, {"pr": 0.3, "x": 2}, {"pr": 0.5, "x": 0}, {"pr": 0.3, "x": 1}]
    ts = taskset(write(tmp_path, rows), {"selector_type": "offline_easy2hard", "feature_keys": ["pr", "x"]})
    reader = TaskReader([ts], total_epochs=2)
    # by pr (highest, the easiest, first), ties by x, full ties (rows 0 and 4) the higher row first (Trinity's sort)
    assert [t.index for t in reader.read(5)] == [1, 3, 2, 4, 0]
    assert reader.metrics() == {
        "selection/ts/feature/pr/mean": pytest.approx(2.3 / 5),
        "selection/ts/feature/x/mean": 0.8,
    }
    assert [t.index for t in reader.read(5)] == [1, 3, 2, 4, 0]  # the same order every epoch


E2H = "(data_selector.feature_keys of offline_easy2hard)"


@pytest.mark.parametrize(
    "second, keys, named",
    [
        ({"pr": 0.5}, ["pr", "y"], f"row 0: feature column 'y' {E2H} is missing"),
        ({"pr": 0.5}, ["pr", "x"], f"row 1: feature column 'x' {E2H} is null (a JSON row that lacks a key"),
        ({"pr": 0.5, "x": "hard"}, ["pr", "x"], f"row 1: feature column 'x' {E2H} holds 'hard', not a finite number"),
        ({"pr": 0.5, "x": float("nan")}, ["pr", "x"], f"row 1: feature column 'x' {E2H} holds nan, not a finite"),
    ],
)
def test_a_missing_or_non_numeric_feature_names_taskset_row_and_key(tmp_path, second, keys, named):
    path = write(tmp_path, [{"pr": 1, "x": 1}, second])
    ts = taskset(path, {"selector_type": "offline_easy2hard", "feature_keys": keys})
    with pytest.raises(DataError, match="taskset ts: " + re.escape(named)):
        TaskReader([ts])


@pytest.mark.parametrize(
    "selector, message",
    [
        (
            {"selector_type": "difficulty_based", "kwargs": {"temperature": 1}},
            r"kwargs.temperature: unknown argument of difficulty_based; known: m, lamb",
        ),
        (
            {"selector_type": "difficulty_based", "kwargs": {"tau": -1}},
            r"kwargs.tau: -1 is out of range; allowed: >= 0",
        ),
        ({"selector_type": "difficulty_based", "kwargs": {"do_sample": 1}}, r"kwargs.do_sample: 1 is not a bool"),
        ({"selector_type": "difficulty_based", "kwargs": {"m": 2.5}}, r"kwargs.m: 2.5 is not a int"),
        (
            {"selector_type": "difficulty_based", "feature_keys": ["a"]},
            r"feature_keys: \['a'\]: difficulty_based reads two",
        ),
        (
            {"selector_type": "shuffle", "kwargs": {"tau": 0}},
            r"kwargs: \['tau'\] refused: selector_type 'shuffle' takes no",
        ),
        (
            {"selector_type": "random", "feature_keys": ["a"]},
            r"feature_keys: \['a'\] has no effect with selector_type 'random'",
        ),
        ({"selector_type": "offline_easy2hard"}, r"feature_keys: offline_easy2hard sorts by these columns"),
    ],
)
def test_selector_arguments_are_checked_by_name_when_the_config_loads(tmp_path, selector, message):
    with pytest.raises(ConfigError, match=r"buffer\.explorer_input\.tasksets\[0\]\.data_selector\." + message):
        taskset(tmp_path / "x.jsonl", selector)


def run(reader: TaskReader, steps: int) -> list[list[int]]:
    """`steps` explorer-like steps: read 3, feed back a pass rate that depends on the task (row r passes r of 4)."""
    picks = []
    for _ in range(steps):
        batch = [t.index for t in reader.read(3)]
        picks.append(batch)
        feed(reader, {row: [1.0] * row + [0.0] * (4 - row) for row in batch})
    return picks


@pytest.mark.parametrize("kwargs", [{"tau": 0, "adaptive_rho": True}, {"tau": 0.3, "do_sample": True}])
def test_the_selector_state_survives_a_restart_exactly(tmp_path, kwargs):
    whole = bots(tmp_path / "a", target_reward=0.6, **kwargs)
    first = run(whole, 4)
    saved = json.loads(json.dumps(whole.state()))  # as the DB keeps it
    resumed = bots(tmp_path / "b", target_reward=0.6, **kwargs)
    resumed.load_state(saved)
    assert run(resumed, 6) == run(whole, 6)
    assert json.dumps(resumed.state()) == json.dumps(whole.state())
    fresh = bots(tmp_path / "b", target_reward=0.6, **kwargs)
    assert run(fresh, 4) == first  # and the first steps were the seeded ones


def test_a_position_saved_before_selectors_had_state_still_loads(tmp_path):
    reader = bots(tmp_path, tau=0)
    reader.load_state({"epoch": 1, "index": 2, "sizes": [4]})
    assert (reader.epoch, reader.index) == (1, 2)
    assert estimator(reader).picks == 0


@pytest.mark.slow
def test_an_explorer_killed_mid_step_resumes_the_estimate_it_saved(tiny_model_dir, tmp_path):
    """explore.py with difficulty_based, SIGKILLed in step 3 (rolled out, not written), restarted: every step's tasks
    and the final saved estimate are those of a reader that reads each step and is fed the rewards the DB holds, step
    by step (the estimate resumed from step 2's save, never rebuilt, and step 3's lost rollout never fed twice)."""
    selector = {"selector_type": "difficulty_based", "kwargs": {"tau": 0.5, "do_sample": True, "target_reward": 0.5}}
    config = write_config(
        tmp_path, tiny_model_dir, **{"buffer.total_steps": 4, "buffer.explorer_input.taskset.data_selector": selector}
    )
    kill_explorer_before_write(config, tmp_path, 3)
    out = run_explorer(config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming explorer explorer after step 2" in out.stderr
    db = next((tmp_path / "ck").rglob("*.db"))
    rows = sqlite3.connect(db).execute("SELECT group_id, reward FROM experiences ORDER BY id").fetchall()
    groups: dict[str, list[float]] = {}
    for group, reward in rows:
        groups.setdefault(group, []).append(reward)
    assert len(groups) == 4 * 3 and all(len(r) == 2 for r in groups.values())
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    replay = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=10**9)
    ids = list(groups)
    for step in range(4):
        tasks = replay.read(3)
        assert [f"explorer/{t.epoch}/{t.task_id}@{t.read_at}" for t in tasks] == ids[3 * step : 3 * step + 3]
        replay.feedback([(t, groups[g]) for t, g in zip(tasks, ids[3 * step : 3 * step + 3])])
    with ExperienceDB(f"sqlite:///{db}") as d:
        saved = d.explorer_states()["explorer"]["reader"]
    assert saved == json.loads(json.dumps(replay.state()))
    assert saved["selectors"][0]["picks"] == 12
    last = read_history(next((tmp_path / "ck").rglob("monitor/explorer.jsonl")))[-1]
    assert last["step"] == 4 and last["selection/arith/seen_tasks"] == len(saved["selectors"][0]["seen"])
    assert 0 <= last["selection/arith/predicted_pass_rate/mean"] <= 1 and "selection/arith/target_gap/mean" in last
