"""explore.py --debug (one task through its workflow, printed; no DB, no trainer) and tool_workflow end to end with a
tool written outside the repository and named only in the YAML, with the chat templates of other families than the
tiny model's (Mistral's: a model trained to call the tool in its format; gpt-oss's): the entry points run as
processes, as a user runs them (the other --debug cases call explore.main in this process). tests/test_tool_parsers.py
has the five families' formats in-process."""

import json
import os
import sqlite3
from pathlib import Path

import pytest

from configs import ConfigError
from helpers import ROOT, run_explorer, scripted, tool_task, trained_to_reply, write_config
from models import load_tokenizer
from workflows import build_workflow

TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
ADD_TOOL = '''
def add(a: int, b: int) -> str:
    """Adds two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)
'''
QUESTION = "What is 41 + 42?"
CALL = '[TOOL_CALLS]add[ARGS]{"a": 41, "b": 42}'  # the model's call of `add` in Mistral's format (v11 tokenizers)
RESULT = "[TOOL_RESULTS]call00000[TOOL_CONTENT]83[/TOOL_RESULTS]"  # its result as Mistral's template renders it


def outside_tool(root: Path) -> dict:
    """A tool file outside the repository and a one-task taskset, under `root`."""
    (root / "outside").mkdir()
    tool_file = root / "outside" / "my_tools.py"
    tool_file.write_text(ADD_TOOL)
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text(json.dumps({"question": QUESTION, "answer": "#### 83"}) + "\n")
    return {"tool": f"{tool_file}:add", "data": str(root / "data")}


@pytest.fixture(scope="module")
def tool_caller(tiny_model_dir, tmp_path_factory) -> dict:
    """The tiny model trained to call `add` (a file outside the repository) in Mistral's format and to answer
    "#### 83" after its result, with everything a config needs. It is trained on an explorer's own contexts,
    recorded by playing the model's part (helpers.scripted) through tool_workflow with Mistral's template (a Llama
    3.1 prompt with the tool is ~1,100 tokens: training on it took 3x as long)."""
    root = tmp_path_factory.mktemp("tool-caller")
    caller = outside_tool(root)
    template = TEMPLATES / "mistral-v11.jinja"
    tok = load_tokenizer(tiny_model_dir)
    model = scripted(tok, [CALL, "#### 83"])
    messages = [{"role": "user", "content": QUESTION}]
    args = {"tools": [caller["tool"]], "max_turns": 3}
    task = tool_task(
        prompt=QUESTION, messages=messages, workflow_args=args, chat_template=template.read_text(), repeat_times=1
    )
    (exp,) = build_workflow(task, model).run()
    assert exp.reward == pytest.approx(1.1)  # the scripted run itself: the call read, run, answered
    contexts = [ids for ids, _ in model.engine.requests]
    replies = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in (CALL, "#### 83")]
    path = trained_to_reply(tiny_model_dir, root / "model", list(zip(contexts, replies)))
    return {**caller, "model": path, "template": str(template)}


def tool_config(tmp_path: Path, caller: dict, **over) -> Path:
    """Explore mode, one step of one task (2 greedy episodes), tool_workflow with the outside tool named only here and
    the chat template of the caller (model.chat_template_path): no line of the project names either."""
    taskset = {
        "name": "adds",
        "path": caller["data"],
        "split": "train",
        "format": {"prompt_key": "question", "response_key": "answer"},
        "rollout_args": {"temperature": 0.0},
        "workflow_args": {"tools": [caller["tool"]], "max_turns": 3},
    }
    settings = {
        "model.chat_template_path": caller["template"],
        "model.max_prompt_tokens": 900,
        "model.max_response_tokens": 48,
        "model.max_model_len": 1024,
        "buffer.batch_size": 1,
        "buffer.total_steps": 1,
        "buffer.default_workflow_type": "tool_workflow",
        "buffer.explorer_input.taskset": taskset,
        "buffer.explorer_input.eval_tasksets": [],
    }
    return write_config(tmp_path, caller["model"], **{**settings, **over})


@pytest.mark.slow
def test_an_explorer_runs_a_tool_named_only_in_the_yaml_in_mistrals_format(tool_caller, tmp_path):
    """explore.py as a process: the model calls the outside tool in Mistral's format, the explorer reads the call
    (the parser told by the chat template), runs the tool in a worker, renders its result with Mistral's template,
    the model answers from it, and the experiences in the DB carry reward 1.1 and one tool call each."""
    out = run_explorer(tool_config(tmp_path, tool_caller))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tool calls are read as mistral (workflow_args.tool_parser: auto)" in out.stderr
    db = next((tmp_path / "ck").rglob("*.db"))
    rows = (
        sqlite3.connect(db)
        .execute("SELECT e.reward, p.meta FROM experiences e JOIN payloads p ON p.id = e.id ORDER BY e.id")
        .fetchall()
    )
    assert [r for r, _ in rows] == pytest.approx([1.1, 1.1])
    for _, meta in rows:
        meta = json.loads(meta)
        assert (meta["metrics"]["tool_calls"], meta["metrics"]["turns"]) == (1.0, 2.0)
        assert meta["response_text"].startswith(CALL) and RESULT in meta["response_text"]
        assert meta["response_text"].endswith("#### 83<|im_end|></s>")  # sampled end of turn, the template's closing


