"""No silent keys: every schema field is read by the code or refused/warned by name; every number has a range;
mutating any key of the reference YAMLs gives a named refusal, a named warning, or a valid config (never a crash)."""

import ast
import copy
import dataclasses
import datetime
import functools
import logging
import re
import subprocess
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from algos import REGISTRIES, ROLLOUT_RS_FNS
from configs import ConfigError, cli, from_dict, normalize, read_yaml, resolve_stages, to_yaml
from configs.checks import REFUSED, WARNED, ranges
from configs.loader import ALIASES, IGNORED, VERL_MAP, command_line
from configs.schema import Config
from schema_reads import ARG_FIELD_PATHS, FIELD_PATHS, args_path, read_paths
from workflows import WORKFLOWS
from workflows.args import check_tasksets

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted((ROOT / "tests/data/reference_configs").glob("*.yaml"))
OURS = sorted((ROOT / "configs").rglob("*.yaml"))
# The code that runs: every module but the schema and the tables of configs/checks.py (naming a field in a
# range or a refusal does not honour it) and the tests / benchmark scripts.
TRACKED = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
RUNTIME = sorted(
    ROOT / f
    for f in TRACKED.split()
    if f.split("/")[0] not in ("tests", "scripts") and f not in ("configs/schema.py", "configs/checks.py")
)


