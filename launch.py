"""launch.py: run a whole experiment: each stage in order, with the processes its mode needs.

Launch lines (one code path: run.sh and train.py both end up in `run()`):
    bash run.sh                               # configs/tiny.yaml: SFT warm-up, then GRPO on CPU
    bash run.sh configs/gsm8k.yaml            # = python launch.py --config configs/gsm8k.yaml
    python train.py --config gsm8k.yaml       # mode both (or stages): train.py hands over to run()

Per stage (`configs.resolve_stages`: the global config with the stage's keys merged in):
    the resolved config is written to <stage job dir>/config.yaml and every process reads that file;
    mode train   -> the trainer (a plain process for one rank, torchrun for more)
    mode explore -> python explore.py;  mode bench -> python explore.py (evaluation only)
    mode both    -> trainer and explorer at once: they take turns through the experience DB and the
                    weights (sync_interval / sync_offset); GPUs are split between them.
With cluster.node_num > 1 the trainer spans nodes (torchrun with a static rendezvous at cluster.master_addr:
master_port): this launcher, on node 0, starts what runs there (mode train: the trainer's first node; mode both: the
explorer alone, the trainer having nodes 1..node_num-1, one rank a node on the CPU) and prints, once per stage, the
line to run on each other node:
    node 1: cd <this directory> && python -m torch.distributed.run --nnodes=2 --node-rank=1 ... train.py --config ...
A stage starts from the weights the previous stage published last. If a process fails, the launcher
stops the others (SIGTERM, then SIGKILL after a grace period), names the failed one and exits non-zero;
nothing is left running. One launcher per run directory (a flock on <run dir>/launch.lock: a second is refused by
name), and its processes end with it however it ends, SIGKILL included (lease.py). After the last stage it writes
`summary.json` and `reward_accuracy.png` in the
run directory (<checkpoint_root_dir>/<project>/<name>/) and prints their paths.

`continue_from_checkpoint: false` with an existing run directory starts a new run named
<name>_<YYYYmmdd-HHMMSS> (Trinity-RFT's behaviour); true resumes every stage where it stopped.
Not for a lone `mode: explore` or `mode: train` (asynchronous RFT): those processes meet in one run
directory, so it is never renamed; each writes its config as config_<explorer or trainer name>.yaml.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import configs

# NOTE: --help answers here, before torch and the project's modules below are imported (~5 s): configs/ loads
# without them
if __name__ == "__main__":
    configs.answer_help(sys.argv[1:], __doc__)

import lease
import proctree
import sync
from buffer import DBMismatch, ExperienceDB, is_postgres, sqlite_path
from configs.resolve import CONSOLE, LAUNCHED
from errors import DataError
from monitor import (
    Console,
    HistoryTail,
    bars_wanted,
    close_log_file,
    close_monitors,
    eval_line,
    fail_left_runs,
    headline,
    log_to_file,
    numbers_of,
    prepare_mlflow,
    read_history,
)
from workflows.args import check_tasksets

log = logging.getLogger("nanorft.launch")
REAP_GRACE_S = 10.0  # what an ended role left running gets this long after SIGTERM before SIGKILL (seconds)
# the trainer's process group: how long a rank waits for the others in a collective (seconds) unless
# NANORFT_GROUP_TIMEOUT says; torch's own default for gloo, and never shorter than rank 0's wait for experiences
GROUP_TIMEOUT_S = 1800.0
GROUP_TIMEOUT_ENV = "NANORFT_GROUP_TIMEOUT"
HERE = Path(__file__).resolve().parent


# --- processes


def commands(stage: configs.Config, config_file: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """role -> (command line, extra environment) of the processes a stage's mode needs on this node (node 0): the
    trainer only where its first node is this one (`other_nodes` says what the others run)."""
    py, cl = sys.executable, stage.cluster
    explorer = ([py, str(HERE / "explore.py"), "--config", str(config_file)], {})
    trainer = (trainer_command(stage, config_file), {})
    beside = cl.trainer_node_num == cl.node_num  # the trainer's first node is this one; else node 0 is the explorer's
    if cl.colocate:  # one GPU, shared
        explorer[1]["CUDA_VISIBLE_DEVICES"] = trainer[1]["CUDA_VISIBLE_DEVICES"] = visible_gpus(range(1))
    elif cl.trainer_gpu_num and stage.mode == "both":  # explorer on the first GPUs, trainer on the rest
        explorer[1]["CUDA_VISIBLE_DEVICES"] = visible_gpus(range(cl.explorer_gpu_num))
        trainer[1]["CUDA_VISIBLE_DEVICES"] = visible_gpus(
            range(cl.explorer_gpu_num, cl.explorer_gpu_num + cl.trainer_gpu_num_per_node)
        )
    elif stage.mode == "both" and beside and overlaps(stage) and "OMP_NUM_THREADS" not in os.environ:
        explorer[1]["OMP_NUM_THREADS"], trainer[1]["OMP_NUM_THREADS"] = map(str, cpu_split())
        for role in (explorer, trainer):  # NOTE: an idle OpenMP thread sleeps instead of spinning (cpu_split)
            role[1]["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    here = {"trainer": trainer} if beside else {}
    return {
        "train": here,
        "explore": {"explorer": explorer},
        "bench": {"explorer": explorer},
        "both": {**here, "explorer": explorer},
    }[stage.mode]


def visible_gpus(indices: range) -> str:
    """CUDA_VISIBLE_DEVICES for a child that gets the GPUs `indices` of the ones this launcher sees: the entries of
    the launcher's own CUDA_VISIBLE_DEVICES (`CUDA_VISIBLE_DEVICES=3 bash run.sh` runs on GPU 3, not 0), or the
    indices themselves where it is unset. ConfigError when it lists fewer GPUs than the layout needs."""
    mine = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mine is None:
        return ",".join(map(str, indices))
    names = [g.strip() for g in mine.split(",") if g.strip()]
    if indices and indices[-1] >= len(names):
        raise configs.ConfigError(
            f"cluster: the layout needs GPUs {list(indices)} of this node's, but "
            f"CUDA_VISIBLE_DEVICES={mine!r} shows {len(names)}: set cluster.gpu_per_node"
        )
    return ",".join(names[i] for i in indices)


def trainer_command(stage: configs.Config, config_file: Path, node_rank: int = 0) -> list[str]:
    """The trainer's command line on the `node_rank`-th of its nodes: a plain process for one rank, torchrun
    --standalone for more on one node, and over several nodes torchrun with a static rendezvous at
    cluster.master_addr:master_port. NOTE: static, not c10d (which torchrun recommends): c10d ignores --node-rank
    and numbers the nodes by host name and process id (docs/LOG.md), while trainer rank 0, which reads the DB and
    serves the weights, must be on the node this launcher knows (node 0, or node 1 after the explorer's)."""
    cl = stage.cluster
    cmd, ranks = [str(HERE / "train.py"), "--config", str(config_file)], max(cl.trainer_gpu_num_per_node, 1)
    if cl.node_num > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={cl.trainer_node_num}",
            f"--node-rank={node_rank}",
            f"--nproc-per-node={ranks}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={cl.master_addr}:{cl.master_port}",
            *cmd,
        ]
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *cmd]
    return [sys.executable, *cmd]


