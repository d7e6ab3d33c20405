"""explore.py: the explorer. Rollout engines and workflow runners turn tasks into scored experiences
in the experience DB; it also evaluates the model on the eval tasksets.

Launch lines:
    python explore.py --config tiny.yaml --mode explore   # fill the experience DB (pair it with train.py)
    python explore.py --config tiny.yaml --mode bench     # evaluate the model and every checkpoint
    python explore.py --config tiny.yaml --dry-run        # print the resolved config
    python explore.py --config tiny.yaml --debug [--task N] [--taskset NAME] [--stage NAME] [--full-rows]
        # one task through its workflow, printed: tools, turns, tool calls, tokens, reward, rows, advantages
    python explore.py --config tiny_tools.yaml --debug --reply '<tool_call>...</tool_call>' --reply '#### 83'
        # the same with canned replies played as the model's: a tool path seen without training

What one explore step does, straight down `explore()`:
    read buffer.batch_size tasks (the task selectors: selection.py) -> run each task's workflow on a runner thread
    (repeat_times responses, one group) -> stamp group/run ids and versions -> the raw rewards back to the task
    selectors (difficulty_based's estimate) -> the experience pipeline's operators over them (filters, reward
    shaping: pipelines/experience.py; a group it drops whole is a missing group for dynamic sampling) -> run more
    tasks in place of the dropped ones, up to explorer.max_refill_rounds rounds (refill; dynamic sampling: drop the
    groups whose rewards all tie and run more tasks until batch_size groups vary: fill_groups) -> write the step's
    experiences AND the explorer's position (and what the step wrote, the weights it waits for next: how the trainer
    knows a short step is all it gets) in one DB transaction -> log rollout metrics -> at a sync point wait for the
    trainer's weights (sync_method checkpoint: poll for its published folder; nccl: receive them over the weight
    group) -> evaluate every eval_interval steps.
The weight handshake (waiting, loading, receiving, a restart's resume, turns on a shared GPU) is sync.py's
ExplorerSync, built at set-up and called in three places: `resume`, `after_step` (or `after_step_behind`), `close`.
Writing experiences and position together is what makes a SIGKILLed explorer restart exactly after
its last written step: no task explored twice, none skipped.

Deviations from Trinity-RFT: runners are threads in this process (no Ray actors); a workflow that
hangs past max_timeout is abandoned (a Python thread cannot be killed; its result is discarded), counted
(rollout/abandoned_threads) and retried while fewer than MAX_ABANDONED run, and the process exits without
waiting for it (`leave`); the user's own reward functions run in worker processes killed with the attempt
(workflows.Reward); every dropped task has a named reason (Drop); explore steps do not overlap (but a sync point
may overlap the next step: partial_rollout below); best@k / worst@k are exact over the k runs (no bootstrap).
With explorer.partial_rollout (veRL's partial rollout; in-flight weight updates as AReaL's and PipelineRL's) the sync
point after step s runs in the background (sync.ExplorerSync.after_step_behind) while step s+1's rollout runs: its
requests start on the old weights, the update pauses the engines with them kept and resumes them, and step s+1 is
written only once the sync point has ended (what the trainer's `holds` relies on). An eval step waits for its sync
point first (it evaluates the new weights).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import configs

# NOTE: --help answers here, before torch and the project's modules below are imported (~5 s): configs/ loads
# without them
if __name__ == "__main__":
    configs.answer_help(sys.argv[1:], __doc__)

import launch
import lease
import lora
import sync
import workflows
from algos.sample import tied_groups
from batching import group_advantages, step_batch
from buffer import Experience, ExperienceDB
from configs.resolve import advantage_origin, gen_batches
from configs.schema import TasksetConfig
from engines import CannedEngine, EngineHandle, auxiliary_handles, close_engines, make_engine, rollout_handle
from errors import DataError
from models import config_tokenizer, fingerprint, load_model
from monitor import Monitor, eval_metrics, rollout_metrics
from pipelines.experience import ExperiencePipeline
from pipelines.task import with_task_pipeline
from sampling import PromptTooLong
from tasksets import Task, TaskReader, load_tasks, prompt_bound, total_steps
from workflows import RewardError, build_workflow
from workflows.args import check_tasksets
from workflows.tool_use import ToolArgs, load_tools

log = logging.getLogger("nanorft.explore")


# --- running workflows


class Drop(str):
    """Why a task was dropped: the message (a str, as logged and returned before), and `reason`, a short name the
    metrics count it under (rollout/dropped/<reason>, monitor.rollout_metrics): timeout, reward (the reward function
    raised, timed out or gave a value that is not a finite number: workflows.RewardError), output (the workflow's
    experiences refused: check_experiences), prompt_too_long, workflow (any other exception of the workflow)."""

    reason: str

    def __new__(cls, message: str, reason: str) -> Drop:
        out = super().__new__(cls, message)
        out.reason = reason
        return out


class BadOutput(ValueError):
    """check_experiences refused what a workflow returned."""


def check_experiences(exps: Any, task: Task) -> list[Experience]:
    """A workflow's output, or ValueError if it is not a non-empty list of sound Experiences, at most repeat_times
    responses (a multi-turn episode's turns, which share info["episode"], are one response)."""
    if not isinstance(exps, list) or not exps or not all(isinstance(e, Experience) for e in exps):
        raise BadOutput(f"workflow {task.workflow} returned {type(exps).__name__}, not a non-empty list of Experience")
    runs = len({x.info["episode"] if "episode" in x.info else ("row", i) for i, x in enumerate(exps)})
    if runs > task.repeat_times:  # NOTE: more would make a bigger group than GRPO's advantages and the step expect
        raise BadOutput(
            f"workflow {task.workflow} returned {runs} responses for a task of repeat_times {task.repeat_times}"
        )
    for e in exps:
        n = len(e.tokens)
        if e.tokens.dim() != 1 or not 0 <= e.prompt_length <= n:
            raise BadOutput(f"workflow {task.workflow}: bad tokens/prompt_length ({n}, {e.prompt_length})")
        if e.logprobs is not None and len(e.logprobs) != n - e.prompt_length:
            raise BadOutput(
                f"workflow {task.workflow}: {len(e.logprobs)} logprobs for {n - e.prompt_length} response tokens"
            )
        if e.reward is None or not math.isfinite(e.reward):
            raise RewardError(f"workflow {task.workflow}: reward {e.reward!r} is not a finite number")
    return exps


MAX_ABANDONED = 16
"""Workflow threads abandoned at their timeout and still running (a Python thread cannot be killed) past which a
timed-out task is not retried: each retry of a workflow stuck in a loop would leave one more thread taking the
GIL from the engine and the other tasks (rollout/abandoned_threads counts them)."""
_abandoned: list[threading.Thread] = []  # run_task's, under _abandoned_lock (runner threads add to it at once)
_abandoned_lock = threading.Lock()


def abandoned(thread: threading.Thread | None = None) -> int:
    """How many abandoned workflow threads still run (run_task's), after adding `thread`."""
    with _abandoned_lock:
        _abandoned[:] = [t for t in _abandoned if t.is_alive()] + ([thread] if thread else [])
        return len(_abandoned)


def reason_of(e: Exception) -> str:
    """The Drop reason of a workflow attempt's exception."""
    if isinstance(e, RewardError):
        return "reward"
    if isinstance(e, PromptTooLong):
        return "prompt_too_long"
    return "output" if isinstance(e, BadOutput) else "workflow"


def attempt(task: Task, handle: EngineHandle, timeout: float, box: dict[str, Any]) -> None:
    """One attempt of the task's workflow (a runner's thread): box["exps"], or box["error"] (a Drop). Its reward
    calls in worker processes end at the attempt's deadline (workflows.reward_deadline)."""
    workflows.ATTEMPT.deadline = time.monotonic() + timeout
    try:
        box["exps"] = check_experiences(build_workflow(task, handle).run(), task)
    except BaseException as e:  # noqa: BLE001 - any failure of user code (sys.exit too) is reported, never raised
        box["error"] = Drop(f"{type(e).__name__}: {e}", reason_of(e))


def run_task(task: Task, handle: EngineHandle, timeout: float, retries: int) -> tuple[list[Experience] | None, str]:
    """Run a task's workflow with a timeout per attempt and retries: (experiences, "") or (None, why: a Drop)."""
    error = Drop("", "")
    for k in range(retries + 1):
        box: dict[str, Any] = {}  # NOTE: this attempt's box: an abandoned attempt ending late writes into its own
        # NOTE: daemon thread: a hung workflow is abandoned here and cannot block the exit (`leave`).
        worker = threading.Thread(
            target=attempt, args=(task, handle, timeout, box), daemon=True, name=f"workflow-{task.task_id}"
        )
        worker.start()
        worker.join(timeout)
        if getattr(handle, "api", None) is not None:  # the attempt's API sessions end with it, however it ended
            handle.api.drop(worker.ident)
        error = box.get("error", Drop("", ""))
        if worker.is_alive():
            n = abandoned(worker)
            error = Drop(f"timed out after {timeout:g} s (its thread runs on, abandoned: {n} such now)", "timeout")
        if not error:
            return box["exps"], ""
        log.warning("task %s attempt %d/%d failed (%s): %s", task.task_id, k + 1, retries + 1, error.reason, error)
        if error.reason == "prompt_too_long":  # the same input fails the same way: not retried
            break
        if error.reason == "timeout" and abandoned() >= MAX_ABANDONED:
            log.warning("task %s: not retried: %d workflow threads abandoned already", task.task_id, MAX_ABANDONED)
            break
    return None, error


def run_tasks(pool: ThreadPoolExecutor, tasks: list[Task], handles: list[EngineHandle], cfg: configs.Config) -> list:
    """Run tasks concurrently on the runner pool; [(task, experiences or None, error)] in task order."""
    e = cfg.explorer
    futures = [
        pool.submit(run_task, t, handles[i % len(handles)], e.max_timeout, e.max_retry_times)
        for i, t in enumerate(tasks)
    ]
    return [(t, *f.result()) for t, f in zip(tasks, futures)]


# --- evaluation (the metrics of a step or an evaluation: monitor.rollout_metrics, monitor.eval_metrics)


def evaluate(
    pool: ThreadPoolExecutor,
    handles: list[EngineHandle],
    cfg: configs.Config,
    eval_sets: list[tuple[Any, list[Task]]],
    prefix: str = "eval",
) -> dict[str, float]:
    """Run every eval taskset (each task repeat_times times) and return its metrics."""
    start, out, tokens = time.monotonic(), {}, 0
    for ts, tasks in eval_sets:
        results = run_tasks(pool, tasks, handles, cfg)
        tokens += sum(x.response_length for _, got, _ in results if got for x in got)
        out.update(eval_metrics(ts.name, results, ts.repeat_times, prefix, cfg.monitor.detailed_stats))
    seconds = time.monotonic() - start
    out.update({f"time/{prefix}": seconds, f"{prefix}/tokens_per_s": tokens / seconds if seconds else 0.0})
    return out


# --- state and weights


def stamp(exps: list[Experience], task: Task, explorer: str) -> None:
    """What the runner, not the workflow, owns: ids and provenance."""
    for run_id, x in enumerate(exps):
        x.group_id, x.run_id, x.task_id, x.explorer = (
            f"{explorer}/{task.epoch}/{task.task_id}" + (f"@{task.read_at}" if task.read_at >= 0 else ""),
            run_id,
            task.task_id,
            explorer,
        )
        x.info.update(epoch=task.epoch, taskset=task.taskset, index=task.index)
        if task.prompt_cut:  # cut by characters as it was read (tasksets.prompt_bound): no loss, as the engine's cut
            x.truncate_status = "prompt_truncated"


def base_weights(cfg: configs.Config) -> str:
    """model.model_path; with LoRA from a saved adapter (model.lora_configs[0].path), an HF folder of the two merged
    (<job dir>/lora_start/<explorer name>, written here): the policy the trainer starts from, for engines that take
    plain weights (the HF engine, bench and debug modes; vLLM engines serving the adapter: `rollout_engines`)."""
    saved = cfg.model.lora_configs[0].path if cfg.model.lora_configs else ""
    if not saved:
        return cfg.model.model_path
    folder = Path(cfg.checkpoint_job_dir, "lora_start", cfg.explorer.name)
    log.info(
        "LoRA from the saved adapter %s: the engine starts from it merged into %s (%s)",
        saved,
        cfg.model.model_path,
        folder,
    )
    return str(lora.merged_folder(load_model(cfg.model.model_path), saved, config_tokenizer(cfg.model), folder))


def rollout_engines(cfg: configs.Config) -> tuple[Any, int]:
    """The rollout engines on the newest published weights, or on the starting ones (sync.start_engine): (engines,
    their version). With a LoRA adapter that vLLM serves (sync.serves_adapter): engines on the base, model.model_path,
    with enable_lora (vllm_engine.lora_args), the adapter loaded in place: the newest published one (sync.adapter_path),
    else the saved one training starts from (lora_configs[0].path), else a new one's (lora.zero_adapter, written in
    <job dir>/lora_start/<explorer name>: the base exactly, as the trainer's new adapter)."""
    rm = cfg.explorer.rollout_model

    def make(path: str, lora: dict | None = None) -> Any:
        return make_engine(rm, path, rm.max_model_len, cfg.model.repetition_penalty, cfg.cluster.colocate, lora=lora)

    if not sync.serves_adapter(cfg):
        return sync.start_engine(cfg, base_weights(cfg), make)
    import vllm_engine

    c = cfg.model.lora_configs[0]

    def served(folder: str) -> Any:
        engine = make(cfg.model.model_path, {"name": c.name or "policy", **vllm_engine.lora_args(cfg.model, folder)})
        try:
            engine.load_weights(folder, version=0)
        except BaseException:
            engine.close()
            raise
        log.info("LoRA: the engines serve the adapter %s on %s", folder, cfg.model.model_path)
        return engine

    new = Path(cfg.checkpoint_job_dir, "lora_start", cfg.explorer.name)
    return sync.start_engine(cfg, c.path or str(lora.zero_adapter(cfg.model.model_path, c, new)), served)


def runners(cfg: configs.Config) -> int:
    """Workflow runner threads: runner_per_model per engine, or (unset) enough for every task of a step."""
    e = cfg.explorer
    return e.runner_per_model * e.rollout_model.engine_num if e.runner_per_model else max(cfg.buffer.batch_size, 256)


# --- main


@dataclasses.dataclass
class Explorer:
    """What set-up builds; the step's phases use it."""

    cfg: configs.Config
    db: ExperienceDB
    reader: TaskReader  # the training tasksets, at the saved position
    step: int  # the last finished step
    engine: Any  # engines.HFEngine, or vllm_engine.EnginePool (of VLLMEngine / AsyncVLLMEngine)
    sync: sync.ExplorerSync  # the weight handshake with the trainer: resume, the sync points, close
    handles: list[EngineHandle]
    pool: ThreadPoolExecutor  # the workflow runners
    monitor: Monitor
    eval_sets: list[tuple[Any, list[Task]]]
    steps: int  # the last step (the tasksets may run out before it with dynamic sampling: reader.exhausted)
    gen_batches: int  # the most batches of tasks a step runs: 1, or dynamic sampling's max_num_gen_batches
    pipeline: ExperiencePipeline | None = None  # data_processor.experience_pipeline's operators (None: none)


def set_up(cfg: configs.Config) -> Explorer:
    """DB and saved position, engine (with the newest published weights), runners, monitor, eval tasks."""
    name, e, b = cfg.explorer.name, cfg.explorer, cfg.buffer
    monitor = Monitor(cfg, role=name)  # first: it opens the log file that set-up's records go to
    # --- the task pipeline (data_processor.task_pipeline): the first training taskset reads its output from here on
    cfg, pipeline_metrics = with_task_pipeline(cfg, run_tasks)
    b = cfg.buffer  # NOTE: after the task pipeline: its tasksets are the ones read below
    if pipeline_metrics:
        monitor.log(pipeline_metrics, step=0)
    check_tasksets(cfg)
    os.environ.update(e.env_vars)
    db = ExperienceDB(b.trainer_input.experience_buffer.path)
    lease.hold(db, "explorer", name)  # one explorer per name (lease.py): before its saved position is read
    tokenizer = config_tokenizer(cfg.model)
    db.check_identity(fingerprint(cfg.model.model_path, tokenizer), f"explorer {name}")
    db.check_advantages(advantage_origin(cfg.algorithm), f"explorer {name}")
    reader = TaskReader(b.explorer_input.tasksets, 10**9 if b.total_steps else b.total_epochs, prompt_bound(cfg.model))
    saved, step = db.explorer_states().get(name), 0
    if saved:
        reader.load_state(saved["reader"])
        step = saved["step"]
        log.info("resuming explorer %s after step %d (epoch %d, task %d)", name, step, reader.epoch, reader.index)
    models: dict[str, Any] = {}  # the experience pipeline's model handles: the auxiliary models', once they start
    pipeline = experience_pipeline(cfg, models, saved)  # before the engines: a bad operator is refused at once
    engine, version = rollout_engines(cfg)
    engine.model_version = version
    if e.partial_rollout:  # the engines' weight updates keep the requests in flight (configs/checks: vllm_async only)
        engine.in_flight_updates = True
    handles = [with_extras(cfg, rollout_handle(cfg, engine, tokenizer))]
    models.update(handles[0].auxiliary)  # NOTE: the pipeline's Context.models, filled now that the engines are up
    return Explorer(
        cfg=cfg,
        db=db,
        reader=reader,
        step=step,
        engine=engine,
        sync=sync.ExplorerSync(cfg, db, engine),
        handles=handles,
        pool=ThreadPoolExecutor(max_workers=runners(cfg), thread_name_prefix="runner"),
        monitor=monitor,
        eval_sets=[(ts, load_tasks(ts, True, prompt_bound(cfg.model))) for ts in b.explorer_input.eval_tasksets],
        steps=total_steps(b, len(reader)),
        gen_batches=gen_batches(cfg.algorithm),
        pipeline=pipeline,
    )


def experience_pipeline(cfg: configs.Config, models: dict[str, Any], saved: dict | None) -> ExperiencePipeline | None:
    """data_processor.experience_pipeline's operators, built (a bad name or argument: a ConfigError now, before any
    rollout), with the cumulative counts saved with the last written step; None without operators."""
    if not cfg.data_processor.experience_pipeline.operators:
        return None
    pipeline = ExperiencePipeline(cfg, models)
    pipeline.load_state((saved or {}).get("pipeline"))
    return pipeline


def with_extras(cfg: configs.Config, handle: EngineHandle) -> EngineHandle:
    """The rollout handle's extras: explorer.auxiliary_models' engines (handle.auxiliary, by name), and with
    explorer.rollout_model.enable_openai_api the OpenAI-compatible API over it (openai_api.py), for workflows that
    call `handle.openai_client()`; its model name is model.model_path (as vLLM's server names it)."""
    handle.auxiliary = auxiliary_handles(cfg)
    rm = cfg.explorer.rollout_model
    if rm.enable_openai_api:
        # NOTE: imported here: fastapi and uvicorn cost ~0.5 s of CPU at import, for the explorers that serve the API
        from openai_api import OpenAIServer

        handle.api = OpenAIServer(
            handle,
            cfg.model.model_path,
            record=rm.enable_history,
            host=rm.openai_api_host,
            port=rm.openai_api_port,
            api_key=rm.openai_api_key,
        )
        log.info(
            "explorer %s: OpenAI-compatible API at %s/v1 (model %r, history %s)",
            cfg.explorer.name,
            handle.api.start(),
            cfg.model.model_path,
            "on" if rm.enable_history else "off",
        )
    return handle


def run_batch(x: Explorer, tasks: list[Task]) -> list:
    """Run tasks on the runners: [(task, its experiences stamped, or None, error)] in task order; with an experience
    pipeline, the experiences it keeps (a task whose whole group it dropped: [], not None: `piped`)."""
    results = run_tasks(x.pool, tasks, x.handles, x.cfg)
    for task, got, err in results:
        if got is None:
            log.error("task %s dropped after %d attempts: %s", task.task_id, x.cfg.explorer.max_retry_times + 1, err)
        else:
            stamp(got, task, x.cfg.explorer.name)
    feed_back(x, results)  # NOTE: first: the selectors learn from the raw rewards, before a filter or a reshaping
    if x.pipeline is not None:  # NOTE: before the advantages: step_wise_grpo's must see the shaped rewards
        results = piped(x.pipeline, results)
    for _, got, _ in results:
        if got:
            group_advantages(got, x.cfg.algorithm)  # step_wise_grpo's, over the task's whole group (batching.py)
    return results


def piped(pipeline: ExperiencePipeline, results: list) -> list:
    """The batch's experiences through the experience pipeline, back in their tasks' results by group_id (a task
    whose whole group it dropped gets []: no group, which dynamic sampling refills and refill does not)."""
    kept, _ = pipeline.run([exp for _, got, _ in results if got for exp in got])
    by_group: dict[str, list[Experience]] = {got[0].group_id: [] for _, got, _ in results if got}
    for exp in kept:
        if exp.group_id not in by_group:
            raise DataError(
                f"the experience pipeline returned an experience of group {exp.group_id!r}, not of the batch"
            )
        by_group[exp.group_id].append(exp)
    return [(task, by_group[got[0].group_id] if got else got, err) for task, got, err in results]


def feed_back(x: Explorer, results: list) -> None:
    """Each task's group of raw rewards to the task selectors (TaskReader.feedback: difficulty_based's pass-rate
    estimate), once per batch of tasks run: the step's first batch, each refill and dynamic-sampling batch. Before
    any filter, so that a group that all failed still counts; a task that failed (no experiences) gives nothing.
    NOTE: the reader's state, saved with the step, includes it: a restart resumes the estimate, never re-feeds it."""
    x.reader.feedback([(task, [e.reward for e in got]) for task, got, _ in results if got])


def rollout(x: Explorer, tasks: list[Task]) -> tuple[list[Experience], dict[str, float]]:
    """Run the step's tasks on the runners, and more in place of the dropped ones (`refill`; with dynamic sampling,
    `fill_groups`); the experiences to write, stamped, and the rollout metrics (of every task run: failed_count, the
    tasks that failed; and rollout/refilled_tasks, missing_tasks: the extra tasks run, the groups the step lacks)."""
    start = time.monotonic()
    results = ran = run_batch(x, tasks)
    more: dict[str, float] = {}
    if x.gen_batches > 1:
        results, ran, more = fill_groups(x, results)
    else:
        results, ran = refill(x, results)
    written = [r for r in results if r[1]]
    metrics = rollout_metrics(ran, time.monotonic() - start) | more | {"rollout/abandoned_threads": abandoned()}
    metrics |= {
        "rollout/refilled_tasks": len(ran) - len(tasks),
        "rollout/missing_tasks": max(x.cfg.buffer.batch_size - len(written), 0),
    }
    if x.pipeline is not None:
        metrics |= pipeline_metrics(x, ran)
    return [exp for _, got, _ in written for exp in got], metrics


def pipeline_metrics(x: Explorer, ran: list) -> dict[str, float]:
    """The experience pipeline's metrics of the step, and the groups it dropped whole (logged): with dynamic sampling
    they were missing groups, refilled as the tied ones are (fill_groups); without it the step is short by them
    (refill runs more tasks only for failed ones; the trainer takes a short step as it is: sync.holds)."""
    gone = sum(got == [] for _, got, _ in ran)
    refilled = x.gen_batches > 1
    if gone:
        log.warning(
            "step %d: the experience pipeline dropped the whole group of %d task(s); %s",
            x.step + 1,
            gone,
            "dynamic sampling counts them as missing groups (more tasks run, up to max_num_gen_batches)"
            if refilled
            else "the step is short by them (not refilled; with dynamic sampling they would be)",
        )
    return x.pipeline.step_metrics() | {
        "pipeline/dropped_groups": gone,
        "pipeline/dropped_groups_refilled": gone if refilled else 0,
    }


def refill(x: Explorer, results: list) -> tuple[list, list]:
    """Tasks read and run in place of the step's dropped ones (a workflow failed or timed out after its retries, a
    prompt too long), up to explorer.max_refill_rounds rounds, each as many as are still missing: (the results to
    write, in reading order; every result run). The dropped tasks were read (the saved position moves past them and
    the extra ones), so a restart neither repeats nor skips a task. NOTE: a step may still end short (the rounds
    spent, the tasksets run out): the trainer takes it as it is (sync.holds)."""
    ran = list(results)
    for _ in range(x.cfg.explorer.max_refill_rounds):
        missing = len(results) - sum(got is not None for _, got, _ in ran)
        more = x.reader.read(missing) if missing > 0 else []
        if not more:
            break
        log.warning("step %d: %d task(s) dropped; running %d more in their place", x.step + 1, missing, len(more))
        ran += run_batch(x, more)
    return [r for r in ran if r[1] is not None], ran


def varied(got: list[Experience] | None) -> bool:
    """A group (a task's experiences) whose rewards do not all tie: GRPO's advantages are not all zero. A group of
    one experience never ties; a failed task (None) has no group."""
    return bool(got) and not tied_groups([x.group_id for x in got], [x.reward for x in got])


def fill_groups(x: Explorer, results: list) -> tuple[list, list, dict[str, float]]:
    """DAPO's dynamic sampling, the explorer's side (algos/sample.py): run more tasks, each batch as many as the
    groups still missing, until the step has buffer.batch_size groups whose rewards do not all tie, running at most
    max_num_gen_batches batches. (The results to write: those groups in reading order, filled up with tied ones at
    the cap; every result run; the rollout/dynamic_sampling/* metrics.) Tied groups not written are dropped: their
    tasks were read (the saved position moves past them), so a restart neither repeats nor skips them."""
    want, ran, batches = x.cfg.buffer.batch_size, list(results), 1
    while (missing := want - sum(varied(got) for _, got, _ in ran)) > 0 and batches < x.gen_batches:
        more = x.reader.read(missing)
        if not more:  # the tasksets ran out
            break
        ran += run_batch(x, more)
        batches += 1
    keep = [r for r in ran if varied(r[1])]
    tied = [r for r in ran if r[1] and not varied(r[1])]
    fill = tied[: want - len(keep)]
    if len(keep) < want:
        why = "the tasksets ran out" if batches < x.gen_batches else "max_num_gen_batches reached"
        log.warning(
            "dynamic sampling: step %d has %d of %d groups with reward variance after %d batches of tasks "
            "(%d extra tasks): %s; %d tied groups fill it (zero advantage)",
            x.step + 1,
            len(keep),
            want,
            batches,
            len(ran) - len(results),
            why,
            len(fill),
        )
    chosen = {id(r) for r in keep + fill}
    return (
        [r for r in ran if id(r) in chosen],
        ran,
        {
            "rollout/dynamic_sampling/num_gen_batches": batches,
            "rollout/dynamic_sampling/extra_tasks": len(ran) - len(results),
            "rollout/dynamic_sampling/dropped_groups": len(tied) - len(fill),
            "rollout/dynamic_sampling/tied_groups_kept": len(fill),
            "rollout/dynamic_sampling/cap_hit": float(len(keep) < want and batches >= x.gen_batches),
        },
    )


def write(x: Explorer, exps: list[Experience], last: bool = False) -> None:
    """The step's experiences and the explorer's position, in one DB transaction (and <name>_meta.json). The state
    also records how many experiences the step wrote and the weights version the explorer waits for after it
    (sync.sync_wait; 0 after its `last` step): what tells the trainer that a short step is all it will get."""
    sync.pause_for_test("explore.before_write", x.step)
    name = x.cfg.explorer.name
    state = {
        "step": x.step,
        "reader": x.reader.state(),
        "model_version": x.engine.model_version,
        "time": time.time(),
        "finished": False,
        "written": len(exps),
        "sync_wait": 0 if last else sync.sync_wait(x.step, x.cfg, x.engine.model_version),
    }
    if x.pipeline is not None:  # its cumulative counts, in the same transaction as the step they count
        state["pipeline"] = x.pipeline.state()
    x.db.write(exps, explorer=(name, state))
    meta = Path(x.cfg.checkpoint_job_dir, f"{name}_meta.json")
    try:  # for people and tools: the DB holds the position a restart reads
        sync.write_atomic(meta, lambda p: Path(p).write_text(json.dumps({"latest_iteration": x.step, **state})))
    except OSError as e:  # e.g. a full disk under the job folder: the step is in the DB, nothing is lost
        log.warning("could not write %s (%s); the explorer's position is in the DB", meta, e)


def joined(x: Explorer, behind: concurrent.futures.Future | None, step: int) -> tuple[int | None, dict[str, float]]:
    """The sync point after step `step`: `behind`'s result (explorer.partial_rollout: it ran while the next step's
    rollout did), or without one x.sync.after_step(step) run now. (None to go on, or the exit code to stop with;
    its metrics and time/sync_idle: the seconds the explorer waited here, generating nothing.)"""
    start = time.monotonic()
    stop, metrics = behind.result() if behind is not None else x.sync.after_step(step)
    return stop, {**metrics, "time/sync_idle": time.monotonic() - start}


def finish(x: Explorer, code: int) -> int:
    """Mark the explorer finished (the trainer stops waiting for more once every explorer has), close up."""
    name = x.cfg.explorer.name
    if code == 0:
        x.db.set_explorer_state(
            name, {**x.db.explorer_states().get(name, {}), "step": x.step, "time": time.time(), "finished": True}
        )
    x.sync.close()
    x.monitor.close(failed=code != 0)
    x.pool.shutdown(wait=False, cancel_futures=True)
    for handle in x.handles:
        if handle.api is not None:
            handle.api.stop()
    close_engines(x.handles)  # vLLM's: in order, within a bound, before the lease (the GPU is free for the next)
    lease.release(x.db)  # another explorer of this name may start now
    log.info("explorer %s finished at step %d; %s", name, x.step, x.db.counts())
    return code


# --- main


def explore(cfg: configs.Config) -> int:
    """Explore mode (and the explorer half of mode both); returns the exit code."""
    x = set_up(cfg)
    try:
        return explore_steps(x, cfg)
    except BaseException:
        # NOTE: an error (a bad operator, the DB) leaves through launch.run_in_process, which closes the monitor and
        # the lease; the workflow pool and the engines' threads close here, so that a run in a test's own process
        # (tests/entry.py) leaves none running behind it, as a process's exit would
        x.pool.shutdown(wait=False, cancel_futures=True)
        close_engines(x.handles)
        raise


def explore_steps(x: Explorer, cfg: configs.Config) -> int:
    """explore's steps, from the explorer `x` set up: rollout, write, sync, eval, log, until the last."""
    x.monitor.total = x.steps
    # --- a restart in mode both: first the weights the interrupted sync point would have given
    if x.step and cfg.mode == "both" and (stop := x.sync.resume(x.step)) is not None:
        return finish(x, stop)
    # --- eval on startup (step 0 only: not again on restart)
    if x.step == 0 and cfg.explorer.eval_on_startup and x.eval_sets:
        x.monitor.log(evaluate(x.pool, x.handles, cfg, x.eval_sets), step=0)
    code, behind = 0, None  # behind: the sync point running while the next step's rollout runs (partial_rollout)
    while x.step < x.steps:
        # --- rollout
        tasks = x.reader.read(cfg.buffer.batch_size)
        if not tasks:
            break
        exps, metrics = rollout(x, tasks)
        metrics |= x.reader.metrics()  # selection/*: the step's picks and the estimate after its feedback
        # --- partial rollout: the step before's sync point ends before this step is written (sync.holds: nothing is
        # written before the weights the explorer waits for)
        if behind is not None:
            (stop, more), behind = joined(x, behind, x.step), None
            metrics |= more
            if stop is not None:  # this step's rollout is not written: a restart runs its tasks again
                code = stop
                break
        # --- write: the step's experiences and the position, in one transaction
        x.step += 1
        last = x.step == x.steps or x.reader.exhausted  # over-sampling (refills, dynamic sampling) may end them first
        write(x, exps, last)
        # --- sync: after step s, the weights it needs (sync.weights_needed): over the group, or published files;
        # colocated, the engine sleeps during the trainer's turn on the GPU; with partial_rollout in the background
        if not last:
            behind = x.sync.after_step_behind(x.step) if cfg.explorer.partial_rollout else None
            if behind is None or (x.eval_sets and x.step % cfg.explorer.eval_interval == 0):  # eval: the new weights
                (stop, more), behind = joined(x, behind, x.step), None
                metrics |= more
                if stop is not None:
                    code = stop
                    break
        # --- eval and log
        if x.eval_sets and (x.step % cfg.explorer.eval_interval == 0 or last):
            metrics.update(evaluate(x.pool, x.handles, cfg, x.eval_sets))
        x.monitor.log(metrics, step=x.step)
    if behind is not None:  # the tasksets ran out behind a sync point: its stop code still counts
        code = joined(x, behind, x.step)[0] or code
    return finish(x, code)


def bench_targets(cfg: configs.Config) -> list[tuple[int, str]]:
    """What bench mode evaluates: (step, weights) of every checkpoint, the newest only with
    bench_on_latest_checkpoint: its HF folder, or a LoRA checkpoint's adapter alone (lora_adapter/, merged when its
    turn comes: `bench_weights`); without any, (0, the starting model)."""
    job = Path(cfg.checkpoint_job_dir)
    found = sync.step_folders(job, f"actor/{lora.ADAPTER_DIR}")
    found |= sync.step_folders(job, "actor/huggingface")  # merged, where there is one
    steps = sorted(found)[-1:] if cfg.explorer.bench_on_latest_checkpoint else sorted(found)
    return [(s, str(found[s])) for s in steps] or [(0, base_weights(cfg))]


@contextlib.contextmanager
def bench_weights(cfg: configs.Config, path: str) -> Iterator[str]:
    """An HF folder of bench_targets' `path`: itself, or for a LoRA adapter, model.model_path with it merged
    (lora.merged_folder) in a temporary folder of the job directory, deleted once the engine has loaded it."""
    if Path(path).name != lora.ADAPTER_DIR:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=".bench-merged-", dir=cfg.checkpoint_job_dir) as tmp:
        log.info("%s: an adapter-only LoRA checkpoint, merged into %s for the evaluation", path, cfg.model.model_path)
        yield str(
            lora.merged_folder(
                load_model(cfg.model.model_path), path, config_tokenizer(cfg.model), Path(tmp, "huggingface")
            )
        )


