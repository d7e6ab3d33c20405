"""Data-Juicer operators (py-data-juicer) in both pipelines, run for real in Data-Juicer's own virtualenv.

Why a separate process: py-data-juicer 1.6.1 pins dill==0.3.8, multiprocess==0.70.16 and emoji==2.2.0, older than the
project's venv holds (dill 0.4.1, multiprocess 0.70.19, which its other packages require): it cannot share the
environment without downgrading the project's. So, as Trinity-RFT runs it as a service, it lives in `.venv-dj` at the
repo root (`bash run.sh dj` sets it up; `bash run.sh test` too) and each call here runs pipelines/dj_worker.py there:

    rows --JSONL--> tmp/in.jsonl -> dj_worker.py run tmp/recipe.json (DefaultExecutor) -> tmp/out/out.jsonl --> rows

The recipe is a Data-Juicer config: `process` (the operators, [{op_name: {args}}]), `np`, `text_keys`, plus the I/O
keys set here (dataset_path, export_path, work_dir; keep_stats_in_res_ds: true, use_cache: false). Stats that
Data-Juicer's filters compute come back under `__dj__stats__`; rows its filters drop do not come back.

Two entry points:
- run_rows(rows, ops, target_fields, np, config_path): the task pipeline's Data-Juicer step over taskset rows; the
  stats are flattened onto the rows (`text_len` beside `question`).
- ExperienceDataJuicer (registry name `data_juicer`): the experience pipeline's operator (Trinity's args
  config_path / operators / np); each experience goes as {prompt_text, response_text, reward} (Trinity's field names)
  and its stats land in exp.info[<stat>], where reward_shaping_mapper's stats_key reads them.

Costs and limits: one worker process per call (~3-8 s of start-up and Data-Juicer's set-up on 2 CPU cores, then the
operators themselves); .venv-dj has no torch, so the operators that load a model (perplexity_filter,
llm_quality_score_filter, ...) fail naming torch; a mapper's change to an experience's text is not applied (its
tokens are what is trained); Data-Juicer drops rows whose text key is empty before any operator runs.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from errors import ConfigError, DataError
from pipelines import Context

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("dj_worker.py")
STATS = "__dj__stats__"  # Data-Juicer's Fields.stats
INDEX = "__nanorft_index__"  # each row's place in the input, to match what comes back
# Recipe keys set here whatever the recipe says: the I/O is the worker's temporary directory
FORCED = ("dataset_path", "dataset", "export_path", "work_dir", "keep_stats_in_res_ds", "use_cache", "ds_cache_dir")


class DataJuicerError(ConfigError):
    """Data-Juicer is missing, or refused or failed on a recipe: its own message, and what to do."""


def venv() -> Path:
    """Where Data-Juicer's virtualenv is: $NANORFT_DJ_VENV, else .venv-dj at the repo root (`bash run.sh dj`)."""
    return Path(os.environ.get("NANORFT_DJ_VENV") or ROOT / ".venv-dj")


def dj_python() -> Path:
    python = venv() / "bin" / "python"
    if not python.exists():
        raise DataJuicerError(
            f"Data-Juicer is not installed: {venv()} has no bin/python. It runs in a virtualenv of its own (its "
            "pins clash with the project's): set it up with `bash run.sh dj` (a minute or two), or point "
            "NANORFT_DJ_VENV at one with py-data-juicer installed"
        )
    return python


def call_worker(args: list[str], workdir: Path, where: str) -> dict[str, Any]:
    """Run dj_worker.py in .venv-dj and return its result; a DataJuicerError with Data-Juicer's message on failure."""
    result = workdir / "result.json"
    # NOTE: -I: the worker sees neither this process's PYTHONPATH nor pipelines/ (a module here could shadow one)
    cmd = [str(dj_python()), "-I", str(WORKER), *args, str(result)]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    try:
        answer = json.loads(result.read_text())
    except (OSError, ValueError):
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        answer = {"error": f"the worker exited with code {proc.returncode} and no result; its last output: {tail}"}
    if "error" not in answer:
        return answer
    if "No module named 'data_juicer'" in answer["error"]:
        raise DataJuicerError(
            f"{where}: {venv()} has no data_juicer ({answer['error']}): set it up with `bash run.sh dj`"
        )
    # one line, as the project's errors are (a process stops on it with that line)
    raise DataJuicerError(f"{where}: Data-Juicer failed: {' '.join(answer['error'].split())}")


