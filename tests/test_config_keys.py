"""No silent keys: every schema field is read by the code or refused/warned by name; every number has a range;
mutating any key of the reference YAMLs gives a named refusal, a named warning, or a valid config (never a crash)."""

import ast
import copy
import dataclasses
import logging
import subprocess
import typing
from pathlib import Path

import pytest
import yaml

from algos import REGISTRIES
from configs import ConfigError, cli, from_dict, normalize, resolve_stages
from configs.checks import RANGES, REFUSED, WARNED
from configs.loader import ALIASES, IGNORED, VERL_MAP
from configs.schema import Config, StageConfig

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted((ROOT / "tests/data/reference_configs").glob("*.yaml"))
OURS = sorted((ROOT / "configs").rglob("*.yaml"))
# The code that runs: every module but the schema and the tables of configs/checks.py (naming a field in a
# range or a refusal does not honour it) and the tests / benchmark scripts.
TRACKED = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
RUNTIME = sorted(ROOT / f for f in TRACKED.split() if f.split("/")[0] not in ("tests", "scripts")
                 and f not in ("configs/schema.py", "configs/checks.py"))


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
    seen = {(cfg, f.name): f"algorithm.{kind}_args.{f.name} ({name})" for kind, registry in REGISTRIES.items()
            for name, (_, cfg) in registry.items() for f in dataclasses.fields(cfg)}
    return [(cls, name, path) for (cls, name), path in seen.items()]


def reads() -> tuple[set[str], set[str]]:
    """Attribute names the runtime code loads (`x.name`, not only assigns), and its string constants (`getattr(a,
    "name")`, keys of dict lookups, the piece names of `getattr(a, piece + "_args")`)."""
    attrs, strings = set(), set()
    for p in RUNTIME:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attrs.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return attrs, strings


def test_every_schema_field_is_read_or_refused_by_name():
    attrs, strings = reads()
    ruled = {(cls, name) for cls, name, *_ in REFUSED + WARNED}
    silent = []
    for cls, name, path in schema_fields() + piece_fields():
        read = name in attrs or name in strings or (name.endswith("_args") and name[:-5] in strings)
        if not read and (cls, name) not in ruled:
            silent.append(path)
    assert not silent, f"accepted, shown in --help, and never read nor refused: {silent}"
    # the stages' sections are merged from the YAML, so they are read by name from StageConfig
    assert {f.name for f in dataclasses.fields(StageConfig)} <= strings | attrs


def test_the_tables_name_real_fields_and_known_trinity_keys():
    fields = {(cls, name) for cls, name, _ in schema_fields() + piece_fields()}
    assert not [k for k in list(RANGES) + [(c, n) for c, n, *_ in REFUSED + WARNED] if k not in fields]
    paths = {path for *_, path in schema_fields()}
    # aliases and the veRL map land on real fields; ignored keys are not fields (else they would be silent)
    assert set(ALIASES.values()) | set(VERL_MAP.values()) <= paths
    assert not set(IGNORED) & paths


MINIMAL = {"model": {"model_path": "m", "max_model_len": 256}, "buffer": {"batch_size": 4, "explorer_input": {
    "taskset": {"path": "data/x"}}}}
# mode both on GPUs over two hosts: the explorer has node 0 (4 vLLM engines), trainer rank 0 is on node 1
APART = {"mode": "both", "cluster": {"node_num": 2, "gpu_per_node": 4, "master_addr": "10.0.0.2"},
         "explorer": {"rollout_model": {"engine_type": "vllm", "engine_num": 4}}}
