"""Weight-sync time, checkpoint vs process group, for the tiny model and a Qwen2.5-1.5B-shaped model.

    .venv/bin/python scripts/bench_sync.py [--models tiny,1.5b] [--repeats 3] [--workdir /tmp/bench_sync]

Models (random weights, fixed seed): tiny = tiny.py's default build (float32); 1.5b = Qwen2Config of
Qwen2.5-1.5B (hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 KV heads, vocab 151936, tied
embeddings) in bfloat16, made on the meta device then `to_empty` + normal(0, 0.02).
  checkpoint  sync.publish_hf (save_pretrained + renames) then the engine-side load that
              HFEngine.load_weights(folder) does: models.load_model(folder) + load_state_dict
  group       two processes: wire.send_weights over gloo (127.0.0.1) -> wire.receive_weights ->
              load_state_dict into the receiver's model; one warm-up transfer (it also creates the
              group) is not counted. Time = the receiver's, from asking for the weights to loaded.
Median of --repeats; GB/s = weight bytes / seconds. CPU only (gloo); NCCL is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import transformers  # noqa: E402

import sync  # noqa: E402
import wire  # noqa: E402
from models import load_model  # noqa: E402


def build(kind: str, workdir: Path) -> tuple[torch.nn.Module, torch.dtype]:
    """The model, freshly made (same seed -> same weights)."""
    if kind == "tiny":
        from tiny import build as build_tiny

        build_tiny(str(workdir / "tiny"))
        return load_model(str(workdir / "tiny/tiny-qwen2")), torch.float32
    config = transformers.Qwen2Config(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model.tie_weights()  # NOTE: to_empty gives lm_head its own storage; re-tie it to the embeddings
    return model.eval(), torch.bfloat16


def nbytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once


def bench_checkpoint(kind: str, workdir: Path, repeats: int) -> dict[str, float]:
    model, dtype = build(kind, workdir)
    target, _ = build(kind, workdir)
    job = workdir / f"ck_{kind}"
    save, load = [], []
    for r in range(1, repeats + 1):
        t0 = time.perf_counter()
        path = sync.publish_hf(model, None, job, step=r)
        t1 = time.perf_counter()
        state = load_model(str(path), dtype=str(dtype).removeprefix("torch.")).state_dict()
        if target.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # as HFEngine.load_weights: the head follows the embeddings
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        target.load_state_dict(state, strict=True)
        del state
        load.append(time.perf_counter() - t1)
        save.append(t1 - t0)
    return {
        "bytes": nbytes(model),
        "save_s": statistics.median(save),
        "load_s": statistics.median(load),
        "total_s": statistics.median([a + b for a, b in zip(save, load)]),
    }


def bench_group(kind: str, workdir: Path, repeats: int) -> dict[str, float]:
    me = [sys.executable, __file__, "--workdir", str(workdir), "--repeats", str(repeats), "--models", kind]
    sender = subprocess.Popen([*me, "--role", "sender"])
    receiver = subprocess.run([*me, "--role", "receiver"], capture_output=True, text=True)
    sender.wait()
    if receiver.returncode or sender.returncode:
        raise SystemExit(f"group bench failed:\n{receiver.stderr[-3000:]}")
    return json.loads(receiver.stdout.strip().splitlines()[-1])


def role_sender(kind: str, workdir: Path, repeats: int) -> None:
    model, _ = build(kind, workdir)
    link = wire.open_sender(workdir / f"pg_{kind}", "cpu", timeout=600)
    params = dict(model.named_parameters())
    specs = [(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    for version in range(repeats + 1):  # version 0: the warm-up
        wire.send_weights(link, version, specs, (p.detach() for p in params.values()))
    wire.close_sender(link, finished=True, grace=60)


def role_receiver(kind: str, workdir: Path, repeats: int) -> None:
    target, _ = build(kind, workdir)
    link = wire.open_receiver(workdir / f"pg_{kind}", timeout=600)
    recv, load, total = [], [], []
    for version in range(repeats + 1):
        t0 = time.perf_counter()
        got_version, state = wire.receive_weights(link)
        t1 = time.perf_counter()
        if target.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        target.load_state_dict(state, strict=True)
        del state
        t2 = time.perf_counter()
        if version:  # not the warm-up
            recv.append(t1 - t0), load.append(t2 - t1), total.append(t2 - t0)
    assert wire.receive_weights(link) is None
    wire.close_receiver(link)
    print(
        json.dumps(
            {
                "bytes": nbytes(target),
                "receive_s": statistics.median(recv),
                "load_s": statistics.median(load),
                "total_s": statistics.median(total),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,1.5b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/bench_sync")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)  # internal: the group peers
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 if args.role else 1)))
    if args.role:
        {"sender": role_sender, "receiver": role_receiver}[args.role](args.models, workdir, args.repeats)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, repeats {args.repeats} (median)", flush=True)
    for kind in args.models.split(","):
        ck = bench_checkpoint(kind, workdir, args.repeats)
        pg = bench_group(kind, workdir, args.repeats)
        gb = ck["bytes"] / 1e9
        print(
            f"{kind:5s} {gb:6.3f} GB  checkpoint {ck['total_s']:7.3f} s ({gb / ck['total_s']:5.2f} GB/s; "
            f"save {ck['save_s']:.3f} + load {ck['load_s']:.3f})  group {pg['total_s']:7.3f} s "
            f"({gb / pg['total_s']:5.2f} GB/s; receive {pg['receive_s']:.3f} + load {pg['load_s']:.3f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
