"""workflows/: answer extraction and equivalence, GSM8K gold solutions judged against themselves,
the countdown safe evaluator, the registries, and each workflow's run() against a scripted fake model."""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from buffer import Experience
from configs import ConfigError, from_dict
from configs.schema import GenerationConfig
from helpers import ROOT, make_task, write_config
from tasksets import Task
from workflows import (
    REWARD_FNS,
    WORKFLOWS,
    Workflow,
    build_reward_fn,
    build_workflow,
    lookup,
    sampling_kwargs,
)
from workflows.countdown import PROMPT, countdown_reward, evaluate, parse_equation
from workflows.judge import JudgeError, parse_grade
from workflows.math import (
    accuracy_reward,
    extract_answer,
    format_reward,
    is_equivalent,
    math_reward,
)

GSM8K_TEST = Path(__file__).parent / "data" / "gsm8k" / "main" / "test.jsonl"


# --- GSM8K judgement: gold solutions must be judged correct, altered ones never


def altered(solution: str) -> str:
    """The solution with its final number N after '####' replaced by N+1, same format (commas kept)."""
    head, _, tail = solution.rpartition("####")
    n = int(tail.strip().replace(",", ""))
    return f"{head}#### {n + 1:,}" if "," in tail else f"{head}#### {n + 1}"


def test_gsm8k_gold_answers_are_correct_and_altered_ones_are_not():
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    start = time.monotonic()
    gold = [math_reward(r["answer"], r["answer"])["accuracy"] for r in rows]
    rate = sum(gold) / len(rows)
    wrong = [altered(r["answer"]) for r in rows]
    assert all(w != r["answer"] and re.search(r"\n#### -?[\d,]+$", w) for w, r in zip(wrong, rows))
    fooled = sum(math_reward(w, r["answer"])["accuracy"] for w, r in zip(wrong, rows))
    elapsed = time.monotonic() - start
    print(
        f"GSM8K test: gold judged correct {rate:.2%} ({int(sum(gold))}/{len(rows)}), "
        f"altered judged correct {int(fooled)}/{len(rows)}, {elapsed:.1f} s"
    )
    assert rate >= 0.995
    assert fooled == 0
    assert elapsed < 30


# --- extraction and equivalence


