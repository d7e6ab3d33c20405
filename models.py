"""Models and tokenizers: the one place the project loads them, so that every script loads them alike (trainer,
explorer, engines, scripts), with the attention implementation they all run (gqa_sdpa; segment_attention for the
trainer's packed micro-batches), and the fingerprint that processes sharing an experience DB must agree on.

    from models import load_model, load_tokenizer
    tokenizer = load_tokenizer("assets/tiny-qwen2")        # built by `python tiny.py`
    model = load_model("assets/tiny-qwen2", dtype="float32", device="cpu")
    identity = fingerprint("assets/tiny-qwen2", tokenizer)  # what processes sharing a DB must agree on
    critic = load_critic("assets/tiny-qwen2")               # the same body with a scalar value head (ppo)

Works the same for a hub name or a local Hugging Face folder (Qwen2.5-1.5B-Instruct, ...). The trainer shards
these models in scoring.py; offline SFT / DPO rows become experiences in source.py.

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import (
    AttentionInterface,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as transformers_logging

from configs.hub import is_hub_id
from configs.preflight import model_problem
from configs.schema import ModelConfig
from errors import ConfigError

# What tokenizer_config.json may say for "load tokenizer.json as is"; transformers 5 writes the
# second name for the first class (PreTrainedTokenizerFast is now an alias of TokenizersBackend).
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


@contextlib.contextmanager
def loading(path: str) -> Iterator[None]:
    """Around the first load of a configured model (config_tokenizer, scoring.build_model): where it fails because
    `path` is no loadable model (a missing folder, one without config.json or weights: configs.preflight.model_problem),
    the ConfigError saying so instead of transformers' traceback (which takes a missing folder for a malformed hub id).
    Other failures pass as they are. NOTE: not in load_model itself: an engine reloading published weights falls back on
    the OSError of a folder being replaced (sync.load_published)."""
    try:
        yield
    except (OSError, ValueError):
        if (why := model_problem(path)) is None:
            raise
        raise ConfigError(
            f"cannot load a model from {path}: {why}; fix the key that names it (model.model_path, "
            "model.critic_model_path, explorer.auxiliary_models[].model_path)"
        ) from None


def model_file(path: str, name: str) -> Path | None:
    """File `name` of model `path`: in its folder, or for a hub id in the HF cache (where the launcher downloaded it:
    configs/hub.py); None where neither holds it."""
    local = Path(path) / name
    if local.is_file() or not is_hub_id(path):
        return local if local.is_file() else None
    try:
        cached = try_to_load_from_cache(path, name)
    except ValueError:  # a name the hub refuses (HFValidationError: "--", ".."): in no cache
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The model's own tokenizer.json when it asks for the generic class, else AutoTokenizer; alike for a folder and
    for a hub id (NOTE: AutoTokenizer on a hub id gave the tiny model Qwen2Tokenizer: other ids for "cafe\u0301")."""
    config = model_file(path, "tokenizer_config.json")
    wanted = json.loads(config.read_text()).get("tokenizer_class") if config else None
    if model_file(path, "tokenizer.json") and wanted in GENERIC_TOKENIZERS:
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
        # NOTE: an instance-level partial, so that every apply_chat_template call (source.render, the rollout
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
    batching.packed_inputs()): segment_attention; with `ulysses` too (sequence parallelism), over the whole sequence
    of a share of the heads (ulysses.SeqParallel.attend). Else transformers' "sdpa", except that on CPU grouped K/V
    heads (GQA) go to torch's SDPA as they are (enable_gqa). NOTE: transformers repeats K/V for every query head
    whenever a mask is given (left padding in the engine), which on CPU copied the whole KV cache in every layer at
    every decode step: 40% of the decode time (docs/LOG.md). On CUDA, SDPA with a mask and enable_gqa falls back to
    its slowest kernel, so there (and for position-bias models) this is transformers' own sdpa."""
    if kwargs.get("ulysses") is not None:  # sequence parallelism (ulysses.py): this rank's columns, all heads
        attend = functools.partial(segment_attention, segments=kwargs["segments"], scaling=scaling)
        return kwargs["ulysses"].attend(query, key, value, attend), None
    if kwargs.get("segments") is not None:
        return segment_attention(query, key, value, kwargs["segments"], scaling), None
    if query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
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
    """Attention of packed rows [R, heads, W, d] computed per segment instead of over whole rows: each unit's prompt
    attends causally to itself; each response attends to its unit's prompt and causally to itself. `segments` (from
    batching.packed_inputs()): per part, the flat positions of its queries [S,Q] and keys [S,K] and a mask [S,1,Q,K];
    padding queries attend to one key and their output is dropped. Returns [R, W, heads, d] (zeros at padding). NOTE: a
    dense [R,1,W,W] mask over rows of a whole group (prompt + 8 responses) computed ~5x the attention scores needed
    (docs/LOG.md)."""
    R, H, W, d = query.shape
    q = query.transpose(1, 2).reshape(R * W, H, d)  # [RW, H, d]
    k, v = (x.transpose(1, 2).reshape(R * W, x.shape[1], d) for x in (key, value))  # [RW, KV, d] each
    gqa, out = k.shape[1] != H, None
    for part, (qi, ki, mask, valid) in enumerate(segments["parts"]):
        kk, vv = k[ki].transpose(1, 2), v[ki].transpose(1, 2)  # [S, KV, K, d]
        if gqa and q.device.type != "cpu":  # CUDA: SDPA with a mask and enable_gqa falls back to its math kernel
            kk, vv = (x.repeat_interleave(H // kk.shape[1], dim=1) for x in (kk, vv))  # [S, H, K, d]
        o = torch.nn.functional.scaled_dot_product_attention(  # [S, H, Q, d]
            q[qi].transpose(1, 2),
            kk,
            vv,
            attn_mask=additive_mask(segments, part, mask, q.dtype),
            scale=scaling,
            enable_gqa=gqa and q.device.type == "cpu",
        )
        out = o.new_zeros(R * W, H, d) if out is None else out  # [RW, H, d] in SDPA's dtype (autocast)
        out = out.index_put((qi[valid],), o.transpose(1, 2)[valid])  # [RW, H, d]
    return out.view(R, W, H, d)


def additive_mask(segments: dict, part: int, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bool mask [S,1,Q,K] of part `part` of `segments` as SDPA's additive mask in `dtype` (0 where a key is seen,
    -inf elsewhere), made once per micro-batch and kept in `segments`: every layer's attention shares it. NOTE: given
    the bool mask, SDPA made a float copy of it in every layer and kept each for the backward pass, as much as a third
    of the activations of a long packed sequence (docs/LOG.md, 2026-11-30)."""
    made = segments.setdefault("additive", {})
    if (part, dtype) not in made:
        made[part, dtype] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return made[part, dtype]


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
    CPU: bf16 matmuls are 3-5x slower there; a config's bf16 / fp16 / auto are resolved to these by configs.derive).
    device "meta": the model without its weights, from its config alone (no memory, nothing read but config.json)."""
    transformers_logging.disable_progress_bar()  # its "Loading weights" bar, at every weight load, is log noise
    if device == "meta":
        return on_meta(AutoModelForCausalLM, AutoConfig.from_pretrained(path), torch_dtype(dtype))
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch_dtype(dtype), attn_implementation=register_attention()
    )
    return model.to(device).eval()


def load_critic(path: str, device: str = "cpu") -> PreTrainedModel:
    """A value model, as veRL's critic: AutoModelForTokenClassification with one label, i.e. the causal
    LM's body with a scalar head (new and small at first; a critic checkpoint loads with its head).
    NOTE: classifier dropout is set to 0, else the values in the loss would differ from the old values.
    device "meta": as load_model's."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    if device == "meta":
        return on_meta(AutoModelForTokenClassification, config, torch.float32)
    with torch.random.fork_rng():  # NOTE: a new head is drawn alike on every rank (FSDP2 keeps each rank's shard)
        torch.manual_seed(0)
        return AutoModelForTokenClassification.from_pretrained(
            path, config=config, dtype=torch.float32, attn_implementation=register_attention()
        ).eval()


def on_meta(auto: type, config: Any, dtype: torch.dtype) -> PreTrainedModel:
    """The model `auto` builds from `config`, its parameters and buffers on the meta device (shapes only)."""
    with torch.device("meta"):
        return auto.from_config(config, dtype=dtype, attn_implementation=register_attention()).eval()


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


def eos_ids(tokenizer: PreTrainedTokenizerBase, generation_config: GenerationConfig | None) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the generation config's eos_token_id (an id or a list;
    Qwen2.5-Instruct's are <|im_end|> and <|endoftext|>), on any of which transformers' generate and vLLM stop."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
    return sorted({tokenizer.eos_token_id, *gen_eos} - {None})


def generation_config(path: str) -> GenerationConfig | None:
    """The generation config a model folder loads with, in transformers as in vLLM (generation_config "auto"): its
    generation_config.json, else one made from its config.json; None when neither reads."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        try:
            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
        except (OSError, ValueError):
            return None