def schema_fields(cls: type = Config, path: str = "") -> list[tuple[type, str, str]]:
    """(class, field, path) of every field of the schema, following nested dataclasses, lists and dicts of them."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        where = f"{path}{f.name}"
        out.append((cls, f.name, where))
        for inner in [hints[f.name], *typing.get_args(hints[f.name])]:
            if dataclasses.is_dataclass(inner):
                out += schema_fields(inner, where + ".")
    return out


def piece_fields() -> list[tuple[type, str, str]]:
    """(class, field, path) of every field of every algos/ piece's Config (the YAML's algorithm.<kind>_args)."""
    seen = {
        (cfg, f.name): f"algorithm.{kind}_args.{f.name} ({name})"
        for kind, registry in REGISTRIES.items()
        for name, (_, cfg) in registry.items()
        for f in dataclasses.fields(cfg)
    }
    return [(cls, name, path) for (cls, name), path in seen.items()]


def workflow_fields() -> list[tuple[type, str, str]]:
    """(class, field, path) of every field of every registered workflow's Args (a taskset's workflow_args)."""
    seen = {
        (wf.Args, f.name): f"buffer.explorer_input.tasksets[].workflow_args.{f.name} ({name})"
        for name, wf in WORKFLOWS.items()
        if wf.Args is not None
        for f in dataclasses.fields(wf.Args)
    }
    return [(cls, name, path) for (cls, name), path in seen.items()]


def strings() -> set[str]:
    """The runtime code's string constants (a key read from a mapping: ARGS_READ_AS_DICT)."""
    return {
        node.value
        for p in RUNTIME
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def ruled_paths() -> set[str]:
    """The field paths a rule of configs/checks.py names: a class's rule holds at every path of the class."""
    out = set()
    for where, name, *_ in REFUSED + WARNED:
        out |= (
            {p for p, (cls, n) in FIELD_PATHS.items() if n == name and cls is where}
            if isinstance(where, type)
            else {f"{where}.{name}"}
        )
    return out


# Fields the code reads under another path: derive() moves the single `taskset` into `tasksets` (tests/test_config.py
# test_derived_values), so each field of it is read where the tasksets' are.
MOVED = {"buffer.explorer_input.taskset.": "buffer.explorer_input.tasksets[]."}
# Read by configs/loader.py's normalize() on the YAML's mapping, not as an attribute: mapped onto fields, or warned
# about (tests/test_config.py test_verl_trainer_config_mapped_or_warned).
READ_AS_DICT = {"trainer.trainer_config"}
# algos/ piece and workflow args read from the YAML's mapping by key, not from their class: a policy loss's
# loss_agg_mode (configs/resolve.py warns that algorithm.loss_agg_mode overrides it, as Trinity's validator does), a
# workflow's system_prompt (chat_messages reads task.workflow_args["system_prompt"]: a user's workflow that declares
# no Args has one too)
ARGS_READ_AS_DICT = {"loss_agg_mode", "system_prompt"}


def nothing_to_read(path: str) -> bool:
    """A Literal field with one allowed value (a taskset's storage_type: file): nothing to honour or to ignore; or a
    section (format, rollout_args, ...): its own fields are checked."""
    cls, name = FIELD_PATHS[path]
    tp = typing.get_type_hints(cls)[name]
    return typing.get_origin(tp) is typing.Literal and len(typing.get_args(tp)) == 1 or dataclasses.is_dataclass(tp)


def test_every_schema_field_is_read_or_refused_by_name():
    """Each field at each place of the schema (explorer.rollout_model.model_path and explorer.auxiliary_models[]
    .model_path are two) is read by the runtime code through a section of that place (tests/schema_reads.py types
    every attribute load), or named by a refusal / warning of configs/checks.py."""
    read, ruled = read_paths(ROOT, RUNTIME), ruled_paths()
    silent = []
    for path in FIELD_PATHS:
        moved = next((path.replace(a, b, 1) for a, b in MOVED.items() if path.startswith(a)), path)
        if not ({path, moved} & (read | ruled) or path in READ_AS_DICT or nothing_to_read(path)):
            silent.append(path)
    assert not silent, f"accepted, shown in --help, and never read nor refused: {silent}"
    # an algos/ piece's or a workflow's arg by place too: through a base of its class (`cfg: Config` in the piece, a
    # workflow's self.args typed by its `Args = ...`), under the path of the class that declares the field
    ruled_pieces, words = {(c, n) for c, n, *_ in REFUSED + WARNED}, strings()
    assert ARGS_READ_AS_DICT <= words
    silent = [
        path
        for cls, name, path in piece_fields() + workflow_fields()
        if ARG_FIELD_PATHS[f"{args_path(cls)}.{name}"] not in read
        and (cls, name) not in ruled_pieces
        and name not in ARGS_READ_AS_DICT
    ]
    assert not silent, f"algos/ piece and workflow arguments never read: {silent}"


def analyse(tmp_path: Path, code: str) -> set[str]:
    (tmp_path / "mod.py").write_text(code)
    return read_paths(tmp_path, [tmp_path / "mod.py"])


def test_the_schema_walk_tells_apart_fields_shared_by_name(tmp_path):
    """The walk is strict where a search for bare names is not: the actor's micro-batch size is not the critic's,
    the rollout model's API switch is not an auxiliary model's; a call site types an unannotated parameter."""
    read = analyse(
        tmp_path,
        "from configs import Config\n"
        "def f(cfg: Config):\n    t = cfg.trainer\n    return t.micro_batch_size_per_gpu\n"
        "def g(cfg):\n    rm = cfg.explorer.rollout_model\n    return rm.enable_openai_api\n"
        "def h(m):\n    return m.seed, m.model_path\n"
        "def k(c: Config):\n    for aux in c.explorer.auxiliary_models:\n        h(aux)\n",
    )
    assert {
        "trainer.micro_batch_size_per_gpu",
        "explorer.rollout_model.enable_openai_api",
        "explorer.auxiliary_models[].seed",
        "explorer.auxiliary_models[].model_path",
    } <= read
    assert (
        not {
            "trainer.critic.micro_batch_size_per_gpu",
            "explorer.auxiliary_models[].enable_openai_api",
            "explorer.rollout_model.seed",
            "explorer.rollout_model.model_path",
        }
        & read
    )
    # a base of unknown type reads only names that exist at one path (`x.name` is not trainer.name)
    assert analyse(tmp_path, "def f(x):\n    return x.name, x.sync_timeout\n") == {"synchronizer.sync_timeout"}
    # getattr over a tuple of names, `self.x` of a tuple assignment
    read = analyse(
        tmp_path,
        "from configs.schema import Config\nclass S:\n"
        "    def __init__(self, cfg: Config):\n        self.a, self.n = cfg.algorithm, 1\n"
        "    def f(self):\n"
        "        return [getattr(self.a, k + '_args') for k in ('kl_loss_fn',)]\n",
    )
    assert read == {"algorithm", "algorithm.kl_loss_fn_args"}
    # a workflow's args through its self.args (typed by its Args), a piece's through its Config: not a task's tools
    read = analyse(
        tmp_path,
        "from workflows import Workflow\nfrom workflows.tool_use import ToolArgs\n"
        "from algos.kl import Config\nclass W(Workflow):\n    Args = ToolArgs\n"
        "    def run(self):\n        return self.task.tools, self.args.max_turns\n"
        "def adapt(cfg: Config, c):\n    return cfg.horizon, c.target_kl\n",
    )
    assert read == {"<workflows.tool_use.ToolArgs>.max_turns", "<algos.kl.Config>.horizon"}
    read = analyse(
        tmp_path,
        "from workflows import Workflow\nfrom workflows.tool_use import ToolArgs\n"
        "class W(Workflow):\n    Args = ToolArgs\n"
        "    def run(self):\n        args = self.args\n        return args.system_prompt\n",
    )
    assert read == {"<workflows.args.WorkflowArgs>.system_prompt"}  # by the class that declares it
    # a trainer's pieces by kind (algos.Pieces): the Config of that kind's pieces; a kind the walk cannot tell, none
    read = analyse(
        tmp_path,
        "import algos\nclass P:\n    pieces: algos.Pieces\n"
        "def f(p: P, k):\n    return p.pieces['kl_loss_fn'][1].adaptive, p.pieces[k][1].tau\n",
    )
    assert read == {"<algos.kl.Config>.adaptive"}


def test_the_tables_name_real_fields_and_known_trinity_keys():
    fields = {(cls, name) for cls, name, _ in schema_fields() + piece_fields() + workflow_fields()}
    assert not [k for k in ranges() if k not in fields]
    args = [wf.Args for wf in WORKFLOWS.values() if wf.Args is not None]
    assert not [(cls, k) for cls in args for k in cls.RANGES if (cls, k) not in fields]
    assert not [
        (w, n)
        for w, n, *_ in REFUSED + WARNED
        if ((w, n) not in fields if isinstance(w, type) else f"{w}.{n}" not in FIELD_PATHS)
    ]
    paths = {path for *_, path in schema_fields()}
    # aliases and the veRL map land on real fields; ignored keys are not fields (else they would be silent)
    assert set(ALIASES.values()) | set(VERL_MAP.values()) <= paths
    assert not set(IGNORED) & paths


MINIMAL = {
    "model": {"model_path": "m", "max_model_len": 256},
    "buffer": {"batch_size": 4, "explorer_input": {"taskset": {"path": "data/x"}}},
}
# mode both on GPUs over two hosts: the explorer has node 0 (4 vLLM engines), trainer rank 0 is on node 1
APART = {
    "mode": "both",
    "cluster": {"node_num": 2, "gpu_per_node": 4, "master_addr": "10.0.0.2"},
    "explorer": {"rollout_model": {"engine_type": "vllm", "engine_num": 4}},
}
# a trainer on SFT data files (a buffer of storage_type file)
SFT = {"mode": "train", "algorithm": {"algorithm_type": "sft"}}
FILE = {"storage_type": "file", "path": "sft.jsonl"}
SFT_INPUT = {"experience_buffer": FILE}
HIDDEN = r"'\*\*\*'"  # a secret's value as a message shows it, as a pattern
# One case per rule of configs/checks.py: (overrides, expected refusal) and (overrides, expected warning).
REFUSAL_CASES = {
    ("buffer.explorer_input.eval_tasksets[].data_selector", "selector_type"): (
        {
            "buffer": {
                "explorer_input": {
                    "eval_tasksets": [{"path": "data/y", "data_selector": {"selector_type": "difficulty_based"}}]
                }
            }
        },
        "eval_tasksets[0].data_selector.selector_type = 'difficulty_based' is refused: an eval taskset runs each",
    ),
    ("ModelConfig", "logprobs"): ({"model": {"logprobs": 5}}, "model.logprobs = 5 is refused: top-k log-probs"),
    ("GenerationConfig", "logprobs"): (
        {"buffer": {"explorer_input": {"taskset": {"rollout_args": {"logprobs": 2}}}}},
        "tasksets[0].rollout_args.logprobs = 2 is refused",
    ),
    ("ModelConfig", "repetition_penalty"): (
        {"model": {"repetition_penalty": 1.1}, "explorer": {"rollout_model": {"engine_type": "hf"}}},
        "model.repetition_penalty = 1.1 is refused: not supported by the HF engine",
    ),
    ("explorer.rollout_model", "enable_history"): (
        {"explorer": {"rollout_model": {"enable_history": True}}},
        "explorer.rollout_model.enable_history = True is refused: it records the calls",
    ),
    ("explorer.rollout_model", "model_path"): (
        {"explorer": {"rollout_model": {"model_path": "/other/model"}}},
        "explorer.rollout_model.model_path = '/other/model' is refused: the rollout model serves model.model_path",
    ),
    **{
        ("explorer.auxiliary_models[]", key): (
            {"explorer": {"auxiliary_models": [{"model_path": "judge", "engine_type": "hf", key: value}]}},
            f"explorer.auxiliary_models[0].{key} = {HIDDEN if key.endswith('_key') else repr(value)} is refused: only "
            "the rollout model is served",
        )
        for key, value in (
            ("enable_openai_api", True),
            ("enable_history", True),
            ("openai_api_host", "0.0.0.0"),
            ("openai_api_port", 8000),
            ("openai_api_key", "k"),
        )
    },
    ("explorer.rollout_model", "openai_api_host"): (
        {"explorer": {"rollout_model": {"enable_openai_api": True, "openai_api_host": "0.0.0.0"}}},
        "explorer.rollout_model.openai_api_host = '0.0.0.0' is refused: the API would answer anyone",
    ),
    **{
        (f"buffer.explorer_input.{sets}[].format", "enable_concatenated_multi_turn"): (
            {"buffer": {"explorer_input": {sets: [{"path": "y", "format": {"enable_concatenated_multi_turn": True}}]}}},
            f"{sets}[{0 if sets == 'eval_tasksets' else 1}].format.enable_concatenated_multi_turn = True "
            "is refused: an "
            "option of SFT data",
        )
        for sets in ("tasksets", "eval_tasksets")
    },
    **{
        (f"buffer.trainer_input.{buf}.format", key): (
            {
                **SFT,
                "buffer": {
                    "trainer_input": {"experience_buffer": {**FILE, "format": {key: "x"}}}
                    if buf == "experience_buffer"
                    else {**SFT_INPUT, "auxiliary_buffers": {"expert": {**FILE, "format": {key: "x"}}}}
                },
            },
            f"{buf.replace('*', 'expert')}.format.{key} = 'x' is refused: an option of tasksets",
        )
        for buf in ("experience_buffer", "auxiliary_buffers.*")
        for key in ("workflow_key", "reward_fn_key", "reply_prefix")
    },
    ("buffer.trainer_input.auxiliary_buffers.*", "storage_type"): (
        {"buffer": {"trainer_input": {"auxiliary_buffers": {"expert": {"path": "sft.jsonl"}}}}},
        "auxiliary_buffers.expert.storage_type = 'queue' is refused: an auxiliary buffer is read as a data file",
    ),
    ("ExperienceBufferConfig", "reuse_cooldown_time"): (
        {"buffer": {"trainer_input": {"experience_buffer": {"reuse_cooldown_time": 5.0}}}},
        "experience_buffer.reuse_cooldown_time = 5.0 is refused: experiences are reused only by the priority queue",
    ),
    ("TrainerConfig", "ulysses_sequence_parallel_size"): (
        {"trainer": {"ulysses_sequence_parallel_size": 0}},
        "ulysses_sequence_parallel_size = 0 is refused: it is the number of ranks each packed sequence is split over",
    ),
    ("ModelConfig", "trust_remote_code"): (
        {"model": {"trust_remote_code": True}},
        "model.trust_remote_code = True is refused: nanorft loads only models",
    ),
    ("ExperienceBufferConfig", "path"): (APART, "buffer.trainer_input.experience_buffer.path = 'sqlite:///"),
    ("SynchronizerConfig", "sync_host"): (
        {**APART, "buffer": {"trainer_input": {"experience_buffer": {"path": "postgresql://u@db/x"}}}},
        "synchronizer.sync_host = '127.0.0.1' is refused: the explorer",
    ),
    ("RolloutCorrectionConfig", "rollout_is"): (
        {
            "explorer": {"rollout_model": {"engine_type": "vllm"}},
            "algorithm": {"rollout_correction": {"rollout_is": "token"}},
            "buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_p": 0.9}}}},
        },
        "algorithm.rollout_correction.rollout_is = 'token' is refused: vLLM's log-probs",
    ),
    ("RolloutCorrectionConfig", "rollout_rs"): (
        {
            "explorer": {"rollout_model": {"engine_type": "vllm"}},
            "algorithm": {"rollout_correction": {"rollout_rs": "icepop"}},
            "buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_k": 20}}}},
        },
        "algorithm.rollout_correction.rollout_rs = 'icepop' is refused: vLLM's log-probs",
    ),
    ("RolloutCorrectionConfig", "rollout_rs", 2): (
        {"algorithm": {"rollout_correction": {"rollout_rs": "icepop", "rollout_rs_threshold": 0.4}}},
        "algorithm.rollout_correction.rollout_rs = 'icepop' is refused: its band of kept ratios is empty",
    ),
    ("RolloutCorrectionConfig", "rollout_rs_threshold"): (
        {"algorithm": {"rollout_correction": {"rollout_rs_threshold": 3.0}}},
        "algorithm.rollout_correction.rollout_rs_threshold = 3.0 is refused: it is a bound of the rejection mask",
    ),
    ("RolloutCorrectionConfig", "rollout_rs_threshold_lower"): (
        {"algorithm": {"rollout_correction": {"rollout_rs_threshold_lower": 0.2}}},
        "algorithm.rollout_correction.rollout_rs_threshold_lower = 0.2 is refused: it is a bound of the rejection",
    ),
    ("TrainerConfig", "optimizer_offload"): (
        {"trainer": {"optimizer_offload": True}},
        "trainer.optimizer_offload = True is refused: FSDP2",
    ),
    ("CriticConfig", "optimizer_offload"): (
        {"trainer": {"critic": {"optimizer_offload": True}}},
        "trainer.critic.optimizer_offload = True is refused",
    ),
    ("AlgorithmConfig", "advantage_fn"): (
        {"algorithm": {"algorithm_type": "on_policy_distill"}},
        "algorithm.advantage_fn = 'on_policy_distill' is refused: its teacher log-probs come from a teacher",
    ),
    ("ModelConfig", "lora_configs"): (
        {"model": {"lora_configs": [{}, {"lora_rank": 8}]}},
        "model.lora_configs = [2 sections] is refused: one LoRA adapter at most",
    ),
    ("LoRAConfig", "path"): (
        {"model": {"lora_configs": [{"path": "tests"}]}},
        "model.lora_configs[0].path = 'tests' is refused: not a saved peft adapter",
    ),
    ("explorer", "partial_rollout"): (
        {"explorer": {"partial_rollout": True, "rollout_model": {"engine_type": "vllm"}}},
        "explorer.partial_rollout = True is refused: in-flight weight updates pause a running engine",
    ),
    ("explorer", "partial_rollout", 2): (
        {
            "mode": "both",
            "cluster": {"gpu_per_node": 1},
            "explorer": {"partial_rollout": True, "rollout_model": {"engine_type": "vllm_async"}},
        },
        "explorer.partial_rollout = True is refused: with cluster.colocate the engine sleeps",
    ),
    ("explorer.rollout_model", "engine_type"): (
        {"explorer": {"rollout_model": {"engine_type": "external"}}},
        "explorer.rollout_model.engine_type = 'external' is refused: the rollout model must return token ids",
    ),
    **{
        ("explorer.rollout_model.external_model_config", key): (
            {"explorer": {"rollout_model": {"external_model_config": {key: value}}}},
            f"explorer.rollout_model.external_model_config.{key} = {value!r} is refused: the rollout model cannot be",
        )
        for key, value in (
            ("base_url", "http://127.0.0.1:1/v1"),
            ("model_name", "judge"),
            ("api_key_env", "JUDGE_KEY"),
            ("timeout", 5.0),
            ("max_retries", 0),
        )
    },
    ("MonitorConfig", "monitor_type"): (
        {"monitor": {"monitor_type": ["wandb", "none"]}},
        "monitor.monitor_type = ['wandb', 'none'] is refused: each sink once, or none alone",
    ),
}
EXTERNAL = {
    "engine_type": "external",
    "external_model_config": {"base_url": "http://127.0.0.1:1/v1", "model_name": "j"},
}
WARNING_CASES = {
    **{
        ("explorer.auxiliary_models[]", key): (
            {"explorer": {"auxiliary_models": [{**EXTERNAL, key: value}]}},
            f"explorer.auxiliary_models[0].{key} = {value!r}: has no effect on an external model",
        )
        for key, value in (
            ("model_path", "judge"),
            ("engine_num", 2),
            ("tensor_parallel_size", 2),
            ("gpu_memory_utilization", 0.5),
            ("enable_prefix_caching", False),
            ("enable_chunked_prefill", True),
            ("enforce_eager", True),
            ("dtype", "bfloat16"),
            ("seed", 1),
            ("max_model_len", 512),
            ("chat_template", "{{ x }}"),
            ("ignore_eos", True),
        )
    },
    ("explorer.auxiliary_models[]", "external_model_config"): (
        {
            "explorer": {
                "auxiliary_models": [{"model_path": "judge", "engine_type": "hf", **EXTERNAL | {"engine_type": "hf"}}]
            }
        },
        "explorer.auxiliary_models[0].external_model_config = {'base_url': 'http://127.0.0.1:1/v1', 'model_name': 'j'",
    ),
    ("InferenceModelConfig", "engine_num"): (
        {
            "explorer": {
                "rollout_model": {"engine_type": "vllm"},
                "auxiliary_models": [{"model_path": "judge", "engine_type": "hf", "engine_num": 4}],
            }
        },
        "explorer.auxiliary_models[0].engine_num = 4: the HF engine runs as one",
    ),  # each model's own engine
    ("InferenceModelConfig", "enforce_eager"): (
        {"explorer": {"rollout_model": {"engine_type": "hf", "enforce_eager": True}}},
        "enforce_eager = True: has no effect",
    ),
    ("InferenceModelConfig", "enable_chunked_prefill"): (
        {"explorer": {"rollout_model": {"engine_type": "hf", "enable_chunked_prefill": False}}},
        "enable_chunked_prefill = False: has no effect",
    ),
    ("InferenceModelConfig", "enable_chunked_prefill", 2): (
        {
            "cluster": {"gpu_per_node": 0},
            "explorer": {"rollout_model": {"engine_type": "vllm", "enable_chunked_prefill": True}},
        },
        "enable_chunked_prefill = True: vLLM 0.32's CPU backend fails a seeded request",
    ),
    ("InferenceModelConfig", "enable_prefix_caching"): (
        {"explorer": {"rollout_model": {"engine_type": "hf", "enable_prefix_caching": False}}},
        "enable_prefix_caching = False: has no effect",
    ),
    ("InferenceModelConfig", "gpu_memory_utilization"): (
        {"explorer": {"rollout_model": {"engine_type": "hf", "gpu_memory_utilization": 0.5}}},
        "gpu_memory_utilization = 0.5: has no effect",
    ),
    ("InferenceModelConfig", "tensor_parallel_size"): (
        {"explorer": {"rollout_model": {"engine_type": "hf", "tensor_parallel_size": 2}}},
        "tensor_parallel_size = 2: the HF engine runs on one",
    ),
    ("explorer", "partial_rollout"): (
        {
            "synchronizer": {"sync_method": "checkpoint", "sync_style": "trainer_driven"},
            "explorer": {"partial_rollout": True, "rollout_model": {"engine_type": "vllm_async"}},
        },
        "explorer.partial_rollout = True: has no effect: the explorer never waits at a sync point",
    ),
    ("ClusterConfig", "node_num"): (
        {"mode": "explore", "cluster": {"node_num": 2, "gpu_per_node": 0}},
        "cluster.node_num = 2: an explorer is one process on the node it starts on",
    ),
    ("ClusterConfig", "master_addr"): (
        {"cluster": {"master_addr": "10.0.0.2"}},
        "cluster.master_addr = '10.0.0.2': has no effect on one node",
    ),
    ("ClusterConfig", "master_addr", 2): (
        {"cluster": {"node_num": 2, "gpu_per_node": 0}},
        "cluster.master_addr = '127.0.0.1': with cluster.node_num > 1 the other nodes would dial this address",
    ),
    ("ClusterConfig", "master_port"): (
        {"cluster": {"master_port": 29600}},
        "cluster.master_port = 29600: has no effect on one node",
    ),
    ("SynchronizerConfig", "sync_host"): (
        {"synchronizer": {"sync_method": "checkpoint", "sync_host": "10.0.0.2"}},
        "sync_host = '10.0.0.2': has no effect with sync_method checkpoint",
    ),
    **{
        ("buffer.explorer_input.eval_tasksets[].data_selector", key): (
            {"buffer": {"explorer_input": {"eval_tasksets": [{"path": "data/y", "data_selector": {key: value}}]}}},
            f"eval_tasksets[0].data_selector.{key} = {value!r}: has no effect on an eval taskset",
        )
        for key, value in (
            ("selector_type", "shuffle"),
            ("seed", 7),
            ("feature_keys", ["pass_rate"]),
            ("kwargs", {"tau": 0}),
        )
    },
    ("ExperienceBufferConfig", "priority_decay"): (
        {"buffer": {"trainer_input": {"experience_buffer": {"priority_decay": 1.0}}}},
        "priority_decay = 1.0: has no effect without use_priority_queue",
    ),
    **{
        ("ExperienceBufferConfig", key, *n): (
            {**SFT, "buffer": {"trainer_input": {"experience_buffer": {**FILE, key: value}}}},
            f"experience_buffer.{key} = {value!r}: has no effect: an option of the experience DB's queue",
        )
        for key, value, n in (
            ("use_priority_queue", True, ()),
            ("reuse_cooldown_time", 5.0, ()),
            ("priority_decay", 1.0, (2,)),
        )
    },
    ("buffer.trainer_input.auxiliary_buffers.*", "max_read_timeout"): (
        {
            **SFT,
            "buffer": {
                "trainer_input": {**SFT_INPUT, "auxiliary_buffers": {"expert": {**FILE, "max_read_timeout": 5}}}
            },
        },
        "auxiliary_buffers.expert.max_read_timeout = 5.0: has no effect: an auxiliary buffer is a data file",
    ),
    ("MonitorConfig", "monitor_args"): (
        {"monitor": {"monitor_type": "wandb", "monitor_args": {"uri": "x"}}},
        "monitor.monitor_args = {'uri': 'x'}: only wandb's api_key / base_url",
    ),
    ("LoRAConfig", "name"): (
        {"model": {"lora_configs": [{"name": "a"}]}, "explorer": {"rollout_model": {"engine_type": "hf"}}},
        "model.lora_configs[0].name = 'a': has no effect: it is vLLM's way of serving",
    ),
    ("LoRAConfig", "base_model_name"): (
        {"model": {"lora_configs": [{"base_model_name": "b"}]}},
        "model.lora_configs[0].base_model_name = 'b': has no effect: vLLM reads it only",
    ),
    ("LoRAConfig", "lora_dtype"): (
        {"model": {"lora_configs": [{"lora_dtype": "bfloat16"}]}, "explorer": {"rollout_model": {"engine_type": "hf"}}},
        "lora_dtype = 'bfloat16': the adapter trains in fp32",
    ),
    ("ModelConfig", "fully_sharded_loras"): (
        {"model": {"fully_sharded_loras": True}},
        "model.fully_sharded_loras = True: has no effect",
    ),
    ("ModelConfig", "max_cpu_loras"): ({"model": {"max_cpu_loras": 2}}, "model.max_cpu_loras = 2: has no effect"),
}
# vLLM's LoRA serving options: passed to vLLM engines that serve the adapter, so not warned there (they are on the HF
# engine and without LoRA: WARNING_CASES)
SERVED_LORA = {
    "model": {
        "lora_configs": [{"name": "a", "lora_dtype": "bfloat16"}],
        "fully_sharded_loras": True,
        "max_cpu_loras": 2,
    },
    "explorer": {"rollout_model": {"engine_type": "vllm"}},
}