@pytest.mark.parametrize(
    "response,reference,expected",
    [
        ("so the total is\n#### 1,234", 1234, 1.0),
        ("#### 1,234", "#### 1234", 1.0),
        ("The answer is $\\boxed{\\frac{3}{4}}$.", 0.75, 1.0),
        ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("\\boxed{\\frac{\\sqrt{4}}{2}} is it", "1", 1.0),  # nested braces, symbolic
        ("\\boxed{\\frac{\\sqrt{4}}{2}} is it", "2", 0.0),
        ("<answer> 42 </answer>", "#### 42", 1.0),
        ("<answer> 41 </answer>", "#### 42", 0.0),
        ("#### -5", -5, 1.0),
        ("the change is -5 dollars", "#### -5", 1.0),  # last-number fallback, negative
        ("#### 5", -5, 0.0),
        ("#### 72.0", 72, 1.0),
        ("#### 72.", "#### 72", 1.0),
        ("#### $18", "#### 18", 1.0),
        ("#### 0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("\\boxed{x + 1}", "\\boxed{1 + x}", 1.0),  # non-numeric: math_verify
        ("#### Step 1\nThen it is 7.", 7, 1.0),  # a markdown heading is not an answer
        ("I have no idea.", 3, 0.0),  # no number at all
    ],
)
def test_accuracy_cases(response, reference, expected):
    assert accuracy_reward(response, reference)["accuracy"] == expected


def test_extraction_order_and_last_number_fallback():
    assert extract_answer("\\boxed{3} then #### 4") == "4"  # #### wins over boxed
    assert extract_answer("<answer>5</answer> and \\boxed{a{b}c}") == "a{b}c"  # boxed over <answer>
    assert extract_answer("\\boxed{1} ... \\boxed{2}") == "2"  # the last one
    assert extract_answer("\\boxed{unclosed") is None
    assert extract_answer("it costs 12 and then 13") is None
    assert extract_answer("it costs 12 and then 13", last_number_fallback=True) == "13"
    assert accuracy_reward("it is 13", 13)["accuracy"] == 1.0
    assert accuracy_reward("it is 13", 13, last_number_fallback=False)["accuracy"] == 0.0
    assert build_reward_fn("math_reward", last_number_fallback=False)("it is 13", 13)["accuracy"] == 0.0


def test_format_and_math_reward_components():
    assert format_reward("#### 3") == {"format_score": 0.1}
    assert format_reward("it is 3") == {"format_score": -0.1}
    assert math_reward("it is 3", "#### 3") == {"accuracy": 1.0, "format_score": -0.1}
    assert math_reward("\\boxed{4}", "#### 3", format_score=0.05) == {"accuracy": 0.0, "format_score": 0.05}


@pytest.mark.parametrize(
    "response",
    [
        "9" * 5000,
        "#### " + "9" * 5000,
        "\\boxed{" + "9" * 5000 + "}",
        "__import__('os').system('touch /tmp/nanorft_pwned')",
        "\\boxed{__import__('os').system('touch /tmp/nanorft_pwned')}",
        "<answer>__import__('os').system('touch /tmp/nanorft_pwned')</answer>",
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{2^{99999999}}",
        "\\boxed{99999!}",
        "#### " + "a" * 38 + "!",
        "<answer>" * 5000,
        "<answer>" * 5000 + "</answer>",
        "{" * 3000 + "\\boxed{" + "{" * 3000,
    ],
)
def test_adversarial_responses_neither_crash_hang_nor_execute(response):
    start, cpu = time.monotonic(), time.process_time()
    assert math_reward(response, "#### 7")["accuracy"] == 0.0
    # CPU seconds (a busy machine stretches the wall clock; a parser stuck in a loop burns CPU), and a wall bound
    assert time.process_time() - cpu < 2.0 and time.monotonic() - start < 30.0
    assert not Path("/tmp/nanorft_pwned").exists()


def test_math_verify_path_works_off_the_main_thread():
    # math_verify's own timeouts use SIGALRM, which raises outside the main thread unless disabled.
    with ThreadPoolExecutor(1) as pool:
        results = list(
            pool.map(
                lambda args: is_equivalent(*args), [("x + 1", "1 + x"), ("\\sqrt{4}", "2"), ("9^{9^{9^{9}}}", "1")]
            )
        )
    assert threading.current_thread() is threading.main_thread()
    assert results == [True, True, False]


# --- countdown

NUMS = {"nums": [3, 5, 2], "target": 16}


@pytest.mark.parametrize(
    "response,expected",
    [
        ("<think>3 + 5 = 8; 8 * 2 = 16</think> <answer> (3 + 5) * 2 </answer>", 1.0),
        ("<answer>1</answer> then <answer>2 * (5 + 3)</answer>", 1.0),  # the last <answer> counts
        ("<answer> 3 * 5 + 2 </answer>", 0.1),  # 17: wrong value
        ("<answer> (3 + 5) * 2 * 1 </answer>", 0.1),  # 1 not given
        ("<answer> (3 + 5) * 2 + 3 - 3 </answer>", 0.1),  # 3 reused
        ("<answer> (3 + 5) * 2 / 0 </answer>", 0.1),  # well-formed, / by 0
        ("<answer> 16 </answer>", 0.1),  # numbers missing
        ("(3 + 5) * 2", 0.0),  # no <answer>
        ("<answer> (3 + 5) * 2 = 16 </answer>", 0.0),  # not an expression
        ("<answer>__import__('os').system('touch /tmp/nanorft_pwned')</answer>", 0.0),
        ("<answer>2**99999999</answer>", 0.0),
        ("<answer>(lambda: 16)()</answer>", 0.0),
        ("<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>", 0.0),
        ("<answer>" + "9" * 5000 + "</answer>", 0.0),
        ("<answer>" * 5000 + "(3 + 5) * 2", 0.0),
    ],
)
def test_countdown_reward(response, expected):
    start = time.monotonic()
    scores = countdown_reward(response, NUMS)
    assert time.monotonic() - start < 1.0
    assert sum(scores.values()) == pytest.approx(expected)
    assert set(scores) == {"accuracy", "format_score"}
    assert not Path("/tmp/nanorft_pwned").exists()


def test_countdown_evaluator():
    assert evaluate(parse_equation("-(3 - 5) * 8 / 2")) == pytest.approx(8.0)
    assert evaluate(parse_equation("10 / 4")) == pytest.approx(2.5)
    assert evaluate(parse_equation("999999 * 999999 * 999999")) is None  # beyond MAX_MAGNITUDE
    for bad in ["True + 1", "1.5 + 2", "a + 1", "1 ** 2", "1 // 2", "[1][0]", "'1' + '2'", ""]:
        assert parse_equation(bad) is None, bad


# --- registries


def math_task(workflow: str = "math_workflow", reward_fn: str = "math_reward", **overrides) -> Task:
    fields = dict(
        raw={"question": "q", "answer": "#### 42"},
        prompt="q",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}],
        reference="#### 42",
        workflow=workflow,
        reward_fn=reward_fn,
        rollout_args=GenerationConfig(temperature=0.7, top_p=0.9, max_tokens=64),
        repeat_times=3,
    )
    return make_task(**{**fields, **overrides})


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_every_workflow_is_constructible(name):
    wf = lookup("workflow", name)(math_task(name, ""), FakeModel([]), build_reward_fn("math_reward"))
    assert isinstance(wf, Workflow)


