"""The args a config hands a workflow (a taskset's `workflow_args`) and a reward function (`reward_fn_args`), checked
as algos/ pieces' `*_args` are (configs.loader.from_dict: unknown keys with the closest valid one, values coerced to the
field's type; configs.checks.check_ranges: ranges, no int of 2**31 or more, no infinite float), each a ConfigError
naming the key:

    @dataclasses.dataclass
    class ToolArgs(WorkflowArgs):        # workflows/tool_use.py; class ToolWorkflow(Workflow): Args = ToolArgs
        RANGES: ClassVar = {"max_turns": AT_LEAST_1}
        max_turns: int = 4               # (with an attribute docstring under it, as every field)

    buffer.explorer_input.taskset.workflow_args.max_turn: unknown key; did you mean max_turns?

A reward function declares its args by its keyword arguments and their annotations (reward_args_class).
Checked by `check_tasksets` before any process starts (launch.py: the registered workflows and reward functions; the
launcher imports none of the user's code), again when an explorer starts (the user's own `module:attr` too), and as
each task's workflow is built (a task row may name its workflow: format.workflow_key); the
same args are checked once per process (`memo`), so the tasks of a taskset pay nothing for it.
A user's workflow that declares no Args, or a reward function that takes **kwargs, gets its args unchecked.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import workflows  # NOTE: the package, still being initialised when it imports this module: used at call time only
from algos import EXPLORER_ADVANTAGE_FNS
from configs.checks import _warn_once, check_ranges
from configs.loader import from_dict
from configs.schema import Config, TasksetConfig
from errors import ConfigError

RewardFn = Callable[..., dict[str, float]]


@dataclasses.dataclass
class WorkflowArgs:
    """The workflow_args every built-in workflow reads; a workflow's own `Args` adds its fields (with attribute
    docstrings, as algos/ pieces' Config) and may give their ranges in `RANGES` (field -> configs.checks range)."""

    RANGES: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}
    system_prompt: str | None = None
    """Replaces (or adds) the task's system message (chat_messages)."""


_GIVEN = ("response", "reference", "draw_key")  # passed by the workflow (Workflow.reward), never by the config


_MISSING = object()
_MEMO: dict[tuple, Any] = {}  # checked args by what was checked: a taskset's are checked once, not for every task


def memo(key: tuple, make: Callable[[], Any]) -> Any:
    """make()'s value for `key`, made once per process; a failure is not kept (the next call raises it again), nor
    is a key that cannot be hashed (a user's unhashable callable: made each time)."""
    try:
        hash(key)
    except TypeError:
        return make()
    value = _MEMO.get(key, _MISSING)
    if value is _MISSING:  # NOTE: runner threads may race here: at worst the same args are checked twice
        if len(_MEMO) >= 1024:  # bounded; a config has a handful of tasksets
            _MEMO.clear()
        value = _MEMO[key] = make()
    return value


def workflow_args(cls: type[workflows.Workflow], args: dict[str, Any], path: str) -> Any:
    """`args` as an instance of cls.Args: an unknown key (with the closest valid one), a value not of the field's
    type or out of its range (configs/checks.py's RANGES, the Args' own RANGES) is a ConfigError naming the key.
    Checked once per process for the same args (the config's derivation, then each task of the taskset as its
    workflow is built); each call gets its own copy. A workflow that declares no Args gets `args` as they are."""
    if cls.Args is None:
        return args

    def check() -> Any:
        checked = from_dict(cls.Args, args, path)
        check_ranges(checked, path)
        return checked

    # NOTE: repr tells apart the values a YAML gives (1, 1.0, True, "1"); not keyed by `path` (only an error names
    # it, and errors are not kept): the check when the config was derived serves every task; a copy, so that a
    # workflow that changes its self.args changes no other task's
    return copy.deepcopy(memo(("workflow_args", cls.Args, repr(args)), check))