def merge(a: dict, b: dict) -> dict:
    return {
        **a,
        **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v for k, v in b.items()},
    }


def merged(overrides: dict) -> dict:
    return merge(copy.deepcopy(MINIMAL), overrides)


def rule_keys(rules: list) -> list[tuple]:
    """(class name or section pattern, field[, n]) of each rule: the n-th rule on the same field gets n."""
    keys: list[tuple] = []
    for where, name, *_ in rules:
        key = (where.__name__ if isinstance(where, type) else where, name)
        n = sum(k[:2] == key for k in keys) + 1
        keys.append(key if n == 1 else (*key, n))
    return keys


def test_every_rule_has_a_case():
    assert sorted(rule_keys(REFUSED)) == sorted(REFUSAL_CASES)
    assert sorted(rule_keys(WARNED)) == sorted(WARNING_CASES)


@pytest.mark.parametrize("rule", sorted(REFUSAL_CASES), ids=lambda k: "/".join(map(str, k)))
def test_refused_values_name_the_key_and_why(rule):
    overrides, message = REFUSAL_CASES[rule]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_stages(from_dict(Config, normalize(merged(overrides))))
    resolve_stages(from_dict(Config, normalize(MINIMAL)))  # and the default value is accepted


@pytest.mark.parametrize(
    "changed",
    [
        {"buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_p": 0.9}}}}},
        {"buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_k": 20}}}}},
        {"model": {"repetition_penalty": 1.1}},
    ],
    ids=str,
)
@pytest.mark.parametrize("key, value", [("rollout_is", "token"), ("rollout_rs", "sequence_mask")])
def test_the_off_policy_correction_is_refused_only_where_vllm_logprobs_differ(changed, key, value):
    """vLLM's processed log-probs follow top-k, top-p and the repetition penalty, which the trainer does not
    apply: with any, rollout_is and rollout_rs are refused on vLLM; on the HF engine (log-probs of the full
    temperature-scaled distribution), or with neither, accepted."""

    def config(engine: str, correction: dict) -> dict:
        return merged(
            merge(
                {
                    "explorer": {"rollout_model": {"engine_type": engine}},
                    "algorithm": {"rollout_correction": correction},
                },
                changed,
            )
        )

    with pytest.raises(ConfigError, match=f"{key} = '{value}' is refused: vLLM's log-probs"):
        resolve_stages(from_dict(Config, normalize(config("vllm", {key: value}))))
    for engine, correction in (("hf", {key: value}), ("vllm", {})):
        if engine == "hf" and "repetition_penalty" in str(changed):
            continue  # refused on the HF engine for its own reason (REFUSAL_CASES)
        resolve_stages(from_dict(Config, normalize(config(engine, correction))))


