"""vLLM's CPU build against the HF engine on the same requests, its start-up time, and how long new weights take to
get into it (from a published folder, and over the trainer's weight group).

    .venv/bin/python scripts/bench_vllm.py [--models 1m,25m,85m] [--prompts 16] [--n 8] [--tokens 64] [--repeats 3]
                                           [--no-compiled] [--json FILE]

Needs vLLM (`bash run.sh vllm`). Models: random-init Qwen2 shapes with tiny.py's byte-level tokenizer, tied
embeddings: 1m (the embedded default: hidden 128, 4 layers), 25m (hidden 512, 8 layers, MLP 1408), 85m (hidden 768,
12 layers, MLP 2048). Both engines in float32 (the trainer's dtype on the CPU), top-k off, top-p 1, temperature 1.
  generate  --prompts chat-templated arithmetic questions x --n samples x exactly --tokens new tokens (EOS
            suppressed until then, so both do the same work), every request in one call; the two engines
            alternate, --repeats runs each after a warm-up run; tokens/s, medians; ratio = vLLM / HF.
  start     seconds from `make_engine` to a ready vLLM engine (one engine, enforce_eager: no torch.compile; the
            first --models shape also without it, vLLM's default).
  reload    new weights (the model perturbed) into the running engine, medians of --repeats: from a published HF
            folder (EnginePool.load_weights: the worker reads it, vLLM's in-place reload), and over the weight
            group (a trainer thread serving wire.send_model over gloo, one group for all the transfers, a warm-up
            transfer first; EnginePool.receive: the worker takes the buckets into the same reload, the time from
            the header to loaded, the trainer's sending included); the HF engine's folder load for comparison.
One JSON line per measurement, then a table. On the CPU vLLM is there to prove the GPU path, not for speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import transformers  # noqa: E402

import sync  # noqa: E402
import weight_transfer  # noqa: E402
import wire  # noqa: E402
from configs.schema import InferenceModelConfig  # noqa: E402
from engines import HFEngine, SamplingParams, make_engine  # noqa: E402
from models import load_model, load_tokenizer  # noqa: E402
from tiny import build  # noqa: E402

SHAPES = {"1m": None, "25m": (512, 8, 8, 1408), "85m": (768, 12, 12, 2048)}  # hidden, layers, heads, MLP


def make_model(kind: str, tiny: str, out: Path) -> str:
    """The model folder of shape `kind` (random weights, fixed seed), with tiny's tokenizer and chat template."""
    if SHAPES[kind] is None:
        return tiny
    hidden, layers, heads, mlp = SHAPES[kind]
    config = transformers.Qwen2Config.from_pretrained(tiny)
    config.update(
        dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=mlp,
            layer_types=["full_attention"] * layers,
        )
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    sync.save_hf(model, load_tokenizer(tiny), out / kind)
    for name in ("chat_template.jinja", "generation_config.json"):
        (out / kind / name).write_bytes((Path(tiny) / name).read_bytes())
    return str(out / kind)


def prompts(path: str, count: int) -> list[list[int]]:
    tok = load_tokenizer(path)
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {i % 9} + {i % 7} - 2?"}],
                tokenize=False,
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
        for i in range(count)
    ]


def tokens_per_second(engine, ids: list[list[int]], n: int, tokens: int, seed: int) -> float:
    params = SamplingParams(n=n, temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, min_tokens=tokens, seed=seed)
    start = time.perf_counter()
    outs = engine.generate(ids, [params] * len(ids))
    return sum(len(c.token_ids) for cs in outs for c in cs) / (time.perf_counter() - start)


def rollout_model(eager: bool = True) -> InferenceModelConfig:
    return InferenceModelConfig(
        engine_type="vllm",
        dtype="float32",
        gpu_memory_utilization=0.15,
        enforce_eager=eager,
        enable_chunked_prefill=torch.cuda.is_available(),
    )  # as configs.derive leaves it


def perturbed(path: str, seed: int) -> torch.nn.Module:
    model = load_model(path)
    with torch.no_grad():
        for i, w in enumerate(model.parameters()):
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed * 1000 + i)) * 0.01)
    return model