@pytest.mark.parametrize("name", sorted(REWARD_FNS))
def test_every_reward_fn_returns_float_components(name):
    reference = NUMS if name == "countdown_reward" else "#### 16"
    scores = build_reward_fn(name)("<answer> (3 + 5) * 2 </answer>", reference)
    assert scores and all(isinstance(v, float) for v in scores.values())


def test_unknown_names_fail_listing_the_known_ones():
    with pytest.raises(KeyError, match="math_workflow") as err:
        lookup("workflow", "math_workflw")
    assert "Did you mean 'math_workflow'" in str(err.value) and "countdown_workflow" in str(err.value)
    with pytest.raises(KeyError, match="countdown_reward"):
        build_reward_fn("no_such_reward")
    with pytest.raises(
        ConfigError, match="reward_fn_args.last_number_fallbak: unknown key; did you mean last_number_fallback"
    ):
        build_reward_fn("math_reward", last_number_fallbak=False)


# --- workflows against a scripted fake model


class FakeModel:
    """Implements workflows.ModelHandle: returns the scripted responses, records every call."""

    model_version = 3

    def __init__(self, responses: list[str]) -> None:
        self.responses = responses
        self.calls: list[dict] = []

    def chat(self, messages: list[dict], n: int = 1, **sampling) -> list[Experience]:
        self.calls.append({"messages": messages, "n": n, **sampling})
        return [
            Experience(
                tokens=torch.arange(10),
                prompt_length=6,
                logprobs=torch.zeros(4),
                prompt_text=str(messages),
                response_text=text,
            )
            for text in self.responses[:n]
        ]

    def generate(self, prompts: list[str], n: int = 1, **sampling) -> list[list[Experience]]:
        return [self.chat([{"role": "user", "content": p}], n, **sampling) for p in prompts]


def test_math_workflow_scores_each_response_and_passes_rollout_args():
    model = FakeModel(["6 * 7 = 42\n#### 42", "\\boxed{41}", "I think it is 42 or so"])
    task = math_task(workflow_args={"system_prompt": "Think step by step."})
    exps = build_workflow(task, model).run()
    assert [e.reward for e in exps] == pytest.approx([1.1, 0.1, 0.9])
    assert [e.metrics for e in exps] == [
        {"accuracy": 1.0, "format_score": 0.1},
        {"accuracy": 0.0, "format_score": 0.1},
        {"accuracy": 1.0, "format_score": -0.1},
    ]
    (call,) = model.calls
    assert call["n"] == 3 and call["temperature"] == 0.7 and call["top_p"] == 0.9 and call["max_tokens"] == 64
    assert "top_k" not in call and "logprobs" not in call  # unset args are not sent
    assert call["messages"] == [{"role": "system", "content": "Think step by step."}, {"role": "user", "content": "q"}]
    assert all(e.group_id == "" and e.run_id == 0 for e in exps)  # the runner's job, not ours


def test_math_workflow_defaults_and_last_number_fallback_workflow_arg():
    task = math_task(reward_fn="", workflow_args={"last_number_fallback": False})
    exps = build_workflow(task, FakeModel(["I think it is 42"])).run()  # no reward_fn named: math_reward
    assert exps[0].metrics == {"accuracy": 0.0, "format_score": -0.1}
    assert task.messages[0] == {"role": "system", "content": "be brief"}  # the task is not mutated


def test_simple_workflow_uses_the_configured_reward_fn():
    model = FakeModel(["<answer>(3 + 5) * 2</answer>", "<answer>3 + 5 + 2</answer>"])
    task = math_task("simple_workflow", "countdown_reward", reference=NUMS, repeat_times=2, messages=None)
    exps = build_workflow(task, model).run()
    assert [e.reward for e in exps] == pytest.approx([1.0, 0.1])
    assert model.calls[0]["messages"] == [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match="reward"):
        lookup("workflow", "simple_workflow")(math_task("simple_workflow", ""), model, None).run()


def test_countdown_workflow_builds_the_tinyzero_prompt():
    model = FakeModel(["<answer>(3 + 5) * 2</answer>", "<answer>3 * 5 + 2</answer>", "no idea"])
    task = math_task(
        "countdown_workflow",
        "countdown_reward",
        raw=dict(NUMS),
        prompt=None,
        messages=None,
        reference=None,
        rollout_args=GenerationConfig(temperature=1.0, max_tokens=256),
    )
    exps = build_workflow(task, model).run()
    assert [e.reward for e in exps] == pytest.approx([1.0, 0.1, 0.0])
    assert [e.metrics["accuracy"] for e in exps] == [1.0, 0.0, 0.0]
    (call,) = model.calls
    assert call["messages"] == [{"role": "user", "content": PROMPT.format(nums=[3, 5, 2], target=16)}]
    assert "Using the numbers [3, 5, 2], create an equation that equals 16." in call["messages"][0]["content"]
    assert call["n"] == 3 and call["temperature"] == 1.0 and call["max_tokens"] == 256


