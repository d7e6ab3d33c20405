"""The config schema: nested dataclasses that mirror Trinity-RFT's YAML sections.

Every field carries Trinity-RFT's default (its configuration guide) unless its
docstring says otherwise, and a docstring that `--help` shows. YAML files only set values; the
loader (configs/loader.py) validates them against these classes, and `derive()` (configs/resolve.py) fills in the values
that depend on others (train_batch_size, max_model_len, ...). Nothing here mutates itself.

Fields marked "Derived" are filled in by `configs.derive`; leave them unset in YAML (a value other than the derived
one is refused; a resolved config, which holds the derived values, loads back).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

import tyro
import yaml

from algos.overlong import Config as OverlongRewardConfig
from errors import ConfigError


def check_plain(value: Any, where: str, path: str = "") -> None:
    """Every key a string or a number and every value a string, number, boolean, null, list or mapping: what a
    config holds. YAML also reads dates (2024-01-01), binary data (!!binary) and sets (!!set); a ConfigError names the
    key of any of them (`where` prefixes the message, e.g. the file)."""
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if not isinstance(k, (str, int, float)):
                shown = "null (an empty key, or ~)" if k is None else f"{k!r} ({type(k).__name__})"
                raise ConfigError(f"{where}{path or 'the top level'}: a key that is {shown}; keys are names")
            check_plain(v, where, sub)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_plain(v, where, f"{path}[{i}]")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        kind = {
            "date": "a date",
            "datetime": "a date and time",
            "bytes": "binary data (!!binary)",
            "set": "a set (!!set)",
        }.get(type(value).__name__, f"a {type(value).__name__}")
        shown = value.isoformat() if hasattr(value, "isoformat") else repr(value)
        raise ConfigError(f"{where}{path}: {shown} is {kind}, not a config value; quote it if it is text")


# Bounds of one YAML document once its aliases (`*name`) are expanded: the largest example config has ~230 nodes
# (a resolved one ~1,000), nested ~8 deep. NOTE: checked on the composed node graph, before any Python object is
# built: PyYAML shares an aliased value, but check_plain, OmegaConf and the written config.yaml expand every use.
YAML_MAX_NODES = 100_000
YAML_MAX_CHARS = 16 << 20  # characters of its scalars
YAML_MAX_DEPTH = 100  # mappings / lists inside one another (the checks and the loader recurse per level)


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_expansion(root: yaml.Node | None) -> None:
    """ConfigError (the caller adds the file) when a composed YAML document is self-containing (an alias inside the
    value it names: `a: &x [*x]`), or expands past YAML_MAX_NODES nodes, YAML_MAX_CHARS characters or
    YAML_MAX_DEPTH levels once its aliases are repeated (a "billion laughs": 551 bytes of nested aliases name 10^9
    strings). An alias is, in the node graph, the very node it names: each node's expanded size is counted once
    (memoised), so the walk is linear in the text. NOTE: iterative, so that a deep or cyclic document is no
    RecursionError here."""
    if root is None:
        return
    size: dict[int, tuple[int, int, int]] = {}  # id(node) -> (nodes, characters, levels) once expanded
    walking: set[int] = set()  # the nodes on the path from the root to the one being walked (their sizes unknown)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = _yaml_children(node)
        if done:
            walking.discard(id(node))
            sizes = [size[id(k)] for k in kids]
            own = len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            nodes, chars = 1 + sum(s[0] for s in sizes), own + sum(s[1] for s in sizes)
            size[id(node)] = (nodes, chars, 1 + max((s[2] for s in sizes), default=0))
            where = f"line {node.start_mark.line + 1}"
            if nodes > YAML_MAX_NODES or chars > YAML_MAX_CHARS:
                raise ConfigError(
                    f"{where}: its aliases (*name) expand it past {YAML_MAX_NODES:,} values or "
                    f"{YAML_MAX_CHARS:,} characters (a config has hundreds of values): write the values out"
                )
            if size[id(node)][2] > YAML_MAX_DEPTH:
                raise ConfigError(
                    f"{where}: nested more than {YAML_MAX_DEPTH} levels deep (mappings or lists inside one "
                    "another, aliases expanded): a config is a few levels deep"
                )
        elif id(node) in walking:
            raise ConfigError(
                f"line {node.start_mark.line + 1}: the value anchored here (&name) holds an alias (*name) of "
                "itself: a config value cannot contain itself"
            )
        elif id(node) not in size:
            walking.add(id(node))
            stack.append((node, True))
            stack += [(k, False) for k in kids]


def bounded_yaml(text: str, loader: type = yaml.SafeLoader) -> Any:
    """yaml.load(text, Loader=loader) with check_expansion between composing and building the document."""
    parser = loader(text)
    try:
        try:
            node = parser.get_single_node()
        except RecursionError:  # NOTE: PyYAML's own parser recurses per level, before check_expansion sees it
            raise ConfigError("nested too deeply (mappings or lists inside one another)") from None
        check_expansion(node)
        return None if node is None else parser.construct_document(node)
    finally:
        parser.dispose()


def _parse_yaml_dict(args: list[str]) -> dict[str, Any]:
    """One `*_args` mapping from the command line. NOTE: tyro turns a ValueError into a usage error naming the
    option (exit 2), so every problem here is one."""
    try:
        value = bounded_yaml(args[0]) if args[0].strip() else {}
    except ConfigError as e:
        raise ValueError(str(e)) from None
    except yaml.YAMLError as e:
        raise ValueError(
            f"not valid YAML ({' '.join(str(e).split())}); expected a mapping such as '{{kl_coef: 0.01}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a YAML/JSON mapping such as '{{kl_coef: 0.01}}', got {args[0]!r}")
    try:
        check_plain(value, "")
    except ValueError as e:  # a ConfigError
        raise ValueError(str(e)) from None
    return value


# A free-form `*_args` mapping. On the command line it takes one YAML/JSON mapping:
# `--algorithm.kl_loss_fn_args '{kl_coef: 0.01}'` (it replaces the whole mapping).
ArgsDict = Annotated[
    dict[str, Any],
    tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="YAML",
        instance_from_str=_parse_yaml_dict,
        is_instance=lambda x: isinstance(x, dict),
        str_from_instance=lambda x: [json.dumps(x)],
    ),
]


def _field(default_factory: Any) -> Any:
    return dataclasses.field(default_factory=default_factory)


# --- algorithm


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-6
    """Peak learning rate of the actor."""
    lr_warmup_steps: int = -1
    """Linear warm-up steps; -1 means use lr_warmup_steps_ratio."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up steps as a fraction of the total training steps (0 to 1)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of lr (0 to 1)."""
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up (the YAML alias `warmup_style` is accepted)."""
    optimizer_type: Literal["adam", "adamw"] = "adam"
    """Optimizer; both names give torch.optim.AdamW (decoupled weight decay), as veRL's FSDP does."""
    betas: list[float] = _field(lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""


@dataclasses.dataclass
class RolloutCorrectionConfig:
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Truncated importance sampling between rollout and trainer log-probs: off, per token, or per sequence
    (algos/correction.py)."""
    rollout_is_threshold: float = 2.0
    """C: importance weights are cut at this value (> 1)."""
    rollout_rs: str = "none"
    """Rejection mask on the ratios pi_old / pi_rollout (dropped tokens get no policy gradient): none, token, sequence,
    geometric (veRL's modes), icepop (IcePop's token band), token_mask, sequence_mask (TRL's); one algos/ file each
    (algos.ROLLOUT_RS_FNS, algos/correction.py)."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the kept ratios (TRL's C_max, IcePop's beta). Unset: the mask's default (token, sequence: 2.0;
    geometric: 1.01; icepop: 5.0; token_mask, sequence_mask: 3.0)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the kept ratios (TRL's C_min, IcePop's alpha; 0 = none). Unset: the mask's default (token,
    sequence: 0.5; geometric: 1 / 1.01; icepop: 0.5; token_mask, sequence_mask: 0)."""


@dataclasses.dataclass
class AlgorithmConfig:
    algorithm_type: str = "ppo"
    """Preset that fills in the pieces below: ppo, grpo, opmd, dpo, sft, mix, ... (algos/__init__.py)."""
    repeat_times: int | None = None
    """Responses sampled per task (group size n). Unset: the preset's default (grpo: 2, ppo: 1)."""
    optimizer: OptimizerConfig = _field(OptimizerConfig)
    """Actor optimizer."""
    sample_strategy: str = ""
    """How the trainer reads experiences (default, staleness_control, mix). Empty: the preset's."""
    sample_strategy_args: ArgsDict = _field(dict)
    """Arguments of sample_strategy (e.g. max_staleness)."""
    advantage_fn: str = ""
    """Advantage estimator (ppo = GAE, grpo, rloo, ...). Empty: the preset's."""
    advantage_fn_args: ArgsDict = _field(dict)
    """Arguments of advantage_fn (e.g. epsilon, std_threshold, gamma, lam)."""
    kl_penalty_fn: str = ""
    """KL penalty subtracted from the reward (none, k1, k2, k3, low_var_kl, abs). Empty: the preset's."""
    kl_penalty_fn_args: ArgsDict = _field(dict)
    """Arguments of kl_penalty_fn (e.g. kl_coef)."""
    policy_loss_fn: str = ""
    """Policy loss (ppo, opmd, dpo, sft, mix, gspo, ...). Empty: the preset's."""
    policy_loss_fn_args: ArgsDict = _field(dict)
    """Arguments of policy_loss_fn (e.g. clip_range, clip_range_low, clip_range_high)."""
    kl_loss_fn: str = ""
    """KL term added to the actor loss (none, k1, k2, k3, low_var_kl, abs). Empty: the preset's."""
    kl_loss_fn_args: ArgsDict = _field(dict)
    """Arguments of kl_loss_fn (e.g. kl_coef)."""
    entropy_loss_fn: str = ""
    """Entropy bonus (default, none, mix). Empty: the preset's."""
    entropy_loss_fn_args: ArgsDict = _field(dict)
    """Arguments of entropy_loss_fn (e.g. entropy_coef)."""
    rollout_correction: RolloutCorrectionConfig = _field(RolloutCorrectionConfig)
    """Off-policy correction for the rollout engine's log-probs (veRL's algorithm.rollout_correction); mismatch metrics
    are logged either way."""
    overlong_reward: OverlongRewardConfig = _field(OverlongRewardConfig)
    """DAPO's soft overlong punishment added to the reward (algos/overlong.py)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses are reduced to one number."""


