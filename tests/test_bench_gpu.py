"""scripts/bench_gpu.py on the tiny shape (CPU, or the GPU when there is one), so that the benchmark cannot rot:
it exits 0 and reports a finite positive number for every figure it measures."""

import argparse
import importlib.util
import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import entry
import pytest
import torch

import sync
from engines import HFEngine
from models import load_model

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--shape",
    "tiny",
    "--groups",
    "4",
    "--group-size",
    "4",
    "--prompt-len",
    "16",
    "--response-len",
    "24",
    "--tokens-per-micro-batch",
    "256",
    "--steps",
    "2",
    "--concurrency",
    "128,512",
    "--decode-tokens",
    "8",
    "--sync-repeats",
    "1",
]
MEASURED = (
    "trainer/packed_tokens_per_s",
    "trainer/seq_tokens_per_s",
    "trainer/step_s",
    "trainer/peak_memory_bytes",
    "trainer/tflops_per_s",
    "sync/group/end_to_end_s",
    "sync/group/send_s",
    "sync/group/engine_load_s",
    "sync/group/bytes",
    "sync/checkpoint/gather_s",
    "sync/checkpoint/save_s",
    "sync/checkpoint/engine_load_s",
    "sync/checkpoint/total_s",
    "sync/checkpoint/bytes",
    "engine/c128/tokens_per_s",
    "engine/c128/generate_s",
    "engine/c128/prefill_s",
    "engine/c512/tokens_per_s",
    "engine/c512/decode_only_tokens_per_s",
)


@pytest.mark.slow
def test_bench_gpu_tiny_shape_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    run = entry.run_process("scripts/bench_gpu.py", *TINY, "--json", str(out), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    results = record["results"]
    assert set(MEASURED) <= set(results), set(MEASURED) - set(results)
    for key, value in results.items():
        if key == "trainer/mfu" and value is None:  # n/a without a known peak (CPU)
            continue
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    # the group sent every parameter once (tied head: once), in the dtype train.py sends in: fp32 on the CPU
    wire = "bfloat16" if torch.cuda.is_available() else "float32"
    assert record["settings"]["sync_dtype"] == wire
    assert results["sync/group/bytes"] == getattr(torch, wire).itemsize * record["model"]["params"]
    # 4 groups of 16 + 4 x 24 packed tokens; sequence tokens count each prompt per response
    assert results["trainer/packed_tokens_per_step"] == 4 * (16 + 4 * 24)
    assert results["trainer/seq_tokens_per_step"] == 16 * (16 + 24)
    assert record["settings"]["engine_requests"] == {"128": "32 prompts x n=4", "512": "128 prompts x n=4"}
    assert "| trainer/step_s |" in run.stdout and record["command"].endswith(" ".join(TINY + ["--json", str(out)]))


@pytest.mark.slow
def test_the_bench_sends_and_publishes_in_the_dtype_it_is_given(tiny_model_dir, tmp_path, monkeypatch):
    """main() gives both sync benchmarks train.engine_dtype (bf16 on CUDA, as train.publish sends and publishes);
    here on the CPU with bf16 given: half the bytes of fp32 over the group and in the published folder."""
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    model = load_model(str(tmp_path / "model"))
    params, scorer, a = (
        sum(p.numel() for p in model.parameters()),
        SimpleNamespace(model=model),
        argparse.Namespace(sync_repeats=1),
    )
    group = bench.bench_group(a, scorer, tmp_path, torch.device("cpu"), torch.bfloat16)
    assert group["sync/group/bytes"] == 2 * params
    monkeypatch.setattr(sync, "full_state", lambda m: m.state_dict())  # no process group here: the model is whole
    cfg = SimpleNamespace(model=SimpleNamespace(model_path=str(tmp_path / "model")), checkpoint_job_dir=str(tmp_path))
    with HFEngine(str(tmp_path / "model")) as engine:
        files = bench.bench_checkpoint(a, scorer, engine, cfg, torch.bfloat16)
    assert 2 * params <= files["sync/checkpoint/bytes"] < 2 * params + 2**16  # bf16 tensors + the file's header
