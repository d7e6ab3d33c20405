"""Task-pipeline operators that ask a model about each task (pipelines/task.py runs them; registry names
llm_difficulty_score_filter and pass_rate_filter).

`api_or_hf_model` names the model, resolved in this order: an explorer.auxiliary_models handle by its name
(engines.auxiliary_handles: the model folder's name, or an external endpoint's model_name); a local HF model folder
(an HF engine for it, closed once the operator is done); else an OpenAI-compatible endpoint serving that model name
(engines.ExternalHandle: base_url from the `api_endpoint` arg or OPENAI_BASE_URL, key from OPENAI_API_KEY).

DifficultyScoreFilter mirrors Data-Juicer 1.6.1's llm_difficulty_score_filter (an LLMAnalysisFilter): its system
prompt, its input template (INPUT_TEMPLATE over FIELD_TEMPLATE per input key, below),
the reply parsed as the first {...} JSON object, the score = mean of the five dimension scores
(1-5) / 5, so in [0.2, 1.0]; a reply that does not parse is asked again up to try_num times, then scores 0.0 (as
Data-Juicer's); kept when min_score <= score <= max_score (closed, as its default). Columns:
`llm_difficulty_score` (float) and `llm_difficulty_record` (the parsed reply as JSON text, "" when none).
Deviations: the columns are top-level (Data-Juicer's are in __dj__stats__); requests go num_process at a time
(data_processor.task_pipeline.num_process) through the handle's replies(); sampling_params default to greedy with
max_tokens 512 (Data-Juicer: the endpoint's defaults); is_hf_model / enable_vllm / model_params / response_path /
preferred_output_lang are not taken (the model is resolved as above; an aux model picks its own engine).

PassRateFilter (nanorft's own): each task runs repeat_times times through its own workflow and reward function (the
first training taskset's, as the explorer runs them: tasksets.load_tasks + explore.run_tasks) with the named model
at `temperature`; the column (`field_name`, default pass_rate) is the mean reward clipped to [0, 1]; a task whose
workflow fails every retry scores 0.0 (counted: stat failed). Rows outside [min_score, max_score] are dropped:
max_score < 1 drops the tasks the model already solves every time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from configs.schema import ExternalModelConfig
from errors import ConfigError

log = logging.getLogger("nanorft.pipelines")


# --- the model behind api_or_hf_model


def resolve_model(name: str, api_endpoint: str | None, context: Any, where: str) -> tuple[Any, bool]:
    """(handle, owned): an auxiliary model's handle (not owned), an HF engine over a local folder (owned: the
    caller closes it), or an external endpoint (owned)."""
    from engines import EngineHandle, ExternalHandle, HFEngine
    from models import load_tokenizer

    if name in context.models:
        return context.models[name], False
    folder = Path(name).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        import torch

        engine = HFEngine(str(folder), device="cuda" if torch.cuda.is_available() else "cpu")
        return EngineHandle(engine, load_tokenizer(str(folder)), {}), True
    base_url = api_endpoint or os.environ.get("OPENAI_BASE_URL", "")
    if not base_url:
        known = ", ".join(context.models) or "none"
        raise ConfigError(
            f"{where}: api_or_hf_model {name!r} is no auxiliary model of this run (explorer.auxiliary_models: "
            f"{known}), no local HF model folder, and no endpoint is given for it (api_endpoint, or OPENAI_BASE_URL)"
        )
    ext = ExternalModelConfig(base_url=base_url, model_name=name, api_key_env="OPENAI_API_KEY")
    return ExternalHandle(ext, where), True


def release(handle: Any) -> None:
    engine = getattr(handle, "engine", None)
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    pool = getattr(handle, "pool", None)
    if pool is not None:
        pool.shutdown(wait=False)


def in_bounds(score: float, low: float | None, high: float | None) -> bool:
    return (low is None or score >= low) and (high is None or score <= high)


# --- llm_difficulty_score_filter

# Data-Juicer 1.6.1's LLMDifficultyScoreFilter.DEFAULT_SYSTEM_PROMPT, word for word (its leading newline kept)
DIFFICULTY_PROMPT = """
You are an expert pedagogical evaluator for LLM training data. Analyze each data sample through multiple difficulty \
lenses and provide calibrated scores with detailed reasoning. Follow these guidelines:

1. Evaluation Dimensions
Rate each dimension (1-5 scale: 1=Novice-friendly, 3=Intermediate, 5=Expert-level):
- Linguistic Complexity: Vocabulary sophistication & syntactic structures
- Conceptual Depth: Abstraction level & theoretical requirements
- Prior Knowledge: Required domain-specific understanding
- Step Complexity: Problem-solving steps needed
- Ambiguity: Multiple valid interpretations

2. Output Format
json
{
  "dimension_scores": {
    "linguistic_complexity": ,
    "conceptual_depth": ,
    "prior_knowledge": ,
    "step_complexity": ,
    "ambiguity":
  },
  "flags": ["multistep_reasoning", "cultural_context", ...],
  "rationale": "Technical analysis of challenge sources"
}
3. Special Instructions
- Differentiate intrinsic vs. extrinsic difficulty factors
- Account for varying cultural/educational backgrounds
- Mark samples requiring cross-domain knowledge synthesis
- Consider temporal aspects for time-sensitive subjects
- Flag ambiguous samples needing difficulty bracketing
- Response a json dict

Example Response:

json
{
  "dimension_scores": {
    "linguistic_complexity": 3,
    "conceptual_depth": 5,
    "prior_knowledge": 4,
    "step_complexity": 4,
    "ambiguity": 5
  },
  "flags": ["nonlinear_reasoning", "semantic_ambiguity"],
  "rationale": "High conceptual difficulty due to multi-layered metaphor interpretation requiring philosophy \
background. Moderate linguistic complexity offset by implicit cultural references."
}
"""
DIMENSIONS = ["linguistic_complexity", "conceptual_depth", "prior_knowledge", "step_complexity", "ambiguity"]
INPUT_TEMPLATE = "# Data\n'''\n{data}\n'''\n\n# Response\njson\n"
FIELD_TEMPLATE = "**{field_name}**\n{field_data}"
OUTER_BRACES = re.compile(r"(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})")  # Data-Juicer's: one level of nesting


def parse_difficulty(reply: str | None, dims: list[str]) -> tuple[float, dict | None]:
    """(mean of the dims' 1-5 scores / 5, the parsed reply), or (0.0, None) when the reply has no JSON object with
    a number for each dim. Example: all five 3 -> 0.6."""
    match = OUTER_BRACES.search(reply or "")
    if not match:
        return 0.0, None
    try:
        data = json.loads(match.group(1))
        scores = [float(data["dimension_scores"][k]) for k in dims]
    except (json.JSONDecodeError, TypeError, KeyError, ValueError):
        return 0.0, None
    return sum(scores) / len(dims) / 5, data


class DifficultyScoreFilter:
    """A model rates each task's difficulty (Data-Juicer's llm_difficulty_score_filter: see the module docstring)."""

    SCORE, RECORD = "llm_difficulty_score", "llm_difficulty_record"
    SAMPLING = {"temperature": 0.0, "max_tokens": 512}

    def __init__(
        self,
        api_or_hf_model: str = "gpt-4o",
        min_score: float | None = 0.5,
        max_score: float | None = 1.0,
        api_endpoint: str | None = None,
        input_keys: list[str] | None = None,
        field_names: list[str] | None = None,
        system_prompt: str | None = None,
        input_template: str | None = None,
        field_template: str | None = None,
        try_num: int = 3,
        sampling_params: dict | None = None,
        dim_required_keys: list[str] | None = None,
        context: Any = None,
    ) -> None:
        where = context.where if context else "llm_difficulty_score_filter"
        self.input_keys, self.field_names = list(input_keys or ["text"]), list(field_names or ["Text"])
        if len(self.input_keys) != len(self.field_names):
            raise ConfigError(f"{where}: input_keys and field_names must pair one to one ({input_keys}, {field_names})")
        if try_num < 1:
            raise ConfigError(f"{where}: try_num must be at least 1, not {try_num}")
        self.model, self.endpoint, self.context, self.where = api_or_hf_model, api_endpoint, context, where
        self.min_score, self.max_score, self.try_num = min_score, max_score, try_num
        self.system_prompt = system_prompt or DIFFICULTY_PROMPT
        self.input_template, self.field_template = input_template or INPUT_TEMPLATE, field_template or FIELD_TEMPLATE
        self.sampling = {**self.SAMPLING, **(sampling_params or {})}
        self.dims = list(dim_required_keys or DIMENSIONS)
        self.refused: set[int] = set()  # the rows whose request the model refused (ask)

    def build_input(self, row: dict) -> str:
        """Data-Juicer's build_input: each input key the row has, under its field name."""
        fields = [
            self.field_template.format(field_name=n, field_data=row[k])
            for k, n in zip(self.input_keys, self.field_names)
            if k in row
        ]
        return self.input_template.format(data="\n\n".join(fields))

    def ask(self, handle: Any, rows: list[dict], width: int) -> list[tuple[float, dict | None]]:
        """Each row's (score, record): the rows `width` at a time, unparsed ones asked again up to try_num times."""
        conversations = [
            [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": self.build_input(r)}]
            for r in rows
        ]
        out: list[tuple[float, dict | None]] = [(0.0, None)] * len(rows)
        todo, self.refused = list(range(len(rows))), set()
        for _ in range(self.try_num):
            for start in range(0, len(todo), width):
                chunk = todo[start : start + width]
                for i, reply in zip(chunk, self.replies(handle, chunk, conversations)):
                    out[i] = parse_difficulty(reply, self.dims)
            todo = [i for i in todo if out[i][1] is None and i not in self.refused]
            if not todo:
                break
        return out

    def replies(self, handle: Any, chunk: list[int], conversations: list[list[dict]]) -> list[str | None]:
        """The model's replies to the chunk's rows; a request the engine refuses (a prompt longer than its
        max_model_len, ...) gets None and is not asked again (self.refused): as Data-Juicer's op leaves the row of a
        failed call at score 0.0, with a warning."""
        try:
            return handle.replies([conversations[i] for i in chunk], **self.sampling)
        except ValueError:
            pass
        out: list[str | None] = []
        for i in chunk:  # one at a time: which of them it refuses
            try:
                out += handle.replies([conversations[i]], **self.sampling)
            except ValueError as e:
                if not self.refused:
                    log.warning("%s: %r refused a request (%s): such rows score 0.0", self.where, self.model, e)
                self.refused.add(i)
                out.append(None)
        return out

    def process(self, rows: list[dict]) -> tuple[list[dict], dict[str, float]]:
        missing = sorted({k for r in rows for k in self.input_keys if k not in r})
        if missing:  # as Data-Juicer: asked without them
            log.warning(
                "%s: input_keys %s missing from some rows: those rows are shown without them", self.where, missing
            )
        handle, owned = resolve_model(self.model, self.endpoint, self.context, self.where)
        width = self.context.cfg.data_processor.task_pipeline.num_process if self.context else 4
        try:
            scored = self.ask(handle, rows, max(1, width))
        finally:
            if owned:
                release(handle)
        kept = []
        for row, (score, record) in zip(rows, scored):
            row[self.SCORE], row[self.RECORD] = score, json.dumps(record, ensure_ascii=False) if record else ""
            if in_bounds(score, self.min_score, self.max_score):
                kept.append(row)
        unparsed = sum(record is None for _, record in scored)
        if unparsed:
            log.warning("%s: %d of %d replies had no difficulty scores: scored 0.0", self.where, unparsed, len(rows))
        mean = sum(s for s, _ in scored) / len(scored) if scored else 0.0
        return kept, {"mean_score": mean, "unparsed": float(unparsed), "refused": float(len(self.refused))}


# --- pass_rate_filter


class PassRateFilter:
    """A model's pass rate on each task through the task's own workflow and reward (see the module docstring)."""

    def __init__(
        self,
        api_or_hf_model: str = "",
        repeat_times: int = 8,
        min_score: float | None = 0.0,
        max_score: float | None = 1.0,
        field_name: str = "pass_rate",
        temperature: float = 1.0,
        api_endpoint: str | None = None,
        context: Any = None,
    ) -> None:
        where = context.where if context else "pass_rate_filter"
        if not api_or_hf_model:
            raise ConfigError(f"{where}: api_or_hf_model is required (an auxiliary model's name or an HF folder)")
        if repeat_times < 1:
            raise ConfigError(f"{where}: repeat_times must be at least 1, not {repeat_times}")
        self.model, self.endpoint, self.context, self.where = api_or_hf_model, api_endpoint, context, where
        self.repeat_times, self.min_score, self.max_score = repeat_times, min_score, max_score
        self.field_name, self.temperature = field_name, temperature

    def tasks(self, rows: list[dict], folder: str) -> list:
        """The rows as the first training taskset's tasks, repeat_times runs each at `temperature`."""
        from tasksets import load_tasks

        path = Path(folder, "rows.jsonl")
        path.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))
        ts = self.context.cfg.buffer.explorer_input.tasksets[0]
        rollout = dataclasses.replace(ts.rollout_args, temperature=self.temperature)
        ts = dataclasses.replace(ts, path=str(path), subset_name=None, repeat_times=self.repeat_times)
        return load_tasks(dataclasses.replace(ts, rollout_args=rollout))

    def run_all(self, run_tasks: Any, pool: ThreadPoolExecutor, tasks: list, handle: Any) -> list:
        """run_tasks over every task, in chunks of a twentieth (at least 64 tasks): a progress line after each."""
        results, start, size = [], time.monotonic(), max(64, math.ceil(len(tasks) / 20))
        for first in range(0, len(tasks), size):
            results += run_tasks(pool, tasks[first : first + size], [handle], self.context.cfg)
            log.info(
                "pass_rate_filter: %d of %d tasks run (%d times each) in %.0f s",
                len(results),
                len(tasks),
                self.repeat_times,
                time.monotonic() - start,
            )
        return results

    def process(self, rows: list[dict]) -> tuple[list[dict], dict[str, float]]:
        from engines import EngineHandle

        run_tasks = self.context.run_tasks
        if run_tasks is None:
            raise ConfigError(f"{self.where}: pass_rate_filter runs tasks through their workflows: only in an explorer")
        handle, owned = resolve_model(self.model, self.endpoint, self.context, self.where)
        try:
            if not isinstance(handle, EngineHandle):
                raise ConfigError(
                    f"{self.where}: {self.model!r} is an external endpoint; a workflow needs a model it runs "
                    "(an auxiliary model on an engine, or an HF folder)"
                )
            with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(16, thread_name_prefix="pass") as pool:
                results = self.run_all(run_tasks, pool, self.tasks(rows, folder), handle)
        finally:
            if owned:
                release(handle)
        kept, failed, total = [], 0, 0.0
        for row, (_, exps, _) in zip(rows, results):
            rewards = [x.reward for x in exps or [] if x.reward is not None]
            failed += not rewards
            rate = min(1.0, max(0.0, sum(rewards) / len(rewards))) if rewards else 0.0
            row[self.field_name], total = rate, total + rate
            if in_bounds(rate, self.min_score, self.max_score):
                kept.append(row)
        return kept, {"mean_pass_rate": total / len(rows) if rows else 0.0, "failed": float(failed)}