# One case per rule of configs/checks.py: (overrides, expected refusal) and (overrides, expected warning).
REFUSAL_CASES = {
    ("ModelConfig", "logprobs"): ({"model": {"logprobs": 5}}, "model.logprobs = 5 is refused: top-k log-probs"),
    ("GenerationConfig", "logprobs"): ({"buffer": {"explorer_input": {"taskset": {"rollout_args": {"logprobs": 2}}}}},
                                       "tasksets[0].rollout_args.logprobs = 2 is refused"),
    ("ModelConfig", "repetition_penalty"): ({"model": {"repetition_penalty": 1.1}, "explorer": {"rollout_model": {
        "engine_type": "hf"}}}, "model.repetition_penalty = 1.1 is refused: not supported by the HF engine"),
    ("InferenceModelConfig", "enable_history"): (
        {"explorer": {"rollout_model": {"enable_history": True}}},
        "explorer.rollout_model.enable_history = True is refused: it records the calls"),
    ("TrainerConfig", "ulysses_sequence_parallel_size"): ({"trainer": {"ulysses_sequence_parallel_size": 2}},
                                                          "ulysses_sequence_parallel_size = 2 is refused"),
    ("ModelConfig", "trust_remote_code"): ({"model": {"trust_remote_code": True}},
                                           "model.trust_remote_code = True is refused: nanorft loads only models"),
    ("ExperienceBufferConfig", "path"): (APART, "buffer.trainer_input.experience_buffer.path = 'sqlite:///"),
    ("SynchronizerConfig", "sync_host"): ({**APART, "buffer": {"trainer_input": {"experience_buffer": {
        "path": "postgresql://u@db/x"}}}}, "synchronizer.sync_host = '127.0.0.1' is refused: the explorer"),
    ("RolloutCorrectionConfig", "rollout_is"): (
        {"explorer": {"rollout_model": {"engine_type": "vllm"}}, "algorithm": {"rollout_correction": {
            "rollout_is": "token"}}, "buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_p": 0.9}}}}},
        "algorithm.rollout_correction.rollout_is = 'token' is refused: vLLM's log-probs"),
    ("TrainerConfig", "optimizer_offload"): ({"trainer": {"optimizer_offload": True}},
                                             "trainer.optimizer_offload = True is refused: FSDP2"),
    ("CriticConfig", "optimizer_offload"): ({"trainer": {"critic": {"optimizer_offload": True}}},
                                            "trainer.critic.optimizer_offload = True is refused"),
    ("ModelConfig", "lora_configs"): ({"model": {"lora_configs": [{}, {"lora_rank": 8}]}},
                                      "model.lora_configs = [2 sections] is refused: one LoRA adapter at most"),
    ("LoRAConfig", "path"): ({"model": {"lora_configs": [{"path": "tests"}]}},
                             "model.lora_configs[0].path = 'tests' is refused: not a saved peft adapter"),
}
WARNING_CASES = {
    ("InferenceModelConfig", "engine_num"): ({"explorer": {"rollout_model": {"engine_type": "hf", "engine_num": 4}}},
                                             "explorer.rollout_model.engine_num = 4: the HF engine runs as one"),
    ("InferenceModelConfig", "enforce_eager"): ({"explorer": {"rollout_model": {"engine_type": "hf",
                                                 "enforce_eager": True}}}, "enforce_eager = True: has no effect"),
    ("InferenceModelConfig", "enable_chunked_prefill"): ({"explorer": {"rollout_model": {
        "engine_type": "hf", "enable_chunked_prefill": False}}}, "enable_chunked_prefill = False: has no effect"),
    ("InferenceModelConfig", "enable_prefix_caching"): ({"explorer": {"rollout_model": {
        "engine_type": "hf", "enable_prefix_caching": False}}}, "enable_prefix_caching = False: has no effect"),
    ("InferenceModelConfig", "gpu_memory_utilization"): ({"explorer": {"rollout_model": {
        "engine_type": "hf", "gpu_memory_utilization": 0.5}}}, "gpu_memory_utilization = 0.5: has no effect"),
    ("InferenceModelConfig", "tensor_parallel_size"): ({"explorer": {"rollout_model": {
        "engine_type": "hf", "tensor_parallel_size": 2}}}, "tensor_parallel_size = 2: the HF engine runs on one"),
    ("ClusterConfig", "node_num"): ({"mode": "explore", "cluster": {"node_num": 2, "gpu_per_node": 0}},
                                    "cluster.node_num = 2: an explorer is one process on the node it starts on"),
    ("ClusterConfig", "master_addr"): ({"cluster": {"master_addr": "10.0.0.2"}},
                                       "cluster.master_addr = '10.0.0.2': has no effect on one node"),
    ("ClusterConfig", "master_port"): ({"cluster": {"master_port": 29600}},
                                       "cluster.master_port = 29600: has no effect on one node"),
    ("SynchronizerConfig", "sync_host"): ({"synchronizer": {"sync_method": "checkpoint", "sync_host": "10.0.0.2"}},
                                          "sync_host = '10.0.0.2': has no effect with sync_method checkpoint"),
    ("LoRAConfig", "name"): ({"model": {"lora_configs": [{"name": "a"}]}},
                             "model.lora_configs[0].name = 'a': has no effect: it is vLLM's way of serving"),
    ("LoRAConfig", "base_model_name"): ({"model": {"lora_configs": [{"base_model_name": "b"}]}},
                                        "model.lora_configs[0].base_model_name = 'b': has no effect"),
    ("LoRAConfig", "lora_dtype"): ({"model": {"lora_configs": [{"lora_dtype": "bfloat16"}]}},
                                   "lora_dtype = 'bfloat16': the adapter trains in fp32"),
    ("ModelConfig", "fully_sharded_loras"): ({"model": {"fully_sharded_loras": True}},
                                             "model.fully_sharded_loras = True: has no effect"),
    ("ModelConfig", "max_cpu_loras"): ({"model": {"max_cpu_loras": 2}}, "model.max_cpu_loras = 2: has no effect"),
}


