"""Bytes (and seconds) per weight sync with LoRA: the merged weights (what the HF engine gets, and what every
engine got before vLLM served the adapter) against the adapter alone (what vLLM engines that serve it get:
sync.serves_adapter).

    .venv/bin/python scripts/bench_lora_sync.py [--rank 8] [--repeats 5] [--workdir /tmp/bench_lora_sync]

tiny: tiny.py's default build (fp32, as the CPU engines take it) with a rank --rank all-linear adapter (alpha 2 r, B
      drawn non-zero) on the trainer's FSDP2 scorer (one gloo rank), both ways measured, each the median of
      --repeats: over the process group (lora.send_model vs lora.send_adapter into a receiver thread of this process,
      wire.receive_weights; gloo on 127.0.0.1; seconds from the send to the tensors received) and as published files
      (lora.publish of the full HF folder vs of the adapter folder: seconds, and bytes on disk).
1.5b: the Qwen2.5-1.5B shape (scripts/bench_sync.py's: hidden 1536, intermediate 8960, 28 layers, vocab 151936, tied
      embeddings) on the meta device, the same adapter rank on every linear layer but the LM head, bf16 (a GPU
      engine's dtype): the bytes each way sends, counted from the shapes (no tensor is made, nothing timed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import lora  # noqa: E402
import scoring  # noqa: E402
import sync  # noqa: E402
import wire  # noqa: E402
from configs.schema import LoRAConfig, TrainerConfig  # noqa: E402
from models import load_tokenizer  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def over_group(actor: torch.nn.Module, job: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Bytes and median seconds of one transfer each way over a gloo group to a receiver thread."""
    sender = wire.open_sender(job, "cpu", 120)
    receiver = wire.open_receiver(job, 120)
    out = {}
    for name, send in (("merged", lora.send_model), ("adapter", lora.send_adapter)):
        seconds, sent = [], 0
        for version in range(repeats + 1):  # the first (it also makes the group) not counted
            thread = threading.Thread(target=wire.receive_weights, args=(receiver,))
            t0 = time.perf_counter()
            thread.start()
            sent = send(sender, actor, version)
            thread.join()
            if version:
                seconds.append(time.perf_counter() - t0)
        out[name] = {"bytes": sent, "seconds": statistics.median(seconds)}
    wire.close_sender(sender, grace=0.1)
    return out


def as_files(actor: torch.nn.Module, tokenizer, job: Path, repeats: int) -> dict[str, dict[str, float]]:
    """Bytes on disk and median seconds of publishing each way (the state gathered, written, the pointer moved)."""
    out = {}
    for name in ("merged", "adapter"):
        seconds = []
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            adapter = lora.adapter_state(actor) if name == "adapter" else None
            weights = lora.full_state(actor) if name == "merged" else None
            lora.publish(actor, tokenizer, job / name, step, adapter, weights)
            seconds.append(time.perf_counter() - t0)
        where = sync.adapter_path if name == "adapter" else sync.weights_path
        out[name] = {"bytes": folder_bytes(where(job / name, repeats)), "seconds": statistics.median(seconds)}
    return out


def tiny(rank: int, repeats: int, work: Path) -> dict:
    from tiny import build

    build(str(work / "tiny"))
    path = str(work / "tiny" / "tiny-qwen2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = (LoRAConfig(lora_rank=rank, lora_alpha=2 * rank), "")
    actor = scoring.build_model(path, TrainerConfig(), torch.device("cpu"), True, adapter=spec)
    with torch.no_grad():
        for name, q in actor.named_parameters():
            if ".lora_B." in name:
                q.normal_(0, 0.02)
    result = {
        "group": over_group(actor, work / "group", repeats),
        "files": as_files(actor, load_tokenizer(path), work, repeats),
    }
    dist.destroy_process_group()
    return result


def qwen_1_5b(rank: int) -> dict:
    """Bytes each way for the Qwen2.5-1.5B shape in bf16, counted on the meta device."""
    from bench_gpu import SHAPES  # this folder (scripts/): the shapes every benchmark here uses

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES["1.5b"]
    config = transformers.Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    merged = sum(q.numel() for q in model.parameters()) * 2  # NOTE: parameters() yields the tied head once
    head = model.get_output_embeddings()
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    adapter = sum(rank * (m.in_features + m.out_features) for m in linear) * 2
    return {"merged": {"bytes": merged}, "adapter": {"bytes": adapter}, "adapted_layers": len(linear)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workdir", default="/tmp/bench_lora_sync")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    result = {"rank": args.rank, "tiny": tiny(args.rank, args.repeats, work), "1.5b": qwen_1_5b(args.rank)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