def bench(cfg: configs.Config) -> int:
    """Evaluate the starting model, or every checkpoint (the newest only with bench_on_latest_checkpoint)."""
    monitor = Monitor(cfg, role=f"{cfg.explorer.name}_bench")  # first: it opens the log file set-up's records go to
    targets = bench_targets(cfg)
    check_tasksets(cfg)
    rm = cfg.explorer.rollout_model
    with bench_weights(cfg, targets[0][1]) as first:
        engine = make_engine(rm, first, rm.max_model_len, cfg.model.repetition_penalty)
    handles = [with_extras(cfg, rollout_handle(cfg, engine, config_tokenizer(cfg.model)))]
    pool = ThreadPoolExecutor(max_workers=runners(cfg), thread_name_prefix="runner")
    eval_sets = [(ts, load_tasks(ts, True, prompt_bound(cfg.model))) for ts in cfg.buffer.explorer_input.eval_tasksets]
    for s, path in targets:
        if s != targets[0][0]:
            with bench_weights(cfg, path) as folder:
                engine.load_weights(folder, version=s)
        metrics = evaluate(pool, handles, cfg, eval_sets, prefix="bench")
        monitor.log(metrics, step=s)
        shown = {k: round(v, 4) for k, v in metrics.items() if "/mean@" in k or "tokens_per_s" in k}
        print(f"bench step {s} ({path}): {json.dumps(shown)}", flush=True)
    monitor.close()
    pool.shutdown(wait=False, cancel_futures=True)
    if handles[0].api is not None:
        handles[0].api.stop()
    close_engines(handles)
    return 0


