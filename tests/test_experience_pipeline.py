"""The experience pipeline (pipelines/experience.py, pipelines/experience_ops.py): each built-in's output by hand,
the pipeline's metrics and counts, refusals at start, an operator that raises, a user operator, the composition with
the explorer's refill and dynamic sampling (explore.run_batch / rollout), and real explorer runs: SIGKILL and restart
with a pipeline that drops some experiences, and reward_std_filter end to end."""

import json
import math
import sqlite3
from pathlib import Path

import entry
import pytest
import torch

import explore
from buffer import Experience, ExperienceDB
from configs import cli
from configs.schema import OperatorConfig
from errors import ConfigError, DataError
from helpers import (
    both_config,
    kill_explorer_before_write,
    make_task,
    run_explorer,
    write_config,
)
from monitor import read_history
from pipelines.experience import ExperiencePipeline
from pipelines.experience_ops import (
    InvalidRewardFilter,
    PassRateCalculator,
    RewardFilter,
    RewardShapingMapper,
    RewardStdFilter,
)

ROOT = Path(__file__).resolve().parents[1]


def exp(reward, group="g", info=None, metrics=None, run=0) -> Experience:
    return Experience(
        torch.arange(3), 1, reward=reward, group_id=group, run_id=run, info=info or {}, metrics=metrics or {}
    )


def config(*ops: tuple[str, dict]):
    cfg = cli(["--config", str(ROOT / "configs/tiny.yaml")])[0]
    cfg.data_processor.experience_pipeline.operators = [OperatorConfig(name=n, args=a) for n, a in ops]
    return cfg


# --- the built-ins by hand


def test_reward_filter_keeps_rewards_at_or_above_the_threshold():
    kept, metrics = RewardFilter(threshold=0.5).process([exp(0.4), exp(0.5), exp(1.0), exp(-1.0)])
    assert [x.reward for x in kept] == [0.5, 1.0] and metrics == {}


def test_reward_std_filter_drops_tied_groups_and_groups_of_one():
    exps = [exp(1.0, "tie"), exp(1.0, "tie"), exp(0.0, "vary"), exp(1.0, "vary"), exp(1.0, "one")]
    exps += [exp(0.0, "near"), exp(0.2, "near")]  # std 0.1: dropped at threshold 0.1 (<=), kept at 0.05
    kept, metrics = RewardStdFilter().process(exps)
    assert [x.group_id for x in kept] == ["vary", "vary", "near", "near"]
    assert metrics == {"dropped_groups": 2, "kept_groups": 2}
    kept, metrics = RewardStdFilter(threshold=0.1).process(exps)
    assert [x.group_id for x in kept] == ["vary", "vary"] and metrics == {"dropped_groups": 3, "kept_groups": 1}
    assert [x.group_id for x in RewardStdFilter(threshold=0.05).process(exps)[0]] == ["vary"] * 2 + ["near"] * 2


def test_invalid_reward_filter_drops_none_nan_and_inf():
    kept, _ = InvalidRewardFilter().process([exp(None), exp(math.nan), exp(math.inf), exp(-math.inf), exp(0.0)])
    assert [x.reward for x in kept] == [0.0]


def test_reward_shaping_by_hand_from_info_then_metrics_with_missing_and_div_by_zero(caplog):
    shaping = [
        {"stats_key": "quality", "op_type": "ADD", "weight": 0.5},
        {"stats_key": "format", "op_type": "MUL", "weight": 2.0},
        {"stats_key": "len", "op_type": "DIV", "weight": 1.0},
        {"stats_key": "quality", "op_type": "SUB", "weight": 0.25},
    ]
    op = RewardShapingMapper(reward_shaping_configs=shaping)
    a = exp(1.0, info={"quality": 2.0, "len": 4.0}, metrics={"format": 0.5, "quality": 99.0})  # info wins
    b = exp(0.0, info={"len": 0.0}, metrics={"quality": 1.0})  # no format: missing; len 0: DIV left out
    with caplog.at_level("WARNING", logger="nanorft.pipelines"):
        kept, metrics = op.process([a, b, exp(3.0)])  # the third has no stat at all: 4 missing
    # a: (1 + 0.5*2) * (2*0.5) / (1*4) - 0.25*2 = 2 * 1 / 4 - 0.5 = 0.0
    # b: (0 + 0.5*1) [format missing] [div by 0] - 0.25*1 = 0.25
    # c: 3.0, every stat missing
    assert [x.reward for x in kept] == [0.0, 0.25, 3.0]
    assert metrics == {
        "reward_diff/mean": (-1.0 + 0.25 + 0.0) / 3,
        "reward_diff/min": -1.0,
        "reward_diff/max": 0.25,
        "missing": 1 + 4,
        "div_by_zero": 1,
    }
    assert caplog.text.count("has no stat 'format'") == 1 and caplog.text.count("has no stat 'len'") == 1


