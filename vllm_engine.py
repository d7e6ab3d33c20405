"""vllm_engine.py: the vLLM rollout engines behind engines.py's interface (submit / generate / load_weights /
model_version / close), written against vLLM's public API (0.32 runs in CI through its CPU build; 0.33 makes the
same calls) and kept thin.

    pool = make_pool(cfg.explorer.rollout_model, model_path, max_model_len)   # engine_num engines (EnginePool)
    pool.submit(prompt_ids, SamplingParams(n=8)).result()             # to the least busy engine
    pool.load_weights("<job>/global_step_10/actor/huggingface", version=10)   # every worker reads the files
    pool.join_group(init_info); pool.receive(header)     # or straight from the trainer (wire.receive_init / _header)
    pool.checksums(); pool.weight_versions()                                  # what vLLM holds
    pool.sleep(); pool.wake_up()                                              # on a GPU shared with the trainer

- VLLMEngine (engine_type vllm): one `vllm.LLM`, its requests gathered into batches by sampling.Batcher.
- AsyncVLLMEngine (engine_type vllm_async): one `vllm.AsyncLLMEngine` driven by an asyncio loop in a thread:
  each request goes in as it comes and vLLM batches continuously (no batch-by-batch waiting).
- EnginePool: engine_num engines of tensor_parallel_size GPUs each, engine i on the explorer's GPUs
  [i * tp, (i + 1) * tp) (without CUDA: vLLM's CPU backend, every engine on the host's cores); a request goes to
  the engine with the fewest requests in flight.
Weights go through vLLM's own RL lifecycle (init_weight_transfer_engine once; start_weight_update / update_weights /
finish_weight_update(weight_version) per update; get_weight_version, compute_weight_checksums) and never through the
explorer's memory: the engines' weight-transfer engine (`weight_backend`) is vLLM's "nccl" between GPUs and nanorft's
gloo engine (weight_transfer.py, a vLLM plugin) on CPUs and on a GPU shared with the trainer; with the gloo engine
every worker also reads a published folder itself through the same lifecycle. The prefix cache is reset after
every update.
LoRA (sync.serves_adapter): the engines start from the base model with enable_lora (`lora_args`), every generate and
score request names the served adapter (LoRARequest, id 1), and new weights are a peft adapter folder loaded in place
(vLLM's add_lora with load_inplace; `load_adapter`), the version set and the prefix cache reset as for full weights;
over the process group the explorer's process receives the adapter (join_ranks 0), not the workers.
Log-probs: logprobs_mode "processed_logprobs", after temperature scaling as the HF engine's and the trainer's,
but also after top-k / top-p, EOS masking (min_tokens) and the repetition penalty: the trainer masks EOS at the same
positions (batching.eos_masked); configs/checks.py refuses the off-policy correction with the others on vLLM.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import wire
from errors import ConfigError
from models import eos_ids, generation_config, load_tokenizer
from sampling import Batcher, Completion, SamplingParams, check_request, check_scoring

log = logging.getLogger("nanorft.vllm_engine")
WEIGHT_BACKEND = "nanorft_gloo"  # weight_transfer.BACKEND (imported with vLLM: nanorft imports without it)
SLEEP_LEVEL = 1  # weights to host memory, KV cache dropped: wake_up is a copy back, no reload
# NOTE: both within lease.DEATH_GRACE_S (20 s), the time an explorer whose launcher died has before its SIGKILL
STOP_S = 15.0  # an engine's graceful shutdown: vLLM's SIGTERM to its engine core, SIGKILL after this (seconds)
CLOSE_MARGIN_S = 5.0  # EnginePool.close kills what still runs STOP_S + this after it began (a close that hung)


def weight_backend(cuda: bool, colocate: bool) -> str:
    """The vLLM weight-transfer engine the explorer's engines and the trainer use: vLLM's own "nccl" between GPUs;
    nanorft's gloo engine (weight_transfer.py) on CPUs and on one GPU shared with the trainer (NCCL cannot join two
    ranks on one GPU; vLLM's "ipc" engine would, but it ships its CUDA IPC handles between processes as pickles:
    docs/gpu-and-vllm.md)."""
    return "nccl" if cuda and not colocate else WEIGHT_BACKEND


def engine_args(model_path: str, max_model_len: int, rm: Any, repetition_penalty: float, colocate: bool) -> dict:
    """The vLLM engine arguments of a rollout model config (every vLLM option of the schema)."""
    return {
        "model": model_path,
        "tensor_parallel_size": rm.tensor_parallel_size,
        "gpu_memory_utilization": rm.gpu_memory_utilization,
        "enable_prefix_caching": rm.enable_prefix_caching,
        "enable_chunked_prefill": rm.enable_chunked_prefill,
        "enforce_eager": rm.enforce_eager,
        "dtype": rm.dtype,
        "seed": rm.seed,
        "max_model_len": max_model_len,
        "logprobs_mode": "processed_logprobs",
        "weight_transfer_config": {"backend": weight_backend(torch.cuda.is_available(), colocate)},
        "enable_sleep_mode": colocate,
    }


def lora_args(model: Any, folder: str) -> dict:
    """vLLM's LoRA engine arguments for serving model.lora_configs[0]'s adapter (sync.serves_adapter): one adapter
    (max_loras 1) of at most its rank (max_lora_rank: the smallest vLLM allows at or above it), lora_dtype,
    fully_sharded_loras and max_cpu_loras as the config says. The rank is the adapter's own where one is saved (the
    folder the engine starts from, else lora_configs[0].path: its adapter_config.json decides), else lora_rank."""
    import typing

    from vllm.config.lora import MaxLoRARanks

    c = model.lora_configs[0]
    rank = c.lora_rank
    for saved in (folder, c.path):
        if saved and Path(saved, "adapter_config.json").is_file():
            peft = json.loads(Path(saved, "adapter_config.json").read_text())
            rank = max([peft["r"], *(peft.get("rank_pattern") or {}).values()])
            break
    allowed = [r for r in typing.get_args(MaxLoRARanks) if r >= rank]
    if not allowed:
        raise ConfigError(
            f"model.lora_configs[0]: rank {rank} is over vLLM's largest, {typing.get_args(MaxLoRARanks)[-1]}"
        )
    dtype = "float32" if c.lora_dtype in ("float32", "fp32") else c.lora_dtype
    return {
        "enable_lora": True,
        "max_lora_rank": allowed[0],
        "max_loras": 1,
        "lora_dtype": getattr(torch, dtype) if dtype == "float32" else dtype,
        "fully_sharded_loras": model.fully_sharded_loras,
        "max_cpu_loras": model.max_cpu_loras,
    }


def vllm_params(
    vllm: Any, prompt: list[int], p: SamplingParams, max_model_len: int, penalty: float, **extra: Any
) -> Any:
    """vllm.SamplingParams of one request: logprobs=0 returns the sampled token's log-prob only. `extra`: more
    SamplingParams fields (the async engine's output_kind)."""
    max_tokens = min(p.max_tokens, max_model_len - len(prompt))  # NOTE: vLLM refuses min_tokens > max_tokens
    return vllm.SamplingParams(
        n=p.n,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=max_tokens,
        min_tokens=min(p.min_tokens, max_tokens),
        stop=list(p.stop),
        seed=p.seed,
        logprobs=0,
        repetition_penalty=penalty,
        **extra,
    )


def completions(outputs: list[Any], version: int) -> list[Completion]:
    """sampling.Completion of each sample (vLLM CompletionOutputs; the EOS that ended a sample stays in token_ids; a
    stop string is cut from the text), with the versions that sampled its tokens (`version_spans`)."""
    out = []
    for o in outputs:
        spans = version_spans(getattr(o, "weight_versions", None), version)
        out.append(
            Completion(
                list(o.token_ids),
                [step[t].logprob for t, step in zip(o.token_ids, o.logprobs)],
                o.text,
                "length" if o.finish_reason == "length" else "stop",
                min(v for _, v in spans),
                spans if len(spans) > 1 else [],
            )
        )
    return out


def version_spans(reported: list[Any] | None, version: int) -> list[tuple[int, int]]:
    """[(first token index, version)] of a sample from vLLM's WeightVersionSpans (version: the label the engine core
    had when it sampled tokens [start, end); set at every sync through update_weight_version, on the final output
    only), adjacent spans of one version merged. A sample vLLM reports no spans for, or a label that is not a number
    (vLLM's "default" before nanorft set one): [(0, version)], the engine's version now (no update ran during it)."""
    labels = [(s.start, s.version) for s in reported or [] if s.end > s.start]
    if not labels or not all(str(v).isdigit() for _, v in labels):
        return [(0, version)]
    spans: list[tuple[int, int]] = []
    for start, label in labels:
        if not spans or spans[-1][1] != int(label):
            spans.append((start, int(label)))
    return [(0, spans[0][1]), *spans[1:]]


def scoring_params(vllm: Any, sequences: list[list[int]], temperature: float, max_model_len: int, **extra: Any) -> Any:
    """vllm.SamplingParams of a scoring request (engines.HFEngine.score's meaning): the prompt's own log-probs
    (prompt_logprobs=0: each token's, given those before it) and one sampled token, which is dropped. vLLM's
    prompt_logprobs skip its sampling processors, temperature included, so it scores at 1.0 only; it skips reading
    the prefix cache for them by itself. ValueError for what it cannot score. `extra`: more SamplingParams fields."""
    check_scoring(sequences, temperature, max_model_len - 1, "max_model_len - 1: vLLM samples one token after it")
    if temperature != 1.0:
        raise ValueError(
            f"scoring temperature {temperature:g}: vLLM's prompt log-probs are taken at temperature 1.0 (prompt tokens "
            "skip its sampling processors); score at 1.0, or with the HF engine (engine_type: hf)"
        )
    return vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, **extra)


