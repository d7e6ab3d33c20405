"""Do the data pipelines change what is learned here? Three before / after comparisons on the embedded default
(issue 49), every run GRPO from the same SFT weights for the same steps, through launch.py as a process:

    bash run.sh --dry-run                                        # once: .venv and assets/
    python scripts/pipeline_experiments.py --jobs 2              # all three (docs/LOG.md: the tables, wall time)
    python scripts/pipeline_experiments.py --only selection --seeds 1,2,3 --steps 40
    python scripts/pipeline_experiments.py --sft-weights DIR     # start from these weights (else SFT once, reused)

1. `selection`: data_selector `shuffle` vs `difficulty_based` (Trinity's BOTS selector: each task's pass rate
   estimated online from the step's rewards, the tasks nearest target_reward 0.5 chosen: greedily at tau 0, and
   sampled at tau 0.1). Its prior for the tasks not
   yet seen is the SFT model's own pass rate on each task (feature_keys), written as a column by a task pipeline of
   one `pass_rate_filter` (8 samples per task, no bounds: it drops nothing). Both arms run that pipeline, so they read
   the same rows. Per seed (--seeds) both arms share data_selector.seed and the rollout engine's seed.
2. `task_pipeline`: the taskset as it is vs a task pipeline that drops the tasks the SFT model already solves
   (`pass_rate_filter`, max_score --solved: a pass rate above it is "solved"), both `shuffle`.
3. `std_filter`: GRPO vs GRPO with an experience pipeline of `reward_std_filter` (the groups whose rewards all tie
   dropped before the DB; no over-sampling: such steps are shorter): trained tokens per step and accuracy.

Read from each run: held-out accuracy (greedy math_reward accuracy on the 200 test problems, every --eval-every steps:
summary.json's eval_history), the explore steps' rollout/accuracy/mean, and the trainer's perf/total_num_tokens per
step (<job dir>/monitor/*.jsonl). Everything lands in <out>/pipeline_experiments.json and .md. The runs share the
machine (--jobs 2: two at once, each OMP_NUM_THREADS=1): wall times are indicative only.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from learn_table import BASE, WARMUP, launch, set_key, sft_weights  # noqa: E402


def pass_rate_pipeline(weights: Path, max_score: float = 1.0) -> dict:
    """A task pipeline of one pass_rate_filter: the SFT model's pass rate on each task (8 samples), as column
    `pass_rate`; tasks above max_score dropped (1.0: none)."""
    args = {"api_or_hf_model": str(weights), "repeat_times": 8, "min_score": 0.0, "max_score": max_score}
    return {"task_pipeline": {"operators": [{"name": "pass_rate_filter", "args": args}]}}


def arms(experiment: str, weights: Path, solved: float) -> dict[str, dict]:
    """The experiment's arms: name -> dotted-key overrides of the RL config."""
    ts = "buffer.explorer_input.taskset"
    if experiment == "selection":
        pipeline = pass_rate_pipeline(weights)
        bots = {
            "selector_type": "difficulty_based",
            "feature_keys": ["pass_rate", "pass_rate"],
            "kwargs": {"target_reward": 0.5, "tau": 0.0},
        }
        sampled = {**bots, "kwargs": {"target_reward": 0.5, "tau": 0.1}}  # softmax(-|gap| / 0.1): spread, not greedy
        # BOTS as meant: two references, the untrained model's pass rate (weak) and the SFT model's (strong), so that
        # the capability estimate moves the prior of the tasks not yet seen as the policy improves (with one column
        # twice it cannot: p~ is the SFT pass rate, whatever the policy has learnt)
        base = {
            "api_or_hf_model": str(ROOT / "assets" / "tiny-qwen2"),
            "repeat_times": 8,
            "field_name": "pass_rate_base",
        }
        two = copy.deepcopy(pipeline)
        two["task_pipeline"]["operators"].insert(0, {"name": "pass_rate_filter", "args": base})
        interpolated = {**sampled, "feature_keys": ["pass_rate_base", "pass_rate"]}
        return {
            "shuffle": {"data_processor": pipeline},
            "difficulty_based": {"data_processor": pipeline, f"{ts}.data_selector": bots},
            "difficulty_based_tau0.1": {"data_processor": pipeline, f"{ts}.data_selector": sampled},
            "difficulty_based_two_refs": {"data_processor": two, f"{ts}.data_selector": interpolated},
        }
    if experiment == "task_pipeline":
        return {"all_tasks": {}, "unsolved_only": {"data_processor": pass_rate_pipeline(weights, solved)}}
    if experiment == "std_filter":
        std = {"experience_pipeline": {"operators": [{"name": "reward_std_filter", "args": {"threshold": 0.0}}]}}
        return {"no_filter": {}, "reward_std_filter": {"data_processor": std}}
    raise SystemExit(f"unknown experiment {experiment!r}: selection, task_pipeline, std_filter")


def run_config(base: dict, out: Path, name: str, weights: Path, steps: int, seed: int, every: int, extra: dict):
    """configs/tiny.yaml's RL part (no stages) from `weights`, `steps` steps, held-out eval every `every` steps."""
    cfg = {k: copy.deepcopy(v) for k, v in base.items() if k != "stages"}
    cfg |= {"name": name, "checkpoint_root_dir": str(out), "continue_from_checkpoint": False}
    for key, value in {
        "model.model_path": str(weights),
        "buffer.total_steps": steps,
        "explorer.eval_interval": every,
        "trainer.save_interval": steps,
        "algorithm.optimizer.lr_scheduler_type": "constant",  # a short run: configs/tiny.yaml's cosine spans 60
        "algorithm.optimizer.lr_warmup_steps": WARMUP,
        "monitor.monitor_type": "none",  # the <job dir>/monitor/*.jsonl history is written anyway
        "buffer.explorer_input.taskset.data_selector.seed": seed,
        "explorer.rollout_model.seed": seed,
        **extra,
    }.items():
        set_key(cfg, key, copy.deepcopy(value))
    return cfg


