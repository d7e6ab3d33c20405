"""nanorft against TRL's GRPOTrainer on the same CPU workload, side by side: speed and held-out accuracy.

    .venv/bin/pip install -e '.[bench]'                 # TRL: an optional extra, never a runtime dependency
    .venv/bin/python scripts/bench_vs_trl.py            # 3 seeds x (nanorft, TRL, nanorft sync_offset 1), ~20 min
    .venv/bin/python scripts/bench_vs_trl.py --seeds 0 --steps 5 --sft-steps 20 --work /tmp/b   # a quick check

The workload, built once with the project's own tooling and cached in --work (same arguments, same files):
  - `tiny.py --problems plain --two-step-frac 0.5 --max-operand 9 --teacher-error 0.6`: 2-3 operand problems
    ("What is 7 + 2 - 4?", 2,500 train / 500 held-out test) whose SFT demonstrations come from the embedded
    default's weak teacher (in 60% of the rows with a subtraction it adds instead; the references the reward
    checks stay right), and the ~1M-parameter Qwen2 model with the byte-level (character) tokenizer;
  - SFT of that model with nanorft's own trainer (train.py, --sft-steps steps of 64 demonstrations): about
    0.29 held-out greedy accuracy, the policy both frameworks start from. GRPO then has something to learn
    that the demonstrations got wrong (with a perfect teacher, 0.48 at the start, neither framework's GRPO
    raised held-out accuracy at any of lr 2e-4 / 1e-4 / 5e-5: docs/LOG.md).
GRPO, the same hyper-parameters on both sides: 16 prompts x 8 samples per step, at most 48 new tokens,
temperature 1 (top-p 1, top-k off), AdamW lr 5e-5 constant (no warm-up, no weight decay, betas 0.9/0.999),
grad clip 1.0, no KL term (beta 0), token-mean loss over the batch (TRL's `dapo` = nanorft's token-mean with one
optimizer step per batch), one update per batch (fully on-policy), --steps steps, reward = math_reward
(1 for the right number + 0.1 for a stated final answer, the same Python function on both sides).
  - nanorft: `python train.py --config <generated yaml>` in mode both, every other key at its default.
  - TRL 1.16 `GRPOTrainer` (HF `model.generate`, fp32), in its own process (this script, --trl-worker).
  - nanorft again with `synchronizer.sync_offset: 1` (the explorer generates step s+1 while step s trains).
The runs alternate within each seed, in a rotating order, so that drift of this shared machine hits all.

Reported per run: wall time of the steps (first step start to last step end: nanorft's trainer step times
summed; TRL's from a callback), step-time breakdown (nanorft: rollout, update, and the rest of the step: DB,
weight sync, batch building, logging, waiting, beyond rollout + update, or beyond the longer of the two when they
overlap; TRL: generate, and the rest: rewards, the update, logging), completions/s and generated tokens/s over that
wall time, peak RSS (nanorft: explorer + trainer),
the whole command's wall time (start-up included), and held-out greedy accuracy before and after, with one
evaluator for both (plain transformers `generate`, greedy, on the 500 test problems).
Then medians per variant and the speed-up ratios TRL / nanorft, seed by seed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY_ARGS = [
    "--problems",
    "plain",
    "--two-step-frac",
    "0.5",
    "--max-operand",
    "9",
    "--teacher-error",
    "0.6",
    "--n-train",
    "2500",
    "--n-test",
    "500",
    "--tokenizer",  # the workload every earlier pair was measured on (docs/LOG.md); tiny.py's default is bpe now
    "byte",
]
HP = {"prompts": 16, "n": 8, "max_new": 48, "lr": 5e-5, "grad_clip": 1.0}


# --- the workload


def build_workload(work: Path, sft_steps: int) -> Path:
    """tiny.py's assets and the SFT checkpoint GRPO starts from (both cached); the SFT weights' folder."""
    subprocess.run(
        [sys.executable, "tiny.py", "--out", str(work / "assets"), *TINY_ARGS],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    sft = work / "sft" / "bench" / f"sft{sft_steps}"
    weights = sft / f"global_step_{sft_steps}" / "actor" / "huggingface"
    if not (weights / "model.safetensors").is_file():
        cfg = {
            "project": "bench",
            "name": f"sft{sft_steps}",
            "mode": "train",
            "continue_from_checkpoint": True,
            "checkpoint_root_dir": str(work / "sft"),
            "algorithm": {
                "algorithm_type": "sft",
                "optimizer": {
                    "lr": 3e-3,
                    "lr_warmup_steps": 30,
                    "lr_scheduler_type": "cosine",
                    "min_lr_ratio": 0.1,
                    "weight_decay": 0.01,
                },
            },
            "model": {
                "model_path": str(work / "assets" / "tiny-qwen2"),
                "max_prompt_tokens": 64,
                "max_response_tokens": HP["max_new"],
            },
            "buffer": {
                "train_batch_size": 64,
                "total_steps": sft_steps,
                "trainer_input": {
                    "experience_buffer": {
                        "name": "sft",
                        "storage_type": "file",
                        "path": str(work / "assets" / "arith" / "sft.jsonl"),
                        "format": {"prompt_type": "messages"},
                    }
                },
            },
            "synchronizer": {"sync_interval": sft_steps},
            "monitor": {"monitor_type": "none"},
        }
        path = write_config(work / "sft.yaml", cfg)
        print(f"SFT of the starting policy ({sft_steps} steps)...", flush=True)
        subprocess.run(
            [sys.executable, "train.py", "--config", str(path)],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return weights


def write_config(path: Path, cfg: dict) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def rows(work: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (work / "assets" / "arith" / f"{split}.jsonl").read_text().splitlines()]


def accuracy(weights: str, work: Path, limit: int | None = None) -> float:
    """Held-out greedy accuracy with plain transformers (the evaluator for both frameworks): batched, left-padded
    `generate`, scored by math_reward's accuracy part; on the first `limit` test problems (None: all)."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import load_tokenizer
    from workflows.math import accuracy_reward

    tok, model = load_tokenizer(weights), AutoModelForCausalLM.from_pretrained(weights).eval()
    tok.padding_side = "left"
    test, right = rows(work, "test")[:limit], 0
    for start in range(0, len(test), 250):
        part = test[start : start + 250]
        text = [
            tok.apply_chat_template(
                [{"role": "user", "content": r["question"]}], add_generation_prompt=True, tokenize=False
            )
            for r in part
        ]
        inputs = tok(text, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=HP["max_new"], pad_token_id=tok.pad_token_id)
        answers = tok.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        right += sum(accuracy_reward(a, r["answer"])["accuracy"] for a, r in zip(answers, part))
    return right / len(test)


