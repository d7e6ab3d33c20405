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
    tool's), reward, and the row it would write (--full-rows: every token id); no DB is made."""
    out = run_explorer(tool_config(tmp_path, tool_caller), "--debug", "--full-rows")
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


# --- what --debug shows of the group, the tools and the weights; --reply (canned replies), --full-rows


@pytest.mark.slow
@pytest.mark.parametrize("answer, reward", [("#### 83", 1.1), ("#### 84", 0.1)])
def test_debug_reply_plays_a_tool_call_through_tool_workflow(tiny_model_dir, tmp_path, capsys, answer, reward):
    """`--reply CALL --reply ANSWER` on tool_workflow with the untrained tiny model and Mistral's template: the canned
    call goes through the real parser, the tool runs and its result is rendered, the second turn gets the second reply
    and the real reward function scores it (math_reward against "#### 83": accuracy 1 + format 0.1, or 0 + 0.1). The
    tools offered are listed with their schemas, the shared prompt is printed once, and the tied group is named."""
    caller = {**outside_tool(tmp_path), "model": tiny_model_dir, "template": str(TEMPLATES / "mistral-v11.jinja")}
    code, stdout = debug_here(tool_config(tmp_path, caller), "--reply", CALL, "--reply", answer, capsys=capsys)
    assert code == 0, stdout[-3000:]
    schema = {
        "name": "add",
        "description": "Adds two whole numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "integer", "description": "The second number."},
            },
            "required": ["a", "b"],
        },
    }
    assert f"tools offered (1):\n  add: {json.dumps(schema, separators=(',', ':'))}\n" in stdout
    assert stdout.count('  [tools] add({"a": 41, "b": 42}) -> "83"') == 2
    assert json.dumps(RESULT)[1:-1] in stdout  # the tool's result, rendered by Mistral's template
    assert stdout.count("--- experience ") == 2 and stdout.count(f": reward {reward:g}, ") == 2
    assert stdout.count('"tool_calls": 1.0, "turns": 2.0') == 2
    assert stdout.count(f"  [action {len(CALL) + 1}] {json.dumps(CALL + '<|im_end|>')}") == 2  # the reply and EOS
    assert stdout.count(f"  [action {len(answer) + 1}] {json.dumps(answer + '<|im_end|>')}") == 2
    assert stdout.count("prompt (") == 2 and stdout.count(" tokens): as above\n") == 1  # the group's prompt once
    assert f"WARNING: the group's 2 rewards tie ({reward:g}): no response is better than another" in stdout
    assert not list((tmp_path / "ck").rglob("*.db"))


def test_canned_engine_answers_each_turn_with_its_reply_and_the_models_logprobs(tiny_model_dir):
    """engines.CannedEngine: a conversation's k-th turn gets reply k (the last repeats; another episode's first turn
    gets the first again), EOS added, cut at max_tokens; the log-probs are the model's own of those tokens at
    temperature 1 (a greedy request's scored temperature), checked against a forward pass here."""
    import torch

    from engines import CannedEngine, HFEngine
    from models import load_model
    from sampling import SamplingParams

    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(tiny_model_dir)
    try:
        canned = CannedEngine(engine, tok, ["ab", "xyz"])
        greedy = SamplingParams(n=2, temperature=0.0, max_tokens=10)
        prompt = tok.encode("What?", add_special_tokens=False)
        first = canned.submit(prompt, greedy).result()
        ab = tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id]
        assert [(c.token_ids, c.finish_reason) for c in first] == [(ab, "stop")] * 2
        model = load_model(tiny_model_dir)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ab])).logits[0, len(prompt) - 1 : -1]  # [R,V]
        by_hand = logits.log_softmax(-1).gather(-1, torch.tensor(ab)[:, None])[:, 0]  # [R]
        assert first[0].logprobs == pytest.approx(by_hand.tolist(), abs=1e-4)
        assert canned.submit(prompt, greedy).result()[0].token_ids == ab  # another episode's first turn
        turn2 = prompt + ab + tok.encode(" tool says 3 ", add_special_tokens=False)
        xyz = tok.encode("xyz", add_special_tokens=False) + [tok.eos_token_id]
        assert canned.submit(turn2, greedy).result()[0].token_ids == xyz
        turn3 = turn2 + xyz + tok.encode(" more ", add_special_tokens=False)
        assert canned.submit(turn3, greedy).result()[0].token_ids == xyz  # the last reply repeats
        cut = canned.submit(turn3, SamplingParams(max_tokens=2)).result()[0]  # turn3 again: still the third turn
        assert (cut.token_ids, cut.finish_reason) == (xyz[:2], "length")
    finally:
        engine.close()


def staged_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    """Two stages: `warm` (train) and `rl` (explore), which starts from what `warm` publishes."""
    stages = [{"stage_name": "warm", "mode": "train"}, {"stage_name": "rl", "mode": "explore"}]
    return write_config(tmp_path, tiny_model_dir, stages=stages, **over)


def resolved(config: Path):
    import configs

    return configs.cli(["--config", str(config)])[0]


