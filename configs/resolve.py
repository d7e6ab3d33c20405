"""Resolve a loaded config into what the processes run: `derive` fills in every value computed from others
(train_batch_size, max_model_len, per-taskset defaults, the experience DB's path, the GPU split over engines,
trainer and nodes), in one function, never in __post_init__; `resolve_stages` gives each stage's derived config;
`entry` is what every script does first (logging, the config, --dry-run).

    cfg, dry = configs.cli(sys.argv[1:])      # configs/loader.py: YAML, normalize, from_dict, the command line
    stages = resolve_stages(cfg)              # [derived Config] (one per stage, or just one)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import json
import logging
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

import algos
from algos import PRESETS, Preset
from configs.checks import (
    DTYPE_NAMES,
    ConfigError,
    _warn_once,
    check_folder_name,
    check_placeholders,
    check_ranges,
    check_support,
    redacted,
)
from configs.hub import fetch_hub
from configs.loader import cli, from_dict, normalize, piece_config
from configs.preflight import preflight
from configs.schema import (
    AlgorithmConfig,
    Config,
    ExperienceBufferConfig,
    ExplorerConfig,
    InferenceModelConfig,
    ModelConfig,
    TasksetConfig,
)

log = logging.getLogger("nanorft.config")

# --- derived values


def _engine_type(requested: str, gpus: int) -> str:
    if requested in ("vllm", "vllm_async", "hf", "external"):
        return requested
    return "vllm" if gpus > 0 and importlib.util.find_spec("vllm") is not None else "hf"


def _detect_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a broken CUDA install counts as no GPU
        return 0


def _derive_algorithm(a: AlgorithmConfig) -> Preset:
    """The preset fills the pieces the YAML leaves empty; every piece's `*_args` is checked here, before any
    process starts."""
    if a.algorithm_type not in PRESETS:
        close = difflib.get_close_matches(a.algorithm_type, PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"algorithm.algorithm_type: unknown {a.algorithm_type!r}; {hint}known: {', '.join(PRESETS)}")
    preset = PRESETS[a.algorithm_type]
    a.repeat_times = 2 if a.algorithm_type == "dpo" else (a.repeat_times or preset.repeat_times)
    pieces = ("advantage_fn", "policy_loss_fn", "kl_loss_fn", "kl_penalty_fn", "entropy_loss_fn", "sample_strategy")
    for piece in pieces:
        if not getattr(a, piece):
            setattr(a, piece, getattr(preset, piece))
    # veRL's FSDP builds AdamW (decoupled weight decay) for both names, and so does train.py
    a.optimizer.optimizer_type = {"adam": "adamw"}.get(a.optimizer.optimizer_type, a.optimizer.optimizer_type)
    if a.sample_strategy == "warmup":
        a.sample_strategy = "default"
    for piece in pieces:
        if not (piece == "advantage_fn" and a.advantage_fn == "none"):
            piece_config(piece, getattr(a, piece), getattr(a, piece + "_args"))
    mode = a.policy_loss_fn_args.get("loss_agg_mode", a.loss_agg_mode)
    if mode != a.loss_agg_mode:  # NOTE: Trinity-RFT's validator overwrites it the same way
        log.warning(
            "config: algorithm.policy_loss_fn_args.loss_agg_mode = %r is overridden by algorithm.loss_agg_mode "
            "(%r); set that instead",
            mode,
            a.loss_agg_mode,
        )
    return preset


def _derive_token_limits(m: ModelConfig) -> None:
    """max_model_len, max_prompt_tokens and max_response_tokens: any two give the third; one alone splits evenly."""
    if not m.model_path:
        raise ConfigError("model.model_path is required (set it in the YAML or pass --model.model_path)")
    if m.max_model_len is None:
        if m.max_prompt_tokens is None or m.max_response_tokens is None:
            raise ConfigError("model.max_model_len is unset: set it, or both max_prompt_tokens and max_response_tokens")
        m.max_model_len = m.max_prompt_tokens + m.max_response_tokens
    elif m.max_prompt_tokens is None and m.max_response_tokens is None:
        m.max_prompt_tokens = m.max_response_tokens = m.max_model_len // 2
    elif m.max_prompt_tokens is None:
        m.max_prompt_tokens = m.max_model_len - m.max_response_tokens
    elif m.max_response_tokens is None:
        m.max_response_tokens = m.max_model_len - m.max_prompt_tokens
    too_long = m.max_prompt_tokens + m.max_response_tokens > m.max_model_len
    if too_long or min(m.max_prompt_tokens, m.max_response_tokens) < 1:
        raise ConfigError(
            f"model: max_prompt_tokens ({m.max_prompt_tokens}) + max_response_tokens ({m.max_response_tokens}) "
            f"must be positive and fit in max_model_len ({m.max_model_len})"
        )
    if m.min_response_tokens > m.max_response_tokens:
        raise ConfigError(f"model.min_response_tokens ({m.min_response_tokens}) exceeds max_response_tokens")
    m.critic_model_path = m.critic_model_path or m.model_path
    if m.chat_template_path and not Path(m.chat_template_path).is_file():
        raise ConfigError(f"model.chat_template_path: {m.chat_template_path} is not a file")


def _derive_synchronizer(c: Config, preset: Preset) -> None:
    """Trinity's aliases, and nccl only where both sides live in one launch."""
    s = c.synchronizer
    # NOTE: Trinity's `memory` (forced when colocated): trainer rank 0 gathers the full weights into host memory and
    # the explorer loads them from there; here that is the process group (gloo through host memory on one GPU)
    s.sync_method = {"online": "nccl", "offline": "checkpoint", "memory": "nccl"}.get(s.sync_method, s.sync_method)
    s.sync_style = {"dynamic_by_trainer": "trainer_driven", "dynamic_by_explorer": "explorer_driven"}.get(
        s.sync_style, s.sync_style
    )
    if s.sync_method == "nccl" and (c.mode != "both" or preset.train_only):
        log.info("synchronizer.sync_method: nccl needs mode both with an explorer; using checkpoint")
        s.sync_method = "checkpoint"
    if s.sync_method == "nccl" and s.sync_style != "fixed":
        log.info(
            "synchronizer.sync_style %s needs sync_method checkpoint; nccl syncs at fixed points (fixed)", s.sync_style
        )
        s.sync_style = "fixed"
    if s.sync_interval < 1 or s.sync_offset < 0:
        raise ConfigError("synchronizer: sync_interval must be >= 1 and sync_offset >= 0")