def other_nodes(stage: configs.Config, config_file: Path) -> list[str]:
    """What each other node runs in this stage (cluster.node_num > 1): 'node <k>: <shell line>', the trainer's
    command from this directory (the same paths on every node: a shared filesystem)."""
    cl, cwd = stage.cluster, shlex.quote(os.getcwd())
    first = cl.node_num - cl.trainer_node_num  # the trainer's first node: 0, or 1 when node 0 is the explorer's
    return [
        f"node {first + r}: cd {cwd} && {shlex.join(trainer_command(stage, config_file, r))}"
        for r in range(cl.trainer_node_num)
        if first + r > 0
    ]


def overlaps(stage: configs.Config) -> bool:
    """Whether explorer and trainer compute at the same time: they do unless the sync is on-policy (fixed style,
    sync_offset 0), where each waits for the other."""
    s = stage.synchronizer
    return not (s.sync_style == "fixed" and s.sync_offset == 0)


def cpu_split() -> tuple[int, int]:
    """CPU threads (explorer, trainer) for a mode-both stage whose processes overlap on a machine without GPUs: the
    explorer a third of the cores (at least one), the trainer every core, both with OMP_WAIT_POLICY=PASSIVE.
    NOTE: each process would otherwise start a thread per core, and two OpenMP thread teams on the same spinning
    cores fight (a team's parallel region waits for its slowest thread: 4.4x slower steps on 2 cores). With passive
    waiting the trainer, the longer of the two, also gets the cores the explorer leaves idle once its rollout is
    done: 80 s against 85-91 s for bench_vs_trl's sync_offset 1 run, where one thread each was the rule
    (docs/LOG.md, 2026-11-30). On-policy runs take turns, so each keeps every core."""
    # NOTE: the cores this process may run on (Linux); macOS has no affinity masks: every core
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // 3), cores


