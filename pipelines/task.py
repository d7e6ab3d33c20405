"""The task pipeline (Trinity-RFT's data_processor.task_pipeline): operators over the taskset rows before the
explorer reads them, their result written once as a taskset the first training taskset then reads.

    rows of `inputs` (tasksets.read_rows; empty inputs: the first training taskset's own path / subset / split)
    -> each operator in order (pipelines.build: a built-in, module:attr, file.py:attr); a run of consecutive other
       names goes to Data-Juicer in one call (pipelines.data_juicer.run_rows); then config_path's recipe, if any
    -> <checkpoint_job_dir>/task_pipeline/tasks-<hash>.jsonl (+ tasks-<hash>.json, the manifest: inputs, operators,
       rows in / out and stats per operator, time), written atomically (tmp + fsync + rename).

The hash covers the input files' bytes (a hub dataset: its name, subset and split only), the operators with their
args, target_fields, the recipe's bytes and a user file.py operator's bytes: an unchanged pipeline reuses its file
(logged), a changed one writes a new one. Explorers starting at once compute it once (a lock file, flock).
Deviations from Trinity-RFT: the output path is not configurable (task_pipeline.output is refused by name); the
result is cached by content; score columns are top-level columns of the rows (Data-Juicer keeps them in
`__dj__stats__`), so that a selector's feature_keys reads them as they are.
"""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import configs
from configs.schema import TasksetConfig
from errors import ConfigError, DataError
from pipelines import Context, build
from pipelines.registry import TASK_OPERATORS

log = logging.getLogger("nanorft.pipelines")

WHERE = "data_processor.task_pipeline"
VERSION = 1  # bump when the output of an unchanged pipeline would change (invalidates every cached file)


def active(cfg: configs.Config) -> bool:
    """Whether the run has a task pipeline to run (operators or a Data-Juicer recipe)."""
    tp = cfg.data_processor.task_pipeline
    return bool(tp.operators or tp.config_path)


def sources(cfg: configs.Config) -> list[tuple[str, str | None, str]]:
    """(path, subset_name, split) of each input: `inputs` (a folder's split: the first training taskset's), or the
    first training taskset's own."""
    tp, sets = cfg.data_processor.task_pipeline, cfg.buffer.explorer_input.tasksets
    if not sets:
        raise ConfigError(f"{WHERE}: no training taskset (buffer.explorer_input.tasksets) to hand its output to")
    first = sets[0]
    if not tp.inputs:
        return [(first.path, first.subset_name, first.split)]
    return [(path, None, first.split) for path in tp.inputs]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def input_digests(srcs: list[tuple[str, str | None, str]]) -> list[dict]:
    """What the hash knows of each input: its files' contents; a hub dataset only by name (not local to hash)."""
    from tasksets import find_data_files

    out = []
    for path, subset, split in srcs:
        if Path(path).expanduser().exists():
            files = find_data_files(path, subset, split)
            out.append({"path": path, "files": {str(f): file_digest(f) for f in files}})
        else:
            out.append({"path": path, "subset": subset, "split": split, "hub": True})
    return out


def is_data_juicer(name: str) -> bool:
    """Neither a built-in nor the user's module:attr: a Data-Juicer operator's name. A near miss of a built-in's
    name is a typo, refused by name (Data-Juicer would only say it does not know it)."""
    if name in TASK_OPERATORS or ":" in name:
        return False
    close = difflib.get_close_matches(name, TASK_OPERATORS, n=1, cutoff=0.85)
    if close:
        raise ConfigError(
            f"{WHERE}.operators: unknown operator {name!r}; did you mean {close[0]!r}? Built-in: "
            f"{', '.join(sorted(TASK_OPERATORS))}; your own: module:attr / file.py:attr; else a Data-Juicer "
            "operator's exact name"
        )
    return True


