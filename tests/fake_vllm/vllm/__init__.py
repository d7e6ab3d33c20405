"""A fake of the part of vLLM's public API that vllm_engine.py uses, for what a CPU cannot show: GPUs (each engine's
CUDA_VISIBLE_DEVICES, tensor-parallel workers), the GPU memory that sleep mode frees, and the one-GPU colocated run.
Everything else it imitates is checked against real vLLM (0.32, its CPU build) by tests/test_vllm_contract.py, where
each behaviour below runs on both: `LLM(**engine args)` with `generate`, `collective_rpc`, `reset_prefix_cache`,
`sleep(level)`, `wake_up(tags)`, `llm_engine.engine_core.shutdown(timeout)`; `AsyncEngineArgs`,
`AsyncLLMEngine.from_engine_args` with async `generate(prompt, sampling_params, request_id)` (an async generator
whose last output is the finished request), async `collective_rpc` / `reset_prefix_cache` / `sleep` / `wake_up`,
`pause_generation` / `resume_generation`, and `shutdown(timeout)`; `SamplingParams` and
`sampling_params.RequestOutputKind`; outputs with `.outputs[i].index / .token_ids / .logprobs ({token: Logprob}) /
.text / .finish_reason` and `.prompt_logprobs`; vLLM's RL lifecycle on LLM and the async engine
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`, `finish_weight_update(weight_version)`,
`update_weight_version`, `get_weight_version`, `compute_weight_checksums`, `shutdown_weight_transfer_engine`) with the
factories and base classes of `vllm.distributed.weight_transfer` and the layer-wise reload it runs inside.

What it models, so that the adapter's use of it is checked:
- engine arguments: only vLLM's names are accepted (a TypeError otherwise); logprobs_mode must be one of vLLM's;
- tensor_parallel_size workers per engine, each a full copy of the model on the CPU with the weight-transfer engine
  that `weight_transfer_config` names, from the factory the `vllm.general_plugins` entry points registered it in (as
  vLLM loads plugins in every process); collective_rpc runs a method on every worker at once (threads,
  as vLLM's worker processes) and returns their results in rank order; a worker's exception comes back as a bare
  Exception naming it (vLLM's "Call to collective_rpc method failed: Worker failed with error ...");
- weights go in through the model's load_weights between the layer-wise reload's start and finish (the lifecycle's
  start_weight_update / finish_weight_update); the model's own load_weights outside a reload fails, as on vLLM's
  CPU build (its weights are repacked after loading);
- prompt_logprobs (a request's SamplingParams.prompt_logprobs): each prompt token's raw log-prob given those before
  it, None for the first, not processed (no temperature, penalty or filtering), as vLLM's;
- "processed_logprobs": log-probs after the repetition penalty (on the prompt's and the response's tokens), the
  EOS masking of min_tokens, temperature, top-k and top-p (the filtered distribution renormalised);
- stopping (generation_config "auto", vLLM's default): a sample ends on the tokenizer's EOS or any eos_token_id of
  the model's generation config (min_tokens masks them all), or once a stop string appears in its text (the text
  cut before it, the token that completed it kept);
- seeds: a request's seed decides its samples (on any engine); without one, an engine's own generator, seeded
  once with its seed, goes on from request to request;
- the async engine streams as vLLM's does: without output_kind FINAL_ONLY, an output per engine step holding the
  samples that produced a token in it (not always all n: the first holds sample 0 alone, as vLLM's did in some runs),
  each with its tokens so far (or only the new ones with DELTA); with FINAL_ONLY, one output of all n;
- sleep mode: sleep() without enable_sleep_mode is an error; generate() while any part sleeps is an error; level 1
  keeps the weights (in host memory), level 2 discards them: after wake_up, generating before every weight was
  loaded again is an error (real vLLM would generate from garbage); wake_up(tags=["weights"] / ["kv_cache"]) wakes a
  part; loading weights into sleeping weights is an error; reset_prefix_cache() is False while requests run;
- the environment each engine was built in (CUDA_VISIBLE_DEVICES, VLLM_WORKER_MULTIPROC_METHOD), and the
  requests each engine ran; engine arguments' dtype among vLLM's names.
Generation is a plain loop over the tiny model, a request's n samples in one batch on HF's KV cache: slow, but exact
(fp32).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import importlib.metadata
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from vllm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.32.0+fake"
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType: no bf16 / fp16 / fp32
ENGINES: list[LLM] = []  # every engine built, for the tests to look into
SLEEP_TAGS = ("weights", "kv_cache")
PLUGINS_LOADED = False
__all__ = ["LLM", "AsyncLLMEngine", "AsyncEngineArgs", "SamplingParams", "RequestOutputKind"]


def no_lora(lora_request: Any) -> None:
    """vLLM's generate takes a LoRA request (nanorft's engines pass None but where they serve an adapter); the fake
    serves none (real vLLM's CPU build runs the adapter-serving tests)."""
    if lora_request is not None:
        raise NotImplementedError("the fake vLLM serves no LoRA adapter")


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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with SamplingParams.prompt_logprobs


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
    enable_sleep_mode: bool = False
    weight_transfer_config: dict | None = None  # vLLM's WeightTransferConfig as a dict: {"backend": name}

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
        self.reloading = False  # inside a layer-wise reload (model_executor/model_loader/reload.py)

    def discard(self) -> None:
        with torch.no_grad():
            for name, w in self.hf.named_parameters():
                w.fill_(float("nan"))  # what the re-allocated memory holds: not the weights
                self.discarded.add(name)

    def load_weights(self, weights: Any) -> set[str]:
        if not self.reloading:  # vLLM's CPU build repacks its weights after loading (as quantized layers on GPUs)
            name, tensor = next(iter(weights))
            raise RuntimeError(f"Attempted to load weight ({tensor.shape}) into parameter (torch.Size([0]))")
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
    """One tensor-parallel worker (vLLM's Worker: `rank`, `device`, `model_runner`, and the weight-transfer engine
    vLLM's factory builds at model load when the engine arguments name a backend), with vLLM's worker methods of the
    weight-update lifecycle: a second start before a finish, or an update or finish without a start, is an error."""

    def __init__(self, args: EngineArgs, rank: int) -> None:
        self.rank, self.local_rank, self.device = rank, rank, torch.device("cpu")
        hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        self.sleeping: set[str] = set()
        self.model_runner = ModelRunner(FakeModel(hf, self.sleeping))
        self.weight_transfer_engine, self.updating = None, False
        if args.weight_transfer_config is not None:
            from vllm.distributed.weight_transfer import WeightTransferEngineFactory

            config = SimpleNamespace(parallel_config=SimpleNamespace(rank=rank), model_config=None)
            self.weight_transfer_engine = WeightTransferEngineFactory.create_engine(
                args.weight_transfer_config, config, self.device, self.model_runner.model
            )

    def reload_weights(
        self, weights_iterator: Any = None, weights_path: str | None = None, is_checkpoint_format: bool = True
    ) -> None:
        """vLLM's documented in-place reload (the model runner's): from (HF name, tensor) pairs, or a folder's
        safetensors files."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if weights_iterator is None:
            files = sorted(Path(weights_path).glob("*.safetensors"))
            weights_iterator = ((k, t) for f in files for k, t in load_file(f).items())
        model = self.model_runner.model
        initialize_layerwise_reload(model)
        model.load_weights(weights_iterator)
        finalize_layerwise_reload(model, None)

    def _engine(self) -> Any:
        if self.weight_transfer_engine is None:
            raise RuntimeError("Weight transfer not configured. Please set weight_transfer_config")
        return self.weight_transfer_engine

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        engine = self._engine()
        engine.init_transfer_engine(engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self.updating:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self._engine().start_weight_update()
        self.updating = True

    def update_weights(self, update_info: dict) -> None:
        if not self.updating:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self._engine().update_weights(update_info)
        except BaseException:
            self.updating = False
            raise

    def finish_weight_update(self) -> None:
        if not self.updating:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self._engine().finish_weight_update()
        self.updating = False

    def shutdown_weight_transfer_engine(self) -> None:
        if self.weight_transfer_engine is not None:
            self.weight_transfer_engine.shutdown()

    def compute_weight_checksums(self) -> dict[str, str]:
        """vLLM's: a SHA-256 of each weight's bytes, named with the worker's parallel ranks."""
        return {
            f"dp0:pp0:pcp0:tp{self.rank}:{name}": hashlib.sha256(
                w.detach().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()
            for name, w in self.model_runner.model.hf.named_parameters()
        }


def load_general_plugins() -> None:
    """vLLM's plugin loading: every `vllm.general_plugins` entry point's function, once per process."""
    global PLUGINS_LOADED
    if not PLUGINS_LOADED:
        PLUGINS_LOADED = True
        for entry in importlib.metadata.entry_points(group="vllm.general_plugins"):
            if entry.name == "nanorft":  # vLLM's own plugins are not in the fake
                entry.load()()


class EngineCoreClient:
    """vLLM's engine client (`LLM.llm_engine.engine_core`), its shutdown only: the engine core and workers stop,
    SIGKILLed after `timeout` s (vLLM's default: 5 s)."""

    def __init__(self) -> None:
        self.shutdowns: list[float | None] = []  # the timeout of each shutdown call

    def shutdown(self, timeout: float | None = None) -> None:
        self.shutdowns.append(timeout)


class LLMEngine:
    """vLLM's LLMEngine (`LLM.llm_engine`), its engine client only."""

    def __init__(self) -> None:
        self.engine_core = EngineCoreClient()


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.args = EngineArgs(model=model, **kwargs)
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.multiproc_method = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # how its workers would start
        load_general_plugins()
        self.workers = [Worker(self.args, r) for r in range(self.args.tensor_parallel_size)]
        self.weight_version = "default"  # the engine core's, set by finish_weight_update / update_weight_version
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
        # vLLM's generation_config "auto": a sample also stops on the model's generation config's eos_token_id(s)
        gen_eos = self.workers[0].model_runner.model.hf.generation_config.eos_token_id
        gen_eos = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)
        self.stop_ids = {self.tokenizer.eos_token_id, *gen_eos} - {None}
        self.requests: list[list[int]] = []  # prompt ids of every request run
        self.prefix_cache_resets, self.running = 0, 0
        self.lock = threading.Lock()
        self.rng = torch.Generator().manual_seed(self.args.seed)  # requests without a seed go on drawing from it
        self.llm_engine = LLMEngine()  # its engine client's shutdown stops the engine (LLM has no shutdown())
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

    def generate(
        self, prompts: list[dict], sampling_params: Any = None, use_tqdm: bool = True, lora_request: Any = None
    ) -> list[RequestOutput]:
        no_lora(lora_request)
        self.check_awake()
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        return [self._run(str(i), p["prompt_token_ids"], sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def _run(self, request_id: str, prompt: list[int], sp: SamplingParams) -> RequestOutput:
        with self.lock:
            self.requests.append(list(prompt))
            self.running += 1
        try:
            model = self.workers[0].model_runner.model.hf
            gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self.rng
            outs = self._samples(model, prompt, sp, gen)
            scored = None if sp.prompt_logprobs is None else prompt_logprobs(model, prompt, sp.prompt_logprobs)
        finally:
            with self.lock:
                self.running -= 1
        return RequestOutput(request_id, list(prompt), outs, finished=True, prompt_logprobs=scored)

    def _samples(
        self, model: torch.nn.Module, prompt: list[int], sp: SamplingParams, gen: torch.Generator
    ) -> list[CompletionOutput]:
        """The n samples of a request, a token a step for all of them at once: one forward pass of the prompt, then
        one of the n new tokens a step on the KV cache (a sample that ended is carried on, its tokens ignored)."""
        ids, lps = [list(prompt) for _ in range(sp.n)], [[] for _ in range(sp.n)]
        reasons, texts, running = ["length"] * sp.n, [None] * sp.n, list(range(sp.n))
        with torch.no_grad():
            out = model(torch.tensor([prompt] * sp.n), use_cache=True)
        for step in range(sp.max_tokens):
            logits = out.logits[:, -1].float()  # [n,V]
            for i in list(running):
                logp = processed(logits[i], sp, ids[i], self.stop_ids if step < sp.min_tokens else ())
                tok = (
                    int(logp.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                )
                ids[i].append(tok)
                lps[i].append({tok: Logprob(float(logp[tok]))})
                if tok in self.stop_ids:
                    reasons[i] = "stop"
                    running.remove(i)
                elif sp.stop and (text := self._stopped(ids[i][len(prompt) :], sp.stop)) is not None:
                    reasons[i], texts[i] = "stop", text
                    running.remove(i)
            if not running or step == sp.max_tokens - 1:
                break
            with torch.no_grad():
                new = torch.tensor([[seq[-1]] for seq in ids])  # [n,1]
                out = model(new, past_key_values=out.past_key_values, use_cache=True)
        outs = []
        for i in range(sp.n):
            out = ids[i][len(prompt) :]
            text = self.tokenizer.decode(out, skip_special_tokens=True) if texts[i] is None else texts[i]
            outs.append(CompletionOutput(i, text, out, lps[i], reasons[i]))
        return outs

    def _stopped(self, out: list[int], stop: list[str]) -> str | None:
        """The text cut before the first stop string in the decoded `out`; None while there is none."""
        decoded = self.tokenizer.decode(out, skip_special_tokens=True)
        cut = [decoded.find(s) for s in stop if s in decoded]
        return decoded[: min(cut)] if cut else None

    # --- the engine's control surface
    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        with ThreadPoolExecutor(len(self.workers)) as pool:  # as vLLM's worker processes: all at once
            futures = [pool.submit(getattr(w, method), *args, **(kwargs or {})) for w in self.workers]
            try:
                return [f.result() for f in futures]
            except Exception as e:  # vLLM re-raises a worker's exception as a bare Exception, whatever its type
                raise Exception(
                    f"Call to collective_rpc method failed: Worker failed with error '{e}', please "
                    "check the stack trace above for the root cause"
                ) from None

    # --- vLLM's RL lifecycle (vllm.entrypoints.rl.offline.RLOfflineMixin): a request is a dict or vLLM's dataclass
    def init_weight_transfer_engine(self, request: Any) -> None:
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": info})

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, request: Any) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.collective_rpc("update_weights", kwargs={"update_info": info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.collective_rpc("finish_weight_update")
        if weight_version is not None:
            self.weight_version = weight_version

    def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    def get_weight_version(self) -> str:
        return self.weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        self.collective_rpc("shutdown_weight_transfer_engine")

    def reset_prefix_cache(self) -> bool:
        """False (nothing reset) while requests run, as vLLM."""
        if self.running:
            return False
        self.prefix_cache_resets += 1
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
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


def prompt_logprobs(model: torch.nn.Module, prompt: list[int], top: int) -> list[dict[int, Logprob] | None]:
    """vLLM's prompt_logprobs: None for the first token, then each token's log-prob given those before it, with the
    `top` most likely tokens too; raw log_softmax of the logits (prompt tokens skip the sampling processors:
    temperature, penalties, top-k / top-p do not apply)."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)  # [L-1,V]
    out: list[dict[int, Logprob] | None] = [None]
    for t, row in zip(prompt[1:], logp):
        best = row.topk(top).indices.tolist() if top > 0 else []
        out.append({k: Logprob(float(row[k])) for k in (t, *best)})
    return out


def processed(logits: torch.Tensor, sp: SamplingParams, seen: list[int], masked: Any = ()) -> torch.Tensor:
    """vLLM's processed log-probs: the repetition penalty on the tokens `seen` (prompt and response so far: positive
    logits divided by it, negative ones multiplied), the `masked` ids (EOS under min_tokens) at -inf, / temperature,
    then top-k and top-p, renormalised."""
    logits = logits.clone()
    if sp.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seen)))
        logits[ids] = torch.where(
            logits[ids] > 0, logits[ids] / sp.repetition_penalty, logits[ids] * sp.repetition_penalty
        )
    logits[list(masked)] = -float("inf")
    logits = logits / (sp.temperature if sp.temperature > 0 else 1.0)
    if sp.top_k and sp.top_k > 0:
        kth = logits.topk(min(sp.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sp.top_p < 1.0:
        probs, order = logits.softmax(-1).sort(descending=True)
        drop = probs.cumsum(-1) - probs > sp.top_p  # keep the smallest head whose mass reaches top_p
        logits[order[drop]] = -float("inf")
    return logits.log_softmax(-1)


class AsyncLLMEngine:
    """The async engine: one request per generate call, streamed; the same workers as LLM."""

    def __init__(self, args: EngineArgs) -> None:
        self.engine = LLM(**dataclasses.asdict(args))
        self.in_flight = self.max_in_flight = 0
        self.shut, self.shut_on_loop = False, False
        self.paused, self.is_paused_now = {}, False  # pause_generation's calls by mode; paused now
        self.loop = asyncio.get_running_loop()  # vLLM's output handler runs on the loop that built the engine

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLMEngine:
        return cls(engine_args)

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str, lora_request: Any = None):
        no_lora(lora_request)
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

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        return await asyncio.to_thread(self.engine.collective_rpc, method, timeout, args, kwargs)

    async def reset_prefix_cache(self) -> bool:
        if self.is_paused_now:  # paused with clear_cache, vLLM preempted the running requests: they hold no KV blocks
            self.engine.prefix_cache_resets += 1
            return True
        return not self.in_flight and self.engine.reset_prefix_cache()

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await asyncio.to_thread(self.engine.init_weight_transfer_engine, request)

    async def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    async def update_weights(self, request: Any) -> None:
        await asyncio.to_thread(self.engine.update_weights, request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        self.engine.update_weight_version(new_version)

    async def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return self.engine.collective_rpc("compute_weight_checksums")

    async def shutdown_weight_transfer_engine(self) -> None:
        await asyncio.to_thread(self.engine.shutdown_weight_transfer_engine)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    # vLLM's pause / resume (vllm/v1/engine/async_llm.py); `paused` counts the pauses of each mode. NOTE: the fake
    # runs a request whole, so it reports no WeightVersionSpans (weight_versions None)
    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused[mode] = self.paused.get(mode, 0) + 1
        self.is_paused_now = True

    async def resume_generation(self) -> None:
        self.is_paused_now = False

    async def is_paused(self) -> bool:
        return self.is_paused_now

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut, self.shut_timeout = True, timeout
        try:
            self.shut_on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # called from another thread
            self.shut_on_loop = False


def stream(final: RequestOutput, delta: bool, tokenizer: Any) -> list[RequestOutput]:
    """A finished request as vLLM's async engine streams it with n samples: one output per engine step, holding the
    samples that produced a token in that step (sample 0 starts a step before the others, as it did in some runs of
    vLLM 0.32, so the first output holds it alone; a sample that ended is in no later output), each with its tokens so
    far (or with `delta` the new one only); finish_reason on a sample's last; `finished` on the very last output."""
    outs, start = [], {o.index: 0 if o.index == 0 else 1 for o in final.outputs}
    for step in range(max(start[o.index] + len(o.token_ids) for o in final.outputs)):
        children = []
        for o in final.outputs:
            t = step - start[o.index]  # this sample's token index at this step
            if not 0 <= t < len(o.token_ids):
                continue
            lo = t if delta else 0
            ids, lps = o.token_ids[lo : t + 1], o.logprobs[lo : t + 1]
            children.append(
                CompletionOutput(
                    o.index,
                    tokenizer.decode(ids, skip_special_tokens=True),
                    ids,
                    lps,
                    o.finish_reason if t == len(o.token_ids) - 1 else None,
                )
            )
        outs.append(RequestOutput(final.request_id, final.prompt_token_ids, children, finished=False))
    outs[-1].finished = True
    return outs
