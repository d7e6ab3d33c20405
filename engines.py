"""Rollout engines: token ids in, sampled token ids and their log-probs out, behind one interface.

    from engines import HFEngine, ModelHandle, SamplingParams, make_engine
    engine = HFEngine("assets/tiny-qwen2")                      # or make_engine(cfg.explorer.rollout_model, ...)
    out = engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(n=4, temperature=0.7, max_tokens=64),
                                                 SamplingParams(temperature=0.0, stop=["\\n"])])
    out[0][2].token_ids, out[0][2].logprobs, out[0][2].finish_reason     # request 0, sample 2
    future = engine.submit([1, 2, 3], SamplingParams(n=8))     # from any thread; batched with others
    engine.load_weights("checkpoints/step_10", version=10)     # or a state dict
    handle = ModelHandle(engine, engine.tokenizer, {"temperature": 1.0, "max_tokens": 256})
    exps = handle.chat([{"role": "user", "content": "What is 2 + 3?"}], n=8)   # buffer.Experience
    engine.close()

Every engine has `generate(prompt_ids, params)`, `submit(prompt_ids, params) -> Future`,
`load_weights(source, version)` and `model_version`. Workflows only see a `ModelHandle`.
- HFEngine (engine_type "hf") runs anywhere: its own decode loop over a left-padded batch with a KV
  cache, because one batch mixes requests with different sampling params (model.generate cannot).
- VLLMEngine (engine_type "vllm") is the GPU production path, a thin wrapper over `vllm.LLM`.
Same seed -> same samples within one engine; a different batch composition can, rarely, flip a
near-tie (float rounding of padded batches), as in vLLM. Concurrent `submit` calls share batches.
Log-probs (`rollout_logprobs`) are log_softmax(raw logits / temperature) at the sampled token, over
the full vocabulary, before top-k / top-p / min_tokens masking (temperature 0 counts as 1.0).
The sampled token ids include the EOS token that ended a response (the trainer must see it).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache

from buffer import Experience
from models import load_model, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """Per-request sampling; the fields and their meaning follow vLLM's SamplingParams."""

    n: int = 1  # samples of this prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = -1  # 0 or -1 = off
    max_tokens: int = 16  # response tokens at most (clamped to max_model_len - prompt length)
    min_tokens: int = 0  # EOS is suppressed before this many response tokens
    stop: list[str] = field(default_factory=list)  # a stop string ends the text (it is cut off)
    seed: int | None = None  # same seed + same prompt -> same samples; None = drawn by the engine
    logprobs: int = 0  # 0 = the sampled token's log-prob only (the only mode supported)


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]  # response only, EOS included when it ended the response
    logprobs: list[float]  # one per token id
    text: str  # decoded without special tokens, cut before a stop string
    finish_reason: str  # "stop" (EOS or stop string) or "length" (max_tokens)
    model_version: int = 0  # weights version that produced it

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class Batcher:
    """Collects `submit` calls from many threads into shared `generate` calls on one worker thread."""

    def __init__(self, generate: Callable, max_model_len: int, wait_s: float = 0.005) -> None:
        self.generate, self.wait_s = generate, wait_s  # wait_s: how long a batch waits for more
        self.max_model_len = max_model_len
        self.queue: queue.Queue = queue.Queue()  # (prompt_ids, params, future); None = close
        self.closed, self.mutex = False, threading.Lock()
        self.worker = threading.Thread(target=self.run, name="engine-batcher", daemon=True)
        self.worker.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one request; the future resolves to its n completions. Bad requests raise here, so
        that one caller's bad request never fails a batch shared with others."""
        check_request(prompt_ids, params, self.max_model_len)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.mutex:  # NOTE: nothing may be queued behind the close marker, or it would hang
            if self.closed:
                raise RuntimeError("engine is closed")
            self.queue.put((prompt_ids, params, future))
        return future

    def run(self) -> None:
        closing = False
        while not closing:
            items = [self.queue.get()]
            deadline = time.monotonic() + self.wait_s
            while True:  # everything already queued, plus what arrives within wait_s
                try:
                    items.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            closing = None in items  # requests queued before close() still run
            items = [it for it in items if it is not None and it[2].set_running_or_notify_cancel()]
            if not items:
                continue
            try:
                outs = self.generate([it[0] for it in items], [it[1] for it in items])
                for it, out in zip(items, outs):
                    it[2].set_result(out)
            except BaseException as e:  # the callers see the failure; the worker lives on
                for it in items:
                    if not it[2].done():
                        it[2].set_exception(e)

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        with self.mutex:
            if self.closed:
                return
            self.closed = True
            self.queue.put(None)
        self.worker.join()


