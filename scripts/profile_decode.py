"""Where a decode step's time goes: the HF engine's decode loop against transformers' `model.generate`, side by side.

    .venv/bin/python scripts/profile_decode.py --threads 1      # assets/tiny-qwen2, 3 rounds of each, alternating
    .venv/bin/python scripts/profile_decode.py --threads 1 --rounds 5 --ops \
        --model checkpoints/bench_vs_trl/sft/bench/sft600/global_step_600/actor/huggingface \
        --taskset checkpoints/bench_vs_trl/assets/arith/test.jsonl    # the bench's SFT policy and test set; + op tables
scripts/bench_engine.py measures the engine's throughput (tokens/s) against `model.generate` on fixed-length and
natural workloads; this script says where one decode step's time goes.

The workload is scripts/bench_vs_trl.py's rollout: 16 prompts of the arithmetic test set (the chat template's
rendering) x 8 samples, at most 48 new tokens, temperature 1, top-p 1, top-k off. Use a model that has had some SFT
(e.g. bench_vs_trl's `sft/bench/sft60/...` or run.sh's sft_warmup) for realistic response lengths; the untrained tiny
model runs every row to max_tokens.

Per run: wall time, CPU time, decode steps (forward passes after the prefill), the prefill's CPU time, and per decode
step the CPU time inside the model's forward (matmuls, attention, KV-cache update, transformers' mask and rotary set-up:
everything in `model.forward`) and the rest (sampling, filtering, stop checks, bookkeeping, cache compaction, syncs).
Both run on the engine's worker thread (Batcher.call), so both use one OpenMP thread team (see sampling.Batcher's NOTE).
NOTE: CPU time is the worker thread's (time.thread_time): with --threads 1 it is all the work done, and it stays
meaningful on a shared machine, where wall time does not (with 2 threads at load ~16 on 2 cores, a batch took 12 s of
wall against 0.6 s with one: libgomp's barriers wait for a descheduled thread). With more threads it misses the other
OpenMP threads' share. The split times `model.forward` through a wrapper set on the instance, for this script only.
Findings: docs/LOG.md, 2026-11-29 (issue 51).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines import HFEngine  # noqa: E402
from sampling import SamplingParams  # noqa: E402


class ForwardClock:
    """Wraps a model's forward on the instance: the calls and the seconds spent inside it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forward, self.calls, self.seconds, self.first = model.forward, 0, 0.0, 0.0
        model.forward = self

    def __call__(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.calls, self.seconds = self.calls + 1, self.seconds + time.thread_time() - start
            self.first = self.first or self.seconds  # the prefill's

    def reset(self) -> None:
        self.calls, self.seconds, self.first = 0, 0.0, 0.0


def bench_prompts(tokenizer, taskset: Path, count: int) -> list[str]:
    """The first `count` test questions, rendered by the chat template with the generation prompt."""
    rows = [json.loads(line) for line in taskset.read_text().splitlines()[:count]]
    messages = [[{"role": "user", "content": r["question"]}] for r in rows]
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]


def engine_run(engine: HFEngine, prompts: list[list[int]], args) -> int:
    """One rollout batch through the engine's decode loop (on its worker): the tokens generated."""
    p = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=args.seed)
    out = engine.run_batch(prompts, [p] * len(prompts))
    return sum(len(c.token_ids) for cs in out for c in cs)


def generate_run(engine: HFEngine, prompts: list[list[int]], args) -> int:
    """The same batch through `model.generate(do_sample=True)`: each prompt repeated n times, left-padded."""
    rows = [p for p in prompts for _ in range(args.n)]
    L, pad = max(map(len, rows)), engine.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (L - len(r)) + r for r in rows])  # [B, L]
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])  # [B, L]
    torch.manual_seed(args.seed)
    out = engine.model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        max_new_tokens=args.max_tokens,
        pad_token_id=pad,
        eos_token_id=engine.eos_ids,
    )
    new = out[:, L:]  # [B, N]
    ended = torch.isin(new, torch.tensor(engine.eos_ids))
    # tokens up to and including the first EOS (or all N)
    first = torch.where(ended.any(-1), ended.int().argmax(-1) + 1, torch.tensor(new.shape[1]))
    return int(first.sum())


def timed(engine: HFEngine, clock: ForwardClock, run, prompts, args) -> dict:
    """run() on the engine's worker: wall, forward and the rest, per decode step (the prefill counts as none)."""

    def run_timed():
        clock.reset()
        start, cpu = time.perf_counter(), time.thread_time()
        tokens = run(engine, prompts, args)
        return time.perf_counter() - start, time.thread_time() - cpu, tokens

    wall, cpu, tokens = engine.batcher.call(run_timed)
    steps, prefill = clock.calls - 1, clock.first
    forward = clock.seconds - prefill
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "tokens": tokens, "prefill_s": prefill, "forward_s": forward}


def op_table(engine: HFEngine, run, prompts, args) -> str:
    """torch.profiler's table of one run (on the worker thread: the profiler sees the thread that starts it)."""

    def profiled():
        with torch.profiler.profile() as prof:
            run(engine, prompts, args)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)

    return engine.batcher.call(profiled)


def show(results: dict[str, list[dict]], threads: int) -> None:
    """One row per run (CPU ms per decode step: forward and the rest), then the medians."""
    print(f"{threads} torch thread(s) on the worker; CPU = the worker thread's CPU time")
    print("| run | wall s | CPU s | prefill s | steps | tokens | decode CPU ms/step | forward ms/step | rest ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        for r in rs:
            s, decode = max(r["steps"], 1), r["cpu_s"] - r["prefill_s"]
            cells = [f"{r[k]:.3f}" for k in ("wall_s", "cpu_s", "prefill_s")] + [str(r["steps"]), str(r["tokens"])]
            cells += [f"{1e3 * x / s:.2f}" for x in (decode, r["forward_s"], decode - r["forward_s"])]  # ms per step
            print(f"| {name} | " + " | ".join(cells) + " |")
    for key in ("wall_s", "cpu_s"):
        med = {name: statistics.median(r[key] for r in rs) for name, rs in results.items()}
        print(f"median {key}: " + ", ".join(f"{name} {v:.3f}" for name, v in med.items()))


def main(argv: list[str] | None = None) -> dict[str, list[dict]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="assets/tiny-qwen2", help="model folder (default: %(default)s)")
    ap.add_argument("--taskset", default="assets/arith/test.jsonl", help="questions (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating, after one warm-up each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch threads of the worker (default: torch's)")
    ap.add_argument("--ops", action="store_true", help="also print torch.profiler's op table of one run of each")
    args = ap.parse_args(argv)
    engine = HFEngine(args.model, max_model_len=1024)
    threads = engine.batcher.call(torch.get_num_threads)  # NOTE: process-wide; restored at the end (main() in tests)
    if args.threads:
        engine.batcher.call(lambda: torch.set_num_threads(args.threads))
    texts = bench_prompts(engine.tokenizer, Path(args.taskset), args.prompts)
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    clock = ForwardClock(engine.model)
    runs = {"engine": engine_run, "generate": generate_run}
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for run in runs.values():
        timed(engine, clock, run, prompts, args)  # warm-up
    for _ in range(args.rounds):
        for name, run in runs.items():
            results[name].append(timed(engine, clock, run, prompts, args))
    show(results, engine.batcher.call(torch.get_num_threads))
    if args.ops:
        for name, run in runs.items():
            print(f"\n{name}\n{op_table(engine, run, prompts, args)}")
    engine.batcher.call(lambda: torch.set_num_threads(threads))
    engine.close()
    return results


if __name__ == "__main__":
    main()