def test_reward_shaping_div_and_mul_by_hand():
    op = RewardShapingMapper([{"stats_key": "s", "op_type": "DIV", "weight": 2.0}])
    assert op.process([exp(3.0, info={"s": 3.0})])[0][0].reward == 0.5  # 3 / (2*3)
    op = RewardShapingMapper([{"stats_key": "s", "op_type": "MUL", "weight": 0.5}])
    assert op.process([exp(3.0, info={"s": 4.0})])[0][0].reward == 6.0  # 3 * (0.5*4)
    op = RewardShapingMapper([{"stats_key": "s"}])  # ADD, weight 1 by default (Trinity's)
    assert op.process([exp(3.0, info={"s": 4.0})])[0][0].reward == 7.0


@pytest.mark.parametrize(
    "shaping, message",
    [
        ([{"op_type": "ADD"}], "needs stats_key"),
        ([{"stats_key": "s", "op_type": "POW"}], "op_type 'POW' is not one of ADD, SUB, MUL, DIV"),
        ([{"stats_key": "s", "weight": "big"}], "weight 'big' is not a number"),
        ([{"stats_key": "s", "wieght": 1}], "unknown key(s) ['wieght']"),
    ],
)
def test_bad_reward_shaping_configs_are_refused_at_start(shaping, message):
    with pytest.raises(ConfigError, match=r"operators\[0\]\.args\.reward_shaping_configs\[0\]") as e:
        ExperiencePipeline(config(("reward_shaping_mapper", {"reward_shaping_configs": shaping})))
    assert message in str(e.value)


def test_a_stat_that_is_not_a_number_is_a_named_data_error():
    op = RewardShapingMapper([{"stats_key": "s"}])
    with pytest.raises(DataError, match="stat 's' is 'high', not a number"):
        op.process([exp(1.0, info={"s": "high"})])


def test_pass_rate_calculator_writes_each_groups_mean_reward():
    exps = [exp(1.0, "a"), exp(0.0, "a"), exp(1.0, "a"), exp(1.0, "b"), exp(0.0, "c")]
    kept, metrics = PassRateCalculator().process(exps)
    assert kept == exps and [x.info["pass_rate"] for x in exps] == [2 / 3] * 3 + [1.0, 0.0]
    assert metrics == {
        "pass_rate/mean": (2 / 3 + 1 + 0) / 3,
        "pass_rate/min": 0.0,
        "pass_rate/max": 1.0,
        "all_passed": 1,
        "all_failed": 1,
    }


# --- the pipeline


