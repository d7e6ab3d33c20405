"""sampling.py: one rollout request, what it asks for and gets back, and how requests share an engine's batches; the
part that every engine (engines.HFEngine, vllm_engine's) shares.

    params = SamplingParams(n=8, temperature=1.0, max_tokens=256, seed=7)   # vLLM's fields and meanings
    check_request(prompt_ids, params, max_model_len)   # ValueError naming the field, before a shared batch
    check_scoring(sequences, temperature, max_len)     # the same for a scoring request (an engine's score())
    batcher = Batcher(run_batch, max_model_len)        # run_batch(prompts, params) -> [[Completion]] per request
    future = batcher.submit(prompt_ids, params)        # from any thread; gathered with others into one batch
    future.result()[0].token_ids, .logprobs, .finish_reason

NOTE: every value of a request is checked at submit (check_request): a value that failed inside a decode would fail
every request of the shared batch (and Batcher.finish then re-runs a failed batch one request at a time).
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from configs.checks import MIN_TEMPERATURE  # below it (but 0, greedy) logits / T overflow: NaN log-probs

log = logging.getLogger("nanorft.sampling")


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
    model_version: int = 0  # weights version that produced it (the oldest, when `spans` holds several)
    # (first token index, version) where the version that sampled the tokens changes, in order; empty: every token
    # is model_version's. Several: the weights changed while the request ran (explorer.partial_rollout)
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


CLOSE = object()  # the queue's close marker


class Batcher:
    """An engine's one worker thread: it runs the requests that `submit` queues from any thread, gathered into
    shared batches, and every `call` (the model's load, weight updates), in queue order.
    NOTE: one thread does all the model's compute. When two threads of a process run torch ops on the CPU,
    each gets its own OpenMP thread team; with more OpenMP threads than cores, libgomp stops letting idle
    workers spin between parallel regions and parks them instead: a decode (thousands of short regions) ran
    1.6-1.9x slower (docs/LOG.md)."""

    def __init__(self, run_batch: Callable, max_model_len: int, wait_s: float = 0.01, max_wait_s: float = 0.1) -> None:
        # a batch takes requests until none came for wait_s, or max_wait_s after its first
        self.run_batch, self.wait_s, self.max_wait_s = run_batch, wait_s, max_wait_s
        self.max_model_len = max_model_len
        # ("request", prompt_ids, params, future) | ("call", fn, future) | CLOSE
        self.queue: queue.Queue = queue.Queue()
        self.closed, self.mutex = False, threading.Lock()
        self.worker = threading.Thread(target=self.run, name="engine-batcher", daemon=True)
        self.worker.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one request; the future resolves to its n completions. Bad requests raise here, so
        that one caller's bad request never fails a batch shared with others."""
        check_request(prompt_ids, params, self.max_model_len)
        return self.put("request", prompt_ids, params)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the worker, between batches; its result (or its exception, raised here)."""
        return self.put("call", fn).result()

    def put(self, kind: str, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.mutex:  # NOTE: nothing may be queued behind the close marker, or it would hang
            if self.closed:
                raise RuntimeError("engine is closed")
            self.queue.put((kind, *args, future))
        return future

    def run(self) -> None:
        pending = None  # an item taken while gathering a batch that must wait for the next turn
        while (item := pending or self.queue.get()) is not CLOSE:
            pending = None
            if item[0] == "call":
                self.finish([item], lambda its: [its[0][1]()])
                continue
            batch, last = [item], time.monotonic() + self.max_wait_s
            # NOTE: the workflows of a step submit within a few ms of each other (each renders and encodes its
            # prompt first): a fixed window after the first request split a step into two batches.
            while pending is None:
                try:
                    nxt = self.queue.get(timeout=max(0.0, min(self.wait_s, last - time.monotonic())))
                except queue.Empty:
                    break
                if nxt is CLOSE or nxt[0] == "call":
                    pending = nxt  # requests queued before close() still run
                else:
                    batch.append(nxt)
            self.finish(batch, lambda its: self.run_batch([it[1] for it in its], [it[2] for it in its]))

    @staticmethod
    def finish(items: list[tuple], work: Callable[[list[tuple]], list]) -> None:
        """Run work(items) and hand each item's future its result. When a batch of several fails, each of its items
        runs again alone, so that a request that breaks a shared batch fails alone (check_request should have
        refused it; an engine fault fails each of them the same way); the worker lives on."""
        items = [it for it in items if it[-1].set_running_or_notify_cancel()]
        for group in [items] if len(items) < 2 else [items, *[[it] for it in items]]:
            if all(it[-1].done() for it in group):
                continue
            try:
                for it, out in zip(group, work(group)):
                    it[-1].set_result(out)
            except BaseException as e:
                if len(group) == 1:
                    group[0][-1].set_exception(e)
                else:
                    log.warning(
                        "a shared batch of %d requests failed (%s: %s): running each alone",
                        len(group),
                        type(e).__name__,
                        e,
                    )

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        with self.mutex:
            if self.closed:
                return
            self.closed = True
            self.queue.put(CLOSE)
        self.worker.join()


INT_LIMIT = 2**31  # n, max_tokens, min_tokens, top_k below it; seeds in [-2**63, 2**63)


def is_integer(value: Any) -> bool:
    """An int, or an integer type of numpy / torch (operator.index takes them), not a bool or a float."""
    try:
        return not isinstance(value, bool) and operator.index(value) == value
    except TypeError:
        return False


def check_request(prompt: list[int], p: SamplingParams, max_model_len: int) -> None:
    """Raise ValueError, naming the field, for a request no engine can serve. NOTE: every value is checked here, at
    submit, because a value that fails inside a decode (an int tensor overflowing, a NaN temperature) would fail
    every request of the shared batch (Batcher.finish then retries them one by one)."""
    if not prompt:
        raise ValueError("empty prompt")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt of {len(prompt)} tokens leaves no room for a response within "
            f"max_model_len={max_model_len}; shorten it or raise max_model_len"
        )
    for name, low in (("n", 1), ("max_tokens", 1), ("min_tokens", 0), ("top_k", -1)):
        value = getattr(p, name)
        if not is_integer(value) or not low <= value < INT_LIMIT:
            raise ValueError(f"{name} = {value!r}: an integer in [{low}, {INT_LIMIT})")
    if not (p.temperature == 0 or MIN_TEMPERATURE <= p.temperature < float("inf")):
        raise ValueError(f"temperature = {p.temperature!r}: 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
    if not 0 < p.top_p <= 1:  # NaN fails too
        raise ValueError(f"top_p = {p.top_p!r}: in (0, 1]")
    if p.seed is not None and (not is_integer(p.seed) or not -(2**63) <= p.seed < 2**63):
        raise ValueError(f"seed = {p.seed!r}: an integer in [-2**63, 2**63)")
    if any(not s for s in p.stop):
        raise ValueError("empty stop string")
    if p.logprobs != 0:
        raise ValueError("only logprobs=0 (the sampled token's log-prob) is supported")


def check_scoring(sequences: list[list[int]], temperature: float, limit: int, why: str = "its max_model_len") -> None:
    """ValueError, naming what is wrong, for a scoring request (an engine's score()) it cannot serve: a temperature
    that is not a finite number > 0, a sequence with no token to score, or one longer than `limit` tokens (`why`)."""
    if not 0 < temperature < float("inf"):
        raise ValueError(f"scoring temperature = {temperature!r}: a finite number > 0")
    for seq in sequences:
        if len(seq) < 2:
            raise ValueError(f"a sequence of {len(seq)} token(s) has no token to score (2 at least)")
        if len(seq) > limit:
            raise ValueError(f"a sequence of {len(seq)} tokens is longer than this engine scores: {limit} ({why})")


def collect(batcher: Batcher, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[Completion]]:
    """Submit every request at once (they share a batch), then wait for all of them."""
    assert len(prompt_ids) == len(params), (len(prompt_ids), len(params))
    for prompt, p in zip(prompt_ids, params):
        check_request(prompt, p, batcher.max_model_len)
    return [f.result() for f in [batcher.submit(x, p) for x, p in zip(prompt_ids, params)]]


class PromptTooLong(ValueError):
    """A prompt over model.max_prompt_tokens with model.enable_prompt_truncation off (the runner does not retry it)."""


def scored_temperature(params: SamplingParams) -> float:
    """The temperature the trainer scores a response at: its sampling temperature, 1.0 for greedy requests (whose
    log-probs the engines take at 1.0)."""
    return params.temperature if params.temperature > 0 else 1.0
