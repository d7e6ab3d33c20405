"""The config page's model of the schema, read from configs/schema.py: no key is registered by hand here.

    fields = schema_fields()                  # every field of Config (and of the items of its lists of sections)
    cfg = load("configs/tiny.yaml")           # as launch.py reads it: read_yaml + normalize + anchor_files + from_dict
    error = validate(dataclasses.asdict(cfg)) # the loader's and checks' own message, and the field it names
    save(cfg, "my.yaml")                      # the keys that differ from the defaults; 0600 when it holds a secret

A field's docstring is tyro's (the string literal under the field, as `--help` shows it), its choices its `Literal`,
its range the rule configs/checks.py enforces (checks.ranges(), a section's own RANGES). A list or mapping of sections
(tasksets, auxiliary_models, lora_configs, stages, operators, auxiliary_buffers) gets its item class's fields as
`path[].field` (a list) or `path.*.field` (a mapping). The page (studio/config_page.py) draws a widget per field from
this; everything here is plain Python, testable without Streamlit.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import re
import threading
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml

from configs import checks
from configs.loader import from_dict, load_file, type_hints
from configs.resolve import escaped, holds_secret, resolve_stages
from configs.schema import Config, StageConfig
from errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

# The keys a first run needs (model, taskset, algorithm, steps, batch, sync, names): beginner mode shows these only.
BEGINNER = (
    "project",
    "name",
    "mode",
    "checkpoint_root_dir",
    "model.model_path",
    "model.max_prompt_tokens",
    "model.max_response_tokens",
    "buffer.explorer_input.taskset.name",
    "buffer.explorer_input.taskset.path",
    "buffer.explorer_input.taskset.split",
    "buffer.explorer_input.taskset.format.prompt_key",
    "buffer.explorer_input.taskset.format.response_key",
    "buffer.default_workflow_type",
    "buffer.default_reward_fn_type",
    "algorithm.algorithm_type",
    "algorithm.repeat_times",
    "algorithm.optimizer.lr",
    "buffer.total_epochs",
    "buffer.total_steps",
    "buffer.batch_size",
    "synchronizer.sync_method",
    "synchronizer.sync_interval",
)

# Expert mode's sections, by the top-level key a field sits under; every other field is in "the rest".
SECTIONS = {
    "model": ("model",),
    "buffer": ("buffer",),
    "explorer and synchronizer": ("explorer", "synchronizer"),
    "trainer": ("trainer", "algorithm"),
    "monitor": ("monitor",),
    "data pipelines": ("data_processor",),
    "the rest": (),  # cluster, log, stages and the top-level keys
}


@dataclasses.dataclass(frozen=True)
class Field:
    """One schema field as the page shows it. `path`: dotted, `[]` for a list's items, `.*` for a mapping's."""

    path: str
    owner: type
    name: str
    kind: str  # literal, bool, int, float, str, yaml (lists, mappings, ArgsDict), section, items
    type_text: str
    default: Any
    doc: str
    choices: tuple = ()
    range_text: str = ""
    optional: bool = False
    item: type | None = None  # a section's class, or the item class of a list / mapping of sections

    @property
    def section(self) -> str:
        return section_of(self.path)

    @property
    def help(self) -> str:
        """The docstring, the default, the choices and the range, as the widget's help shows them."""
        parts = [self.doc, f"type: {self.type_text}; default: {shown_default(self)}"]
        if self.choices:
            parts.append(f"choices: {', '.join(map(str, self.choices))}")
        if self.range_text:
            parts.append(f"range: {self.range_text}")
        return "\n\n".join(parts)


def shown_default(f: Field) -> str:
    return "unset" if f.default is None else repr(f.default)


def section_of(path: str) -> str:
    """The expert section a field's path belongs to (the first key decides)."""
    top = path.split(".")[0].split("[")[0]
    return next((name for name, keys in SECTIONS.items() if top in keys), "the rest")


# --- the schema


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """(the type without Optional, whether None is allowed); Annotated (ArgsDict) is kept."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], len(inner) < len(typing.get_args(tp))
    return tp, False


def _items_class(tp: Any) -> tuple[str, type] | None:
    """("list" or "mapping", item class) of a list / mapping of sections, else None."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, dict) and args and dataclasses.is_dataclass(args[-1]):
        return ("list" if origin is list else "mapping"), args[-1]
    return None


def _kind(tp: Any) -> str:
    if dataclasses.is_dataclass(tp):
        return "section"
    if _items_class(tp):
        return "items"
    if typing.get_origin(tp) is Literal:
        return "literal"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(tp, "yaml")


