"""A learning table: every RL preset trained from the embedded SFT weights on the embedded task, each beside its
control, for the same budget; held-out accuracy before and after, and wall time.

    bash run.sh --dry-run                               # once: .venv and assets/ (or: python tiny.py --out assets)
    python scripts/learn_table.py --jobs 2              # every RL preset (docs/LOG.md: the table, its wall time)
    python scripts/learn_table.py --presets grpo,rloo --steps 10   # some presets, a smaller budget
    python scripts/learn_table.py --sft-weights DIR     # start from these weights (else SFT once, then reused)

1. The embedded default (`tiny.py --out assets`, once), then SFT: configs/tiny.yaml's `sft_warmup` stage alone (600
   steps on the weak teacher's demonstrations, held-out accuracy 0.60), run once into <out>/sft_stage; a later call
   finds its weights there.
2. Per preset (`--presets`; default every preset of algos.PRESETS that is not train-only: sft and dpo learn from
   files, not from a reward, and have no place in an RL table), two runs of configs/tiny.yaml's RL part (mode both,
   HF engine, 16 tasks x 8 responses a step) from the SFT weights, `--steps` steps each (lr 5e-5 after 2 warm-up
   steps, constant: configs/tiny.yaml's cosine spans 60 steps), through launch.py as a process:
     - `real`:    algorithm_type <preset>, rewarded by math_reward (the right number, plus 0.1 for `#### N`);
     - `control`: the same, but the training taskset rewarded by random_reward (a seeded coin flip, p 0.5): a gain
       the control also makes did not come from the reward.
   Held-out accuracy is greedy math_reward accuracy on the 200 test problems (the same eval as `bash run.sh`), at
   step 0 (before: the SFT weights) and at the last step (after).
3. The table (markdown, on stdout and in <out>/learn_table.md) and every figure in <out>/learn_table.json. A preset
   learns when it gains at least --margin (0.05: one 200-problem eval's standard error is ~0.034) and gains at least
   that much more than its control; the exit code is 0 when every preset learns, else 1.

OVERRIDES holds what a preset needs beyond configs/tiny.yaml (its dotted keys set in both runs; each entry says why):
ppo's critic, multi_step_grpo's multi-turn workflow, the expert rows of mix and mix_chord, the teacher of
on_policy_distill and jsd. A preset with no entry (a new one in algos.PRESETS) runs with none: it joins the table by
itself, and its row shows whether it learns. The presets that learn from a teacher, not a reward (CONTROLS:
"teacher"), run after the others: their teacher is --teacher, by default this table's grpo run's final weights; their
control has the SFT weights as its teacher instead of a random reward, which they would ignore.

--config runs the table on another config of the same layout (a stage named sft_warmup and the RL part around it);
the test does, with a reward the untrained model learns in a few steps. `--jobs 2` runs two runs at once (each with
OMP_NUM_THREADS=1): in mode both the explorer and trainer take turns, so one run keeps about one core busy. The wall
times are each run's own (launch.py's whole command: processes start, evals, steps), measured under whatever else
the machine runs (the other run of --jobs 2 too).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs" / "tiny.yaml"
sys.path.insert(0, str(ROOT))

from algos import PRESETS  # noqa: E402
from sync import latest_weights  # noqa: E402


def sft_file(base: dict) -> dict:
    """The SFT stage's demonstrations (its experience_buffer), as an auxiliary buffer of expert rows."""
    (stage,) = [s for s in base["stages"] if s["stage_name"] == "sft_warmup"]
    buf = copy.deepcopy(stage["buffer"]["trainer_input"]["experience_buffer"])
    return {k: v for k, v in buf.items() if k in ("storage_type", "path", "format")}


