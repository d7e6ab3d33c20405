"""What a derived config may hold: the allowed range of every number, and the keys this build refuses or warns about.

    check_ranges(cfg)     # before and after derive(): every field in ranges() inside its range, or ConfigError
    check_support(cfg)    # after derive(): REFUSED values -> ConfigError, WARNED values -> a warning at start

Every message names the key's path as the YAML spells it (`buffer.explorer_input.eval_tasksets[0].rollout_args.top_p`)
and says why. The tables are keyed by (schema class, field), so a range written once holds for every place the class
appears (each taskset, each auxiliary model); a rule may instead name one place (`explorer.auxiliary_models[]`), where
the same class means something else elsewhere. A key refused only for some values is refused only for those.
tests/test_config_keys.py walks the schema: every field, at every place, is read by the code there
(tests/schema_reads.py) or named here.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import algos
from algos.overlong import Config as OverlongRewardConfig
from configs import data_selector
from configs.schema import (
    AlgorithmConfig,
    BufferConfig,
    ClusterConfig,
    Config,
    CriticConfig,
    ExperienceBufferConfig,
    ExplorerConfig,
    ExternalModelConfig,
    GenerationConfig,
    InferenceModelConfig,
    LoRAConfig,
    ModelConfig,
    MonitorConfig,
    OptimizerConfig,
    RolloutCorrectionConfig,
    SynchronizerConfig,
    TasksetConfig,
    TrainerConfig,
)
from dbconn import shown
from errors import ConfigError

log = logging.getLogger("nanorft.config")


# The keys whose values are hidden wherever they are (a workflow's args, monitor_args, a stage's overrides): names of
# passwords, keys, tokens, credentials and cookies. NOTE: not `*_key` (format.prompt_key names a column);
# `max_tokens` ends in tokens, not token.
SECRET = re.compile(
    r"(password|passwd|passphrase|pwd|(^|_)pass|secret|api_?keys?|access_?keys?|private_?key|token|"
    r"credentials?|cookies?|(^|_)pat|(^|_)auth)$",
    re.IGNORECASE,
)
# Mappings whose every value is hidden, whatever its key: a process's environment (explorer.env_vars, also in a
# stage's overrides) is as likely to hold a secret as not, under names no pattern foresees (AZURE_OPENAI_KEY,
# DB_PASS, GITHUB_PAT, ..._COOKIE).
ALL_HIDDEN = frozenset({"env_vars"})
# The monitor_args keys whose values are shown (a URL with its password hidden); every other value of monitor_args is
# hidden. What monitor.py reads (base_url, uri, username; api_key and password are hidden) and the harmless names of
# wandb's / mlflow's own options a Trinity-RFT config may carry (warned about as unread: MONITOR_ARGS).
SHOWN_MONITOR_ARGS = frozenset(
    {
        "base_url",
        "uri",
        "tracking_uri",
        "username",
        "entity",
        "project",
        "group",
        "name",
        "tags",
        "mode",
        "dir",
        "job_type",
        "notes",
    }
)


def _hidden(parts: list[str]) -> bool:
    """Whether the value at config path `parts` (keys from the top) is a secret: under env_vars, under monitor_args
    but for SHOWN_MONITOR_ARGS, or at a key named like a secret (SECRET)."""
    for i, part in enumerate(parts[:-1]):
        if part in ALL_HIDDEN or (part == "monitor_args" and parts[i + 1] not in SHOWN_MONITOR_ARGS):
            return True
    return bool(parts) and isinstance(parts[-1], str) and bool(SECRET.search(parts[-1]))


def redacted(value: Any, parent: str = "") -> Any:
    """A config (or any part of one: `parent` is the key holding it) as plain data, with its secrets replaced by ***
    for the copies that leave the process (--dry-run's output, the wandb and mlflow runs' config, the messages of
    ConfigError and of warnings): every value of explorer.env_vars, every value of monitor_args but its
    SHOWN_MONITOR_ARGS, the value of a key named like a secret elsewhere (SECRET: a workflow's api_key), and a
    password in a URL, however spelt (dbconn.shown: the host stays)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: "***" if _hidden([parent, k]) and v not in (None, "") else redacted(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redacted(v) for v in value) if type(value) in (list, tuple) else value
    return shown(value) if isinstance(value, str) and "://" in value else value


def shown_value(path: str, value: Any) -> str:
    """The value at config path `path` as a message shows it (repr), secrets hidden (`redacted`): *** for the whole
    value when it is a secret itself (`monitor.monitor_args.password`, `explorer.env_vars.DB_PASS`)."""
    parts = [p.rstrip("]") for p in re.split(r"[.\[]", path)]
    whole = parts[-1] in ALL_HIDDEN | {"monitor_args"} and not isinstance(value, dict)  # `env_vars: "TOKEN=x"`
    return repr("***" if (whole or _hidden(parts)) and value not in (None, "") else redacted(value, parts[-1]))


def _num(ok: Callable[[float], bool], text: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, (int, float)) and math.isfinite(v) and ok(v)), text