def _derive_tasksets(c: Config) -> None:
    """Tasksets get names, workflows, reward functions and rollout args from the buffer's and model's defaults;
    batch sizes and total_steps follow."""
    a, b, t = c.algorithm, c.buffer, c.trainer
    inp = b.explorer_input
    moved = bool(inp.taskset.path)  # its messages name it as the YAML does
    if moved:
        inp.tasksets = [inp.taskset] + inp.tasksets
        inp.taskset = TasksetConfig()
    for kind, sets in (("taskset", inp.tasksets), ("eval_taskset", inp.eval_tasksets)):
        for i, ts in enumerate(sets):
            where = (
                "buffer.explorer_input.taskset"
                if moved and kind == "taskset" and i == 0
                else f"buffer.explorer_input.{kind}s[{i}]"
            )
            _derive_taskset(c, ts, kind, where, f"{kind}_{i}")
    names = [ts.name for ts in inp.tasksets + inp.eval_tasksets]
    if len(set(names)) != len(names):
        raise ConfigError(f"buffer.explorer_input: taskset names must be unique, got {names}")
    if c.mode in ("both", "explore") and not inp.tasksets:
        raise ConfigError(f"mode {c.mode} needs a training taskset: set buffer.explorer_input.taskset.path")
    if c.mode == "bench" and not inp.eval_tasksets:
        raise ConfigError("mode bench needs buffer.explorer_input.eval_tasksets")
    if a.repeat_times < 1 or b.batch_size < 1:
        raise ConfigError("algorithm.repeat_times and buffer.batch_size must be >= 1")
    b.train_batch_size = b.train_batch_size or b.batch_size * a.repeat_times
    if b.total_steps is None and t.total_steps is not None:
        b.total_steps = t.total_steps
    t.total_steps = b.total_steps


