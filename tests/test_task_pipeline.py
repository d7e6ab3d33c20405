"""The task pipeline (pipelines/task.py) and its model-scoring operators (pipelines/scoring.py): scores checked
against hand-computed values, the written taskset, its reuse and recompute, refusals by name, no half-written file,
the Data-Juicer dispatch (a stand-in for pipelines.data_juicer.run_rows), and the seed's example end to end."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

import explore
from errors import ConfigError, DataError
from helpers import raw, run_explorer, write_config

ROWS = [
    {"question": "What is 2 + 3?", "answer": "#### 5"},
    {"question": "What is 4 + 4?", "answer": "#### 8"},
    {"question": "What is 9 + 1?", "answer": "#### 10"},
]
DIMS = ["linguistic_complexity", "conceptual_depth", "prior_knowledge", "step_complexity", "ambiguity"]


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def scores_reply(*scores: int) -> str:
    return "Sure.\n```json\n" + json.dumps({"dimension_scores": dict(zip(DIMS, scores)), "flags": []}) + "\n```"


class CannedJudge:
    """A handle answering each difficulty question by the question it sees; records every replies() call."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.calls = answers, []

    def replies(self, conversations: list[list[dict]], **sampling) -> list[str]:
        self.calls.append((conversations, sampling))
        return [next(v for k, v in self.answers.items() if k in c[-1]["content"]) for c in conversations]


def context(models: dict, num_process: int = 4, cfg=None):
    from pipelines import Context

    cfg = cfg or types.SimpleNamespace(
        data_processor=types.SimpleNamespace(task_pipeline=types.SimpleNamespace(num_process=num_process))
    )
    return Context(cfg, models, "data_processor.task_pipeline.operators[0]")


def difficulty(models: dict, num_process: int = 4, **args):
    from configs.schema import OperatorConfig
    from pipelines import build
    from pipelines.registry import TASK_OPERATORS

    spec = OperatorConfig("llm_difficulty_score_filter", {"api_or_hf_model": "judge", **args})
    return build(spec, TASK_OPERATORS, context(models, num_process))


# --- llm_difficulty_score_filter


def test_difficulty_filter_scores_as_data_juicer_by_hand():
    """Data-Juicer's scale: mean of five 1-5 scores / 5; an unparseable reply asked try_num times, then 0.0."""
    judge = CannedJudge({"2 + 3": scores_reply(3, 3, 3, 3, 3), "4 + 4": scores_reply(5, 5, 5, 4, 4), "9 + 1": "hm"})
    op = difficulty(
        {"judge": judge},
        num_process=2,
        min_score=0.5,
        max_score=0.9,
        input_keys=["question", "answer"],
        field_names=["Question", "Answer"],
    )
    rows = [dict(r) for r in ROWS]
    kept, stats = op.process(rows)
    assert [r["question"] for r in kept] == ["What is 2 + 3?"]  # 0.6 in [0.5, 0.9]; 0.92 above; 0.0 below
    assert [r["llm_difficulty_score"] for r in rows] == pytest.approx([0.6, 23 / 25, 0.0])
    assert json.loads(rows[0]["llm_difficulty_record"])["dimension_scores"]["ambiguity"] == 3
    assert rows[2]["llm_difficulty_record"] == ""
    assert stats == pytest.approx({"mean_score": (0.6 + 0.92 + 0.0) / 3, "unparsed": 1.0, "refused": 0.0})
    # requests: 2 at a time (num_process), then the unparsed row again, twice more (try_num 3)
    assert [len(c) for c, _ in judge.calls] == [2, 1, 1, 1]
    system, user = judge.calls[0][0][0]
    assert system["role"] == "system" and system["content"].startswith("\nYou are an expert pedagogical evaluator")
    assert "- Step Complexity: Problem-solving steps needed" in system["content"]
    assert (
        user["content"] == "# Data\n'''\n**Question**\nWhat is 2 + 3?\n\n**Answer**\n#### 5\n'''\n\n# Response\njson\n"
    )
    assert judge.calls[0][1] == {"temperature": 0.0, "max_tokens": 512}