# --- model and cluster


@dataclasses.dataclass
class LoRAConfig:
    name: str = ""
    """The adapter's name in vLLM's LoRA requests (lora_name; empty: policy), on vLLM engines that serve it; the HF
    engine gets merged weights: warned when set there."""
    path: str = ""
    """A saved adapter to start from (peft's format: adapter_config.json + adapter_model.safetensors, e.g. a
    checkpoint's actor/lora_adapter); its own adapter_config.json decides rank, alpha and layers. Empty: a new adapter
    (B = 0: training starts exactly at model_path)."""
    base_model_name: str = ""
    """Trinity's name of the base model for vLLM's LoRA requests (only vLLM's OpenAI server reads it); names nothing
    here: warned when set."""
    lora_rank: int = 32
    """r: rank of the update B.A added to each adapted weight (>= 1)."""
    lora_alpha: float = 32.0
    """alpha: the update is scaled by alpha / r (> 0)."""
    lora_dtype: str = "auto"
    """vLLM's dtype of the adapter weights it serves (auto: the engine's dtype; float16, bfloat16, float32). The adapter
    trains in fp32 (as every trained weight); the HF engine gets it merged in its own dtype: there auto and float32
    mean that, anything else is warned about."""
    target_modules: str | list[str] = "all-linear"
    """Layers that get an adapter, as peft reads target_modules: all-linear (every linear layer but the LM head), a
    list of module names (`[q_proj, v_proj]`: a name matches itself and any module name ending in `.name`), or one
    regular expression matching a module's whole name."""
    exclude_modules: str | list[str] | None = None
    """Layers left without an adapter, as peft reads exclude_modules (a list of names, or one regular expression)."""