def _derive_taskset(c: Config, ts: TasksetConfig, kind: str, where: str, name: str) -> None:
    a, b, m = c.algorithm, c.buffer, c.model
    if not ts.path:
        raise ConfigError(f"{where}.path is required")
    ts.name = ts.name or name
    if kind == "taskset":
        if ts.repeat_times not in (None, a.repeat_times):
            log.warning("%s.repeat_times is set to algorithm.repeat_times (%d) for training", where, a.repeat_times)
        ts.repeat_times = a.repeat_times
        ts.default_workflow_type = ts.default_workflow_type or b.default_workflow_type
    else:
        ts.repeat_times = ts.repeat_times or 1
        ts.default_workflow_type = ts.default_workflow_type or b.default_eval_workflow_type or b.default_workflow_type
    ts.default_reward_fn_type = ts.default_reward_fn_type or b.default_reward_fn_type
    runs = c.mode in ("both", "explore") or (c.mode == "bench" and kind == "eval_taskset")
    if runs and not ts.default_workflow_type and not ts.format.workflow_key:
        # NOTE: a warning here (Trinity's grpo / ppo examples name no workflow and must load); explore.py refuses
        # to start with it (workflows.args.check_tasksets)
        _warn_once(
            f"config: {where}.default_workflow_type is empty, as are buffer.default_workflow_type and "
            f"{where}.format.workflow_key: no workflow runs these tasks, and an explorer refuses to start"
        )
    r = ts.rollout_args
    r.temperature = m.temperature if r.temperature is None else r.temperature
    r.top_p = m.top_p if r.top_p is None else r.top_p
    r.top_k = m.top_k if r.top_k is None else r.top_k
    r.logprobs = m.logprobs if r.logprobs is None else r.logprobs
    r.max_tokens = m.max_response_tokens if r.max_tokens is None else r.max_tokens


def _check_explorer_advantages(a: AlgorithmConfig) -> None:
    """step_wise_grpo's advantages are computed in the explorer (algos.EXPLORER_ADVANTAGE_FNS), where the trainer's
    reward shaping cannot reach them (workflows.args.check_step_wise: the tasksets that must match it)."""
    if a.advantage_fn in algos.EXPLORER_ADVANTAGE_FNS and (a.kl_penalty_fn != "none" or a.overlong_reward.enable):
        raise ConfigError(
            f"algorithm.advantage_fn {a.advantage_fn} is computed in the explorer from the rewards, "
            "where the trainer's reward shaping cannot reach it: algorithm.kl_penalty_fn must be none "
            "and algorithm.overlong_reward.enable false (a KL loss, kl_loss_fn, is fine)"
        )


def gen_batches(a: AlgorithmConfig) -> int:
    """The most batches of tasks one explore step runs: what the sample strategy asks (dynamic_sampling's
    max_num_gen_batches: algos/sample.py), else 1 (no over-sampling)."""
    fn = algos.SAMPLE_STRATEGIES[a.sample_strategy][0]
    return fn(1, piece_config("sample_strategy", a.sample_strategy, a.sample_strategy_args)).get(
        "max_num_gen_batches", 1
    )


def _check_gen_batches(c: Config) -> None:
    """Over-sampling (gen_batches > 1) makes the tasks a step takes vary: in mode both, where the explorer and the
    trainer take turns over a number of steps they must agree on, buffer.total_epochs cannot give it."""
    if gen_batches(c.algorithm) > 1 and c.mode == "both" and not c.buffer.total_steps:
        raise ConfigError(
            f"algorithm.sample_strategy {c.algorithm.sample_strategy} over-samples in the explorer (up to "
            f"max_num_gen_batches = {gen_batches(c.algorithm)} batches of tasks per step): in mode both set "
            "buffer.total_steps, since a step takes a varying number of tasks and total_epochs cannot give the "
            "number of steps (or set sample_strategy_args.max_num_gen_batches: 1, the trainer-side refill only)"
        )


def advantage_origin(a: AlgorithmConfig) -> str:
    """Where the advantages of the experiences in a DB come from, for a process of algorithm `a`: "the trainer"
    (from the rewards, when a batch is trained), or an explorer-side advantage fn with all its args (stored with
    each experience by the explorer, read back by the trainer: step_wise_grpo). The explorers and the trainer
    sharing a DB must agree (buffer.ExperienceDB.check_advantages)."""
    if a.advantage_fn not in algos.EXPLORER_ADVANTAGE_FNS:
        return "the trainer"
    args = dataclasses.asdict(piece_config("advantage_fn", a.advantage_fn, a.advantage_fn_args))
    return f"the explorer: {a.advantage_fn} {json.dumps(args, sort_keys=True)}"