def _type_text(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Annotated:
        return "mapping (YAML)"
    return getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def range_text(owner: type, name: str, tp: Any) -> str:
    """The range configs/checks.py enforces on this field (its own text), or the int limit every int meets."""
    rule = checks.ranges().get((owner, name)) or getattr(owner, "RANGES", {}).get(name)
    if rule:
        return rule[1]
    return "an integer below 2**31 in magnitude" if tp is int else ""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings: the string literal right under each field, as tyro shows it in --help.
    NOTE: read from the class's source here, not through tyro's private reader, whose signature changed between the
    tyro floor (0.9.3) and today's."""
    body = ast.parse(inspect.cleandoc("\n" + inspect.getsource(cls))).body[0].body
    return {
        node.target.id: inspect.cleandoc(after.value.value)
        for node, after in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
    }  # fmt: skip


@functools.cache
def schema_fields(cls: type = Config, prefix: str = "") -> tuple[Field, ...]:
    """Every field of `cls` (Config: the whole schema), depth first: a section, then its fields; a list / mapping of
    sections, then its item class's fields under `path[]` / `path.*`."""
    out: list[Field] = []
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap(hints[f.name])
        path, kind = f"{prefix}{f.name}", _kind(tp)
        literal = typing.get_args(tp) if kind == "literal" else ()
        items = _items_class(tp)
        doc = field_docs(cls).get(f.name, "")
        out.append(
            Field(path, cls, f.name, kind, _type_text(hints[f.name]), _default(f), doc, literal,
                  range_text(cls, f.name, tp), optional, items[1] if items else tp if kind == "section" else None)
        )  # fmt: skip
        if kind == "section":
            out += schema_fields(tp, f"{path}.")
        elif items:
            out += schema_fields(items[1], f"{path}[]." if items[0] == "list" else f"{path}.*.")
    return tuple(out)


def field_at(path: str) -> Field | None:
    """The field of a concrete path (`buffer.explorer_input.tasksets[0].name` -> `...tasksets[].name`)."""
    pattern = re.sub(r"\[\d+\]", "[]", path)
    by_path = {f.path: f for f in schema_fields()}
    if pattern in by_path:
        return by_path[pattern]
    parts = pattern.split(".")  # a mapping's item: auxiliary_buffers.<name>.x -> auxiliary_buffers.*.x
    for i in range(1, len(parts)):
        star = ".".join(parts[:i] + ["*"] + parts[i + 1 :])
        if star in by_path:
            return by_path[star]
    return None


# --- values: a raw dict (dataclasses.asdict of a Config) read and written by concrete path


_STEP = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _steps(path: str) -> list[str | int]:
    return [int(i) if i else k for k, i in _STEP.findall(path)]


def get(raw: Any, path: str) -> Any:
    for step in _steps(path):
        raw = raw[step]
    return raw


def put(raw: Any, path: str, value: Any) -> None:
    *parents, last = _steps(path)
    for step in parents:
        raw = raw[step]
    raw[last] = value


def item_default(item: type) -> dict[str, Any]:
    """A new item of a list of sections, as plain data (its class's defaults)."""
    return dataclasses.asdict(item())


# --- load, validate, save


def load(path: str | Path) -> Config:
    """A YAML file as launch.py reads it (configs.loader.cli without a command line): a ConfigError if refused."""
    return load_file(path)


class _Caught(logging.Handler):
    """The config loggers' warnings of this thread (a Streamlit session's script runs in a thread of its own)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread, self.messages = threading.get_ident(), []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.messages.append(record.getMessage())


@contextlib.contextmanager
def caught_warnings() -> Iterator[list[str]]:
    """The warnings the loader and checks log inside the block (`config: ... is ignored`, `... an explorer refuses
    to start`), as a list. NOTE: checks warns of a thing once per process (_warn_once); the page validates on every
    rerun and must show them each time, so the block starts from an empty record and the old one is put back."""
    handler, logger = _Caught(), logging.getLogger("nanorft.config")
    seen = set(checks._WARNED_ALREADY)
    checks._WARNED_ALREADY.clear()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        checks._WARNED_ALREADY.update(seen)


@dataclasses.dataclass
class Verdict:
    """What validate found: the Config (None where refused), the error (the loader's own words) and its field, and
    the warnings the checks gave (a config that runs, but maybe not as meant)."""

    cfg: Config | None
    error: str = ""
    field: str = ""  # the concrete path the message names, "" for none
    warnings: list[str] = dataclasses.field(default_factory=list)


def validate(raw: dict[str, Any]) -> Verdict:
    """The raw values checked as `launch.py` checks a loaded file: from_dict, the placeholders, then every stage
    derived and checked (configs.resolve_stages)."""
    with caught_warnings() as warned:
        try:
            cfg = from_dict(Config, raw)
            checks.check_placeholders(dataclasses.asdict(cfg))
            resolve_stages(cfg)
        except ConfigError as e:
            return Verdict(None, str(e), error_field(str(e), raw), list(dict.fromkeys(warned)))
    return Verdict(cfg, warnings=list(dict.fromkeys(warned)))


def concrete_paths(raw: Any, prefix: str = "") -> list[str]:
    """Every path of the raw config that is a schema field (item indices and mapping keys written out)."""
    out = []
    items = raw.items() if isinstance(raw, dict) else enumerate(raw) if isinstance(raw, list) else ()
    for key, value in items:
        path = f"{prefix}[{key}]" if isinstance(key, int) else f"{prefix}.{key}" if prefix else str(key)
        if field_at(path) is not None:
            out.append(path)
        if isinstance(value, (dict, list)) and (field_at(path) is None or field_at(path).kind != "yaml"):
            out += concrete_paths(value, path)
    return out


def error_field(message: str, raw: dict[str, Any]) -> str:
    """The field an error message names: the longest field path it starts with or mentions; "" for none. A stage's
    error (`stages[0] (sft): algorithm.x: ...`) names its override section `stages[0].algorithm` where that stage sets
    the key, else the global key it inherited."""
    paths = concrete_paths(raw)
    stage = re.match(r"(stages\[(\d+)\]) \([^)]*\): ((\w+)[\w.]*)", message)
    if stage:
        override = raw["stages"][int(stage[2])].get(stage[4]) if stage[4] in StageConfig.__dataclass_fields__ else None
        if _holds(override, stage[3].split(".")[1:]):
            return f"{stage[1]}.{stage[4]}"
        message = message[stage.end(1) :]
    named = [p for p in paths if re.search(rf"(?<![\w.\]]){re.escape(p)}(?![\w])", message)]
    return max(named, key=len, default="")


def _holds(override: Any, keys: list[str]) -> bool:
    """Whether a stage's override mapping sets the key `keys` (or a mapping above it)."""
    for k in keys:
        if not isinstance(override, dict) or k not in override:
            return False
        override = override[k]
    return isinstance(override, dict) or bool(keys) or override is not None


def minimal(value: dict[str, Any], cls: type = Config) -> dict[str, Any]:
    """The keys of `value` (plain data of a `cls`) that differ from the defaults, as a person writes a YAML file;
    an item of a list of sections keeps only its own non-default keys."""
    hints, out = type_hints(cls), {}
    for f in dataclasses.fields(cls):
        v, default = value[f.name], _default(f)
        if v == default:
            continue
        tp, _ = _unwrap(hints[f.name])
        items = _items_class(tp)
        if dataclasses.is_dataclass(tp) and isinstance(v, dict):
            out[f.name] = minimal(v, tp)
        elif items and items[0] == "list":
            out[f.name] = [minimal(x, items[1]) for x in v]
        elif items:
            out[f.name] = {k: minimal(x, items[1]) for k, x in v.items()}
        else:
            out[f.name] = v
    return out


def to_text(cfg: Config, hide: bool = False) -> str:
    """The YAML the page saves (hide: with secrets as ***, as --dry-run shows them; such text is for eyes only)."""
    data = minimal(dataclasses.asdict(cfg))
    if hide:
        data = checks.redacted(data)
    return yaml.safe_dump(escaped(data), sort_keys=False, allow_unicode=True) if data else "{}\n"


def save(cfg: Config, path: str | Path) -> Path:
    """Write the config as YAML to `path`: only its owner may read it when it holds a secret (configs.resolve.
    holds_secret). NOTE: paths stay as loaded: a `file.py:attr` spec is absolute already (anchor_files), and a
    relative data or model path means, as in every config, the directory launch.py runs from (the repository)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    secret = holds_secret(cfg)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(to_text(cfg))
    if secret:
        os.chmod(p, 0o600)  # NOTE: os.open's mode applies to a new file only
    return p


def example_configs() -> list[Path]:
    """The YAML files the page offers: configs/ (recursively) and Trinity-RFT's examples in tests/data."""
    found = sorted((ROOT / "configs").rglob("*.yaml")) + sorted((ROOT / "tests/data/reference_configs").glob("*.yaml"))
    return [p for p in found if p.is_file()]