def test_the_pipeline_runs_in_order_and_counts_each_operator():
    """reward_filter then reward_std_filter then reward_filter again (label #2): kept / dropped per operator, its own
    keys, and the totals over two batches (their kept / dropped summed, /mean weighted, /min, /max)."""
    p = ExperiencePipeline(
        config(
            ("reward_shaping_mapper", {"reward_shaping_configs": [{"stats_key": "bonus"}]}),
            ("reward_filter", {"threshold": 0.0}),
            ("reward_std_filter", {}),
            ("reward_filter", {"threshold": 1.0}),
        )
    )
    batch1 = [exp(-1.0, "a"), exp(1.0, "a"), exp(1.0, "a"), exp(0.0, "b", info={"bonus": 2.0}), exp(2.0, "b")]
    kept, m = p.run(batch1)
    # shaped: b0 0 -> 2; filter >= 0 drops a0; std: a (1, 1) tied dropped, b (2, 2) tied dropped: nothing left
    assert kept == [] and m["pipeline/reward_shaping_mapper/reward_diff/mean"] == 2.0 / 5
    assert (m["pipeline/reward_filter/kept"], m["pipeline/reward_filter/dropped"]) == (4, 1)
    assert (m["pipeline/reward_std_filter/kept"], m["pipeline/reward_std_filter/dropped"]) == (0, 4)
    assert (m["pipeline/reward_filter#2/kept"], m["pipeline/reward_filter#2/dropped"]) == (0, 0)
    kept, m = p.run([exp(0.5, "c"), exp(1.5, "c", info={"bonus": 1.0})])  # shaped 0.5, 2.5: varied; >= 1 keeps one
    assert [x.reward for x in kept] == [2.5]
    step = p.step_metrics()
    assert step["pipeline/reward_shaping_mapper/reward_diff/mean"] == (2.0 + 1.0) / 7  # weighted by 5 and 2
    assert step["pipeline/reward_shaping_mapper/reward_diff/max"] == 2.0
    assert step["pipeline/reward_shaping_mapper/missing"] == 4 + 1
    assert (step["pipeline/reward_filter/kept"], step["pipeline/reward_filter/dropped"]) == (6, 1)
    assert step["pipeline/reward_std_filter/dropped_groups"] == 2
    assert (step["pipeline/reward_filter#2/kept"], step["pipeline/reward_filter#2/dropped"]) == (1, 1)
    assert (step["pipeline/reward_filter#2/kept_total"], step["pipeline/reward_filter#2/dropped_total"]) == (1, 1)
    assert p.state()["reward_std_filter"] == {"kept": 2, "dropped": 4}
    assert (step["pipeline/input/experiences"], step["pipeline/input/reward_mean"]) == (
        7,
        (-1 + 1 + 1 + 0 + 2 + 0.5 + 1.5) / 7,
    )
    assert (step["pipeline/output/experiences"], step["pipeline/output/reward_mean"]) == (1, 2.5)
    again = p.step_metrics()  # the step's numbers are forgotten, the totals stay
    assert "pipeline/reward_filter/kept" not in again and again["pipeline/reward_filter/kept_total"] == 6
    fresh = ExperiencePipeline(config(("reward_filter", {}), ("reward_std_filter", {})))
    fresh.load_state(p.state())
    assert fresh.state() == {"reward_filter": {"kept": 6, "dropped": 1}, "reward_std_filter": {"kept": 2, "dropped": 4}}


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("reward_std_filtre", {}, "unknown operator 'reward_std_filtre'. Did you mean 'reward_std_filter'?"),
        ("reward_filter", {"treshold": 1}, "takes no argument 'treshold'; did you mean 'threshold'?"),
        ("no_such_module:Op", {}, "cannot import 'no_such_module'"),
    ],
)
def test_a_bad_operator_is_refused_at_start_by_name(name, args, message):
    with pytest.raises(ConfigError, match=r"data_processor\.experience_pipeline\.operators\[1\]") as e:
        ExperiencePipeline(config(("reward_filter", {}), (name, args)))
    assert message in str(e.value)


USER_OP = '''
class DropRun:
    """Drops the experiences of one run_id; its own metric counts them."""

    def __init__(self, run_id=1):
        self.run_id = run_id

    def process(self, exps):
        kept = [x for x in exps if x.run_id != self.run_id]
        return kept, {"seen": len(exps)}


class Broken:
    def process(self, exps):
        raise ZeroDivisionError("my bug")
'''