# --- nanorft


def nanorft_config(work: Path, start: Path, seed: int, steps: int, offset: int) -> dict:
    """The workload as a nanorft YAML: only what defines it; every other key at its default."""
    return {
        "project": "bench",
        "name": f"nanorft_s{seed}_o{offset}",
        "mode": "both",
        "checkpoint_root_dir": str(work / "runs"),
        "continue_from_checkpoint": False,
        "algorithm": {
            "algorithm_type": "grpo",
            "repeat_times": HP["n"],
            "kl_loss_fn": "none",
            "loss_agg_mode": "token-mean",
            "optimizer": {"lr": HP["lr"], "lr_scheduler_type": "constant", "lr_warmup_steps": 0, "weight_decay": 0.0},
        },
        "model": {"model_path": str(start), "max_prompt_tokens": 64, "max_response_tokens": HP["max_new"]},
        "buffer": {
            "total_steps": steps,
            "batch_size": HP["prompts"],
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {
                "taskset": {
                    "name": "arith",
                    "storage_type": "file",
                    "path": str(work / "assets" / "arith"),
                    "split": "train",
                    "format": {"prompt_key": "question", "response_key": "answer"},
                    "rollout_args": {"temperature": 1.0},
                    "data_selector": {"selector_type": "shuffle", "seed": seed},
                }
            },
        },
        "explorer": {"rollout_model": {"seed": seed}},
        "synchronizer": {"sync_offset": offset},
        "trainer": {"grad_clip": HP["grad_clip"]},
        "monitor": {"monitor_type": "none"},
    }