POSITIVE, NON_NEGATIVE, AT_LEAST_1 = (
    _num(lambda v: v > 0, "> 0"),
    _num(lambda v: v >= 0, ">= 0"),
    _num(lambda v: v >= 1, ">= 1"),
)
FRACTION, PROBABILITY = _num(lambda v: 0 <= v <= 1, "in [0, 1]"), _num(lambda v: 0 < v <= 1, "in (0, 1]")
TOP_K = _num(lambda v: v >= -1, ">= -1 (-1 or 0 = off)")
HOST = (lambda v: isinstance(v, str) and v != "" and not any(ch.isspace() for ch in v), "a host name or IP address")
# Every int of a config (a count, size, token length, step, seed) is below 2**31 in magnitude, whatever its own range:
# no machine holds 2**31 of anything a config counts, and the engines, torch and the DB take it as int32 / int64
# (check_ranges). Waits end within MAX_SECONDS (~32 years: longer is "forever"; Python's thread waits and timedelta
# fail past ~9.2e9 s).
INT_LIMIT, MAX_SECONDS = 2**31, 1e9
SECONDS = _num(lambda v: 0 < v <= MAX_SECONDS, f"> 0 and <= {MAX_SECONDS:g} (seconds)")
# NOTE: 0 samples greedily (both engines; the trainer then scores at 1.0: sampling.scored_temperature). Below
# MIN_TEMPERATURE, vLLM samples at 0.01 whatever is asked (its _MAX_TEMP: logits / temperature overflow below it)
# while the trainer would score at the asked temperature, and the HF engine's and the trainer's logits / 1e-40 are
# inf and NaN: every step warned about, nothing trained.
MIN_TEMPERATURE = 0.01
TEMPERATURE = _num(lambda v: v == 0 or v >= MIN_TEMPERATURE, f"0 (greedy) or >= {MIN_TEMPERATURE:g}")
# A dtype's other spellings -> its torch name (configs.resolve writes the torch name for the processes and vLLM).
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
DTYPES = ("auto", *dict.fromkeys(name for alias, torch_name in DTYPE_NAMES.items() for name in (torch_name, alias)))


