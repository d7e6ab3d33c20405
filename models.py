"""Models, tokenizers and what the trainer feeds them: the one place the project loads models, so every
script loads them alike; offline SFT / DPO rows tokenized into experiences; the trainer's step batch,
packed micro-batches, and the FSDP2-sharded scorer (`build_model`) that turns them into log-probs and values.

    from models import load_model, load_tokenizer
    tokenizer = load_tokenizer("assets/tiny-qwen2")        # built by `python tiny.py`
    model = load_model("assets/tiny-qwen2", dtype="float32", device="cpu")
    identity = fingerprint("assets/tiny-qwen2", tokenizer)  # what processes sharing a DB must agree on
    critic = load_critic("assets/tiny-qwen2")               # the same body with a scalar value head (ppo)
    exp = sft_experience(messages, tokenizer, max_len=256)  # offline SFT / DPO rows as token ids + mask

Works the same for a hub name or a local Hugging Face folder (Qwen2.5-1.5B-Instruct, ...).

Why not plain AutoTokenizer (checked with transformers 5.20.2 on the folder tiny.py writes):
AutoTokenizer returns Qwen2Tokenizer for `model_type: qwen2`, even though tokenizer_config.json
names PreTrainedTokenizerFast. It keeps our vocabulary and special tokens (ASCII round-trips and
`<|im_start|>` is one id), but it replaces our pre-tokenizer with Qwen's regex split and adds an
NFC normalizer, so text that is not NFC-normalised no longer round-trips ("cafe\\u0301" comes
back as "caf\\u00e9", with different ids), and a vocabulary that is not byte-level would break
outright. PreTrainedTokenizerFast loads tokenizer.json exactly as saved.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as transformers_logging

import algos
import lora
from buffer import Experience
from configs import piece_config
from configs.preflight import model_problem
from configs.schema import AlgorithmConfig, ExperienceBufferConfig, LoRAConfig, ModelConfig, TrainerConfig
from errors import ConfigError, DataError
from tasksets import format_row, read_rows

# What tokenizer_config.json may say for "load tokenizer.json as is"; transformers 5 writes the
# second name for the first class (PreTrainedTokenizerFast is now an alias of TokenizersBackend).
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


@contextlib.contextmanager
def loading(path: str) -> Iterator[None]:
    """Around the first load of a configured model (config_tokenizer, build_model): where it fails because `path` is
    no loadable model (a missing folder, one without config.json or weights: configs.preflight.model_problem), the
    ConfigError saying so instead of transformers' traceback (which takes a missing folder for a malformed hub id).
    Other failures pass as they are. NOTE: not in load_model itself: an engine reloading published weights falls
    back on the OSError of a folder being replaced (explore.load_published)."""
    try:
        yield
    except (OSError, ValueError):
        if (why := model_problem(path)) is None:
            raise
        raise ConfigError(
            f"cannot load a model from {path}: {why}; fix the key that names it (model.model_path, "
            "model.critic_model_path, explorer.auxiliary_models[].model_path)"
        ) from None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's own tokenizer.json when it asks for the generic class, else AutoTokenizer."""
    folder = Path(path)
    config = folder / "tokenizer_config.json"
    wanted = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if (folder / "tokenizer.json").is_file() and wanted in GENERIC_TOKENIZERS:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:  # batching needs one; Llama-style tokenizers ship without
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


GQA_SDPA = "nanorft_gqa_sdpa"  # the attention implementation the project's models use on CPU