def run_nanorft(work: Path, start: Path, seed: int, steps: int, offset: int) -> dict:
    from monitor import read_history

    cfg = nanorft_config(work, start, seed, steps, offset)
    job = work / "runs" / "bench" / cfg["name"]
    subprocess.run(["rm", "-rf", str(job)], check=True)
    path = write_config(work / f"{cfg['name']}.yaml", cfg)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "train.py", "--config", str(path)], cwd=ROOT, capture_output=True, text=True)
    command = time.monotonic() - t0
    if out.returncode:
        raise RuntimeError(f"nanorft run failed:\n{out.stderr[-3000:]}")
    trainer, explorer = (
        read_history(job / "monitor" / "trainer.jsonl"),
        read_history(job / "monitor" / "explorer.jsonl"),
    )
    wall = sum(r["time/step"] for r in trainer)
    median = {
        k: statistics.median(r[k] for r in rs)
        for k, rs in (("time/step", trainer), ("time/update", trainer), ("time/rollout", explorer))
    }
    weights = job / f"global_step_{steps}" / "actor" / "huggingface"
    return {
        "framework": "nanorft" if offset == 0 else f"nanorft sync_offset {offset}",
        "seed": seed,
        "wall_s": wall,
        "command_s": command,
        "step_s": median["time/step"],
        "rollout_s": median["time/rollout"],
        "update_s": median["time/update"],
        # overlapped (sync_offset 1): the step is the longer of the two plus the rest
        "other_s": median["time/step"] - (max if offset else sum)((median["time/rollout"], median["time/update"])),
        "completions": sum(r["rollout/experience_count"] for r in explorer[:steps]),
        "tokens": sum(r["response_length/mean"] * r["batch/size"] for r in trainer),
        "peak_rss_gb": max(r.get("perf/max_rss_gb", 0) for r in trainer)
        + max(r.get("perf/max_rss_gb", 0) for r in explorer),
        "weights": str(weights),
    }


# --- TRL


