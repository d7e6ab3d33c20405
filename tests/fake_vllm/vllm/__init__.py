"""A fake of the part of vLLM's public API that vllm_engine.py uses, for contract tests on machines without vLLM or a
GPU (every test machine of this project). Written from vLLM's documentation (0.33): `LLM(**engine args)` with
`generate`, `collective_rpc`, `reset_prefix_cache`, `sleep(level)`, `wake_up(tags)`; `AsyncEngineArgs`,
`AsyncLLMEngine.from_engine_args` with async `generate(prompt, sampling_params, request_id)` (an async generator whose
last output is the finished request), async `collective_rpc` / `reset_prefix_cache` / `sleep` / `wake_up`, and
`shutdown`; `SamplingParams` and `sampling_params.RequestOutputKind`; outputs with `.outputs[i].index / .token_ids /
.logprobs ({token: Logprob}) / .text / .finish_reason`.

What it models, so that the adapter's use of it is checked:
- engine arguments: only vLLM's names are accepted (a TypeError otherwise); logprobs_mode must be one of vLLM's;
- tensor_parallel_size workers per engine, each a full copy of the model on the CPU with the worker extension
  (`worker_extension_cls`) mixed in, as vLLM does; collective_rpc runs a method on every worker at once (threads,
  as vLLM's worker processes) and returns their results in rank order;
- "processed_logprobs": log-probs after temperature, top-k and top-p (the filtered distribution renormalised);
- stopping (generation_config "auto", vLLM's default): a sample ends on the tokenizer's EOS or any eos_token_id of
  the model's generation config (min_tokens masks them all);
- the async engine streams as vLLM's does: without output_kind FINAL_ONLY, every output holds ONE sample (the one
  that just produced a token: its tokens so far, or only the new ones with DELTA); with it, one output of all n;
- sleep mode: sleep() without enable_sleep_mode is an error; generate() while any part sleeps is an error; level 1
  keeps the weights (in host memory), level 2 discards them: after wake_up, generating before every weight was
  loaded again is an error (real vLLM would generate from garbage); wake_up(tags=["weights"] / ["kv_cache"]) wakes a
  part; loading weights into sleeping weights is an error; reset_prefix_cache() is False while requests run;
- the environment each engine was built in (CUDA_VISIBLE_DEVICES, VLLM_WORKER_MULTIPROC_METHOD), and the
  requests each engine ran; engine arguments' dtype among vLLM's names.
Generation is a plain loop of full forward passes of the tiny model (no KV cache): slow, but exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.33.0+fake"
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType: no bf16 / fp16 / fp32
ENGINES: list["LLM"] = []  # every engine built, for the tests to look into
SLEEP_TAGS = ("weights", "kv_cache")
__all__ = ["LLM", "AsyncLLMEngine", "AsyncEngineArgs", "SamplingParams", "RequestOutputKind"]


@dataclasses.dataclass
class Logprob:
    logprob: float


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None  # "stop" | "length"; None while the sample runs (streamed)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclasses.dataclass
class EngineArgs:
    """The engine arguments vllm_engine.py passes (vLLM has many more; a name vLLM does not have is a TypeError)."""

    model: str
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    logprobs_mode: str = "raw_logprobs"
    worker_extension_cls: str = ""
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode {self.logprobs_mode!r} not in {LOGPROBS_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")


AsyncEngineArgs = EngineArgs


class ModelRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> Any:
        return self.model


class FakeModel(torch.nn.Module):
    """The HF model under vLLM's `load_weights(weights: Iterable[(HF name, tensor)])`."""

    def __init__(self, hf: torch.nn.Module, sleeping: set[str]) -> None:
        super().__init__()
        self.hf, self.sleeping = hf, sleeping  # the engine's parts asleep (SLEEP_TAGS)
        self.loaded: list[str] = []
        self.discarded: set[str] = set()  # weights a level-2 sleep threw away, not loaded since

    def discard(self) -> None:
        with torch.no_grad():
            for name, w in self.hf.named_parameters():
                w.fill_(float("nan"))  # what the re-allocated memory holds: not the weights
                self.discarded.add(name)

    def load_weights(self, weights: Any) -> set[str]:
        if "weights" in self.sleeping:
            raise RuntimeError("load_weights while the weights sleep: wake_up first")
        params = dict(self.hf.named_parameters())
        names = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:  # lm_head.weight of tied embeddings: vLLM skips it too
                    continue
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))
                names.add(name)
        self.loaded += sorted(names)
        self.discarded -= names
        return names


class Worker:
    """One tensor-parallel worker (vLLM's Worker: `rank`, `device`, `model_runner`)."""

    def __init__(self, args: EngineArgs, rank: int) -> None:
        self.rank, self.local_rank, self.device = rank, rank, torch.device("cpu")
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.sleeping: set[str] = set()
        self.model_runner = ModelRunner(FakeModel(hf, self.sleeping))