def supervise(procs: dict[str, subprocess.Popen], grace: float = 30.0, tick: Callable[[], None] | None = None) -> int:
    """Wait for every process (calling `tick` every 0.2 s). The first non-zero exit stops the others; returns that
    code (0 if all ok)."""
    running = dict(procs)
    while running:
        if tick is not None:
            tick()
        for role, p in list(running.items()):
            code = p.poll()
            if code is None:
                continue
            del running[role]
            reap_left(procs)  # what the role started and left running (vLLM's engine processes, when it was killed)
            if code != 0:
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                others = ", ".join(running) or "nothing else"
                log.error("%s failed (%s); stopping %s. See its messages above.", role, why, others)
                stop(running, grace)
                return code if code > 0 else 1
            log.info("%s finished", role)
        time.sleep(0.2)
    return 0


def reap_left(procs: dict[str, subprocess.Popen], grace: float = REAP_GRACE_S) -> list[int]:
    """Stop the processes that ended roles left running (logged as a warning with what was stopped): those carrying
    this launcher's mark in their environment (lease.launcher_env) that are not below a role still running. NOTE: an
    explorer SIGKILLed (by the OOM killer, a user) gets no chance to stop its vLLM engine core and workers; they are
    re-parented away from it and ran on, holding the GPU and the launcher's output pipe (docs/gpu-and-vllm.md).
    Returns the pids stopped."""
    live = [p.pid for p in procs.values() if p.poll() is None]
    left = proctree.left_by(f"{lease.LAUNCHER_PID}={lease.launcher_env()[lease.LAUNCHER_PID]}", live)
    left = proctree.still_running(left, 2.0)  # NOTE: a dead role's resource tracker ends by itself, at once
    if not left:
        return []
    shown = ", ".join(map(proctree.describe, left))
    log.warning(
        "stopping %d process(es) left running by ended roles: %s (SIGTERM, SIGKILL after %g s)", len(left), shown, grace
    )
    _, killed = proctree.stop_all(left, grace)
    if killed:
        log.warning("killed (SIGKILL) after %g s: %s", grace, ", ".join(map(str, killed)))
    return left


def on_second_interrupt(procs: dict[str, subprocess.Popen]) -> None:
    """From now on a Ctrl-C or SIGTERM kills `procs` at once and ends this process with a short message (exit 130),
    instead of a KeyboardInterrupt traceback from inside the gentle stop that the first one started."""

    def now(signum: int, _frame: object) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        reap_left(procs, grace=0.0)
        print(f"\ninterrupted again: {', '.join(procs) or 'nothing'} killed", file=sys.stderr, flush=True)
        os._exit(130)

    signal.signal(signal.SIGINT, now)
    signal.signal(signal.SIGTERM, now)


def stop(procs: dict[str, subprocess.Popen], grace: float) -> None:
    """SIGTERM each process, SIGKILL what is still alive after `grace` seconds."""
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs.values():
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --- the summary of a run


def eval_key(record: dict) -> str | None:
    """The held-out accuracy metric of a monitor record: eval|bench/<first taskset>/accuracy/mean@k, else reward."""
    keys = [k for k in record if k.startswith(("eval/", "bench/")) and "/mean@" in k]
    return next((k for k in keys if "/accuracy/mean@" in k), next((k for k in keys if "/reward/mean@" in k), None))


def run_dir(cfg: configs.Config, stages: list[configs.Config]) -> Path:
    """Where summary.json goes: <root>/<project>/<name>/, the parent of the stages' job dirs."""
    job = Path(stages[0].checkpoint_job_dir)
    return job.parent if cfg.stages else job