def stages(cfg: configs.Config) -> list[tuple[str, Any]]:
    """The pipeline as run: ("op", (label, index, OperatorConfig)) or ("dj", [label, [{name: args}, ...], open]),
    open: more operator names may join it (not the recipe's run). The labels name the metrics (a user's op: its attr;
    an op used twice: name#2; a Data-Juicer run: data_juicer, data_juicer#2)."""
    tp, out, seen = cfg.data_processor.task_pipeline, [], {}

    def label(name: str) -> str:
        seen[name] = seen.get(name, 0) + 1
        return name if seen[name] == 1 else f"{name}#{seen[name]}"

    for i, spec in enumerate(tp.operators):
        if not spec.name:
            raise ConfigError(f"{WHERE}.operators[{i}]: no name")
        if not is_data_juicer(spec.name):
            out.append(("op", (label(spec.name.rpartition(":")[2]), i, spec)))  # module:attr -> attr
        elif out and out[-1][0] == "dj" and out[-1][1][2]:  # extends the run of Data-Juicer names before it
            out[-1][1][1].append({spec.name: dict(spec.args)})
        else:
            out.append(("dj", [label("data_juicer"), [{spec.name: dict(spec.args)}], True]))
    if tp.config_path:
        out.append(("dj", [label("data_juicer"), recipe_ops(tp.config_path), False]))
    return out


def recipe_ops(path: str) -> list[dict]:
    """The `process:` list of a Data-Juicer recipe (YAML)."""
    import yaml

    try:
        recipe = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{WHERE}.config_path: cannot read {path}: {e}") from None
    ops = recipe.get("process") if isinstance(recipe, dict) else None
    if not isinstance(ops, list) or not ops:
        raise ConfigError(f"{WHERE}.config_path: {path} has no `process:` list of Data-Juicer operators")
    return ops


def pipeline_hash(cfg: configs.Config, srcs: list) -> tuple[str, dict]:
    """The cache key and what it covers (kept in the manifest): the inputs' bytes, the operators and their args, the
    text fields, the recipe's and a file.py operator's bytes, and the first training taskset's config."""
    tp = cfg.data_processor.task_pipeline
    ops = [{"name": o.name, "args": o.args} for o in tp.operators]
    user_files = {o.name: file_digest(Path(o.name.rpartition(":")[0])) for o in tp.operators if ".py:" in o.name}
    recipe = file_digest(Path(tp.config_path)) if tp.config_path else ""
    key = {
        "version": VERSION,
        "inputs": input_digests(srcs),
        "operators": ops,
        "target_fields": target_fields(cfg),
        "config_path": [tp.config_path, recipe],
        "user_files": user_files,
        # what an operator that runs the tasks reads of them (pass_rate_filter: workflow, reward function, their
        # args, the format), so that a changed reward recomputes
        "taskset": dataclasses.asdict(cfg.buffer.explorer_input.tasksets[0]),
    }
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], key


def target_fields(cfg: configs.Config) -> list[str]:
    """The text columns (Data-Juicer's text_keys): target_fields, or the first taskset's prompt_key."""
    tp = cfg.data_processor.task_pipeline
    return list(tp.target_fields) or [cfg.buffer.explorer_input.tasksets[0].format.prompt_key]


def read_inputs(srcs: list) -> list[dict]:
    from tasksets import read_rows

    return [row for path, subset, split in srcs for _, _, row in read_rows(path, subset, split)]


def run_stage(kind: str, what: Any, rows: list[dict], ops: dict, cfg: configs.Config) -> tuple[list, dict]:
    """One operator (or one Data-Juicer run) over the rows: (kept rows, its own stats)."""
    if kind == "op":
        label, _, _ = what
        kept, stats = ops[label].process(rows)
        return list(kept), dict(stats or {})
    from pipelines.data_juicer import run_rows

    tp = cfg.data_processor.task_pipeline
    kept, stats = run_rows(rows, what[1], target_fields(cfg), tp.num_process)
    return list(kept), dict(stats or {})


def run_all(cfg: configs.Config, rows: list[dict], ops: dict) -> tuple[list[dict], list[dict]]:
    """Every stage in order; (rows left, per stage {label, rows_in, rows_out, stats}). No row left: a DataError
    naming the operator that dropped the last ones."""
    report = []
    for kind, what in stages(cfg):
        label = what[0]
        start, n_in = time.monotonic(), len(rows)
        rows, stats = run_stage(kind, what, rows, ops, cfg)
        report.append({"label": label, "rows_in": n_in, "rows_out": len(rows), "stats": stats})
        log.info(
            "task pipeline: %s kept %d of %d rows (%.1f s)%s",
            label,
            len(rows),
            n_in,
            time.monotonic() - start,
            f" {json.dumps(stats, default=str)}" if stats else "",
        )
        if not rows:
            raise DataError(
                f"{WHERE}: operator {label!r} dropped the last {n_in} row(s): no task left to explore; loosen its "
                "bounds (min_score / max_score) or check its inputs"
            )
    return rows, report