def over_the_group(pool, models: list[torch.nn.Module], job: Path) -> list[float]:
    """Seconds of each transfer of `models` (in turn) into the pool's workers over one weight group, from the header
    read to loaded; the first (which also creates the group) is a warm-up and not returned."""
    link = wire.open_sender(job, "cpu", timeout=120)
    receiver = wire.open_receiver(job, timeout=60, receivers=pool.join_ranks())
    sources = iter(models)
    source = weight_transfer.SpecSource(lambda: wire.model_stream(next(sources)))  # each round the next model
    trainer = weight_transfer.trainer_engine(pool.backend, link, 0, source, SimpleNamespace(sync_timeout=120))

    def send() -> None:  # as train.send: the trainer's side of the engines' weight-transfer engine
        for version in range(100, 100 + len(models)):
            trainer.client.version = version
            with torch.no_grad():
                trainer.send_weights()

    sender = threading.Thread(target=send)
    pool.join_group(wire.receive_init(receiver))
    sender.start()
    seconds = []
    for _ in models:
        start = time.perf_counter()
        pool.receive(wire.receive_header(receiver))
        seconds.append(time.perf_counter() - start)
        wire.ack(receiver)
    sender.join()
    wire.close_receiver(receiver)
    wire.close_sender(link, finished=True, grace=1)
    return seconds[1:]


def reloads(pool, hf: HFEngine, path: str, work: Path, repeats: int) -> dict[str, float]:
    """Median seconds of new weights into vLLM from a folder and over the group, and into the HF engine from a
    folder."""
    tok, folder, hf_folder, models = load_tokenizer(path), [], [], [perturbed(path, r + 1) for r in range(repeats)]
    for r, model in enumerate(models):
        published = sync.save_hf(model, tok, work / f"reload{r}")
        start = time.perf_counter()
        pool.load_weights(str(published), version=r + 1)
        folder.append(time.perf_counter() - start)
        start = time.perf_counter()
        hf.load_weights(str(published), version=r + 1)
        hf_folder.append(time.perf_counter() - start)
    group = over_the_group(pool, [models[0], *models], work / "group")
    return {
        "vllm_folder_s": statistics.median(folder),
        "vllm_group_s": statistics.median(group),
        "hf_folder_s": statistics.median(hf_folder),
    }


def bench(kind: str, path: str, args: argparse.Namespace, work: Path) -> dict:
    ids = prompts(path, args.prompts)
    start = time.perf_counter()
    pool = make_engine(rollout_model(), path, 512)
    started = time.perf_counter() - start
    hf = HFEngine(path, max_model_len=512)
    try:
        for engine in (pool, hf):  # warm-up
            tokens_per_second(engine, ids[:2], 2, 8, seed=0)
        runs = {"vllm": [], "hf": []}
        for r in range(args.repeats):
            runs["vllm"].append(tokens_per_second(pool, ids, args.n, args.tokens, seed=r))
            runs["hf"].append(tokens_per_second(hf, ids, args.n, args.tokens, seed=r))
        times = reloads(pool, hf, path, work / kind, args.repeats)
    finally:
        pool.close()
        hf.close()
    params = sum(p.numel() for p in load_model(path).parameters())
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "model": kind,
        "params": params,
        "vllm_tok_s": med["vllm"],
        "hf_tok_s": med["hf"],
        "ratio": med["vllm"] / med["hf"],
        "vllm_runs": runs["vllm"],
        "hf_runs": runs["hf"],
        "start_s": started,
        **times,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1m,25m,85m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compiled", action="store_true", help="skip the start-up time with torch.compile (~45 s)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    import vllm

    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "cpu": platform.processor() or platform.machine(),
                "cores": len(os.sched_getaffinity(0)),
            }
        ),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build(str(work / "tiny"), n_train=10, n_test=2, tokenizer="byte")  # the figures of earlier runs
        tiny, rows = str(work / "tiny" / "tiny-qwen2"), []
        for i, kind in enumerate(args.models.split(",")):
            rows.append(bench(kind, make_model(kind, tiny, work), args, work))
            print(json.dumps(rows[-1]), flush=True)
            if i == 0 and not args.no_compiled:  # vLLM's default: torch.compile at start
                start = time.perf_counter()
                make_engine(rollout_model(eager=False), make_model(kind, tiny, work), 512).close()
                print(json.dumps({"model": kind, "start_compiled_s": time.perf_counter() - start}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(
        f"\n{'model':>6} {'params':>8} {'vLLM tok/s':>11} {'HF tok/s':>9} {'vLLM/HF':>8} {'start s':>8} "
        f"{'folder s':>9} {'group s':>8} {'HF folder s':>11}"
    )
    for r in rows:
        print(
            f"{r['model']:>6} {r['params'] / 1e6:>7.1f}M {r['vllm_tok_s']:>11.0f} {r['hf_tok_s']:>9.0f} "
            f"{r['ratio']:>7.2f}x {r['start_s']:>8.1f} {r['vllm_folder_s']:>9.3f} {r['vllm_group_s']:>8.3f} "
            f"{r['hf_folder_s']:>11.3f}"
        )


if __name__ == "__main__":
    main()