def summarize(cfg: configs.Config, stages: list[configs.Config], seconds: float) -> dict:
    """summary.json's content: accuracy before/after SFT and after RFT, the eval and reward history."""
    evals, rewards, spans, offset, steps, sft_at = [], [], [], 0, 0, None
    for i, st in enumerate(stages):
        job = Path(st.checkpoint_job_dir)
        stage_steps = 0
        for file in sorted(job.glob("monitor/*.jsonl")):
            for rec in read_history(file):
                stage_steps = max(stage_steps, rec["step"])
                if (key := eval_key(rec)) is not None:
                    evals.append(
                        {
                            "stage": st.name,
                            "stage_index": i,
                            "step": rec["step"],
                            "global_step": offset + rec["step"],
                            "accuracy": rec[key],
                            "metric": key,
                            "metrics": {k: v for k, v in rec.items() if k.startswith(("eval/", "bench/"))},
                        }
                    )
                row = {"stage": st.name, "stage_index": i, "global_step": offset + rec["step"]}
                if "rollout/reward/mean" in rec:
                    rewards.append(row | {"reward": rec["rollout/reward/mean"]})
                if "actor/sft_loss" in rec:
                    rewards.append(row | {"sft_loss": rec["actor/sft_loss"]})
        if st.mode == "train" and st.algorithm.algorithm_type == "sft" and sft_at is None:
            sft_at = i
        spans.append({"first_step": offset, "steps": stage_steps})
        offset += stage_steps
        steps += stage_steps if st.mode != "bench" else 0
    evals.sort(key=lambda e: (e["stage_index"], e["step"]))
    before = [e for e in evals if sft_at is not None and e["stage_index"] < sft_at]
    after = [e for e in evals if sft_at is not None and e["stage_index"] > sft_at]
    trained = [e for e in evals if stages[e["stage_index"]].mode in ("both", "explore")]
    weights = next((w for st in reversed(stages) if (w := sync.latest_weights(st.checkpoint_job_dir))), None)
    return {
        "config": cfg.name,
        "run_dir": str(run_dir(cfg, stages)),
        "accuracy_before_sft": before[-1]["accuracy"] if before else None,
        "accuracy_after_sft": after[0]["accuracy"] if after else None,
        "accuracy_after_rft": trained[-1]["accuracy"] if trained else (evals[-1]["accuracy"] if evals else None),
        "accuracy_metric": evals[-1]["metric"] if evals else None,
        "wall_seconds": round(seconds, 1),
        "steps": steps,
        "checkpoint": str(weights) if weights else None,
        "stages": [
            {"name": st.name, "mode": st.mode, "algorithm": st.algorithm.algorithm_type, **span}
            for st, span in zip(stages, spans)
        ],
        "eval_history": evals,
        "reward_history": rewards,
    }