def _derive_paths(c: Config, preset: Preset) -> None:
    """The job directory, and the experience DB's default location inside it: below checkpoint_root_dir, whatever
    the names (check_folder_name: a stage's name is <name>/<stage_name>)."""
    names = [
        ("project", c.project, 1),
        ("group", c.group, 1),
        ("name", c.name, 2),
        ("explorer.name", c.explorer.name, 1),
        ("trainer.name", c.trainer.name, 1),
    ]
    for path, value, parts in names:
        if value or path != "group":  # no group: no folder
            check_folder_name(path, value, parts)
    parts = [c.checkpoint_root_dir, c.project] + ([c.group] if c.group else []) + [c.name]
    c.checkpoint_job_dir = str(Path(*parts))
    inputs = c.buffer.trainer_input
    bufs: list[ExperienceBufferConfig] = [inputs.experience_buffer, *inputs.auxiliary_buffers.values()]
    wheres = ["experience_buffer", *(f"auxiliary_buffers.{k}" for k in inputs.auxiliary_buffers)]
    for eb, where in zip(bufs, wheres):
        if not eb.schema_type:  # the trainer's input follows the algorithm; auxiliary files hold expert SFT data
            eb.schema_type = "experience" if eb.storage_type != "file" else preset.schema if eb is bufs[0] else "sft"
        if not eb.path and eb.storage_type != "file":
            check_folder_name(f"buffer.trainer_input.{where}.name", eb.name)  # the DB's file: <name>.db
            eb.path = f"sqlite:///{Path(c.checkpoint_job_dir, 'buffer', eb.name + '.db')}"
        scheme = eb.path.split("://")[0] if "://" in eb.path else ""
        if eb.storage_type != "file" and scheme not in ("", "sqlite", "postgresql", "postgres"):
            raise ConfigError(
                f"buffer.trainer_input.experience_buffer.path: {scheme}:// is not an experience DB this "
                "project serves; use sqlite:///path.db or postgresql://user@host/db"
            )


def _derive_trainer_explorer(c: Config) -> None:
    """Micro-batch token budget and mini-batch size; eval on sync boundaries, as Trinity-RFT does."""
    t, e, s = c.trainer, c.explorer, c.synchronizer
    t.max_token_len_per_gpu = t.max_token_len_per_gpu or max(16384, 2 * c.model.max_model_len)
    t.ppo_mini_batch_size = t.ppo_mini_batch_size or c.buffer.train_batch_size
    t.trainer_strategy = {"fsdp": "fsdp2"}.get(t.trainer_strategy, t.trainer_strategy)  # both mean fully_shard
    rm = c.explorer.rollout_model
    rm.max_model_len = rm.max_model_len or c.model.max_model_len
    # NOTE: the rollout model always serves model.model_path (configs/checks.py refuses another): naming it here too
    # says nothing, and a later stage's model.model_path becomes the earlier stage's weights (launch.stages_in_order)
    rm.model_path = "" if rm.model_path == c.model.model_path else rm.model_path
    for i, aux in enumerate(c.explorer.auxiliary_models):
        if aux.engine_type == "external":  # an endpoint: nothing to load, nothing to size
            _check_external(aux, f"explorer.auxiliary_models[{i}]")
            continue
        aux.max_model_len = aux.max_model_len or c.model.max_model_len
        if not aux.model_path:
            raise ConfigError(
                f"explorer.auxiliary_models[{i}].model_path is empty: an auxiliary model serves its own model "
                "(or set engine_type: external and its external_model_config: an OpenAI-compatible endpoint)"
            )
    if rm.max_model_len < c.model.max_model_len:
        raise ConfigError(
            f"explorer.rollout_model.max_model_len ({rm.max_model_len}) is below model.max_model_len "
            f"({c.model.max_model_len}): the engine could not hold a full prompt + response"
        )
    if e.eval_interval % s.sync_interval:
        rounded = math.ceil(e.eval_interval / s.sync_interval) * s.sync_interval
        log.info("explorer.eval_interval %d rounded up to %d (a multiple of sync_interval)", e.eval_interval, rounded)
        e.eval_interval = rounded


def _check_external(aux: InferenceModelConfig, where: str) -> None:
    """An external auxiliary model names its endpoint: base_url (http or https) and model_name."""
    ext = aux.external_model_config
    for key in ("base_url", "model_name"):
        if not getattr(ext, key):
            raise ConfigError(f"{where}.external_model_config.{key} is empty: engine_type external needs the endpoint")
    if not ext.base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{where}.external_model_config.base_url = {ext.base_url!r}: not an http(s) URL "
            "(e.g. http://127.0.0.1:8000/v1)"
        )