def merge(a: dict, b: dict) -> dict:
    return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                    for k, v in b.items()}}


def merged(overrides: dict) -> dict:
    return merge(copy.deepcopy(MINIMAL), overrides)


def test_every_rule_has_a_case():
    assert {(c.__name__, n) for c, n, *_ in REFUSED} == set(REFUSAL_CASES)
    assert {(c.__name__, n) for c, n, *_ in WARNED} == set(WARNING_CASES)


@pytest.mark.parametrize("rule", sorted(REFUSAL_CASES), ids="/".join)
def test_refused_values_name_the_key_and_why(rule):
    overrides, message = REFUSAL_CASES[rule]
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve_stages(from_dict(Config, normalize(merged(overrides))))
    resolve_stages(from_dict(Config, normalize(MINIMAL)))  # and the default value is accepted


@pytest.mark.parametrize("changed", [{"buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_p": 0.9}}}}},
                                     {"buffer": {"explorer_input": {"taskset": {"rollout_args": {"top_k": 20}}}}},
                                     {"model": {"min_response_tokens": 2}}, {"model": {"repetition_penalty": 1.1}},
                                     {"explorer": {"rollout_model": {"ignore_eos": True}}}], ids=str)
def test_the_off_policy_correction_is_refused_only_where_vllm_logprobs_differ(changed):
    """vLLM's processed log-probs follow every change to the distribution: with any, rollout_is is refused on vLLM;
    on the HF engine (log-probs of the full temperature-scaled distribution), or without rollout_is, accepted."""
    def config(engine: str, rollout_is: str) -> dict:
        return merged(merge({"explorer": {"rollout_model": {"engine_type": engine}},
                             "algorithm": {"rollout_correction": {"rollout_is": rollout_is}}}, changed))

    with pytest.raises(ConfigError, match="rollout_is = 'token' is refused: vLLM's log-probs"):
        resolve_stages(from_dict(Config, normalize(config("vllm", "token"))))
    for engine, rollout_is in (("hf", "token"), ("vllm", "none")):
        if engine == "hf" and "repetition_penalty" in str(changed):
            continue  # refused on the HF engine for its own reason (REFUSAL_CASES)
        resolve_stages(from_dict(Config, normalize(config(engine, rollout_is))))


@pytest.mark.parametrize("rule", sorted(WARNING_CASES), ids="/".join)
def test_warned_values_say_what_will_not_happen(rule, caplog):
    overrides, message = WARNING_CASES[rule]
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        resolve_stages(from_dict(Config, normalize(merged(overrides))))
    assert message in caplog.text