def config_tokenizer(m: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of model.model_path with the config's chat template: model.chat_template_path's file, else
    model.custom_chat_template, else its own; model.enable_thinking, when set, reaches the template (Qwen3's reads
    it) in every rendering, SFT and rollout alike. Trainer and explorer both load it here (the DB identity check
    hashes the template)."""
    with loading(m.model_path):
        tokenizer = load_tokenizer(m.model_path)
    template = Path(m.chat_template_path).read_text() if m.chat_template_path else m.custom_chat_template
    tokenizer = with_template(tokenizer, template)
    if m.enable_thinking is not None:
        # NOTE: an instance-level partial, so that every apply_chat_template call (models.render, the rollout
        # handle) passes the variable; the class and other tokenizers are untouched
        tokenizer.apply_chat_template = functools.partial(
            tokenizer.apply_chat_template, enable_thinking=m.enable_thinking
        )
    return tokenizer


def with_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> PreTrainedTokenizerBase:
    """`tokenizer` itself, or a shallow copy rendering with chat `template` (format.chat_template,
    rollout_model.chat_template) when one is given."""
    if not template:
        return tokenizer
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def gqa_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention of every model the project loads. With `segments` (the trainer's packed micro-batches,
    pack()): segment_attention. Else transformers' "sdpa", except that on CPU grouped K/V heads (GQA) go to
    torch's SDPA as they are (enable_gqa). NOTE: transformers repeats K/V for every query head whenever a mask is
    given (left padding in the engine), which on CPU copied the whole KV cache in every layer at every decode
    step: 40% of the decode time (docs/LOG.md). On CUDA, SDPA with a mask and enable_gqa falls back to its
    slowest kernel, so there (and for position-bias models) this is transformers' own sdpa."""
    if kwargs.get("segments") is not None:
        return segment_attention(query, key, value, kwargs["segments"], scaling), None
    if query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(  # [B, heads, L, d]
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: dict, scaling: float | None
) -> torch.Tensor:
    """Attention of packed rows [R, heads, W, d] computed per segment instead of over whole rows: each unit's
    prompt attends causally to itself; each response attends to its unit's prompt and causally to itself.
    `segments` (from pack()): per part, the flat positions of its queries [S,Q] and keys [S,K] and a mask
    [S,1,Q,K]; padding queries attend to one key and their output is dropped. Returns [R, W, heads, d] (zeros
    at padding). NOTE: a dense [R,1,W,W] mask over rows of a whole group (prompt + 8 responses) computed ~5x
    the attention scores needed (docs/LOG.md)."""
    R, H, W, d = query.shape
    q = query.transpose(1, 2).reshape(R * W, H, d)  # [RW, H, d]
    k, v = (x.transpose(1, 2).reshape(R * W, x.shape[1], d) for x in (key, value))  # [RW, KV, d] each
    gqa, out = k.shape[1] != H, None
    for qi, ki, mask, valid in segments["parts"]:
        kk, vv = k[ki].transpose(1, 2), v[ki].transpose(1, 2)  # [S, KV, K, d]
        if gqa and q.device.type != "cpu":  # CUDA: SDPA with a mask and enable_gqa falls back to its math kernel
            kk, vv = (x.repeat_interleave(H // kk.shape[1], dim=1) for x in (kk, vv))  # [S, H, K, d]
        o = torch.nn.functional.scaled_dot_product_attention(  # [S, H, Q, d]
            q[qi].transpose(1, 2), kk, vv, attn_mask=mask, scale=scaling, enable_gqa=gqa and q.device.type == "cpu"
        )
        out = o.new_zeros(R * W, H, d) if out is None else out  # [RW, H, d] in SDPA's dtype (autocast)
        out = out.index_put((qi[valid],), o.transpose(1, 2)[valid])  # [RW, H, d]
    return out.view(R, W, H, d)


def register_attention() -> str:
    """Make GQA_SDPA known to transformers (its public AttentionInterface; sdpa's mask builder). Idempotent."""
    if GQA_SDPA not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(GQA_SDPA, gqa_sdpa)
        AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return GQA_SDPA


def torch_dtype(name: str) -> torch.dtype:
    """torch.<name> for a floating-point dtype's torch name; ValueError naming it otherwise."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a torch floating-point dtype name (float32, bfloat16, float16)")
    return dtype


def load_model(path: str, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A causal LM in eval mode, with gqa_sdpa attention. dtype: "float32" | "bfloat16" | "float16" (float32 on
    CPU: bf16 matmuls are 3-5x slower there; a config's bf16 / fp16 / auto are resolved to these by configs.derive)."""
    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, at every weight load, is log noise
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation=register_attention()
    )
    return model.to(device).eval()


def load_critic(path: str) -> PreTrainedModel:
    """A value model, as veRL's critic: AutoModelForTokenClassification with one label, i.e. the causal
    LM's body with a scalar head (new and small at first; a critic checkpoint loads with its head).
    NOTE: classifier dropout is set to 0, else the values in the loss would differ from the old values."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng():  # NOTE: a new head is drawn alike on every rank (FSDP2 keeps each rank's shard)
        torch.manual_seed(0)
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32, attn_implementation=register_attention()
        ).eval()


# --- offline data (SFT / DPO files) as experiences


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
    )


def sft_experience(
    messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_len: int, multi_turn: bool = False
) -> Experience:
    """One conversation as an Experience for SFT (or one side of a DPO pair): the chat-templated tokens,
    with the loss on the last assistant turn up to and including its end-of-turn token, or on every
    assistant turn (`multi_turn`, Trinity's enable_concatenated_multi_turn). The prompt is everything
    before the first trained turn; tokens between trained turns (user turns) are masked out."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns = turns if multi_turn else turns[-1:]
    full = render(tokenizer, messages)
    spans = []
    for i in turns:
        before, upto = render(tokenizer, messages[:i], True), render(tokenizer, messages[: i + 1])
        start = len(before)
        if full[: len(upto)] != upto or upto[:start] != before:
            raise DataError("the chat template renders a conversation's prefix differently from the whole conversation")
        turn = upto[start:]
        if tokenizer.eos_token_id in turn:  # drop what the template adds after the end of the turn
            turn = turn[: turn.index(tokenizer.eos_token_id) + 1]
        spans.append((start, start + len(turn)))
    tokens = torch.tensor(full[: min(spans[-1][1], max_len)], dtype=torch.long)  # [L]
    prompt = min(spans[0][0], max_len - 1, len(tokens) - 1)
    mask = torch.zeros(len(tokens), dtype=torch.bool)  # [L]
    for start, end in spans:
        mask[start:end] = True
    return Experience(tokens=tokens, prompt_length=prompt, action_mask=mask[prompt:], reward=0.0)


def dpo_experiences(row: dict, tokenizer: PreTrainedTokenizerBase, max_len: int, pair: str) -> list[Experience]:
    """A DPO row (prompt messages, chosen, rejected: strings or assistant message lists) as two
    Experiences, chosen first, sharing group_id `pair` (the trainer keeps the two together, in order)."""
    out = []
    for run_id, key in enumerate(("chosen", "rejected")):
        answer = row[key] if isinstance(row[key], list) else [{"role": "assistant", "content": str(row[key])}]
        exp = sft_experience(row["messages"] + answer, tokenizer, max_len)
        exp.group_id, exp.run_id = pair, run_id
        out.append(exp)
    return out


def file_units(eb: ExperienceBufferConfig, tokenizer, max_len: int) -> list[list[Experience]]:
    """An SFT or DPO data file as units: [one experience] per SFT conversation, [chosen, rejected] per pair."""
    if eb.schema_type not in ("sft", "dpo"):
        raise DataError(
            f"buffer {eb.name}: a file buffer for the trainer needs schema_type sft or dpo, got {eb.schema_type!r}"
        )
    units, tokenizer = [], with_template(tokenizer, eb.format.chat_template)
    for _, n, row in read_rows(eb.path, eb.subset_name, eb.split):
        f = format_row(row, eb.format, f"{eb.path}: row {n}", kind=eb.schema_type)
        units.append(
            dpo_experiences(f, tokenizer, max_len, f"pair/{n}")
            if eb.schema_type == "dpo"
            else [sft_experience(f["messages"], tokenizer, max_len, eb.format.enable_concatenated_multi_turn)]
        )
    if not units:
        raise DataError(f"buffer {eb.name}: {eb.path} has no rows")
    return units


def pick(units: list[list[Experience]], first: int, count: int, tag: str) -> list[Experience]:
    """Units first .. first + count - 1 of a seeded order of `units` per epoch (tag/epoch seeds it)."""
    positions = [divmod(pos, len(units)) for pos in range(first, first + count)] if units else []  # (epoch, index)
    orders = {e: random.Random(f"{tag}/{e}").sample(range(len(units)), len(units)) for e, _ in positions}
    return [x for e, i in positions for x in units[orders[e][i]]]


# --- the trainer's batches: the step batch (dense, built once), packed micro-batches, log-probs and values


def episode_key(x: Experience, b: int) -> tuple:
    """The turns of one multi-turn episode share it (their group and info["episode"]); any other row is its own."""
    return (x.group_id, x.info["episode"]) if x.group_id and "episode" in x.info else ("row", b)


def step_batch(
    exps: list[Experience], width: int, temperatures: dict[str, float] | None = None
) -> dict[str, torch.Tensor]:
    """The step's experiences as dense tensors, built once; the trainer's later phases read and extend it.
    Per sequence [B]: prompt_lengths, response_lengths, rewards, group_index (a task's repeats share it; an
    experience without a group is its own), episode_index (the turns of one episode share it), prompt_index
    (same prompt token ids, same index: pack() shares them), expert (mix: expert SFT rows), has_rollout_logprobs,
    temperature (the one it was sampled at, recorded by the rollout handle; else that of the taskset that produced
    it, from `temperatures`; else 1). A response to a truncated prompt gets an empty response_mask. Prompts [B,P]
    right-padded. Per response token [B,T]: responses (the token ids), response_mask (action tokens; the first
    token of a response without a prompt has no logit to score it), rollout_logprobs (0 where the engine gave
    none), expert_mask (1.0 on expert rows). has_stored_advantages [B], and only when some row carries them,
    stored_advantages [B,T] (an explorer-side advantage fn's, step_wise_grpo: no other algorithm pays for them).
    NOTE: T = max(width, the longest response): the trainer passes model.max_response_tokens, so that
    seq-mean-token-sum-norm divides by Dr.GRPO's constant whatever the batch holds."""
    B, P = len(exps), max(max(x.prompt_length for x in exps), 1)
    T = max(width, max(x.response_length for x in exps), 1)
    batch = {
        "prompts": torch.zeros(B, P, dtype=torch.long),
        "responses": torch.zeros(B, T, dtype=torch.long),
        "response_mask": torch.zeros(B, T, dtype=torch.bool),
        "rollout_logprobs": torch.zeros(B, T),
    }
    groups: dict[str, int] = {}
    episodes: dict[tuple, int] = {}
    prompts: dict[tuple[int, ...], int] = {}
    for b, x in enumerate(exps):
        p, r = x.prompt_length, x.response_length
        batch["prompts"][b, :p] = x.tokens[:p]
        batch["responses"][b, :r] = x.tokens[p:]
        batch["response_mask"][b, :r] = True if x.action_mask is None else x.action_mask
        batch["response_mask"][b, 0] &= p > 0
        if x.truncate_status == "prompt_truncated":  # the model saw a cut prompt: no loss (Trinity-RFT's rule)
            batch["response_mask"][b] = False
        if x.logprobs is not None:
            batch["rollout_logprobs"][b, :r] = x.logprobs
        groups.setdefault(x.group_id or f"id/{x.id}/{b}", len(groups))
        episodes.setdefault(episode_key(x, b), len(episodes))
        prompts.setdefault(tuple(x.tokens[:p].tolist()), len(prompts))
    batch |= {
        "prompt_lengths": torch.tensor([x.prompt_length for x in exps]),  # [B]
        "response_lengths": torch.tensor([x.response_length for x in exps]),  # [B]
        "rewards": torch.tensor([float(x.reward or 0.0) for x in exps]),  # [B]
        "group_index": torch.tensor([groups[x.group_id or f"id/{x.id}/{b}"] for b, x in enumerate(exps)]),  # [B]
        "episode_index": torch.tensor([episodes[episode_key(x, b)] for b, x in enumerate(exps)]),  # [B]
        "prompt_index": torch.tensor([prompts[tuple(x.tokens[: x.prompt_length].tolist())] for x in exps]),  # [B]
        "expert": torch.tensor([bool(x.info.get("expert")) for x in exps]),  # [B]
        "has_rollout_logprobs": torch.tensor([x.logprobs is not None for x in exps]),  # [B]
        "temperature": torch.tensor(
            [x.info.get("temperature") or (temperatures or {}).get(x.info.get("taskset"), 1.0) for x in exps]
        ),  # [B]
    }
    batch["expert_mask"] = batch["expert"][:, None].float().expand(B, T).contiguous()  # [B,T]
    batch["has_stored_advantages"] = torch.tensor([x.advantages is not None for x in exps])  # [B]
    if batch["has_stored_advantages"].any():  # only an explorer-side advantage fn's rows carry them (step_wise_grpo)
        batch["stored_advantages"] = torch.zeros(B, T)  # [B,T] (group_advantages)
        for b, x in enumerate(exps):
            if x.advantages is not None:
                batch["stored_advantages"][b, : x.response_length] = x.advantages
    return batch


def group_advantages(exps: list[Experience], algorithm: AlgorithmConfig) -> None:
    """With an advantage fn computed in the explorer (algos.EXPLORER_ADVANTAGE_FNS: step_wise_grpo), its advantages
    over one task's whole group, before it is written: exp.advantages [R]; a row it filters out (std_threshold)
    gets an empty action_mask (it leaves the loss, as in the trainer). A no-op for every other advantage fn."""
    fn = algos.EXPLORER_ADVANTAGE_FNS.get(algorithm.advantage_fn)
    if fn is None or not exps:
        return
    batch = step_batch(exps, 0)
    keys = ("rewards", "group_index", "episode_index", "response_mask")
    out, _ = fn(
        {k: batch[k] for k in keys}, piece_config("advantage_fn", algorithm.advantage_fn, algorithm.advantage_fn_args)
    )
    keep = out.get("keep", torch.ones(len(exps), dtype=torch.bool))  # [B]
    for b, x in enumerate(exps):
        x.advantages = out["advantages"][b, : x.response_length].float()  # [R]
        if not keep[b]:
            x.action_mask = torch.zeros(x.response_length, dtype=torch.bool)  # [R]


def pack_units(
    batch: dict[str, torch.Tensor], idx: list[int], share: bool, budget: int, paired: bool = False
) -> list[list[int]]:
    """The sequences idx cut into the units pack() lays out together: with `share`, those with the same
    prompt (a GRPO group, a DPO pair), split where one unit would pass `budget` tokens; else one each, or
    (`paired`: DPO rows, chosen then rejected) one pair each. Units keep idx's order inside."""
    if not share:
        return [idx[k : k + 2] for k in range(0, len(idx), 2)] if paired else [[i] for i in idx]
    by_prompt: dict[int, list[int]] = {}
    for i in idx:
        by_prompt.setdefault(int(batch["prompt_index"][i]), []).append(i)
    units = []
    for members in by_prompt.values():
        size = int(batch["prompt_lengths"][members[0]])
        units.append([])
        for i in members:
            n = int(batch["response_lengths"][i])
            if units[-1] and size + n > budget and len(units[-1]) % 2 == 0:  # NOTE: even: never split a DPO pair
                units.append([])
                size = int(batch["prompt_lengths"][i])
            units[-1].append(i)
            size += n
    return units


def unit_length(batch: dict[str, torch.Tensor], unit: list[int]) -> int:
    """Tokens of a unit laid out by pack(): its prompt once, then each member's response."""
    return int(batch["prompt_lengths"][unit[0]]) + int(batch["response_lengths"][unit].sum())


def micro_batches(
    batch: dict[str, torch.Tensor], units: list[list[int]], budget: int, fixed: int | None
) -> list[list[list[int]]]:
    """Units cut into micro-batches, largest first: at most `budget` packed tokens each (use_dynamic_bsz), or
    `fixed` sequences each. A unit larger than the budget goes alone."""
    out: list[list[list[int]]] = []
    size = 0
    for u in sorted(units, key=lambda u: -unit_length(batch, u)):
        n = len(u) if fixed else unit_length(batch, u)
        limit = fixed or budget
        if out and size + n <= limit:
            out[-1].append(u)
            size += n
        else:
            out.append([u])
            size = n
    return out


def pack(batch: dict[str, torch.Tensor], units: list[list[int]], share: bool, device: torch.device) -> dict:
    """Model inputs for the sequences of `units` (one micro-batch), each unit laid out as its prompt followed by
    each member's response (shared prompts: the prompt runs once for the whole group), the units bin-packed into
    rows as wide as the largest: input_ids / position_ids [R,W]; segments: what segment_attention needs so that
    a token sees the tokens before it in its own unit, except other members' responses; rows [n]: the batch rows
    of the micro-batch's sequences, in order; index [N]: where, in the flattened [R*W] rows, the state that
    predicts each valid response token is, and dest [N] where that token is in the flattened [n,T] (N = sum of
    response_mask over the rows). Without `share`, one sequence per row, right-padded, and a [R,W] mask."""
    rows_of_units = bin_pack([unit_length(batch, u) for u in units]) if share else [[k] for k in range(len(units))]
    W = max(unit_length(batch, u) for u in units)
    R, T = len(rows_of_units), batch["responses"].shape[1]
    ids, pos = torch.zeros(R, W, dtype=torch.long), torch.zeros(R, W, dtype=torch.long)
    order = [i for row in rows_of_units for k in row for i in units[k]]  # the micro-batch's rows, in layout order
    source = torch.zeros(len(order), T, dtype=torch.long)  # [n,T] flat position of each token's predictor
    prompts, responses = [], []  # flat positions of each unit's prompt; of each response, after its prompt's
    for r, row in enumerate(rows_of_units):
        col = r * W  # flat position of the next token
        for k in row:
            first = units[k][0]
            p = int(batch["prompt_lengths"][first])
            ids.view(-1)[col : col + p], pos.view(-1)[col : col + p] = batch["prompts"][first, :p], torch.arange(p)
            prompts.append(list(range(col, col + p)))
            col += p
            for i in units[k]:
                length = int(batch["response_lengths"][i])
                ids.view(-1)[col : col + length] = batch["responses"][i, :length]
                pos.view(-1)[col : col + length] = torch.arange(p, p + length)
                # NOTE: the state at position t predicts token t + 1: the response's first token is scored at the
                # prompt's last position, shared by the unit's members
                # (a response without a prompt has no state before its first token: response_mask drops it)
                predictors = (prompts[-1][-1:] or [col]) + list(range(col, col + length - 1))
                source[len(responses), :length] = torch.tensor(predictors[:length], dtype=torch.long)
                responses.append((prompts[-1], list(range(col, col + length))))
                col += length
    valid = batch["response_mask"][order]  # [n,T]
    mb = {"input_ids": ids, "position_ids": pos, "index": source[valid], "dest": valid.flatten().nonzero()[:, 0]}
    if share:  # the prompt part (causal in itself), then each response after its prompt
        parts = [
            segment_part([q for q in prompts if q], [0 for q in prompts if q]),
            segment_part([[*p, *q] for p, q in responses if q], [len(p) for p, q in responses if q]),
        ]
        mb["segments"] = {"parts": [tuple(x.to(device) for x in part) for part in parts if part[0].numel()]}
    else:
        lengths = torch.tensor([unit_length(batch, u) for u in units])  # [R]
        mb["attention_mask"] = (torch.arange(W)[None, :] < lengths[:, None]).long()  # [R,W]
    return {**{k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}, "rows": torch.tensor(order)}


def segment_part(keys: list[list[int]], prefix: list[int]) -> tuple[torch.Tensor, ...]:
    """segment_attention's tensors for segments whose keys are `keys[s]` (flat positions): the first `prefix[s]`
    are seen by every query, the rest are the queries themselves (causal). (queries [S,Q], keys [S,K],
    mask [S,1,Q,K], valid queries [S,Q]); padding is position 0, and a padding query sees key 0 only."""
    S = len(keys)
    K = max((len(k) for k in keys), default=1)
    Q = max((len(k) - p for k, p in zip(keys, prefix)), default=1)
    ki = torch.tensor([k + [0] * (K - len(k)) for k in keys], dtype=torch.long).view(S, K)  # [S,K]
    qi = torch.tensor([k[p:] + [0] * (Q - len(k) + p) for k, p in zip(keys, prefix)], dtype=torch.long).view(S, Q)
    first = torch.tensor(prefix)[:, None, None]  # [S,1,1] prefix keys
    n_keys = torch.tensor([len(k) for k in keys])[:, None, None]  # [S,1,1]
    q, k = torch.arange(Q)[None, :, None], torch.arange(K)[None, None, :]  # [1,Q,1], [1,1,K]
    valid = (q < n_keys - first)[:, :, 0]  # [S,Q]
    mask = (k < first) | ((k - first <= q) & (k < n_keys))  # [S,Q,K]
    mask = (mask & valid[:, :, None]) | (~valid[:, :, None] & (k == 0))  # [S,Q,K] padding queries see key 0
    return qi, ki, mask[:, None], valid


def bin_pack(lengths: list[int]) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` in rows as wide as the largest."""
    width, rows, room = max(lengths), [], []
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        r = next((r for r, free in enumerate(room) if free >= lengths[k]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(k)
        room[r] -= lengths[k]
    return rows


CHUNK_ELEMENTS = 2**25  # logits materialised at once: [tokens, V] fp32 of at most 128 MB


class TokenScorer(torch.nn.Module):
    """What the trainer shards with FSDP2 (its root): an HF causal LM, or a critic, run on a packed micro-batch
    (pack()), returning a value per response token of the micro-batch's sequences, as dense [n,T] tensors (0 on
    masked tokens): the log-prob of each token at `temperature` and, if asked, the entropy of the distribution
    it was drawn from (causal LM); the value of the state before it (critic, veRL's convention).
    NOTE: the vocabulary projection runs on the scored positions only, in chunks of CHUNK_ELEMENTS logits, each
    recomputed in the backward pass (activation checkpointing): Qwen's 152k vocabulary at 16k tokens would be
    ~10 GB per fp32 tensor otherwise. A model whose head does more than a linear map (soft-capping, scaling)
    is refused rather than scored wrongly. `adapter`: the model's LoRA adapter (lora.wrap), or None."""

    def __init__(self, model: PreTrainedModel, critic: bool = False, adapter: lora.Adapter | None = None) -> None:
        super().__init__()
        self.model, self.critic, self.adapter = model, critic, adapter
        extras = [
            k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(model.config, k, None)
        ]
        if extras and not critic:
            raise ValueError(
                f"{model.config.model_type}: the trainer's scorer supports a plain linear LM head; "
                f"this model also applies {extras}"
            )

    def forward(
        self, mb: dict, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, T = len(mb["rows"]), mb["width"]
        inputs = {
            "input_ids": mb["input_ids"],
            "attention_mask": mb.get("attention_mask"),
            "position_ids": mb["position_ids"],
            "use_cache": False,
            "segments": mb.get("segments"),
        }
        if self.critic:
            values = self.model(**inputs).logits.flatten(0, 1)[mb["index"], 0].float()  # [N]
            return scatter(values, mb["dest"], n, T), None
        hidden = self.model.base_model(**inputs).last_hidden_state.flatten(0, 1)[mb["index"]]  # [N,H]
        targets, temperature = mb["targets"], mb["temperature"]  # [N], [N]
        head, step = self.model.get_output_embeddings(), max(1, CHUNK_ELEMENTS // self.model.config.vocab_size)
        chunks = [
            (hidden[i : i + step], targets[i : i + step], temperature[i : i + step])
            for i in range(0, max(len(targets), 1), step)
        ]
        parts = [
            checkpoint(head_logprobs, *c, head, entropy, entropy_grad, use_reentrant=False)
            if len(chunks) > 1
            else head_logprobs(*c, head, entropy, entropy_grad)
            for c in chunks
        ]
        logp = scatter(torch.cat([p[0] for p in parts]), mb["dest"], n, T)  # [n,T]
        ent = scatter(torch.cat([p[1] for p in parts]), mb["dest"], n, T) if entropy else None  # [n,T]
        return logp, ent


def setup_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group (or a one-process group); this rank, world size and device."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # a plain process: a group of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(
    path: str,
    t: TrainerConfig,
    device: torch.device,
    trainable: bool,
    critic: bool = False,
    adapter: tuple[LoRAConfig, str] | None = None,
) -> TokenScorer:
    """An HF causal LM (or, `critic`, the value model) in a models.TokenScorer, sharded with FSDP2: each decoder
    layer, then the scorer (the root: embeddings, final norm and head). `adapter` (lora.start): a LoRA adapter is put
    into the HF model first (lora.wrap), so that each layer's FSDP2 group holds its frozen weights and its A and B."""
    with loading(path):
        hf = load_critic(path) if critic else load_model(path, dtype="float32", device="cpu")
    lora_adapter = lora.wrap(hf, *adapter) if adapter else None
    if trainable and (t.critic.gradient_checkpointing if critic else t.gradient_checkpointing):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cuda = device.type == "cuda"
    # bf16 compute with fp32 master weights and fp32 gradient reduction on GPU; fp32 throughout on CPU.
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cuda else {}
    if cuda and (t.critic.param_offload if critic else t.param_offload if trainable else t.ref_param_offload):
        policy["offload_policy"] = CPUOffloadPolicy()
    model = TokenScorer(hf, critic=critic, adapter=lora_adapter)
    for layer in hf.base_model.layers:
        fully_shard(layer, **policy)
    fully_shard(model, **policy)  # NOTE: last, so tied embeddings / lm_head share one root group
    model.train(trainable)
    if not trainable:
        model.requires_grad_(False)
    return model


def head_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: torch.Tensor,
    head: torch.nn.Module,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(hidden [N,H]) / temperature [N]) at the targets [N], and the entropy [N] (no gradient
    unless entropy_grad: an entropy term with coefficient 0 is a metric only)."""
    logits = head(hidden).float() / temperature[:, None]  # [N,V]
    lse = logits.logsumexp(-1)  # [N]
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse  # [N]
    if not entropy:
        return logp, logp.new_zeros(0)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = lse - (logits.softmax(-1) * logits).sum(-1)  # [N]
    return logp, ent


def scatter(values: torch.Tensor, dest: torch.Tensor, n: int, T: int) -> torch.Tensor:
    """[n,T] zeros with values [N] at the flat positions dest [N] (differentiable in values). NOTE: not a view of
    a flat tensor: FSDP2 warns that an in-place op on a view returned by its root would skip its hooks."""
    return values.new_zeros(n, T).index_put((dest // T, dest % T), values)


def micro_batch(
    batch: dict[str, torch.Tensor],
    units: list[list[int]],
    share: bool,
    device: torch.device,
    keys: tuple[str, ...] = (),
) -> dict:
    """pack() plus what the loss reads: targets [N], width T, and the step batch's [B,T] / [B] tensors `keys`
    (and response_mask) at the micro-batch's rows, in layout order."""
    mb = pack(batch, units, share, device)
    rows = mb["rows"]
    mb["width"] = T = batch["responses"].shape[1]
    dest = mb["dest"].cpu()
    mb["targets"] = batch["responses"][rows].flatten()[dest].to(device)  # [N]
    mb["temperature"] = batch["temperature"][rows, None].expand(len(rows), T).flatten()[dest].to(device)  # [N]
    for k in ("response_mask", *keys):
        mb[k] = batch[k][rows].to(device)
    return mb


@torch.no_grad()
def score(
    scorer: TokenScorer, batch: dict[str, torch.Tensor], mine: list[list[list[int]]], share: bool, device: torch.device
) -> torch.Tensor:
    """log-probs (or values) [B,T] of this rank's micro-batches `mine`, zero on the other ranks' rows."""
    out = torch.zeros(batch["responses"].shape)  # [B,T]
    was_training = scorer.training
    scorer.eval()
    for units in mine:
        mb = micro_batch(batch, units, share, device)
        out[mb["rows"]] = scorer(mb)[0].float().cpu()
    scorer.train(was_training)
    return out


# config.json keys that decide whether token ids and weights mean the same thing on both sides
ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "tie_word_embeddings",
)


def fingerprint(path: str, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The architecture (config.json's ARCH_KEYS) and a hash of the tokenizer (vocabulary, special
    tokens, chat template) of a model: equal for a model and its fine-tuned checkpoints."""
    config = AutoConfig.from_pretrained(path).to_dict()
    text = json.dumps(
        [sorted(tokenizer.get_vocab().items()), tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template],
        ensure_ascii=False,
    )
    return {**{k: config.get(k) for k in ARCH_KEYS}, "tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