def test_sampling_kwargs_drops_unset_and_logprobs():
    assert sampling_kwargs(GenerationConfig(temperature=1.0, logprobs=5)) == {"temperature": 1.0}


def test_empty_answer_forms_state_nothing():
    assert extract_answer("\\boxed{} <answer> </answer>") is None
    assert format_reward("<answer></answer>") == {"format_score": -0.1}


def test_random_reward_repeats_exactly_per_seed_task_and_run():
    """The control's coin flips depend on (seed, task, run) only: a rerun of the experiment draws the same rewards,
    the runs of one group draw their own, and another seed draws others."""

    def rewards(seed: int, index: int = 0) -> list[float]:
        task = math_task("math_workflow", "random_reward", reward_fn_args={"seed": seed}, repeat_times=16, index=index)
        return [e.reward for e in build_workflow(task, FakeModel(["#### 42"] * 16)).run()]

    first = rewards(1)
    assert rewards(1) == first and 0 < sum(first) < 16  # the same responses, yet not one draw for the group
    assert rewards(2) != first and rewards(1, index=5) != first
    with pytest.raises(ConfigError, match=r"reward_fn_args.draw_key: unknown key; valid keys: p, seed"):
        build_reward_fn("random_reward", draw_key="x")  # the workflow gives it, not the config


def test_a_tasksets_args_are_checked_once_and_draw_key_looked_up_once(monkeypatch):
    """Every task of a taskset builds its workflow with the same workflow_args and reward_fn_args: they are checked
    once per process (the config's derivation did it already in a real explorer), each workflow gets its own copy;
    whether the reward function takes a draw_key is looked up once, not for every response."""
    import inspect

    import workflows.args

    checks, signatures, signature = [], [], inspect.signature
    monkeypatch.setattr(workflows.args, "from_dict", lambda *a: checks.append(a[0]) or from_dict(*a))
    monkeypatch.setattr(inspect, "signature", lambda fn: signatures.append(fn) or signature(fn))
    workflows.args._takes_draw_key.cache_clear()
    args = {"system_prompt": f"be brief {os.getpid()} {time.time()}"}  # args this process has not checked yet
    built = [
        build_workflow(
            math_task(
                "math_workflow",
                "random_reward",
                workflow_args=args,
                index=i,
                reward_fn_args={"seed": 7, "p": 0.5 + 1e-9 * os.getpid()},
            ),
            FakeModel(["#### 42"] * 3),
        )
        for i in range(4)
    ]
    signatures.clear()
    assert [len(w.run()) for w in built] == [3] * 4  # 12 responses
    assert sorted(c.__name__ for c in checks) == ["MathArgs", "random_reward_args"]  # once each, not per task
    assert [getattr(f, "__name__", "") for f in signatures] == ["random_reward"]  # once, not per response
    built[0].args.system_prompt = "changed"
    assert built[1].args.system_prompt == args["system_prompt"]  # a copy each
    with pytest.raises(ConfigError, match="workflow_args.max_turn: unknown key"):  # errors are not kept
        build_workflow(math_task("tool_workflow", workflow_args={"max_turn": 2}), FakeModel([]))
    with pytest.raises(ConfigError, match="workflow_args.max_turn: unknown key"):
        build_workflow(math_task("tool_workflow", workflow_args={"max_turn": 2}), FakeModel([]))


# --- a user's own workflow and reward function, named in the YAML (no edit of the project)

USER_FILE = """
from workflows import Workflow, apply_reward

def shout_reward(response, reference, *, bonus=0.0):
    return {"loud": float(response.isupper()) + bonus}

class EchoWorkflow(Workflow):
    def run(self):
        exps = self.model.chat([{"role": "user", "content": self.task.prompt}], n=self.task.repeat_times)
        return [apply_reward(e, self.reward_fn(e.response_text, self.task.reference)) for e in exps]
"""