def test_difficulty_filter_keeps_unparsed_rows_when_min_score_is_zero():
    """As Data-Juicer's: the 0.0 of an unparseable reply is a score like any other (the seed's min_score 0.0)."""
    judge = CannedJudge({"What": "no json here"})
    kept, stats = difficulty(
        {"judge": judge}, min_score=0.0, try_num=1, input_keys=["question"], field_names=["Q"]
    ).process([dict(r) for r in ROWS])
    assert len(kept) == 3 and stats["unparsed"] == 3.0 and len(judge.calls) == 1


def test_difficulty_filter_refuses_what_it_cannot_resolve(monkeypatch):
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    op = difficulty({}, min_score=0.0)
    with pytest.raises(ConfigError, match=r"operators\[0\]: api_or_hf_model 'judge' is no auxiliary model"):
        op.process([dict(ROWS[0])])
    with pytest.raises(ConfigError, match="takes no argument 'min_scor'; did you mean 'min_score'"):
        difficulty({}, min_scor=0.0)
    with pytest.raises(ConfigError, match="input_keys and field_names must pair"):
        difficulty({}, input_keys=["question", "answer"], field_names=["Q"])


def test_difficulty_filter_external_endpoint(monkeypatch):
    """Neither an aux model nor a folder: an OpenAI-compatible endpoint, base_url from api_endpoint."""
    import engines

    seen = {}

    class Endpoint:
        def __init__(self, ext, where):
            seen.update(url=ext.base_url, model=ext.model_name, key=ext.api_key_env)

        def replies(self, conversations, **sampling):
            return [scores_reply(1, 1, 1, 1, 1)] * len(conversations)

    monkeypatch.setattr(engines, "ExternalHandle", Endpoint)
    kept, _ = difficulty({}, api_or_hf_model="gpt-x", api_endpoint="http://h:1/v1", min_score=0.3).process(
        [dict(ROWS[0])]
    )
    assert kept == [] and seen == {"url": "http://h:1/v1", "model": "gpt-x", "key": "OPENAI_API_KEY"}


# --- pass_rate_filter


