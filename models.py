"""Load models and tokenizers: the one place the project does, so every script loads them alike.

    from models import load_model, load_tokenizer
    tokenizer = load_tokenizer("assets/tiny-qwen2")        # built by `python tiny.py`
    model = load_model("assets/tiny-qwen2", dtype="float32", device="cpu")
    identity = fingerprint("assets/tiny-qwen2", tokenizer)  # what processes sharing a DB must agree on

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

import hashlib
import json
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel,
                          PreTrainedTokenizerBase, PreTrainedTokenizerFast)

# What tokenizer_config.json may say for "load tokenizer.json as is"; transformers 5 writes the
# second name for the first class (PreTrainedTokenizerFast is now an alias of TokenizersBackend).
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


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


def load_model(path: str, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """A causal LM in eval mode. dtype: "float32" | "bfloat16" | "float16" (float32 on CPU:
    bf16 matmuls are 3-5x slower there)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(device).eval()


# config.json keys that decide whether token ids and weights mean the same thing on both sides
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def fingerprint(path: str, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The architecture (config.json's ARCH_KEYS) and a hash of the tokenizer (vocabulary, special
    tokens, chat template) of a model: equal for a model and its fine-tuned checkpoints."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).to_dict()
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token, tokenizer.pad_token,
                       tokenizer.chat_template], ensure_ascii=False)
    return {**{k: config.get(k) for k in ARCH_KEYS}, "tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