def test_a_workflow_and_reward_fn_from_the_users_own_file(tmp_path):
    path = tmp_path / "my_task.py"
    path.write_text(USER_FILE)
    task = math_task(f"{path}:EchoWorkflow", f"{path}:shout_reward", reward_fn_args={"bonus": 0.5})
    exps = build_workflow(task, FakeModel(["HEY", "hey", "HO"])).run()
    assert [e.reward for e in exps] == [1.5, 0.5, 1.5] and exps[0].metrics == {"loud": 1.5}
    assert build_reward_fn("workflows.math:math_reward")("#### 4", "#### 4") == {"accuracy": 1.0, "format_score": 0.1}
    with pytest.raises(KeyError, match=r"cannot import .*nope\.py"):
        lookup("workflow", f"{tmp_path}/nope.py:EchoWorkflow")
    with pytest.raises(KeyError, match="has no 'Missing'"):
        lookup("workflow", f"{path}:Missing")
    with pytest.raises(KeyError, match="is not a subclass of workflows.Workflow"):
        lookup("workflow", f"{path}:shout_reward")
    with pytest.raises(ConfigError, match=r"reward_fn_args.loudness: unknown key; valid keys: bonus"):
        build_reward_fn(f"{path}:shout_reward", loudness=2)


@pytest.mark.parametrize(
    "name,why",
    [
        ("builtins:exec", "is not a Python function"),
        ("builtins:eval", "is not a Python function"),
        ("os:system", "is not a Python function"),
        ("subprocess:Popen", "is not a Python function"),
        ("math:pi", "is not a Python function"),
        ("json:loads", r"cannot be called as fn\(response, reference\)"),
    ],
)
def test_a_reward_function_is_python_code_taking_response_and_reference(name, why):
    """A reward named `module:attr` (the YAML's; a task row cannot name one: tests/test_tasksets.py) must be Python
    code taking (response, reference): builtins and classes are refused by name, so that a "reward" never runs the
    model's response (exec, eval) or passes it to a shell (os.system, subprocess.Popen)."""
    with pytest.raises(KeyError, match=f"reward function '{name}' {why}"):
        build_reward_fn(name)
    import functools

    from workflows import python_reward_fn

    assert python_reward_fn(functools.partial(lambda response, reference, k: {"r": k}, k=1), "p")("a", "b") == {"r": 1}
    with pytest.raises(KeyError, match="is not a Python function"):
        python_reward_fn(functools.partial(exec), "partial-of-exec")

    def scaled(response, reference, *, scale):  # its own args come from reward_fn_args
        return {"r": scale}

    assert python_reward_fn(scaled, "scaled") is scaled
    with pytest.raises(KeyError, match=r"'one' cannot be called as fn\(response, reference\)"):
        python_reward_fn(lambda response: {}, "one")


ARGS_FILE = '''
import dataclasses

from configs.checks import AT_LEAST_1
from workflows import Workflow, WorkflowArgs


@dataclasses.dataclass
class EchoArgs(WorkflowArgs):
    RANGES = {"times": AT_LEAST_1}
    times: int = 1
    """How many times to say it."""


class Declared(Workflow):
    Args = EchoArgs

    def run(self):
        return []


class Free(Workflow):
    def run(self):
        return []
'''


def test_a_users_workflow_is_checked_against_the_args_it_declares_when_an_explorer_starts(tmp_path):
    """A user's workflow (`file.py:attr`) with an Args dataclass gets its workflow_args checked as a built-in one's,
    when an explorer starts (the config loader imports no user code) and as each task's workflow is built; one that
    declares none gets task.workflow_args as they are."""
    import configs
    from workflows.args import check_tasksets

    path = tmp_path / "declared.py"
    path.write_text(ARGS_FILE)
    raw = {
        "model": {"model_path": "m", "max_model_len": 256},
        "buffer": {
            "batch_size": 2,
            "explorer_input": {
                "taskset": {"path": "x", "default_workflow_type": f"{path}:Declared", "workflow_args": {"tims": 2}}
            },
        },
    }
    (cfg,) = configs.resolve_stages(configs.from_dict(configs.Config, configs.normalize(raw)))  # not imported here
    with pytest.raises(
        ConfigError,
        match=r"^buffer\.explorer_input\.tasksets\[0\]\.workflow_args\.tims: unknown key; "
        "did you mean times",
    ):
        check_tasksets(cfg)
    cfg.buffer.explorer_input.tasksets[0].workflow_args = {"times": 0}
    with pytest.raises(ConfigError, match=r"workflow_args\.times: 0 is out of range; allowed: >= 1"):
        check_tasksets(cfg)
    cfg.buffer.explorer_input.tasksets[0].workflow_args = {"times": "3"}
    check_tasksets(cfg)
    assert build_workflow(math_task(f"{path}:Declared", workflow_args={"times": "3"}), FakeModel([])).args.times == 3
    with pytest.raises(ConfigError, match=r"^taskset t: workflow_args\.tims: unknown key"):  # a task row's workflow
        build_workflow(math_task(f"{path}:Declared", workflow_args={"tims": 3}), FakeModel([]))
    cfg.buffer.explorer_input.tasksets[0].default_workflow_type = f"{path}:Free"
    cfg.buffer.explorer_input.tasksets[0].workflow_args = {"anything": [1, 2]}
    check_tasksets(cfg)
    assert build_workflow(math_task(f"{path}:Free", workflow_args={"anything": [1]}), FakeModel([])).args == {
        "anything": [1]
    }