@functools.cache
def known_ops(python: str) -> tuple[str, ...]:
    """Data-Juicer's registered operator names, asked of the worker once per venv (`python`: its interpreter)."""
    with tempfile.TemporaryDirectory(prefix="nanorft-dj-") as tmp:
        return tuple(call_worker(["ops"], Path(tmp), "Data-Juicer's operator list")["ops"])


def op_name(op: Any, where: str) -> str:
    if not (isinstance(op, dict) and len(op) == 1 and isinstance(next(iter(op)), str)):
        raise ConfigError(f"{where}: a Data-Juicer operator is one {{op_name: {{args}}}} mapping, not {op!r}")
    return next(iter(op))


def check_ops(ops: list[dict], where: str) -> None:
    """Each operator is a Data-Juicer one: else a DataJuicerError naming the closest names."""
    names = [op_name(op, f"{where}[{i}]") for i, op in enumerate(ops)]
    known = known_ops(str(dj_python()))
    for i, name in enumerate(names):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f" Close names: {', '.join(close)}." if close else ""
            raise DataJuicerError(
                f"{where}[{i}]: {name!r} is not a Data-Juicer operator.{hint} ({len(known)} operators are "
                "registered; Data-Juicer's docs/Operators.md lists them)"
            )


def read_recipe(config_path: str, where: str) -> dict[str, Any]:
    """A Data-Juicer recipe file (YAML): its keys, `process` a list."""
    import yaml

    path = Path(config_path)
    if not path.is_file():
        raise ConfigError(f"{where}: config_path {config_path!r} is not a file (resolved: {path.resolve()})")
    try:
        recipe = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: config_path {config_path}: not YAML: {e}") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("process", []), list):
        raise ConfigError(
            f"{where}: config_path {config_path}: a Data-Juicer recipe is a mapping with a `process` list"
        )
    return recipe


def make_recipe(ops: list[dict], config_path: str, np: int, text_keys: list[str], tmp: Path, where: str) -> dict:
    """The recipe the worker runs: config_path's (its process first, then `ops`), its np / text_keys else these, the
    I/O keys (FORCED) on tmp."""
    recipe = read_recipe(config_path, where) if config_path else {}
    recipe = {k: v for k, v in recipe.items() if k not in FORCED}
    recipe["process"] = list(recipe.get("process") or []) + list(ops)
    if not recipe["process"]:
        raise ConfigError(f"{where}: no Data-Juicer operators (give `operators`, or a config_path with a `process`)")
    recipe.setdefault("project_name", "nanorft")
    recipe.setdefault("np", np)
    if text_keys:  # none: Data-Juicer's default, `text`
        recipe.setdefault("text_keys", text_keys[0] if len(text_keys) == 1 else list(text_keys))
    recipe.setdefault("skip_op_error", False)  # an operator's error is an error here, not a silently kept row
    io = {"dataset_path": str(tmp / "in.jsonl"), "export_path": str(tmp / "out" / "out.jsonl")}
    io |= {"work_dir": str(tmp / "work"), "keep_stats_in_res_ds": True, "use_cache": False}
    return recipe | io | {"ds_cache_dir": str(tmp / "cache")}


