"""Partial rollout (explorer.partial_rollout: in-flight weight updates) against waiting for the whole step, back to back
on one machine: explorer idle time at the sync points, steps per hour, and the learning curve of both.

    bash run.sh --dry-run                                  # once: the venv and assets/
    python scripts/bench_partial_rollout.py                # ~10 min on 2 CPU cores (vLLM's CPU build);
                                                           # writes checkpoints/nanorft/bench_partial_<time>.json
    python scripts/bench_partial_rollout.py --steps 12 --max-response-tokens 256 --batch-size 8

Each run: GRPO in mode both (one launcher, trainer and explorer side by side, on-policy: sync_offset 0, so the
explorer waits at every sync point for the weights trained on its step) on the embedded tiny model (assets/tiny-qwen2,
not SFT-warmed: its response lengths are long-tailed, many to the max_response_tokens cut and some a few tokens),
engine_type vllm_async with checkpoint sync; once with partial_rollout off, once on. Per run: wall seconds, steps per
hour, time/sync_idle summed (the seconds the explorer's loop waited at sync points, generating nothing), the rollout
reward per step (the learning curve), response lengths, and with partial_rollout the mixed responses
(rollout/partial_responses, rollout/tokens_from_new_weights) and the trainer's rollout-vs-trainer log-prob gap
(rollout_corr/kl, abs_diff).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from monitor import read_history  # noqa: E402


def config(name: str, partial: bool, args: argparse.Namespace, root: Path) -> dict:
    """The run's config: the embedded default's task and model, mode both, vllm_async, checkpoint sync each step."""
    taskset = {"path": str(Path(args.assets, "arith")), "split": "train", "format": {"prompt_key": "question"}}
    taskset["format"]["response_key"] = "answer"
    return {
        "project": "nanorft",
        "name": name,
        "mode": "both",
        "checkpoint_root_dir": str(root),
        "algorithm": {"algorithm_type": "grpo", "repeat_times": args.repeat_times, "optimizer": {"lr": 5e-5}},
        "model": {
            "model_path": str(Path(args.assets, "tiny-qwen2")),
            "max_prompt_tokens": 160,
            "max_response_tokens": args.max_response_tokens,
        },
        "cluster": {"gpu_per_node": 0},
        "buffer": {
            "total_steps": args.steps,
            "batch_size": args.batch_size,
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {"taskset": {"name": "arith", **taskset, "rollout_args": {"temperature": 1.0}}},
        },
        "explorer": {
            "partial_rollout": partial,
            "eval_on_startup": False,
            "rollout_model": {"engine_type": "vllm_async", "enforce_eager": True, "dtype": "float32"},
        },
        "synchronizer": {"sync_method": "checkpoint", "sync_interval": 1, "sync_offset": 0, "sync_timeout": 1200},
        "trainer": {"save_interval": 1000},
        "monitor": {"monitor_type": "none"},
    }


def one_run(name: str, partial: bool, args: argparse.Namespace, root: Path) -> dict:
    """Run it to the end (a failure fails loudly); what its monitors logged, summed up."""
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(name, partial, args, root)))
    start = time.monotonic()
    subprocess.run([sys.executable, "train.py", "--config", str(path)], cwd=ROOT, check=True, env=dict(os.environ))
    wall = time.monotonic() - start
    job = root / "nanorft" / name
    explorer = [r for r in read_history(job / "monitor/explorer.jsonl") if "rollout/reward/mean" in r]
    trainer = read_history(job / "monitor/trainer.jsonl")

    def total(key: str, rows: list[dict]) -> float:
        return sum(r.get(key, 0.0) for r in rows)

    return {
        "partial_rollout": partial,
        "wall_seconds": round(wall, 1),
        "steps": len(explorer),
        "steps_per_hour": round(len(explorer) / wall * 3600, 1),
        "explorer_idle_seconds": round(total("time/sync_idle", explorer), 2),
        "rollout_seconds": round(total("time/rollout", explorer), 2),
        "reward_curve": [round(r["rollout/reward/mean"], 4) for r in explorer],
        "response_length_mean": round(total("response_length/mean", explorer) / max(len(explorer), 1), 1),
        "response_length_max": max((r["response_length/max"] for r in explorer), default=0),
        "clip_ratio_mean": round(total("response_length/clip_ratio", explorer) / max(len(explorer), 1), 3),
        "partial_responses": total("rollout/partial_responses", explorer),
        "experiences": total("rollout/experience_count", explorer),
        "tokens_from_new_weights": total("rollout/tokens_from_new_weights", explorer),
        "rollout_corr_kl": [round(r["rollout_corr/kl"], 5) for r in trainer if "rollout_corr/kl" in r],
        "rollout_corr_abs_diff": [
            round(r["rollout_corr/abs_diff"], 5) for r in trainer if "rollout_corr/abs_diff" in r
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=4, help="tasks per step")
    ap.add_argument("--repeat-times", type=int, default=4, help="responses per task")
    ap.add_argument("--max-response-tokens", type=int, default=128, help="the cut of the long tail")
    ap.add_argument("--root", default=str(ROOT / "checkpoints"), help="checkpoint_root_dir of the runs")
    ap.add_argument("--assets", default=str(ROOT / "assets"), help="where tiny.py wrote the model and tasks")
    args = ap.parse_args()
    tag, root = time.strftime("%Y%m%d-%H%M%S"), Path(args.root)
    (root / "nanorft").mkdir(parents=True, exist_ok=True)
    result = {"tag": tag, "args": vars(args)}
    for partial in (False, True):
        result["on" if partial else "off"] = one_run(
            f"bench_partial_{'on' if partial else 'off'}_{tag}", partial, args, root
        )
    out = root / "nanorft" / f"bench_partial_{tag}.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1), f"\nwritten to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