EXT_WORKFLOW = '''
from workflows import Workflow, apply_reward


class LengthWorkflow(Workflow):
    """A user's workflow in a package of their own, outside the repository."""

    def run(self):
        exps = self.model.chat([{"role": "user", "content": self.task.prompt}], n=self.task.repeat_times)
        for run, e in enumerate(exps):
            apply_reward(e, self.reward(e.response_text, run))
        return exps
'''


def test_user_code_outside_the_repository_runs_in_the_explorer(tmp_path, tiny_model_dir):
    """explore.py as a user runs it, from the repository: the workflow is `module:attr` of a module found through
    PYTHONPATH, the reward function `rewards.py:attr` with a path relative to the YAML file's directory (not the
    working directory); one explore step writes their experiences."""
    import subprocess
    import sys

    from buffer import ExperienceDB

    (tmp_path / "ext" / "my_ext").mkdir(parents=True)
    (tmp_path / "ext" / "my_ext" / "__init__.py").write_text("")
    (tmp_path / "ext" / "my_ext" / "flows.py").write_text(EXT_WORKFLOW)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "rewards.py").write_text(
        "def length(response, reference):\n    return {'length': float(len(response))}\n"
    )
    config = write_config(
        tmp_path / "cfg",
        tiny_model_dir,
        **{
            "buffer.default_workflow_type": "my_ext.flows:LengthWorkflow",
            "buffer.default_reward_fn_type": "rewards.py:length",
            "buffer.total_steps": 1,
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "ext"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "explore.py", "--config", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    db = next((tmp_path / "cfg" / "ck").rglob("*.db"))
    with ExperienceDB(f"sqlite:///{db}") as d:
        metrics = [json.loads(m)["metrics"] for (m,) in d.query("SELECT meta FROM payloads")]
    assert len(metrics) == 6 and all(m["length"] >= 0 for m in metrics)  # 3 tasks x 2 runs, scored by rewards.py


def test_the_explorer_names_a_workflow_or_reward_fn_that_does_not_exist_before_any_work():
    import configs
    from workflows.args import check_tasksets

    cfg = configs.Config()
    ts = configs.TasksetConfig(
        name="arith", default_workflow_type="math_workflow", default_reward_fn_type="math_reward"
    )
    cfg.buffer.explorer_input.tasksets = [ts]
    check_tasksets(cfg)
    ts.default_workflow_type = "math_workflw"
    with pytest.raises(
        configs.ConfigError,
        match=r"tasksets\[0\].default_workflow_type: unknown workflow "
        r"'math_workflw'\. Did you mean 'math_workflow'\?",
    ):
        check_tasksets(cfg)
    ts.default_workflow_type, ts.reward_fn_args = "math_workflow", {"last_number_fallbak": False}
    with pytest.raises(
        configs.ConfigError,
        match=r"tasksets\[0\].reward_fn_args.last_number_fallbak: unknown key; "
        "did you mean last_number_fallback",
    ):
        check_tasksets(cfg)


# --- an auxiliary model as a judge


@pytest.mark.parametrize(
    "reply,grade", [("Matches. Score: 10", 1.0), ("Score: 3\nno, Score: 7.5", 0.75), ("Score:0", 0.0)]
)
def test_parse_grade(reply, grade):
    assert parse_grade(reply) == grade


@pytest.mark.parametrize("reply", ["Looks fine.", "Score: 11", "Score: -1", "score 5", ""])
def test_parse_grade_refuses_ungraded_output(reply):
    with pytest.raises(JudgeError):
        parse_grade(reply)


class Judge(FakeModel):
    """A judge that replies with the scripted texts in turn; records each replies() call's prompts (each
    conversation's last message) and sampling."""

    def replies(self, conversations, **sampling):
        prompts = [messages[-1]["content"] for messages in conversations]
        self.calls.append({"prompts": prompts, **sampling})
        return [self.responses.pop(0) for _ in prompts]


def test_llm_judge_workflow_grades_each_response_with_the_auxiliary_model():
    model = FakeModel(["#### 42", "#### 41"])
    model.auxiliary = {"judge-7b": Judge(["ok. Score: 10", "hmm", "wrong. Score: 2"])}
    exps = build_workflow(math_task("llm_judge_workflow", "", repeat_times=2), model).run()
    assert [e.reward for e in exps] == [1.0, 0.2] and exps[1].metrics == {"judge": 0.2}
    calls = model.auxiliary["judge-7b"].calls
    # the group's responses in one replies() call; "hmm" had no grade: asked again, alone, sampled
    assert [len(c["prompts"]) for c in calls] == [2, 1] and [c["temperature"] for c in calls] == [0.0, 0.7]
    assert "Response: #### 41" in calls[0]["prompts"][1] and "Reference answer: #### 42" in calls[0]["prompts"][1]
    assert calls[1]["prompts"] == calls[0]["prompts"][1:]
    model.auxiliary = {"judge-7b": Judge(["fine", "fine", "fine"])}
    with pytest.raises(JudgeError, match=r"after 3 replies: no `Score: N` in the judge's reply 'fine'"):
        build_workflow(math_task("llm_judge_workflow", "", repeat_times=1), model).run()
    model.auxiliary = {}
    with pytest.raises(ValueError, match="needs a judge in explorer.auxiliary_models"):
        build_workflow(math_task("llm_judge_workflow", "", repeat_times=1), model).run()


@pytest.mark.slow
def test_a_real_auxiliary_model_grades_through_the_explorer(tiny_model_dir, judge_dir, tmp_path):
    """The explorer's path: explorer.auxiliary_models starts an HF engine for the judge (engines.auxiliary_handles,
    via explore.with_extras), llm_judge_workflow runs on a runner (explore.run_task) and the judge, a real model
    trained to answer "Score: 7", grades every response: reward 0.7. The untrained model as the judge never gives a
    grade: the task fails, by name."""
    import explore
    from configs import cli, resolve_stages
    from engines import HFEngine, rollout_handle
    from tasksets import load_tasks

    with HFEngine(tiny_model_dir) as engine:
        for judge_path, graded in ((judge_dir, True), (tiny_model_dir, False)):
            config = write_config(
                tmp_path,
                tiny_model_dir,
                **{
                    "buffer.default_workflow_type": "llm_judge_workflow",
                    "buffer.default_reward_fn_type": None,
                    "buffer.explorer_input.taskset.workflow_args": {"judge_max_tokens": 16},
                    "explorer.auxiliary_models": [
                        {"model_path": judge_path, "engine_type": "hf", "max_model_len": 512}
                    ],
                },
            )
            (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
            handle = explore.with_extras(cfg, rollout_handle(cfg, engine, engine.tokenizer))
            try:
                assert list(handle.auxiliary) == [Path(judge_path).name]
                task = load_tasks(cfg.buffer.explorer_input.tasksets[0])[0]
                exps, error = explore.run_task(task, handle, timeout=300, retries=0)
            finally:
                for aux in handle.auxiliary.values():
                    aux.engine.close()
            if graded:
                assert error == "" and [e.reward for e in exps] == [0.7, 0.7] and exps[0].metrics == {"judge": 0.7}
            else:
                assert exps is None and error.startswith("JudgeError: after 3 replies: no `Score: N` in the judge's")


def test_the_judge_reads_the_question_of_a_messages_taskset():
    """A messages-format task has no `prompt`: the judge is shown its last user message."""
    model = FakeModel(["#### 42"])
    model.auxiliary = {"judge": Judge(["Score: 9"])}
    messages = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "#### 2"},
        {"role": "user", "content": "And 6 x 7?"},
    ]
    build_workflow(math_task("llm_judge_workflow", "", repeat_times=1, prompt=None, messages=messages), model).run()
    assert "Question: And 6 x 7?\n" in model.auxiliary["judge"].calls[0]["prompts"][0]


# --- an auxiliary model as a teacher (on-policy distillation)


class Teacher(FakeModel):
    """A teacher whose log-prob of token k of any sequence is -0.1 k; records each score() call."""

    def score(self, sequences, temperature=1.0):
        self.calls.append({"sequences": [list(map(int, s)) for s in sequences], "temperature": temperature})
        return [-0.1 * torch.arange(1, len(s), dtype=torch.float32) for s in sequences]


def test_on_policy_distill_workflow_stores_the_teachers_logprobs_of_each_response():
    """The group's responses (tokens 0..9, prompt 6, student log-probs 0) scored in one call: the teacher's log-probs of
    tokens 6..9 are -0.6..-0.9; kl_divergence = sum(0 - teacher) = 3.0 per response, 0.75 per token. With a reward
    function its components are the reward (logged); without one the reward is 0. Eval tasks are not scored."""
    model = FakeModel(["#### 42", "#### 41"])
    model.auxiliary = {"teacher-7b": Teacher([])}
    task = math_task("on_policy_distill_workflow", "math_reward", repeat_times=2, workflow_args={"temperature": 0.5})
    exps = build_workflow(task, model).run()
    (call,) = model.auxiliary["teacher-7b"].calls
    assert call == {"sequences": [list(range(10))] * 2, "temperature": 0.5}
    for exp, reward in zip(exps, [1.1, 0.1]):
        assert torch.allclose(exp.teacher_logprobs, torch.tensor([-0.6, -0.7, -0.8, -0.9]))
        assert exp.reward == pytest.approx(reward) and exp.metrics["accuracy"] in (0.0, 1.0)
        assert exp.metrics["kl_divergence"] == pytest.approx(3.0) and exp.metrics["kl_per_token"] == pytest.approx(0.75)
        assert exp.metrics["teacher_logprob"] == pytest.approx(-0.75)
    (exp,) = build_workflow(math_task("on_policy_distill_workflow", "", repeat_times=1), model).run()
    assert exp.reward == 0.0 and exp.teacher_logprobs is not None and "accuracy" not in exp.metrics
    (exp,) = build_workflow(math_task("on_policy_distill_workflow", "", repeat_times=1, is_eval=True), model).run()
    assert exp.teacher_logprobs is None and len(model.auxiliary["teacher-7b"].calls) == 2


def test_on_policy_distill_workflow_names_a_missing_or_unknown_teacher():
    model = FakeModel(["#### 42"])
    model.auxiliary = {}
    with pytest.raises(ValueError, match="needs a teacher in explorer.auxiliary_models"):
        build_workflow(math_task("on_policy_distill_workflow", "", repeat_times=1), model).run()
    model.auxiliary = {"teacher-7b": Teacher([])}
    task = math_task("on_policy_distill_workflow", "", repeat_times=1, workflow_args={"teacher": "teacher-70b"})
    with pytest.raises(ValueError, match="no auxiliary model 'teacher-70b'; there are \\['teacher-7b'\\]"):
        build_workflow(task, model).run()


# --- a reward that fails: a named drop of its task, never a crash, never a kept bad value

REWARDS_FILE = """
import math

def nan_reward(response, reference):
    return {"accuracy": 1.0, "brevity": math.nan if response == "b" else 0.5}

def raising_reward(response, reference):
    return {"accuracy": 1 / len(response)}

def text_reward(response, reference):
    return {"accuracy": "high"}

def list_reward(response, reference):
    return [1.0]
"""


def registered_raising_reward(response, reference):
    return {"accuracy": 1 / len(response)}


@pytest.mark.parametrize(
    "name, why",
    [
        ("nan_reward", r"reward function '.*rewards\.py:nan_reward' gave component 'brevity' = nan: not a finite"),
        ("raising_reward", r"reward function '.*rewards\.py:raising_reward' raised ZeroDivisionError"),
        ("text_reward", r"gave component 'accuracy' = 'high': not a number"),
        ("list_reward", r"returned list, not a dict of \{component: number\}"),
        ("registered", r"reward function 'registered' raised ZeroDivisionError: division by zero"),
    ],
)
def test_a_reward_that_raises_or_gives_no_finite_number_is_a_named_drop_of_its_task(tmp_path, monkeypatch, name, why):
    """The user's reward functions (in a worker process) and a registered one (in the thread): an exception, NaN,
    a value that is not a number or not a dict drops the task with reason "reward", the log and the metrics naming
    the task and the function (before: a bare exception of the workflow, counted as any failure, or NaN caught
    only as the workflow's reward)."""
    import explore

    path = tmp_path / "rewards.py"
    path.write_text(REWARDS_FILE)
    monkeypatch.setitem(REWARD_FNS, "registered", registered_raising_reward)
    reward_fn = "registered" if name == "registered" else f"{path}:{name}"
    task = math_task(reward_fn=reward_fn, repeat_times=2, index=7)
    exps, err = explore.run_task(task, FakeModel(["a", "b"] if name == "nan_reward" else ["a", ""]), 30, 0)
    assert exps is None and err.reason == "reward" and re.search(why, err), err
    metrics = explore.rollout_metrics([(task, exps, err)], 1.0)
    assert metrics["rollout/dropped/reward"] == 1 and metrics["rollout/failed_count"] == 1
    assert metrics["rollout/dropped_errors"].startswith(f"{task.task_id} (reward): RewardError: ")


def test_a_reward_named_by_module_loads_in_a_fresh_worker(monkeypatch):
    """`workflows.math:math_reward` in a worker process that loaded nothing before: imported by name, its package
    first (loaded from its file alone, its `from workflows import ...` found it half made: an ImportError)."""
    import workflows
    from workflows.tool_workers import Workers

    fresh = Workers(size=1, whole_env=True)
    monkeypatch.setattr(workflows, "REWARD_WORKERS", fresh)
    try:
        assert build_reward_fn("workflows.math:math_reward")("#### 4", "#### 4") == {
            "accuracy": 1.0,
            "format_score": 0.1,
        }
        assert fresh.live  # it ran in the worker
    finally:
        fresh.close()