def run_trl(work: Path, start: Path, seed: int, steps: int) -> dict:
    """TRL in its own process (this script with --trl-worker): its numbers come back as JSON."""
    out_dir = work / "runs" / f"trl_s{seed}"
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--trl-worker",
            "--work",
            str(work),
            "--start",
            str(start),
            "--seed",
            str(seed),
            "--steps",
            str(steps),
            "--out",
            str(out_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(f"TRL run failed:\n{out.stderr[-3000:]}")
    result = json.loads((out_dir / "result.json").read_text())
    return {**result, "command_s": time.monotonic() - t0}


def trl_worker(work: Path, start: Path, seed: int, steps: int, out_dir: Path) -> None:
    """One TRL GRPOTrainer run of the workload; writes out_dir/result.json and the final weights."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from models import load_tokenizer
    from workflows.math import math_reward

    def reward(prompts, completions, answer, **_):
        return [sum(math_reward(c[0]["content"], a).values()) for c, a in zip(completions, answer)]

    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows(work, "train")]
    )
    model = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32)
    clock = {"generate": 0.0, "tokens": 0, "steps": []}
    generate = model.generate

    def timed_generate(*args, **kwargs):  # the benchmark's probe: how much of a step is generation
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        clock["generate"] += time.perf_counter() - t
        return out

    model.generate = timed_generate

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock["steps"].append([time.perf_counter(), None])

        def on_step_end(self, args, state, control, **kw):
            clock["steps"][-1][1] = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                clock["tokens"] += logs["completions/mean_length"] * HP["prompts"] * HP["n"]

    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=HP["prompts"] * HP["n"],
        num_generations=HP["n"],
        max_completion_length=HP["max_new"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=HP["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=HP["grad_clip"],
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=load_tokenizer(str(start)),
        callbacks=[Steps()],
    )
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    load_tokenizer(str(start)).save_pretrained(str(out_dir / "final"))
    spans = [b - a for a, b in clock["steps"]]
    wall = clock["steps"][-1][1] - clock["steps"][0][0]
    result = {
        "framework": "TRL",
        "seed": seed,
        "wall_s": wall,
        "step_s": statistics.median(spans),
        "rollout_s": clock["generate"] / steps,
        "update_s": None,
        "other_s": statistics.median(spans) - clock["generate"] / steps,
        "completions": steps * HP["prompts"] * HP["n"],
        "tokens": clock["tokens"],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "weights": str(out_dir / "final"),
    }
    (out_dir / "result.json").write_text(json.dumps(result))


# --- main


def show(results: list[dict]) -> None:
    print(
        "\n| run | seed | steps wall | per step | rollout | update | rest | completions/s | tokens/s | peak RSS | "
        "command | accuracy before -> after |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        update = f"{r['update_s']:.2f} s" if r["update_s"] is not None else "-"
        print(
            f"| {r['framework']} | {r['seed']} | {r['wall_s']:.1f} s | {r['step_s']:.3f} s | {r['rollout_s']:.3f} s | "
            f"{update} | {r['other_s']:.3f} s | {r['completions'] / r['wall_s']:.0f} | "
            f"{r['tokens'] / r['wall_s']:,.0f} | "
            f"{r['peak_rss_gb']:.2f} GB | {r['command_s']:.0f} s | {r['before']:.3f} -> {r['after']:.3f} |"
        )
    kinds = list(dict.fromkeys(r["framework"] for r in results))
    print("\n| run | median steps wall | mean accuracy after | TRL / this, seed by seed |")
    print("|---|---:|---:|---|")
    trl = {r["seed"]: r["wall_s"] for r in results if r["framework"] == "TRL"}
    for kind in kinds:
        mine = [r for r in results if r["framework"] == kind]
        ratios = ", ".join(f"{trl[r['seed']] / r['wall_s']:.2f}" for r in mine if r["seed"] in trl)
        print(
            f"| {kind} | {statistics.median(r['wall_s'] for r in mine):.1f} s | "
            f"{statistics.mean(r['after'] for r in mine):.3f} | {ratios} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="checkpoints/bench_vs_trl", help="workload cache and runs (default: %(default)s)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--sft-steps", type=int, default=600)
    ap.add_argument("--no-offset", action="store_true", help="skip the sync_offset 1 runs")
    ap.add_argument("--json", help="also write every result here")
    ap.add_argument("--eval-limit", type=int, help="score the first N test problems only (a quick check; default: all)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--start", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work).resolve()
    if args.trl_worker:
        return trl_worker(work, Path(args.start), args.seed, args.steps, Path(args.out))
    start = build_workload(work, args.sft_steps)
    before = accuracy(str(start), work, args.eval_limit)
    print(f"starting policy: held-out greedy accuracy {before:.3f} ({start})", flush=True)
    runs = {
        "nanorft": lambda s: run_nanorft(work, start, s, args.steps, 0),
        "TRL": lambda s: run_trl(work, start, s, args.steps),
    }
    if not args.no_offset:
        runs["nanorft sync_offset 1"] = lambda s: run_nanorft(work, start, s, args.steps, 1)
    results = []
    for k, seed in enumerate(args.seeds):
        names = list(runs)
        for name in names[k % len(names) :] + names[: k % len(names)]:  # a rotating order
            r = runs[name](seed)
            r |= {"before": before, "after": accuracy(r["weights"], work, args.eval_limit)}
            results.append(r)
            print(json.dumps(r), flush=True)
    show(results)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"argv": sys.argv, "torch_threads": os.cpu_count(), "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
