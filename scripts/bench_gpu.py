"""Trainer, rollout-engine and weight-sync throughput of one model shape with random weights.

Each figure goes through the project's own code paths, on this machine's GPU (or its CPU). No download: the model
is built here (fixed seed).

    .venv/bin/python scripts/bench_gpu.py                          # GPU: the Qwen2.5-1.5B shape, defaults below
    .venv/bin/python scripts/bench_gpu.py --shape 0.5b --json bench_0.5b.json
    .venv/bin/python scripts/bench_gpu.py --peak-tflops 989 --tokens-per-micro-batch 32768 --no-gradient-checkpointing
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_gpu.py --shape tiny --groups 4 --group-size 4 --prompt-len 16 \\
        --response-len 24 --tokens-per-micro-batch 256 --steps 2 --decode-tokens 8 --sync-repeats 1   # CPU, ~10 s

Shapes (transformers.Qwen2Config; tied embeddings, rope_theta 1e6, 32768 positions; the byte-level tokenizer of
tiny.make_tokenizer, so every token id used here is a byte, < 256, and ids past the tokenizer decode to ""):
  1.5b  Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab 151936
  0.5b  Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936
  50m   hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 2048, vocab 32000 (~47M: scripts/bench_load.py)
  tiny  hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab 264 (CPU smoke test)
Built in bf16 on CUDA (fp32 on CPU) and saved as an HF folder; the trainer loads it in fp32, as train.py does.

What is measured:
  trainer   scoring.build_model (FSDP2 scoring.TokenScorer in a one-process group; bf16 compute with fp32 master
            weights on CUDA, fp32 on CPU) on one step batch of --groups GRPO groups of --group-size responses
            sharing a prompt, all of --prompt-len / --response-len tokens: batching.step_batch -> pack_units ->
            micro_batches (--tokens-per-micro-batch packed tokens; trainer.max_token_len_per_gpu) -> per
            micro-batch batching.micro_batch, scorer(mb, entropy=True), a token-mean policy-gradient loss with
            random advantages, backward; then grad clip 1.0 and one AdamW step. 1 warm-up step, then --steps
            timed (median). Packed tokens: what the model runs on (each group's prompt once); sequence tokens:
            prompt + response of every sequence. Peak memory: torch.cuda.max_memory_allocated (GPU) or the
            process's peak RSS since start (CPU).
            MFU = FLOPs / step seconds / --peak-tflops (default from the GPU name; n/a when unknown), with
            FLOPs = 6 * P * packed + 6 * H * V * scored + 12 * L * Hq * pairs: P non-embedding parameters, H
            hidden, V vocab, scored = response tokens (the head runs on those only), L layers, Hq = heads x
            head_dim, pairs = (query, key) pairs the attention mask allows (a prompt token sees the prompt up
            to itself, a response token the prompt and its response up to itself). Recomputation (gradient
            checkpointing, the chunked head) and the mask's skipped pairs are not counted, as usual for MFU.
  engine    engines.HFEngine (bf16 on CUDA, fp32 on CPU, max_batch_size = the largest --concurrency): for each
            --concurrency C, C / group-size prompts of --prompt-len tokens x n = group-size samples, each
            decoding exactly --decode-tokens tokens (min_tokens = max_tokens), temperature 1. tokens/s =
            C x N / the generate call's seconds (prefill included); prefill_s = the same call with N = 1;
            decode-only tokens/s = C x (N - 1) / (generate_s - prefill_s).
  sync      group: wire.open_sender here, wire.open_receiver + receive_weights in a second process (this script,
            --role receiver) that holds an HFEngine; NCCL between cuda:0 and cuda:1 when there are two GPUs, else
            gloo over 127.0.0.1 with the tensors on the CPU (on one GPU, as train.py would have to). end_to_end_s:
            from wire.send_model(link, scorer.model, v) to the receiver holding every tensor (one clock: same
            host); engine_load_s: HFEngine.load_weights(state_dict, v) after it. One warm-up transfer (it also
            creates the group), then --sync-repeats (median).
            checkpoint: sync.full_state(scorer.model) (gather_s), sync.cast + sync.publish_hf (save_s),
            HFEngine.load_weights(folder, v) (engine_load_s); bytes = the folder's safetensors files.
            Both in the dtype train.py sends and publishes in (train.engine_dtype: the rollout engine's, bf16 on
            CUDA by default; fp32 on the CPU).
Output: a markdown table of every figure, then one JSON line (--json FILE writes it too).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import batching  # noqa: E402
import configs  # noqa: E402
import models  # noqa: E402
import scoring  # noqa: E402
import sync  # noqa: E402
import train  # noqa: E402
import wire  # noqa: E402
from buffer import Experience  # noqa: E402
from engines import HFEngine, SamplingParams  # noqa: E402
from tiny import SPECIAL_TOKENS, Options, make_tokenizer  # noqa: E402

SHAPES = {  # (hidden, layers, heads, KV heads, intermediate, vocab)
    "1.5b": (1536, 28, 12, 2, 8960, 151936),
    "0.5b": (896, 24, 14, 2, 4864, 151936),
    "50m": (512, 8, 8, 4, 2048, 32000),
    "tiny": (64, 2, 4, 2, 128, 264),
}
# bf16 dense TFLOP/s by GPU name, first match wins (the H100 SXM's 989 is the plain "H100" entry)
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
SYNC_TIMEOUT = 300.0  # s, each wait for the other side of the weight link


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.5b")
    ap.add_argument("--groups", type=int, default=16, help="GRPO groups per train step")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (also the engine's n)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (trainer and engine)")
    ap.add_argument(
        "--response-len",
        type=int,
        default=480,
        help="response tokens; the default makes a group 256 + 8 x 480 = 4096 packed tokens",
    )
    ap.add_argument(
        "--tokens-per-micro-batch",
        type=int,
        default=None,
        help="trainer.max_token_len_per_gpu; unset: what configs.derive makes of it (16384 here)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="trainer.gradient_checkpointing; default on with CUDA (estimate: 1.5b at 16k tokens "
        "needs ~60 GB of activations without it)",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed train steps (after one warm-up step)")
    ap.add_argument("--concurrency", default="128,512", help="engine: concurrent sequences, comma-separated")
    ap.add_argument("--decode-tokens", type=int, default=256, help="engine: tokens each sequence decodes")
    ap.add_argument("--sync-repeats", type=int, default=2, help="timed weight transfers of each method")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak, for MFU; default: from the GPU name")
    ap.add_argument("--json", default=None, help="also write the JSON line to this file")
    ap.add_argument("--workdir", default=None, help="model and job folders (default: a temporary folder, removed)")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)  # internal: "receiver", the sync's second process
    ap.add_argument("--engine-device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--sync-device", default="cpu", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.decode_tokens < 2 or min(a.groups, a.group_size, a.prompt_len, a.response_len, a.steps, a.sync_repeats) < 1:
        ap.error("--decode-tokens must be >= 2; groups, sizes, lengths, steps and repeats >= 1")
    return a


def sync_cuda() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- the model: random weights of the shape, an HF folder


def make_model_folder(shape: str, folder: Path, device: torch.device, dtype: torch.dtype | None = None) -> dict:
    """Qwen2ForCausalLM of `shape` (seed 0) and tiny's tokenizer, saved to `folder` in `dtype` (default: bf16 on
    CUDA, fp32 on the CPU); returns its sizes."""
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    tokenizer = make_tokenizer(Options(tokenizer="byte"), [])  # byte-level: every id used here is a byte
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = transformers.Qwen2Config(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        vocab_size=vocab,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=32768,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(0)
    with torch.device(device):  # NOTE: on the GPU, so the 1.5B random init takes a moment, not a minute
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters())  # tied: the head counted once, as the embedding
    del model
    return {
        "shape": shape,
        "params": params,
        "non_embedding_params": params - embedding,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "head_dim": hidden // heads,
        "vocab": vocab,
    }


def trainer_config(a: argparse.Namespace, work: Path, device: torch.device) -> configs.Config:
    """A GRPO train-mode config for the folder, derived by configs.derive as train.py's is."""
    cfg = configs.Config()
    cfg.mode, cfg.checkpoint_root_dir = "train", str(work / "ck")
    cfg.algorithm.algorithm_type = "grpo"
    cfg.model.model_path = str(work / "model")
    cfg.model.max_prompt_tokens, cfg.model.max_response_tokens = a.prompt_len, a.response_len
    cfg.trainer.max_token_len_per_gpu = a.tokens_per_micro_batch
    gc_on = a.gradient_checkpointing
    cfg.trainer.gradient_checkpointing = device.type == "cuda" if gc_on is None else gc_on
    return configs.derive(cfg)