# (class, field) -> (predicate, allowed range) of the schema's sections; None (an unset optional) is always allowed.
# ranges() adds the rest.
RANGES: dict[tuple[type, str], tuple[Callable[[Any], bool], str]] = {
    (OptimizerConfig, "lr"): POSITIVE,
    (OptimizerConfig, "lr_warmup_steps"): _num(lambda v: v >= -1, ">= -1 (-1 = use lr_warmup_steps_ratio)"),
    (OptimizerConfig, "lr_warmup_steps_ratio"): FRACTION,
    (OptimizerConfig, "min_lr_ratio"): FRACTION,
    (OptimizerConfig, "betas"): (
        lambda v: len(v) == 2 and all(_num(lambda b: 0 <= b < 1, "")[0](b) for b in v),
        "two numbers in [0, 1)",
    ),
    (OptimizerConfig, "weight_decay"): NON_NEGATIVE,
    (AlgorithmConfig, "repeat_times"): AT_LEAST_1,
    (OverlongRewardConfig, "buffer_len"): NON_NEGATIVE,
    (OverlongRewardConfig, "penalty_factor"): NON_NEGATIVE,
    (ModelConfig, "max_model_len"): _num(lambda v: v >= 2, ">= 2"),
    (ModelConfig, "max_prompt_tokens"): AT_LEAST_1,
    (ModelConfig, "max_response_tokens"): AT_LEAST_1,
    (ModelConfig, "min_response_tokens"): NON_NEGATIVE,
    (ModelConfig, "temperature"): TEMPERATURE,
    (ModelConfig, "top_p"): PROBABILITY,
    (ModelConfig, "top_k"): TOP_K,
    (ModelConfig, "logprobs"): NON_NEGATIVE,
    (ModelConfig, "repetition_penalty"): POSITIVE,
    (ModelConfig, "max_cpu_loras"): AT_LEAST_1,
    (LoRAConfig, "lora_rank"): AT_LEAST_1,
    (LoRAConfig, "lora_alpha"): POSITIVE,
    (ClusterConfig, "node_num"): AT_LEAST_1,
    (ClusterConfig, "gpu_per_node"): NON_NEGATIVE,
    (ClusterConfig, "master_addr"): HOST,
    (ClusterConfig, "master_port"): _num(lambda v: 1 <= v <= 65535, "1..65535"),
    (GenerationConfig, "temperature"): TEMPERATURE,
    (GenerationConfig, "top_p"): PROBABILITY,
    (GenerationConfig, "top_k"): TOP_K,
    (GenerationConfig, "logprobs"): NON_NEGATIVE,
    (GenerationConfig, "max_tokens"): AT_LEAST_1,
    (TasksetConfig, "repeat_times"): AT_LEAST_1,
    (ExperienceBufferConfig, "max_read_timeout"): SECONDS,
    (ExperienceBufferConfig, "reuse_cooldown_time"): _num(
        lambda v: 0 <= v <= MAX_SECONDS, f">= 0 and <= {MAX_SECONDS:g} (seconds)"
    ),
    (ExperienceBufferConfig, "priority_decay"): NON_NEGATIVE,
    (BufferConfig, "batch_size"): AT_LEAST_1,
    (BufferConfig, "train_batch_size"): NON_NEGATIVE,
    (BufferConfig, "total_epochs"): AT_LEAST_1,
    (BufferConfig, "total_steps"): AT_LEAST_1,
    (InferenceModelConfig, "engine_num"): AT_LEAST_1,
    (InferenceModelConfig, "tensor_parallel_size"): AT_LEAST_1,
    (InferenceModelConfig, "gpu_memory_utilization"): PROBABILITY,
    (InferenceModelConfig, "max_model_len"): _num(lambda v: v >= 2, ">= 2"),
    (InferenceModelConfig, "openai_api_port"): _num(lambda v: 0 <= v <= 65535, "0..65535 (0: a free port)"),
    (InferenceModelConfig, "dtype"): (lambda v: v in DTYPES, f"one of {', '.join(DTYPES)}"),
    (ExternalModelConfig, "timeout"): SECONDS,
    (ExternalModelConfig, "max_retries"): NON_NEGATIVE,
    (ExplorerConfig, "runner_per_model"): AT_LEAST_1,
    (ExplorerConfig, "max_timeout"): SECONDS,
    (ExplorerConfig, "max_retry_times"): NON_NEGATIVE,
    (ExplorerConfig, "max_refill_rounds"): NON_NEGATIVE,
    (ExplorerConfig, "eval_interval"): AT_LEAST_1,
    (SynchronizerConfig, "sync_interval"): AT_LEAST_1,
    (SynchronizerConfig, "sync_offset"): NON_NEGATIVE,
    (SynchronizerConfig, "sync_timeout"): SECONDS,
    (SynchronizerConfig, "sync_host"): HOST,
    (CriticConfig, "lr"): POSITIVE,
    (CriticConfig, "lr_warmup_steps_ratio"): FRACTION,
    (CriticConfig, "weight_decay"): NON_NEGATIVE,
    (CriticConfig, "cliprange_value"): POSITIVE,
    (CriticConfig, "grad_clip"): POSITIVE,
    (CriticConfig, "micro_batch_size_per_gpu"): AT_LEAST_1,
    (TrainerConfig, "save_interval"): NON_NEGATIVE,
    (TrainerConfig, "max_checkpoints_to_keep"): AT_LEAST_1,
    (TrainerConfig, "total_steps"): AT_LEAST_1,
    (TrainerConfig, "grad_clip"): POSITIVE,
    (TrainerConfig, "max_token_len_per_gpu"): AT_LEAST_1,
    (TrainerConfig, "micro_batch_size_per_gpu"): AT_LEAST_1,
    (TrainerConfig, "log_prob_micro_batch_size_per_gpu"): AT_LEAST_1,
    (TrainerConfig, "ppo_epochs"): AT_LEAST_1,
    (TrainerConfig, "ppo_mini_batch_size"): NON_NEGATIVE,
    (TrainerConfig, "critic_warmup"): NON_NEGATIVE,
    (RolloutCorrectionConfig, "rollout_is_threshold"): _num(lambda v: v > 1, "> 1 (importance weights are cut at it)"),
    (RolloutCorrectionConfig, "rollout_rs_threshold"): POSITIVE,
    (RolloutCorrectionConfig, "rollout_rs_threshold_lower"): NON_NEGATIVE,
}
# The same for the algos/ pieces' *_args (checked by configs.piece_config), by their Config's name inside algos/: their
# modules import torch, which loading a config does without (ranges() finds the classes when a config is checked).
PIECE_RANGES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("gae.Config", "gamma"): FRACTION,
    ("gae.Config", "lam"): FRACTION,
    ("reinforceplusplus.Config", "gamma"): FRACTION,
    ("grpo.Config", "epsilon"): POSITIVE,
    ("grpo.Config", "std_threshold"): NON_NEGATIVE,
    ("opmd.AdvantageConfig", "tau"): POSITIVE,
    ("opmd.LossConfig", "tau"): POSITIVE,
    ("rec.AdvantageConfig", "epsilon"): POSITIVE,
    ("rec.LossConfig", "temp"): POSITIVE,
    ("ppo_loss.Config", "clip_range"): POSITIVE,
    ("ppo_loss.Config", "clip_range_low"): NON_NEGATIVE,
    ("ppo_loss.Config", "clip_range_high"): NON_NEGATIVE,
    ("ppo_loss.Config", "clip_ratio_c"): _num(lambda v: v > 1, "> 1"),
    ("mix.Config", "clip_range"): POSITIVE,
    ("mix.Config", "clip_range_low"): NON_NEGATIVE,
    ("mix.Config", "clip_range_high"): NON_NEGATIVE,
    ("mix.Config", "clip_ratio_c"): _num(lambda v: v > 1, "> 1"),
    ("mix.Config", "mu"): FRACTION,
    ("cispo.Config", "clip_range_low"): NON_NEGATIVE,
    ("cispo.Config", "clip_range_high"): NON_NEGATIVE,
    ("sapo.Config", "tau_pos"): POSITIVE,
    ("sapo.Config", "tau_neg"): POSITIVE,
    ("sppo.Config", "epsilon"): POSITIVE,
    ("dpo.Config", "beta"): POSITIVE,
    ("dpo.Config", "label_smoothing"): _num(lambda v: 0 <= v < 0.5, "in [0, 0.5)"),
    ("sft_loss.PhiConfig", "cutoff_prob"): PROBABILITY,
    ("kl.Config", "kl_coef"): NON_NEGATIVE,
    ("kl.Config", "target_kl"): POSITIVE,
    ("kl.Config", "horizon"): AT_LEAST_1,
    ("sample.Config", "max_staleness"): NON_NEGATIVE,
    ("sample.Config", "refill_rounds"): NON_NEGATIVE,
    ("sample.Config", "max_num_gen_batches"): _num(
        lambda v: v >= 1, ">= 1 (veRL's 0, no cap, is not offered: over-sampling could run forever)"
    ),
    ("sample.Config", "expert_data_ratio"): FRACTION,
    ("asymre.Config", "baseline_shift"): _num(lambda v: True, "finite"),
    ("on_policy_distill.Config", "kl_coef"): NON_NEGATIVE,
    ("jsd.Config", "kl_coef"): NON_NEGATIVE,
    ("jsd.Config", "lambda_coef"): FRACTION,
    ("jsd.Config", "temperature"): POSITIVE,
    ("mix_chord.Config", "mu_warmup_steps"): NON_NEGATIVE,
    ("mix_chord.Config", "mu_decay_steps"): NON_NEGATIVE,
    ("mix_chord.Config", "mu_peak"): FRACTION,
    ("mix_chord.Config", "mu_valley"): FRACTION,
    ("mix_chord.Config", "clip_range"): POSITIVE,
    ("mix_chord.Config", "clip_range_low"): NON_NEGATIVE,
    ("mix_chord.Config", "clip_range_high"): NON_NEGATIVE,
    ("mix_chord.Config", "clip_ratio_c"): _num(lambda v: v > 1, "> 1"),
}


@functools.cache
def ranges() -> dict[tuple[type, str], tuple[Callable[[Any], bool], str]]:
    """(class, field) -> (predicate, allowed range), what check_ranges reads: RANGES, the rejection mask's names and
    PIECE_RANGES with their classes, built on first use (algos/: the piece modules load then)."""
    rollout_rs = (
        lambda v: v == "none" or v in algos.ROLLOUT_RS_FNS,
        f"one of none, {', '.join(algos.ROLLOUT_RS_FNS)} (algos.ROLLOUT_RS_FNS)",
    )
    pieces = {(_piece_class(name), key): rule for (name, key), rule in PIECE_RANGES.items()}
    return {**RANGES, (RolloutCorrectionConfig, "rollout_rs"): rollout_rs, **pieces}