def test_a_user_operator_from_a_file_and_one_that_raises(tmp_path):
    path = tmp_path / "my_ops.py"
    path.write_text(USER_OP)
    p = ExperiencePipeline(config((f"{path}:DropRun", {"run_id": 0})))
    kept, m = p.run([exp(1.0, run=0), exp(0.0, run=1), exp(1.0, run=0)])
    assert [x.run_id for x in kept] == [1]
    assert (m["pipeline/DropRun/kept"], m["pipeline/DropRun/dropped"], m["pipeline/DropRun/seen"]) == (1, 2, 3)
    broken = ExperiencePipeline(config(("reward_filter", {}), (f"{path}:Broken", {})))
    with pytest.raises(DataError, match=r"operator Broken \(data_processor.experience_pipeline.operators\[1\]\) "
                       r"raised ZeroDivisionError: my bug\. The step is not written"):  # fmt: skip
        broken.run([exp(1.0)])


def test_a_reward_left_invalid_after_the_pipeline_is_a_named_error():
    p = ExperiencePipeline(config(("reward_shaping_mapper", {"reward_shaping_configs": [{"stats_key": "s"}]})))
    with pytest.raises(DataError, match="end the pipeline with invalid_reward_filter"):
        p.run([exp(1.0, info={"s": math.nan})])
    p = ExperiencePipeline(
        config(
            ("reward_shaping_mapper", {"reward_shaping_configs": [{"stats_key": "s"}]}), ("invalid_reward_filter", {})
        )
    )
    kept, m = p.run([exp(1.0, info={"s": math.nan}), exp(1.0)])
    assert [x.reward for x in kept] == [1.0] and m["pipeline/invalid_reward_filter/dropped"] == 1


# --- in the explorer: run_batch / rollout with refill and dynamic sampling

KINDS = ["tie", "vary", "tie", None, "vary", "tie", "vary", "vary"]  # each task's group (None: its workflow fails)


class Reader:
    def __init__(self, size: int) -> None:
        self.index, self.size, self.fed = 0, size, []

    def feedback(self, groups: list) -> None:  # tasksets.TaskReader.feedback: (task, raw rewards) of each group run
        self.fed += [(task.index, rewards) for task, rewards in groups]

    def read(self, n: int) -> list:
        out = [make_task(index=i, taskset="t") for i in range(self.index, min(self.index + n, self.size))]
        self.index += len(out)
        return out


def fake_run_tasks(pool, tasks, handles, cfg) -> list:
    """explore.run_tasks without runners: each task's group by KINDS (two responses)."""
    rewards = {"tie": [1.0, 1.0], "vary": [0.0, 1.0]}
    return [
        (t, None, "boom")
        if KINDS[t.index] is None
        else (t, [Experience(torch.arange(3), 1, reward=r) for r in rewards[KINDS[t.index]]], "")
        for t in tasks
    ]


def explorer(gen_batches: int, pipeline: bool, size: int = 8):
    cfg = config(("reward_std_filter", {})) if pipeline else config()
    cfg.buffer.batch_size, cfg.explorer.max_refill_rounds = 3, 2
    fields = {"cfg": cfg, "reader": Reader(size), "step": 0, "gen_batches": gen_batches, "pool": None, "handles": []}
    return type("X", (), {**fields, "pipeline": ExperiencePipeline(cfg) if pipeline else None})()


@pytest.mark.parametrize("pipeline", [False, True])
def test_dynamic_sampling_refills_the_groups_the_pipeline_dropped(monkeypatch, caplog, pipeline):
    """DAPO's dynamic sampling, max_num_gen_batches 3: batches [0 1 2], [3 4] (3 fails), [5]. Without the pipeline
    the tied group 0 fills the step at the cap; with reward_std_filter the tied groups 0, 2, 5 are dropped by the
    pipeline, counted as missing groups and refilled the same way, and none is left to fill the step."""
    monkeypatch.setattr(explore, "run_tasks", fake_run_tasks)
    x = explorer(3, pipeline)
    with caplog.at_level("WARNING", logger="nanorft.explore"):
        exps, m = explore.rollout(x, x.reader.read(3))
    groups = list(dict.fromkeys(e.task_id for e in exps))
    assert groups == (["t/1", "t/4"] if pipeline else ["t/0", "t/1", "t/4"]) and x.reader.index == 6
    assert m["rollout/dynamic_sampling/num_gen_batches"] == 3 and m["rollout/missing_tasks"] == (1 if pipeline else 0)
    # the task selectors were fed every group run, the tied ones the pipeline dropped too (raw rewards: before it)
    assert x.reader.fed == [(0, [1.0, 1.0]), (1, [0.0, 1.0]), (2, [1.0, 1.0]), (4, [0.0, 1.0]), (5, [1.0, 1.0])]
    if pipeline:
        assert m["pipeline/dropped_groups"] == m["pipeline/dropped_groups_refilled"] == 3
        assert (m["pipeline/reward_std_filter/kept"], m["pipeline/reward_std_filter/dropped"]) == (4, 6)
        assert (
            "the experience pipeline dropped the whole group of 3 task(s); dynamic sampling counts them as missing"
            in caplog.text
        )
    else:
        assert not any(k.startswith("pipeline/") for k in m)