# --- trainer


def grpo_batch(a: argparse.Namespace, cfg: configs.Config) -> tuple[dict, list[list[list[int]]]]:
    """The step batch of --groups groups (random byte ids, random advantages) and its micro-batches of units."""
    g, exps = torch.Generator().manual_seed(0), []
    for k in range(a.groups):
        prompt = torch.randint(0, 256, (a.prompt_len,), generator=g)
        for r in range(a.group_size):
            response = torch.randint(0, 256, (a.response_len,), generator=g)
            exps.append(
                Experience(
                    tokens=torch.cat([prompt, response]),
                    prompt_length=a.prompt_len,
                    reward=float(r % 2),
                    group_id=f"g{k}",
                    run_id=r,
                )
            )
    batch = batching.step_batch(exps, cfg.model.max_response_tokens)
    B, T = batch["responses"].shape
    batch["advantages"] = torch.randn(B, 1, generator=g).expand(B, T).contiguous()  # [B,T] one per sequence
    budget = cfg.trainer.max_token_len_per_gpu
    units = batching.pack_units(batch, list(range(B)), cfg.trainer.use_remove_padding, budget)
    return batch, batching.micro_batches(batch, units, budget, None)


def step_flops(batch: dict, micro: list[list[list[int]]], facts: dict) -> dict[str, float]:
    """Packed / sequence / scored tokens of one step and its model FLOPs (the module docstring's formula)."""
    packed = pairs = 0
    for units in micro:
        for unit in units:
            p = int(batch["prompt_lengths"][unit[0]])
            rs = [int(batch["response_lengths"][i]) for i in unit]
            packed += batching.unit_length(batch, unit)
            pairs += p * (p + 1) // 2 + sum(r * p + r * (r + 1) // 2 for r in rs)
    seq = int((batch["prompt_lengths"] + batch["response_lengths"]).sum())
    scored = int(batch["response_mask"].sum())
    f = facts
    flops = (
        6 * f["non_embedding_params"] * packed
        + 6 * f["hidden"] * f["vocab"] * scored
        + 12 * f["layers"] * f["heads"] * f["head_dim"] * pairs
    )
    return {"packed": packed, "seq": seq, "scored": scored, "flops": float(flops)}


