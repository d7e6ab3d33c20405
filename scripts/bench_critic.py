"""The critic's cost: the trainer's seconds per step for GRPO vs PPO (GAE + a critic) on the same batches.

    .venv/bin/python scripts/bench_critic.py --db checkpoints/nanorft/tiny_opmd/buffer/tiny_opmd_buffer.db \
        [--model checkpoints/nanorft/tiny_sft/global_step_350/actor/huggingface] [--steps 6] [--repeats 3]

The experience DB of a finished run (its explorers marked finished) is copied once per run and its
claims released, so every run trains on the same experiences: `train.py --mode train` with algorithm_type grpo, then
ppo, then
grpo, ... (--repeats pairs, alternating so that machine noise hits both), with configs/tiny_opmd.yaml's
other settings (tiny_ppo.yaml's critic lr). Each run does --steps train
steps of train_batch_size 128; the first step of each run (allocation warm-up) is dropped. Reported:
the median over runs of each run's median time/step, time/update and time/old_ref_logprobs, and the
ratio PPO / GRPO. One process, one thread set (OMP_NUM_THREADS of the caller).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from buffer import ExperienceDB  # noqa: E402
from monitor import read_history  # noqa: E402

KEYS = ("time/step", "time/update", "time/old_ref_logprobs")


def run(algo: str, db: Path, model: str, steps: int, work: Path, k: int) -> dict[str, float]:
    name = f"{algo}_{k}"
    copy = work / f"{name}.db"
    shutil.copy(db, copy)
    with ExperienceDB(f"sqlite:///{copy}") as d:
        d.release_after(0)  # every experience pending again
    cmd = [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny_opmd.yaml",
        "--mode",
        "train",
        "--name",
        name,
        "--checkpoint_root_dir",
        str(work),
        "--model.model_path",
        model,
        "--algorithm.algorithm_type",
        algo,
        "--algorithm.repeat_times",
        "1" if algo == "ppo" else "8",
        "--buffer.train_batch_size",
        "128",
        "--buffer.total_steps",
        str(steps),
        "--trainer.critic.lr",
        "5e-4",
        "--trainer.save_interval",
        "0",
        "--buffer.trainer_input.experience_buffer.path",
        f"sqlite:///{copy}",
        "--monitor.monitor_type",
        "none",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    rows = read_history(work / "nanorft" / name / "monitor" / "trainer.jsonl")[1:]
    return {key: statistics.median(r[key] for r in rows) for key in KEYS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", required=True, help="the experience DB of a finished run (sqlite file)")
    ap.add_argument("--model", default="checkpoints/nanorft/tiny_sft/global_step_350/actor/huggingface")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {"grpo": [], "ppo": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.repeats):
            for algo in ("grpo", "ppo"):
                results[algo].append(run(algo, Path(args.db), args.model, args.steps, Path(tmp), k))
                print(algo, k, json.dumps(results[algo][-1]), flush=True)
    summary = {algo: {key: statistics.median(r[key] for r in rs) for key in KEYS} for algo, rs in results.items()}
    summary["ppo/grpo"] = {key: summary["ppo"][key] / summary["grpo"][key] for key in KEYS}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