def test_ignored_trinity_keys_are_warned_about(tmp_path, caplog):
    text = yaml.safe_dump(merged({"trainer": {"save_hf_checkpoint": "never", "fix_actor_microbatch_loss_scale": True},
                                  "algorithm": {"optimizer": {"clip_grad": 0.5}}}))
    (tmp_path / "c.yaml").write_text(text)
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        (cfg,) = resolve_stages(cli(["--config", str(tmp_path / "c.yaml")])[0])
    assert "trainer.save_hf_checkpoint is ignored: nanorft's checkpoints hold their weights" in caplog.text
    assert "trainer.fix_actor_microbatch_loss_scale is ignored" in caplog.text
    assert cfg.trainer.grad_clip == 0.5  # Trinity's optimizer.clip_grad is the trainer's clip
    clash = merged({"trainer": {"grad_clip": 2.0}, "algorithm": {"optimizer": {"clip_grad": 0.5}}})
    with pytest.raises(ConfigError, match="trainer.grad_clip is set twice"):
        normalize(clash)


@pytest.mark.parametrize("path, value, allowed", [
    ("algorithm.repeat_times", 0, ">= 1"), ("buffer.total_epochs", 0, ">= 1"),
    ("explorer.rollout_model.engine_num", 0, ">= 1"), ("cluster.gpu_per_node", -1, ">= 0"),
    ("model.top_p", 0.0, "in (0, 1]"), ("model.top_p", 1.5, "in (0, 1]"), ("model.temperature", -0.1, ">= 0"),
    ("synchronizer.sync_interval", 0, ">= 1"), ("algorithm.optimizer.lr", 0.0, "> 0"),
    ("algorithm.optimizer.lr", float("nan"), "> 0"), ("trainer.critic.lr", -1e-5, "> 0"),
    ("buffer.explorer_input.taskset.rollout_args.top_p", 0.0, "in (0, 1]"),
    ("algorithm.optimizer.betas", [0.9], "two numbers in [0, 1)"), ("trainer.ppo_epochs", 0, ">= 1"),
    ("explorer.rollout_model.dtype", "fp8", "one of auto"), ("cluster.master_port", 0, "1..65535"),
    ("synchronizer.sync_host", "", "a host name or IP address"),
])
def test_values_out_of_range_name_the_key_and_the_range(path, value, allowed):
    node = raw = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    for k in parents:
        node = node.setdefault(k, {})
    node[last] = value
    with pytest.raises(ConfigError) as e:
        resolve_stages(from_dict(Config, normalize(raw)))
    assert path in str(e.value) and allowed in str(e.value)


MUTATIONS = [None, -1, 0, 0.5, 7, 10**9, -1e-3, "x", "", True, [], {}, [1], {"x": 1}, float("inf")]


def leaves(d, prefix=""):
    for k, v in d.items():
        yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [(f"{prefix}{k}", v)]


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
def test_mutating_any_key_of_a_config_is_refused_by_name_or_accepted(path, monkeypatch):
    """Every leaf of the YAML, set to each of MUTATIONS or deleted: either a ConfigError that names the key (its
    last part at least, or a key it conflicts with) or a config that resolves. Never another exception."""
    monkeypatch.setenv("HOME", "/home/user")
    raw = yaml.safe_load(path.read_text())
    crashes, unnamed = [], []
    for leaf, _ in leaves(raw):
        for value in MUTATIONS + [KeyError]:
            try:
                resolve_stages(from_dict(Config, normalize(mutate(raw, leaf, value))))
            except ConfigError as e:
                if leaf.split(".")[-1] not in str(e) and not _names_a_related_key(str(e)):
                    unnamed.append(f"{leaf}={value!r}: {e}")
            except Exception as e:  # noqa: BLE001 - this is what the test looks for
                crashes.append(f"{leaf}={value!r}: {type(e).__name__}: {e}")
    assert not crashes, crashes[:10]
    assert not unnamed, unnamed[:10]


def _names_a_related_key(message: str) -> bool:
    """A refusal may name the key it conflicts with or depends on instead (e.g. deleting model_path: 'model.model_path
    is required'); it still names a key path."""
    return any(part in message for part in ("model.", "buffer.", "algorithm.", "trainer.", "explorer.", "cluster.",
                                            "synchronizer.", "stages[", "mode "))