VLLM_TYPES = ("vllm", "vllm_async")  # engine types that run vLLM engines on GPUs of their own
VLLM_MEMORY = 0.9  # unset gpu_memory_utilization of a vLLM engine on GPUs (Trinity's default)
# ... and without GPUs, where vLLM's CPU backend takes this share of the host's memory for its worker (weights + KV
# cache: ~0.6 GiB of it for the worker itself; 0.9 would not fit beside the trainer)
CPU_VLLM_MEMORY = 0.1


def _derive_cluster(c: Config) -> None:
    """Which GPUs go to the explorer's engines (engine_num x tensor_parallel_size for vLLM, one for the HF engine),
    which to the trainer, and on which nodes (_derive_nodes). Mode both on one GPU colocates them (Trinity's
    `colocate`): both use GPU 0."""
    cl, e = c.cluster, c.explorer
    cl.gpu_per_node = _detect_gpus() if cl.gpu_per_node is None else cl.gpu_per_node
    gpus = cl.gpu_per_node * cl.node_num
    rm = e.rollout_model
    rm.engine_type = _engine_type(rm.engine_type, gpus)
    for aux in e.auxiliary_models:  # vLLM: GPUs of its own after the rollout model's; HF: the explorer's device
        aux.engine_type = _engine_type(aux.engine_type, gpus)
    for m in (rm, *e.auxiliary_models):  # the unset vLLM options whose default depends on GPUs
        if m.engine_type in VLLM_TYPES and m.gpu_memory_utilization is None:
            m.gpu_memory_utilization = VLLM_MEMORY if gpus else CPU_VLLM_MEMORY
        if m.engine_type in VLLM_TYPES and m.enable_chunked_prefill is None:
            m.enable_chunked_prefill = bool(gpus)  # off on vLLM's CPU backend (schema.py says why)
    vllm_gpus = [
        m.engine_num * m.tensor_parallel_size if m.engine_type in VLLM_TYPES else 0 for m in e.auxiliary_models
    ]
    explorer_gpus, _ = explorer_gpu_plan(e)
    if gpus == 0 or c.mode == "train":
        explorer_gpus = 0
    cl.colocate = bool(gpus == 1 and c.mode == "both")
    if cl.colocate:
        _derive_colocation(c)
        explorer_gpus = 1
    cl.explorer_gpu_num = explorer_gpus
    cl.trainer_gpu_num = {"train": gpus, "both": 1 if cl.colocate else gpus - explorer_gpus}.get(c.mode, 0)
    engines = (
        f"explorer.rollout_model.engine_num {rm.engine_num} x tensor_parallel_size {rm.tensor_parallel_size}"
        + (f" + auxiliary models' {sum(vllm_gpus)}" if sum(vllm_gpus) else "")
        + f" = {explorer_gpus} GPUs"
    )
    if gpus and explorer_gpus > gpus:
        raise ConfigError(f"cluster: the rollout engines need {engines}, cluster.gpu_per_node gives {gpus}")
    if gpus and c.mode == "both" and cl.trainer_gpu_num < 1:
        raise ConfigError(
            f"cluster: in mode both the rollout engines take {engines} of cluster.gpu_per_node "
            f"{gpus}, leaving none for the trainer"
        )
    _derive_nodes(c, engines)


def explorer_gpu_plan(e: ExplorerConfig) -> tuple[int, list[int]]:
    """(GPUs the explorer's engines take, the explorer-local GPU each auxiliary model's engines start at): the
    rollout model's first (vLLM: engine_num x tensor_parallel_size; the HF engine: 1, the explorer's first GPU), then
    each vLLM auxiliary model's in turn; an HF auxiliary model takes none (it runs on the explorer's first device).
    _derive_cluster counts these and engines.auxiliary_handles places the engines by them: one rule for both."""
    rm = e.rollout_model
    first, starts = rm.engine_num * rm.tensor_parallel_size if rm.engine_type in VLLM_TYPES else 1, []
    for aux in e.auxiliary_models:
        starts.append(first)
        first += aux.engine_num * aux.tensor_parallel_size if aux.engine_type in VLLM_TYPES else 0
    return first, starts