def _piece_class(name: str) -> type:
    """`gae.Config` -> algos.gae.Config."""
    module, cls = name.split(".")
    return getattr(getattr(algos, module), cls)


# (where, field, applies(value, cfg, section), why): `where` is a schema class (the rule holds wherever the class
# appears) or a section's path as `walk` spells it in its pattern (`explorer.auxiliary_models[]`: any auxiliary model,
# `buffer.trainer_input.auxiliary_buffers.*`: any auxiliary buffer); `section` is the dataclass holding the field.
Rule = tuple[type | str, str, Callable[[Any, Config, Any], bool], str]

# Values this build cannot honour: a ConfigError naming the key and why.
REFUSED: list[Rule] = [
    (
        "buffer.explorer_input.eval_tasksets[].data_selector",
        "selector_type",
        lambda v, c, s: v == "difficulty_based",
        "an eval taskset runs each of its tasks once, in file order, and gives no feedback: an online selector has "
        "nothing to choose; use it on a training taskset (buffer.explorer_input.tasksets)",
    ),
    (
        ModelConfig,
        "logprobs",
        lambda v, c, s: v > 0,
        "top-k log-probs are not returned by nanorft's engines (each sampled token's log-prob always is), and no loss "
        "reads them; set 0",
    ),
    (
        GenerationConfig,
        "logprobs",
        lambda v, c, s: v > 0,
        "top-k log-probs are not returned by nanorft's engines (each sampled token's log-prob always is); set 0",
    ),
    (
        ModelConfig,
        "repetition_penalty",
        lambda v, c, s: v != 1.0 and c.explorer.rollout_model.engine_type == "hf",
        "not supported by the HF engine: a penalised sample's log-prob would not be the one the trainer computes "
        "(vLLM applies it); set 1.0",
    ),
    (
        "explorer.rollout_model",
        "enable_history",
        lambda v, c, s: v and not s.enable_openai_api,
        "it records the calls made through the explorer's OpenAI-compatible API: set enable_openai_api: true as well "
        "(multi-turn workflows on the model handle keep their own token-level history: workflows/episode.py)",
    ),
    (
        "explorer.rollout_model",
        "openai_api_host",
        lambda v, c, s: s.enable_openai_api and not s.openai_api_key and not loopback(v),
        "the API would answer anyone who can reach this address: set explorer.rollout_model.openai_api_key "
        "(its callers "
        "then send it as a bearer token), or bind to 127.0.0.1",
    ),
    (
        "explorer.rollout_model",
        "model_path",
        lambda v, c, s: v not in ("", c.model.model_path),
        "the rollout model serves model.model_path (and after each sync the trainer's weights); this key names an "
        "auxiliary model's own model: set model.model_path, or leave this unset",
    ),
    (
        "explorer",
        "partial_rollout",
        lambda v, c, s: v and s.rollout_model.engine_type != "vllm_async",
        "in-flight weight updates pause a running engine with its requests kept, which only vLLM's async engine "
        "does: set explorer.rollout_model.engine_type: vllm_async, or partial_rollout: false",
    ),
    (
        "explorer",
        "partial_rollout",
        lambda v, c, s: v and c.cluster.colocate,
        "with cluster.colocate the engine sleeps while the trainer uses the shared GPU, so it cannot generate while "
        "the explorer waits for weights: set partial_rollout: false, or give the explorer GPUs of its own",
    ),
    (
        "explorer.rollout_model",
        "engine_type",
        lambda v, c, s: v == "external",
        "the rollout model must return token ids and their log-probs and take the trainer's weights; an "
        "OpenAI-compatible endpoint returns text: it can be an auxiliary model (explorer.auxiliary_models[], e.g. a "
        "judge)",
    ),
    *[
        (
            "explorer.rollout_model.external_model_config",
            f.name,
            lambda v, c, s, f=f: v != f.default,
            "the rollout model cannot be an external endpoint (an auxiliary model can)",
        )
        for f in dataclasses.fields(ExternalModelConfig)
    ],
    *[
        (
            "explorer.auxiliary_models[]",
            key,
            applies,
            "only the rollout model is served as an OpenAI-compatible API "
            "(explorer.rollout_model's enable_openai_api / enable_history / openai_api_host / _port / _key); "
            "a workflow "
            "calls an auxiliary model through its handle (self.auxiliary_models[name])",
        )
        for key, applies in (
            ("enable_openai_api", lambda v, c, s: v),
            ("enable_history", lambda v, c, s: v),
            ("openai_api_host", lambda v, c, s: v != "127.0.0.1"),
            ("openai_api_port", lambda v, c, s: v != 0),
            ("openai_api_key", lambda v, c, s: v is not None),
        )
    ],
    *[
        (
            f"buffer.explorer_input.{sets}[].format",
            "enable_concatenated_multi_turn",
            lambda v, c, s: v,
            "an option of SFT data (buffer.trainer_input.experience_buffer.format); a taskset's rows are prompts that "
            "workflows answer",
        )
        for sets in ("tasksets", "eval_tasksets")
    ],
    *[
        (
            f"buffer.trainer_input.{buf}.format",
            key,
            lambda v, c, s: v is not None,
            "an option of tasksets (buffer.explorer_input); the rows of a trainer's data file (SFT / DPO) "
            "run no workflow "
            "or reward function and are trained on as written",
        )
        for buf in ("experience_buffer", "auxiliary_buffers.*")
        for key in ("workflow_key", "reward_fn_key", "reply_prefix")
    ],
    (
        "buffer.trainer_input.auxiliary_buffers.*",
        "storage_type",
        lambda v, c, s: v != "file",
        "an auxiliary buffer is read as a data file (e.g. the expert SFT rows of mix): set storage_type: file",
    ),
    (
        ExperienceBufferConfig,
        "reuse_cooldown_time",
        lambda v, c, s: v is not None and not s.use_priority_queue and s.storage_type != "file",
        "experiences are reused only by the priority queue (FIFO order claims each once): set use_priority_queue: true",
    ),
    (
        TrainerConfig,
        "ulysses_sequence_parallel_size",
        lambda v, c, s: v < 1,
        "it is the number of ranks each packed sequence is split over: 1 (no split) or more",
    ),
    (
        ModelConfig,
        "trust_remote_code",
        lambda v, c, s: v,
        "nanorft loads only models whose modelling code ships with transformers (its FSDP wrapping and attention "
        "functions are written for those); no code from the model folder is run",
    ),
    (
        RolloutCorrectionConfig,
        "rollout_is",
        lambda v, c, s: v != "none" and filtered_vllm_rollouts(c),
        "vLLM's log-probs (logprobs_mode processed_logprobs) are taken after top-k / top-p filtering and the "
        "repetition penalty, the trainer's over the full distribution (only min_tokens' EOS masking is matched: the "
        "trainer masks the same positions): the importance weights would compare different things. Set top_p 1.0 and "
        "top_k -1 in the training tasksets' rollout_args (or model) and model.repetition_penalty 1.0, use the HF "
        "engine, or set rollout_is: none and rollout_rs: none",
    ),
    (
        RolloutCorrectionConfig,
        "rollout_rs",
        lambda v, c, s: v != "none" and filtered_vllm_rollouts(c),
        "vLLM's log-probs (logprobs_mode processed_logprobs) are taken after top-k / top-p filtering and the "
        "repetition penalty, the trainer's over the full distribution: the ratios the mask reads would compare "
        "different things. Set top_p 1.0 and top_k -1 in the training tasksets' rollout_args (or model) and "
        "model.repetition_penalty 1.0, use the HF engine, or set rollout_rs: none",
    ),
    *[
        (
            RolloutCorrectionConfig,
            key,
            lambda v, c, s: v is not None and s.rollout_rs == "none",
            "it is a bound of the rejection mask, and rollout_rs is none: name a mask (rollout_rs) or unset it",
        )
        for key in ("rollout_rs_threshold", "rollout_rs_threshold_lower")
    ],
    (
        RolloutCorrectionConfig,
        "rollout_rs",
        lambda v, c, s: v in algos.ROLLOUT_RS_FNS and not rs_band_ok(s),
        "its band of kept ratios is empty: rollout_rs_threshold_lower must be below rollout_rs_threshold (each unset "
        "one is the mask's default: configs/schema.py RolloutCorrectionConfig)",
    ),
    (
        SynchronizerConfig,
        "sync_host",
        lambda v, c, s: loopback(v) and c.synchronizer.sync_method == "nccl" and explorer_apart(c),
        "the explorer (node 0) cannot reach a store on trainer rank 0's loopback (node 1, cluster.master_addr): set an "
        "address of that node the explorer reaches (e.g. the same as cluster.master_addr), or sync_method checkpoint",
    ),
    (
        ExperienceBufferConfig,
        "path",
        lambda v, c, s: explorer_apart(c) and sqlite_db(v, c),
        "an SQLite DB serves the processes of one host only (its WAL needs shared memory, network filesystems break "
        "its locks), and here the explorer has node 0 while trainer rank 0, which reads the DB, runs on node 1: use a "
        "PostgreSQL URL (postgresql://user@host/db), or run mode train over the nodes with explorers on trainer rank "
        "0's host",
    ),
    (
        TrainerConfig,
        "optimizer_offload",
        lambda v, c, s: v and not c.trainer.param_offload,
        "FSDP2 keeps the optimizer state wherever the parameters are (its CPU offload moves both): "
        "set trainer.param_offload: true as well",
    ),
    (
        CriticConfig,
        "optimizer_offload",
        lambda v, c, s: v and not c.trainer.critic.param_offload,
        "FSDP2 keeps the optimizer state wherever the parameters are (its CPU offload moves both): "
        "set trainer.critic.param_offload: true as well",
    ),
    (
        AlgorithmConfig,
        "advantage_fn",
        lambda v, c, s: needs_teacher(v) and c.mode in ("both", "explore") and not c.explorer.auxiliary_models,
        "its teacher log-probs come from a teacher scoring the student's tokens in the explorer: set the teacher in "
        "explorer.auxiliary_models and buffer.default_workflow_type: on_policy_distill_workflow (workflows/distill.py)",
    ),
    (ModelConfig, "lora_configs", lambda v, c, s: len(v) > 1, "one LoRA adapter at most (as in Trinity-RFT)"),
    (
        MonitorConfig,
        "monitor_type",
        lambda v, c, s: ("none" in v and len(v) > 1) or len(set(v)) < len(v),
        "each sink once, or none alone (none = no sink)",
    ),
    (
        LoRAConfig,
        "path",
        lambda v, c, s: v and not Path(v, "adapter_config.json").is_file(),
        "not a saved peft adapter (a folder with adapter_config.json and adapter_model.safetensors)",
    ),
]