@dataclasses.dataclass
class ModelConfig:
    model_path: str = ""
    """HF folder or hub id of the model to train (required)."""
    critic_model_path: str = ""
    """Model the critic starts from (ppo). Empty: model_path (derived)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model folder: refused (true); nanorft runs transformers' own models."""
    custom_chat_template: str = ""
    """Jinja chat template overriding the tokenizer's (trainer and explorer alike)."""
    chat_template_path: str = ""
    """File holding a chat template (wins over custom_chat_template; a missing file is refused)."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens. Unset: max_prompt_tokens + max_response_tokens (derived)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens. Unset: max_model_len - max_response_tokens, or half (derived)."""
    max_response_tokens: int | None = None
    """Longest response in tokens. Unset: max_model_len - max_prompt_tokens, or half (derived)."""
    min_response_tokens: int = 1
    """Shortest response in tokens: every rollout request's default min_tokens (EOS is suppressed before that)."""
    enable_prompt_truncation: bool = True
    """A prompt over max_prompt_tokens keeps its last max_prompt_tokens tokens and its experience gets no loss
    (truncate_status prompt_truncated); false: the task fails at once (not retried), naming the lengths."""
    temperature: float = 1.0
    """Default sampling temperature (tasksets' rollout_args override it): 0 = greedy, else >= 0.01 (below, vLLM
    samples at 0.01 and logits / temperature overflow: configs/checks.py MIN_TEMPERATURE)."""
    top_p: float = 1.0
    """Default nucleus-sampling threshold (1.0 = off)."""
    top_k: int = -1
    """Default top-k (-1 or 0 = off)."""
    logprobs: int = 0
    """Extra top log-probs per token returned by the engine (the sampled token's is always returned)."""
    repetition_penalty: float = 1.0
    """Repetition penalty of the rollout engine (1.0 = off)."""
    enable_thinking: bool | None = None
    """Passed to chat templates that know it (Qwen3); unset = the template's default."""
    lora_configs: list[LoRAConfig] = _field(list)
    """LoRA (one adapter at most, as in Trinity-RFT): the trainer trains an adapter through peft instead of the whole
    model; vLLM engines serve it on the base model (enable_lora) and get the adapter alone at each sync, the HF
    engine gets the weights with the adapter merged in (lora.py). Empty: full fine-tuning."""
    fully_sharded_loras: bool = False
    """vLLM's option for serving adapters (shard the whole LoRA computation with tensor parallelism), passed to vLLM
    engines that serve the adapter; no effect on the HF engine or without LoRA (warned when true)."""
    max_cpu_loras: int | None = None
    """vLLM's option for serving adapters (adapters kept in CPU memory, >= 1), passed to vLLM engines that serve the
    adapter; no effect on the HF engine or without LoRA (warned when set)."""


@dataclasses.dataclass
class ClusterConfig:
    node_num: int = 1
    """Number of nodes. The launcher runs on node 0 (the explorer's, in mode both) and prints the command for each
    other node; more than one spans the trainer over nodes (torchrun, static rendezvous at master_addr): every node
    in mode train, nodes 1..node_num-1 in mode both (node 0 is the explorer's, on the CPU as on GPUs)."""
    gpu_per_node: int | None = None
    """GPUs per node: 0 = none (everything on the CPU, even where CUDA is visible); unset = as many as torch sees.
    On the CPU the launcher starts one trainer rank per trainer node."""
    master_addr: str = "127.0.0.1"
    """With node_num > 1: the address of the trainer's first node, which holds trainer rank 0 and torchrun's
    rendezvous; every trainer node must reach it. That node is node 0 in mode train, node 1 in mode both (node 0 is
    the explorer's: the trainer starts at node 1). 127.0.0.1: every "node" on this machine (a test)."""
    master_port: int = 29500
    """With node_num > 1: the TCP port of the rendezvous on master_addr (torchrun's --rdzv-endpoint addr:port)."""
    explorer_gpu_num: int | None = None
    """Derived (leave unset; another value is refused): GPUs given to rollout engines (engine_num x
    tensor_parallel_size for vLLM)."""
    trainer_gpu_num: int | None = None
    """Derived (leave unset; another value is refused): GPUs left for the trainer (its torchrun world size on GPU)."""
    trainer_node_num: int | None = None
    """Derived (leave unset; another value is refused): nodes the trainer spans, the last ones (torchrun --nnodes);
    0 when the mode has no trainer."""
    trainer_gpu_num_per_node: int | None = None
    """Derived (leave unset; another value is refused): trainer GPUs (ranks) on each of its nodes (torchrun
    --nproc-per-node); 0 on the CPU: one rank."""
    colocate: bool | None = None
    """Derived (leave unset; another value is refused): mode both on one GPU; explorer and trainer share it (vLLM
    sleeps while the trainer steps)."""