@pytest.mark.parametrize(
    "changed",
    [{}, {"model": {"min_response_tokens": 5}}, {"explorer": {"rollout_model": {"ignore_eos": True}}}],
    ids=str,
)
def test_the_off_policy_correction_runs_on_vllm_with_min_tokens(changed):
    """Issue 47: the EOS masking of min_tokens (model.min_response_tokens, 1 by default; ignore_eos) is matched by
    the trainer (batching.eos_masked): rollout_is and every rollout_rs mask are accepted on vLLM with it."""
    for correction in [{"rollout_is": "token"}] + [{"rollout_rs": name} for name in ROLLOUT_RS_FNS]:
        over = {"explorer": {"rollout_model": {"engine_type": "vllm"}}, "algorithm": {"rollout_correction": correction}}
        (cfg,) = resolve_stages(from_dict(Config, normalize(merged(merge(over, changed)))))
        rc = cfg.algorithm.rollout_correction
        assert (cfg.explorer.rollout_model.engine_type, rc.rollout_is, rc.rollout_rs) == (
            "vllm",
            correction.get("rollout_is", "none"),
            correction.get("rollout_rs", "none"),
        )


@pytest.mark.parametrize("rule", sorted(WARNING_CASES), ids=lambda k: "/".join(map(str, k)))
def test_warned_values_say_what_will_not_happen(rule, caplog):
    overrides, message = WARNING_CASES[rule]
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        resolve_stages(from_dict(Config, normalize(merged(overrides))))
    assert message in caplog.text