def train_step(
    scorer: scoring.TokenScorer,
    optim: torch.optim.Optimizer,
    batch: dict,
    micro: list,
    share: bool,
    device: torch.device,
    grad_clip: float,
) -> tuple[float, float]:
    """One optimizer step over every micro-batch; (step seconds, of which packing micro-batches on the CPU)."""
    sync_cuda()
    start, pack_s = time.perf_counter(), 0.0
    total = batch["response_mask"].sum().clamp(min=1)  # token-mean over the whole step, as train.optimize
    optim.zero_grad(set_to_none=True)
    for units in micro:
        t0 = time.perf_counter()
        mb = batching.micro_batch(batch, units, share, device, ("advantages",))
        pack_s += time.perf_counter() - t0
        logp, _ = scorer(mb, entropy=True)  # [n,T] (entropy: a metric in the trainer, no gradient)
        loss = -(mb["advantages"] * logp * mb["response_mask"]).sum() / total.to(device)  # []
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(scorer.parameters(), grad_clip)
    norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
    if not math.isfinite(norm):
        raise RuntimeError(f"gradient norm {norm}")
    optim.step()
    sync_cuda()
    return time.perf_counter() - start, pack_s


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def bench_trainer(
    a: argparse.Namespace, cfg: configs.Config, device: torch.device, facts: dict, peak: float | None
) -> tuple[scoring.TokenScorer, torch.optim.Optimizer, dict]:
    """The trainer's model, optimizer and figures (see the module docstring)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    scorer = scoring.build_model(cfg.model.model_path, cfg.trainer, device, trainable=True)
    optim = train.adamw(scorer, 1e-6, cfg.algorithm.optimizer)
    batch, micro = grpo_batch(a, cfg)
    n = step_flops(batch, micro, facts)
    runs = [
        train_step(scorer, optim, batch, micro, cfg.trainer.use_remove_padding, device, cfg.trainer.grad_clip)
        for _ in range(a.steps + 1)
    ][1:]  # the first: warm-up (allocations, kernels)
    step_s = statistics.median(r[0] for r in runs)
    achieved = n["flops"] / step_s
    out = {
        "trainer/packed_tokens_per_s": n["packed"] / step_s,
        "trainer/seq_tokens_per_s": n["seq"] / step_s,
        "trainer/step_s": step_s,
        "trainer/pack_s": statistics.median(r[1] for r in runs),
        "trainer/peak_memory_bytes": peak_memory(device),
        "trainer/tflops_per_s": achieved / 1e12,
        "trainer/mfu": achieved / (peak * 1e12) if peak else None,
        "trainer/packed_tokens_per_step": n["packed"],
        "trainer/seq_tokens_per_step": n["seq"],
        "trainer/micro_batches_per_step": len(micro),
    }
    return scorer, optim, out


# --- weight sync


def sync_backend(device: torch.device) -> str:
    """NCCL needs the receiver on another GPU than the sender; on one GPU (or none) the link is gloo on the CPU."""
    return "nccl" if device.type == "cuda" and torch.cuda.device_count() >= 2 else "gloo"


def bench_group(
    a: argparse.Namespace, scorer: scoring.TokenScorer, work: Path, device: torch.device, dtype: torch.dtype
) -> dict:
    """The process-group method: this process sends in `dtype` (train.py's: the engine's), a second one (--role
    receiver) receives and loads."""
    nccl = sync_backend(device) == "nccl"
    send_dev, recv_dev = ("cuda:0", "cuda:1") if nccl else ("cpu", "cpu")
    engine_dev = "cuda:1" if nccl else "cuda" if device.type == "cuda" else "cpu"
    link = wire.open_sender(work / "pg", send_dev, SYNC_TIMEOUT)
    peer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "receiver",
            "--workdir",
            str(work),
            "--engine-device",
            engine_dev,
            "--sync-device",
            recv_dev,
        ],
        cwd=ROOT,
    )
    rows = []
    for version in range(a.sync_repeats + 1):  # version 0: the warm-up, which also creates the group
        start, t0 = time.time(), time.perf_counter()
        sent = wire.send_model(link, scorer.model, version, dtype)
        send_s = time.perf_counter() - t0
        key = f"bench/loaded/{version}"
        # NOTE: the next send starts only once the receiver has loaded this one and waits again
        link.store.wait([key], link.timeout)
        got = json.loads(link.store.get(key))
        if version:
            rows.append((got["have"] - start, send_s, got["load_s"]))
    wire.close_sender(link, finished=True, grace=60)
    if peer.wait(timeout=SYNC_TIMEOUT):
        raise RuntimeError(f"the receiver process failed (exit {peer.returncode})")
    return {
        "sync/group/end_to_end_s": statistics.median(r[0] for r in rows),
        "sync/group/send_s": statistics.median(r[1] for r in rows),
        "sync/group/engine_load_s": statistics.median(r[2] for r in rows),
        "sync/group/bytes": sent,
    }


def receiver(a: argparse.Namespace) -> None:
    """--role receiver: the explorer's side. Each version's arrival time (time.time, the sender's clock too) and
    HFEngine.load_weights seconds go back through the link's store."""
    work, cuda = Path(a.workdir), a.engine_device.startswith("cuda")
    if a.sync_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.sync_device))  # NCCL: this process's GPU is the receiving one
    engine = HFEngine(
        str(work / "model"),
        device=a.engine_device,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=64,
        max_batch_size=1,
    )
    link = wire.open_receiver(work / "pg", SYNC_TIMEOUT, device=a.sync_device)
    while (got := wire.receive_weights(link)) is not None:
        sync_cuda()  # NOTE: an NCCL broadcast's wait() only orders streams; the bytes are there after this
        have = time.time()
        version, state = got
        t0 = time.perf_counter()
        engine.load_weights(state, version)
        sync_cuda()
        link.store.set(f"bench/loaded/{version}", json.dumps({"have": have, "load_s": time.perf_counter() - t0}))
        del state, got
    wire.close_receiver(link)
    engine.close()