def _derive_nodes(c: Config, engines: str) -> None:
    """The trainer's nodes (the last trainer_node_num of node_num) and its ranks on each. The explorer is one
    process on node 0. Over several nodes the trainer takes whole nodes (Trinity-RFT's rule): in mode both node 0 is
    the explorer's (on GPUs its engines must fill it) and the trainer starts at node 1; in mode train it has every
    node. On the CPU the same layout, one trainer rank per node: in mode both over n nodes the trainer has n - 1 ranks
    on nodes 1..n-1, so its weights (sync_method nccl: gloo) cross the link to the explorer as on GPUs."""
    cl, n, per = c.cluster, c.cluster.node_num, c.cluster.gpu_per_node
    if c.mode not in ("train", "both"):
        cl.trainer_node_num = cl.trainer_gpu_num_per_node = 0
        return
    if per == 0:
        cl.trainer_node_num, cl.trainer_gpu_num_per_node = (n - 1 if c.mode == "both" and n > 1 else n), 0
        return
    if n > 1 and cl.explorer_gpu_num > per:
        raise ConfigError(
            f"cluster: the explorer runs on node 0, and its rollout engines need {engines}, more than "
            f"cluster.gpu_per_node {per}"
        )
    if cl.trainer_gpu_num > per and cl.trainer_gpu_num % per:
        raise ConfigError(
            f"cluster: over cluster.node_num {n} nodes the trainer takes whole nodes: the rollout "
            f"engines take {engines} of node 0's cluster.gpu_per_node {per}, leaving "
            f"{cl.trainer_gpu_num} GPUs, not a multiple of {per}; give the explorer all of node 0 "
            f"(explorer.rollout_model.engine_num x tensor_parallel_size = {per}), or run mode train "
            "over the nodes and explorers (mode explore) on other hosts"
        )
    cl.trainer_node_num = max(cl.trainer_gpu_num // per, 1) if n > 1 else 1
    cl.trainer_gpu_num_per_node = cl.trainer_gpu_num // cl.trainer_node_num


COLOCATED_VLLM_MEMORY = 0.25  # Trinity's cap of gpu_memory_utilization when vLLM shares the GPU with the trainer


def _derive_colocation(c: Config) -> None:
    """Mode both on one GPU: one engine on one GPU, vLLM within COLOCATED_VLLM_MEMORY of it (and asleep while the
    trainer steps, explore.py); weights over the process group travel through host memory (gloo: NCCL cannot join
    two ranks on one GPU)."""
    rm = c.explorer.rollout_model
    if any(m.engine_type in VLLM_TYPES for m in c.explorer.auxiliary_models):
        raise ConfigError(
            "explorer.auxiliary_models: a vLLM auxiliary model needs GPUs of its own; on one GPU shared "
            "by the explorer and the trainer, give it engine_type: hf"
        )
    if rm.engine_type in VLLM_TYPES and (rm.engine_num, rm.tensor_parallel_size) != (1, 1):
        raise ConfigError(
            f"explorer.rollout_model: engine_num {rm.engine_num} x tensor_parallel_size "
            f"{rm.tensor_parallel_size} on one GPU shared with the trainer: both must be 1"
        )
    if rm.engine_type in VLLM_TYPES and rm.gpu_memory_utilization > COLOCATED_VLLM_MEMORY:
        log.info(
            "explorer.rollout_model.gpu_memory_utilization %g capped to %g: the trainer shares the GPU",
            rm.gpu_memory_utilization,
            COLOCATED_VLLM_MEMORY,
        )
        rm.gpu_memory_utilization = COLOCATED_VLLM_MEMORY


def _derive_dtypes(c: Config) -> None:
    """Engine dtypes as torch names (what train.py, models.load_model and vLLM read): bf16 -> bfloat16, fp16 / half ->
    float16, fp32 / float -> float32; auto -> bfloat16 with GPUs (cluster.gpu_per_node > 0), float32 without (the HF
    engine and the trainer on the CPU use float32 whatever the name). NOTE: not the model config's torch_dtype,
    which vLLM's own auto would read: one rule, known before any model file is opened."""
    gpus = c.cluster.gpu_per_node > 0
    for m in (c.explorer.rollout_model, *(a for a in c.explorer.auxiliary_models if a.engine_type != "external")):
        m.dtype = ("bfloat16" if gpus else "float32") if m.dtype == "auto" else DTYPE_NAMES.get(m.dtype, m.dtype)


# Fields only derive() sets -> what they are derived from. A value in the YAML or on the command line is refused
# unless it is the derived one (a resolved config, e.g. a run directory's config.yaml, holds exactly those).
DERIVED = {
    "checkpoint_job_dir": "checkpoint_root_dir, project, group and name",
    "cluster.explorer_gpu_num": "the rollout engines (engine_type, engine_num, tensor_parallel_size), mode and GPUs",
    "cluster.trainer_gpu_num": "mode, cluster.gpu_per_node x node_num and the explorer's GPUs",
    "cluster.trainer_node_num": "mode, cluster.node_num and the GPU split",
    "cluster.trainer_gpu_num_per_node": "the trainer's GPUs and nodes",
    "cluster.colocate": "mode both on one GPU",
}


def check_derived(given: Config, derived: Config) -> None:
    """A ConfigError for a DERIVED field that `given` sets to something else than derive() makes of it."""
    for path, source in DERIVED.items():
        mine, theirs = given, derived
        for k in path.split("."):
            mine, theirs = getattr(mine, k), getattr(theirs, k)
        same = Path(mine) == Path(theirs) if path == "checkpoint_job_dir" and mine else mine == theirs
        if mine not in (None, "") and not same:
            raise ConfigError(f"{path} = {mine!r} is derived from {source} (here {theirs!r}): leave it unset")


def derive(cfg: Config) -> Config:
    """Return a copy of `cfg` with every derived value filled in. Idempotent: derive(derive(c)) == derive(c).

    One section per config part, in this order (later sections read what earlier ones filled in)."""
    c = copy.deepcopy(cfg)
    check_ranges(c)  # first: later sections compute with these numbers
    preset = _derive_algorithm(c.algorithm)
    _derive_token_limits(c.model)
    _derive_synchronizer(c, preset)
    _derive_tasksets(c)
    _check_explorer_advantages(c.algorithm)
    _check_gen_batches(c)
    _derive_paths(c, preset)
    _derive_trainer_explorer(c)
    _derive_cluster(c)
    _derive_dtypes(c)
    check_derived(cfg, c)
    check_ranges(c)  # the derived values too
    check_support(c)
    return c


# --- stages and output


def _deep_merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def resolve_stages(cfg: Config) -> list[Config]:
    """The derived config of each stage: the global config with the stage's keys merged in key by key
    (a stage inherits every key it does not set), except that a stage with another algorithm_type
    gets a fresh algorithm section."""
    if not cfg.stages:
        return [derive(cfg)]
    check_folder_name("name", cfg.name)  # one folder: each stage's is <name>/<stage_name>
    base = dataclasses.asdict(cfg)
    base["stages"] = []
    out = []
    seen = set()
    for i, st in enumerate(cfg.stages):
        if not st.stage_name or st.stage_name in seen:
            raise ConfigError(f"stages[{i}].stage_name must be set and unique, got {st.stage_name!r}")
        if st.start_from and st.start_from not in seen:
            raise ConfigError(
                f"stages[{i}].start_from {st.start_from!r} is not an earlier stage's name (earlier: "
                f"{', '.join(sorted(seen)) or 'none'})"
            )
        check_folder_name(f"stages[{i}].stage_name", st.stage_name)  # the stage runs as <name>/<stage_name>
        seen.add(st.stage_name)
        sections = ("algorithm", "buffer", "explorer", "trainer", "model", "synchronizer", "data_processor")
        override: dict[str, Any] = {k: getattr(st, k) for k in sections}
        override.update(name=f"{cfg.name}/{st.stage_name}", **({"mode": st.mode} if st.mode else {}))
        stage_base = base
        if st.algorithm.get("algorithm_type", cfg.algorithm.algorithm_type) != cfg.algorithm.algorithm_type:
            # NOTE: another algorithm starts from its own defaults: the global pieces (advantage_fn,
            # kl_loss_fn, their *_args, optimizer) belong to the global algorithm, as in Trinity-RFT.
            stage_base = {**base, "algorithm": {}}
        merged = _deep_merge(stage_base, normalize(override))
        try:
            out.append(derive(from_dict(Config, merged)))
        except ConfigError as e:
            raise ConfigError(f"stages[{i}] ({st.stage_name}): {e}") from e
    return out


def to_yaml(cfg: Config) -> str:
    """The config as YAML that `read_yaml` + `from_dict` load back to an equal Config."""
    return yaml.safe_dump(escaped(dataclasses.asdict(cfg)), sort_keys=False, allow_unicode=True)


_INTERPOLATION = re.compile(r"(\\*)\$\{")  # `${` and the backslashes right before it
_MISSING = re.compile(r"\\+\?\?\?")  # OmegaConf's missing value `???`, escaped
# NOTE: OmegaConf 2.4 reads `\???` as `???` (one backslash fewer); 2.3 (our floor) as it is written
_UNESCAPES_MISSING = OmegaConf.create({"k": "\\???"}).k == "???"


def escaped(value: Any) -> Any:
    r"""Plain config data whose strings `read_yaml` (OmegaConf) reads back as they are. A resolved config may hold
    text with `${` (`${x}^2$`, written `\${x}^2$` in a YAML file; a command line's value, taken as written), which
    OmegaConf would take as an interpolation when a child process reads the written file. NOTE: OmegaConf's escapes
    act only right before `${`: `\${` is a literal `${`, and each `\\` before it one backslash; a backslash
    anywhere else is literal. So k backslashes and `${` are written as 2k backslashes and `\${`. Likewise OmegaConf
    reads a whole value `???` as missing (a config refuses it: checks._check_literal) and, from 2.4 on, `\???` as `???`
    (one backslash fewer): such a value then gets one more."""
    if isinstance(value, str):
        value = "\\" + value if _UNESCAPES_MISSING and _MISSING.fullmatch(value) else value
        return _INTERPOLATION.sub(lambda m: m[1] * 2 + "\\${", value)
    if isinstance(value, dict):
        return {k: escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escaped(v) for v in value]
    return value


def holds_secret(cfg: Config) -> bool:
    """Whether `redacted` hides anything of this config (--dry-run then says so at the top of its document)."""
    return redacted(cfg) != dataclasses.asdict(cfg)


SECRETS_NOTE = (
    "# secrets are shown as ***: every env_vars value, monitor_args' values (but its URLs, names, tags "
    "and modes), passwords, API keys and tokens (in URLs too)"
)


def dry_run(cfg: Config, out: Any = None) -> None:
    """Print every stage's resolved config as YAML documents (one per stage), with its secrets as *** (`redacted`:
    a terminal, a CI log or a pasted issue is no place for a password). NOTE: such a document then loads back with
    *** where the secrets were; a comment at its top says so. The run directory's config.yaml, which the processes
    read, keeps the real values, and only its owner may read it (launch.write_stage_config)."""
    out = out or sys.stdout
    for i, stage in enumerate(resolve_stages(cfg)):
        if i:
            out.write("---\n")
        if holds_secret(stage):
            out.write(f"{SECRETS_NOTE}\n")
        out.write(yaml.safe_dump(escaped(redacted(stage)), sort_keys=False, allow_unicode=True))
    out.flush()


CONSOLE = "NANORFT_CONSOLE"  # "launcher": the launcher draws this process's console (monitor.Console)
# marks the processes the launcher started: train.py then never re-launches, and entry skips the pre-flight (the
# launcher ran it for the whole machine; a child sees only its share of the GPUs)
LAUNCHED = "NANORFT_LAUNCHED"


def answer_help(argv: list[str], doc: str | None) -> None:
    """`-h` / `--help`: tyro's table printed and the process ended (entry), else nothing. Each entry script calls it
    first, before it imports torch and the rest (~5 s): configs/ loads without them (algos/__init__.py), so --help
    answers in well under a second. `doc`: the script's docstring, whose first paragraph heads the help."""
    if "-h" in argv or "--help" in argv:
        entry(argv, (doc or "").split("\n\n")[0])


def entry(argv: list[str], description: str) -> Config:
    """What every script does first: logging, config, and --dry-run (which exits). Exits 2 on a bad config."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        cfg, dry = cli(argv, description)
        check_placeholders(dataclasses.asdict(cfg))  # before --dry-run too: what it prints would run
        logging.getLogger().setLevel(cfg.log.level)
        if os.environ.get(CONSOLE) == "launcher":  # the launcher draws the console: INFO goes to the log file only
            for handler in logging.getLogger().handlers:
                handler.setLevel(logging.WARNING)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its loading chatter; our warnings stay
        if cfg.cluster.gpu_per_node == 0:  # 0 means no GPU: set before torch looks (children inherit it)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if dry:
            dry_run(cfg)
            raise SystemExit(0)
        stages = resolve_stages(cfg)  # every refusal here, before any process starts
        if not os.environ.get(LAUNCHED):
            preflight(stages)  # and what this machine lacks for them
            fetch_hub(stages)  # the hub ids it lacks, downloaded once, here (or: the processes run offline)
        return cfg
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