def test_without_dynamic_sampling_a_dropped_group_shortens_the_step(monkeypatch, caplog):
    """refill runs more tasks only for failed ones: batch [0 1 2] with task 0, 2 tied: the step is task 1 alone."""
    monkeypatch.setattr(explore, "run_tasks", fake_run_tasks)
    x = explorer(1, True)
    with caplog.at_level("WARNING", logger="nanorft.explore"):
        exps, m = explore.rollout(x, x.reader.read(3))
    assert [e.task_id for e in exps] == ["t/1", "t/1"] and x.reader.index == 3
    assert (m["rollout/refilled_tasks"], m["rollout/missing_tasks"], m["pipeline/dropped_groups"]) == (0, 2, 2)
    assert m["pipeline/dropped_groups_refilled"] == 0 and "the step is short by them" in caplog.text


def test_step_wise_advantages_see_the_shaped_rewards(monkeypatch):
    """run_batch: the pipeline runs before group_advantages (step_wise_grpo's, in the explorer): a tied group made
    varied by shaping (+ info bonus) gets non-zero advantages."""
    monkeypatch.setattr(explore, "run_tasks", fake_run_tasks)
    cfg = config(("reward_shaping_mapper", {"reward_shaping_configs": [{"stats_key": "run", "weight": 1.0}]}))
    cfg.algorithm.advantage_fn = "step_wise_grpo"
    x = type(
        "X", (), {"cfg": cfg, "pool": None, "handles": [], "pipeline": ExperiencePipeline(cfg), "reader": Reader(0)}
    )()

    def tied(pool, tasks, handles, cfg):
        return [
            (t, [Experience(torch.arange(3), 1, reward=1.0, info={"run": r}) for r in (0.0, 2.0)], "") for t in tasks
        ]

    monkeypatch.setattr(explore, "run_tasks", tied)
    ((_, got, _),) = explore.run_batch(x, [make_task(index=0)])
    assert [e.reward for e in got] == [1.0, 3.0]
    assert got[0].advantages is not None and got[0].advantages[0] < 0 < got[1].advantages[0]


# --- real explorer runs on the tiny model

DROP_SOME = '''
class DropSome:
    """Deterministic by the task's index: even tasks lose run 1, tasks 4, 9, 14... lose their whole group."""

    def process(self, exps):
        return [x for x in exps if x.info["index"] % 5 != 4 and not (x.info["index"] % 2 == 0 and x.run_id == 1)], {}
'''


def db_rows(tmp_path: Path) -> list[tuple]:
    db = next((tmp_path / "ck").rglob("*.db"))
    return sqlite3.connect(db).execute("SELECT group_id, run_id, reward FROM experiences ORDER BY id").fetchall()


