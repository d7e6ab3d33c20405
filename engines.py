"""Rollout engines: token ids in, sampled token ids and their log-probs out, behind one interface.

    from engines import EngineHandle, HFEngine, SamplingParams, make_engine
    engine = HFEngine("assets/tiny-qwen2")                      # or make_engine(cfg.explorer.rollout_model, ...)
    out = engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(n=4, temperature=0.7, max_tokens=64),
                                                 SamplingParams(temperature=0.0, stop=["\\n"])])
    out[0][2].token_ids, out[0][2].logprobs, out[0][2].finish_reason     # request 0, sample 2
    future = engine.submit([1, 2, 3], SamplingParams(n=8))     # from any thread; batched with others
    engine.load_weights("checkpoints/step_10", version=10)     # or a state dict
    handle = EngineHandle(engine, engine.tokenizer, {"temperature": 1.0, "max_tokens": 256})
    exps = handle.chat([{"role": "user", "content": "What is 2 + 3?"}], n=8)   # buffer.Experience
    engine.close()

A request's SamplingParams and Completion, its checks and the Batcher that gathers requests into shared batches are
sampling.py's (every engine's). Every engine has `generate(prompt_ids, params)`, `submit(prompt_ids, params) -> Future`,
`score(sequences, temperature)` (each token's log-prob given those before it: a teacher scoring a student's tokens),
`load_weights(source, version)` and `model_version`. Workflows only see an `EngineHandle` (what it offers them:
workflows.ModelHandle).
- HFEngine (engine_type "hf") runs anywhere: its own decode loop over a left-padded batch with a KV
  cache, because one batch mixes requests with different sampling params (model.generate cannot).
- vLLM (engine_type "vllm" / "vllm_async") is the GPU production path: vllm_engine.py, engine_num engines.
- CannedEngine wraps either for `explore.py --debug --reply TEXT`: canned replies instead of samples, scored by it.
Same seed -> same samples within one engine; a different batch composition can, rarely, flip a
near-tie (float rounding of padded batches), as in vLLM. Concurrent `submit` calls share batches.
Log-probs (`rollout_logprobs`) are log_softmax(raw logits / temperature) at the sampled token, over
the full vocabulary with the EOS ids masked where min_tokens masks them (as vLLM's processed log-probs; the trainer
masks the same positions: batching.eos_masked), before top-k / top-p filtering (temperature 0 counts as 1.0).
The sampled token ids include the EOS token that ended a response (the trainer must see it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import importlib.util
import logging
import os
import random
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from buffer import Experience
from chat_template import chat_ids
from configs.resolve import explorer_gpu_plan
from configs.schema import ExternalModelConfig
from errors import ConfigError
from models import eos_ids, load_model, load_tokenizer, with_template
from sampling import Batcher, Completion, PromptTooLong, SamplingParams, check_scoring, collect, scored_temperature

log = logging.getLogger("nanorft.engines")
SCORE_ELEMENTS = 2**26  # logits per scoring pass (HFEngine.score; 256 MB of float32): a 152k vocabulary at ~440 tokens


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering, per row: filtered logits are -inf.
    logits [B, V]; top_k [B] long (V = off); top_p [B] float (1 = off)."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    drop = torch.arange(V, device=logits.device).expand(B, V) >= top_k[:, None]  # [B, V]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)  # [B, V]
    # keep the smallest prefix whose mass reaches top_p (the most likely token is always kept)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


class Sampler:
    """The per-row sampling state of one decode batch, vectorised: temperature, top-k / top-p, min_tokens,
    the token budget, and each row's uniform draws, made up front from its own seeded generator (so a row's
    samples depend on its seed and sample index only, not on what else is in the batch)."""

    def __init__(
        self,
        ps: list[SamplingParams],
        sample_idx: list[int],
        seeds: list[int],
        prompt_lens: list[int],
        max_model_len: int,
        V: int,
        dev: str | torch.device,
    ) -> None:
        self.V = V
        self.temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps], device=dev)  # [B]
        self.greedy = torch.tensor([p.temperature == 0 for p in ps], device=dev)  # [B]
        self.any_greedy = bool(self.greedy.any())  # else no argmax per step
        self.top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in ps], device=dev)  # [B]
        self.top_p = torch.tensor([p.top_p for p in ps], device=dev)  # [B]
        self.filtering = bool((self.top_k < V).any() or (self.top_p < 1).any())
        self.min_tokens = torch.tensor([p.min_tokens for p in ps], device=dev)  # [B]
        new = [min(p.max_tokens, max_model_len - n) for p, n in zip(ps, prompt_lens)]
        self.max_new, self.longest = torch.tensor(new, device=dev), max(new)  # [B], N
        # NOTE: one generator per row, seeded by (request seed, sample index): N draws each, used one per step.
        gens = [
            torch.Generator("cpu").manual_seed((seed * 1_000_003 + k) % 2**63) for k, seed in zip(sample_idx, seeds)
        ]
        self.u = torch.stack([torch.rand(self.longest, generator=g) for g in gens]).to(dev)  # [B, N] in [0, 1)

    def sample(
        self, logits: torch.Tensor, live: torch.Tensor, t: int, is_eos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token t of the rows `live` [b] from their logits [b,V]: (ids [b], log-probs [b]). The log-probs are
        log_softmax(logits / T) after min_tokens' EOS masking, before top-k / top-p filtering (what the trainer
        recomputes: it masks EOS at the same positions, info["min_tokens"])."""
        scaled = logits / self.temp[live, None]  # [b,V]
        short = t < self.min_tokens[live]  # [b] min_tokens not reached: EOS may not be sampled
        if short.any():
            scaled = scaled.masked_fill(short[:, None] & is_eos, float("-inf"))  # [b,V]
        logp = scaled.log_softmax(dim=-1)  # [b,V]
        if self.filtering:
            scaled = filter_logits(scaled, self.top_k[live], self.top_p[live])  # [b,V]
        # Inverse-CDF sampling with the row's own uniform draw: one vectorised search for the whole batch.
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)  # [b,V]
        u = self.u[live, t] * cdf[:, -1]  # [b]
        # side="right": the first token whose cdf exceeds u, so a zero-probability token is never picked
        sampled = torch.searchsorted(cdf, u[:, None], side="right")[:, 0].clamp(max=self.V - 1)  # [b]
        picked = torch.where(self.greedy[live], scaled.argmax(dim=-1), sampled) if self.any_greedy else sampled  # [b]
        return picked, logp.gather(-1, picked[:, None])[:, 0]  # [b], [b]