# --- buffer


@dataclasses.dataclass
class FormatConfig:
    """How a row's columns become a task / an SFT or DPO example. Every *_key names a column, or a dotted path into
    struct columns (veRL's parquet: `response_key: reward_model.ground_truth`); a top-level column of that name
    wins."""

    prompt_type: Literal["plaintext", "messages"] = "plaintext"
    """Rows hold a prompt string (plaintext) or a chat message list (messages). Trinity defaults to messages."""
    prompt_key: str = "prompt"
    """Column with the user prompt (plaintext): text, or a chat (a list of {role, content}, as veRL's)."""
    response_key: str = "response"
    """Column with the reference answer / SFT response (plaintext)."""
    system_prompt_key: str | None = None
    """Column with a per-row system prompt (wins over system_prompt)."""
    system_prompt: str | None = None
    """System prompt for every row."""
    messages_key: str = "messages"
    """Column with the message list (messages). Trinity's default is 'message'."""
    tools_key: str = "tools"
    """Column with tool schemas (a list of dicts)."""
    chosen_key: str = "chosen"
    """Column with the preferred response (DPO)."""
    rejected_key: str = "rejected"
    """Column with the dispreferred response (DPO)."""
    reply_prefix: str | None = None
    """Text the assistant turn starts with (added after the generation prompt: part of the prompt tokens; the
    response text the reward sees does not include it)."""
    workflow_key: str | None = None
    """Column naming a per-row workflow (overrides the taskset's): a registered one or the taskset's own, never code
    to import (`module:attr` / a file path: only the YAML names code)."""
    reward_fn_key: str | None = None
    """Column naming a per-row reward function (overrides the taskset's), as workflow_key."""
    enable_concatenated_multi_turn: bool = False
    """SFT on messages: train on every assistant turn of a conversation, not only the last."""
    chat_template: str = ""
    """Chat template for this data (task prompts, SFT / DPO rows); empty = the model's (model.chat_template_path,
    model.custom_chat_template or the tokenizer's)."""


@dataclasses.dataclass
class GenerationConfig:
    temperature: float | None = None
    """Sampling temperature: 0 = greedy, else >= 0.01; unset = model.temperature (derived)."""
    top_p: float | None = None
    """Nucleus threshold; unset = model.top_p (derived)."""
    top_k: int | None = None
    """Top-k; unset = model.top_k (derived)."""
    logprobs: int | None = None
    """Extra top log-probs per token; unset = model.logprobs (derived)."""
    max_tokens: int | None = None
    """Longest response; unset = model.max_response_tokens (derived)."""


@dataclasses.dataclass
class DataSelectorConfig:
    selector_type: Literal["sequential", "shuffle", "random", "offline_easy2hard", "difficulty_based"] = "sequential"
    """Task order: file order, a seeded permutation per epoch (shuffle), seeded sampling with replacement (random),
    sorted once by feature_keys, highest first (offline_easy2hard), or online by each task's estimated pass rate,
    nearest kwargs.target_reward first (difficulty_based: Trinity's BOTS selector; selection.py)."""
    seed: int = 42
    """Seed of shuffle / random / difficulty_based's sampling."""
    feature_keys: list[str] = _field(list)
    """Columns of the taskset the selector reads: offline_easy2hard sorts by them (the first, ties broken by the
    next); difficulty_based reads two prior pass-rate columns (a weaker and a stronger reference) to interpolate
    unseen tasks' pass rates, or none (a flat prior of 0.5)."""
    kwargs: ArgsDict = _field(dict)
    """The selector's own arguments, Trinity's names (difficulty_based: m, lamb, rho, target_reward, tau,
    do_sample, adaptive_rho, cap_coef_update_discount: configs/data_selector.DifficultyArgs); unknown names are
    refused."""


@dataclasses.dataclass
class TasksetConfig:
    name: str = ""
    """Taskset name (metrics are keyed by it). Empty: taskset_<i> / eval_taskset_<i> (derived)."""
    storage_type: Literal["file"] = "file"
    """Where tasks live: files (jsonl/json/parquet/csv) or a hub dataset read with `datasets`."""
    path: str = ""
    """A file, a folder in Hugging Face layout, or a hub dataset name."""
    subset_name: str | None = None
    """Subset (config) name, e.g. 'main' for GSM8K; a sub-folder of path."""
    split: str = "train"
    """Split to read: a file named <split>.<ext> or <split>-*.<ext> in the folder."""
    repeat_times: int | None = None
    """Rollouts per task. Derived: algorithm.repeat_times for training tasksets, 1 for eval ones unless set."""
    format: FormatConfig = _field(FormatConfig)
    """Which columns hold what."""
    rollout_args: GenerationConfig = _field(GenerationConfig)
    """Sampling arguments for this taskset."""
    default_workflow_type: str = ""
    """Workflow for these tasks; empty = buffer.default_workflow_type (derived)."""
    default_reward_fn_type: str = ""
    """Reward function for these tasks; empty = buffer.default_reward_fn_type (derived)."""
    workflow_args: ArgsDict = _field(dict)
    """Extra arguments handed to the workflow."""
    reward_fn_args: ArgsDict = _field(dict)
    """Extra arguments handed to the reward function."""
    data_selector: DataSelectorConfig = _field(DataSelectorConfig)
    """Task order."""
    enable_progress_bar: bool = False
    """Show a progress bar (on stderr) while the rows are read and turned into tasks."""


