"""Models, tokenizers and what the trainer feeds them: the one place the project loads models, so every
script loads them alike; offline SFT / DPO rows tokenized into experiences; padded batches, log-probs
and values.

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

import hashlib
import json
import random
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer,
                          PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast)

from buffer import DataError, Experience, format_row, read_rows
from configs import Config, ExperienceBufferConfig

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


def load_critic(path: str) -> PreTrainedModel:
    """A value model, as veRL's critic: AutoModelForTokenClassification with one label, i.e. the causal
    LM's body with a scalar head (new and small at first; a critic checkpoint loads with its head).
    NOTE: classifier dropout is set to 0, else the values in the loss would differ from the old values."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    with torch.random.fork_rng():  # NOTE: a new head is drawn alike on every rank (FSDP2 keeps each rank's shard)
        torch.manual_seed(0)
        return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32).eval()


# --- offline data (SFT / DPO files) as experiences


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False) -> list[int]:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                         return_dict=False)


def sft_experience(messages: list[dict], tokenizer: PreTrainedTokenizerBase, max_len: int,
                   multi_turn: bool = False) -> Experience:
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
        raise DataError(f"buffer {eb.name}: a file buffer for the trainer needs schema_type sft or dpo, got {eb.schema_type!r}")
    units = []
    for _, n, row in read_rows(eb.path, eb.subset_name, eb.split):
        f = format_row(row, eb.format, f"{eb.path}: row {n}", kind=eb.schema_type)
        units.append(dpo_experiences(f, tokenizer, max_len, f"pair/{n}") if eb.schema_type == "dpo" else
                     [sft_experience(f["messages"], tokenizer, max_len, eb.format.enable_concatenated_multi_turn)])
    if not units:
        raise DataError(f"buffer {eb.name}: {eb.path} has no rows")
    return units


def pick(units: list[list[Experience]], first: int, count: int, tag: str) -> list[Experience]:
    """Units first .. first + count - 1 of a seeded order of `units` per epoch (tag/epoch seeds it)."""
    positions = [divmod(pos, len(units)) for pos in range(first, first + count)] if units else []  # (epoch, index)
    orders = {e: random.Random(f"{tag}/{e}").sample(range(len(units)), len(units)) for e, _ in positions}
    return [x for e, i in positions for x in units[orders[e][i]]]


# --- batches: model inputs, log-probs and values


def micro_batches(lengths: list[int], budget: int, fixed: int | None, units: list[list[int]] | None = None) -> list[list[int]]:
    """Indices cut into micro-batches, longest first: at most `budget` tokens each counting padding
    (use_dynamic_bsz), or `fixed` sequences each. A sequence longer than the budget goes alone.
    `units`: indices that must stay together and in order (a DPO pair); default: every index alone."""
    units = sorted(units if units is not None else [[i] for i in range(len(lengths))], key=lambda u: -max(lengths[i] for i in u))
    out: list[list[int]] = []
    for u in units:
        n = len(out[-1]) + len(u) if out else 0
        if out and (n <= fixed if fixed else n * max(lengths[i] for i in out[-1]) <= budget):
            out[-1].extend(u)
        else:
            out.append(list(u))
    return out


def collate(exps: list[Experience], extra: dict[str, list[torch.Tensor]], idx: list[int], device: torch.device) -> dict:
    """Right-padded model inputs [B,L] and response-aligned tensors [B,T] for the experiences `idx`."""
    rows = [exps[i] for i in idx]
    B, L, T = len(rows), max(len(x.tokens) for x in rows), max(max(x.response_length for x in rows), 1)
    batch = {"input_ids": torch.zeros(B, L, dtype=torch.long), "attention_mask": torch.zeros(B, L, dtype=torch.long),
             "positions": torch.zeros(B, T, dtype=torch.long), "targets": torch.zeros(B, T, dtype=torch.long),
             "response_mask": torch.zeros(B, T, dtype=torch.bool), "rewards": torch.tensor([x.reward for x in rows])}
    for b, x in enumerate(rows):
        n, p, r = len(x.tokens), x.prompt_length, x.response_length
        batch["input_ids"][b, :n] = x.tokens
        batch["attention_mask"][b, :n] = 1
        # NOTE: the logits at position t predict token t + 1, so response token p + j is read at p + j - 1.
        batch["positions"][b, :r] = torch.arange(p - 1, n - 1).clamp(min=0)
        batch["targets"][b, :r] = x.tokens[p:]
        batch["response_mask"][b, :r] = True if x.action_mask is None else x.action_mask
        batch["response_mask"][b, 0] &= p > 0  # a response with no prompt has no logit for its first token
    for name, values in extra.items():
        batch[name] = torch.zeros(B, T)
        for b, i in enumerate(idx):
            batch[name][b, : len(values[i])] = values[i]
    return {k: v.to(device) for k, v in batch.items()}


def token_logprobs(model, mb: dict, temperature: float, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [B,T] under `model` at the rollout temperature, and the entropy [B,T]."""
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits  # [B,L,V]
    rows = torch.arange(logits.shape[0], device=logits.device)[:, None]  # [B,1]
    logits = logits[rows, mb["positions"]].float() / temperature  # [B,T,V] response positions only
    logp = torch.log_softmax(logits, dim=-1)  # [B,T,V]
    out = logp.gather(-1, mb["targets"][..., None]).squeeze(-1)  # [B,T]
    ent = -(logp.exp() * logp).sum(-1) if entropy else None  # [B,T]
    return out, ent


def token_values(critic, mb: dict) -> torch.Tensor:
    """The critic's value [B,T] of the state before each response token (0 on masked tokens, as veRL)."""
    out = critic(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits  # [B,L,1]
    rows = torch.arange(out.shape[0], device=out.device)[:, None]  # [B,1]
    return out[rows, mb["positions"], 0].float() * mb["response_mask"]  # [B,T]


@torch.no_grad()
def score(model, exps: list[Experience], cfg: Config, device, forward) -> list[torch.Tensor]:
    """Per-experience `forward(model, micro-batch)` [B,T] (log-probs or values) as 1-D tensors of length R, no grad."""
    t, out = cfg.trainer, [torch.empty(0)] * len(exps)
    was_training = model.training
    model.eval()
    for idx in micro_batches([len(x.tokens) for x in exps], t.max_token_len_per_gpu, None if t.use_dynamic_bsz else t.log_prob_micro_batch_size_per_gpu):
        values = forward(model, collate(exps, {}, idx, device))
        for b, i in enumerate(idx):
            out[i] = values[b, : exps[i].response_length].float().cpu()
    model.train(was_training)
    return out


# config.json keys that decide whether token ids and weights mean the same thing on both sides
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "tie_word_embeddings")


def fingerprint(path: str, tokenizer: PreTrainedTokenizerBase) -> dict:
    """The architecture (config.json's ARCH_KEYS) and a hash of the tokenizer (vocabulary, special
    tokens, chat template) of a model: equal for a model and its fine-tuned checkpoints."""
    config = AutoConfig.from_pretrained(path).to_dict()
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token, tokenizer.pad_token,
                       tokenizer.chat_template], ensure_ascii=False)
    return {**{k: config.get(k) for k in ARCH_KEYS}, "tokenizer_sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