@pytest.mark.slow
def test_sigkill_before_the_write_then_restart_with_a_pipeline_neither_repeats_nor_skips(tiny_model_dir, tmp_path):
    """4 steps of 3 tasks (repeat_times 2), a user operator dropping by task index; SIGKILL mid-step 3 (generated and
    piped, not written), restart: the DB holds exactly what the operator keeps of the 12 tasks in reading order, and
    the saved cumulative counts are those of 4 steps, not 5 (the killed step's counts were not kept)."""
    (tmp_path / "drop_some.py").write_text(DROP_SOME)
    ops = [{"name": f"{tmp_path / 'drop_some.py'}:DropSome"}]
    config = write_config(tmp_path, tiny_model_dir, **{"data_processor": {"experience_pipeline": {"operators": ops}}})
    kill_explorer_before_write(config, tmp_path, 3)
    out = run_explorer(config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming explorer explorer after step 2" in out.stderr
    # the taskset is read in file order (sequential): task i is row i; kept by hand from DropSome's rule
    want = [
        (f"explorer/0/arith/{i}", r) for i in range(12) if i % 5 != 4 for r in (0, 1) if not (i % 2 == 0 and r == 1)
    ]
    assert [(g, r) for g, r, _ in db_rows(tmp_path)] == want
    state = ExperienceDB(f"sqlite:///{next((tmp_path / 'ck').rglob('*.db'))}").explorer_states()["explorer"]
    assert state["pipeline"] == {"DropSome": {"kept": len(want), "dropped": 24 - len(want)}}


@pytest.mark.slow
def test_reward_std_filter_end_to_end_leaves_no_tied_group_and_counts_the_dropped(tiny_model_dir, tmp_path):
    """explore on the tiny model with random_reward (p 0.5: about half the groups of 2 tie) and reward_std_filter:
    no tied group in the DB, and each step's metrics add up: kept = the rows it wrote, dropped = 2 x its dropped
    groups, and every task read is either in the DB or among the dropped groups."""
    ops = [{"name": "reward_std_filter", "args": {"threshold": 0.0}}]
    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{
            "buffer.total_steps": 3,
            "buffer.default_reward_fn_type": "random_reward",
            "data_processor": {"experience_pipeline": {"operators": ops}},
        },
    )
    out = run_explorer(config)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = db_rows(tmp_path)
    by_group: dict[str, list[float]] = {}
    for g, _, reward in rows:
        by_group.setdefault(g, []).append(reward)
    assert all(len(r) == 2 and r[0] != r[1] for r in by_group.values())
    history = [h for h in read_history(next((tmp_path / "ck").rglob("monitor/explorer.jsonl"))) if "time/rollout" in h]
    assert len(history) == 3
    for h in history:
        assert h["pipeline/reward_std_filter/kept"] + h["pipeline/reward_std_filter/dropped"] == 3 * 2
        assert h["pipeline/reward_std_filter/dropped"] == 2 * h["pipeline/reward_std_filter/dropped_groups"]
        assert h["pipeline/dropped_groups"] == h["pipeline/reward_std_filter/dropped_groups"]
    dropped = sum(h["pipeline/dropped_groups"] for h in history)
    assert 0 < dropped < 9  # both kinds of group occurred (random_reward's draws are seeded: the same each run)
    assert len(by_group) + dropped == 9 and len(rows) == sum(h["pipeline/reward_std_filter/kept"] for h in history)
    assert history[-1]["pipeline/reward_std_filter/dropped_total"] == 2 * dropped


RAISES_LATER = '''
class RaisesLater:
    """Fails on the tasks of step 2 (index 3 on); keeps everything else."""

    def process(self, exps):
        if any(x.info["index"] >= 3 for x in exps):
            raise KeyError("quality")
        return exps, {}
'''


@pytest.mark.slow
def test_an_operator_that_raises_stops_the_explorer_and_its_step_is_not_written(tiny_model_dir, tmp_path, caplog):
    """Step 1 is written; step 2's operator raises: exit 2 with the operator named, no traceback from the process's
    exit path, step 2's experiences not in the DB and the saved position after step 1 (a restart runs it again)."""
    (tmp_path / "raises.py").write_text(RAISES_LATER)
    ops = [{"name": "reward_filter", "args": {"threshold": -1.0}}, {"name": f"{tmp_path / 'raises.py'}:RaisesLater"}]
    config = write_config(tmp_path, tiny_model_dir, **{"data_processor": {"experience_pipeline": {"operators": ops}}})
    out = run_explorer(config)
    code, err = out.returncode, out.stderr
    assert code == 2
    assert "experience pipeline operator RaisesLater (data_processor.experience_pipeline.operators[1]) raised " in err
    assert "KeyError: 'quality'. The step is not written" in err
    assert [g for g, _, _ in db_rows(tmp_path)] == [f"explorer/0/arith/{i}" for i in range(3) for _ in (0, 1)]
    state = ExperienceDB(f"sqlite:///{next((tmp_path / 'ck').rglob('*.db'))}").explorer_states()["explorer"]
    assert state["step"] == 1 and state["reader"]["index"] == 3
    assert state["pipeline"] == {"reward_filter": {"kept": 6, "dropped": 0}, "RaisesLater": {"kept": 6, "dropped": 0}}