def run(rows: list[dict], recipe_ops: list[dict], config_path: str, np: int, text_keys: list[str], where: str):
    """The rows Data-Juicer keeps, as it returns them (INDEX: each one's place in `rows`; STATS: its stats)."""
    if not rows:
        return []
    with tempfile.TemporaryDirectory(prefix="nanorft-dj-") as name:
        tmp = Path(name)
        recipe = make_recipe(recipe_ops, config_path, np, text_keys, tmp, where)
        check_ops(recipe["process"], f"{where}: process")
        with open(tmp / "in.jsonl", "w") as f:
            for i, row in enumerate(rows):
                try:
                    f.write(json.dumps({**row, INDEX: i}) + "\n")
                except (TypeError, ValueError) as e:
                    raise DataError(f"{where}: row {i} is not JSON (Data-Juicer reads JSONL): {e}") from None
        (tmp / "recipe.json").write_text(json.dumps(recipe))
        answer = call_worker(["run", str(tmp / "recipe.json")], tmp, where)
        out = tmp / "out" / "out.jsonl"
        if not out.exists() and answer.get("rows_out") == 0:
            return []
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def stat_means(rows: list[dict]) -> dict[str, float]:
    """`<stat>_mean` over the rows that came back, for each numeric stat."""
    sums: dict[str, list[float]] = {}
    for row in rows:
        for key, value in (row.get(STATS) or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                sums.setdefault(key, []).append(float(value))
    return {f"{k}_mean": sum(v) / len(v) for k, v in sums.items()}


def run_rows(
    rows: list[dict], ops: list[dict], target_fields: list[str], np: int, config_path: str = ""
) -> tuple[list[dict], dict[str, float]]:
    """The task pipeline's Data-Juicer step: `ops` ([{op_name: {args}}], after config_path's recipe's) over `rows`
    with text_keys = target_fields (an operator reads the first unless its `text_key` arg names another). Returns
    the rows Data-Juicer keeps, in order, with what its mappers changed and each stat flattened onto the row
    (row["text_len"]), and {rows_in, rows_out, <stat>_mean}."""
    where = "data_processor.task_pipeline (Data-Juicer)"
    back = run(rows, ops, config_path, np, target_fields, where)
    metrics = {"rows_in": float(len(rows)), "rows_out": float(len(back))} | stat_means(back)
    kept = []
    for out in back:
        original = rows[out.pop(INDEX)]
        stats = out.pop(STATS, None) or {}
        # NOTE: JSONL -> a table -> JSONL gives every row every column: drop the ones the row lacked (None)
        row = {k: v for k, v in out.items() if not k.startswith("__dj__") and (k in original or v is not None)}
        kept.append(row | stats)
    return kept, metrics


class ExperienceDataJuicer:
    """Data-Juicer over each explore step's experiences (Trinity's `data_juicer` experience operator): its filters
    drop experiences, its stats go to exp.info[<stat>]. Each experience is the row {prompt_text, response_text,
    reward}; the text the operators read is response_text unless the recipe sets text_keys (or an op its text_key).

    Deviations from Trinity: np defaults to 1 (a step's batch is small; more processes cost more than they save);
    `config_path` and `operators` may both be given (the recipe's process, then the operators), where Trinity takes
    config_path alone; no server: a worker process per step."""

    def __init__(
        self, config_path: str = "", operators: list[dict] | None = None, np: int = 1, context: Context | None = None
    ) -> None:
        self.where = context.where if context is not None else "experience_pipeline: data_juicer"
        if not config_path and not operators:
            raise ConfigError(
                f"{self.where}: data_juicer needs config_path (a Data-Juicer recipe) or operators "
                "(a list of {op_name: {args}})"
            )
        if not isinstance(np, int) or np < 1:
            raise ConfigError(f"{self.where}: np must be a positive integer, not {np!r}")
        self.config_path, self.operators, self.np = config_path, list(operators or []), np
        # at build time, not at the first step: a missing venv, a bad recipe or an unknown op name stops the run now
        with tempfile.TemporaryDirectory(prefix="nanorft-dj-") as tmp:
            recipe = make_recipe(self.operators, config_path, np, ["response_text"], Path(tmp), self.where)
        check_ops(recipe["process"], f"{self.where}: process")

    def process(self, exps: list) -> tuple[list, dict[str, float]]:
        rows = [{"prompt_text": e.prompt_text, "response_text": e.response_text, "reward": e.reward} for e in exps]
        back = run(rows, self.operators, self.config_path, self.np, ["response_text"], self.where)
        kept = []
        for out in back:
            exp = exps[out[INDEX]]
            exp.info.update(out.get(STATS) or {})
            kept.append(exp)
        return kept, stat_means(back)