def _worker_class(extension: str) -> type:
    if not extension:
        return Worker
    module, _, name = extension.rpartition(".")
    return type("WorkerWithExtension", (Worker, getattr(importlib.import_module(module), name)), {})


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.args = EngineArgs(model=model, **kwargs)
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.multiproc_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # how its workers would start
        cls = _worker_class(self.args.worker_extension_cls)
        self.workers = [cls(self.args, r) for r in range(self.args.tensor_parallel_size)]
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
        # vLLM's generation_config "auto": a sample also stops on the model's generation config's eos_token_id(s)
        gen_eos = self.workers[0].model_runner.model.hf.generation_config.eos_token_id
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        self.stop_ids = {self.tokenizer.eos_token_id, *gen_eos} - {None}
        self.requests: list[list[int]] = []  # prompt ids of every request run
        self.prefix_cache_resets, self.running = 0, 0
        self.lock = threading.Lock()
        ENGINES.append(self)

    # --- generation
    @property
    def asleep(self) -> bool:
        return bool(self.workers[0].sleeping)

    def check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError(f"generate() while the engine sleeps ({sorted(self.workers[0].sleeping)}): wake_up()")
        if stale := self.workers[0].model_runner.model.discarded:
            raise RuntimeError(f"generate() with {len(stale)} weights discarded by sleep(level=2) and not loaded since")

    def generate(self, prompts: list[dict], sampling_params: Any = None, use_tqdm: bool = True) -> list[RequestOutput]:
        self.check_awake()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        return [self._run(str(i), p["prompt_token_ids"], sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def _run(self, request_id: str, prompt: list[int], sp: SamplingParams) -> RequestOutput:
        with self.lock:
            self.requests.append(list(prompt))
            self.running += 1
        try:
            model = self.workers[0].model_runner.model.hf
            gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else self.args.seed)
            outs = [self._sample(model, prompt, sp, gen, i) for i in range(sp.n)]
        finally:
            with self.lock:
                self.running -= 1
        return RequestOutput(request_id, list(prompt), outs, finished=True)

    def _sample(self, model: torch.nn.Module, prompt: list[int], sp: SamplingParams, gen: torch.Generator,
                index: int) -> CompletionOutput:
        ids, lps, reason = list(prompt), [], "length"
        for step in range(sp.max_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            if step < sp.min_tokens:
                logits[sorted(self.stop_ids)] = -float("inf")
            logp = processed(logits, sp)
            tok = int(logp.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(tok)
            lps.append({tok: Logprob(float(logp[tok]))})
            if tok in self.stop_ids:
                reason = "stop"
                break
        out = ids[len(prompt):]
        return CompletionOutput(index, self.tokenizer.decode(out, skip_special_tokens=True), out, lps, reason)

    # --- the engine's control surface
    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list:
        with ThreadPoolExecutor(len(self.workers)) as pool:  # as vLLM's worker processes: all at once
            futures = [pool.submit(getattr(w, method), *args, **(kwargs or {})) for w in self.workers]
            return [f.result() for f in futures]

    def reset_prefix_cache(self) -> bool:
        """False (nothing reset) while requests run, as vLLM."""
        if self.running:
            return False
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        if not self.args.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=True)")
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}")
        for w in self.workers:
            w.sleeping.update(SLEEP_TAGS)
            if level == 2:
                w.model_runner.model.discard()

    def wake_up(self, tags: list[str] | None = None) -> None:
        if unknown := set(tags or ()) - set(SLEEP_TAGS):
            raise ValueError(f"wake_up tags {sorted(unknown)}: vLLM's are {SLEEP_TAGS}")
        for w in self.workers:
            w.sleeping.difference_update(tags or SLEEP_TAGS)


def processed(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """vLLM's processed log-probs: logits / temperature, then top-k and top-p, renormalised."""
    logits = logits / (sp.temperature if sp.temperature > 0 else 1.0)
    if sp.top_k and sp.top_k > 0:
        kth = logits.topk(min(sp.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sp.top_p < 1.0:
        probs, order = logits.softmax(-1).sort(descending=True)
        drop = probs.cumsum(-1) - probs > sp.top_p  # keep the smallest head whose mass reaches top_p
        logits = logits.clone()
        logits[order[drop]] = -float("inf")
    return logits.log_softmax(-1)


class AsyncLLMEngine:
    """The async engine: one request per generate call, streamed; the same workers as LLM."""

    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLM(**dataclasses.asdict(args))
        self.in_flight = self.max_in_flight = 0
        self.shut, self.shut_on_loop = False, False
        self.loop = asyncio.get_running_loop()  # vLLM's output handler runs on the loop that built the engine

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLMEngine":
        return cls(engine_args)

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str):
        self.engine.check_awake()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.01)  # other requests come in meanwhile: continuous batching
            out = await asyncio.to_thread(self.engine._run, request_id, prompt["prompt_token_ids"], sampling_params)
            if sampling_params.output_kind == RequestOutputKind.FINAL_ONLY:
                yield out
                return
            for streamed in stream(out, sampling_params.output_kind == RequestOutputKind.DELTA, self.engine.tokenizer):
                yield streamed
                await asyncio.sleep(0)
        finally:
            self.in_flight -= 1

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        return await asyncio.to_thread(self.engine.collective_rpc, method, timeout, args, kwargs)

    async def reset_prefix_cache(self) -> bool:
        return not self.in_flight and self.engine.reset_prefix_cache()

    async def sleep(self, level: int = 1) -> None:
        self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def shutdown(self) -> None:
        self.shut = True
        try:
            self.shut_on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # called from another thread
            self.shut_on_loop = False


def stream(final: RequestOutput, delta: bool, tokenizer: Any) -> list[RequestOutput]:
    """A finished request as vLLM's async engine streams it with n samples: one output per new token of ONE sample
    (the samples interleaved, a token each in turn), holding that sample's tokens so far (or with `delta` the new
    one only); finish_reason on a sample's last; `finished` on the very last output."""
    outs, longest = [], max(len(o.token_ids) for o in final.outputs)
    for t in range(longest):
        for o in final.outputs:
            if t >= len(o.token_ids):
                continue
            lo = t if delta else 0
            ids, lps = o.token_ids[lo : t + 1], o.logprobs[lo : t + 1]
            done = t == len(o.token_ids) - 1
            child = CompletionOutput(o.index, tokenizer.decode(ids, skip_special_tokens=True), ids, lps,
                                     o.finish_reason if done else None)
            outs.append(RequestOutput(final.request_id, final.prompt_token_ids, [child], finished=False))
    outs[-1].finished = True
    return outs