# --- debug: one task through its workflow, printed; no DB, no trainer, no weight sync, no monitor


def debug(cfg: configs.Config, flags: argparse.Namespace) -> int:
    """`--debug`: run one task (`--task`, its row in file order, of `--taskset`, by default the first training
    taskset, of `--stage`, by default the first stage that runs workflows) through its workflow with the configured
    model (a stage's weights are those an earlier run of its source stage published, as when launched; a line says
    when there are none and the base model runs), or with `--reply TEXT` the canned replies (engines.CannedEngine),
    and print what it did: the tools offered, the tool calls as they run, then the prompt once, each experience's
    turns (the model's tokens and the others), reward, metrics and the row the explorer would write, and the group's
    advantages as the trainer's advantage fn computes them. Returns 1 if the workflow fails (its traceback printed)."""
    stage, weights = debug_stage(cfg, flags.stage)
    ts, task = debug_task(stage, flags.taskset, flags.task)
    check_tasksets(stage)
    tokenizer = config_tokenizer(stage.model)
    rm = stage.explorer.rollout_model
    base = make_engine(rm, base_weights(stage), rm.max_model_len, stage.model.repetition_penalty)
    engine = CannedEngine(base, tokenizer, flags.reply) if flags.reply else base
    handle = with_extras(stage, rollout_handle(stage, engine, tokenizer))
    print(
        f"=== stage {stage.name or '-'}, taskset {ts.name}, task {flags.task} ({task.task_id}): workflow "
        f"{task.workflow}, reward function {task.reward_fn or '(the workflow default)'}, repeat_times "
        f"{task.repeat_times}, model {stage.model.model_path}\n{weights}messages: {json.dumps(task.messages)}\n"
        f"reference: {json.dumps(task.reference, default=str)}",
        flush=True,
    )
    if flags.reply:
        print(
            f"replies (--reply, the k-th answers turn k, the last repeats): {json.dumps(flags.reply)}; their "
            "log-probs are the model's (scored, not sampled)",
            flush=True,
        )
    try:
        exps = debug_run(task, handle)
    finally:  # its engines' threads end with it (a run in a test's own process leaves none: tests/entry.py)
        close_engines([handle])
        if engine is not base:  # --reply: the canned engine's model
            base.close()
    if exps is None:
        return 1
    stamp(exps, task, stage.explorer.name)
    group_advantages(exps, stage.algorithm)
    prompt: list[int] = []
    for k, exp in enumerate(exps):
        same = exp.tokens[: exp.prompt_length].tolist() == prompt
        print(shown_experience(exp, k, len(exps), tokenizer, same, flags.full_rows), flush=True)
        prompt = exp.tokens[: exp.prompt_length].tolist()
    print(shown_advantages(exps, stage), flush=True)
    return 0