class HFEngine:
    """The embedded engine: a transformers model and a hand-written batched decode loop."""

    engine_type = "hf"

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_batch_size: int = 256,
        seed: int = 42,
    ) -> None:
        self.device, self.dtype = device, dtype
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size  # batch size in rows
        self.batcher = Batcher(self.run_batch, max_model_len)
        self.model = self.batcher.call(lambda: load_model(model_path, dtype=dtype, device=device))  # see Batcher
        self.tokenizer = load_tokenizer(model_path)
        self.eos_ids = eos_ids(self.tokenizer, self.model.generation_config)
        self.is_eos = torch.zeros(self.model.config.vocab_size, dtype=torch.bool, device=device)  # [V]
        self.is_eos[self.eos_ids] = True
        self.model_version = 0
        self.num_batches = 0  # decode batches run so far (a request of n samples spans n rows)
        self.rng = random.Random(seed)  # seeds the requests that come without one

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        return self.batcher.submit(prompt_ids, params)

    def close(self) -> None:
        self.batcher.close()

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        """n completions per request; each request has its own sampling params (one batch, through the worker)."""
        return collect(self.batcher, prompt_ids, params)

    @torch.no_grad()
    def run_batch(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        """The worker's part of generate: the requests' samples as rows, decoded max_batch_size rows at a time."""
        rows = []  # (request index, sample index, prompt, params, seed): one row per sample
        for i, (prompt, p) in enumerate(zip(prompt_ids, params)):
            seed = p.seed if p.seed is not None else self.rng.randrange(2**31)
            rows += [(i, k, prompt, p, seed) for k in range(p.n)]
        out: list[list[Completion]] = [[] for _ in prompt_ids]
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            for (i, _, _, _, _), completion in zip(chunk, self.decode(chunk)):
                out[i].append(completion)  # rows are in sample order, so out[i][k] is sample k
        return out

    def prefill(self, rows: list[tuple]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run each distinct request's prompt once (left-padded), then give each of its samples a copy of
        its KV cache: (cache, last logits [B,V], attention mask [B,C] over the cache slots, last positions [B,1]),
        rows in order.
        NOTE: the group's n samples share one prefill, as vLLM's prefix cache does; with n = 8 that is 8x
        less prefill work than a batched model.generate over the repeated prompts."""
        dev, firsts = self.device, {}
        for r, row in enumerate(rows):
            firsts.setdefault(row[0], r)  # request index -> its first row
        unique = [rows[r][2] for r in firsts.values()]  # [U] prompts
        L, pad = max(map(len, unique)), self.tokenizer.pad_token_id or 0
        capacity = L + max(row[3].max_tokens for row in rows)  # cache slots: prompt + the longest response
        ids = torch.tensor([[pad] * (L - len(x)) + x for x in unique], device=dev)  # [U, L]
        # 1 = a slot that may be attended to: left padding 0, the prompt and every later token 1, so that one
        # tensor serves every decode step (step t reads its first L + t + 1 columns).
        mask = torch.tensor([[0] * (L - len(x)) + [1] * (capacity - L + len(x)) for x in unique], device=dev)  # [U, C]
        pos = (mask[:, :L].cumsum(-1) - 1).clamp(min=0)  # [U, L], pads get position 0 (masked anyway)
        cache = DynamicCache(config=self.model.config)
        logits = (
            self.model(
                input_ids=ids,
                attention_mask=mask[:, :L],
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1]
            .float()
        )  # [U, V]
        slot = {request: j for j, request in enumerate(firsts)}
        expand = torch.tensor([slot[row[0]] for row in rows], device=dev)  # [B] row -> its prompt
        if len(rows) > len(unique):
            cache.batch_select_indices(expand)
        return cache, logits[expand], mask[expand], pos[expand, -1:]

    def decode(self, rows: list[tuple]) -> list[Completion]:
        """One batch: prefill (shared per request), then sample token by token with the KV cache. Finished
        rows stay in the batch (their tokens are ignored) until an eighth of it has finished, then leave it."""
        self.num_batches += 1
        dev, ps, B = self.device, [r[3] for r in rows], len(rows)
        s = Sampler(
            ps,
            sample_idx=[r[1] for r in rows],
            seeds=[r[4] for r in rows],
            prompt_lens=[len(r[2]) for r in rows],
            max_model_len=self.max_model_len,
            V=self.model.config.vocab_size,
            dev=dev,
        )
        cache, logits, mask, pos = self.prefill(rows)
        tokens = torch.zeros(B, s.longest, dtype=torch.long, device=dev)  # [B, N] sampled ids
        logps = torch.zeros(B, s.longest, device=dev)  # [B, N] their log-probs
        length = torch.zeros(B, dtype=torch.long, device=dev)  # [B] tokens so far; frozen when a row ends
        reason: list[str | None] = [None] * B
        texts: list[str | None] = [None] * B  # set when a stop string cut the text
        live = torch.arange(B, device=dev)  # [b] batch rows still decoding (finished ones until compacted)
        active = torch.ones(B, dtype=torch.bool, device=dev)  # [B] not finished yet
        stops = any(p.stop for p in ps)  # some row has stop strings
        for t in range(s.longest):
            picked, picked_lp = s.sample(logits, live, t, self.is_eos)  # [b], [b]
            rows_t = live[active[live]]  # [a] rows that take this token
            keep = active[live]  # [b]
            tokens[rows_t, t], logps[rows_t, t] = picked[keep], picked_lp[keep]
            length[rows_t] = t + 1
            ended = self.is_eos[picked[keep]] | (t + 1 >= s.max_new[rows_t])  # [a]
            for j, r in enumerate(rows_t.tolist() if stops else []):  # NOTE: a Python loop over rows: only with stops
                if ps[r].stop and (cut := self.stop_cut(tokens[r, : t + 1].tolist(), ps[r])) is not None:
                    texts[r], ended[j] = cut, True
            if ended.any():
                done = rows_t[ended]
                for r in done.tolist():
                    reason[r] = "stop" if texts[r] is not None or bool(self.is_eos[tokens[r, t]]) else "length"
                active[done] = False
            if not active.any():
                break
            if (~active[live]).sum() * 8 >= len(live):  # drop finished rows from the batch and its KV cache
                keep_idx = active[live].nonzero()[:, 0]  # [b']
                cache.batch_select_indices(keep_idx)
                live, mask, pos, picked = live[keep_idx], mask[keep_idx], pos[keep_idx], picked[keep_idx]
            pos = pos + 1  # [b, 1]
            logits = self.next_logits(picked, mask, pos, cache)  # [b, V]
        return self.completions(tokens, logps, length.tolist(), texts, reason)

    def next_logits(
        self, picked: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """One decode step: the logits [b,V] after the tokens just sampled, picked [b] at positions pos [b,1],
        attending to the cache slots that mask [b,C] allows; the cache grows by one slot."""
        return (
            self.model(
                input_ids=picked[:, None],
                attention_mask=mask[:, : cache.get_seq_length() + 1],
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            )
            .logits[:, -1]
            .float()
        )  # [b, V]

    def completions(
        self,
        tokens: torch.Tensor,
        logps: torch.Tensor,
        lengths: list[int],
        texts: list[str | None],
        reason: list[str | None],
    ) -> list[Completion]:
        """The decoded rows as Completions: the first lengths[r] sampled ids tokens [B,N] and log-probs logps [B,N]
        of each row, its text (cut before a stop string, else decoded) and why it ended."""
        ids = [tokens[r, :n].tolist() for r, n in enumerate(lengths)]
        lps = [logps[r, :n].tolist() for r, n in enumerate(lengths)]
        decoded = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [
            Completion(
                token_ids=ids[r],
                logprobs=lps[r],
                text=texts[r] if texts[r] is not None else decoded[r],
                finish_reason=reason[r] or "length",
                model_version=self.model_version,
            )
            for r in range(len(lengths))
        ]

    def stop_cut(self, tokens: list[int], p: SamplingParams) -> str | None:
        """The text cut before the first stop string, once one appears (None until then).
        NOTE: decodes the whole response: a stop string may span tokens. Rows without stop strings skip this."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cut = min((i for s in p.stop if (i := text.find(s)) >= 0), default=-1)
        return text[:cut] if cut >= 0 else None

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """log_softmax(logits / temperature) of each token of each sequence after its first, given the tokens
        before it: len(seq) - 1 log-probs per sequence (vLLM's prompt_logprobs; a teacher scoring a student's
        response). On the worker, between batches; check_scoring refuses what no engine can score."""
        check_scoring(sequences, temperature, self.max_model_len)
        return self.batcher.call(lambda: self.score_now(sequences, temperature))

    @torch.no_grad()
    def score_now(self, sequences: list[list[int]], temperature: float) -> list[list[float]]:
        """score() on the worker: right-padded rows of about SCORE_ELEMENTS logits at a time (a longer sequence
        alone), one forward pass each."""
        out: list[list[float]] = [[] for _ in sequences]
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        V, pad = self.model.config.vocab_size, self.tokenizer.pad_token_id or 0
        while order:
            L = len(sequences[order[0]])
            take = order[: max(1, SCORE_ELEMENTS // (L * V))]
            order = order[len(take) :]
            ids = torch.tensor([sequences[i] + [pad] * (L - len(sequences[i])) for i in take], device=self.device)
            mask = torch.tensor([[1] * len(sequences[i]) + [0] * (L - len(sequences[i])) for i in take])
            logits = self.model(input_ids=ids, attention_mask=mask.to(self.device)).logits[:, :-1].float()  # [b,L-1,V]
            logp = (logits / temperature).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # [b,L-1]
            for row, i in enumerate(take):
                out[i] = logp[row, : len(sequences[i]) - 1].tolist()
        return out

    def sleep(self) -> None:
        """On a GPU shared with the trainer (cluster.colocate): the model waits in host memory; a no-op on the CPU."""
        if str(self.device).startswith("cuda"):
            self.batcher.call(lambda: (self.model.to("cpu"), torch.cuda.empty_cache()))

    def wake_up(self) -> None:
        if str(self.device).startswith("cuda"):
            self.batcher.call(lambda: self.model.to(self.device))

    def load_weights(self, source: str | dict[str, torch.Tensor], version: int) -> None:
        """New weights from an HF folder or a state dict, between batches (on the worker); then model_version =
        version."""

        def load() -> None:
            state = (
                load_model(source, dtype=self.dtype, device="cpu").state_dict() if isinstance(source, str) else source
            )
            if self.model.config.tie_word_embeddings and "lm_head.weight" not in state:
                state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}  # tied: same tensor
            self.model.load_state_dict(state, strict=True)  # copies into the existing parameters
            self.model_version = version

        self.batcher.call(load)

    def checksums(self) -> list[dict[str, str]]:
        """The weights' checksums (`checksums`), between batches, as the one engine of a list (EnginePool's)."""
        return [self.batcher.call(lambda: checksums(self.model))]


def checksums(model: torch.nn.Module) -> dict[str, str]:
    """A SHA-256 of each parameter's bytes (vLLM's compute_weight_checksums, for an HF model)."""
    return {
        name: hashlib.sha256(w.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, w in model.named_parameters()
    }


def engine_kind(rm: Any) -> tuple[str, str]:
    """(the engine type a rollout model config runs: hf, vllm or vllm_async; why): "auto" = vLLM if importable and a
    GPU is present. The trainer asks too: it sends weights to vLLM engines through their weight-transfer engine."""
    if rm.engine_type != "auto":
        return rm.engine_type, f"engine_type={rm.engine_type} in the config"
    have_vllm, have_gpu = importlib.util.find_spec("vllm") is not None, torch.cuda.is_available()
    why = (
        f"engine_type=auto, vllm {'importable' if have_vllm else 'not installed'}, "
        f"CUDA GPU {'present' if have_gpu else 'absent'}"
    )
    return ("vllm" if have_vllm and have_gpu else "hf"), why


def make_engine(
    cfg_rollout_model,
    model_path: str,
    max_model_len: int,
    repetition_penalty: float = 1.0,
    colocate: bool = False,
    first_gpu: int = 0,
    lora: dict | None = None,
) -> Any:
    """The engine that `engine_type` asks for; "auto" = vLLM if importable and a GPU is present. vLLM:
    vllm_engine.make_pool (engine_num engines from the explorer's GPU `first_gpu` on; `repetition_penalty` =
    model.repetition_penalty, which the config refuses for the HF engine; `colocate`: sleep mode, the GPU is
    shared with the trainer; `lora`: serving a LoRA adapter on the base `model_path`, make_pool's)."""
    kind, why = engine_kind(cfg_rollout_model)
    have_gpu = torch.cuda.is_available()
    if kind in ("vllm", "vllm_async"):
        import vllm_engine

        log.info(
            "rollout engines: vLLM (%s), %d x tp %d",
            why,
            cfg_rollout_model.engine_num,
            cfg_rollout_model.tensor_parallel_size,
        )
        rm = dataclasses.replace(cfg_rollout_model, engine_type=kind)
        return vllm_engine.make_pool(
            rm,
            model_path,
            max_model_len=max_model_len,
            repetition_penalty=repetition_penalty,
            colocate=colocate,
            first_gpu=first_gpu,
            lora=lora,
        )
    if lora is not None:
        raise ConfigError("the HF engine serves no LoRA adapter (it gets merged weights): sync.serves_adapter")
    device, dtype = ("cuda", cfg_rollout_model.dtype) if have_gpu else ("cpu", "float32")
    log.info("rollout engine: HF on %s %s (%s)", device, dtype, why)
    if cfg_rollout_model.engine_num > 1:
        log.warning("engine_num=%d: the HF engine runs as one engine", cfg_rollout_model.engine_num)
    return HFEngine(model_path, device=device, dtype=dtype, max_model_len=max_model_len, seed=cfg_rollout_model.seed)


class CannedEngine:
    """`explore.py --debug --reply TEXT`: plays the model with canned replies instead of sampling, through the same
    interface (`submit`), so that a workflow's real path (a tool call, its result, the next turn, the reward) can be
    seen without a trained model. The k-th reply answers a conversation's k-th turn, the last one repeating: a
    request's turn is the number of distinct earlier contexts that are a strict prefix of its own (a multi-turn
    episode's context grows by its turns; the episodes of one task share their first prompt). A reply is tokenised
    as the model's own text (its special-token texts are control tokens), EOS added (`end`), cut at the request's
    max_tokens. Its log-probs are computed by the model (`score`, at the request's scored temperature), not marked as
    not sampled: the row's rollout log-probs stay what the trainer compares its own with (a row without them would
    take another path there), and they show how likely the policy finds the canned text. Not applied: min_tokens'
    EOS masking, stop strings."""

    def __init__(self, engine: Any, tokenizer: Any, replies: list[str]) -> None:
        self.engine, self.tokenizer, self.replies = engine, tokenizer, list(replies)
        self.contexts: list[tuple[int, ...]] = []  # every distinct context submitted so far
        self.lock = threading.Lock()  # NOTE: workflows submit from several threads

    @property
    def model_version(self) -> int:
        return self.engine.model_version

    @property
    def eos_ids(self) -> list[int]:
        return list(getattr(self.engine, "eos_ids", None) or [self.tokenizer.eos_token_id])

    @property
    def end(self) -> int:
        """The id a reply ends with: the tokenizer's EOS (a chat model's end of turn, Qwen's <|im_end|>), else the
        engine's first."""
        return self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_ids[0]

    def turn(self, ids: list[int]) -> int:
        """The request's turn (0-based) in its conversation, recorded."""
        key = tuple(ids)
        with self.lock:
            k = sum(1 for c in self.contexts if len(c) < len(key) and key[: len(c)] == c)
            if key not in self.contexts:
                self.contexts.append(key)
        return k

    def submit(self, ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        text = self.replies[min(self.turn(ids), len(self.replies) - 1)]
        out = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens]
        cut = len(out) == params.max_tokens
        out += [] if cut else [self.end]
        logprobs = self.engine.score([list(ids) + out], scored_temperature(params))[0][len(ids) - 1 :]
        shown = self.tokenizer.decode(out, skip_special_tokens=True)  # as an engine's Completion.text
        done = Completion(out, logprobs, shown, "length" if cut else "stop", self.model_version)
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result([done] * params.n)
        return f

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        return self.engine.score(sequences, temperature)

    def close(self) -> None:
        self.engine.close()


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "seed")


class EngineHandle:
    """What a workflow gets as its model (workflows.ModelHandle is the part it may call): an engine with its tokenizer
    and request defaults; chat / generate return buffer.Experience, no access to the weights.
    `defaults`: sampling arguments of every request (e.g. min_tokens = model.min_response_tokens);
    `max_prompt_tokens`: longer prompts keep their last max_prompt_tokens tokens and are marked "prompt_truncated"
    (the trainer gives them no loss), or with `truncate` off fail with PromptTooLong; `ignore_eos`: sample to
    max_tokens (EOS suppressed, as min_tokens = max_tokens); `template_kwargs`: variables of the chat template
    (e.g. enable_thinking)."""

    def __init__(
        self,
        engine: Any,
        tokenizer,
        defaults: dict | None = None,
        max_prompt_tokens: int | None = None,
        truncate: bool = True,
        ignore_eos: bool = False,
        template_kwargs: dict | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.defaults = self.sampling(**(defaults or {}))
        self.max_prompt, self.truncate, self.ignore_eos = max_prompt_tokens, truncate, ignore_eos
        self.template_kwargs = template_kwargs or {}
        self.max_model_len = max_model_len  # prompt + response tokens (a multi-turn episode's context limit)
        self.api: Any = None  # openai_api.OpenAIServer, when explorer.rollout_model.enable_openai_api
        self.auxiliary: dict[str, EngineHandle] = {}  # explorer.auxiliary_models by name (auxiliary_handles)

    def openai_client(self) -> Any:
        """An `openai.OpenAI` client of the explorer's OpenAI-compatible API (its model: `self.api.name`), in a
        session of its own: with enable_history, `history(client)` turns its calls into experiences."""
        if self.api is None:
            raise RuntimeError("the OpenAI-compatible API is off: set explorer.rollout_model.enable_openai_api: true")
        return self.api.client()

    def history(self, client: Any) -> list[Experience]:
        """Every choice of every call `client` made (openai_client), as an Experience, in call order; or with
        `episode()`, the calls of one conversation as one experience (openai_api.OpenAIServer.episode). Either
        ends the client's session."""
        if self.api is None or not self.api.record:
            raise RuntimeError("calls are recorded only with explorer.rollout_model.enable_history: true")
        return self.api.history(client)

    def episode(self, client: Any, mask_truncated: bool = True) -> Experience:
        """`client`'s calls of one conversation as one experience (see history()); a last reply cut at its
        max_tokens leaves it no action tokens unless not `mask_truncated`, as an Episode's."""
        if self.api is None or not self.api.record:
            raise RuntimeError("calls are recorded only with explorer.rollout_model.enable_history: true")
        return self.api.episode(client, mask_truncated)

    @property
    def model_version(self) -> int:
        return self.engine.model_version

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a response: the engine's (HFEngine: the tokenizer's EOS and the generation config's),
        else the tokenizer's EOS."""
        return list(getattr(self.engine, "eos_ids", None) or [self.tokenizer.eos_token_id])

    def sampling(self, **sampling) -> dict:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling argument(s) {unknown}; accepted: {list(SAMPLING_KEYS)}")
        return sampling

    def chat(
        self,
        messages: list[dict],
        n: int = 1,
        tools: list | None = None,
        chat_template: str | None = None,
        reply_prefix: str | None = None,
        **sampling,
    ) -> list[Experience]:
        """Sample n responses to `messages`, rendered by the tokenizer's chat template (or `chat_template`) with
        `tools`; the assistant turn starts with `reply_prefix` (part of the prompt, not of the response text). The
        messages' strings are tokenised as text (render_ids)."""
        text, ids = self.render_ids(messages, tools, chat_template, suffix=reply_prefix or "")
        return self.sample([(text, *self.cut(ids))], n, **sampling)[0]

    def render(
        self,
        messages: list[dict],
        tools: list | None = None,
        chat_template: str | None = None,
        generation: bool = True,
        template_kwargs: dict | None = None,
    ) -> str:
        """`messages` through the chat template (or `chat_template`), with the assistant's generation prompt;
        `template_kwargs` (a request's chat_template_kwargs) over the handle's. The text: its ids are render_ids'."""
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=generation,
            tokenize=False,
            tools=tools,
            chat_template=chat_template or None,
            **{**self.template_kwargs, **(template_kwargs or {})},
        )

    def render_ids(
        self,
        messages: list[dict],
        tools: list | None = None,
        chat_template: str | None = None,
        generation: bool = True,
        template_kwargs: dict | None = None,
        suffix: str = "",
    ) -> tuple[str, list[int]]:
        """render()'s text (then `suffix`, e.g. a reply prefix, read as template text) and its token ids, every
        string of the messages, tools and `template_kwargs` tokenised as text: a row, a tool result or an API
        caller's `<|im_end|>` never becomes a control token (chat_template.chat_ids). Not cut to max_prompt_tokens."""
        kwargs = {**self.template_kwargs, **(template_kwargs or {})}
        return chat_ids(self.tokenizer, messages, tools, chat_template, generation, kwargs, suffix)

    def params(self, n: int = 1, **sampling) -> SamplingParams:
        """A request's SamplingParams: the handle's defaults, then `sampling` (ignore_eos: min_tokens = max_tokens)."""
        params = SamplingParams(n=n, **{**self.defaults, **self.sampling(**sampling)})
        if self.ignore_eos:
            params.min_tokens = params.max_tokens
        return params

    def submit(self, ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Completions of exact token ids (a multi-turn episode's context): a future of list[Completion]."""
        return self.engine.submit(ids, params)

    def encode(self, prompt: str) -> tuple[list[int], bool]:
        """Token ids of a prompt's text as written (its special-token texts are control tokens: a raw prompt of the
        workflow's own; messages go through render_ids), cut to max_prompt_tokens (cut())."""
        return self.cut(self.tokenizer.encode(prompt, add_special_tokens=False))

    def cut(self, ids: list[int]) -> tuple[list[int], bool]:
        """A prompt's ids cut to max_prompt_tokens (keeping its end: the generation prompt), and whether they were;
        PromptTooLong instead when truncation is off."""
        if self.max_prompt is None or len(ids) <= self.max_prompt:
            return ids, False
        if not self.truncate:
            raise PromptTooLong(
                f"a prompt of {len(ids)} tokens exceeds model.max_prompt_tokens ({self.max_prompt}) "
                "and model.enable_prompt_truncation is off"
            )
        return ids[-self.max_prompt :], True

    def replies(self, conversations: list[list[dict]], **sampling) -> list[str]:
        """One reply's text per conversation (chat messages, through the chat template), all in one engine batch:
        what a judge asks of an auxiliary model (ExternalHandle.replies: the same from an endpoint)."""
        prompts = [(text, *self.cut(ids)) for text, ids in map(self.render_ids, conversations)]
        return [exps[0].response_text for exps in self.sample(prompts, 1, **sampling)]

    def score(self, sequences: list[list[int]] | list[torch.Tensor], temperature: float = 1.0) -> list[torch.Tensor]:
        """The engine's log-prob of each token of each sequence after the first, given the tokens before it:
        [L - 1] float32 per sequence of L token ids, log_softmax(logits / temperature) over the full vocabulary.
        A teacher (an auxiliary model) scoring a student's experience: score([exp.tokens])[0][exp.prompt_length - 1:]
        are its log-probs of the response tokens (on_policy_distill_workflow)."""
        ids = [[int(t) for t in seq] for seq in sequences]
        return [torch.tensor(lp, dtype=torch.float32) for lp in self.engine.score(ids, temperature)]

    def generate(self, prompts: list[str], n: int = 1, **sampling) -> list[list[Experience]]:
        """n experiences per prompt text (already templated: encode(), its special-token texts are control tokens)."""
        return self.sample([(p, *self.encode(p)) for p in prompts], n, **sampling)

    def sample(self, prompts: list[tuple[str, list[int], bool]], n: int = 1, **sampling) -> list[list[Experience]]:
        """n experiences per prompt (its text, its ids, whether they were cut), submitted together: one batch."""
        params = self.params(n, **sampling)
        futures = [self.engine.submit(ids, params) for _, ids, _ in prompts]
        return [
            [experience(ids, c, scored_temperature(params), text, cut, params.min_tokens) for c in f.result()]
            for (text, ids, cut), f in zip(prompts, futures)
        ]


def experience(
    prompt: list[int],
    c: Completion,
    temperature: float,
    prompt_text: str = "",
    prompt_cut: bool = False,
    min_tokens: int = 0,
) -> Experience:
    """A sampled response (sampling.Completion) to the prompt ids `prompt` as an Experience; info holds the
    temperature the trainer scores it at and the request's min_tokens (the first min_tokens positions had EOS masked:
    batching.eos_masked)."""
    return Experience(
        tokens=torch.tensor(prompt + c.token_ids, dtype=torch.long),
        prompt_length=len(prompt),
        logprobs=torch.tensor(c.logprobs, dtype=torch.float32),
        model_version=c.model_version,
        spans=list(c.spans),
        truncate_status="prompt_truncated" if prompt_cut else "response_truncated" if c.truncated else None,
        prompt_text=prompt_text,
        response_text=c.text,
        info={"temperature": temperature, "min_tokens": min_tokens},
    )


def auxiliary_handles(cfg) -> dict[str, EngineHandle | ExternalHandle]:
    """explorer.auxiliary_models, each on engines of its own (vLLM: on the explorer's GPUs after the rollout model's;
    HF: on the explorer's device) or, engine_type external, an OpenAI-compatible endpoint (ExternalHandle), by name:
    the model folder's name, or the endpoint's model_name (name#2, ... for repeats). Workflows reach them as
    `self.auxiliary_models[name]` (e.g. a judge, workflows/judge.py)."""
    handles, (_, starts) = {}, explorer_gpu_plan(cfg.explorer)  # the GPU split the config resolved
    for i, (aux, first) in enumerate(zip(cfg.explorer.auxiliary_models, starts)):
        external = aux.engine_type == "external"
        name = aux.external_model_config.model_name if external else Path(aux.model_path.rstrip("/")).name
        name = name if name not in handles else f"{name}#{sum(k.split('#')[0] == name for k in handles) + 1}"
        if external:
            handles[name] = ExternalHandle(aux.external_model_config, f"explorer.auxiliary_models[{i}]")
            continue
        engine = make_engine(aux, aux.model_path, aux.max_model_len, first_gpu=first)
        tokenizer = load_tokenizer(aux.model_path)
        tokenizer = with_template(tokenizer, aux.chat_template) if aux.chat_template else tokenizer
        handles[name] = EngineHandle(engine, tokenizer, {}, ignore_eos=aux.ignore_eos, max_model_len=aux.max_model_len)
    return handles


def close_engines(handles: list[EngineHandle]) -> None:
    """Close the engines behind `handles`, each once: their auxiliary models' first (a judge may serve a rollout
    model's request to the end), then theirs. vLLM engines shut down within a bound (vllm_engine.EnginePool.close);
    the HF engine's worker thread ends. Engines without `close` (a test's scripted engine) are left alone."""
    engines: list[Any] = []
    for handle in handles:
        aux = [a.engine for a in handle.auxiliary.values() if isinstance(a, EngineHandle)]
        engines += [e for e in [*aux, handle.engine] if not any(e is seen for seen in engines)]
    for engine in engines:
        if hasattr(engine, "close"):
            engine.close()


class ExternalModelError(RuntimeError):
    """A call to an external auxiliary model failed: the endpoint unreachable, too slow, an error status, or a reply
    that is not a chat completion with text. It fails the workflow run that made the call (the runner retries it,
    then drops the task with this message), never the explorer."""


class ExternalHandle:
    """An auxiliary model that is an OpenAI-compatible endpoint nanorft does not run (engine_type external), called
    through the `openai` client's chat completions. It offers what a judge needs of a handle, `replies` (text in,
    text out): no token ids, log-probs or weights, so it can grade or advise but is never trained on. The API key
    comes from the environment variable the config names (api_key_env), never from the config. The requests of one
    `replies` call run concurrently (MAX_CONCURRENT of this handle's at once at most), each bounded by `timeout`
    seconds and retried `max_retries` times by the client."""

    MAX_CONCURRENT = 16
    # sampling keys the chat completions API takes as they are; top_k and min_tokens (vLLM's) go in its body
    OPENAI_KEYS = ("temperature", "top_p", "max_tokens", "stop", "seed")

    def __init__(self, ext: ExternalModelConfig, where: str) -> None:
        import openai

        key = os.environ.get(ext.api_key_env) if ext.api_key_env else "EMPTY"
        if not key:
            raise ConfigError(
                f"{where}.external_model_config.api_key_env = {ext.api_key_env!r}: that environment variable is not "
                "set (it holds the endpoint's API key; for an endpoint without keys set api_key_env: '')"
            )
        self.url, self.model, self.timeout = ext.base_url, ext.model_name, ext.timeout
        self.client = openai.OpenAI(
            base_url=ext.base_url, api_key=key, timeout=ext.timeout, max_retries=ext.max_retries
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(self.MAX_CONCURRENT, thread_name_prefix="external")
        self.model_version = 0  # an endpoint's model never changes here

    def replies(self, conversations: list[list[dict]], **sampling) -> list[str]:
        """The endpoint's reply text to each conversation (chat messages), one request each, sent concurrently;
        ExternalModelError (naming the endpoint and the cause) when any fails."""
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling argument(s) {unknown}; accepted: {list(SAMPLING_KEYS)}")
        futures = [self.pool.submit(self.reply, messages, sampling) for messages in conversations]
        return [f.result() for f in futures]

    def reply(self, messages: list[dict], sampling: dict) -> str:
        """One chat completion's text."""
        import openai

        body = {k: v for k, v in sampling.items() if k not in self.OPENAI_KEYS}
        where = f"external model {self.model!r} at {self.url}"
        try:
            out = self.client.chat.completions.create(
                model=self.model,
                messages=messages,
                n=1,
                **{k: v for k, v in sampling.items() if k in self.OPENAI_KEYS},
                **({"extra_body": body} if body else {}),
            )
        except openai.APITimeoutError:
            raise ExternalModelError(f"{where}: no reply within {self.timeout:g} s") from None
        except openai.APIConnectionError as e:
            raise ExternalModelError(f"{where}: cannot connect ({e.__cause__ or e})") from None
        except openai.APIStatusError as e:
            raise ExternalModelError(f"{where}: HTTP {e.status_code}: {str(e)[:300]}") from None
        except (openai.APIError, ValueError) as e:  # e.g. a body that is no JSON (json's ValueError)
            raise ExternalModelError(f"{where}: a bad reply ({type(e).__name__}: {str(e)[:300]})") from None
        choices = getattr(out, "choices", None)
        text = choices[0].message.content if choices else None
        if not isinstance(text, str):
            raise ExternalModelError(f"{where}: a reply without text: {str(out)[:300]!r}")
        return text


def rollout_handle(cfg, engine: Any, tokenizer) -> EngineHandle:
    """The handle every workflow of this explorer gets, with the config's prompt limits and template settings."""
    m, rm = cfg.model, cfg.explorer.rollout_model
    kwargs = {} if m.enable_thinking is None else {"enable_thinking": m.enable_thinking}
    if rm.chat_template:
        tokenizer = with_template(tokenizer, rm.chat_template)
    return EngineHandle(
        engine,
        tokenizer,
        defaults={"min_tokens": m.min_response_tokens},
        max_prompt_tokens=m.max_prompt_tokens,
        truncate=m.enable_prompt_truncation,
        ignore_eos=rm.ignore_eos,
        template_kwargs=kwargs,
        max_model_len=rm.max_model_len,
    )