def check_request(prompt: list[int], p: SamplingParams, max_model_len: int) -> None:
    """Raise ValueError for a request no engine can serve."""
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room for a response within "
                         f"max_model_len={max_model_len}; shorten it or raise max_model_len")
    if p.n < 1 or p.max_tokens < 1 or p.temperature < 0 or not 0 < p.top_p <= 1 or p.min_tokens < 0:
        raise ValueError(f"invalid sampling params {p}")
    if any(not s for s in p.stop):
        raise ValueError("empty stop string")
    if p.logprobs != 0:
        raise ValueError("only logprobs=0 (the sampled token's log-prob) is supported")


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


class HFEngine:
    """The embedded engine: a transformers model and a hand-written batched decode loop."""

    engine_type = "hf"

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "float32",
                 max_model_len: int = 2048, max_batch_size: int = 64, seed: int = 42) -> None:
        self.device, self.dtype = device, dtype
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size  # batch size in rows
        self.model = load_model(model_path, dtype=dtype, device=device)
        self.tokenizer = load_tokenizer(model_path)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        self.eos_ids = sorted({self.tokenizer.eos_token_id, *gen_eos} - {None})
        self.model_version = 0
        self.num_batches = 0  # decode batches run so far (a request of n samples spans n rows)
        self.rng = random.Random(seed)  # seeds the requests that come without one
        self.lock = threading.Lock()  # NOTE: held by every generate and load_weights
        self.batcher = Batcher(self.generate, max_model_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        return self.batcher.submit(prompt_ids, params)

    def close(self) -> None:
        self.batcher.close()

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        """n completions per request; each request has its own sampling params."""
        assert len(prompt_ids) == len(params), (len(prompt_ids), len(params))
        for prompt, p in zip(prompt_ids, params):
            check_request(prompt, p, self.max_model_len)
        with self.lock:
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

    def decode(self, rows: list[tuple]) -> list[Completion]:
        """One batch: prefill the left-padded prompts, then sample token by token with the KV cache."""
        self.num_batches += 1
        dev, V = self.device, self.model.config.vocab_size
        B, L = len(rows), max(len(r[2]) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (L - len(r[2])) + r[2] for r in rows], device=dev)  # [B, L]
        mask = torch.tensor([[0] * (L - len(r[2])) + [1] * len(r[2]) for r in rows], device=dev)  # [B, L]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L], pads get position 0 (masked anyway)
        ps = [r[3] for r in rows]
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in ps], device=dev)  # [B]
        greedy = torch.tensor([p.temperature == 0 for p in ps], device=dev)  # [B]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in ps], device=dev)  # [B]
        top_p = torch.tensor([p.top_p for p in ps], device=dev)  # [B]
        filtering = bool((top_k < V).any() or (top_p < 1).any())
        max_new = [min(p.max_tokens, self.max_model_len - len(r[2])) for r, p in zip(rows, ps)]
        gens = [torch.Generator(dev).manual_seed((seed * 1_000_003 + k) % 2**63) for _, k, _, _, seed in rows]
        is_eos = torch.zeros(V, dtype=torch.bool, device=dev)  # [V]
        is_eos[self.eos_ids] = True
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        done: list[Completion | None] = [None] * B
        live = list(range(B))  # row indices still in the batch, in batch order
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1].float()  # [B, V]
        while True:
            scaled = logits / temp[live, None]  # [b, V]
            logp = scaled.log_softmax(dim=-1)  # [b, V], the reported log-probs: before any masking
            short = torch.tensor([len(tokens[r]) < ps[r].min_tokens for r in live], device=dev)  # [b]
            if short.any():  # min_tokens not reached: EOS may not be sampled
                scaled = scaled.masked_fill(short[:, None] & is_eos, float("-inf"))
            if filtering:
                scaled = filter_logits(scaled, top_k[live], top_p[live])
            # Inverse-CDF sampling: one uniform draw per row from its own generator, then one
            # vectorised search (30x cheaper than a torch.multinomial call per row).
            cdf = scaled.softmax(dim=-1).cumsum(dim=-1)  # [b, V]
            u = torch.stack([torch.rand((), generator=gens[r], device=dev) for r in live])  # [b] in [0, 1)
            # side="right": the first token whose cdf exceeds u, so a zero-probability token is never picked
            sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right")[:, 0].clamp(max=V - 1)  # [b]
            picked_t = torch.where(greedy[live], scaled.argmax(dim=-1), sampled)  # [b]
            picked = picked_t.tolist()
            picked_lp = logp.gather(-1, picked_t[:, None])[:, 0].tolist()  # [b]
            keep = []
            for j, r in enumerate(live):
                tokens[r].append(picked[j])
                logps[r].append(picked_lp[j])
                reason, text = self.finished(tokens[r], ps[r], max_new[r])
                if reason is None:
                    keep.append(j)
                else:
                    text = self.tokenizer.decode(tokens[r], skip_special_tokens=True) if text is None else text
                    done[r] = Completion(tokens[r], logps[r], text, reason, self.model_version)
            if not keep:
                break
            if len(keep) < len(live):  # drop finished rows from the batch and its KV cache
                keep_t = torch.tensor(keep, device=dev)
                cache.batch_select_indices(keep_t)
                mask, pos, picked_t = mask[keep_t], pos[keep_t], picked_t[keep_t]
                live = [live[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)  # [b, L + t]
            pos = pos[:, -1:] + 1  # [b, 1]
            logits = self.model(input_ids=picked_t[:, None], attention_mask=mask, position_ids=pos,
                                past_key_values=cache, use_cache=True).logits[:, -1].float()  # [b, V]
        return done  # type: ignore[return-value]

    def finished(self, tokens: list[int], p: SamplingParams, max_new: int) -> tuple[str | None, str | None]:
        """(finish reason or None to go on, the text when a stop string cut it) after a row's last token."""
        if p.stop:  # NOTE: decodes the whole response every step: a stop string may span tokens
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            cut = min((i for s in p.stop if (i := text.find(s)) >= 0), default=-1)
            if cut >= 0:
                return "stop", text[:cut]  # the tokens keep the one that completed the stop string
        if tokens[-1] in self.eos_ids:
            return "stop", None
        return ("length" if len(tokens) >= max_new else None), None

    def load_weights(self, source: str | dict[str, torch.Tensor], version: int) -> None:
        """New weights from an HF folder or a state dict, between batches; then model_version = version."""
        state = load_model(source, dtype=self.dtype, device="cpu").state_dict() if isinstance(source, str) else source
        if self.model.config.tie_word_embeddings and "lm_head.weight" not in state:
            state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}  # tied: same tensor
        with self.lock:
            self.model.load_state_dict(state, strict=True)  # copies into the existing parameters
            self.model_version = version