def prompt_logprobs(out: Any, sequence: list[int]) -> list[float]:
    """The log-probs of a scored sequence's tokens after the first (a RequestOutput's prompt_logprobs: None for the
    first token, then {token id: Logprob} holding at least the token's own)."""
    return [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], sequence[1:])]


def adapter_request(vllm: Any, name: str, folder: str, inplace: bool = False) -> Any:
    """vLLM's LoRARequest of the served adapter: always lora_int_id 1 (one adapter; a new one replaces it in place,
    `inplace`: load_inplace, which only the load itself asks for: a request asking for it reloads at every step)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1, folder, load_inplace=inplace)


def worker_error(e: Exception) -> str:
    """What went wrong in a vLLM worker. NOTE: vLLM re-raises a worker's exception as a bare Exception "Call to
    collective_rpc method failed: Worker failed with error '<the error>', please check the stack trace above ...";
    the explorer logs the error itself."""
    text = str(e) or type(e).__name__
    found = re.search(r"Worker failed with error '(.*)', please check", text, re.DOTALL)
    return (found.group(1) if found else text).splitlines()[0]


def update_bytes(update_info: dict) -> int:
    """The tensors' bytes of one transfer's update info: nanorft's gloo engine's (a wire header) or vLLM's NCCL
    engine's (names, dtype_names, shapes)."""
    if "header" in update_info:
        return wire.header_bytes(update_info["header"])
    sizes = zip(update_info["dtype_names"], update_info["shapes"])
    return sum(math.prod(shape) * getattr(torch, d).itemsize for d, shape in sizes)