class AnswerEngine:
    """Plays the model in a math task: "2 + 3" always right, "4 + 4" right every other sample, "9 + 1" never."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.count, self.model_version = tokenizer, {}, 0

    def submit(self, ids, params):
        import concurrent.futures

        from engines import Completion

        text = self.tokenizer.decode(ids)
        q = next(q for q in ("2 + 3", "4 + 4", "9 + 1") if q in text)
        out = []
        for _ in range(params.n):
            k = self.count[q] = self.count.get(q, 0) + 1
            right = q == "2 + 3" or (q == "4 + 4" and k % 2 == 0)
            reply = {"2 + 3": "#### 5", "4 + 4": "#### 8", "9 + 1": "#### 10"}[q] if right else "#### 0"
            ids_out = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Completion(ids_out, [-0.5] * len(ids_out), reply, "stop", 0))
        f = concurrent.futures.Future()
        f.set_result(out)
        return f


def test_pass_rate_filter_runs_each_task_through_its_workflow(tmp_path, tiny_model_dir):
    from configs import cli, resolve_stages
    from configs.schema import OperatorConfig
    from engines import EngineHandle
    from models import load_tokenizer
    from pipelines import Context, build
    from pipelines.registry import TASK_OPERATORS

    path = write_config(tmp_path, tiny_model_dir, **{"buffer.default_reward_fn_type": "accuracy_reward"})
    (cfg,) = resolve_stages(cli(["--config", str(path)])[0])
    tok = load_tokenizer(tiny_model_dir)
    handle = EngineHandle(AnswerEngine(tok), tok, {"max_tokens": 20})
    spec = OperatorConfig("pass_rate_filter", {"api_or_hf_model": "m", "repeat_times": 4, "max_score": 0.75})
    where = "data_processor.task_pipeline.operators[0]"
    op = build(spec, TASK_OPERATORS, Context(cfg, {"m": handle}, where, explore.run_tasks))
    rows = [dict(r) for r in ROWS]
    kept, stats = op.process(rows)
    assert [r["pass_rate"] for r in rows] == [1.0, 0.5, 0.0]  # 4/4, 2/4, 0/4 right
    assert [r["question"] for r in kept] == ["What is 4 + 4?", "What is 9 + 1?"]  # 1.0 > max_score 0.75
    assert stats == pytest.approx({"mean_pass_rate": 0.5, "failed": 0.0})
    assert handle.engine.count == {"2 + 3": 4, "4 + 4": 4, "9 + 1": 4}


# --- the pipeline: file, cache, refusals, crash, Data-Juicer dispatch

USER_OP = '''
import json, os
from pathlib import Path

class KeepShort:
    """Keeps the rows whose question has at most max_len characters; counts its runs in a file."""
    def __init__(self, max_len: int = 100, counter: str = ""):
        self.max_len, self.counter = max_len, counter

    def process(self, rows):
        if self.counter:
            p = Path(self.counter)
            p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else "1")
        kept = [dict(r, length=len(r["question"])) for r in rows if len(r["question"]) <= self.max_len]
        return kept, {"longest": max(len(r["question"]) for r in rows)}

class Boom:
    def process(self, rows):
        raise RuntimeError("boom")
'''


def pipeline_cfg(tmp_path, tiny_model_dir, operators, rows=None, **over):
    from configs import cli, resolve_stages

    data = jsonl(tmp_path / "in.jsonl", rows or ROWS + [{"question": "What is 10 + 10 + 10?", "answer": "#### 30"}])
    (tmp_path / "ops.py").write_text(USER_OP)
    tp = {"inputs": [str(data)], "operators": operators, "target_fields": ["question"]}
    path = write_config(tmp_path, tiny_model_dir, **{"data_processor.task_pipeline": tp, **over})
    (cfg,) = resolve_stages(cli(["--config", str(path)])[0])
    return cfg


def user_op(tmp_path, **args):
    return {"name": f"{tmp_path}/ops.py:KeepShort", "args": {"counter": str(tmp_path / "runs"), **args}}


def test_pipeline_writes_once_reuses_and_recomputes(tmp_path, tiny_model_dir, caplog):
    from pipelines.task import with_task_pipeline

    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=14)])
    new, metrics = with_task_pipeline(cfg)
    ts = new.buffer.explorer_input.tasksets[0]
    out = Path(ts.path)
    assert out.parent == Path(cfg.checkpoint_job_dir, "task_pipeline") and out.name.startswith("tasks-")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [dict(r, length=14) for r in ROWS]  # the 21-character question dropped; the column kept
    assert (ts.name, ts.format) == (
        cfg.buffer.explorer_input.tasksets[0].name,
        cfg.buffer.explorer_input.tasksets[0].format,
    )
    assert metrics == {
        "pipeline/task/KeepShort/kept": 3.0,
        "pipeline/task/KeepShort/dropped": 1.0,
        "pipeline/task/KeepShort/longest": 21.0,
    }
    manifest = json.loads(out.with_suffix(".json").read_text())
    assert [(r["rows_in"], r["rows_out"]) for r in manifest["operators"]] == [(4, 3)]
    # unchanged: reused (the operator did not run again, the manifest is the same), and said so
    before = out.with_suffix(".json").read_text()
    with caplog.at_level("INFO", logger="nanorft.pipelines"):
        again, metrics2 = with_task_pipeline(cfg)
    assert "unchanged" in caplog.text and "reusing" in caplog.text
    assert (tmp_path / "runs").read_text() == "1" and out.with_suffix(".json").read_text() == before
    assert again.buffer.explorer_input.tasksets[0].path == str(out) and metrics2 == metrics
    # an argument changed: recomputed into another file
    cfg2 = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=100)])
    other = Path(with_task_pipeline(cfg2)[0].buffer.explorer_input.tasksets[0].path)
    assert other != out and len(other.read_text().splitlines()) == 4 and (tmp_path / "runs").read_text() == "2"
    # the input changed: recomputed too
    jsonl(tmp_path / "in.jsonl", ROWS[:2])
    third = Path(with_task_pipeline(cfg2)[0].buffer.explorer_input.tasksets[0].path)
    assert third not in (out, other) and len(third.read_text().splitlines()) == 2
    # the taskset's reward function changed (what pass_rate_filter scores with): recomputed too
    cfg3 = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=100)], rows=ROWS[:2])
    cfg3.buffer.explorer_input.tasksets[0].default_reward_fn_type = "accuracy_reward"
    fourth = Path(with_task_pipeline(cfg3)[0].buffer.explorer_input.tasksets[0].path)
    assert fourth not in (out, other, third) and (tmp_path / "runs").read_text() == "4"


def test_explorers_starting_at_once_compute_it_once(tmp_path, tiny_model_dir):
    """Two explorers (threads here: flock locks each open file apart) at once: the operator runs once, both read
    the same file."""
    import concurrent.futures

    from pipelines.task import with_task_pipeline

    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=14)])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(with_task_pipeline, [cfg, cfg]))
    assert (tmp_path / "runs").read_text() == "1"
    assert got[0][0].buffer.explorer_input.tasksets[0].path == got[1][0].buffer.explorer_input.tasksets[0].path
    assert got[0][1] == got[1][1]


def test_pipeline_metric_names(tmp_path, tiny_model_dir):
    from pipelines.task import with_task_pipeline

    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=14), user_op(tmp_path, max_len=13)])
    with pytest.raises(DataError, match=r"operator 'KeepShort#2' dropped the last 3 row\(s\)"):
        with_task_pipeline(cfg)
    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_len=14), user_op(tmp_path, max_len=100)])
    _, metrics = with_task_pipeline(cfg)
    assert metrics["pipeline/task/KeepShort/dropped"] == 1.0 and metrics["pipeline/task/KeepShort#2/kept"] == 3.0


def test_pipeline_refuses_bad_operators_by_name(tmp_path, tiny_model_dir):
    from pipelines.task import with_task_pipeline

    typo = pipeline_cfg(tmp_path, tiny_model_dir, [{"name": "llm_dificulty_score_filter", "args": {}}])
    with pytest.raises(ConfigError, match="unknown operator 'llm_dificulty_score_filter'; did you mean 'llm_diff"):
        with_task_pipeline(typo)
    bad_arg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path, max_length=3)])
    with pytest.raises(ConfigError, match=r"operators\[0\]: operator .* takes no argument 'max_length'; did you"):
        with_task_pipeline(bad_arg)
    missing = pipeline_cfg(tmp_path, tiny_model_dir, [{"name": f"{tmp_path}/ops.py:Nope"}])
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        with_task_pipeline(missing)
    assert not list(Path(typo.checkpoint_job_dir, "task_pipeline").glob("tasks-*"))


def test_pipeline_crash_leaves_no_file(tmp_path, tiny_model_dir):
    from pipelines.task import with_task_pipeline

    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [user_op(tmp_path), {"name": f"{tmp_path}/ops.py:Boom"}])
    with pytest.raises(RuntimeError, match="boom"):
        with_task_pipeline(cfg)
    folder = Path(cfg.checkpoint_job_dir, "task_pipeline")
    assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # no output, no manifest, no .tmp


def test_data_juicer_names_go_to_run_rows_in_runs(tmp_path, tiny_model_dir, monkeypatch):
    """Consecutive Data-Juicer names: one run_rows call with their {name: args} list (a stand-in for the module)."""
    from pipelines.task import with_task_pipeline

    calls = []

    def run_rows(rows, ops, target_fields, np):
        calls.append((len(rows), ops, target_fields, np))
        return rows[:-1], {"ops": float(len(ops))}

    monkeypatch.setitem(sys.modules, "pipelines.data_juicer", types.SimpleNamespace(run_rows=run_rows))
    ops = [
        {"name": "text_length_filter", "args": {"min_len": 3}},
        {"name": "words_num_filter", "args": {}},
        user_op(tmp_path),
        {"name": "text_length_filter", "args": {"max_len": 99}},
    ]
    cfg = pipeline_cfg(tmp_path, tiny_model_dir, ops, **{"data_processor.task_pipeline.num_process": 3})
    new, metrics = with_task_pipeline(cfg)
    assert calls == [
        (4, [{"text_length_filter": {"min_len": 3}}, {"words_num_filter": {}}], ["question"], 3),
        (3, [{"text_length_filter": {"max_len": 99}}], ["question"], 3),
    ]
    assert metrics["pipeline/task/data_juicer/kept"] == 3.0 and metrics["pipeline/task/data_juicer#2/ops"] == 1.0
    assert len(Path(new.buffer.explorer_input.tasksets[0].path).read_text().splitlines()) == 2


def test_stage_overrides_data_processor(tmp_path, tiny_model_dir):
    from configs import cli, resolve_stages

    op = {"name": "x.py:Op", "args": {"k": 1}}
    path = write_config(
        tmp_path,
        tiny_model_dir,
        **{
            "data_processor": {"task_pipeline": {"operators": [op], "num_process": 2}},
            "stages": [
                {"stage_name": "a"},
                {"stage_name": "b", "data_processor": {"task_pipeline": {"num_process": 7, "operators": []}}},
            ],
        },
    )
    a, b = resolve_stages(cli(["--config", str(path)])[0])
    assert a.data_processor.task_pipeline.operators[0].name == "x.py:Op"
    assert a.data_processor.task_pipeline.num_process == 2
    assert b.data_processor.task_pipeline.num_process == 7 and b.data_processor.task_pipeline.operators == []


# --- the seed's example, end to end


@pytest.mark.slow(seconds=3)
def test_seed_example_runs_through_an_auxiliary_model(tmp_path, tiny_model_dir, caplog):
    """The config guide's task_pipeline block as written (the experience half: test_seed_data_processor_block_in_mode_
    both), inputs a local file, api_or_hf_model the run's auxiliary tiny model: Data-Juicer's prompt (~1,800
    characters) is longer than the tiny model's max_model_len, so the engine refuses each request and every score is
    Data-Juicer's 0.0 for a failed call, kept by min_score 0.0; the explorer then explores the written file's tasks."""
    from buffer import ExperienceDB

    data = jsonl(tmp_path / "tasks.jsonl", ROWS)
    seed = {
        "task_pipeline": {
            "num_process": 32,
            "operators": [
                {
                    "name": "llm_difficulty_score_filter",
                    "args": {
                        "api_or_hf_model": Path(tiny_model_dir).name,
                        "min_score": 0.0,
                        "input_keys": ["question", "answer"],
                        "field_names": ["Question", "Answer"],
                    },
                }
            ],
            "inputs": [str(data)],
            "target_fields": ["question", "answer"],
        }
    }
    over = {
        "data_processor": seed,
        "buffer.total_steps": None,
        "buffer.total_epochs": 1,
        "explorer.auxiliary_models": [{"model_path": tiny_model_dir, "engine_type": "hf", "max_model_len": 512}],
    }
    path = write_config(tmp_path, tiny_model_dir, **over)
    out = run_explorer(path)
    assert out.returncode == 0, out.stderr
    (out,) = (tmp_path / "ck" / "p" / "e" / "task_pipeline").glob("tasks-*.jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [dict(r, llm_difficulty_score=0.0, llm_difficulty_record="") for r in ROWS]
    # the explorer read the 3 tasks of that file (one step of batch_size 3, one epoch), not the 50 of arith/train
    db = next((tmp_path / "ck" / "p" / "e" / "buffer").glob("*.db"))
    tasks = {t for (t,) in raw(f"sqlite:///{db}", "SELECT DISTINCT task_id FROM experiences")}
    assert tasks == {"arith/0", "arith/1", "arith/2"}
    assert ExperienceDB(f"sqlite:///{db}").explorer_states()["explorer"]["step"] == 1
    history = [json.loads(line) for line in (tmp_path / "ck" / "p" / "e" / "monitor" / "explorer.jsonl").open()]
    first = next(h for h in history if "pipeline/task/llm_difficulty_score_filter/kept" in h)
    assert first["step"] == 0 and first["pipeline/task/llm_difficulty_score_filter/dropped"] == 0
    assert first["pipeline/task/llm_difficulty_score_filter/unparsed"] == 3
    assert first["pipeline/task/llm_difficulty_score_filter/refused"] == 3
    assert "refused a request" in (tmp_path / "ck" / "p" / "e" / "log" / "explorer.log").read_text()


def test_pass_rate_filter_on_a_real_auxiliary_model(tmp_path, tiny_model_dir):
    """The tiny model as an auxiliary HF model, started for the pipeline and closed after: each task's column is a
    mean of 2 rewards of accuracy_reward (0 or 1), so 0, 0.5 or 1; the manifest counts what the filter kept."""
    from pipelines.task import with_task_pipeline

    op = {"name": "pass_rate_filter", "args": {"api_or_hf_model": Path(tiny_model_dir).name, "repeat_times": 2}}
    over = {
        "explorer.auxiliary_models": [{"model_path": tiny_model_dir, "engine_type": "hf", "max_model_len": 512}],
        "buffer.default_reward_fn_type": "accuracy_reward",
    }
    cfg = pipeline_cfg(tmp_path, tiny_model_dir, [op], **over)
    new, metrics = with_task_pipeline(cfg, explore.run_tasks)
    rows = [json.loads(line) for line in Path(new.buffer.explorer_input.tasksets[0].path).read_text().splitlines()]
    assert len(rows) == 4 and {r["pass_rate"] for r in rows} <= {0.0, 0.5, 1.0}
    assert metrics["pipeline/task/pass_rate_filter/mean_pass_rate"] == pytest.approx(
        sum(r["pass_rate"] for r in rows) / 4
    )
    assert metrics["pipeline/task/pass_rate_filter/kept"] == 4.0


SEED_BLOCK = """
data_processor:
  task_pipeline:
    num_process: 32
    operators:
      - name: "llm_difficulty_score_filter"
        args:
          api_or_hf_model: "qwen2.5-7b-instruct"
          min_score: 0.0
          input_keys: ["question", "answer"]
          field_names: ["Question", "Answer"]
    inputs:  # the output will be set to the explorer input automatically
      - ${oc.env:TRINITY_TASKSET_PATH}
    target_fields: ["question", "answer"]