def needs_teacher(advantage_fn: str) -> bool:
    """Whether the advantage fn reads teacher log-probs (its Config NEEDS them: on_policy_distill, jsd)."""
    return advantage_fn in algos.ADVANTAGE_FNS and "teacher_logprobs" in getattr(
        algos.ADVANTAGE_FNS[advantage_fn][1], "NEEDS", ()
    )


def loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.x.x.x, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def explorer_apart(c: Config) -> bool:
    """Whether the explorer and trainer rank 0 run on different hosts: mode both over several nodes (node 0 is the
    explorer's, the trainer starts at node 1; on the CPU as on GPUs), unless every "node" is this machine (a loopback
    master_addr)."""
    cl = c.cluster
    return c.mode == "both" and cl.trainer_node_num < cl.node_num and not loopback(cl.master_addr)


def sqlite_db(url: str, c: Config) -> bool:
    """Whether `url` is the trainer's experience DB and an SQLite file (not a file taskset, not PostgreSQL)."""
    eb = c.buffer.trainer_input.experience_buffer
    return url == eb.path and eb.storage_type != "file" and (url.startswith("sqlite:") or "://" not in url)


def rs_band_ok(rc: RolloutCorrectionConfig) -> bool:
    """Whether the rejection mask's band [lower, upper] (the set bounds, the mask's defaults else) is not empty."""
    band = algos.ROLLOUT_RS_FNS[rc.rollout_rs][1]()
    lower = band.lower if rc.rollout_rs_threshold_lower is None else rc.rollout_rs_threshold_lower
    upper = band.upper if rc.rollout_rs_threshold is None else rc.rollout_rs_threshold
    return lower < upper