@dataclasses.dataclass
class ExperienceBufferConfig:
    name: str = "experience_buffer"
    """Buffer name (the DB file is named after it when path is empty)."""
    storage_type: Literal["queue", "sql", "file"] = "queue"
    """queue / sql: the experience DB (SQLite or PostgreSQL, by path); file: read-only SFT/DPO data files (train
    mode)."""
    schema_type: Literal["", "experience", "sft", "dpo"] = ""
    """What the rows are: experiences (the DB), SFT conversations or DPO pairs (files). Empty: from the algorithm
    (derived)."""
    path: str = ""
    """queue/sql: sqlite:///path.db (empty: sqlite:///<job dir>/buffer/<name>.db, derived), or
    postgresql://user:password@host:port/db for explorers and trainers on several hosts (the `postgres` extra);
    file: a data file or folder."""
    subset_name: str | None = None
    """file: subset (sub-folder) name."""
    split: str = "train"
    """file: split to read."""
    format: FormatConfig = _field(FormatConfig)
    """file: which columns hold what (SFT / DPO data)."""
    max_read_timeout: float = 1800.0
    """Seconds the trainer waits for a full batch before it takes what exists."""
    use_priority_queue: bool = False
    """Claim whole groups by priority (model_version - decay x use_count, Trinity's linear_decay) instead of FIFO
    (Trinity's replay_buffer.enable)."""
    reuse_cooldown_time: float | None = None
    """Priority queue: seconds before a claimed group may be claimed again, trained on the advantages of its first
    use; unset = never reused."""
    priority_decay: float = 2.0
    """Priority queue: decay per previous use (Trinity's priority_fn_args.decay)."""


@dataclasses.dataclass
class ExplorerInputConfig:
    taskset: TasksetConfig = _field(TasksetConfig)
    """The training taskset (merged into tasksets, derived)."""
    tasksets: list[TasksetConfig] = _field(list)
    """Several training tasksets, interleaved in proportion to their sizes."""
    eval_tasksets: list[TasksetConfig] = _field(list)
    """Tasksets evaluated every explorer.eval_interval steps and in bench mode."""


@dataclasses.dataclass
class TrainerInputConfig:
    experience_buffer: ExperienceBufferConfig = _field(ExperienceBufferConfig)
    """Where the explorer writes and the trainer reads (required even in explore mode)."""
    auxiliary_buffers: dict[str, ExperienceBufferConfig] = _field(dict)
    """Extra trainer inputs by name, e.g. sft_dataset for the mix algorithm."""


@dataclasses.dataclass
class BufferConfig:
    batch_size: int = 1
    """Tasks per explorer step (do not multiply by repeat_times)."""
    train_batch_size: int = 0
    """Experiences per train step; 0 = batch_size x repeat_times (derived)."""
    total_epochs: int = 1
    """Passes over the training tasksets."""
    total_steps: int | None = None
    """Train steps to run; wins over total_epochs when set."""
    explorer_input: ExplorerInputConfig = _field(ExplorerInputConfig)
    """Tasksets for the explorer."""
    trainer_input: TrainerInputConfig = _field(TrainerInputConfig)
    """Experience buffer (and auxiliary data) for the trainer."""
    default_workflow_type: str = ""
    """Workflow of tasksets that name none (e.g. math_workflow)."""
    default_eval_workflow_type: str = ""
    """Workflow of eval tasksets that name none; empty = default_workflow_type."""
    default_reward_fn_type: str = ""
    """Reward function of tasksets that name none (e.g. math_reward)."""


# --- explorer, synchronizer, trainer


@dataclasses.dataclass
class ExternalModelConfig:
    base_url: str = ""
    """The endpoint's base URL as the `openai` client takes it (e.g. https://api.openai.com/v1,
    http://127.0.0.1:8000/v1 for a vLLM server); required with engine_type external."""
    model_name: str = ""
    """The model the endpoint serves (each request's `model`), and the auxiliary model's name for workflows
    (self.auxiliary_models[model_name], a judge's workflow_args.judge); required with engine_type external."""
    api_key_env: str = "OPENAI_API_KEY"
    """Name of the environment variable that holds the endpoint's API key (the key itself is never written in a
    config); empty = an endpoint without keys (the client sends "EMPTY")."""
    timeout: float = 60.0
    """Seconds one request may take before it fails (and with it that judgement, not the explorer)."""
    max_retries: int = 2
    """Retries of a request the `openai` client deems transient (connection error, timeout, 429, 5xx)."""