def test_vllms_lora_options_are_not_warned_where_vllm_serves_the_adapter(caplog):
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        resolve_stages(from_dict(Config, normalize(merged(SERVED_LORA))))
    for key in ("name", "lora_dtype", "fully_sharded_loras", "max_cpu_loras"):
        assert f"{key} = " not in caplog.text


def test_ignored_trinity_keys_are_warned_about(tmp_path, caplog):
    text = yaml.safe_dump(
        merged(
            {
                "trainer": {"fix_actor_microbatch_loss_scale": True},
                "algorithm": {"optimizer": {"clip_grad": 0.5}},
            }
        )
    )
    (tmp_path / "c.yaml").write_text(text)
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        (cfg,) = resolve_stages(cli(["--config", str(tmp_path / "c.yaml")])[0])
    assert "trainer.fix_actor_microbatch_loss_scale is ignored" in caplog.text
    assert cfg.trainer.grad_clip == 0.5  # Trinity's optimizer.clip_grad is the trainer's clip
    clash = merged({"trainer": {"grad_clip": 2.0}, "algorithm": {"optimizer": {"clip_grad": 0.5}}})
    with pytest.raises(ConfigError, match="trainer.grad_clip is set twice"):
        normalize(clash)


@pytest.mark.parametrize(
    "path, value, allowed",
    [
        ("algorithm.repeat_times", 0, ">= 1"),
        ("buffer.total_epochs", 0, ">= 1"),
        ("explorer.rollout_model.engine_num", 0, ">= 1"),
        ("cluster.gpu_per_node", -1, ">= 0"),
        ("model.top_p", 0.0, "in (0, 1]"),
        ("model.top_p", 1.5, "in (0, 1]"),
        ("model.temperature", -0.1, ">= 0"),
        ("synchronizer.sync_interval", 0, ">= 1"),
        ("algorithm.optimizer.lr", 0.0, "> 0"),
        ("algorithm.optimizer.lr", float("nan"), "> 0"),
        ("trainer.critic.lr", -1e-5, "> 0"),
        ("buffer.explorer_input.taskset.rollout_args.top_p", 0.0, "in (0, 1]"),
        ("algorithm.optimizer.betas", [0.9], "two numbers in [0, 1)"),
        ("trainer.ppo_epochs", 0, ">= 1"),
        ("explorer.rollout_model.dtype", "fp8", "one of auto"),
        ("cluster.master_port", 0, "1..65535"),
        ("synchronizer.sync_host", "", "a host name or IP address"),
        # no count or size of 2**31 or more, no wait past 1e9 s (issue 13: numbers that pass a lower bound)
        ("buffer.batch_size", "1e30", ">= 1, below 2**31"),
        ("algorithm.repeat_times", 10**12, ">= 1, below 2**31"),
        ("model.max_model_len", 10**15, ">= 2, below 2**31"),
        ("explorer.rollout_model.seed", 2**40, "below 2**31"),
        ("explorer.max_timeout", 1e12, "<= 1e+09 (seconds)"),
        ("synchronizer.sync_timeout", 1e30, "<= 1e+09"),
        ("buffer.trainer_input.experience_buffer.max_read_timeout", 1e10, "<= 1e+09"),
    ],
)
def test_values_out_of_range_name_the_key_and_the_range(path, value, allowed):
    node = raw = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value
    with pytest.raises(ConfigError) as e:
        resolve_stages(from_dict(Config, normalize(raw)))
    assert path in str(e.value) and allowed in str(e.value)