def debug_run(task: Task, handle: EngineHandle) -> list[Experience] | None:
    """The task's workflow run once, with the tools it offers printed first and its tool calls as they run (the
    tools' logger at DEBUG, to stdout); None, its traceback printed, if it fails."""
    tools = logging.getLogger("nanorft.tools")  # run_tool's calls (DEBUG) and the tool parser's choice
    shown = logging.StreamHandler(sys.stdout)
    shown.setFormatter(logging.Formatter("  [tools] %(message)s"))
    tools.addHandler(shown)
    tools.setLevel(logging.DEBUG)
    try:
        workflow = build_workflow(task, handle)
        if offered := shown_tools(workflow, task):
            print(offered, flush=True)
        return check_experiences(workflow.run(), task)
    except Exception:  # the user's workflow: its whole traceback is what a debug run is for
        traceback.print_exc(file=sys.stdout)
        return None
    finally:
        tools.removeHandler(shown)
        if handle.api is not None:
            handle.api.stop()


def debug_stage(cfg: configs.Config, name: str) -> tuple[configs.Config, str]:
    """The stage `--stage NAME` names (its full or last name; "": the first) that runs workflows, and a line on the
    weights it starts from when it follows another stage: that stage's last published weights, or, when it has
    published none (not run yet), the base model (launch.stages_in_order then leaves model.model_path as it is)."""
    previous, done, named = None, {}, []
    for spec, stage in zip(cfg.stages or [None], launch.stages_in_order(cfg)):
        source = done[spec.start_from] if spec and spec.start_from else previous
        previous = done[spec.stage_name if spec else ""] = stage
        if name not in ("", stage.name, stage.name.rsplit("/", 1)[-1]):
            continue
        named.append(f"{stage.name}: {stage.mode}")
        if stage.mode not in ("explore", "both", "bench"):
            continue
        if source is None:
            return stage, ""
        if weights := sync.latest_weights(source.checkpoint_job_dir):
            return stage, f"weights: the last that stage {source.name} published ({weights})\n"
        return stage, (
            f"weights: the base model: stage {stage.name} starts from what stage {source.name} publishes, and it has "
            f"published none yet (nothing under {source.checkpoint_job_dir}; run it first to see the trained model)\n"
        )
    raise configs.ConfigError(
        f"--stage {name}: no such stage" if not named else f"--debug: no stage runs workflows ({', '.join(named)})"
    )