def filtered_vllm_rollouts(c: Config) -> bool:
    """Whether a vLLM engine samples the training tasksets from a distribution the trainer does not score (top-k,
    top-p, a repetition penalty): vLLM's processed log-probs are taken after them. min_tokens / ignore_eos masking
    EOS is not one: the trainer masks EOS at the same positions (batching.eos_masked, scoring.head_logprobs)."""
    rm = c.explorer.rollout_model
    return rm.engine_type != "hf" and (
        c.model.repetition_penalty != 1.0
        or any(
            (ts.rollout_args.top_p or 1.0) < 1.0 or (ts.rollout_args.top_k or -1) > 0
            for ts in c.buffer.explorer_input.tasksets
        )
    )


_VLLM_ONLY = "has no effect on the HF engine (it is a vLLM option)"
MONITOR_ARGS = {"wandb": {"api_key", "base_url"}, "mlflow": {"uri", "username", "password"}}  # what monitor.py reads
_MERGED = (
    "has no effect: it is vLLM's way of serving a LoRA adapter, and no engine here serves one (no model.lora_configs, "
    "or engine_type hf: the HF engine gets the adapter merged into its weights; lora.py)"
)


def _no_adapter_served(c: Config) -> bool:
    """No rollout engine serves a LoRA adapter (sync.serves_adapter, without probing the machine: engine_type auto
    may resolve to vLLM, so it counts as serving)."""
    return not c.model.lora_configs or c.explorer.rollout_model.engine_type == "hf"