class VLLMEngine:
    """The GPU production path: `vllm.LLM` behind the same interface (vLLM 0.33's public API)."""

    engine_type = "vllm"

    def __init__(self, model_path: str, max_model_len: int = 2048, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 dtype: str = "bfloat16", seed: int = 42) -> None:
        import vllm  # lazily: this module must import without vLLM

        # NOTE: collective_rpc with a Python function (load_weights) needs pickled callables.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.vllm, self.max_model_len = vllm, max_model_len
        # logprobs_mode="processed_logprobs": log-probs after temperature scaling, like HFEngine's
        # (vLLM's default, raw_logprobs, ignores the temperature). NOTE: vLLM also applies top-k /
        # top-p before "processed" log-probs, HFEngine does not; they agree when both are off.
        self.llm = vllm.LLM(model=model_path, tensor_parallel_size=tensor_parallel_size,
                            gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=enable_prefix_caching,
                            seed=seed, max_model_len=max_model_len, dtype=dtype, logprobs_mode="processed_logprobs")
        self.tokenizer = load_tokenizer(model_path)
        self.model_version = 0
        self.num_batches = 0
        self.lock = threading.Lock()
        self.batcher = Batcher(self.generate, max_model_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        return self.batcher.submit(prompt_ids, params)

    def close(self) -> None:
        self.batcher.close()

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        """As HFEngine.generate. vLLM's defaults already match it: the stop string is cut from the
        text, the EOS token stays in token_ids. NOTE: vLLM detokenises (text, stop strings) with
        its own AutoTokenizer, which for model_type qwen2 is not models.load_tokenizer's (see
        models.py); token ids and log-probs do not depend on it."""
        for prompt, p in zip(prompt_ids, params):
            check_request(prompt, p, self.max_model_len)
        sps = [self.vllm.SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p,
                                        top_k=p.top_k if p.top_k > 0 else -1,
                                        max_tokens=min(p.max_tokens, self.max_model_len - len(ids)),
                                        min_tokens=p.min_tokens, stop=list(p.stop), seed=p.seed, logprobs=0)
               for ids, p in zip(prompt_ids, params)]
        with self.lock:
            self.num_batches += 1
            outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sampling_params=sps,
                                     use_tqdm=False)
            version = self.model_version
        return [[Completion(list(o.token_ids), [step[t].logprob for t, step in zip(o.token_ids, o.logprobs)],
                            o.text, "length" if o.finish_reason == "length" else "stop", version)
                 for o in req.outputs] for req in outs]

    def load_weights(self, source: str | dict[str, torch.Tensor], version: int) -> None:
        """NOTE: the one place that touches vLLM's private surface: each worker's
        model_runner.get_model().load_weights (the loader vLLM itself uses: it maps HF names to vLLM's
        fused layers and skips lm_head when embeddings are tied), called through the public
        collective_rpc. The weights are pickled to every worker: fine for small models; large ones
        want a CUDA-IPC or NCCL path (sync.py's business)."""
        if isinstance(source, str):
            source = load_model(source, dtype="float32", device="cpu").state_dict()
        weights = [(name, t.detach().cpu()) for name, t in source.items()]

        def load(worker, weights):  # runs inside each vLLM worker process
            worker.model_runner.get_model().load_weights(weights=weights)

        with self.lock:
            self.llm.collective_rpc(load, args=(weights,))
            self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
            self.model_version = version