def metrics(report: list[dict]) -> dict[str, float]:
    """pipeline/task/<op>/kept, .../dropped, .../<its stat> (numbers only)."""
    out = {}
    for r in report:
        p = f"pipeline/task/{r['label']}"
        out[f"{p}/kept"], out[f"{p}/dropped"] = float(r["rows_out"]), float(r["rows_in"] - r["rows_out"])
        out.update({f"{p}/{k}": float(v) for k, v in r["stats"].items() if isinstance(v, (int, float))})
    return out


def write_atomic(path: Path, text_lines: Any) -> None:
    """Write the lines to path.tmp, fsync, rename over `path`, fsync the folder: a crash leaves the old file or
    none, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in text_lines:
            fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_ops(cfg: configs.Config, models: dict, run_tasks: Any = None) -> dict[str, Any]:
    """The pipeline's own operators by label, built before anything runs: an unknown name or argument fails at
    start, cached result or not. `models` (shared, filled only when the pipeline runs) is their Context's."""
    ops = {}
    for kind, what in stages(cfg):
        if kind == "op":
            label, i, spec = what
            ops[label] = build(spec, TASK_OPERATORS, Context(cfg, models, f"{WHERE}.operators[{i}]", run_tasks))
    return ops


def compute(cfg: configs.Config, srcs: list, ops: dict, models: dict) -> tuple[list[dict], list[dict]]:
    """Read the inputs and run the stages, with the auxiliary models up only while they run."""
    from engines import EngineHandle, auxiliary_handles

    rows = read_inputs(srcs)
    if not rows:
        raise DataError(f"{WHERE}: the inputs {[s[0] for s in srcs]} have no rows")
    if ops and cfg.explorer.auxiliary_models:
        models.update(auxiliary_handles(cfg))
    try:
        return run_all(cfg, rows, ops)
    finally:
        for handle in models.values():
            if isinstance(handle, EngineHandle) and hasattr(handle.engine, "close"):
                handle.engine.close()
        models.clear()


def run_task_pipeline(cfg: configs.Config, run_tasks: Any = None) -> tuple[TasksetConfig, dict[str, float]]:
    """The first training taskset reading the pipeline's output (computed now, or reused), and the pipeline's
    metrics (pipeline/task/...). Call only when active(cfg)."""
    srcs, models = sources(cfg), {}
    ops = build_ops(cfg, models, run_tasks)
    digest, key = pipeline_hash(cfg, srcs)
    folder = Path(cfg.checkpoint_job_dir, "task_pipeline")
    folder.mkdir(parents=True, exist_ok=True)
    out, manifest = folder / f"tasks-{digest}.jsonl", folder / f"tasks-{digest}.json"
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: held to the end: a second explorer waits, then reuses the file
        if out.exists() and manifest.exists():
            report = json.loads(manifest.read_text())["operators"]
            log.info("task pipeline: unchanged (hash %s): reusing %s (%d rows)", digest, out, report[-1]["rows_out"])
        else:
            log.info("task pipeline: running %d stage(s) over %s -> %s", len(stages(cfg)), [s[0] for s in srcs], out)
            start = time.time()
            rows, report = compute(cfg, srcs, ops, models)
            about = {"hash": digest, "key": key, "operators": report, "rows": len(rows), "time": start}
            about["seconds"] = time.time() - start
            write_atomic(manifest, [json.dumps(about, indent=1, default=str) + "\n"])
            write_atomic(out, (json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))
    first = cfg.buffer.explorer_input.tasksets[0]
    log.info("task pipeline: taskset %s reads %s instead of %s", first.name, out, first.path)
    return dataclasses.replace(first, path=str(out), subset_name=None), metrics(report)


def with_task_pipeline(cfg: configs.Config, run_tasks: Any = None) -> tuple[configs.Config, dict[str, float]]:
    """`cfg` with its first training taskset replaced by the task pipeline's output, and the pipeline's metrics;
    `cfg` itself and {} without a task pipeline. The one place the explorer's tasksets change (explore.set_up, which
    hands over its `run_tasks` for the operators that run workflows: pipelines.Context)."""
    if not active(cfg):
        return cfg, {}
    first, numbers = run_task_pipeline(cfg, run_tasks)
    tasksets = [first, *cfg.buffer.explorer_input.tasksets[1:]]
    explorer_input = dataclasses.replace(cfg.buffer.explorer_input, tasksets=tasksets)
    buffer = dataclasses.replace(cfg.buffer, explorer_input=explorer_input)
    return dataclasses.replace(cfg, buffer=buffer), numbers
