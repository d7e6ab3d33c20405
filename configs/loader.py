"""Load, validate and resolve a config: the one path every entry point takes.

    cfg = configs.cli(sys.argv[1:])           # --config FILE.yaml, then tyro CLI overrides
    stages = configs.resolve_stages(cfg)      # [derived Config] (one per stage, or just one)

Order of work (precedence: dataclass default < YAML < CLI):
1. `read_yaml`: YAML text -> dict; `${oc.env:VAR,default}` and `${a.b.c}` resolved by OmegaConf. A key written
   twice, a date, binary data, a set, a null key or `???` is a ConfigError naming the file and the key.
2. `normalize`: deprecated aliases renamed, Ray-only keys dropped with a warning, Trinity's `monitor.monitor_type:
   wandb` made a list of one sink, veRL `trainer.trainer_config` keys mapped onto nanorft fields and removed from it
   (the rest warned about by path).
3. `from_dict`: dict -> dataclasses; unknown keys fail with their path and the closest valid key,
   values are coerced to the field type (YAML reads `1e-6` as a string) or fail with path/value/type.
4. tyro applies the command line on top (`--algorithm.optimizer.lr 1e-6`); a `--trainer.trainer_config` given there
   is mapped as from the YAML (`cli_trainer_config`).
Then configs/resolve.py: `derive`, every value computed from others (train_batch_size, max_model_len,
per-taskset defaults, GPU split, ...), in one function, never in __post_init__; `resolve_stages`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import logging
import re
import stat
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, NoReturn

import tyro
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

import algos
from configs.checks import check_ranges, shown_value
from configs.schema import Config, bounded_yaml, check_plain
from errors import ConfigError

log = logging.getLogger("nanorft.config")
CONFIG_DIR = Path(__file__).resolve().parent


# --- 1. YAML


def find_config_file(name: str) -> Path:
    """A path as given, else a bare name inside configs/ (with or without .yaml)."""
    tried = [Path(name), CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"]
    for p in tried:
        if p.is_file():
            return p
    if Path(name).is_dir():
        raise ConfigError(f"--config {name}: a directory, not a YAML file")
    if Path(name).exists():  # a FIFO, a device: named
        _check_file(name)
    raise ConfigError(f"config file not found: {name} (tried {', '.join(str(p) for p in tried)})")


class _Duplicate(Exception):
    """A key written twice in one YAML mapping (key, its line, the line of the first)."""


class _UniqueKeys:
    """A YAML loader that refuses a key written twice in one mapping (plain PyYAML keeps the last silently).
    Keys brought in by a merge (`<<: *anchor`) may be overridden, as YAML allows."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=False)  # type: ignore[attr-defined]
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if first != key_node.start_mark.line + 1:
                raise _Duplicate(key, key_node.start_mark.line + 1, first)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _UniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    """yaml.SafeLoader with _UniqueKeys."""