def make_engine(cfg_rollout_model, model_path: str, max_model_len: int) -> HFEngine | VLLMEngine:
    """The engine that `engine_type` asks for; "auto" = vLLM if importable and a GPU is present."""
    kind = cfg_rollout_model.engine_type
    have_vllm, have_gpu = importlib.util.find_spec("vllm") is not None, torch.cuda.is_available()
    if kind == "auto":
        kind = "vllm" if have_vllm and have_gpu else "hf"
        why = f"engine_type=auto, vllm {'importable' if have_vllm else 'not installed'}, " \
              f"CUDA GPU {'present' if have_gpu else 'absent'}"
    else:
        why = f"engine_type={kind} in the config"
    if kind in ("vllm", "vllm_async"):
        # NOTE: vllm_async is served by the same synchronous vllm.LLM behind the batching queue
        log.info("rollout engine: vLLM (%s), tp=%d", why, cfg_rollout_model.tensor_parallel_size)
        return VLLMEngine(model_path, max_model_len, cfg_rollout_model.tensor_parallel_size,
                          cfg_rollout_model.gpu_memory_utilization, cfg_rollout_model.enable_prefix_caching,
                          cfg_rollout_model.dtype, cfg_rollout_model.seed)
    device, dtype = ("cuda", cfg_rollout_model.dtype) if have_gpu else ("cpu", "float32")
    log.info("rollout engine: HF on %s %s (%s)", device, dtype, why)
    if cfg_rollout_model.engine_num > 1:
        log.warning("engine_num=%d: the HF engine runs as one engine", cfg_rollout_model.engine_num)
    return HFEngine(model_path, device=device, dtype=dtype, max_model_len=max_model_len, seed=cfg_rollout_model.seed)


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "seed")


class ModelHandle:
    """What a workflow gets: chat / generate returning buffer.Experience, no access to the weights."""

    def __init__(self, engine: HFEngine | VLLMEngine, tokenizer, defaults: dict | None = None) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.defaults = self.sampling(**(defaults or {}))

    @property
    def model_version(self) -> int:
        return self.engine.model_version

    def sampling(self, **sampling) -> dict:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling argument(s) {unknown}; accepted: {list(SAMPLING_KEYS)}")
        return sampling

    def chat(self, messages: list[dict], n: int = 1, **sampling) -> list[Experience]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.generate([prompt], n=n, **sampling)[0]

    def generate(self, prompts: list[str], n: int = 1, **sampling) -> list[list[Experience]]:
        """n experiences per prompt text (already templated; encoded without special tokens)."""
        params = SamplingParams(n=n, **{**self.defaults, **self.sampling(**sampling)})
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        futures = [self.engine.submit(x, params) for x in ids]  # submitted together: one batch
        return [[Experience(tokens=torch.tensor(x + c.token_ids, dtype=torch.long), prompt_length=len(x),
                            logprobs=torch.tensor(c.logprobs, dtype=torch.float32), model_version=c.model_version,
                            truncate_status="response_truncated" if c.truncated else None,
                            prompt_text=p, response_text=c.text)
                 for c in f.result()] for p, x, f in zip(prompts, ids, futures)]