@pytest.mark.slow
def test_debug_runs_one_task_of_a_tool_workflow_and_prints_what_it_did(tool_caller, tmp_path):
    """`explore.py --config X --debug`, as a newcomer runs it on the same config: the parser it chose, the tool call
    with its arguments and result, each experience's turns (the model's tokens apart from the template's and the
    tool's), reward, and the row it would write; no DB is made."""
    out = run_explorer(tool_config(tmp_path, tool_caller), "--debug")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("=== stage e, taskset adds, task 0 (adds/0): workflow tool_workflow, reward function ")
    assert "  [tools] tool calls are read as mistral (workflow_args.tool_parser: auto)" in text
    assert text.count('  [tools] add({"a": 41, "b": 42}) -> "83"') == 2
    assert text.count("--- experience ") == 2 and text.count("reward 1.1, ") == 2
    assert f"  [action {len(CALL) + 1}] {json.dumps(CALL + '<|im_end|>')}" in text  # the call's bytes and EOS
    assert json.dumps(RESULT)[1:-1] in text
    rows = [json.loads(line[len("row: ") :]) for line in text.splitlines() if line.startswith("row: ")]
    assert [(r["group_id"], r["run_id"], r["reward"]) for r in rows] == [
        ("explorer/0/adds/0", 0, 1.1),
        ("explorer/0/adds/0", 1, 1.1),
    ]
    assert all(len(r["tokens"]) == r["prompt_length"] + r["logprobs"]["n"] for r in rows)
    assert not list((tmp_path / "ck").rglob("*.db"))


def debug_here(config: Path, *args: str, capsys) -> tuple[int, str]:
    """`explore.py --config X --debug ARGS` in this process (the process itself: test_debug_runs_one_task_of_a_tool_\
    workflow_and_prints_what_it_did): its exit code and stdout. What `configs.entry` and `--debug` set for a process
    (environment variables, logger levels) is put back afterwards."""
    import logging

    from explore import main
    from workflows import tool_parsers

    tool_parsers._log_once.cache_clear()  # said once per process: this run says it again
    env = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "TRANSFORMERS_VERBOSITY")}
    loggers = [logging.getLogger(), logging.getLogger("nanorft.tools")]
    levels = [logger.level for logger in loggers]
    capsys.readouterr()
    try:
        code = main(["--config", str(config), "--debug", *args])
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_debug_runs_a_tool_workflow_with_gpt_oss_template_and_an_outside_tool(tiny_model_dir, tmp_path, capsys):
    """The same command with another family's template (gpt-oss's harmony format), the tiny model untrained: the tool
    named in the YAML loads, its schema from its docstring reaches the template, replies are read as gpt-oss's
    (`openai`); this model makes no call."""
    caller = {**outside_tool(tmp_path), "model": tiny_model_dir, "template": str(TEMPLATES / "gpt-oss.jinja")}
    code, stdout = debug_here(tool_config(tmp_path, caller), capsys=capsys)
    assert code == 0, stdout[-3000:]
    assert "  [tools] tool calls are read as openai (workflow_args.tool_parser: auto)" in stdout
    assert "// Adds two whole numbers.\\ntype add = (_: {\\n// The first number.\\na: number" in stdout
    assert stdout.count("--- experience ") == 2 and not list((tmp_path / "ck").rglob("*.db"))


@pytest.mark.slow
def test_debug_picks_a_task_of_the_taskset_it_is_told(tiny_model_dir, tmp_path, capsys):
    """--task N of --taskset NAME (an eval one here), with the tiny model and math_workflow."""
    config = write_config(tmp_path, tiny_model_dir)
    code, stdout = debug_here(config, "--taskset", "arith_test", "--task", "2", capsys=capsys)
    assert code == 0, stdout[-3000:]
    rows = (Path(tiny_model_dir).parent / "arith" / "test.jsonl").read_text().splitlines()
    assert stdout.startswith("=== stage e, taskset arith_test, task 2 (arith_test/2): workflow math_workflow")
    assert json.dumps(json.loads(rows[2])["question"]) in stdout
    assert stdout.count("--- experience ") == 2  # the eval taskset's repeat_times
    assert not list((tmp_path / "ck").rglob("*.db"))


@pytest.mark.slow
def test_debug_names_a_task_or_taskset_that_is_not_there(tiny_model_dir, tmp_path, capsys):
    import configs
    from explore import debug_task, main

    (cfg,) = configs.resolve_stages(configs.cli(["--config", str(write_config(tmp_path, tiny_model_dir))])[0])
    assert debug_task(cfg, "", 1)[1].task_id == "arith/1"  # the first training taskset by default
    with pytest.raises(ConfigError, match=r"^--task 999: taskset arith has tasks 0 to \d+$"):
        debug_task(cfg, "", 999)
    with pytest.raises(ConfigError, match=r"^--taskset nope: no such taskset in stage e \(its tasksets: arith, "):
        debug_task(cfg, "nope", 0)
    assert main(["--config", "x.yaml", "--task", "1"]) == 2  # before the config is read
    assert "--task: only with --debug" in capsys.readouterr().err