# preset -> dotted-key overrides of both its runs (real and control), on top of configs/tiny.yaml's RL part; a value
# that is a function gets the base config (configs/tiny.yaml, or --config) and the run's teacher weights
OVERRIDES: dict[str, dict] = {
    # PPO: one response per task (GAE needs no group), 128 tasks a step: as many responses as 16 x 8; its critic
    # (a fresh value head) trains alone for the first steps; configs/tiny_ppo.yaml's critic settings
    "ppo": {
        "algorithm.repeat_times": 1,
        "buffer.batch_size": 128,
        "algorithm.advantage_fn_args": {"gamma": 1.0, "lam": 1.0},
        "trainer.critic_warmup": 2,
        "trainer.critic.lr": 5e-4,
        "trainer.critic.cliprange_value": 0.5,
    },
    # multi-turn GRPO needs a multi-turn workflow with one experience per turn: tool_workflow with the calculator,
    # step_wise. The SFT model answers arithmetic in one turn (it never saw a tool call), so its episodes are one
    # turn long: this row checks the step-wise path (advantages computed in the explorer), not credit over turns
    "multi_step_grpo": {
        "buffer.explorer_input.taskset.default_workflow_type": "tool_workflow",
        "buffer.explorer_input.taskset.workflow_args": {"tools": ["calculator"], "max_turns": 2, "step_wise": True},
        "model.max_model_len": 240,
    },
    # mix: RL plus SFT on expert rows; the expert file is the SFT demonstrations themselves (the weak teacher), so
    # the expert term teaches nothing the SFT weights lack and any gain over the control comes from the reward
    "mix": {
        "buffer.trainer_input.auxiliary_buffers": lambda base, teacher: {"sft_dataset": sft_file(base)},
    },
    # CHORD: mix's expert term weighted by a mu schedule (its defaults: mu 0.1 throughout); the same expert rows
    "mix_chord": {
        "buffer.trainer_input.auxiliary_buffers": lambda base, teacher: {"sft_dataset": sft_file(base)},
    },
    # on-policy distillation: a teacher (an auxiliary model) scores the student's tokens in the explorer, in
    # on_policy_distill_workflow (on the training taskset; eval stays math_workflow). The teacher: --teacher, by
    # default this table's grpo run's final weights (a better model than the SFT weights both start from)
    "on_policy_distill": {
        "buffer.explorer_input.taskset.default_workflow_type": "on_policy_distill_workflow",
        "explorer.auxiliary_models": lambda base, teacher: [{"model_path": teacher, "engine_type": "hf"}],
    },
    "jsd": {
        "buffer.explorer_input.taskset.default_workflow_type": "on_policy_distill_workflow",
        "explorer.auxiliary_models": lambda base, teacher: [{"model_path": teacher, "engine_type": "hf"}],
    },
}
# preset -> what its control changes: "reward" (random_reward on the training taskset) unless named here. "teacher":
# the control's teacher is the SFT weights the student starts from, which know nothing the student does not (the
# distillation losses never read the reward: a random one would change nothing)
CONTROLS: dict[str, str] = {"on_policy_distill": "teacher", "jsd": "teacher"}
WARMUP = 2  # learning-rate warm-up steps of every run
RANDOM_REWARD = {"default_reward_fn_type": "random_reward", "reward_fn_args": {"p": 0.5, "seed": 42}}


# --- configs


def set_key(cfg: dict, key: str, value: object) -> None:
    """cfg["a"]["b"]["c"] = value for key "a.b.c" (the parents made as needed)."""
    *parents, last = key.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    cfg[last] = value