def bench_checkpoint(
    a: argparse.Namespace, scorer: scoring.TokenScorer, engine: HFEngine, cfg: configs.Config, dtype: torch.dtype
) -> dict:
    """The checkpoint method: gather the full state, publish the HF folder in `dtype` (train.publish's, for a step
    that is not also a checkpoint), load it into the engine."""
    tokenizer, job, rows, size = models.load_tokenizer(cfg.model.model_path), cfg.checkpoint_job_dir, [], 0
    for version in range(1, a.sync_repeats + 1):
        t0 = time.perf_counter()
        state = sync.full_state(scorer.model)
        t1 = time.perf_counter()
        folder = sync.publish_hf(scorer.model, tokenizer, job, version, state_dict=sync.cast(state, dtype))
        t2 = time.perf_counter()
        engine.load_weights(str(sync.weights_path(job, version)), version)
        sync_cuda()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        del state
        shutil.rmtree(folder.parent.parent)  # 1.5b: 3 GB of bf16 per folder
    names = ("gather_s", "save_s", "engine_load_s", "total_s")
    return {f"sync/checkpoint/{k}": statistics.median(r[i] for r in rows) for i, k in enumerate(names)} | {
        "sync/checkpoint/bytes": size
    }


# --- engine


def bench_decode(a: argparse.Namespace, engine: HFEngine) -> dict:
    """Decode throughput at each --concurrency (see the module docstring)."""
    g, N, out = torch.Generator().manual_seed(1), a.decode_tokens, {}
    engine.generate([[1, 2, 3]], [SamplingParams(n=2, max_tokens=4, min_tokens=4)])  # warm-up
    for c in [int(x) for x in a.concurrency.split(",")]:
        n = min(a.group_size, c)
        prompts = [torch.randint(0, 256, (a.prompt_len,), generator=g).tolist() for _ in range(c // n)]
        timed = {}
        for tokens in (1, N):
            params = [
                SamplingParams(n=n, temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=k)
                for k in range(len(prompts))
            ]
            t0, batches = time.perf_counter(), engine.num_batches
            done = engine.generate(prompts, params)
            timed[tokens] = time.perf_counter() - t0
            if sorted({len(x.token_ids) for cs in done for x in cs}) != [tokens] or engine.num_batches != batches + 1:
                raise RuntimeError(f"concurrency {c}: not one batch of sequences of exactly {tokens} tokens each")
        rows = len(prompts) * n
        out |= {
            f"engine/c{c}/tokens_per_s": rows * N / timed[N],
            f"engine/c{c}/generate_s": timed[N],
            f"engine/c{c}/prefill_s": timed[1],
            f"engine/c{c}/decode_only_tokens_per_s": rows * (N - 1) / max(timed[N] - timed[1], 1e-9),
        }
    return out


# --- report


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (x{torch.cuda.device_count()})"
    cpu = platform.processor() or platform.machine()
    return f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def default_peak(device: torch.device) -> float | None:
    """bf16 dense TFLOP/s of a known GPU, from its name; None elsewhere (MFU then n/a)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)


def fmt(v: object) -> str:
    if isinstance(v, float) and abs(v) >= 100 or isinstance(v, int):
        return f"{v:,.0f}"
    return f"{v:.4g}" if isinstance(v, float) else "n/a" if v is None else str(v)


def report(a: argparse.Namespace, record: dict) -> None:
    """The markdown table, then the JSON line (and --json)."""
    print(f"\n{record['device']}; torch {record['torch']}, transformers {record['transformers']}")
    print(f"command: {record['command']}")
    print(f"model: {json.dumps(record['model'])}\nsettings: {json.dumps(record['settings'])}\n")
    print("| figure | value |\n|---|---:|")
    for k, v in record["results"].items():
        print(f"| {k} | {fmt(v)} |")
    line = json.dumps(record)
    print(line, flush=True)
    if a.json:
        Path(a.json).write_text(line + "\n")


# --- main


def main(a: argparse.Namespace) -> None:
    _, world, device = scoring.setup_distributed()
    if world != 1:
        raise SystemExit("run it as one plain process (no torchrun)")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_gpu_"))
    peak = a.peak_tflops or default_peak(device)
    # --- model: random weights of the shape, an HF folder
    facts = make_model_folder(a.shape, work / "model", device)
    cfg = trainer_config(a, work, device)
    # --- trainer
    scorer, optim, results = bench_trainer(a, cfg, device, facts, peak)
    # --- sync: process group (a second process), then checkpoint files into this process's engine; in the dtype
    # train.py sends and publishes in (the engine's: bf16 on CUDA by default, fp32 on the CPU)
    wire = train.engine_dtype(cfg, device)
    results |= bench_group(a, scorer, work, device, wire)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    concurrency = [int(x) for x in a.concurrency.split(",")]
    engine = HFEngine(
        str(work / "model"),
        device=device.type,
        dtype=dtype,
        max_model_len=a.prompt_len + a.decode_tokens,
        max_batch_size=max(concurrency),
    )
    results |= bench_checkpoint(a, scorer, engine, cfg, wire)
    # --- engine: the trainer's memory freed first
    del scorer, optim
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    results |= bench_decode(a, engine)
    engine.close()
    # --- report
    settings = {
        k: getattr(a, k)
        for k in (
            "groups",
            "group_size",
            "prompt_len",
            "response_len",
            "steps",
            "concurrency",
            "decode_tokens",
            "sync_repeats",
        )
    }
    settings |= {
        "tokens_per_micro_batch": cfg.trainer.max_token_len_per_gpu,
        "peak_tflops": peak,
        "gradient_checkpointing": cfg.trainer.gradient_checkpointing,
        "engine_dtype": dtype,
        "trainer_compute": "bf16 (fp32 master weights)" if device.type == "cuda" else "fp32",
        "sync_backend": sync_backend(device),
        "sync_dtype": str(wire).removeprefix("torch."),
        "engine_requests": {c: f"{c // min(a.group_size, c)} prompts x n={min(a.group_size, c)}" for c in concurrency},
    }
    report(
        a,
        {
            "device": device_name(device),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": shlex.join([sys.executable, *sys.argv]),
            "model": facts,
            "settings": settings,
            "results": results,
        },
    )
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()  # a bar per weight load is noise here
    receiver(args) if args.role == "receiver" else main(args)
    # NOTE: leave without the interpreter's teardown, as train.py does: gloo worker threads of process-group
    # objects still referenced there can abort the exit ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