def test_large_values_a_real_run_uses_are_accepted():
    (stage,) = resolve_stages(
        from_dict(
            Config,
            normalize(
                merged(
                    {
                        "model": {"max_model_len": 131072, "max_response_tokens": 65536},
                        "buffer": {"total_steps": 10**6},
                        "explorer": {"max_timeout": 86400.0 * 365},
                        "synchronizer": {"sync_timeout": 1e9},
                    }
                )
            ),
        )
    )
    assert (stage.model.max_model_len, stage.trainer.total_steps) == (131072, 10**6)


def load_workflow(name: str, **taskset: Any) -> Config:
    overrides = {"buffer": {"default_workflow_type": name, "explorer_input": {"taskset": taskset}}}
    (stage,) = resolve_stages(from_dict(Config, normalize(merged(overrides))))
    check_tasksets(stage, user_code=False)  # as the launcher does before any process starts
    return stage


# A value out of range for each range a workflow's Args declare (a new range needs its case here)
BAD_WORKFLOW_ARGS = {
    "tools": ["search"],
    "tool_parser": "llama",
    "max_turns": 0,
    "tool_timeout": 0.0,
    "max_score": -1.0,
    "judge_retries": -1,
    "judge_max_tokens": 0,
    "temperature": 0.0,
}


@pytest.mark.parametrize("name", sorted(WORKFLOWS))
def test_each_workflows_args_are_checked_by_name_when_the_config_loads(name):
    """A taskset's workflow_args against its workflow's Args (workflows/args.py), as algos/ pieces' *_args are: an
    unknown key with the closest valid one, a value of another type, out of range or of 2**31 and more; the defaults
    load, and values are coerced to the field's type (the processes read them typed)."""
    cls = WORKFLOWS[name].Args
    where = r"^buffer\.explorer_input\.tasksets\[0\]\.workflow_args\."  # `taskset:` is tasksets[0] once derived
    fields = dataclasses.fields(cls)
    last = fields[-1].name
    with pytest.raises(ConfigError, match=where + rf"{last}s: unknown key; did you mean {last}\?"):
        load_workflow(name, workflow_args={last + "s": 1})
    for f in fields:
        with pytest.raises(ConfigError, match=where + rf"{f.name}: (expected a list, got )?{{'a': 1}}"):
            load_workflow(name, workflow_args={f.name: {"a": 1}})  # a mapping fits no field's type
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert load_workflow(name, workflow_args={f.name: default}).buffer.explorer_input.tasksets[0].workflow_args == {
            f.name: default
        }
        if typing.get_type_hints(cls)[f.name] is int:
            with pytest.raises(ConfigError, match=where + rf"{f.name}: {2**40} is out of range; allowed: .*, below 2"):
                load_workflow(name, workflow_args={f.name: 2**40})
    for key, rule in cls.RANGES.items():
        with pytest.raises(ConfigError, match=where + rf"{key}: .* is out of range; allowed: {re.escape(rule[1])}"):
            load_workflow(name, workflow_args={key: BAD_WORKFLOW_ARGS[key]})
    if "max_turns" in {f.name for f in fields}:
        assert load_workflow(name, workflow_args={"max_turns": "3"}).buffer.explorer_input.tasksets[
            0
        ].workflow_args == {"max_turns": 3}