def merged(workers: list[dict[str, str]]) -> dict[str, str]:
    """One engine's checksums from its workers' (each names its weights with its parallel rank)."""
    return {name: digest for worker in workers for name, digest in worker.items()}


def reset_prefix_cache(reset: Any, tries: int = 50) -> None:
    """reset() (an engine's reset_prefix_cache) until it returns True. NOTE: vLLM returns False, resetting nothing,
    while requests hold cached blocks; KV blocks of the old weights must not serve the new ones."""
    for _ in range(tries):
        if reset():
            return
        time.sleep(0.1)
    raise RuntimeError(f"vLLM would not reset its prefix cache after new weights ({tries} tries): requests running?")


class VLLMEngine:
    """engine_type vllm: one `vllm.LLM`; concurrent submits share batches (sampling.Batcher), one generate call
    per batch. `llm_args`: engine_args(...)."""

    engine_type = "vllm"

    def __init__(self, llm_args: dict, repetition_penalty: float = 1.0) -> None:
        import vllm  # lazily: nanorft imports without vLLM

        self.vllm, self.penalty, self.max_model_len = vllm, repetition_penalty, llm_args["max_model_len"]
        self.llm = vllm.LLM(**llm_args)
        self.tokenizer = load_tokenizer(llm_args["model"])
        # the ids vLLM stops on: the tokenizer's EOS and the generation config's (as the HF engine's; Episode reads it)
        self.eos_ids = eos_ids(self.tokenizer, generation_config(llm_args["model"]))
        self.model_version = 0
        self.lora: Any = None  # the served LoRA adapter's vllm LoRARequest, named by every request (None: the base)
        self.batcher = Batcher(self.run_batch, self.max_model_len)

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        return self.batcher.submit(prompt_ids, params)

    def run_batch(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        sps = [vllm_params(self.vllm, ids, p, self.max_model_len, self.penalty) for ids, p in zip(prompt_ids, params)]
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outs = self.llm.generate(prompts, sampling_params=sps, use_tqdm=False, lora_request=self.lora)
        return [completions(out.outputs, self.model_version) for out in outs]

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each token's log-prob given those before it (engines.HFEngine.score), on the worker between batches."""
        sp = scoring_params(self.vllm, sequences, temperature, self.max_model_len)
        prompts = [{"prompt_token_ids": seq} for seq in sequences]
        outs = self.batcher.call(
            lambda: self.llm.generate(prompts, sampling_params=sp, use_tqdm=False, lora_request=self.lora)
        )
        return [prompt_logprobs(out, seq) for out, seq in zip(outs, sequences)]

    def init_transfer(self, init_info: dict) -> None:
        """vLLM's init_weight_transfer_engine on every worker (between batches)."""
        self.batcher.call(lambda: self.llm.init_weight_transfer_engine({"init_info": init_info}))

    def update(self, update_info: dict, version: int) -> None:
        """One weight update through vLLM's lifecycle, between batches: start, update, finish with the version."""

        def lifecycle() -> None:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": update_info})
            self.llm.finish_weight_update(weight_version=str(version))
            reset_prefix_cache(self.llm.reset_prefix_cache)  # KV blocks of the old weights

        self.batcher.call(lifecycle)
        self.model_version = version

    def reload(self, folder: str, version: int) -> None:
        """A published folder through vLLM's documented in-place reload (the workers' reload_weights), between
        batches: for an engine whose weight-transfer engine has no folder source (vLLM's nccl)."""

        def reload() -> None:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            self.llm.update_weight_version(str(version))
            reset_prefix_cache(self.llm.reset_prefix_cache)

        self.batcher.call(reload)
        self.model_version = version

    def load_adapter(self, name: str, folder: str, version: int) -> None:
        """The LoRA adapter at `folder` in place of the one served (lora_id 1, load_inplace), between batches; the
        requests after it name it. NOTE: `LLM` has no add_lora of its own: its engine's."""

        def load() -> None:
            self.llm.llm_engine.add_lora(adapter_request(self.vllm, name, folder, inplace=True))
            self.llm.update_weight_version(str(version))
            reset_prefix_cache(self.llm.reset_prefix_cache)  # KV blocks of the old adapter

        self.batcher.call(load)
        self.lora, self.model_version = adapter_request(self.vllm, name, folder), version

    def set_version(self, version: int) -> None:
        self.batcher.call(lambda: self.llm.update_weight_version(str(version)))
        self.model_version = version

    def weight_version(self) -> str:
        return self.batcher.call(self.llm.get_weight_version)

    def checksums(self) -> dict[str, str]:
        """vLLM's checksum of every weight of every worker (compute_weight_checksums; `LLM` has no method of its
        own for it: its workers' through collective_rpc)."""
        return merged(self.batcher.call(lambda: self.llm.collective_rpc("compute_weight_checksums")))

    def end_transfer(self) -> None:
        self.batcher.call(self.llm.shutdown_weight_transfer_engine)

    def sleep(self) -> None:
        self.batcher.call(lambda: self.llm.sleep(level=SLEEP_LEVEL))

    def wake_up(self) -> None:
        self.batcher.call(self.llm.wake_up)

    def close(self, timeout: float = STOP_S) -> None:
        """The batch running finishes, then the engine core and its workers stop (`stop_llm`)."""
        self.batcher.close()
        if self.llm is not None:
            stop_llm(self.llm, timeout)
            self.llm = None


class AsyncVLLMEngine:
    """engine_type vllm_async: one `vllm.AsyncLLMEngine` on an asyncio loop in its own thread; each submit is one
    request streamed into the running engine (continuous batching). NOTE: vLLM's async engine streams by default, and
    with n > 1 each streamed output holds only the sample that just produced tokens: requests ask for
    RequestOutputKind.FINAL_ONLY (one output, all n samples), and samples are collected by index regardless."""

    engine_type = "vllm_async"

    def __init__(self, llm_args: dict, repetition_penalty: float = 1.0) -> None:
        import vllm
        from vllm.sampling_params import RequestOutputKind

        self.vllm, self.penalty, self.max_model_len = vllm, repetition_penalty, llm_args["max_model_len"]
        self.final_only = RequestOutputKind.FINAL_ONLY
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-async", daemon=True)
        self.thread.start()
        self.llm = self.call(self._start(vllm.AsyncEngineArgs(**llm_args)))
        self.tokenizer = load_tokenizer(llm_args["model"])
        self.eos_ids = eos_ids(self.tokenizer, generation_config(llm_args["model"]))  # as VLLMEngine's
        self.model_version, self.ids = 0, itertools.count()
        self.lora: Any = None  # as VLLMEngine's

    @contextlib.contextmanager
    def keep_requests(self) -> Iterator[None]:
        """Pause generation with the requests in flight kept (vLLM's pause_generation(mode="keep")), e.g. while new
        weights load; they go on on `resume_generation`, and a request started under version v finishes under v+1.
        NOTE: with clear_cache (vLLM's default) the engine core preempts the running requests and frees their KV
        blocks (Scheduler.reset_prefix_cache(reset_running_requests=True)): on resume each is prefilled again, its
        prompt and the tokens it has so far, with the new weights; no KV entry of the old weights serves a new token
        (the tokens sampled before keep their old-weights log-probs: the spans say which)."""
        self.call(self.llm.pause_generation(mode="keep", clear_cache=True))
        try:
            yield
        finally:
            self.call(self.llm.resume_generation())

    async def _start(self, args: Any) -> Any:
        return self.vllm.AsyncLLMEngine.from_engine_args(args)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        check_request(prompt_ids, params, self.max_model_len)
        sp = vllm_params(self.vllm, prompt_ids, params, self.max_model_len, self.penalty, output_kind=self.final_only)
        return asyncio.run_coroutine_threadsafe(self._generate(prompt_ids, sp), self.loop)

    async def _generate(self, prompt_ids: list[int], sp: Any) -> list[Completion]:
        samples: dict[int, Any] = {}  # sample index -> its newest (cumulative) output
        version = self.model_version  # the version it starts on: where vLLM reports no spans, the oldest it had
        request = {"prompt_token_ids": prompt_ids}
        async for out in self.llm.generate(request, sp, request_id=f"r{next(self.ids)}", lora_request=self.lora):
            samples.update((o.index, o) for o in out.outputs)
        if sorted(samples) != list(range(sp.n)):
            raise RuntimeError(f"vLLM returned samples {sorted(samples)} of a request for n={sp.n}")
        return completions([samples[i] for i in range(sp.n)], version)

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each token's log-prob given those before it (engines.HFEngine.score): one request per sequence."""
        sp = scoring_params(self.vllm, sequences, temperature, self.max_model_len, output_kind=self.final_only)
        futures = [asyncio.run_coroutine_threadsafe(self._score(seq, sp), self.loop) for seq in sequences]
        return [f.result() for f in futures]

    async def _score(self, sequence: list[int], sp: Any) -> list[float]:
        last = None
        request = {"prompt_token_ids": sequence}
        async for out in self.llm.generate(request, sp, request_id=f"s{next(self.ids)}", lora_request=self.lora):
            last = out
        return prompt_logprobs(last, sequence)

    def init_transfer(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self.call(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    def update(self, update_info: dict, version: int) -> None:
        """One weight update through vLLM's lifecycle (VLLMEngine.update)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self.call(self.llm.start_weight_update())
        self.call(self.llm.update_weights(WeightTransferUpdateRequest(update_info)))
        self.call(self.llm.finish_weight_update(weight_version=str(version)))
        reset_prefix_cache(lambda: self.call(self.llm.reset_prefix_cache()))
        self.model_version = version

    def reload(self, folder: str, version: int) -> None:
        """VLLMEngine.reload."""
        self.call(self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder}))
        self.set_version(version)
        reset_prefix_cache(lambda: self.call(self.llm.reset_prefix_cache()))

    def load_adapter(self, name: str, folder: str, version: int) -> None:
        """VLLMEngine.load_adapter (AsyncLLM's add_lora)."""
        self.call(self.llm.add_lora(adapter_request(self.vllm, name, folder, inplace=True)))
        self.set_version(version)
        reset_prefix_cache(lambda: self.call(self.llm.reset_prefix_cache()))
        self.lora = adapter_request(self.vllm, name, folder)

    def set_version(self, version: int) -> None:
        self.call(self.llm.update_weight_version(str(version)))
        self.model_version = version

    def weight_version(self) -> str:
        return self.call(self.llm.get_weight_version())

    def checksums(self) -> dict[str, str]:
        return merged(self.call(self.llm.compute_weight_checksums()))

    def end_transfer(self) -> None:
        self.call(self.llm.shutdown_weight_transfer_engine())

    def sleep(self) -> None:
        self.call(self.llm.sleep(level=SLEEP_LEVEL))

    def wake_up(self) -> None:
        self.call(self.llm.wake_up())

    async def _shutdown(self, timeout: float) -> None:
        """vLLM's AsyncLLM.shutdown (its engine core SIGTERMed, SIGKILLed after `timeout` s), then every task left
        on the loop (requests abandoned in flight) cancelled and awaited. NOTE: on the loop that runs the engine's
        output handler: shutdown cancels the handler before the engine core's end can reach it. Left to vLLM's
        finalizer at interpreter exit, the engine core stopped under a running handler ("AsyncLLM output_handler
        failed", EngineDeadError), then AsyncLLM.__del__ ran after vLLM's modules were gone (TypeError)."""
        llm, self.llm = self.llm, None  # NOTE: its __del__ (a second shutdown, a no-op) runs here, modules alive
        llm.shutdown(timeout=timeout)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def close(self, timeout: float = STOP_S) -> None:
        """Shut the engine down (`_shutdown`), then stop the loop and its thread."""
        if not self.loop.is_running():
            return
        try:
            self.call(self._shutdown(timeout))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


class EnginePool:
    """engine_num vLLM engines behind one engine's interface: requests go to the least busy engine; weights, sleep
    and wake-up go to all of them at once (their workers meet in one weight group, so one at a time would hang)."""

    def __init__(
        self, engines: list[VLLMEngine | AsyncVLLMEngine], ranks_per_engine: int, backend: str = WEIGHT_BACKEND
    ) -> None:
        self.engines, self.per_engine, self.backend = engines, ranks_per_engine, backend
        self.adapter = ""  # the name of the LoRA adapter the engines serve (make_pool's `lora`); "": none served
        self.engine_type, self.tokenizer = engines[0].engine_type, engines[0].tokenizer
        self.eos_ids = engines[0].eos_ids  # the ids a sample ends on (workflows/episode.py ends a turn on any)
        self.in_flight = [0] * len(engines)
        self.mutex, self.asleep, self.joined = threading.Lock(), False, False
        self.procs: dict[int, int | None] = {}  # pid -> start time of the engines' processes (make_pool's record)
        self.closed = False
        # explorer.partial_rollout (set at the explorer's set-up): weight updates keep the requests in flight
        # (`keep_requests`) instead of finding none (explore steps that do not overlap)
        self.in_flight_updates = False

    @contextlib.contextmanager
    def keep_requests(self) -> Iterator[None]:
        """Around a weight update: with in_flight_updates, every engine paused with its requests kept
        (AsyncVLLMEngine.keep_requests), resumed after; else nothing."""
        with contextlib.ExitStack() as stack:
            if self.in_flight_updates:
                for e in self.engines:
                    stack.enter_context(e.keep_requests())
            yield

    @property
    def model_version(self) -> int:
        return self.engines[0].model_version

    @model_version.setter
    def model_version(self, version: int) -> None:  # the explorer sets the version of the weights it started with
        self.all(lambda e: e.set_version(version))  # vLLM's update_weight_version: its outputs carry it

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        with self.mutex:
            i = min(range(len(self.engines)), key=self.in_flight.__getitem__)
            self.in_flight[i] += 1
        future = self.engines[i].submit(prompt_ids, params)
        future.add_done_callback(lambda _: self._done(i))
        return future

    def _done(self, i: int) -> None:
        with self.mutex:
            self.in_flight[i] -= 1

    def generate(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
        futures = [self.submit(ids, p) for ids, p in zip(prompt_ids, params)]
        return [f.result() for f in futures]

    def score(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        """Each token's log-prob given those before it (engines.HFEngine.score), on the least busy engine."""
        with self.mutex:
            i = min(range(len(self.engines)), key=self.in_flight.__getitem__)
            self.in_flight[i] += 1
        try:
            return self.engines[i].score(sequences, temperature)
        finally:
            self._done(i)

    def all(self, fn: Any) -> list:
        """fn(engine) on every engine at once (threads); their results in engine order."""
        with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as pool:
            return list(pool.map(fn, self.engines))

    def load_weights(self, source: str | dict[str, torch.Tensor], version: int) -> None:
        """New weights from a published HF folder, which every worker reads itself, through vLLM's weight-update
        lifecycle (weight_transfer.GlooEngine); serving a LoRA adapter, a peft adapter folder loaded in place of the
        one served (load_adapter). OSError when the folder cannot be loaded, checked before any worker starts
        (sync.load_published then retries with the newest folder)."""
        if not isinstance(source, str):
            raise TypeError("vLLM engines load weights from a folder or over the weight group, not a state dict")
        from weight_transfer import check_folder

        try:
            check_folder(source)
        except OSError as e:
            raise OSError(f"vLLM workers could not load {source}: {e}") from e
        self.wake_up()  # vLLM loads weights into awake engines
        with self.keep_requests():
            if self.adapter:
                self.all(lambda e: e.load_adapter(self.adapter, source, version))
            elif self.backend == WEIGHT_BACKEND:
                self.all(lambda e: e.update({"folder": source}, version))
            else:  # vLLM's own engines have no folder source: its documented reload from a path
                self.all(lambda e: e.reload(source, version))

    def join_ranks(self) -> int:
        """How many ranks receive weights over the group: every worker of every engine; none when they serve a LoRA
        adapter (the explorer receives it, writes it as a folder and loads that: sync.ExplorerSync.take_weights)."""
        return 0 if self.adapter else len(self.engines) * self.per_engine

    def join_group(self, init_info: dict) -> None:
        """Every worker joins the trainer's weight group (vLLM's init_weight_transfer_engine with the trainer's init
        info, wire.receive_init), engine i's workers from rank 1 + i * tensor_parallel_size on, after the explorer
        announced join_ranks() receivers."""
        first = {id(e): 1 + i * self.per_engine for i, e in enumerate(self.engines)}
        try:
            self.all(lambda e: e.init_transfer({**init_info, "rank_offset": first[id(e)]}))
        except Exception as e:  # NOTE: vLLM re-raises a worker's error as a bare Exception, whatever its type
            raise wire.SyncError(f"vLLM workers could not join the weight group: {worker_error(e)}") from e
        self.joined = True

    def receive(self, header: dict) -> int:
        """One transfer over the weight group (a header the trainer's weight_transfer.StoreClient posted: its version
        and the update info of the engines' weight-transfer engine), through vLLM's weight-update lifecycle: every
        worker takes the tensors. Returns the bytes of the transfer. SyncError (the explorer's restart message)
        when it broke: the engines' weights are then half-updated, and the explorer stops."""
        self.wake_up()
        try:
            with self.keep_requests():
                self.all(lambda e: e.update(header["update_info"], header["version"]))
        except Exception as e:
            raise wire.SyncError(worker_error(e)) from e
        return update_bytes(header["update_info"])

    def checksums(self) -> list[dict[str, str]]:
        """Each engine's weight checksums (vLLM's compute_weight_checksums, every worker's merged)."""
        return self.all(lambda e: e.checksums())

    def weight_versions(self) -> list[str]:
        """Each engine's weight version as vLLM holds it (get_weight_version)."""
        return self.all(lambda e: e.weight_version())

    def sleep(self) -> None:
        """Free the GPU for the trainer (level 1: weights to host memory, KV cache dropped)."""
        if not self.asleep:
            self.all(lambda e: e.sleep())
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.all(lambda e: e.wake_up())
            self.asleep = False

    def close(self, timeout: float = STOP_S) -> None:
        """Shut every engine down, all at once: the workers leave the weight group, then each engine ends its
        requests and stops its engine core and workers (vLLM's shutdown: SIGTERM, SIGKILL after `timeout` s, its
        warning naming what it killed). What still runs `timeout` + CLOSE_MARGIN_S s after this began (a close that
        hung) is killed here, with a warning naming each process. Called again (atexit's), it does nothing."""
        if self.closed:
            return
        self.closed = True
        closing = threading.Thread(target=self._close_engines, args=(timeout,), daemon=True, name="vllm-close")
        closing.start()
        closing.join(timeout + CLOSE_MARGIN_S)  # NOTE: daemon threads: a close that hangs cannot hold the exit
        kill_left(self.procs, f"{timeout + CLOSE_MARGIN_S:g} s after the vLLM engines began to close")

    def _close_engines(self, timeout: float) -> None:
        """EnginePool.close's part that may hang: each engine's close in a thread of its own, all waited for."""
        try:
            if self.joined:  # each worker leaves the weight group first (vLLM's shutdown_weight_transfer_engine)
                self.all(lambda e: e.end_transfer())
                self.joined = False
        except Exception as e:  # a worker that cannot leave the group: the engine stops all the same
            log.warning("vLLM workers could not leave the weight group: %s", e)
        threads = [
            threading.Thread(target=close_engine, args=(e, i, timeout), daemon=True, name=f"vllm-close-{i}")
            for i, e in enumerate(self.engines)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def close_engine(engine: VLLMEngine | AsyncVLLMEngine, index: int, timeout: float) -> None:
    """engine.close(timeout); a failure is a warning (what is left running is killed by EnginePool.close)."""
    try:
        engine.close(timeout)
    except Exception as e:
        log.warning("vLLM engine %d did not close cleanly: %s: %s", index + 1, type(e).__name__, e)


def stop_llm(llm: Any, timeout: float) -> None:
    """Stop a `vllm.LLM`'s engine core and workers now: SIGTERM, SIGKILL after `timeout` s (vLLM's warning names
    what it killed). NOTE: vLLM 0.32's LLM has no shutdown() (AsyncLLM has; LLM.shutdown() was proposed, vLLM PR
    #36283, and closed): its engine client's shutdown is the call. Left to vLLM's finalizer (the LLM collected), the
    grace is a fixed 5 s, which the worker overran on a busy CPU: force-killed at every end (docs/LOG.md, 2026-11-29).
    The one place nanorft reaches past LLM's methods to stop it."""
    shutdown = getattr(llm, "shutdown", None) or llm.llm_engine.engine_core.shutdown
    shutdown(timeout=timeout)


def engine_processes(before: set[int]) -> dict[int, int | None]:
    """pid -> start time of this process's descendants not in `before`: the engine core and workers of the engines
    started since. NOTE: multiprocessing's resource tracker (one per process, started with vLLM's first shared
    memory) is left out: it ends by itself with this process, after freeing what is left in shared memory."""
    import lease
    import proctree

    new = [p for p in proctree.descendants(os.getpid()) if p not in before]
    return {p: lease.started(p) for p in new if "resource_tracker" not in proctree.describe(p)}


def kill_left(engine_procs: dict[int, int | None], when: str) -> list[int]:
    """SIGKILL the engine processes still running (after up to 2 s for those ending), with a warning naming them
    (`when`: since when they should have ended). Returns their pids."""
    import proctree

    left = proctree.still_running([p for p, start in engine_procs.items() if proctree.alive(p, start)], 2.0)
    if left:
        shown = ", ".join(map(proctree.describe, left))
        log.warning("vLLM engine processes still running %s: %s; killing them (SIGKILL)", when, shown)
        proctree.stop_all(left, 0.0)
    return left


@contextlib.contextmanager
def visible_gpus(gpus: list[str] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES = `gpus` while an engine starts (None: as it is). NOTE: vLLM starts its engine core and
    workers as processes at construction; they inherit the environment then, so each engine sees its own GPUs only."""
    if gpus is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def explorer_gpus(count: int) -> list[str]:
    """The GPUs this explorer process may use, as CUDA_VISIBLE_DEVICES names them (the launcher's split)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [g for g in seen.split(",") if g] if seen is not None else [str(i) for i in range(count)]
    return names


def placements(rm: Any, first_gpu: int) -> list[list[str] | None]:
    """Each engine's GPUs: tensor_parallel_size of them, from the explorer's GPU `first_gpu` on; without CUDA, None
    for every engine (vLLM's CPU backend: each engine's worker on the host's cores)."""
    if not torch.cuda.is_available():
        return [None] * rm.engine_num
    tp, gpus = rm.tensor_parallel_size, explorer_gpus(torch.cuda.device_count())[first_gpu:]
    if len(gpus) < rm.engine_num * tp:
        raise RuntimeError(
            f"{rm.engine_num} engines x {tp} GPUs need {rm.engine_num * tp} GPUs; "
            f"this explorer sees {len(gpus)} ({gpus})"
        )
    return [gpus[i * tp : (i + 1) * tp] for i in range(rm.engine_num)]


def make_pool(
    rm: Any,
    model_path: str,
    max_model_len: int,
    repetition_penalty: float = 1.0,
    colocate: bool = False,
    first_gpu: int = 0,
    lora: dict | None = None,
) -> EnginePool:
    """engine_num engines of rm.engine_type, each on its tensor_parallel_size GPUs (sleep mode when colocated),
    from the explorer's GPU `first_gpu` on (auxiliary models come after the rollout model's). `lora`: serve a LoRA
    adapter on `model_path` (the base): {"name": its request name, **lora_args}; the pool loads it (load_weights)."""
    cls = AsyncVLLMEngine if rm.engine_type == "vllm_async" else VLLMEngine
    # NOTE: vLLM forks its workers by default; spawned, each reads the CUDA_VISIBLE_DEVICES its engine was built with
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # NOTE: before vLLM is first imported: its own log handler prints ~60 INFO lines per engine start on the console;
    # without it, vLLM's records go to this process's handlers (the explorer's log file; its console at the level
    # the launcher sets), and its engine and worker processes print only warnings and errors
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # NOTE: the engine core's grace for its workers (vLLM's default 5 s, which a worker overran on a busy CPU: SIGTERM
    # with a warning at every end), inside the engine's own bound STOP_S
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(int(STOP_S * 2 / 3)))
    import proctree

    args, engines = engine_args(model_path, max_model_len, rm, repetition_penalty, colocate), []
    served = dict(lora or {})
    name = served.pop("name", "")
    args |= served
    before = set(proctree.descendants(os.getpid()))  # what runs already: the engines' processes are what comes next
    for i, gpus in enumerate(placements(rm, first_gpu)):
        with visible_gpus(gpus):
            engines.append(cls({**args, "seed": rm.seed + i}, repetition_penalty))  # engines sample differently
        log.info(
            "rollout engine %d/%d: %s on %s",
            i + 1,
            rm.engine_num,
            cls.engine_type,
            "the CPU" if gpus is None else f"GPU(s) {','.join(gpus)}",
        )
    pool = EnginePool(engines, rm.tensor_parallel_size, args["weight_transfer_config"]["backend"])
    pool.adapter = name
    pool.procs = engine_processes(before)
    atexit.register(pool.close)  # NOTE: whatever ends this process (an error, SIGTERM): before vLLM's finalizers
    return pool