# An auxiliary model's keys that mean nothing to an external endpoint, with their defaults (derive() leaves them so)
_NOT_EXTERNAL = {
    "model_path": "",
    "engine_num": 1,
    "tensor_parallel_size": 1,
    "gpu_memory_utilization": None,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": None,
    "enforce_eager": False,
    "dtype": "auto",
    "seed": 42,
    "max_model_len": None,
    "chat_template": "",
    "ignore_eos": False,
}
# Values accepted with a warning at start that says what will not happen.
WARNED: list[Rule] = [
    *[
        (
            "explorer.auxiliary_models[]",
            key,
            lambda v, c, s, default=default: s.engine_type == "external" and v != default,
            "has no effect on an external model (engine_type external): the endpoint serves and samples its own "
            "model; nanorft sends messages and reads replies",
        )
        for key, default in _NOT_EXTERNAL.items()
    ],
    (
        "explorer.auxiliary_models[]",
        "external_model_config",
        lambda v, c, s: s.engine_type != "external" and v != ExternalModelConfig(),
        "has no effect: engine_type is not external (set engine_type: external to call that endpoint)",
    ),
    (
        InferenceModelConfig,
        "engine_num",
        lambda v, c, s: v > 1 and s.engine_type == "hf",
        "the HF engine runs as one engine (several are a vLLM option); the GPU split counts one (none for an auxiliary "
        "model, which shares the explorer's device)",
    ),
    (InferenceModelConfig, "enforce_eager", lambda v, c, s: v and s.engine_type == "hf", _VLLM_ONLY),
    (InferenceModelConfig, "enable_chunked_prefill", lambda v, c, s: not v and s.engine_type == "hf", _VLLM_ONLY),
    (
        InferenceModelConfig,
        "enable_chunked_prefill",
        lambda v, c, s: v and s.engine_type in ("vllm", "vllm_async") and c.cluster.gpu_per_node == 0,
        "vLLM 0.32's CPU backend fails a seeded request that a chunked prefill splits (\"CPU Generator does not use "
        'offset"), and the engine with it: leave it unset (off without GPUs), or send no seeds',
    ),
    (
        InferenceModelConfig,
        "enable_prefix_caching",
        lambda v, c, s: not v and s.engine_type == "hf",
        "has no effect on the HF engine, which always computes a group's prompt once",
    ),
    (
        InferenceModelConfig,
        "gpu_memory_utilization",
        lambda v, c, s: v is not None and s.engine_type == "hf",
        _VLLM_ONLY,
    ),
    (
        InferenceModelConfig,
        "tensor_parallel_size",
        lambda v, c, s: v > 1 and s.engine_type == "hf",
        "the HF engine runs on one device (tensor parallelism is a vLLM option)",
    ),
    (
        "explorer",
        "partial_rollout",
        lambda v, c, s: v and (c.synchronizer.sync_style == "trainer_driven" or c.mode not in ("explore", "both")),
        "has no effect: the explorer never waits at a sync point (sync_style trainer_driven loads what is published "
        "without waiting; bench and train modes have no sync points)",
    ),
    (
        ClusterConfig,
        "node_num",
        lambda v, c, s: v > 1 and c.mode in ("explore", "bench"),
        "an explorer is one process on the node it starts on; the other nodes have nothing to run in this mode (start "
        "one explorer per node, each with its own explorer.name, against the same experience DB URL)",
    ),
    (
        ClusterConfig,
        "master_addr",
        lambda v, c, s: v != "127.0.0.1" and c.cluster.node_num == 1,
        "has no effect on one node (torchrun --standalone makes its own rendezvous)",
    ),
    (
        ClusterConfig,
        "master_addr",
        lambda v, c, s: loopback(v) and c.cluster.node_num > 1 and c.mode in ("train", "both"),
        "with cluster.node_num > 1 the other nodes would dial this address, each its own loopback (and the explorer "
        "would look for the trainer's weight store and DB on this machine): that works only when every node is this "
        "machine; set the address of the trainer's first node, one the other nodes reach",
    ),
    (
        ClusterConfig,
        "master_port",
        lambda v, c, s: v != 29500 and c.cluster.node_num == 1,
        "has no effect on one node (torchrun --standalone makes its own rendezvous)",
    ),
    (
        SynchronizerConfig,
        "sync_host",
        lambda v, c, s: v != "127.0.0.1" and c.synchronizer.sync_method != "nccl",
        "has no effect with sync_method checkpoint (the explorer reads the published files)",
    ),
    *[
        (
            "buffer.explorer_input.eval_tasksets[].data_selector",
            key,
            applies,
            "has no effect on an eval taskset: every evaluation runs each of its tasks once, in file order",
        )
        for key, applies in (
            ("selector_type", lambda v, c, s: v != "sequential"),
            ("seed", lambda v, c, s: v != 42),
            ("feature_keys", lambda v, c, s: bool(v)),
            ("kwargs", lambda v, c, s: bool(v)),
        )
    ],
    (
        ExperienceBufferConfig,
        "priority_decay",
        lambda v, c, s: v != 2.0 and not s.use_priority_queue and s.storage_type != "file",
        "has no effect without use_priority_queue: true (experiences are claimed in FIFO order)",
    ),
    # NOTE: warned, not refused: a stage of SFT on a data file inherits the global experience buffer's queue options
    *[
        (
            ExperienceBufferConfig,
            key,
            lambda v, c, s, changed=changed: s.storage_type == "file" and changed(v),
            "has no effect: an option of the experience DB's queue, "
            "and this buffer is a data file (storage_type file), "
            "read in a fixed order",
        )
        for key, changed in (
            ("use_priority_queue", bool),
            ("reuse_cooldown_time", lambda v: v is not None),
            ("priority_decay", lambda v: v != 2.0),
        )
    ],
    (
        "buffer.trainer_input.auxiliary_buffers.*",
        "max_read_timeout",
        lambda v, c, s: v != 1800.0,
        "has no effect: an auxiliary buffer is a data file, read in full at start (nothing to wait for)",
    ),
    (
        MonitorConfig,
        "monitor_args",
        lambda v, c, s: bool(set(v) - {k for kind in s.monitor_type for k in MONITOR_ARGS.get(kind, ())}),
        "only wandb's api_key / base_url and mlflow's uri / username / password are read (for the sinks that "
        "monitor_type lists); other keys have no effect",
    ),
    (LoRAConfig, "name", lambda v, c, s: v != "" and _no_adapter_served(c), _MERGED),
    (
        LoRAConfig,
        "base_model_name",
        lambda v, c, s: v != "",
        "has no effect: vLLM reads it only to list an adapter in its OpenAI server, which nanorft does not run",
    ),
    (
        LoRAConfig,
        "lora_dtype",
        lambda v, c, s: v not in ("auto", "float32", "fp32") and _no_adapter_served(c),
        "the adapter trains in fp32 (as every trained weight) and reaches the HF engine merged into the base weights, "
        "in the engine's dtype (explorer.rollout_model.dtype)",
    ),
    (ModelConfig, "fully_sharded_loras", lambda v, c, s: v and _no_adapter_served(c), _MERGED),
    (ModelConfig, "max_cpu_loras", lambda v, c, s: _no_adapter_served(c), _MERGED),
]