def test_reward_fn_args_are_checked_by_name_when_the_config_loads(caplog):
    """A taskset's reward_fn_args against its reward function's keyword arguments and their annotations (the named one,
    or its workflow's default): unknown keys, types, non-finite numbers; a judge's taskset is told that a reward
    function has no effect there."""
    where = r"^buffer\.explorer_input\.tasksets\[0\]\."
    for reward in ("math_reward", ""):  # "": math_workflow's default, math_reward
        with pytest.raises(ConfigError, match=where + "reward_fn_args.format_scor: unknown key; did you mean format_s"):
            load_workflow("math_workflow", default_reward_fn_type=reward, reward_fn_args={"format_scor": 0.2})
    with pytest.raises(ConfigError, match=where + "reward_fn_args.format_score: 'x' is not a valid float"):
        load_workflow("math_workflow", reward_fn_args={"format_score": "x"})
    with pytest.raises(ConfigError, match=where + "reward_fn_args.format_score: inf is not a finite number"):
        load_workflow("math_workflow", reward_fn_args={"format_score": float("inf")})
    with pytest.raises(ConfigError, match=where + "reward_fn_args.draw_key: unknown key; valid keys: p, seed"):
        load_workflow("math_workflow", default_reward_fn_type="random_reward", reward_fn_args={"draw_key": "x"})
    with pytest.raises(ConfigError, match=where + "default_reward_fn_type: unknown reward function 'math_rewrd'"):
        load_workflow("math_workflow", default_reward_fn_type="math_rewrd")
    stage = load_workflow("math_workflow", reward_fn_args={"format_score": "0.2", "last_number_fallback": "false"})
    want = {"format_score": 0.2, "last_number_fallback": False}
    assert stage.buffer.explorer_input.tasksets[0].reward_fn_args == want
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        load_workflow("llm_judge_workflow", default_reward_fn_type="math_reward")
    assert (
        "tasksets[0].default_reward_fn_type = 'math_reward': has no effect: llm_judge_workflow grades the responses "
        "itself"
    ) in caplog.text


MUTATIONS = [None, -1, 0, 0.5, 7, 10**9, 2**40, -1e-3, "x", "", True, [], {}, [1], {"x": 1}, float("inf")]


def leaves(d, prefix=""):
    for k, v in d.items():
        yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]


@functools.cache
def first_in(files: tuple[Path, ...], walk: Callable[[Path], list]) -> dict[Path, set]:
    """For each of `files`, the paths of `walk(file)` that no earlier file of the same mode and algorithm_type has:
    the ones its fuzzing mutates. NOTE: a trade for time: a key seen again in another config of the same mode and
    algorithm is not mutated there (58% of the key fuzzer's leaves and 34% of the file fuzzer's nodes)."""
    seen, out = set(), {}
    for f in files:
        raw = read_yaml(f)
        context = (raw.get("mode", "both"), (raw.get("algorithm") or {}).get("algorithm_type", "grpo"))
        out[f] = {w for w in walk(f) if (context, w) not in seen}
        seen |= {(context, w) for w in out[f]}
    return out


def leaf_paths(path: Path) -> list[str]:
    return [leaf for leaf, _ in leaves(read_yaml(path))]


def mutate(raw: dict, path: str, value) -> dict:
    node = out = copy.deepcopy(raw)
    *parents, last = path.split(".")
    for k in parents:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return out


@pytest.mark.parametrize("path", REFERENCE + OURS, ids=lambda p: p.name)
@pytest.mark.slow
def test_mutating_any_key_of_a_config_is_refused_by_name_or_accepted(path, tmp_path, monkeypatch):
    """Every leaf of the YAML (that no earlier file of its mode and algorithm has: first_in), set to each of
    MUTATIONS or deleted: either a ConfigError that names the key (its last part at least, or a key it conflicts
    with) or a config that resolves and that the launcher's children load back identically. Never another
    exception."""
    monkeypatch.setenv("HOME", "/home/user")
    raw = read_yaml(path)  # interpolations resolved, as the loader gives them
    crashes, unnamed, refused, valid = [], [], [], 0
    mine = first_in(tuple(REFERENCE + OURS), leaf_paths)[path]
    for leaf, _ in leaves(raw):
        if leaf not in mine:
            continue
        for value in MUTATIONS + [KeyError]:
            stages = resolved(
                lambda leaf=leaf, value=value: from_dict(Config, normalize(mutate(raw, leaf, value))),
                leaf,
                f"{leaf}={value!r}",
                unnamed,
                crashes,
            )
            if stages is None:
                continue
            valid += 1
            # what the launcher writes for its processes, as they read it (NOTE: every tenth config, for time;
            # test_mutating_a_config_file_... reloads every one of its own)
            for stage in stages if valid % 10 == 0 else []:
                try:
                    assert child_load(to_yaml(stage), tmp_path) == stage, "reloads differently"
                except (AssertionError, ConfigError) as e:
                    refused.append(f"{leaf}={value!r}: the launcher accepts it, its child: {e}")
    assert not crashes, crashes[:10]
    assert not unnamed, unnamed[:10]
    assert not refused, refused[:10]


def resolved(
    build: Callable[[], Config], key: str, label: str, unnamed: list[str], crashes: list[str]
) -> list[Config] | None:
    """The stages of the config `build` makes; None when refused (a ConfigError that does not name `key`, its last
    part at least, or a related key, goes to `unnamed`) or when another exception is raised (to `crashes`)."""
    try:
        return resolve_stages(build())
    except ConfigError as e:
        if key.split(".")[-1] not in str(e) and not _names_a_related_key(str(e)):
            unnamed.append(f"{label}: {e}")
    except Exception as e:  # noqa: BLE001 - this is what the tests look for
        crashes.append(f"{label}: {type(e).__name__}: {e}")
    return None


def child_load(text: str, tmp_path: Path, real_cli: bool = False, tyro: bool = False) -> Config:
    """A stage's resolved YAML as a launched process loads it (train.py / explore.py: configs.entry): the file
    through cli() and resolve_stages, or, for speed, the same steps but cli()'s argument parsing; tyro also checks
    that tyro on the empty command line (which cli() skips) gives the config back unchanged (~0.2 s a call)."""
    f = tmp_path / "stage.yaml"
    f.write_text(text)
    cfg = cli(["--config", str(f)])[0] if real_cli else from_dict(Config, normalize(read_yaml(f)))
    # cli() skips tyro when there is no option to apply: it must give the config back as it is
    assert not tyro or command_line(cfg, []) == cfg, "tyro changes it given no option"
    (stage,) = resolve_stages(cfg)
    return stage


# What a YAML file can hold beyond the values above: dates, binary data, sets, null and number keys, a list where
# a mapping goes, a mapping where a scalar goes, OmegaConf's ??? and interpolations that do not resolve.
FILE_MUTATIONS = [
    datetime.date(2024, 1, 1),
    b"\x00\x01",
    {1, 2},
    {None: 1},
    {1: 2},
    [{}],
    {"x": 1},
    "???",
    "${nope.x}",
    "${oc.env:NANORFT_FUZZ_UNSET}",
    "yes",
    "a\x00b",
]
UNKNOWN = "zz_unknown_key"
# Mappings whose keys are free by design: environment variables (a workflow's workflow_args are its Args' fields)
FREE_FORM = ("env_vars",)