def shown_tools(workflow: workflows.Workflow, task: Task) -> str:
    """The tools a tool workflow offers the model (workflow_args.tools and the taskset's format.tools_key schemas,
    as tool_workflow gives them to the chat template): one line each, its name and JSON schema, compact; "" for a
    workflow without tools."""
    schemas = (
        [t.schema() for t in load_tools(tuple(workflow.args.tools))] if isinstance(workflow.args, ToolArgs) else []
    )
    schemas += task.tools or []
    lines = [f"tools offered ({len(schemas)}):"] if schemas else []
    for schema in schemas:
        fn = schema.get("function", schema) if isinstance(schema, dict) else {}
        lines.append(f"  {fn.get('name', '?')}: {json.dumps(fn, separators=(',', ':'))}")
    return "\n".join(lines)


def shown_advantages(exps: list[Experience], cfg: configs.Config) -> str:
    """The group's advantages as the trainer computes them (train.shape_rewards then train.compute_advantages, with
    the configured algorithm.advantage_fn and its args), each experience's mean over its action tokens, and a
    warning when the group's rewards tie. Over this group alone: a batch-wide statistic (std_cal_level batch,
    REINFORCE++'s whitening) is the trainer's over its whole step. The KL penalty (reference log-probs) and the
    pieces that need the trainer's own tensors (a critic's values, old or teacher log-probs) are not computed here:
    a line says so."""
    # NOTE: imported here: train.py's import costs ~1 s of CPU and only --debug needs it in the explorer
    import train

    a = cfg.algorithm
    if a.advantage_fn == "none":
        return f"advantages: none (advantage_fn none: {a.policy_loss_fn} learns without them)"
    fn, args = train.lookup("advantage_fn", a.advantage_fn, a.advantage_fn_args)
    head = f"advantages ({a.advantage_fn} {json.dumps(dataclasses.asdict(args), default=str)}"
    needs = getattr(args, "NEEDS", ())
    if needs:
        return f"{head}): not computed here: it needs {', '.join(needs)}, which the trainer computes"
    no_kl = dataclasses.replace(cfg, algorithm=dataclasses.replace(a, kl_penalty_fn="none"))
    # NOTE: a stand-in for train.Parts with what shape_rewards and compute_advantages read of it (a test runs both)
    parts = types.SimpleNamespace(rl=True, cfg=no_kl, pieces={"advantage_fn": (fn, args)})
    batch = step_batch(exps, cfg.model.max_response_tokens or 0)
    train.shape_rewards(parts, batch)
    train.compute_advantages(parts, batch)
    mask = batch["response_mask"]  # [B,T] (a row the advantage fn drops: empty)
    means = (batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    shown = [
        f"{k + 1}: {m:+.4f}" if mask[k].any() else f"{k + 1}: - (no action tokens)"
        for k, m in enumerate(means.tolist())
    ]
    lines = [f"{head}, each experience's mean over its action tokens): {', '.join(shown)}"]
    if a.kl_penalty_fn != "none":
        lines.append(f"  (without the KL penalty {a.kl_penalty_fn}: it needs the reference model's log-probs)")
    if len(exps) > 1 and len({x.reward for x in exps}) == 1:
        size = batch["advantages"].abs().max().item()
        lines.append(
            f"WARNING: the group's {len(exps)} rewards tie ({exps[0].reward:g}): no response is better than another, "
            "nothing to learn from this group "
            + (
                "(every advantage is 0)"
                if size == 0
                else f"({a.advantage_fn}'s advantages: at most {size:.3g} in size)"
            )
        )
    return "\n".join(lines)


def debug_task(cfg: configs.Config, name: str, index: int) -> tuple[TasksetConfig, Task]:
    """The taskset named `name` (a training or eval taskset; "": the first training taskset, else the first eval
    one) and its task `index` (0-based, file order); a ConfigError naming what is missing."""
    inp = cfg.buffer.explorer_input
    found = [(ts, False) for ts in inp.tasksets] + [(ts, True) for ts in inp.eval_tasksets]
    chosen = next(((ts, ev) for ts, ev in found if ts.name == name or not name), None)
    if chosen is None:
        known = ", ".join(ts.name for ts, _ in found) or "none"
        raise configs.ConfigError(f"--taskset {name}: no such taskset in stage {cfg.name} (its tasksets: {known})")
    tasks = load_tasks(chosen[0], is_eval=chosen[1], bound=prompt_bound(cfg.model))
    if not 0 <= index < len(tasks):
        raise configs.ConfigError(f"--task {index}: taskset {chosen[0].name} has tasks 0 to {len(tasks) - 1}")
    return chosen[0], tasks[index]


def shown_experience(exp: Experience, k: int, n: int, tokenizer: Any, same_prompt: bool, full: bool) -> str:
    """Experience k of n as `--debug` prints it: reward and its components, the prompt (unless `same_prompt`: the
    previous experience's, a group's shared prompt is printed once), the response in runs of tokens in the action mask
    ("action": the model's, trained on) and not ("masked": template text, tool results, and a truncated episode's own
    turns), then the row the explorer would write (the token ids, all of them with `full` (--full-rows), else the
    first and last few and how many are hidden; the other tensors summarised)."""
    response, mask = exp.tokens[exp.prompt_length :].tolist(), exp.action_mask
    acting = [True] * len(response) if mask is None else mask.tolist()
    prompt = f"{json.dumps(tokenizer.decode(exp.tokens[: exp.prompt_length]))}" if not same_prompt else "as above"
    lines = [
        f"--- experience {k + 1} of {n}: reward {exp.reward:g}, {json.dumps(exp.metrics)}",
        f"prompt ({exp.prompt_length} tokens): {prompt}",
        f"response ({len(response)} tokens, {sum(acting)} in the action mask):",
    ]
    start = 0
    for end in range(1, len(response) + 1):
        if end == len(response) or acting[end] != acting[start]:
            who = "action" if acting[start] else "masked"
            lines.append(f"  [{who} {end - start}] {json.dumps(tokenizer.decode(response[start:end]))}")
            start = end
    logprobs = exp.logprobs.tolist() if exp.logprobs is not None else []
    row = {
        **{f: getattr(exp, f) for f in ("group_id", "run_id", "task_id", "explorer", "model_version", "reward")},
        **{"prompt_length": exp.prompt_length, "truncate_status": exp.truncate_status, "info": exp.info},
        "tokens": exp.tokens.tolist() if full else short_ids(exp.tokens.tolist()),
        "logprobs": {"n": len(logprobs), "mean": sum(logprobs) / len(logprobs) if logprobs else None},
        "advantages": None if exp.advantages is None else exp.advantages.tolist()[:1],
    }
    lines.append(f"row: {json.dumps(row, default=str)}")
    return "\n".join(lines)


ROW_IDS = 8  # token ids shown at each end of a row's `tokens` without --full-rows


def short_ids(ids: list[int]) -> list:
    """A row's token ids cut for the console: the first and last ROW_IDS, and between them how many are hidden."""
    if len(ids) <= 3 * ROW_IDS:
        return ids
    return [*ids[:ROW_IDS], f"... {len(ids) - 2 * ROW_IDS} more (--full-rows) ...", *ids[-ROW_IDS:]]


def main(argv: list[str]) -> int:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--debug", action="store_true")
    pre.add_argument("--task", type=int, default=None)
    pre.add_argument("--taskset", default=None)
    pre.add_argument("--stage", default=None)
    pre.add_argument("--reply", action="append", default=None)
    pre.add_argument("--full-rows", action="store_true")
    pre.add_argument("--task-pipeline", action="store_true")
    flags, rest = pre.parse_known_args(argv)
    given = [f"--{k}" for k in ("task", "taskset", "stage", "reply") if getattr(flags, k) is not None]
    given += ["--full-rows"] if flags.full_rows else []
    if given and not flags.debug:
        print(f"{', '.join(given)}: only with --debug", file=sys.stderr)
        return 2
    cfg = configs.entry(rest, DESCRIPTION)
    if flags.debug:
        flags.task, flags.taskset, flags.stage = flags.task or 0, flags.taskset or "", flags.stage or ""
        try:
            return debug(cfg, flags)
        except (configs.ConfigError, DataError) as e:
            print(f"debug: {e}", file=sys.stderr)
            return 2
    if flags.task_pipeline:
        return launch.run_in_process(cfg, {"explore": task_pipeline, "both": task_pipeline}, "task pipeline")
    return launch.run_in_process(cfg, {"bench": bench, "explore": explore, "both": explore}, "explorer")


def task_pipeline(cfg: configs.Config) -> int:
    """--task-pipeline: data_processor.task_pipeline alone, its output written (or found) under the job folder, then
    exit. launch.py runs it before a stage's explorer and trainer start, so that the trainer's wait for its first
    batch (max_read_timeout) never includes it; the explorer then finds the output ready (the same content hash)."""
    with_task_pipeline(cfg, run_tasks)
    return 0


def leave(code: int) -> None:
    """End this process with exit code `code`. NOTE: while workflow threads abandoned at their timeout still run (a
    workflow or an in-thread reward stuck in a loop or a sleep, or waiting on the engine for them), the interpreter's
    teardown aborted ("terminate called without an active exception", SIGABRT: torch torn down under a thread still
    in it), which marked a stage FAILED after all its steps were written. Then the exit hooks run here (atexit's:
    the tool and reward workers killed, vLLM's engines stopped) and the process leaves without the teardown, as
    train.py does. NOTE: from here on SIGTERM is ignored: after a Ctrl-C the launcher also SIGTERMs what the Ctrl-C
    already stops, and the handler's SystemExit, raised inside an exit hook, printed a traceback (it SIGKILLs what is
    left after its grace)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not (n := abandoned()):
        sys.exit(code)
    log.warning("%d workflow thread(s) abandoned at their timeout still run: the explorer exits without them", n)
    atexit._run_exitfuncs()  # NOTE: CPython's own; what the interpreter runs at exit, before its teardown
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


DESCRIPTION = (
    "nanorft explorer. --debug [--task N] [--taskset NAME] [--stage NAME] [--reply TEXT ...] [--full-rows]: run one "
    "task through its workflow (with --reply, canned replies instead of the model's) and print the tools offered, its "
    "turns, tool calls, tokens, reward, the rows it would write and the group's advantages (no DB, no trainer)."
)


if __name__ == "__main__":
    # NOTE: SIGTERM (e.g. the launcher stopping this explorer because its trainer failed) leaves through SystemExit,
    # so the engines close and vLLM's exit hooks stop its engine-core processes. Its default action ended this
    # process alone: they lived on, holding the launcher's output pipe open.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    leave(main(sys.argv[1:]))