@dataclasses.dataclass
class InferenceModelConfig:
    model_path: str = ""
    """Auxiliary models only: the model to serve (the rollout model serves model.model_path; this key set to it is
    dropped when the config is derived, any other value refused)."""
    engine_type: Literal["auto", "vllm", "vllm_async", "hf", "external"] = "auto"
    """auto = vLLM when importable and a GPU is present, else the HF engine (Trinity's default: vllm). external
    (auxiliary models only): an OpenAI-compatible endpoint that nanorft does not run (external_model_config), e.g. a
    judge served elsewhere."""
    engine_num: int = 1
    """Number of rollout engines."""
    tensor_parallel_size: int = 1
    """GPUs per vLLM engine."""
    gpu_memory_utilization: float | None = None
    """Fraction of each GPU vLLM may use (0 to 1); unset = 0.9 (Trinity's default). Without GPUs, vLLM's CPU
    backend reads it as the share of the host's memory an engine's worker may take, weights and KV cache together;
    unset there = 0.1 (configs/resolve.py)."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching (the group's shared prompt is computed once)."""
    enable_chunked_prefill: bool | None = None
    """vLLM chunked prefill; unset = on with GPUs (vLLM's default), off without: vLLM 0.32's CPU backend fails a
    seeded request that a chunked prefill splits ("CPU Generator does not use offset"), and its engine with it."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs (slower, starts faster)."""
    dtype: str = "auto"
    """Engine dtype: auto = bfloat16 with GPUs, float32 without (as the trainer on the CPU); bf16 / fp16 / half /
    fp32 / float are resolved to torch's names (configs/resolve.py). The HF engine uses float32 on the CPU whatever
    the name; vLLM's CPU backend honours it. Weights are sent and published in it."""
    seed: int = 42
    """Sampling seed of the engine (vLLM engine i gets seed + i)."""
    max_model_len: int | None = None
    """Context length of this engine; unset = model.max_model_len."""
    enable_history: bool = False
    """Record the calls a workflow makes through the OpenAI-compatible API (EngineHandle.openai_client), so that it
    can turn them into experiences (EngineHandle.history); needs enable_openai_api."""
    enable_openai_api: bool = False
    """Serve the rollout engine as an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models)
    from the explorer, for workflows written against the `openai` client (openai_api.py)."""
    openai_api_host: str = "127.0.0.1"
    """Address the API binds to (loopback: only this machine can call it; any other needs openai_api_key)."""
    openai_api_key: str | None = None
    """Bearer token every request to the API must carry (`Authorization: Bearer <key>`, the `openai` client's
    api_key; the handle's own clients send it); required when openai_api_host is not loopback. A secret: hidden in
    what the config prints; e.g. `${oc.env:NANORFT_API_KEY}` to take it from the environment."""
    openai_api_port: int = 0
    """Port of the API; 0 = a free one (logged at start)."""
    chat_template: str = ""
    """Chat template of the rollout prompts (a taskset's format.chat_template wins); empty = the model's."""
    ignore_eos: bool = False
    """Keep sampling past EOS up to max_tokens (benchmarks; EOS is suppressed, as min_tokens = max_tokens)."""
    external_model_config: ExternalModelConfig = _field(ExternalModelConfig)
    """engine_type external: the endpoint (base_url, model_name, api_key_env, timeout, max_retries)."""


@dataclasses.dataclass
class ExplorerConfig:
    name: str = "explorer"
    """Explorer name; several explorers on one experiment need distinct names."""
    runner_per_model: int | None = None
    """Concurrent workflow runners (threads) per rollout engine; unset = every task of a step (up to 256 at a
    time, also for eval) at once, so that the engine batches all their requests together (Trinity's default 8
    runs a step's 16 tasks in two waves of 8 batched requests each)."""
    max_timeout: float = 1800.0
    """Seconds one workflow run may take before it is abandoned."""
    max_retry_times: int = 2
    """Retries of a failed or timed-out workflow run."""
    max_refill_rounds: int = 1
    """Rounds of extra tasks a step reads and runs in place of its dropped ones (a workflow that failed or timed out
    after its retries, a prompt too long), each round as many tasks as are still missing, so that the step usually
    writes batch_size groups; 0: none (the step writes what it has; the trainer takes it as it is). With dynamic
    sampling, max_num_gen_batches bounds the step instead."""
    env_vars: dict[str, str] = _field(dict)
    """Environment variables set for the workflow runners. Every value is taken for a secret: *** in --dry-run,
    messages and the monitors' copy of the config (the run directory's config.yaml, 0600, keeps them)."""
    rollout_model: InferenceModelConfig = _field(InferenceModelConfig)
    """The rollout engines."""
    auxiliary_models: list[InferenceModelConfig] = _field(list)
    """Extra models workflows may call (judges, reward models); each needs model_path, or with engine_type external
    its external_model_config (an OpenAI-compatible endpoint)."""
    eval_interval: int = 100
    """Evaluate every this many explorer steps (rounded to a multiple of sync_interval, derived)."""
    eval_on_startup: bool = True
    """Evaluate the starting model at step 0 (not again on restart)."""
    bench_on_latest_checkpoint: bool = False
    """bench mode: evaluate only the newest checkpoint instead of all of them."""
    partial_rollout: bool = False
    """In-flight weight updates (veRL's partial rollout; AReaL, PipelineRL): at a sync point the explorer does not
    stop generating. The next step's tasks start on the old weights while the sync point waits for and loads the
    trainer's new ones in the background; the load pauses the engines with their requests kept (vLLM's
    pause_generation(mode="keep")) and resumes them, so a response started under version v finishes under v+1. Each
    experience records which version sampled which tokens (Experience.spans; model_version: the oldest). The step's
    write waits for the sync point (the trainer's bookkeeping is unchanged). engine_type vllm_async only."""