def plot(summary: dict, path: Path) -> bool:
    """SFT loss, train reward and held-out accuracy over the run's stages (`draw`), saved to `path`; False (and no
    file) when the run recorded none of them, e.g. a stage that failed at start."""
    fig = draw(summary)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def draw(summary: dict):
    """The plot's figure (None when there is nothing to draw): a panel per recorded series, all on one x axis where
    each stage (summary["stages"]: first_step, steps) gets a segment of its own width, whatever its number of steps,
    so that 60 RFT steps after 600 SFT steps are not squashed (`stage_segments`); the accuracy points labelled with
    their value where a label fits (`label_points`: no label overprints another)."""
    panels = [
        ("SFT loss", "sft_loss", summary["reward_history"]),
        ("train reward (rollout mean)", "reward", summary["reward_history"]),
        ("held-out accuracy (greedy)", "accuracy", summary["eval_history"]),
    ]
    panels = [(title, key, [x for x in rows if key in x]) for title, key, rows in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    segments = stage_segments(summary)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, (title, key, rows) in zip(axes[0], panels):
        for stage in dict.fromkeys(r.get("stage_index", 0) for r in rows):  # a line per stage: none between two
            part = [r for r in rows if r.get("stage_index", 0) == stage]
            ax.plot([x_of(segments, r) for r in part], [r[key] for r in part], "o-" if key == "accuracy" else "-", ms=4)
            ax.lines[-1].set_color("C0")
        ax.set_title(title, pad=16 if segments else 6)
        ax.grid(alpha=0.3)
        if key == "accuracy":
            ax.set_ylim(0, 1.05)
        mark_stages(ax, segments)
    fig.suptitle(
        f"{summary['config']}: accuracy {summary['accuracy_before_sft']} before SFT, "
        f"{summary['accuracy_after_sft']} after SFT, {summary['accuracy_after_rft']} after RFT",
        fontsize=9,
    )
    fig.tight_layout()
    for ax, (_, key, rows) in zip(axes[0], panels):
        if key == "accuracy":
            label_points(ax, rows, [x_of(segments, r) for r in rows])
    return fig


# a stage of at most one step (a bench stage's evaluation) gets this share of the width of a stage that trains
POINT_STAGE_WIDTH = 0.35


def stage_segments(summary: dict) -> list[dict]:
    """Each stage's segment of the x axis: its global steps [first_step, first_step + steps] drawn over [x0, x0 +
    width], width 1 (POINT_STAGE_WIDTH for a stage of one step or none); [] for a summary without stage spans (every
    point at its global step)."""
    out, x0 = [], 0.0
    for st in summary.get("stages", []):
        if "first_step" not in st:
            return []
        width = 1.0 if st["steps"] > 1 else POINT_STAGE_WIDTH
        out.append({**st, "x0": x0, "width": width, "short": st["name"].rsplit("/", 1)[-1]})
        x0 += width
    return out


def x_of(segments: list[dict], row: dict) -> float:
    """Where a history row (its global_step, stage_index) sits on the x axis of `segments`."""
    if not segments:
        return row["global_step"]
    seg = segments[row["stage_index"]]
    frac = (row["global_step"] - seg["first_step"]) / seg["steps"] if seg["steps"] > 1 else 0.5
    return seg["x0"] + seg["width"] * frac


def mark_stages(ax, segments: list[dict]) -> None:
    """The stages on `ax`: a dotted line between two, each one's name above its segment, and x ticks at a few
    global steps of each stage that trains (a shared boundary once)."""
    from matplotlib.ticker import MaxNLocator

    if not segments:
        ax.set_xlabel("step (all stages)")
        return
    ticks: dict[float, int] = {}
    for seg in segments:
        if seg["x0"] > 0:
            ax.axvline(seg["x0"], color="0.6", ls=":", lw=1)
        centre = seg["x0"] + seg["width"] / 2
        ax.text(centre, 1.01, seg["short"], transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=7)
        steps = MaxNLocator(nbins=3, integer=True).tick_values(0, seg["steps"]) if seg["steps"] > 1 else []
        for v in (v for v in steps if 0 <= v <= seg["steps"]):
            ticks.setdefault(round(seg["x0"] + seg["width"] * v / seg["steps"], 6), seg["first_step"] + int(v))
    ax.set_xticks(list(ticks), [str(v) for v in ticks.values()], fontsize=8)
    end = segments[-1]["x0"] + segments[-1]["width"]
    ax.set_xlim(-0.04 * end, 1.04 * end)  # room for the labels of the first and last points
    ax.set_xlabel("global step (each stage drawn at its own scale)")


def label_points(ax, rows: list[dict], xs: list[float]) -> None:
    """Each accuracy point's value, above it or else below it, where the label overlaps no label already placed nor
    the stage names: the first point, each stage's last and the best placed first, then the rest left to right."""
    renderer = ax.figure.canvas.get_renderer()
    placed = [t.get_window_extent(renderer) for t in ax.texts]  # the stage names
    last_of_stage = {r.get("stage_index", 0): i for i, r in enumerate(rows)}
    best = max(range(len(rows)), key=lambda i: rows[i]["accuracy"])
    first = [0, *sorted(last_of_stage.values()), best]
    order = list(dict.fromkeys(first + list(range(len(rows)))))
    for i in order:
        for dy, va in ((6, "bottom"), (-7, "top")):
            label = ax.annotate(
                f"{rows[i]['accuracy']:.2f}",
                (xs[i], rows[i]["accuracy"]),
                textcoords="offset points",
                xytext=(0, dy),
                ha="center",
                va=va,
                fontsize=7,
            )
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                placed.append(box)
                break
            label.remove()


# --- main


def stages_in_order(cfg: configs.Config, resolved: list[configs.Config] | None = None) -> Iterator[configs.Config]:
    """Each stage's resolved config (`resolved`: configs.resolve_stages(cfg) when the caller has it), lazily: a stage
    starts from the weights the previous stage (or the one its `start_from` names) published last, read when the
    caller asks for the next stage (after running the previous)."""
    previous, done = None, {}
    for spec, stage in zip(cfg.stages or [None], resolved or configs.resolve_stages(cfg)):
        source = done[spec.start_from] if spec and spec.start_from else previous
        if source is not None and (weights := sync.latest_weights(source.checkpoint_job_dir)):
            stage.model.model_path = str(weights)
        previous = done[spec.stage_name if spec else ""] = stage
        yield stage


def group_timeout(cfg: configs.Config) -> float:
    """How long a trainer rank waits in a collective for the others (torch.distributed's timeout):
    $NANORFT_GROUP_TIMEOUT seconds, else GROUP_TIMEOUT_S or max_read_timeout + 5 min, the longer. A node that stops
    answering (its host lost, its link cut) fails the others' collectives after this long with a named error
    (`group_failure`) instead of holding them. NOTE: ranks other than 0 wait in a collective while rank 0 waits for
    experiences (max_read_timeout): a shorter timeout would end a run that is only waiting for its explorers. On GPUs
    this lengthens NCCL's own default (10 min), which ended such a wait (max_read_timeout 1800 s by default) early."""
    if os.environ.get(GROUP_TIMEOUT_ENV):
        return float(os.environ[GROUP_TIMEOUT_ENV])
    return max(GROUP_TIMEOUT_S, cfg.buffer.trainer_input.experience_buffer.max_read_timeout + 300.0)


def group_failure(e: BaseException, cfg: configs.Config) -> str:
    """The named message for a failed collective of the trainer's process group (a rank on another node, or the link
    to it, stopped answering: gloo's timeout or a closed connection; torch's DistError), '' for any other error."""
    import torch.distributed as dist

    gloo = isinstance(e, RuntimeError) and "/gloo/" in str(e)
    if not (isinstance(e, dist.DistError) or gloo) or not dist.is_initialized() or dist.get_world_size() == 1:
        return ""
    cl, first = cfg.cluster, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"the trainer's process group failed on rank {dist.get_rank()} of {dist.get_world_size()} ({first}): a rank "
        f"on another node, or the link to it, stopped answering (the group's timeout: {group_timeout(cfg):g} s, "
        f"{GROUP_TIMEOUT_ENV}). Check that every node runs and reaches {cl.master_addr}:{cl.master_port}, then start "
        "the trainer again on every node (the launcher on node 0, the line it prints on the others): it resumes from "
        "its last checkpoint"
    )