def walk(obj: Any, path: str = "", section: str = "") -> Iterator[tuple[str, Any, str, Any, str]]:
    """(path of the field, the dataclass holding it, field name, value, the holder's section pattern) for every field,
    depth first. The pattern is the holder's path with list indices as [] and dict keys as * (`explorer.
    auxiliary_models[]`, `buffer.trainer_input.auxiliary_buffers.*`): what REFUSED / WARNED rules name."""
    for f in dataclasses.fields(obj):
        value, where = getattr(obj, f.name), f"{path}.{f.name}" if path else f.name
        pattern = f"{section}.{f.name}" if section else f.name
        yield where, obj, f.name, value, section
        if dataclasses.is_dataclass(value):
            yield from walk(value, where, pattern)
        elif isinstance(value, (list, dict)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in list(items):
                if dataclasses.is_dataclass(item):
                    sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}"
                    yield from walk(item, sub, f"{pattern}[]" if isinstance(key, int) else f"{pattern}.*")


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Every number of ranges() inside its range (unset optionals pass), no int of 2**31 or more in magnitude, and no
    float infinite or NaN, in the config, piece config or workflow args `cfg` (whose fields' paths start with
    `prefix`); or a ConfigError naming the key and the range. A workflow's Args give their ranges in their own
    `RANGES` (field -> range; configs/ imports nothing of workflows/)."""
    for path, obj, name, value, _ in walk(cfg, prefix):
        rule = ranges().get((type(obj), name)) or getattr(obj, "RANGES", {}).get(name)
        huge = isinstance(value, int) and not isinstance(value, bool) and abs(value) >= INT_LIMIT
        if value is not None and (huge or (rule is not None and not rule[0](value))):
            allowed = rule[1] if rule else "an integer below 2**31 in magnitude"
            allowed += ", below 2**31" if rule and huge else ""
            raise ConfigError(f"{path}: {shown_value(path, value)} is out of range; allowed: {allowed}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{path}: {shown_value(path, value)} is not a finite number")
        if not dataclasses.is_dataclass(value):
            _check_literal(value, path)


def _check_literal(value: Any, path: str) -> None:
    """No value `???` (OmegaConf's mark of a mandatory value left unset: a YAML file's is refused as it is read, one
    from the command line here), nor a string with a NUL (which no file path may hold). NOTE: text with `${` is
    fine: a YAML's escaped `\\${x}` and a command line's `${x}` (taken as written) are kept as they are, and
    configs.to_yaml escapes them for the processes that read the written config back."""
    if isinstance(value, str) and value == "???":
        raise ConfigError(f"{path} is ??? (a mandatory value left unset): set it")
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(
            f"{path}: {shown_value(path, value)} holds a NUL character (no name, path or text of a config may)"
        )
    for k, v in value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ():
        if not dataclasses.is_dataclass(v):
            _check_literal(v, f"{path}.{k}" if isinstance(value, dict) else f"{path}[{k}]")


def check_folder_name(path: str, value: str, parts: int = 1) -> None:
    """A ConfigError unless `value` (the key at `path`) names `parts` folders at most, one inside the other, below
    the folder that holds it: the job's folder is <checkpoint_root_dir>/<project>[/<group>]/<name> and a process's
    files are named after explorer.name / trainer.name, so `..`, an absolute path or a separator would put them
    elsewhere. Anything else is a name (Trinity-RFT's `qwen2.5-1.5b_grpo`; a template's `<experiment_name>` left unset
    is the entry points' to refuse: check_placeholders). A stage runs as
    `<name>/<stage_name>` (configs.resolve_stages): the config written for its processes holds two."""
    pieces = value.split("/")
    if len(pieces) <= parts and not any(p in ("", ".", "..") or "\\" in p for p in pieces):
        return
    what = "one folder name" if parts == 1 else "a folder name, or <name>/<stage_name> as a stage's config holds"
    raise ConfigError(
        f"{path} = {value!r} is refused: it names a folder or file of the job's directory "
        "(<checkpoint_root_dir>/<project>[/<group>]/<name>), and .., an absolute path or a separator "
        f"would put that elsewhere; allowed: {what}: not empty, not . or .., no / or \\ (e.g. "
        "qwen2.5-1.5b_grpo)"
    )


def _matches(where: type | str, obj: Any, section: str) -> bool:
    return type(obj) is where if isinstance(where, type) else section == where


def check_support(cfg: Config) -> None:
    """REFUSED values fail; WARNED values are logged (once per process that derives the config)."""
    refused, warned = _by_field(REFUSED), _by_field(WARNED)  # NOTE: each field meets its own rules only, in order
    for path, obj, name, value, section in walk(cfg):
        for where, _, applies, why in refused.get(name, ()):
            if _matches(where, obj, section) and value is not None and applies(value, cfg, obj):
                text = (
                    f"[{len(value)} sections]"
                    if isinstance(value, list) and dataclasses.is_dataclass(value[0])
                    else shown_value(path, value)
                )
                raise ConfigError(f"{path} = {text} is refused: {why}")
        for where, _, applies, why in warned.get(name, ()):
            if _matches(where, obj, section) and value is not None and applies(value, cfg, obj):
                _warn_once(f"config: {path} = {shown_value(path, value)}: {why}")
    check_selectors(cfg)


def check_selectors(cfg: Config) -> None:
    """Each training taskset's data_selector: feature_keys and kwargs that fit its selector_type, kwargs by
    Trinity's names (configs/data_selector.check: a ConfigError naming the key)."""
    for i, ts in enumerate(cfg.buffer.explorer_input.tasksets):
        data_selector.check(ts.data_selector, f"buffer.explorer_input.tasksets[{i}].data_selector")


def _by_field(rules: list[Rule]) -> dict[str, list[Rule]]:
    out: dict[str, list[Rule]] = {}
    for rule in rules:
        out.setdefault(rule[1], []).append(rule)
    return out


_WARNED_ALREADY: set[str] = set()


def _warn_once(message: str) -> None:
    """A process derives its config more than once (validation, then each stage): say each thing once."""
    if message not in _WARNED_ALREADY:
        _WARNED_ALREADY.add(message)
        log.warning("%s", message)


# A template's placeholder (Trinity-RFT's examples: `project: <project_name>`, `checkpoint_root_dir: <your dir>`)
_PLACEHOLDER = re.compile(r"<[A-Za-z_][\w .\-]*>")
_NAME_KEYS = ("project", "group", "name", "stage_name")
_FREE_FORM = ("_args", "env_vars", "trainer_config")  # free-form mappings: what their keys mean is not ours


def check_placeholders(value: Any) -> None:
    """A ConfigError naming every key and value where a name (project, group, name, stage_name, a section's name)
    or a path (a key `path` or ending in _path / _dir) still holds a template's `<placeholder>`: it would become a
    folder (or a path nothing is at) named so. `value`: the config as plain data (dataclasses.asdict), stages'
    overrides included."""
    found = placeholders(value)
    if found:
        raise ConfigError("; ".join(found) if len(found) == 1 else "\n  " + "\n  ".join(found))


def placeholders(value: Any, path: str = "") -> list[str]:
    """check_placeholders' findings under `path`, one line each."""
    if isinstance(value, list):
        return [line for i, item in enumerate(value) for line in placeholders(item, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    found = []
    for key, item in value.items():
        where = f"{path}.{key}" if path else str(key)
        if str(key).endswith(_FREE_FORM):
            continue
        named = key in _NAME_KEYS or key == "path" or str(key).endswith(("_path", "_dir"))
        if named and isinstance(item, str) and (m := _PLACEHOLDER.search(item)):
            found.append(
                f"{where} = {item!r}: {m[0]} is a template's placeholder left unset (it would become a folder or "
                f"path named {m[0]}); set {where} to a real {'path' if key not in _NAME_KEYS else 'name'}"
            )
        found += placeholders(item, where)
    return found
