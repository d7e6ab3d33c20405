"""Workflows and reward functions: what turns one task into scored responses.

    from workflows import build_workflow
    exps = build_workflow(task, model).run()   # task.repeat_times Experiences, reward and metrics set

The contract (Trinity-RFT's `Workflow`, cut down):
  - A workflow gets a `Task` (buffer.py), a model handle (`ModelHandle` below, implemented by
    engines.EngineHandle) and a reward function, and returns Experiences with `reward` and `metrics` set.
    It never touches the DB, the trainer or the weights. The runner stamps group_id, run_id,
    model_version, explorer and task_id afterwards. Eval tasks (`task.is_eval`) use the same run().
  - A reward function is `(response: str, reference: Any, **reward_fn_args) -> dict[str, float]`:
    named components (e.g. {"accuracy": 1.0, "format_score": 0.1}); the reward is their sum and each
    component is also stored in `exp.metrics` so it gets logged. `reward_fn_args` from the config
    are bound once (`build_reward_fn`), checked against the function's keyword arguments and their annotations.
  - A workflow declares the `workflow_args` it reads as a dataclass, `Args` (fields with docstrings, ranges in its
    RANGES), as algos/ pieces declare their `*_args`: an unknown key, a wrong type or a value out of range is a
    ConfigError naming the key when the config is derived, and the workflow reads `self.args`. A user's workflow
    (`module:attr`) is checked against its Args when an explorer starts; one that declares none gets
    `task.workflow_args` unchecked.
  - Registries are plain dicts, one line per entry, read through `lookup(kind, name)`; adding a task = one new
    file + one line here, or no line at all: a workflow or reward function named `module:attr` /
    `path/file.py:attr` in the YAML is imported from there (`load_object`).

Multi-turn workflows keep each episode as token ids (workflows/episode.py: no re-rendering of history, action
mask on the model's own tokens); `tool_workflow` (workflows/tool_use.py) runs tool calls between turns.

Departures from Trinity: no async twins, no `can_reset` / `can_repeat` flags (single-turn workflows ask for all
`repeat_times` responses in one `chat(n=...)` call). Auxiliary models (`explorer.auxiliary_models`, e.g. a
judge: workflows/judge.py, a teacher: workflows/distill.py) are `self.auxiliary_models[name]`, handles like
`self.model`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from math import isfinite  # NOTE: not `import math`: the submodule workflows.math takes that name here
from pathlib import Path
from typing import Any, ClassVar, Protocol

from buffer import Experience
from configs.schema import GenerationConfig
from tasksets import Task
from workflows.args import WorkflowArgs, check_args, reward_args, takes_draw_key, workflow_args  # noqa: F401
from workflows.tool_workers import Workers

log = logging.getLogger("nanorft.workflows")

RewardFn = Callable[..., dict[str, float]]  # (response, reference, **bound args) -> components


class ModelHandle(Protocol):
    """What a workflow may ask of the rollout engine (engines.EngineHandle implements it; tests use a fake). Multi-turn
    episodes (workflows/episode.py) also use its tokenizer, max_model_len, eos_ids, cut, params and submit, and
    the OpenAI-compatible API its openai_client and history (EngineHandle's docstrings).

    Sampling keys: temperature, top_p, top_k, max_tokens, min_tokens, stop (list[str]), seed.
    Each returned Experience has tokens (prompt + response ids), prompt_length, logprobs (one per
    response token), prompt_text, response_text and truncate_status ("response_truncated" when
    cut at max_tokens, else None)."""

    model_version: int  # weights version currently served

    def chat(
        self,
        messages: list[dict],
        n: int = 1,
        tools: list | None = None,
        chat_template: str | None = None,
        reply_prefix: str | None = None,
        **sampling: Any,
    ) -> list[Experience]:
        """Apply the chat template (or `chat_template`) to `messages` with `tools`, start the assistant turn with
        `reply_prefix`, and sample n responses (`chat_options(task)` gives the taskset format's three)."""
        ...

    def generate(self, prompts: list[str], n: int = 1, **sampling: Any) -> list[list[Experience]]:
        """Sample n responses per raw text prompt (no template): one list per prompt."""
        ...

    def render(
        self, messages: list[dict], tools: list | None = None, chat_template: str | None = None, generation: bool = True
    ) -> str:
        """`messages` through the chat template: the text chat() sends. NOTE: generate() reads a text's special-token
        texts as control tokens; chat() (render_ids) tokenises the messages' strings as text."""
        ...

    def render_ids(
        self,
        messages: list[dict],
        tools: list | None = None,
        chat_template: str | None = None,
        generation: bool = True,
        template_kwargs: dict | None = None,
        suffix: str = "",
    ) -> tuple[str, list[int]]:
        """render()'s text and its token ids, every string of the messages tokenised as text (what chat() sends)."""
        ...

    def replies(self, conversations: list[list[dict]], **sampling: Any) -> list[str]:
        """One reply's text per conversation, sampled together: what a judge asks of an auxiliary model (an
        external endpoint's handle, engines.ExternalHandle, offers this only)."""
        ...

    def score(self, sequences: list, temperature: float = 1.0) -> list:
        """Each token's log-prob given those before it, [L - 1] float32 tensors per sequence of L token ids (a teacher
        scoring a student's tokens: workflows/distill.py)."""
        ...


class Workflow:
    """Base class of all workflows (the only class hierarchy here). Subclasses implement run()."""

    default_reward_fn: str | None = None  # used when the config names no reward function
    # The dataclass of its workflow_args (checked by `check_args`: unknown keys, types, ranges). None: the args are
    # handed over unchecked in task.workflow_args (a user's workflow that declares none reads them itself).
    Args: ClassVar[type | None] = None
    uses_reward_fn: ClassVar[bool] = True  # False: graded otherwise (a judge); a reward fn set for it is warned about

    def __init__(self, task: Task, model: ModelHandle, reward_fn: RewardFn | None) -> None:
        self.task = task
        self.model = model
        self.args: Any = workflow_args(type(self), task.workflow_args, f"taskset {task.taskset}: workflow_args")
        self.auxiliary_models: dict[str, ModelHandle] = getattr(model, "auxiliary", {})  # e.g. a judge, by name
        if reward_fn is None and self.default_reward_fn is not None:
            reward_fn = build_reward_fn(self.default_reward_fn, **task.reward_fn_args)
        self.reward_fn = reward_fn

    @classmethod
    def load_user_code(cls, args: Any) -> None:
        """Load the user's own code that `args` (its checked workflow_args) name, e.g. tool_workflow's tools named
        `module:function`, raising KeyError / ValueError naming it: called when an explorer starts (check_args), so
        that a name that does not load fails then, not at the first task. The config loader does not call it (it
        imports none of the user's code)."""

    def run(self) -> list[Experience]:
        raise NotImplementedError

    def reward(self, response: str, run: int, **extra: Any) -> dict[str, float]:
        """reward_fn(response, task.reference, **extra) for response `run` of the task's group; a reward function
        with a `draw_key` argument (random_reward) also gets "<taskset>/<epoch>/<task index>/<run>", which its
        seeded draw depends on, so that a rerun of the experiment draws the same rewards."""
        return self.reward_fn(response, self.task.reference, **extra, **self.draw_args(run))

    def draw_args(self, run: int) -> dict[str, str]:
        """{"draw_key": ...} for a reward function that takes one (see reward()), else {}."""
        if self.reward_fn is None or not takes_draw_key(self.reward_fn):
            return {}
        return {"draw_key": f"{self.task.taskset}/{self.task.epoch}/{self.task.index}/{run}"}


# --- helpers shared by workflows


def sampling_kwargs(args: GenerationConfig) -> dict[str, Any]:
    """The rollout args that are set, as ModelHandle sampling keys.

    `logprobs` (extra top log-probs) is not a sampling key of the handle, which always returns the
    log-prob of each sampled token, so it is not passed on."""
    return {k: v for k, v in dataclasses.asdict(args).items() if v is not None and k != "logprobs"}


def chat_options(task: Task) -> dict[str, Any]:
    """What the taskset's format says about rendering a task's prompt: ModelHandle.chat's tools (format.tools_key),
    chat_template and reply_prefix."""
    return {"tools": task.tools, "chat_template": task.chat_template or None, "reply_prefix": task.reply_prefix}


def chat_messages(task: Task) -> list[dict]:
    """The task's chat messages; `workflow_args["system_prompt"]` replaces (or adds) the system message."""
    messages = list(task.messages) if task.messages else [{"role": "user", "content": task.prompt or ""}]
    system_prompt = task.workflow_args.get("system_prompt")
    if system_prompt is not None:
        messages = [m for m in messages if m.get("role") != "system"]
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def apply_reward(exp: Experience, components: dict[str, float]) -> Experience:
    """Set exp.reward to the sum of the components and log each one in exp.metrics; RewardError for a component
    that is not a finite number (the task is dropped, saying which: never a NaN reward kept)."""
    values = finite_components(components, "the reward")
    exp.metrics.update(values)
    exp.reward = float(sum(values.values()))
    return exp


# --- rewards: what a workflow's reward_fn is (build_reward_fn), and where the user's own run


class RewardError(ValueError):
    """A reward function raised, gave no result in time, or returned something other than {name: finite number}:
    the explorer drops the task, naming the function and why (explore.Drop, reason "reward")."""


ATTEMPT = threading.local()
"""The explorer's attempt of a task, on the attempt's thread: ATTEMPT.deadline (time.monotonic()), set by
explore.attempt; a reward call in a worker process gets the time left (reward_deadline)."""
REWARD_TIMEOUT = 600.0
"""Seconds a reward call in a worker process may take outside an explorer's attempt (a test, `--debug`)."""
REWARD_MARGIN = 0.25
"""Seconds of an attempt's time kept from its reward calls: a reward stuck in a loop ends, and says so (a drop for
"reward"), before the attempt's thread is abandoned at its timeout."""
REWARD_WORKERS = Workers(size=max(8, 2 * (os.cpu_count() or 1)), whole_env=True)
"""The worker processes of the user's reward functions (workflows/tool_workers.py, as tools), started as needed: at
most two per core (8 at least) run at once, so that rewards stuck in a loop until their attempt's timeout take
CPU time, not the explorer's GIL, and a few of them leave workers free for the other tasks."""


def reward_deadline() -> float:
    """The time.monotonic() by which a reward call must end: the explorer's attempt of the task's deadline (ATTEMPT)
    less REWARD_MARGIN, else REWARD_TIMEOUT from now; RewardError when it has passed."""
    deadline = getattr(ATTEMPT, "deadline", None)
    if deadline is None:
        return time.monotonic() + REWARD_TIMEOUT
    if deadline - REWARD_MARGIN <= time.monotonic():
        raise RewardError("no time left for the reward in this attempt (explorer.max_timeout)")
    return deadline - REWARD_MARGIN


def finite_components(out: Any, who: str) -> dict[str, float]:
    """`out` as {name: float}, or RewardError naming `who`: not a dict of names to finite numbers."""
    if not isinstance(out, dict):
        raise RewardError(f"{who} returned {type(out).__name__}, not a dict of {{component: number}}")
    values = {}
    for name, value in out.items():
        try:
            values[str(name)] = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"{who} gave component {name!r} = {value!r:.100}: not a number") from None
        if not isfinite(values[str(name)]):
            raise RewardError(f"{who} gave component {name!r} = {value!r}: not a finite number")
    return values


class Reward:
    """A reward function as a workflow calls it (its `reward_fn`): reward(response, reference, **extra) ->
    {component: float}, its reward_fn_args bound. Whatever goes wrong is a RewardError naming it (an exception, a
    value that is not {name: finite number}). A function of the user's own (named `module:attr`) runs in a worker
    process (REWARD_WORKERS), killed when the attempt's time is up (reward_deadline): one stuck in a loop ends with
    its attempt, and never holds the GIL from the engine and the other tasks. NOTE: the registered reward functions
    are the project's (bounded: math_reward's guards) and run in the calling thread, as would a user's whose
    arguments are not JSON (a reference that a parquet file gave as numpy arrays), said once."""

    def __init__(self, name: str, fn: RewardFn, bound: dict[str, Any], ref: dict | None) -> None:
        self.name, self.ref = name, ref
        self.func = functools.partial(fn, **bound)  # NOTE: `func`, as a partial's: what takes_draw_key looks at

    def __call__(self, response: str, reference: Any, **extra: Any) -> dict[str, float]:
        try:
            out = self.in_worker(response, reference, extra) if self.ref else self.func(response, reference, **extra)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward function {self.name!r} raised {type(e).__name__}: {e}") from e
        return finite_components(out, f"reward function {self.name!r}")

    def in_worker(self, response: str, reference: Any, extra: dict[str, Any]) -> Any:
        try:
            json.dumps([reference, extra, self.func.keywords])
        except (TypeError, ValueError, RecursionError) as e:
            if (self.name, "json") not in _SAID:
                _SAID.add((self.name, "json"))
                log.warning("reward function %r runs in the explorer's thread: %s is not JSON (%s)", self.name, e)
            return self.func(response, reference, **extra)
        start, by = time.monotonic(), reward_deadline()
        kwargs = {**self.func.keywords, **extra}
        out = REWARD_WORKERS.call(self.ref, kwargs, by - start, (response, reference), value=True, by=by)
        if out.get("timeout"):
            raise RewardError(
                f"reward function {self.name!r} gave no result within {by - start:.3g} s (the time left of the "
                "task's attempt, explorer.max_timeout); its worker process was killed"
            )
        if "error" in out:
            raise RewardError(f"reward function {self.name!r} raised {out['error']}")
        return out["value"]


_SAID: set[tuple[str, str]] = set()  # warnings said once per process


# --- registries
# NOTE: imported here, below the base class, because each workflow file subclasses `Workflow`
# from this module (a circular import that works only in this order).
from workflows.countdown import CountdownWorkflow, countdown_reward  # noqa: E402
from workflows.distill import DistillWorkflow  # noqa: E402
from workflows.judge import JudgeWorkflow  # noqa: E402
from workflows.math import MathWorkflow, accuracy_reward, format_reward, math_reward, random_reward  # noqa: E402
from workflows.simple import SimpleWorkflow  # noqa: E402
from workflows.tool_use import ToolWorkflow  # noqa: E402

WORKFLOWS: dict[str, type[Workflow]] = {
    "simple_workflow": SimpleWorkflow,
    "math_workflow": MathWorkflow,
    "countdown_workflow": CountdownWorkflow,
    "countdown": CountdownWorkflow,  # the name TinyZero users know
    "tool_workflow": ToolWorkflow,  # multi-turn, with tools (workflows/tool_use.py)
    "llm_judge_workflow": JudgeWorkflow,  # graded by an auxiliary model (workflows/judge.py)
    "on_policy_distill_workflow": DistillWorkflow,  # a teacher (an auxiliary model) scores the student's tokens
}

REWARD_FNS: dict[str, RewardFn] = {
    "accuracy_reward": accuracy_reward,
    "format_reward": format_reward,
    "math_reward": math_reward,
    "countdown_reward": countdown_reward,
    "random_reward": random_reward,  # a control: reward by coin flip
}


def _unknown(kind: str, name: str, known: dict) -> KeyError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return KeyError(f"unknown {kind} {name!r}.{hint} Known: {', '.join(sorted(known))}")


@functools.cache  # once per process: lookup runs for every task
def load_object(spec: str, kind: str) -> Any:
    """`module:attr` or `path/to/file.py:attr`: a workflow or reward function of the user's own, named in the
    YAML, without editing the project (the module is imported as any Python module: the config is trusted)."""
    module, _, attr = spec.rpartition(":")
    try:
        if module.endswith(".py"):
            loaded = importlib.util.spec_from_file_location(Path(module).stem, module)
            if loaded is None or not Path(module).is_file():
                raise ImportError(f"no file {module}")
            mod = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(mod)
        else:
            mod = importlib.import_module(module)
    except ImportError as e:
        raise KeyError(f"{kind} {spec!r}: cannot import {module!r} ({e})") from e
    if not hasattr(mod, attr):
        raise KeyError(f"{kind} {spec!r}: {module!r} has no {attr!r}")
    return getattr(mod, attr)


def lookup(kind: str, name: str) -> Any:
    """The workflow class (kind "workflow") or reward function (kind "reward_fn") registered under `name`, or named
    `module:attr` (load_object; a reward function checked by python_reward_fn); KeyError listing the known names
    otherwise. Every registry is read this way from outside its package (algos.lookup: the algorithm pieces)."""
    what, registry = {"workflow": ("workflow", WORKFLOWS), "reward_fn": ("reward function", REWARD_FNS)}[kind]
    if ":" not in name:
        if name not in registry:
            raise _unknown(what, name, registry)
        return registry[name]
    found = load_object(name, what)
    if kind == "reward_fn":
        return python_reward_fn(found, name)
    if not (isinstance(found, type) and issubclass(found, Workflow)):
        raise KeyError(f"workflow {name!r} is not a subclass of workflows.Workflow")
    return found


def python_reward_fn(fn: Any, name: str) -> RewardFn:
    """`fn` if it is Python code that takes (response, reference) by position, as Workflow.reward calls it; else a
    KeyError naming it. NOTE: builtins and classes are refused: a "reward" named `builtins:exec` would run the
    model's response, `subprocess:Popen` would run it as a command."""
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    python = (
        inspect.isfunction(base)
        or inspect.ismethod(base)
        # an instance of a class with a Python __call__ (B004 would have callable(), which builtins pass)
        or (not isinstance(base, type) and inspect.isfunction(getattr(type(base), "__call__", None)))  # noqa: B004
    )
    if not python:
        raise KeyError(
            f"reward function {name!r} is not a Python function (builtins and classes are refused): a "
            "reward function takes (response, reference) and returns {component: value}"
        )
    try:
        inspect.signature(fn).bind_partial("response", "reference")  # its own args come from reward_fn_args
    except (TypeError, ValueError) as e:
        raise KeyError(f"reward function {name!r} cannot be called as fn(response, reference): {e}") from None
    return fn


def build_reward_fn(name: str, **reward_fn_args: Any) -> Reward:
    """The reward function `name` (registered, or `module:attr`: run in a worker process) with `reward_fn_args`
    bound (checked and coerced: reward_args), as a Reward; unknown names (KeyError) or args (ConfigError) fail here,
    at construction, not at the first response."""
    fn = lookup("reward_fn", name)
    bound = reward_args(fn, name, reward_fn_args, "reward_fn_args")
    return Reward(name, fn, bound, worker_ref(name) if ":" in name else None)


def worker_ref(name: str) -> dict:
    """How a worker process finds reward function `name` (`module:attr` or `path.py:attr`): tools.reference's
    {"module", "file", "attr"}. NOTE: a module named by name is imported by name there, its package first (loaded
    from its file alone, workflows.math's `from workflows import ...` found itself half made)."""
    from workflows.tools import ToolError, reference

    try:
        ref = reference(name, name)
    except ToolError as e:  # NOTE: lookup has imported it already: not expected
        raise KeyError(f"reward function {name!r}: {e}") from None
    return {**ref, "file": ""} if ref["module"] else ref


def build_workflow(task: Task, model: ModelHandle) -> Workflow:
    """The task's workflow, with its reward function (if named) built from task.reward_fn_args."""
    reward_fn = build_reward_fn(task.reward_fn, **task.reward_fn_args) if task.reward_fn else None
    return lookup("workflow", task.workflow)(task, model, reward_fn)