def run_in_process(cfg: configs.Config, runners: dict[str, Callable[[configs.Config], int]], role: str) -> int:
    """Run `runners[stage.mode](stage)` for each stage in this process, in order (what train.py and
    explore.py do when started directly); stops at the first non-zero exit code."""
    lease.follow_launcher()  # started by a launcher: end with it, however it ends
    for stage in stages_in_order(cfg):
        if stage.mode not in runners:
            log.info("stage %s is mode %s: nothing for the %s to do", stage.name, stage.mode, role)
            continue
        code = 1  # what an exception leaves
        try:
            code = runners[stage.mode](stage)
        except (DataError, DBMismatch, configs.ConfigError) as e:  # bad input: the message says it all, no traceback
            log.error("%s of stage %s stops: %s", role, stage.name, e)
            return 2
        except RuntimeError as e:  # a lost node or link under the trainer's process group: named, no traceback
            if not (why := group_failure(e, stage)):
                raise
            log.error("%s of stage %s stops: %s", role, stage.name, why)
            return 2
        except KeyboardInterrupt:  # Ctrl-C (the whole terminal's process group): a line, not a traceback
            log.error("%s of stage %s interrupted", role, stage.name)
            signal.signal(signal.SIGINT, lambda *_: os._exit(130))  # a second one while closing: leave at once
            return 130
        finally:  # NOTE: a stage an error ended left its monitor open (its mlflow run RUNNING): closed, as failed
            close_monitors(failed=code != 0)
            lease.release_all()  # the role's lease in the DB (lease.py), however the stage ended
        if code:
            return code
    return 0


def fresh_name(cfg: configs.Config) -> configs.Config:
    """With continue_from_checkpoint false, an existing run directory gets a new run: <name>_<time>."""
    job = Path(configs.derive(dataclasses.replace(cfg, stages=[])).checkpoint_job_dir)
    if cfg.continue_from_checkpoint or not job.exists() or not any(job.iterdir()) or async_role(cfg):
        return cfg
    name = f"{cfg.name}_{time.strftime('%Y%m%d-%H%M%S')}"
    log.info("continue_from_checkpoint is false and %s exists: this run is %s", job, name)
    return dataclasses.replace(cfg, name=name)


def async_role(cfg: configs.Config) -> str:
    """The explorer's or trainer's name when `cfg` is one side of an asynchronous run, else ""."""
    if cfg.stages or cfg.mode not in ("explore", "train"):
        return ""
    return cfg.explorer.name if cfg.mode == "explore" else cfg.trainer.name


def reopen_explorer(stage: configs.Config) -> None:
    """Mode both in a run directory whose explorer had finished (a resumed run with more steps): mark it
    unfinished in the DB before the processes start. NOTE: else the trainer, seeing every explorer that
    wrote to the DB finished, ends before the explorer has started; an explorer with nothing left to do
    marks itself finished again at once."""
    url = stage.buffer.trainer_input.experience_buffer.path
    if not is_postgres(url) and not Path(sqlite_path(url)).is_file():
        return
    try:
        with ExperienceDB(url) as db:
            state = db.explorer_states().get(stage.explorer.name)
            if state and state.get("finished"):
                db.set_explorer_state(stage.explorer.name, {**state, "finished": False})
    except DBMismatch:  # the processes name the problem themselves, as they do without a launcher
        return