"""


def test_seed_block_loads_verbatim(tmp_path, tiny_model_dir, monkeypatch):
    """The config guide's task_pipeline block as written (its ${oc.env:...} input) loads into the schema."""
    import yaml

    from configs import cli, resolve_stages

    monkeypatch.setenv("TRINITY_TASKSET_PATH", str(tmp_path / "tasks.jsonl"))
    base = yaml.safe_load(write_config(tmp_path, tiny_model_dir).read_text())
    path = tmp_path / "seed.yaml"
    path.write_text(yaml.safe_dump(base) + SEED_BLOCK)
    (cfg,) = resolve_stages(cli(["--config", str(path)])[0])
    tp = cfg.data_processor.task_pipeline
    assert (tp.num_process, tp.inputs, tp.target_fields) == (
        32,
        [str(tmp_path / "tasks.jsonl")],
        ["question", "answer"],
    )
    (op,) = tp.operators
    assert op.name == "llm_difficulty_score_filter" and op.args["min_score"] == 0.0
    assert op.args["field_names"] == ["Question", "Answer"]


def test_explorer_stops_with_the_named_error_when_no_task_is_left(tmp_path, tiny_model_dir, caplog):
    data = jsonl(tmp_path / "in.jsonl", ROWS)
    (tmp_path / "ops.py").write_text(USER_OP)
    tp = {"inputs": [str(data)], "operators": [user_op(tmp_path, max_len=3)]}
    out = run_explorer(write_config(tmp_path, tiny_model_dir, **{"data_processor.task_pipeline": tp}))
    code, errors = out.returncode, out.stderr
    assert code != 0 and "operator 'KeepShort' dropped the last 3 row(s)" in errors and "Traceback" not in errors