@pytest.mark.slow
def test_mode_both_with_shaping_from_the_reward_components_and_dynamic_sampling(tiny_model_dir, tmp_path):
    """launch.py in mode both (GRPO with DAPO's dynamic sampling, 3 steps): reward_shaping_mapper adds 0.5 x the
    `accuracy` component (in exp.metrics: random_reward's, p 0.5, as the tiny model solves no task) and
    reward_std_filter drops the tied groups, which dynamic sampling refills. Each row's reward is 1.5 x its accuracy,
    by hand from its payload; every group varies; the trainer trains its 3 steps on them."""
    shaping = [{"stats_key": "accuracy", "op_type": "ADD", "weight": 0.5}]
    ops = [
        {"name": "reward_shaping_mapper", "args": {"reward_shaping_configs": shaping}},
        {"name": "reward_std_filter"},
    ]
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "buffer.default_reward_fn_type": "random_reward",
            "algorithm.sample_strategy": "dynamic_sampling",
            "algorithm.sample_strategy_args": {"max_num_gen_batches": 3},
            "data_processor": {"experience_pipeline": {"operators": ops}},
        },
    )
    out = entry.run_process("launch.py", "--config", str(config), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    db = next((tmp_path / "ck").rglob("*.db"))
    rows = sqlite3.connect(db).execute("SELECT e.group_id, e.reward, p.meta FROM experiences e JOIN payloads p "
                                       "ON p.id = e.id ORDER BY e.id").fetchall()  # fmt: skip
    assert rows
    for _, reward, meta in rows:
        parts = json.loads(meta)["metrics"]
        assert parts["accuracy"] in (0.0, 1.0) and reward == 1.5 * parts["accuracy"]
    by_group: dict[str, list[float]] = {}
    for g, reward, _ in rows:
        by_group.setdefault(g, []).append(reward)
    assert all(len(r) == 2 and r[0] != r[1] for r in by_group.values())
    history = read_history(next((tmp_path / "ck").rglob("monitor/explorer.jsonl")))
    steps = [h for h in history if "pipeline/dropped_groups" in h]
    assert len(steps) == 3 and all(h["pipeline/dropped_groups_refilled"] == h["pipeline/dropped_groups"] for h in steps)
    trained = [h["step"] for h in read_history(next((tmp_path / "ck").rglob("monitor/trainer.jsonl")))]
    assert trained[-1] == 3


@pytest.mark.slow
def test_a_bad_operator_stops_the_explorer_at_start_before_any_rollout(tiny_model_dir, tmp_path, caplog, monkeypatch):
    """A misspelt argument: exit 2 naming the operator's place and the argument, before the engine starts or any
    workflow runs."""
    started = []
    monkeypatch.setattr(explore, "run_tasks", lambda *a: started.append(a) or [])
    monkeypatch.setattr(explore.sync, "start_engine", lambda *a: started.append(a) or (None, 0))
    ops = [{"name": "reward_std_filter", "args": {"treshold": 0.1}}]
    config = write_config(tmp_path, tiny_model_dir, **{"data_processor": {"experience_pipeline": {"operators": ops}}})
    out = run_explorer(config)
    code, err = out.returncode, out.stderr
    assert code == 2 and not started
    assert "data_processor.experience_pipeline.operators[0]: operator 'reward_std_filter' takes no argument " in err
    assert "'treshold'; did you mean 'threshold'?" in err