@functools.cache
def reward_args_class(fn: RewardFn) -> type | None:
    """A dataclass of the arguments of `fn` that a config may set (all but response, reference and draw_key), typed
    by its annotations, to check reward_fn_args with as a workflow's Args; None when `fn` takes **kwargs."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: the arguments are taken as they come
        hints = {}
    fields = [
        (k, hints.get(k, Any), dataclasses.field(default=None))
        for k, p in params.items()
        if k not in _GIVEN and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return dataclasses.make_dataclass(f"{getattr(fn, '__name__', 'reward_fn')}_args", fields)


def reward_args(fn: RewardFn, name: str, args: dict[str, Any], path: str) -> dict[str, Any]:
    """`args` checked against reward function `name`'s arguments (reward_args_class) and coerced to their types; a
    ConfigError naming the key, or an argument without a default that `args` leaves out. Checked once per process
    for the same function and args (as workflow_args). A function that takes **kwargs gets `args` as they are."""
    cls = reward_args_class(fn)
    if cls is None:
        return dict(args)

    def check() -> dict[str, Any]:
        if args and not dataclasses.fields(cls):
            raise ConfigError(f"{path}.{next(iter(args))}: unknown key; reward function {name!r} takes no arguments")
        checked = from_dict(cls, args, path)
        check_ranges(checked, path)
        params = inspect.signature(fn).parameters
        for f in dataclasses.fields(cls):
            if params[f.name].default is inspect.Parameter.empty and f.name not in args:
                raise ConfigError(f"{path}.{f.name}: reward function {name!r} needs it (it has no default)")
        return {k: getattr(checked, k) for k in args}

    return copy.deepcopy(memo(("reward_args", fn, repr(args)), check))


@functools.lru_cache(maxsize=256)
def _takes_draw_key(fn: RewardFn) -> bool:
    return "draw_key" in inspect.signature(fn).parameters


def takes_draw_key(fn: RewardFn) -> bool:
    """Whether reward function `fn` (bound by build_reward_fn or not) takes a draw_key (random_reward's seeded draw);
    looked up once per function, not for every response."""
    base = getattr(fn, "func", fn)  # a partial's function, or a Reward's partial (workflows.Reward)
    base = base.func if isinstance(base, functools.partial) else base  # NOTE: a partial's signature keeps every name
    try:
        return _takes_draw_key(base)
    except TypeError:  # an unhashable callable: looked up each time
        return "draw_key" in inspect.signature(fn).parameters


def check_args(ts: TasksetConfig, where: str, user_code: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """A taskset's (workflow_args, reward_fn_args) checked against what its workflow and reward function declare,
    values coerced to their types; a ConfigError naming the key (`<where>.workflow_args.max_turn: unknown key; did
    you mean max_turns?`) or the workflow or reward function that does not exist. Not checked here: a name a task
    row gives (format.workflow_key / reward_fn_key: checked per task, as its workflow is built), and with
    `user_code` False a name of the user's own code (`module:attr`: the config loader imports none)."""
    wf, rf = ts.default_workflow_type, ts.default_reward_fn_type
    wf = "" if ts.format.workflow_key or (":" in wf and not user_code) else wf
    try:
        cls = workflows.lookup("workflow", wf) if wf else None
    except KeyError as e:
        raise ConfigError(f"{where}.default_workflow_type: {e.args[0]}") from None
    wargs, rargs = dict(ts.workflow_args), dict(ts.reward_fn_args)
    if cls is not None and cls.Args is not None:
        checked = workflow_args(cls, wargs, f"{where}.workflow_args")
        if user_code:
            try:
                cls.load_user_code(checked)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"{where}.workflow_args: {e.args[0] if e.args else e}") from None
        wargs = {k: getattr(checked, k) for k in wargs}
    if cls is not None and not cls.uses_reward_fn and (rf or rargs):
        key = "default_reward_fn_type" if rf else "reward_fn_args"
        _warn_once(
            f"config: {where}.{key} = {rf or rargs!r}: has no effect: {wf} grades the responses itself (no "
            "reward function)"
        )
    rf = rf or ((cls.default_reward_fn or "") if cls is not None else "")
    if rf and not ts.format.reward_fn_key and (user_code or ":" not in rf):
        try:
            fn = workflows.lookup("reward_fn", rf)
        except KeyError as e:
            raise ConfigError(f"{where}.default_reward_fn_type: {e.args[0]}") from None
        rargs = reward_args(fn, rf, rargs, f"{where}.reward_fn_args")
    return wargs, rargs


def check_tasksets(cfg: Config, user_code: bool = True) -> None:
    """Each taskset that runs has a workflow, and its workflow and reward function exist and take its workflow_args and
    reward_fn_args (coerced in place to their types): a ConfigError naming the key otherwise. A name in a task row
    (format.workflow_key) is checked per task. With `user_code` False (the launcher) the user's own `module:attr` is
    not imported; the explorer checks it as it starts.
    NOTE: here, not in configs/resolve.py: configs/ imports nothing of workflows/ (which imports configs/)."""
    for key in ("tasksets", "eval_tasksets"):
        for i, ts in enumerate(getattr(cfg.buffer.explorer_input, key)):
            where = f"buffer.explorer_input.{key}[{i}]"
            runs = cfg.mode in ("both", "explore") or (cfg.mode == "bench" and key == "eval_tasksets")
            if not runs:
                continue
            if not ts.default_workflow_type and not ts.format.workflow_key:
                raise ConfigError(
                    f"{where} ({ts.name}): no workflow runs these tasks: set buffer.default_workflow_type, the "
                    "taskset's default_workflow_type (e.g. math_workflow), or a format.workflow_key column"
                )
            ts.workflow_args, ts.reward_fn_args = check_args(ts, where, user_code)
    check_step_wise(cfg)


def check_step_wise(c: Config) -> None:
    """A step-wise taskset (workflow_args.step_wise: one experience per turn) and the advantage fn must match: turns
    normalised as responses of their own weigh an episode by its number of turns. step_wise_grpo's advantages are
    computed in the explorer (algos.EXPLORER_ADVANTAGE_FNS)."""
    a, sets = c.algorithm, c.buffer.explorer_input.tasksets
    step_wise = [
        f"buffer.explorer_input.tasksets[{i}] ({ts.name})"
        for i, ts in enumerate(sets)
        if ts.workflow_args.get("step_wise")
    ]
    if step_wise and a.advantage_fn not in EXPLORER_ADVANTAGE_FNS:
        raise ConfigError(
            f"{', '.join(step_wise)}: workflow_args.step_wise writes one experience per turn, which "
            f"algorithm.advantage_fn {a.advantage_fn} would normalise as responses of their own (an "
            "episode weighing as many times as it has turns); use algorithm_type multi_step_grpo "
            "(advantage_fn step_wise_grpo)"
        )
    if sets and a.advantage_fn in EXPLORER_ADVANTAGE_FNS and not step_wise and c.mode in ("both", "explore"):
        _warn_once(
            f"config: algorithm.advantage_fn {a.advantage_fn} with no taskset setting workflow_args.step_wise: "
            "unless the workflow writes one experience per turn itself (info['episode']), this is GRPO over "
            "whole episodes"
        )