@pytest.mark.slow  # ~40 s: launch.py, its task-pipeline process, then explorer and trainer (mode both, 2 steps)
def test_the_launcher_runs_the_task_pipeline_before_the_explorer_and_trainer(tmp_path, tiny_model_dir):
    """launch.py runs the task pipeline alone first (explore.py --task-pipeline), so the trainer's wait never includes
    it: the user operator runs once (its counter file), and the explorer then reuses the output by its hash."""
    from helpers import both_config, launch

    data = jsonl(tmp_path / "in.jsonl", ROWS + [{"question": "What is 10 + 10 + 10?", "answer": "#### 30"}])
    (tmp_path / "ops.py").write_text(USER_OP)
    tp = {"inputs": [str(data)], "operators": [user_op(tmp_path, max_len=14)], "target_fields": ["question"]}
    config = both_config(tmp_path, tiny_model_dir, **{"data_processor.task_pipeline": tp, "buffer.total_steps": 2})
    done = launch(config, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "run"
    assert (tmp_path / "runs").read_text() == "1"  # computed once: by the launcher's task-pipeline process
    launch_log = (job / "log" / "launch.log").read_text()
    assert "the task pipeline first (1 operator(s))" in launch_log
    explorer_log = (job / "log" / "explorer.log").read_text()
    assert "task pipeline: unchanged" in explorer_log and "reusing" in explorer_log
    (out,) = (job / "task_pipeline").glob("tasks-*.jsonl")
    assert [json.loads(line)["question"] for line in out.read_text().splitlines()] == [r["question"] for r in ROWS]


@pytest.mark.slow  # ~90 s: launch.py, the task pipeline's process, explorer (Data-Juicer per step) and trainer
def test_seed_data_processor_block_in_mode_both(tmp_path, tiny_model_dir):
    """The config guide's whole data_processor block on the tiny model, through launch.py in mode both: the task
    pipeline's difficulty filter asks an auxiliary model (the tiny one: each request refused as too long, so every
    score is 0.0 and min_score 0.0 keeps the task), the experience pipeline runs the shipped Data-Juicer recipe at
    the path the guide names, then reward_shaping_mapper with the guide's stats_key (llm_quality_score, which the
    offline recipe does not produce: counted as missing, the reward left as it was) and one it does produce
    (alnum_ratio, ADD 1.0). Each DB row is checked by hand against its own payload."""
    import sqlite3

    from helpers import both_config, launch

    data = jsonl(tmp_path / "tasks.jsonl", ROWS)
    difficulty = {
        "api_or_hf_model": Path(tiny_model_dir).name,
        "min_score": 0.0,
        "input_keys": ["question", "answer"],
        "field_names": ["Question", "Answer"],
    }
    shaping = [
        {"stats_key": "llm_quality_score", "op_type": "ADD", "weight": 1.0},
        {"stats_key": "alnum_ratio", "op_type": "ADD", "weight": 1.0},
    ]
    block = {
        "task_pipeline": {
            "num_process": 32,
            "operators": [{"name": "llm_difficulty_score_filter", "args": difficulty}],
            "inputs": [str(data)],
            "target_fields": ["question", "answer"],
        },
        "experience_pipeline": {
            "operators": [
                {
                    "name": "data_juicer",
                    "args": {"config_path": "examples/grpo_gsm8k_experience_pipeline/dj_scoring_exp.yaml"},
                },
                {"name": "reward_shaping_mapper", "args": {"reward_shaping_configs": shaping}},
            ]
        },
    }
    over = {
        "data_processor": block,
        "buffer.total_steps": 2,
        "buffer.batch_size": 3,
        "explorer.auxiliary_models": [{"model_path": tiny_model_dir, "engine_type": "hf", "max_model_len": 512}],
    }
    config = both_config(tmp_path, tiny_model_dir, **over)
    done = launch(config, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "run"
    (out,) = (job / "task_pipeline").glob("tasks-*.jsonl")
    assert [json.loads(line)["llm_difficulty_score"] for line in out.read_text().splitlines()] == [0.0] * 3
    db = next((job / "buffer").glob("*.db"))
    rows = sqlite3.connect(db).execute("SELECT e.task_id, e.reward, p.meta FROM experiences e JOIN payloads p "
                                       "ON p.id = e.id ORDER BY e.id").fetchall()  # fmt: skip
    assert rows and {task for task, _, _ in rows} <= {"arith/0", "arith/1", "arith/2"}  # the pipeline's 3 tasks
    for _, reward, meta in rows:
        meta = json.loads(meta)
        info, parts, text = meta["info"], meta["metrics"], meta["response_text"]
        assert info["text_len"] == len(text) and info["char_rep_ratio"] <= 0.5  # the recipe's stats and filter
        alnum = sum(c.isalnum() for c in text) / len(text)
        assert info["alnum_ratio"] == pytest.approx(alnum)
        assert reward == pytest.approx(parts["accuracy"] + parts["format_score"] + alnum)
    history = [json.loads(line) for line in (job / "monitor" / "explorer.jsonl").open()]
    steps = [h for h in history if "pipeline/reward_shaping_mapper/kept" in h]
    assert len(steps) == 2
    for h in steps:  # every experience the mapper saw lacked llm_quality_score
        assert h["pipeline/reward_shaping_mapper/missing"] == h["pipeline/reward_shaping_mapper/kept"] > 0
        assert h["pipeline/data_juicer/kept"] == h["pipeline/reward_shaping_mapper/kept"]
