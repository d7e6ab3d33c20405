"""Asynchronous vs synchronous GRPO on the embedded default, back to back on one machine: wall time and
held-out accuracy after the same number of trainer steps.

    bash run.sh --dry-run                            # once: the venv and assets/
    python scripts/async_vs_sync.py                  # ~20 min on 2 CPU cores;
                                                     # writes checkpoints/nanorft/async_vs_sync.json

1. the SFT warm-up both start from (configs/async/tiny_sft.yaml; skipped when its checkpoint exists);
2. synchronous: configs/async/tiny_trainer.yaml with --mode both --synchronizer.sync_offset 0 (explorer
   and trainer take turns, on-policy), one launcher;
3. asynchronous: the same file in mode train plus configs/async/tiny_explorer.yaml in mode explore, two
   independent processes started together (the explorer runs one step ahead, sync_offset 1), each
   given one of the machine's threads (--threads-per-process; OMP_NUM_THREADS);
4. greedy accuracy on the 200 held-out problems of the SFT weights and of each run's final weights
   (explore.py --mode bench on the newest checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from monitor import read_history  # noqa: E402

PY = sys.executable


def run(cmd: list[str], env: dict | None = None) -> float:
    """Run a command to the end (its output to ours); its wall seconds. Fails loudly."""
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, **(env or {})})
    return time.monotonic() - start


def bench(name: str) -> float:
    """Greedy held-out accuracy of run `name`'s newest checkpoint (of the SFT weights when it has none)."""
    run(
        [
            PY,
            "explore.py",
            "--config",
            "configs/async/tiny_explorer.yaml",
            "--mode",
            "bench",
            "--name",
            name,
            "--explorer.bench_on_latest_checkpoint",
            "True",
            "--monitor.monitor_type",
            "none",
        ]
    )
    rows = read_history(ROOT / "checkpoints/nanorft" / name / "monitor/explorer_bench.jsonl")
    return rows[-1]["bench/arith_test/accuracy/mean@1"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads-per-process", type=int, default=1, help="OMP_NUM_THREADS of each async process")
    args = ap.parse_args()
    tag = time.strftime("%Y%m%d-%H%M%S")
    result: dict = {"tag": tag}
    result["sft_seconds"] = run([PY, "train.py", "--config", "configs/async/tiny_sft.yaml"])
    result["accuracy_sft"] = bench(f"bench_sft_{tag}")

    sync_name, async_name = f"tiny_sync_{tag}", f"tiny_async_{tag}"
    result["sync_seconds"] = run(
        [
            PY,
            "train.py",
            "--config",
            "configs/async/tiny_trainer.yaml",
            "--mode",
            "both",
            "--synchronizer.sync_offset",
            "0",
            "--name",
            sync_name,
        ]
    )
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_process)}
    procs = [
        subprocess.Popen([PY, script, "--config", f"configs/async/{cfg}", "--name", async_name], cwd=ROOT, env=env)
        for script, cfg in (("train.py", "tiny_trainer.yaml"), ("explore.py", "tiny_explorer.yaml"))
    ]
    codes = [p.wait() for p in procs]
    result["async_seconds"] = time.monotonic() - start
    if any(codes):
        raise SystemExit(f"the async run failed: exit codes {codes}")
    result["accuracy_sync"] = bench(sync_name)
    result["accuracy_async"] = bench(async_name)
    result["async_over_sync_wall"] = result["async_seconds"] / result["sync_seconds"]
    trainer = read_history(ROOT / "checkpoints/nanorft" / async_name / "monitor/trainer.jsonl")
    result["async_staleness_mean"] = sum(r["batch/staleness/mean"] for r in trainer) / len(trainer)
    result["async_rollout_corr_kl_mean"] = sum(r["rollout_corr/kl"] for r in trainer) / len(trainer)
    result["async_trainer_read_seconds_mean"] = sum(r["time/read"] for r in trainer) / len(trainer)
    sync_trainer = read_history(ROOT / "checkpoints/nanorft" / sync_name / "monitor/trainer.jsonl")
    result["sync_trainer_read_seconds_mean"] = sum(r["time/read"] for r in sync_trainer) / len(sync_trainer)
    out = ROOT / "checkpoints/nanorft" / f"async_vs_sync_{tag}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), f"\nwritten to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