def write_stage_config(stage: configs.Config, path: Path) -> Path:
    """Write the stage's resolved config, which its processes read, to `path`, readable by its owner only (0600) from
    the moment the file exists: it holds the real secrets (env_vars, monitor_args, a DB URL's password), and which
    values are secret is not for a name pattern to guess. NOTE: a file left by an earlier run keeps its mode through
    open(): it is made 0600 before it is emptied and the new text goes in."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with open(fd, "w", encoding="utf-8") as f:
        os.fchmod(fd, 0o600)
        f.truncate()
        f.write(configs.to_yaml(stage))
    return path


def run_stage(stage: configs.Config, side: str) -> int:
    """Start the stage's processes and wait for them; returns the exit code. On a terminal, the launcher draws a
    progress bar per process from their histories (the processes then leave the console to it)."""
    start, started, job = time.monotonic(), time.time(), Path(stage.checkpoint_job_dir)
    job.mkdir(parents=True, exist_ok=True)
    file_log = log_to_file(str(job), f"launch_{side}" if side else "launch")  # log/launch.log
    config_file = write_stage_config(stage, job / (f"config_{side}.yaml" if side else "config.yaml"))
    log.info("stage %s: mode %s, %s, config %s", stage.name, stage.mode, stage.algorithm.algorithm_type, config_file)
    if others := other_nodes(stage, config_file):
        log.info(
            "stage %s spans %d nodes: run on each other node (the same paths there: a shared filesystem); the "
            "trainer waits at its rendezvous %s:%d until every node has joined (10 min at most):\n  %s",
            stage.name,
            stage.cluster.node_num,
            stage.cluster.master_addr,
            stage.cluster.master_port,
            "\n  ".join(others),
        )
    procs: dict[str, subprocess.Popen] = {}
    if (code := task_pipeline_first(stage, config_file)) != 0:
        log.info("%s", stage_line(stage, [], code, time.monotonic() - start))
        close_log_file(file_log)
        return code
    bars = bars_wanted()
    watch = Watch(stage, bars) if bars else None
    try:
        if stage.mode == "both":
            reopen_explorer(stage)
        for role, (cmd, env) in commands(stage, config_file).items():
            if env:
                log.info("%s: %s", role, " ".join(f"{k}={v}" for k, v in env.items()))
            env = {
                **os.environ,
                **env,
                LAUNCHED: "1",
                **({CONSOLE: "launcher"} if bars else {}),
                **lease.launcher_env(),
            }
            procs[role] = subprocess.Popen(cmd, cwd=os.getcwd(), env=env)
        code = supervise(procs, tick=watch.tick if watch else None)
    except KeyboardInterrupt:
        log.error("interrupted: stopping %s (interrupt again to kill them at once)", ", ".join(procs))
        on_second_interrupt(procs)
        code = 130
    finally:
        stop(procs, grace=30.0)
        reap_left(procs)
        if watch:
            watch.close()
    if code:  # the Monitor roles of the processes stopped here, whose mlflow runs never ended
        ran = {"trainer": [stage.trainer.name], "explorer": [stage.explorer.name, f"{stage.explorer.name}_bench"]}
        fail_left_runs(stage, [name for role in procs for name in ran[role]], started)
    log.info("%s", stage_line(stage, list(procs), code, time.monotonic() - start))
    close_log_file(file_log)
    return code


def task_pipeline_first(stage: configs.Config, config_file: Path) -> int:
    """A stage that explores with a task pipeline (data_processor.task_pipeline) runs it first, alone, as a process
    (explore.py --task-pipeline: its output cached under the job folder); the explorer started next finds it there.
    Else the trainer, started at once, would count the pipeline's minutes against its max_read_timeout."""
    tp = stage.data_processor.task_pipeline
    if stage.mode not in ("both", "explore") or not (tp.operators or tp.config_path):
        return 0
    log.info("stage %s: the task pipeline first (%d operator(s))", stage.name, len(tp.operators))
    cmd = [sys.executable, str(HERE / "explore.py"), "--config", str(config_file), "--task-pipeline"]
    proc = subprocess.Popen(cmd, cwd=os.getcwd(), env={**os.environ, LAUNCHED: "1", **lease.launcher_env()})
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        stop({"task pipeline": proc}, grace=30.0)
        return 130
    if code:
        log.error("stage %s: the task pipeline failed (exit code %d): see its lines above", stage.name, code)
    return code


class Watch:
    """The launcher's console on a terminal: a bar per process of the stage, fed from their histories."""

    def __init__(self, stage: configs.Config, bars: bool = True, file: TextIO | None = None) -> None:
        roles = list(commands(stage, Path()).keys())
        self.tails = {role: HistoryTail(history_path(stage, role)) for role in roles}
        self.console = Console(dict.fromkeys(roles), bars=bars, file=file)

    def tick(self) -> None:
        for role, tail in self.tails.items():
            for record in tail.read():
                self.console.step(role, record["step"], numbers_of(record), record.get("total_steps"))

    def close(self) -> None:
        self.tick()
        self.console.close()


