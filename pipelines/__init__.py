"""Data pipelines (Trinity-RFT's `data_processor`): operators over the taskset rows before the explorer reads them
(the task pipeline, pipelines/task.py) and over each explore step's scored experiences before they are written (the
experience pipeline, pipelines/experience.py). docs/pipelines.md is the user's page.

An operator is one small interface, the same in both pipelines (Trinity's ExperienceOperator):

    class MyOp:
        def __init__(self, threshold: float = 0.5): ...          # the YAML's `args`, by name
        def process(self, items: list) -> tuple[list, dict[str, float]]:
            ...                                                    # items: row dicts (task pipeline) or
            return kept, {"my_stat": 1.0}                          #   buffer.Experience objects (experience pipeline)

`process` returns the items it keeps (changed in place or new) and its own numbers, logged as pipeline/<op>/<key>
beside pipeline/<op>/kept and pipeline/<op>/dropped (counted here, never by the operator). An operator whose
__init__ takes a `context` parameter also gets the run's Context (its config; the model handles an LLM-scoring
operator asks). Operators are named by a built-in's name (pipelines/registry.py), by `module:attr` or
`path/to/file.py:attr` (your own, imported from there: the config is trusted, the data is not), or, in the task
pipeline, by a Data-Juicer operator's name (pipelines/data_juicer.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Protocol

from configs.schema import OperatorConfig
from errors import ConfigError


class Operator(Protocol):
    def process(self, items: list) -> tuple[list, dict[str, float]]: ...


@dataclasses.dataclass
class Context:
    """What an operator that asks for `context` gets."""

    cfg: Any  # configs.Config: the run's (stage's) resolved config
    models: dict[str, Any] = dataclasses.field(default_factory=dict)  # auxiliary model handles by name (engines.py)
    where: str = ""  # the operator's place in the config, for messages: data_processor.task_pipeline.operators[0]
    # explore.run_tasks, handed over by the explorer (pipelines/ imports nothing of explore.py, which imports it): how
    # an operator runs tasks through their own workflows (pass_rate_filter); None outside an explorer
    run_tasks: Any = None


def construct(factory: Any, args: dict[str, Any], context: Context, name: str) -> Operator:
    """factory(**args) (and context= when its signature takes it); a ConfigError naming the argument it does not
    take, with the closest one it does."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature: hand it the args as they are
        params = {}
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    known = [k for k, p in params.items() if k != "context" and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in args:
        if params and not open_ended and key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{context.where}: operator {name!r} takes no argument {key!r}{hint} (it takes: {', '.join(known)})"
            )
    extra = {"context": context} if "context" in params else {}
    op = factory(**args, **extra)
    if not callable(getattr(op, "process", None)):
        raise ConfigError(f"{context.where}: operator {name!r} has no process(items) method")
    return op


def build(spec: OperatorConfig, registry: dict[str, str], context: Context) -> Operator:
    """The operator `spec` names: a built-in of `registry` (name -> "module:attr"), or the user's `module:attr` /
    `file.py:attr`. (The task pipeline sends other names to Data-Juicer before calling this.)"""
    from workflows import load_object

    if ":" in spec.name:
        try:
            factory = load_object(spec.name, "operator")
        except KeyError as e:
            raise ConfigError(f"{context.where}: {e.args[0]}") from None
    elif spec.name in registry:
        factory = load_object(registry[spec.name], "operator")
    else:
        close = difflib.get_close_matches(spec.name, registry, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{context.where}: unknown operator {spec.name!r}.{hint} Built-in: {', '.join(sorted(registry))}; or "
            "name your own as module:attr / file.py:attr"
        )
    return construct(factory, dict(spec.args), context, spec.name)