def sft_config(base: dict, out: Path, steps: int) -> dict:
    """configs/tiny.yaml with its sft_warmup stage alone; `steps` (0: the stage's own 600) replaces its length."""
    cfg = copy.deepcopy(base)
    cfg["stages"] = [s for s in cfg["stages"] if s["stage_name"] == "sft_warmup"]
    if steps:  # a shorter SFT, its warm-up a tenth of it (LOG: 60 or 150 steps leave 4-7% held-out, too weak to RL)
        set_key(cfg["stages"][0], "buffer.total_steps", steps)
        set_key(cfg["stages"][0], "algorithm.optimizer.lr_warmup_steps", max(steps // 10, 1))
    cfg |= {"name": "sft", "checkpoint_root_dir": str(out), "continue_from_checkpoint": False}
    cfg["monitor"] = {"monitor_type": "none"}
    return cfg


def run_config(base: dict, out: Path, preset: str, arm: str, weights: Path, steps: int, teacher: str = "") -> dict:
    """configs/tiny.yaml's RL part (no stages) for one run: `arm` "real" or "control", from `weights`; `teacher`: the
    real run's teacher weights (the presets that CONTROLS marks "teacher")."""
    cfg = {k: copy.deepcopy(v) for k, v in base.items() if k != "stages"}
    cfg |= {"name": f"{preset}_{arm}", "checkpoint_root_dir": str(out), "continue_from_checkpoint": False}
    set_key(cfg, "algorithm.algorithm_type", preset)
    set_key(cfg, "model.model_path", str(weights))
    set_key(cfg, "buffer.total_steps", steps)
    set_key(cfg, "explorer.eval_interval", steps)  # eval at step 0 and at the last step
    set_key(cfg, "trainer.save_interval", steps)
    # a short run: the learning rate does not decay (configs/tiny.yaml's cosine spans its 60 steps)
    set_key(cfg, "algorithm.optimizer.lr_scheduler_type", "constant")
    set_key(cfg, "algorithm.optimizer.lr_warmup_steps", WARMUP)
    set_key(cfg, "monitor.monitor_type", "none")
    control = CONTROLS.get(preset, "reward") if arm == "control" else ""
    teacher = str(weights) if control == "teacher" else teacher
    for key, value in OVERRIDES.get(preset, {}).items():
        set_key(cfg, key, value(base, teacher) if callable(value) else copy.deepcopy(value))
    if control == "reward":
        cfg["buffer"]["explorer_input"]["taskset"] |= copy.deepcopy(RANDOM_REWARD)
    return cfg


# --- runs


def launch(cfg: dict, out: Path, threads: int | None) -> tuple[int, float, Path]:
    """launch.py on `cfg` (written to <out>/configs/<name>.yaml), its output to <out>/logs/<name>.log; the exit
    code, wall seconds and the run directory."""
    name = cfg["name"]
    (out / "configs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    path = out / "configs" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    start = time.monotonic()
    with open(out / "logs" / f"{name}.log", "w") as log:
        code = subprocess.run(
            [sys.executable, "launch.py", "--config", str(path)], cwd=ROOT, env=env, stdout=log, stderr=log
        ).returncode
    return code, time.monotonic() - start, out / cfg.get("project", "nanorft") / name


def sft_weights(base: dict, out: Path, steps: int) -> Path:
    """The SFT weights in <out>/sft_<steps> (made there first if absent)."""
    folder = out / (f"sft_{steps}" if steps else "sft_stage")
    cfg = sft_config(base, folder, steps)
    job = folder / cfg.get("project", "nanorft") / "sft" / "sft_warmup"
    if (weights := latest_weights(job)) is not None:
        print(f"[learn_table] SFT weights found: {weights}", flush=True)
        return weights
    print(f"[learn_table] SFT (the sft_warmup stage) into {folder} ...", flush=True)
    code, seconds, _ = launch(cfg, folder, None)
    if code or (weights := latest_weights(job)) is None:
        raise SystemExit(f"SFT failed (exit code {code}): see {folder / 'logs' / 'sft.log'}")
    print(f"[learn_table] SFT done in {seconds:.0f} s: {weights}", flush=True)
    return weights


@dataclasses.dataclass
class Plan:
    """What every run of a table shares."""

    base: dict  # the base config (configs/tiny.yaml, or --config), as read
    out: Path  # the output folder
    weights: Path  # the SFT weights every run starts from
    steps: int  # train steps of every run
    threads: int | None  # OMP_NUM_THREADS of every run (None: launch.py's choice)
    teacher: str = ""  # the teacher weights of the presets CONTROLS marks "teacher"


def one_run(plan: Plan, preset: str, arm: str) -> dict:
    """One arm of one preset: before / after accuracy, wall seconds, exit code."""
    row: dict = {"preset": preset, "arm": arm, "exit_code": None, "wall_seconds": 0.0}
    if CONTROLS.get(preset) == "teacher" and not plan.teacher:
        return row | {"error": "no teacher: put grpo in the same table (its real run teaches), or give --teacher"}
    runs = plan.out / "runs"
    cfg = run_config(plan.base, runs, preset, arm, plan.weights, plan.steps, plan.teacher)
    # NOTE: an earlier table's run of this name goes first (else launch.py would rename this run <name>_<time>)
    shutil.rmtree(runs / cfg.get("project", "nanorft") / cfg["name"], ignore_errors=True)
    code, seconds, run_dir = launch(cfg, runs, plan.threads)
    row |= {"exit_code": code, "wall_seconds": round(seconds, 1)}
    if CONTROLS.get(preset) == "teacher":
        row["teacher"] = str(plan.weights) if arm == "control" else plan.teacher
    summary = run_dir / "summary.json"
    evals = json.loads(summary.read_text())["eval_history"] if summary.is_file() else []
    if code == 0 and len(evals) >= 2 and evals[0]["step"] == 0 and evals[-1]["step"] == plan.steps:
        row |= {"before": evals[0]["accuracy"], "after": evals[-1]["accuracy"]}
    else:
        row["error"] = f"no eval at steps 0 and {plan.steps}: see {runs / 'logs' / (cfg['name'] + '.log')}"
    print(f"[learn_table] {preset} {arm}: {json.dumps(row)}", flush=True)
    return row


def run_all(plan: Plan, presets: list[str], jobs: int, teacher: str) -> list[dict]:
    """Both arms of every preset, `jobs` runs at a time; the presets that learn from a teacher last, once the grpo
    run that teaches them (unless `teacher` names one) has finished."""
    first = [p for p in presets if CONTROLS.get(p) != "teacher"]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(lambda j: one_run(plan, *j), [(p, arm) for p in first for arm in ("real", "control")]))
        grpo = latest_weights(plan.out / "runs" / plan.base.get("project", "nanorft") / "grpo_real")
        plan = dataclasses.replace(plan, teacher=teacher or (str(grpo) if "grpo" in first and grpo else ""))
        later = [(p, arm) for p in presets if p not in first for arm in ("real", "control")]
        rows += list(pool.map(lambda j: one_run(plan, *j), later))
    return rows


def rl_presets(names: str) -> list[str]:
    """The presets to run: `names` comma-separated, or every preset of algos.PRESETS that is not train-only."""
    if not names:
        return [name for name, p in PRESETS.items() if not p.train_only]
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in chosen if n not in PRESETS or PRESETS[n].train_only]
    if bad:
        known = ", ".join(n for n, p in PRESETS.items() if not p.train_only)
        raise SystemExit(f"--presets: {', '.join(bad)} not an RL preset of algos.PRESETS; known: {known}")
    return chosen


# --- the table


def table(rows: list[dict], margin: float) -> tuple[list[dict], str]:
    """Per preset: its two runs side by side, and the markdown table of them."""
    by = {(r["preset"], r["arm"]): r for r in rows}
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    lines = [
        "| preset | before | after | gain | control after | control gain | gain over control | learns | wall (s) "
        "| control wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    out = []
    for p in presets:
        real, ctl = by[(p, "real")], by[(p, "control")]
        ok = "after" in real and "after" in ctl
        entry = {"preset": p, "control": CONTROLS.get(p, "reward"), "real": real, "control_run": ctl}
        if ok:
            gain, cgain = real["after"] - real["before"], ctl["after"] - ctl["before"]
            entry |= {"gain": gain, "control_gain": cgain, "gain_over_control": gain - cgain}
            entry["learns"] = gain >= margin and gain - cgain >= margin  # it gains, and more than its control
            cells = [real["before"], real["after"], gain, ctl["after"], cgain, gain - cgain]
            text = " | ".join(f"{c:+.3f}" if i in (2, 4, 5) else f"{c:.3f}" for i, c in enumerate(cells))
            verdict = "yes" if entry["learns"] else "**no**"
        else:
            entry["learns"] = False
            text, verdict = " | ".join(["-"] * 6), "**failed**: " + (real.get("error") or ctl.get("error", ""))
        lines.append(f"| {p} | {text} | {verdict} | {real['wall_seconds']:.0f} | {ctl['wall_seconds']:.0f} |")
        out.append(entry)
    return out, "\n".join(lines)


# --- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(BASE), help="the base config: an sft_warmup stage and the RL part")
    ap.add_argument("--presets", default="", help="comma-separated RL presets (default: every one in algos.PRESETS)")
    ap.add_argument("--steps", type=int, default=15, help="train steps of every run")
    ap.add_argument("--out", default=str(ROOT / "checkpoints" / "learn_table"), help="output folder (SFT reused)")
    ap.add_argument("--sft-weights", default="", help="an HF folder to start from instead of <out>/sft_*'s SFT")
    ap.add_argument("--sft-steps", type=int, default=0, help="SFT steps (default: the stage's own, 600)")
    ap.add_argument("--teacher", default="", help="the teacher of on_policy_distill / jsd (default: the grpo run's)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (>1: each with OMP_NUM_THREADS=1)")
    ap.add_argument("--margin", type=float, default=0.05, help="the gain, and the gain over the control, of a learner")
    args = ap.parse_args(argv)
    presets = rl_presets(args.presets)
    out = Path(args.out).resolve()
    base = yaml.safe_load(Path(args.config).read_text())
    start = time.monotonic()
    # --- the embedded default (once; tiny.py skips a complete build), then SFT
    subprocess.run([sys.executable, "tiny.py", "--out", "assets"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    weights = Path(args.sft_weights).resolve() if args.sft_weights else sft_weights(base, out, args.sft_steps)
    # --- the runs: real and control per preset
    plan = Plan(base, out, weights, args.steps, 1 if args.jobs > 1 else None)
    rows = run_all(plan, presets, args.jobs, str(Path(args.teacher).resolve()) if args.teacher else "")
    # --- the table
    entries, md = table(rows, args.margin)
    result = {
        "command": " ".join([Path(sys.executable).name, "scripts/learn_table.py", *(argv or sys.argv[1:])]),
        "steps": args.steps,
        "jobs": args.jobs,
        "margin": args.margin,
        "sft_weights": str(weights),
        "wall_seconds": round(time.monotonic() - start, 1),
        "presets": entries,
    }
    (out / "learn_table.json").write_text(json.dumps(result, indent=1))
    (out / "learn_table.md").write_text(md + "\n")
    print(f"\n{md}\n\n{out / 'learn_table.json'}; {result['wall_seconds']:.0f} s in all", flush=True)
    return 0 if all(e["learns"] for e in entries) else 1


if __name__ == "__main__":
    sys.exit(main())