def history_path(stage: configs.Config, role: str) -> Path:
    """The JSONL history the stage's `role` process writes (its Monitor's role name)."""
    name = {"trainer": stage.trainer.name, "explorer": stage.explorer.name}[role]
    if role == "explorer" and stage.mode == "bench":
        name = f"{name}_bench"
    return Path(stage.checkpoint_job_dir, "monitor", f"{name}.jsonl")


def stage_line(stage: configs.Config, roles: list[str], code: int, seconds: float) -> str:
    """The line at a stage's end: how it ended, its time, and each process's last numbers."""
    parts = []
    for role in roles:
        path = history_path(stage, role)
        records = read_history(path) if path.exists() else []
        last = next((r for r in reversed(records) if r.get("step")), None)
        evals = next((e for r in reversed(records) if (e := eval_line(numbers_of(r)))), None)
        if last:
            parts.append(f"{role} step {last['step']}: {headline(numbers_of(last))}")
        if evals:
            parts.append(f"last {evals[0]} {evals[1]}")
    how = "finished" if code == 0 else f"FAILED (exit code {code})"
    return f"stage {stage.name} {how} in {seconds:.0f} s" + (": " + "; ".join(parts) if parts else "")


def run(cfg: configs.Config) -> int:
    """Run every stage of `cfg`; returns the exit code."""
    start = time.monotonic()
    try:
        cfg = fresh_name(cfg)
        resolved = configs.resolve_stages(cfg)
        for stage in resolved:  # every stage valid, with the GPUs it needs, before anything starts
            check_tasksets(stage, user_code=False)  # workflow_args / reward_fn_args (the explorer checks user code)
            commands(stage, Path())
        # monitor_type mlflow: one store for the run, its experiment created once, before any process starts
        prepare_mlflow(resolved, run_dir(cfg, resolved))
    except configs.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:  # one launcher per run directory (per side of an asynchronous run), held until this process ends
        lock = lease.lock_dir(run_dir(cfg, resolved), async_role(cfg))
    except lease.RoleTaken as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    try:
        return run_stages(cfg, resolved, start)
    except KeyboardInterrupt:  # between stages or in the summary: no traceback
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        os.close(lock)


def run_stages(cfg: configs.Config, resolved: list[configs.Config], start: float) -> int:
    """Run the stages in order (the first failure stops them), then write the summary and the plot."""
    # NOTE: SIGTERM to the launcher (e.g. `kill`) must stop the children too: turn it into an exception.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # NOTE: Ctrl-C and the studio's stop (SIGINT) stop the run however the launcher was started: a background job
    # of a script starts with SIGINT ignored, and a blocked signal mask survives exec; both would leave it running.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    code, stages = 0, []
    for stage in stages_in_order(cfg, resolved):
        stages.append(stage)
        code = run_stage(stage, async_role(cfg))
        if code:
            log.error("stage %s failed; later stages not run", stage.name)
            break
    # --- summary and plot
    out = run_dir(cfg, stages)
    summary = summarize(cfg, stages, time.monotonic() - start)
    summary["exit_code"] = code
    written = write_summary(out / "summary.json", summary)
    drawn = out / "reward_accuracy.png"
    try:
        drawn = drawn if plot(summary, drawn) else "none (no step recorded a loss, reward or accuracy)"
    except Exception as e:  # a plot (a full disk too) must not turn a finished run into a failure
        log.warning("could not draw the plot: %s", e)
        drawn = "none"
    shown = {
        k: summary[k]
        for k in ("accuracy_before_sft", "accuracy_after_sft", "accuracy_after_rft", "wall_seconds", "steps")
    }
    print(f"\nrun {'finished' if code == 0 else f'FAILED (exit code {code})'}: {json.dumps(shown)}")
    print(f"summary: {written}\nplot:    {drawn}", flush=True)
    return code


def write_summary(path: Path, summary: dict) -> str:
    """Write summary.json whole (sync.write_atomic: never a torn file) and return its path, or "none (why)" when it
    cannot be written: a full disk must not turn a finished run into a failure (its figures stay in the monitor files,
    and the line above prints the main ones)."""
    try:
        sync.write_atomic(path, lambda p: Path(p).write_text(json.dumps(summary, indent=1)))
    except OSError as e:
        log.warning("could not write %s: %s", path, e)
        return f"none (could not write {path}: {e.strerror or e})"
    return str(path)


def main(argv: list[str]) -> int:
    """--verify-sync (sync_check.py): the weight path checked before the stages start."""
    verify, argv = "--verify-sync" in argv, [a for a in argv if a != "--verify-sync"]
    cfg = configs.entry(argv, "nanorft launcher: every stage of an experiment, with its processes")
    if verify:
        import sync_check

        try:
            sync_check.verify_stages(configs.resolve_stages(cfg))
        except configs.ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