@dataclasses.dataclass
class SynchronizerConfig:
    sync_method: Literal["nccl", "checkpoint", "online", "offline", "memory"] = "nccl"
    """nccl: a process group (NCCL on GPU, gloo on CPU), mode both only; checkpoint: explorer polls saved weights.
    memory (Trinity's, for one shared GPU): an alias of nccl, whose weights go through host memory there."""
    sync_style: Literal["fixed", "trainer_driven", "explorer_driven", "dynamic_by_trainer", "dynamic_by_explorer"] = (
        "fixed"
    )
    """Who decides when weights move: a fixed cadence, or the trainer / explorer when it is ready."""
    sync_interval: int = 1
    """Steps between weight syncs."""
    sync_offset: int = 0
    """Explorer steps run before the first sync (1 = one-step off-policy pipelining)."""
    sync_timeout: float = 3600.0
    """Seconds either side waits for the other at a sync point."""
    sync_host: str = "127.0.0.1"
    """sync_method nccl: the address trainer rank 0's weight store binds to and announces to the explorer in
    <job dir>/sync_group.json. Loopback (only this machine) unless the explorer runs on another host than trainer
    rank 0 (cluster.node_num > 1, mode both: node 1's): then an address of that node the explorer reaches (0.0.0.0:
    every interface, announced by host name)."""


@dataclasses.dataclass
class CriticConfig:
    lr: float = 1e-5
    """Critic learning rate."""
    lr_warmup_steps_ratio: float = 0.0
    """Critic warm-up as a fraction of the total steps."""
    weight_decay: float = 0.01
    """Critic AdamW weight decay."""
    cliprange_value: float = 0.5
    """Value-loss clip range."""
    grad_clip: float = 1.0
    """Critic gradient-norm clip."""
    micro_batch_size_per_gpu: int = 8
    """Critic sequences per forward pass when use_dynamic_bsz is off."""
    gradient_checkpointing: bool = False
    """Recompute critic activations in the backward pass."""
    param_offload: bool = False
    """Keep critic parameters on CPU between uses (GPU only)."""
    optimizer_offload: bool = False
    """Keep critic optimizer state on CPU (GPU only)."""


@dataclasses.dataclass
class TrainerConfig:
    name: str = "trainer"
    """Trainer name (log and monitor files are named after it)."""
    trainer_strategy: Literal["fsdp", "fsdp2"] = "fsdp2"
    """Sharding: both names give FSDP2 (fully_shard)."""
    save_interval: int = 0
    """Save a checkpoint every this many steps; 0 = only at the end."""
    max_checkpoints_to_keep: int | None = None
    """Delete older checkpoints beyond this many; unset = keep all."""
    save_hf_checkpoint: Literal["always", "last", "never"] = "always"
    """A Hugging Face folder of the weights in every checkpoint (always, gathered on rank 0; Trinity-RFT's default is
    last), or only where the weight sync publishes one (last / never, alike: the last step's is always published);
    resumes read the checkpoint's sharded model/."""
    total_steps: int | None = None
    """Train steps; buffer.total_steps wins when both are set."""
    enable_preview: bool = True
    """Log the lowest- and highest-reward sample of each step."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the actor."""
    use_dynamic_bsz: bool = True
    """Pack micro-batches up to max_token_len_per_gpu tokens instead of a fixed count."""
    max_token_len_per_gpu: int | None = None
    """Token budget of one micro-batch (packed tokens); unset = 16384 (veRL's actor default), or 2 x
    max_model_len when that is more (Trinity derives 2 x max_model_len, which cut a step of 128 short
    sequences into ~40 micro-batches). With ulysses_sequence_parallel_size N, a micro-batch holds N times this,
    split over N ranks (veRL's rule)."""
    micro_batch_size_per_gpu: int = 1
    """Sequences per micro-batch when use_dynamic_bsz is off (veRL ppo_micro_batch_size_per_gpu)."""
    log_prob_micro_batch_size_per_gpu: int = 4
    """Sequences per forward pass for old/ref log-probs when use_dynamic_bsz is off."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int = 0
    """Experiences per optimizer step; 0 = train_batch_size (one optimizer step per train step)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (veRL enable_gradient_checkpointing)."""
    use_remove_padding: bool = True
    """Lay each group's prompt out once in the packed micro-batches (false: every response gets its own copy of its
    prompt). Either way sequences are packed without padding."""
    param_offload: bool = False
    """FSDP2 CPU offload of actor parameters (GPU only)."""
    optimizer_offload: bool = False
    """Keep actor optimizer state on CPU (GPU only)."""
    ref_param_offload: bool = False
    """Keep the reference model's parameters on CPU (GPU only)."""
    ulysses_sequence_parallel_size: int = 1
    """Sequence parallelism (DeepSpeed-Ulysses, veRL's key): each packed micro-batch is split over this many
    consecutive ranks, each running the model on 1/N of its columns (attention trades columns for heads with an
    all-to-all: ulysses.py); it must divide the trainer's ranks and the model's attention heads. 1: no split."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts (ppo)."""
    critic: CriticConfig = _field(CriticConfig)
    """Critic settings (ppo)."""
    trainer_config: ArgsDict = _field(dict)
    """veRL-style settings; the keys that mean something here are mapped onto the fields above, the rest warned
    about."""


# --- monitor, log, stages, root


@dataclasses.dataclass
class MonitorConfig:
    monitor_type: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = _field(lambda: ["tensorboard"])
    """Where metrics go besides the console and the run's JSONL history: one sink or several at once (`[tensorboard,
    wandb]`; Trinity's single name is read as a list of one); none (alone) or [] = no sink. wandb runs online or
    offline as wandb decides from its credentials (`wandb login`, WANDB_API_KEY, WANDB_MODE); offline without any."""
    monitor_args: ArgsDict = _field(dict)
    """Monitor options: wandb base_url / api_key; mlflow uri / username / password. Values are *** in --dry-run,
    messages and the monitors' copy of the config, but those of configs/checks.py SHOWN_MONITOR_ARGS (uri, base_url,
    username, entity, tags, ...; a URL's password hidden)."""
    detailed_stats: bool = False
    """Eval metrics also get max/min/std across tasks."""