class _CUniqueKeyLoader(_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """_UniqueKeyLoader on libyaml's parser (PyYAML's own, where it was built without it): the same constructor and
    resolver, ~5x faster."""


def load_yaml(text: str) -> Any:
    """yaml.load with _UniqueKeyLoader, a self-containing document or one its aliases expand past a bound refused
    before it is built (schema.check_expansion: a ConfigError without the file). NOTE: libyaml's parser first, and
    what it refuses again with PyYAML's: an error (or a document only PyYAML reads) is PyYAML's, as it always was."""
    try:
        return bounded_yaml(text, _CUniqueKeyLoader)  # NOTE: SafeLoaders: no Python objects built
    except (yaml.YAMLError, _Duplicate, UnicodeError):
        return bounded_yaml(text, _UniqueKeyLoader)


MAX_YAML_BYTES = 16 << 20  # a config file's size: the examples are ~5 KB (schema.YAML_MAX_CHARS bounds its expansion)


def _check_file(path: str | Path) -> None:
    """ConfigError when `path` is not a regular file (a FIFO would block the read, /dev/zero never end it) or is
    larger than MAX_YAML_BYTES; a path that cannot be stat'ed is read_yaml's to name."""
    try:
        st = Path(path).stat()
    except OSError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device"
        raise ConfigError(f"{path}: {kind}, not a regular file; a config is a YAML file")
    if st.st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {st.st_size:,} bytes, over {MAX_YAML_BYTES:,}; a config is a few KB of YAML")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config and resolve its interpolations; a ConfigError naming the file (and the line or key) for
    anything that is not a YAML mapping of plain values."""
    _check_file(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not a text (UTF-8) file: byte 0x{e.object[e.start]:02x} at byte {e.start + 1}; "
            "a config is a YAML file"
        ) from None
    except OSError as e:  # a directory, no permission, ...
        raise ConfigError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    try:
        raw = load_yaml(text) or {}
    except ConfigError as e:  # bounded_yaml's: aliases, nesting
        raise ConfigError(f"{path}: {e}") from None
    except _Duplicate as e:
        key, line, first = e.args
        raise ConfigError(
            f"{path}: line {line}: key {key!r} is written twice in one mapping (first at line {first}); "
            "YAML would keep only the last: remove one"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    check_plain(raw, f"{path}: ")
    if not _omegaconf_reads(raw):
        return _fresh(raw)  # NOTE: OmegaConf would give the same, ~50x slower (every process reads its config)
    try:
        return OmegaConf.to_container(
            OmegaConf.create(raw),
            resolve=True,  # type: ignore[return-value]
            throw_on_missing=True,
        )
    except MissingMandatoryValue as e:
        raise ConfigError(f"{path}: {e.full_key} is ??? (a mandatory value left unset): set it") from None
    except Exception as e:  # omegaconf raises several error classes; all mean a bad interpolation
        raise ConfigError(f"{path}: cannot resolve an interpolation: {' '.join(str(e).split())}") from e


def _omegaconf_reads(value: Any) -> bool:
    """Whether OmegaConf changes anything of this plain YAML data: a string (key or value) holding `${` (an
    interpolation, or one escaped) or `???` (a missing value, or one escaped)."""
    if isinstance(value, dict):
        return any(_omegaconf_reads(k) or _omegaconf_reads(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_omegaconf_reads(v) for v in value)
    return isinstance(value, str) and ("${" in value or "???" in value)


def _fresh(value: Any) -> Any:
    """Plain YAML data with a new mapping / list at each place, as OmegaConf.to_container gives: a YAML alias
    (`*name`) read twice is two objects, not one shared."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value


# --- 2. normalize: aliases, ignored keys, veRL trainer_config

# Old or alternative Trinity-RFT spellings -> the key nanorft uses.
_EB = "buffer.trainer_input.experience_buffer"
ALIASES = {
    "algorithm.optimizer.warmup_style": "algorithm.optimizer.lr_scheduler_type",
    "buffer.explorer_input.default_workflow_type": "buffer.default_workflow_type",
    "buffer.explorer_input.default_eval_workflow_type": "buffer.default_eval_workflow_type",
    "buffer.explorer_input.default_reward_fn_type": "buffer.default_reward_fn_type",
    "algorithm.optimizer.clip_grad": "trainer.grad_clip",
}
# Trinity-RFT's experience_buffer.replay_buffer block (ReplayBufferConfig) -> the experience_buffer keys beside it.
REPLAY_BUFFER = {
    "enable": "use_priority_queue",
    "reuse_cooldown_time": "reuse_cooldown_time",
    "priority_fn_args.decay": "priority_decay",
}
# Trinity-RFT keys that only make sense with Ray or services nanorft does not have.
IGNORED = {
    "ray_namespace": "nanorft uses no Ray",
    "ignore_validator_suggestions": "nanorft has no interactive validator",
    "service": "nanorft runs Data-Juicer as a subprocess in its own environment (.venv-dj), not as a service",
    "cluster.ray_address": "nanorft uses no Ray",
    "monitor.enable_ray_timeline": "nanorft uses no Ray",
    "log.group_by_node": "single node: logs go to <job dir>/log",
    "trainer.trainer_type": "nanorft has one trainer (train.py)",
    "trainer.save_strategy": "one process saves (trainer rank 0 writes the HF copy)",
    "explorer.rollout_model.use_v1": "vLLM's V1 engine is the only one",
    "synchronizer.wait_for_checkpoint": "unused in Trinity-RFT too",
    "buffer.trainer_input.experience_buffer.capacity": "the SQLite DB has no capacity limit",
    "trainer.fix_actor_microbatch_loss_scale": "nanorft weights micro-batches exactly in every loss_agg_mode (the "
    "gradient does not depend on the cut into micro-batches)",
}
# Trinity-RFT keys with a meaning nanorft does not implement: an error that says why (never silently dropped).
REFUSED = {
    "data_processor.task_pipeline.output": "the task pipeline's output is written under <job dir>/task_pipeline/ and "
    "read as the first training taskset",
    "data_processor.task_pipeline.priority_weights": "no priority-weighted task ranking in nanorft; score the tasks "
    "with an operator and choose them with data_selector (offline_easy2hard or difficulty_based)",
    "data_processor.task_pipeline.top_k": "no priority-weighted task ranking in nanorft; filter with an operator's "
    "min_score / max_score instead",
    "data_processor.experience_pipeline.save_input": "the experiences a pipeline drops are counted "
    "(pipeline/<op>/dropped and the explorer's saved state), not saved to a second buffer",
    "data_processor.experience_pipeline.input_save_path": "the experiences a pipeline drops are counted, not saved "
    "to a second buffer",
    "data_processor.experience_pipeline.inputs": "the experience pipeline reads the explorer's own experiences only",
}
SAVE_INPUT = "data_processor.experience_pipeline.save_input"  # refused when true; false: a warning, dropped
# veRL `trainer.trainer_config` paths -> nanorft fields with the same meaning.
VERL_MAP = {
    "actor_rollout_ref.model.enable_gradient_checkpointing": "trainer.gradient_checkpointing",
    "actor_rollout_ref.model.use_remove_padding": "trainer.use_remove_padding",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "trainer.micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "trainer.ppo_mini_batch_size",
    "actor_rollout_ref.actor.use_dynamic_bsz": "trainer.use_dynamic_bsz",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "trainer.max_token_len_per_gpu",
    "actor_rollout_ref.actor.grad_clip": "trainer.grad_clip",
    "actor_rollout_ref.actor.ppo_epochs": "trainer.ppo_epochs",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "trainer.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "trainer.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "trainer.optimizer_offload",
    "actor_rollout_ref.actor.optim.lr": "algorithm.optimizer.lr",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "algorithm.optimizer.lr_warmup_steps_ratio",
    "actor_rollout_ref.actor.optim.warmup_style": "algorithm.optimizer.lr_scheduler_type",
    "actor_rollout_ref.actor.optim.min_lr_ratio": "algorithm.optimizer.min_lr_ratio",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "trainer.ref_param_offload",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "trainer.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "trainer.log_prob_micro_batch_size_per_gpu",
    "critic.optim.lr": "trainer.critic.lr",
    "critic.optim.lr_warmup_steps_ratio": "trainer.critic.lr_warmup_steps_ratio",
    "critic.model.enable_gradient_checkpointing": "trainer.critic.gradient_checkpointing",
    "critic.model.fsdp_config.param_offload": "trainer.critic.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "trainer.critic.optimizer_offload",
    "critic.ppo_micro_batch_size_per_gpu": "trainer.critic.micro_batch_size_per_gpu",
    "critic.cliprange_value": "trainer.critic.cliprange_value",
    "critic.grad_clip": "trainer.critic.grad_clip",
    "trainer.critic_warmup": "trainer.critic_warmup",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints_to_keep",
}
_MISSING = object()


def _get(d: dict, dotted: str) -> Any:
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return _MISSING
        d = d[k]
    return d


def _set(d: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for k in parents:
        d = d.setdefault(k, {})
    d[last] = value


def _pop(d: dict, dotted: str) -> Any:
    *parents, last = dotted.split(".")
    for k in parents:
        if not isinstance(d.get(k), dict):
            return _MISSING
        d = d[k]
    return d.pop(last, _MISSING)


@functools.cache
def _field_type(dotted: str) -> Any:
    """The type of the schema field at `dotted` (e.g. trainer.critic.lr)."""
    tp: Any = Config
    for k in dotted.split("."):
        tp = type_hints(tp)[k]
    return tp


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints(cls, include_extras=True), once per class (a pure function of the schema; every config
    load asks it for each section). NOTE: read it, never change it."""
    return typing.get_type_hints(cls, include_extras=True)


def _same(a: Any, b: Any, tp: Any = None) -> bool:
    """Equal once YAML's spelling is set aside ('1e-5' == 1e-05, 'yes' == 'true' == True): both coerced to the
    field's type `tp` where given."""
    if tp is not None:
        try:
            return _coerce(a, tp, "") == _coerce(b, tp, "")
        except ConfigError:
            pass
    try:
        return a == b or str(a).lower() == str(b).lower() or float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _drop(d: dict, dotted: str) -> None:
    """Remove the leaf at `dotted` and the mappings it leaves empty."""
    *parents, last = dotted.split(".")
    chain = [d]
    for k in parents:
        chain.append(chain[-1][k])
    del chain[-1][last]
    for parent, k in zip(reversed(chain[:-1]), reversed(parents)):
        if parent[k] == {}:
            del parent[k]


def _leaves(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        out += _leaves(v, path + ".") if isinstance(v, dict) and v else [(path, v)]
    return out


def replay_buffer(raw: dict[str, Any]) -> None:
    """Trinity-RFT's experience_buffer.replay_buffer block, in place: its keys set as the experience_buffer's own
    (REPLAY_BUFFER); a priority_fn other than linear_decay, or any other key, refused by name."""
    eb = _get(raw, _EB)
    block = eb.pop("replay_buffer", None) if isinstance(eb, dict) else None
    if block is None:
        return
    where = f"{_EB}.replay_buffer"
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: expected a mapping (enable, priority_fn, reuse_cooldown_time, priority_fn_args)")
    fn = block.pop("priority_fn", "linear_decay")
    if fn != "linear_decay":
        raise ConfigError(
            f"{where}.priority_fn = {fn!r}: nanorft's priority queue is Trinity's linear_decay only (model_version - "
            f"decay x use_count: {_EB}.use_priority_queue, priority_decay); the noise and use_count_limit of "
            "decay_limit_randomization are not implemented"
        )
    for key, value in _leaves(block):
        if value == {}:  # an empty mapping (priority_fn_args: {}) sets nothing
            continue
        if key not in REPLAY_BUFFER:
            known = ", ".join(f"{k} (-> {v})" for k, v in REPLAY_BUFFER.items())
            raise ConfigError(f"{where}.{key}: not a key nanorft has; its replay_buffer keys: priority_fn, {known}")
        target = REPLAY_BUFFER[key]
        if target in eb and not _same(eb[target], value, _field_type(f"{_EB}.{target}")):
            raise ConfigError(f"{where}.{key} = {value!r} and {_EB}.{target} = {eb[target]!r} disagree: set one")
        eb[target] = value


def normalize(raw: dict[str, Any]) -> dict[str, Any]:
    """Aliases -> current keys, Trinity's replay_buffer block mapped, Ray-only keys dropped, veRL trainer_config
    mapped (all with warnings)."""
    raw = copy.deepcopy(raw)
    replay_buffer(raw)
    for old, new in ALIASES.items():
        value = _pop(raw, old)
        if value is not _MISSING:
            log.warning("config: %s is an old name of %s; using it as such", old, new)
            _set(raw, "__alias__." + new, value)
    for new, value in _leaves(raw.pop("__alias__", {})):
        if _get(raw, new) is not _MISSING and not _same(_get(raw, new), value, _field_type(new)):
            raise ConfigError(f"{new} is set twice with different values (once under an old name)")
        _set(raw, new, value)
    for key, why in IGNORED.items():
        if _pop(raw, key) is not _MISSING:
            log.warning("config: %s is ignored: %s", key, why)
    if _get(raw, SAVE_INPUT) is False:  # Trinity's save_input off: what nanorft does anyway
        _pop(raw, SAVE_INPUT)
        log.warning("config: %s: false is nanorft's only behaviour (%s)", SAVE_INPUT, REFUSED[SAVE_INPUT])
    for key, why in REFUSED.items():
        if _get(raw, key) is not _MISSING:
            raise ConfigError(f"{key} is not supported: {why}")
    monitor = raw.get("monitor")
    if isinstance(monitor, dict) and isinstance(monitor.get("monitor_type"), str):  # Trinity's one sink by name
        monitor["monitor_type"] = [monitor["monitor_type"]]
    trainer = raw.get("trainer") if isinstance(raw.get("trainer"), dict) else {}
    if trainer.get("trainer_config_path"):
        if trainer.get("trainer_config"):
            raise ConfigError("trainer.trainer_config and trainer.trainer_config_path are both set; set only one")
        trainer["trainer_config"] = read_yaml(trainer["trainer_config_path"])
    trainer.pop("trainer_config_path", None)
    verl = trainer.get("trainer_config") or {}
    if not isinstance(verl, dict):
        raise ConfigError(f"trainer.trainer_config must be a mapping, got {verl!r}")
    for path, value in _leaves(verl):
        full = f"trainer.trainer_config.{path}"
        if path in VERL_MAP:
            target, tp = VERL_MAP[path], _field_type(VERL_MAP[path])
            value, existing = _coerce(value, tp, full), _get(raw, target)
            if existing is not _MISSING and not _same(existing, value, tp):
                raise ConfigError(f"{full} = {value!r} conflicts with {target} = {existing!r}; set only one")
            _set(raw, target, value)
            # NOTE: mapped keys leave trainer_config (their value is the field's now): a resolved config written
            # out and loaded again (the launcher's children) must not map them again over a changed field
            _drop(verl, path)
        else:
            log.warning("config: %s (veRL) has no meaning in nanorft and is not used", full)
    return raw


# --- 3. from_dict: validation and type coercion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _coerce(value, args[0], path)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, path)
    if origin is typing.Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(x) for x in args], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"{path}: {shown_value(path, value)} is not one of {list(args)}{hint}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {shown_value(path, value)}")
        return [_coerce(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {shown_value(path, value)}")
        return {str(k): _coerce(v, args[1], f"{path}.{k}") for k, v in value.items()}
    return _coerce_scalar(value, tp, path)


def _coerce_union(value: Any, args: tuple, path: str) -> Any:
    """Optional[X] or `A | B`: None where allowed, else the first type the value fits, in the order written."""
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    if len(inner) == 1:
        return _coerce(value, inner[0], path)
    for option in inner:  # `str | list[str]`
        try:
            return _coerce(value, option, path)
        except ConfigError:
            pass
    raise ConfigError(f"{path}: {shown_value(path, value)} is not a valid {' or '.join(map(_type_name, inner))}")


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    """bool, int, float, str from YAML's or the command line's spelling of them."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
            return value.lower() in ("true", "yes")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            f = float(value)
            if f == int(f) and not isinstance(value, bool):
                return int(f)
        except (TypeError, ValueError, OverflowError):
            pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"{path}: {shown_value(path, value)} is not a valid {_type_name(tp)}")


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a plain dict, failing on unknown keys and wrong types."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path or 'config'}: expected a mapping for {cls.__name__}, got {shown_value(path or 'config', data)}"
        )
    hints, names = type_hints(cls), _field_names(cls)
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(names)}"
            raise ConfigError(f"{where}: unknown key; {hint}")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# --- 4. the command line


def piece_config(kind: str, name: str, args: dict[str, Any] | None, path: str | None = None) -> Any:
    """Validate `args` (the YAML's algorithm.<kind>_args, or `path`) into the Config of algos/ piece `name`.
    Unknown keys fail with their path and the closest valid key; an unknown piece name fails listing the
    known ones (ConfigError)."""
    path = path or f"algorithm.{kind}_args"
    if kind not in algos.REGISTRIES:
        raise ConfigError(f"{path}: unknown piece kind {kind!r}; known: {', '.join(algos.REGISTRIES)}")
    registry = algos.REGISTRIES[kind]
    if name not in registry:
        raise ConfigError(f"{path}: unknown {kind} {name!r}; known: {', '.join(registry)}")
    piece = from_dict(registry[name][1], args or {}, path)
    check_ranges(piece, path)
    return piece


_BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False}
# Booleans on the command line are spelt as in YAML: `--trainer.gradient_checkpointing true` (tyro alone
# accepts only True / False).
CLI_TYPES = tyro.constructors.ConstructorRegistry()


@CLI_TYPES.primitive_rule
def _yaml_bool(info: tyro.constructors.PrimitiveTypeInfo) -> tyro.constructors.PrimitiveConstructorSpec | None:
    if info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="{true,false}",
        instance_from_str=lambda args: _BOOL_WORDS[args[0].lower()],
        is_instance=lambda x: isinstance(x, bool),
        str_from_instance=lambda x: [str(x).lower()],
        choices=tuple(w for k in _BOOL_WORDS for w in (k, k.capitalize(), k.upper())),
    )


_FILE_SPEC = re.compile(r"(?P<file>[^:]+\.py):(?P<attr>[\w.]+)")
_SPEC_KEYS = ("default_workflow_type", "default_eval_workflow_type", "default_reward_fn_type")


def anchor_files(raw: Any, base: Path) -> Any:
    """A workflow, reward function or tool (workflow_args.tools) named `path/file.py:attr` in a YAML file, and a
    tool_parser `.json` file, with a relative path: resolved against the YAML file's directory `base` (in every
    section and stage), not the process's working directory (run.sh and the launcher's children run elsewhere); the
    resolved config then holds the absolute path."""
    if isinstance(raw, list):
        return [anchor_files(v, base) for v in raw]
    if not isinstance(raw, dict):
        return raw
    out = {k: anchor_files(v, base) for k, v in raw.items()}
    for key in _SPEC_KEYS:
        if key in out:
            out[key] = _anchored(out[key], base)
    args = out.get("workflow_args")
    if isinstance(args, dict):
        args = out["workflow_args"] = dict(args)
        if isinstance(args.get("tools"), list):
            args["tools"] = [_anchored(t, base) for t in args["tools"]]
        parser = args.get("tool_parser")
        if isinstance(parser, str) and parser.endswith(".json") and not Path(parser).is_absolute():
            args["tool_parser"] = str(base / parser)
    return out


def _anchored(spec: Any, base: Path) -> Any:
    m = _FILE_SPEC.fullmatch(str(spec or ""))
    return f"{base / m['file']}:{m['attr']}" if m and not Path(m["file"]).is_absolute() else spec


# The options the entry scripts read themselves, before tyro (--help shows them in its table): (name, metavar,
# what it does and which script takes it). NOTE: explore.py's --debug options are its own pre-parser's; keep both lists
# in step.
SCRIPT_OPTIONS = (
    ("config", "FILE", "all scripts: a YAML config (a bare name is looked up in configs/, e.g. --config tiny)."),
    ("dry-run", "", "all scripts: load, validate and print the resolved config of every stage, then exit."),
    (
        "verify-sync",
        "",
        "launch.py, run.sh: before the run, move the model's weights once over the process group into the rollout "
        "engines and check their checksums against the same weights loaded from the folder.",
    ),
    (
        "debug",
        "",
        "explore.py: run one task through its workflow and print its turns, tool calls, tokens, reward and the rows "
        "it would write (no DB, no trainer).",
    ),
    ("task", "N", "explore.py --debug: the task's row in its taskset, 0-based in file order (default: 0)."),
    (
        "taskset",
        "NAME",
        "explore.py --debug: a training or eval taskset by name (default: the first training one, else the first eval "
        "one).",
    ),
    ("stage", "NAME", "explore.py --debug: the stage, by name (default: the first stage that runs workflows)."),
    (
        "reply",
        "TEXT",
        "explore.py --debug: a canned response played instead of the model's, one per turn (repeat the option for "
        "several turns): a tool path seen without training.",
    ),
    ("full-rows", "", "explore.py --debug: print each row whole (tokens included), not shortened."),
)


def _container(tp: Any) -> tuple[Any, Any] | None:
    """(list or dict, item type) of a list or mapping field's type (Optional unwrapped), None for any other; an
    ArgsDict (its own YAML option) is tyro's."""
    if typing.get_origin(tp) is typing.Annotated:
        return None
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _container(inner[0]) if len(inner) == 1 else None
    origin = typing.get_origin(tp)
    return (origin, typing.get_args(tp)[-1]) if origin in (list, dict) else None


def _schema_field(dotted: str) -> Any:
    """The type of the Config field at `dotted` (`buffer.explorer_input.eval_tasksets`), None where that is no field
    (`model.lora_configs.0.lora_rank`: tyro's own option for one item)."""
    tp: Any = Config
    for k in dotted.split("."):
        if not dataclasses.is_dataclass(tp) or k not in _field_names(tp):
            return None
        tp = type_hints(tp)[k]
    return tp


def _yaml_only_fields(cfg: Any, path: str = "") -> list[tuple[str, str]]:
    """(path, help) of the fields that hold a list or mapping of sections (stages, tasksets, ...): tyro shows no
    option for one that is empty, and one per item's key for the others (`--model.lora_configs.0.lora_rank`);
    yaml_options sets the whole of it."""
    out = []
    for f in dataclasses.fields(cfg):
        value, where = getattr(cfg, f.name), f"{path}{f.name}"
        kind = _container(type_hints(type(cfg))[f.name])
        if kind and dataclasses.is_dataclass(kind[1]):
            what = "list" if kind[0] is list else "mapping (name -> section)"
            example = "'[]' or '[{key: value, ...}]'" if kind[0] is list else "'{name: {key: value, ...}}'"
            out.append((where, f"The whole {where} as a YAML {what} of {kind[1].__name__}: {example}."))
        elif dataclasses.is_dataclass(value):
            out += _yaml_only_fields(value, where + ".")
    return out


def yaml_options(cfg: Config, args: list[str]) -> tuple[Config, list[str]]:
    """`--path VALUE` of a list or mapping field in the YAML's syntax (`--stages '[]'`, `--buffer.explorer_input.
    eval_tasksets '[{name: t, path: data/t}]'`, `--explorer.env_vars '{A: b}'`) applied to a copy of `cfg`, each
    value checked as from a YAML file (`_coerce`: a ConfigError names the key); the other options are returned for
    tyro. A list of sections (tyro has no option for one that is empty) always takes YAML; a list or mapping of plain
    values takes it when the value opens with [ or {, else tyro's own spelling (`--algorithm.optimizer.betas 0.9
    0.95`)."""
    out, rest, i = None, [], 0
    while i < len(args):
        arg = args[i]
        key, eq, given = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        tp = _schema_field(key.replace("-", "_")) if key else None
        kind = _container(tp) if tp is not None else None
        text = given if eq else args[i + 1] if i + 1 < len(args) else None
        if kind is None or text is None or not (dataclasses.is_dataclass(kind[1]) or text.lstrip()[:1] in "[{"):
            rest.append(arg)
            i += 1
            continue
        where = key.replace("-", "_")
        out = out or copy.deepcopy(cfg)
        _assign(out, where, _coerce(_option_yaml(where, text), tp, where))
        i += 1 if eq else 2
    return out or cfg, rest


def _option_yaml(where: str, text: str) -> Any:
    """One option's value read as YAML: a ConfigError naming the option where it is not YAML of plain values."""
    try:
        value = bounded_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--{where}: not valid YAML ({' '.join(str(e).split())}); e.g. '[]' or '[{{a: 1}}]'"
        ) from None
    except ConfigError as e:
        raise ConfigError(f"--{where}: {e}") from None
    check_plain(value, f"--{where}: ")
    return value


def _assign(cfg: Any, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for k in parents:
        cfg = getattr(cfg, k)
    setattr(cfg, last, value)


def load_file(path: str | Path) -> Config:
    """A YAML config file as validated Config (not derived): read, normalised (Trinity / veRL names), its `file.py`
    specs anchored to its folder, checked against the schema."""
    path = Path(path)
    return from_dict(Config, anchor_files(normalize(read_yaml(path)), path.resolve().parent))


def cli(argv: list[str], description: str = "") -> tuple[Config, bool]:
    """Parse `--config FILE [--dry-run] [--section.key VALUE ...]` into a validated (not derived) Config."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--dry-run", "--dry_run", action="store_true")
    known, rest = pre.parse_known_args(argv)
    cfg = load_file(find_config_file(known.config)) if known.config else Config()
    # NOTE: no option to apply (a launched process's `--config FILE`): tyro would give back `cfg` (tests/
    # test_config_keys.py checks it on the fuzzed configs), after ~0.1 s of building its parser
    after = command_line(cfg, rest, description) if rest else cfg
    if after.trainer.trainer_config != cfg.trainer.trainer_config:
        after = cli_trainer_config(cfg, after)
    if not known.config and not after.model.model_path:
        raise ConfigError(
            "no --config given; pass --config FILE.yaml (a bare name is looked up in configs/, e.g. --config tiny), "
            "or set the whole config on the command line, starting with --model.model_path"
        )
    return after, known.dry_run


def command_line(cfg: Config, args: list[str], description: str = "") -> Config:
    """The options `args` (`--section.key VALUE`, --help) applied by tyro on top of `cfg`; lists and mappings in the
    YAML's syntax first (`yaml_options`)."""
    cfg, args = yaml_options(cfg, args)
    if not args:
        return cfg
    text = f"{description}\n\nEvery option below overrides the YAML value (precedence: default < YAML < CLI)."
    if "-h" in args or "--help" in args:
        help_table(cfg, text)
    with CLI_TYPES:
        return tyro.cli(
            Config,
            default=cfg,
            args=args,
            description=text,
            use_underscores=True,
            config=(tyro.conf.FlagConversionOff,),
        )


def help_table(cfg: Config, description: str) -> NoReturn:
    """tyro's --help for Config (its defaults: `cfg`), with the scripts' own options (SCRIPT_OPTIONS) and the lists
    of sections tyro leaves out (yaml_options) as rows of its table. NOTE: tyro writes every option with underscores
    (use_underscores); the scripts' hyphenated names are put back in its text, the same length (the box stays
    aligned). Exits 0, as tyro's --help does."""
    rows = [(name, meta, why) for name, meta, why in SCRIPT_OPTIONS]
    rows += [(path, "YAML", why) for path, why in _yaml_only_fields(cfg)]
    while True:
        try:
            table = _help_options(cfg, rows)
            with CLI_TYPES:  # NOTE: builds the parser first: a clash is raised before anything is written
                parser = tyro.extras.get_parser(
                    table, description=description, use_underscores=True, config=(tyro.conf.FlagConversionOff,)
                )
            break
        except Exception as e:  # tyro's own (vendored) argparse.ArgumentError
            # an older tyro (0.9.3) has an option of its own for an empty mapping of sections: its row is not added
            clash = re.search(r"conflicting option string: --(\S+)", str(e))
            if clash is None:
                raise
            rows = [row for row in rows if row[0].replace("-", "_") != clash[1]]
    text = parser.format_help()
    for name, _, _ in rows:
        text = text.replace(f"--{name.replace('-', '_')} ", f"--{name} ")
    sys.stdout.write(text)
    raise SystemExit(0)


def _help_options(cfg: Config, rows: list[tuple[str, str | None, str]]) -> type:
    """help_table's dataclass: one string field per row (shown, never parsed), then Config's own options."""
    fields: list[Any] = []
    for name, meta, why in rows:
        spec = tyro.constructors.PrimitiveConstructorSpec(
            nargs=1 if meta else "*",  # NOTE: "*", not 0, for a flag: tyro 0.9.3 (the floor) refuses nargs 0
            metavar=meta,
            instance_from_str=lambda a: a,
            is_instance=lambda x: True,
            str_from_instance=lambda x: [],
        )
        row = tyro.conf.arg(name=name, help=why, help_behavior_hint="")
        fields.append((f"opt_{len(fields)}", Annotated[str, spec, row], dataclasses.field(default="")))
    fields.append(("cfg", Annotated[Config, tyro.conf.arg(name="")], dataclasses.field(default_factory=lambda: cfg)))
    return dataclasses.make_dataclass("Options", fields)


def cli_trainer_config(before: Config, after: Config) -> Config:
    """`--trainer.trainer_config '{...}'`: its veRL keys mapped onto the fields as from a YAML file (`normalize`),
    over the YAML's values (the command line wins); refused where another option of the command line sets the same
    field to something else."""
    mapped = normalize({"trainer": {"trainer_config": copy.deepcopy(after.trainer.trainer_config)}})
    raw = dataclasses.asdict(after)
    for path, value in _leaves(mapped):
        if path.startswith("trainer.trainer_config"):
            continue
        tp, mine, theirs = _field_type(path), _attr(after, path), _attr(before, path)
        if mine != theirs and not _same(mine, value, tp):
            raise ConfigError(
                f"--trainer.trainer_config maps a key onto {path} = {value!r}, and --{path} sets it to "
                f"{mine!r}; set only one"
            )
        _set(raw, path, value)
    raw["trainer"]["trainer_config"] = mapped["trainer"].get("trainer_config", {})
    return from_dict(Config, raw)


def _attr(cfg: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        cfg = getattr(cfg, k)
    return cfg