def history(run_dir: Path, role: str) -> list[dict]:
    path = run_dir / "monitor" / f"{role}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def one_run(args: argparse.Namespace, base: dict, weights: Path, experiment: str, arm: str, seed: int) -> dict:
    """One arm at one seed: held-out accuracy along the run, rollout accuracy and trained tokens per step."""
    extra = arms(experiment, weights, args.solved)[arm]
    name, runs = f"{experiment}_{arm}_s{seed}", Path(args.out) / "runs"
    cfg = run_config(base, runs, name, weights, args.steps, seed, args.eval_every, extra)
    shutil.rmtree(runs / cfg.get("project", "nanorft") / name, ignore_errors=True)
    code, seconds, run_dir = launch(cfg, runs, 1 if args.jobs > 1 else None)
    summary = run_dir / "summary.json"
    evals = json.loads(summary.read_text())["eval_history"] if summary.is_file() else []
    explorer, trainer = history(run_dir, "explorer"), history(run_dir, "trainer")
    row = {
        "experiment": experiment,
        "arm": arm,
        "seed": seed,
        "exit_code": code,
        "wall_seconds": round(seconds, 1),
        "heldout": {e["step"]: e["accuracy"] for e in evals},
        "rollout_accuracy": [r.get("rollout/accuracy/mean") for r in explorer if "rollout/accuracy/mean" in r],
        "trained_tokens": [r.get("perf/total_num_tokens") for r in trainer if "perf/total_num_tokens" in r],
        "tasks_after_pipeline": task_rows(run_dir),
    }
    print(f"[pipeline_experiments] {name}: exit {code}, {seconds:.0f} s, held-out {row['heldout']}", flush=True)
    return row


def task_rows(run_dir: Path) -> int | None:
    """The rows the run's task pipeline wrote (its manifest), None without one."""
    found = sorted((run_dir / "task_pipeline").glob("*.jsonl"))
    return sum(1 for line in found[-1].open() if line.strip()) if found else None


def mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def table(rows: list[dict], experiment: str) -> str:
    """Per arm: held-out accuracy at each eval step (mean over seeds, and each seed), rollout accuracy, trained
    tokens per step."""
    mine = [r for r in rows if r["experiment"] == experiment]
    steps = sorted({int(s) for r in mine for s in r["heldout"]})
    head = "| arm | seeds | " + " | ".join(f"held-out @{s}" for s in steps) + " | rollout acc | tokens / step |"
    lines = [f"### {experiment}", "", head, "|---|---|" + "---:|" * (len(steps) + 2)]
    for arm in dict.fromkeys(r["arm"] for r in mine):
        runs = [r for r in mine if r["arm"] == arm]
        cells = []
        for s in steps:
            vals = [r["heldout"].get(s, r["heldout"].get(str(s))) for r in runs]
            m = mean(vals)
            each = "/".join("-" if v is None else f"{v:.3f}" for v in vals)
            cells.append("-" if m is None else f"{m:.3f} ({each})")
        acc = mean([mean(r["rollout_accuracy"]) for r in runs])
        tok = mean([mean(r["trained_tokens"]) for r in runs])
        seeds = ",".join(str(r["seed"]) for r in runs)
        tail = f"{'-' if acc is None else f'{acc:.3f}'} | {'-' if tok is None else f'{tok:.0f}'}"
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="selection,task_pipeline,std_filter", help="experiments, comma-separated")
    ap.add_argument("--seeds", default="1,2,3", help="the seeds every arm runs, comma-separated")
    ap.add_argument("--steps", type=int, default=40, help="train steps of every run")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out eval interval (steps)")
    ap.add_argument("--solved", type=float, default=0.8, help="task_pipeline: a pass rate above this is solved")
    ap.add_argument("--out", default=str(ROOT / "checkpoints" / "pipeline_experiments"), help="output folder")
    ap.add_argument("--sft-weights", default="", help="an HF folder to start from instead of <out>/sft_stage")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (>1: each with OMP_NUM_THREADS=1)")
    ap.add_argument("--arms", default="", help="only these arms, comma-separated (default: every arm)")
    args = ap.parse_args(argv)
    args.out = str(Path(args.out).resolve())
    base = yaml.safe_load(BASE.read_text())
    start = time.monotonic()
    subprocess.run([sys.executable, "tiny.py", "--out", "assets"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    weights = Path(args.sft_weights).resolve() if args.sft_weights else sft_weights(base, Path(args.out), 0)
    experiments = [e.strip() for e in args.only.split(",") if e.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [
        (e, arm, seed)
        for e in experiments
        for seed in seeds
        for arm in arms(e, weights, args.solved)
        if not args.arms or arm in args.arms.split(",")
    ]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda j: one_run(args, base, weights, *j), jobs))
    md = "\n\n".join(table(rows, e) for e in experiments)
    result = {
        "command": " ".join(["python", "scripts/pipeline_experiments.py", *(argv or sys.argv[1:])]),
        "sft_weights": str(weights),
        "steps": args.steps,
        "wall_seconds": round(time.monotonic() - start, 1),
        "runs": rows,
    }
    Path(args.out, "pipeline_experiments.json").write_text(json.dumps(result, indent=1))
    Path(args.out, "pipeline_experiments.md").write_text(md + "\n")
    print(f"\n{md}\n\n{Path(args.out, 'pipeline_experiments.json')}; {result['wall_seconds']:.0f} s", flush=True)
    return 0 if all(r["exit_code"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