def test_debug_says_when_a_stage_falls_back_to_the_base_model(tiny_model_dir, tmp_path):
    """--stage rl before `warm` has published anything: the base model runs (launch.stages_in_order leaves
    model.model_path), and the line says so; once `warm` has published, its weights, named."""
    from explore import debug_stage
    from sync import POINTER, weights_path

    cfg = resolved(staged_config(tmp_path, tiny_model_dir))
    stage, line = debug_stage(cfg, "rl")
    warm_dir = tmp_path / "ck" / "p" / "e" / "warm"
    assert (stage.name, stage.model.model_path) == ("e/rl", tiny_model_dir)
    assert line == (
        "weights: the base model: stage e/rl starts from what stage e/warm publishes, and it has published none yet "
        f"(nothing under {warm_dir}; run it first to see the trained model)\n"
    )
    weights_path(warm_dir, 3).mkdir(parents=True)
    (warm_dir / POINTER).write_text("3\n")
    stage, line = debug_stage(cfg, "rl")
    assert stage.model.model_path == str(weights_path(warm_dir, 3))
    assert line == f"weights: the last that stage e/warm published ({weights_path(warm_dir, 3)})\n"
    assert debug_stage(cfg, "")[0].name == "e/rl"  # the first stage that runs workflows


def group(rewards: list[float]) -> list:
    """One group of experiences (6-token prompt, 4-token responses) with these rewards."""
    from helpers import experiences

    exps = experiences([(6, [4] * len(rewards))])
    for x, r in zip(exps, rewards):
        x.reward = r
    return exps


@pytest.mark.parametrize(
    "algorithm, shown",
    [
        # GRPO: A = (r - mean) / (std + 1e-6), std unbiased: [1, 0, 0, 1] -> mean 0.5, std 0.57735 -> +-0.8660
        ("grpo", "1: +0.8660, 2: -0.8660, 3: -0.8660, 4: +0.8660"),
        # RLOO: A = r - the mean of the others: 1 - 1/3, 0 - 2/3
        ("rloo", "1: +0.6667, 2: -0.6667, 3: -0.6667, 4: +0.6667"),
    ],
)
def test_debug_shows_the_advantages_of_the_configured_advantage_fn(tiny_model_dir, tmp_path, algorithm, shown):
    import configs
    from explore import shown_advantages

    config = write_config(tmp_path, tiny_model_dir, **{"algorithm.algorithm_type": algorithm})
    (cfg,) = configs.resolve_stages(resolved(config))
    text = shown_advantages(group([1.0, 0.0, 0.0, 1.0]), cfg)
    assert text.startswith(f"advantages ({algorithm} {{")
    assert text.endswith(f"each experience's mean over its action tokens): {shown}")
    assert "WARNING" not in text


def test_debug_warns_when_the_groups_rewards_tie(tiny_model_dir, tmp_path):
    """Tied rewards: GRPO's advantages are all 0, the trainer learns nothing from the group: one plain line."""
    import configs
    from explore import shown_advantages

    (cfg,) = configs.resolve_stages(resolved(write_config(tmp_path, tiny_model_dir)))
    text = shown_advantages(group([0.5, 0.5, 0.5]), cfg)
    assert text.splitlines() == [
        text.splitlines()[0],
        "WARNING: the group's 3 rewards tie (0.5): no response is better than another, nothing to learn from this "
        "group (every advantage is 0)",
    ]
    assert text.splitlines()[0].endswith("): 1: +0.0000, 2: +0.0000, 3: +0.0000")


def test_debug_says_what_it_cannot_compute_of_the_advantages(tiny_model_dir, tmp_path):
    """PPO's GAE needs the critic's values: not computed in the explorer, and said so."""
    import configs
    from explore import shown_advantages

    config = write_config(tmp_path, tiny_model_dir, **{"algorithm.algorithm_type": "ppo", "algorithm.repeat_times": 1})
    (cfg,) = configs.resolve_stages(resolved(config))
    text = shown_advantages(group([1.0]), cfg)
    assert text.startswith("advantages (ppo {") and text.endswith(
        "): not computed here: it needs values, which the trainer computes"
    )


def test_debug_rows_are_short_unless_asked(tiny_model_dir):
    """A row's token ids: the first and last 8 and how many are hidden between them; all of them with --full-rows."""
    import torch

    from explore import shown_experience

    tok = load_tokenizer(tiny_model_dir)
    (exp,) = group([1.0])
    exp.tokens = torch.arange(40)
    exp.prompt_length = 30
    row = json.loads(shown_experience(exp, 0, 1, tok, False, False).splitlines()[-1][len("row: ") :])
    assert row["tokens"] == [*range(8), "... 24 more (--full-rows) ...", *range(32, 40)]
    row = json.loads(shown_experience(exp, 0, 1, tok, False, True).splitlines()[-1][len("row: ") :])
    assert row["tokens"] == list(range(40))


def test_reply_and_full_rows_only_with_debug(capsys):
    from explore import main

    assert main(["--config", "x.yaml", "--reply", "hi", "--full-rows"]) == 2  # before the config is read
    assert "--reply, --full-rows: only with --debug" in capsys.readouterr().err