# --- data_processor


@dataclasses.dataclass
class OperatorConfig:
    name: str = ""
    """A built-in operator (pipelines/registry.py), a Data-Juicer operator's name (run by the real py-data-juicer in
    its own environment), or your own as `module:attr` / `path/to/file.py:attr` (docs/pipelines.md)."""
    args: ArgsDict = _field(dict)
    """The operator's arguments, by its own names; unknown ones are refused by name."""


@dataclasses.dataclass
class TaskPipelineConfig:
    operators: list[OperatorConfig] = _field(list)
    """Operators run in order over the taskset rows before the explorer reads them (empty: no task pipeline). The
    result is written once under <job dir>/task_pipeline/, keyed by a hash of the inputs and the operators, and the
    first training taskset reads it (score columns kept)."""
    inputs: list[str] = _field(list)
    """Taskset files (jsonl / json / parquet / csv) or folders, read in order; empty: the first training taskset's
    own path (and its subset_name / split)."""
    target_fields: list[str] = _field(list)
    """The columns the operators read as text (Data-Juicer's text_keys); empty: the first training taskset's
    format.prompt_key."""
    num_process: int = 4
    """Data-Juicer's np, and the concurrent model requests an LLM-scoring operator keeps in flight."""
    config_path: str = ""
    """A Data-Juicer recipe (YAML with a `process:` list) run over the rows after `operators`; empty: none."""


@dataclasses.dataclass
class ExperiencePipelineConfig:
    operators: list[OperatorConfig] = _field(list)
    """Operators run in order on each explore step's scored experiences before they are written (empty: none):
    reward_filter, reward_std_filter, invalid_reward_filter, reward_shaping_mapper, data_juicer, or your own."""


@dataclasses.dataclass
class DataProcessorConfig:
    task_pipeline: TaskPipelineConfig = _field(TaskPipelineConfig)
    """Operators over the taskset files before exploring (explore and both modes)."""
    experience_pipeline: ExperiencePipelineConfig = _field(ExperiencePipelineConfig)
    """Operators over each step's experiences before the DB (in the explorer, inside its exactly-once write)."""


@dataclasses.dataclass
class LogConfig:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Logging level of every process."""


@dataclasses.dataclass
class StageConfig:
    stage_name: str = ""
    """Stage name; the stage runs as experiment <name>/<stage_name>."""
    mode: str = ""
    """Mode of this stage; empty = the global mode."""
    algorithm: ArgsDict = _field(dict)
    """Overrides of the global algorithm section (merged key by key)."""
    buffer: ArgsDict = _field(dict)
    """Overrides of the global buffer section."""
    explorer: ArgsDict = _field(dict)
    """Overrides of the global explorer section."""
    trainer: ArgsDict = _field(dict)
    """Overrides of the global trainer section."""
    model: ArgsDict = _field(dict)
    """Overrides of the global model section (model_path is set to the previous stage's weights)."""
    start_from: str = ""
    """stage_name of an earlier stage whose last weights this stage starts from; empty = the previous stage's (e.g.
    a random-reward control and the run it controls, both from one SFT stage's weights)."""
    synchronizer: ArgsDict = _field(dict)
    """Overrides of the global synchronizer section."""
    data_processor: ArgsDict = _field(dict)
    """Overrides of the global data_processor section."""


@dataclasses.dataclass
class Config:
    project: str = "nanorft"
    """Project name: checkpoints go to <checkpoint_root_dir>/<project>/<name>/ (Trinity's default: Trinity-RFT). One
    folder name (as group and name): no /, \\, . or .. (configs/checks.py check_folder_name)."""
    group: str = ""
    """Optional group level between project and name."""
    name: str = "rft"
    """Experiment name (a stage runs as <name>/<stage_name>)."""
    mode: Literal["both", "train", "explore", "bench"] = "both"
    """both: explorer + trainer in turns; train / explore: one of them (async RFT); bench: evaluate checkpoints."""
    checkpoint_root_dir: str = "./checkpoints"
    """Root of all checkpoints, logs and DBs."""
    checkpoint_job_dir: str = ""
    """Derived (leave unset; another value is refused): <checkpoint_root_dir>/<project>[/<group>]/<name>."""
    continue_from_checkpoint: bool = True
    """Resume from the job's latest checkpoint; false = start afresh as <name>_<timestamp>."""
    algorithm: AlgorithmConfig = _field(AlgorithmConfig)
    """Algorithm preset and pieces."""
    model: ModelConfig = _field(ModelConfig)
    """Model paths and token limits."""
    cluster: ClusterConfig = _field(ClusterConfig)
    """Nodes and GPUs."""
    buffer: BufferConfig = _field(BufferConfig)
    """Tasksets and the experience buffer."""
    explorer: ExplorerConfig = _field(ExplorerConfig)
    """Rollout engines and workflow runners."""
    trainer: TrainerConfig = _field(TrainerConfig)
    """The trainer."""
    synchronizer: SynchronizerConfig = _field(SynchronizerConfig)
    """Weight sync between trainer and explorer."""
    monitor: MonitorConfig = _field(MonitorConfig)
    """Metrics sinks."""
    data_processor: DataProcessorConfig = _field(DataProcessorConfig)
    """Data pipelines: a task pipeline before exploring, an experience pipeline before the DB (docs/pipelines.md)."""
    log: LogConfig = _field(LogConfig)
    """Logging."""
    stages: list[StageConfig] = _field(list)
    """Stages run in order, each inheriting this config (e.g. SFT warm-up, then RFT)."""