def nodes(d: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Every key path of a YAML document: sections and leaves, mapping keys and list indices."""
    items = d.items() if isinstance(d, dict) else enumerate(d) if isinstance(d, list) else []
    for k, v in items:
        yield prefix + (k,), v
        yield from nodes(v, prefix + (k,))


def node_paths(path: Path) -> list[tuple]:
    return [where for where, _ in nodes(yaml.safe_load(path.read_text()))]


def set_at(raw: dict, path: tuple, value: Any) -> dict:
    out = node = copy.deepcopy(raw)
    for k in path[:-1]:
        node = node[k]
    if value is UNKNOWN:
        node[path[-1]][UNKNOWN] = 1
    else:
        node[path[-1]] = copy.deepcopy(value)
    return out


@pytest.mark.parametrize("path", REFERENCE + [ROOT / "configs/tiny.yaml"], ids=lambda p: p.name)
@pytest.mark.slow
def test_mutating_a_config_file_is_refused_by_name_or_loads_back_in_the_children(path, tmp_path, monkeypatch, caplog):
    """Each key path of the file (sections, leaves, list items) set to each of FILE_MUTATIONS, and an unknown key
    added to each mapping, written as YAML (yaml.dump: dates, binary, sets as YAML writes them) and loaded as a
    user's --config is: a ConfigError naming the key, or a config that every process the launcher starts loads back
    identically from the YAML the launcher writes (every tenth through the real cli(), and tyro). An unknown
    key that loads is named by a warning (trainer_config, monitor_args) or sits in a free-form mapping."""

    monkeypatch.setenv("HOME", "/home/user")
    raw, f = yaml.safe_load(path.read_text()), tmp_path / "mutated.yaml"
    # NOTE: for time, most mutations go into the file with its ${oc.env:...} already resolved (read_yaml then skips
    # OmegaConf, which gives the same: tests/test_config.py test_read_yaml_gives_what_pyyaml_and_omegaconf_give);
    # every tenth, and every mutation that is itself an interpolation or ???, into the file as written
    plain, mutation = read_yaml(path), 0
    crashes, unnamed, silent, refused, checked = [], [], [], [], 0
    mine = first_in(tuple(REFERENCE + [ROOT / "configs/tiny.yaml"]), node_paths)[path]
    for where, old in list(nodes(raw)):
        if where not in mine:
            continue
        values = FILE_MUTATIONS + ([UNKNOWN] if isinstance(old, dict) else [])
        for value in values:
            name, shown = ".".join(map(str, where)), "an unknown key" if value is UNKNOWN else repr(value)
            mutation += 1
            omegaconf = mutation % 10 == 0 or isinstance(value, str) and ("${" in value or "???" in value)
            doc = set_at(raw if omegaconf else plain, where, value)
            f.write_text(yaml.dump(doc, Dumper=yaml.CDumper))  # libyaml's emitter: the same YAML, faster
            caplog.clear()
            try:
                with caplog.at_level(logging.WARNING):
                    stages = resolve_stages(from_dict(Config, normalize(read_yaml(f))))
                    for stage in stages:
                        if stage.mode != "train":
                            check_tasksets(stage)
                if value is UNKNOWN and UNKNOWN not in caplog.text and where[-1] not in FREE_FORM:
                    silent.append(f"{name}: {UNKNOWN} accepted without a word")
            except ConfigError as e:
                named = UNKNOWN if value is UNKNOWN else str(where[-1])
                if named not in str(e) and not _names_a_related_key(str(e)):
                    unnamed.append(f"{name} = {shown}: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - this is what the test looks for
                crashes.append(f"{name} = {shown}: {type(e).__name__}: {e}")
                continue
            for stage in stages:  # accepted: every process the launcher starts must accept it and read the same
                checked += 1
                try:
                    tenth = checked % 10 == 0
                    assert child_load(to_yaml(stage), tmp_path, real_cli=tenth, tyro=tenth) == stage, "differs"
                except (AssertionError, ConfigError) as e:
                    refused.append(f"{name} = {shown}: the launcher accepts it, its child: {e}")
    assert not crashes, crashes[:10]
    assert not unnamed, unnamed[:10]
    assert not silent, silent[:10]
    assert not refused, refused[:10]


def _names_a_related_key(message: str) -> bool:
    """A refusal may name the key it conflicts with or depends on instead (e.g. deleting model_path: 'model.model_path
    is required'); it still names a key path."""
    return any(
        part in message
        for part in (
            "model.",
            "buffer.",
            "algorithm.",
            "trainer.",
            "explorer.",
            "cluster.",
            "synchronizer.",
            "stages[",
            "mode ",
        )
    )


@pytest.mark.slow
def test_every_override_the_launcher_accepts_its_children_accept(tmp_path, monkeypatch, capsys):
    """The command line on top of a file with veRL trainer_config keys (ppo_example.yaml): `--key value` for every
    leaf of the file outside lists and every field the veRL keys and Trinity's old names map onto, with a number and
    a word. Each is a usage error naming the option (tyro, exit 2), a ConfigError naming the key, or a config whose
    stages the launcher's processes load back identically through the real cli() (a mapped key must not be mapped
    again over the command line's value; every tenth also through tyro on the empty command line)."""
    monkeypatch.setenv("HOME", "/home/user")
    path = ROOT / "tests/data/reference_configs/ppo_example.yaml"
    raw = yaml.safe_load(path.read_text())
    keys = sorted(
        {k for k, _ in leaves(raw) if "trainer_config" not in k} | set(VERL_MAP.values()) | set(ALIASES.values())
    )
    crashes, unnamed, refused, checked = [], [], [], 0
    for key in keys:
        for value in ("0.5", "x"):
            try:
                stages = resolved(
                    lambda key=key, value=value: cli(["--config", str(path), f"--{key}", value])[0],
                    key,
                    f"--{key} {value}",
                    unnamed,
                    crashes,
                )
            except SystemExit:
                if f"--{key}" not in capsys.readouterr().err:
                    unnamed.append(f"--{key} {value}: a usage error that does not name the option")
                continue
            if stages is None:
                continue
            for stage in stages:  # accepted: every child must accept it too, and read the same config
                checked += 1
                try:
                    again = child_load(to_yaml(stage), tmp_path, real_cli=True, tyro=checked % 10 == 0)
                    assert again == stage, "reloads differently"
                except (AssertionError, ConfigError) as e:
                    refused.append(f"--{key} {value}: the launcher accepts it, its child: {e}")
    assert not crashes, crashes[:10]
    assert not unnamed, unnamed[:10]
    assert not refused, refused[:10]
