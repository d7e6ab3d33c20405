"""tasksets.py: reading tasksets and data files into tasks and rows (the explorer's input, the trainer's files).

    from tasksets import TaskReader
    reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=1)
    tasks = reader.read(cfg.buffer.batch_size)    # Task objects; reader.state() is the saved position

Local files (.jsonl/.json/.parquet/.csv, one file or a Hugging Face-style folder of splits) are read with
`datasets`; a path that is not local is tried on the hub (the pre-flight made sure it can be, and the launcher
downloaded it: configs/hub.py). A format key names a column, or a dotted path into
struct columns (veRL's parquet: `reward_model.ground_truth`). Every problem (missing file, split or column, a
malformed row, a null or a non-text prompt or reference) is a DataError naming the file, row and key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from errors import DataError

if TYPE_CHECKING:  # annotations only: importing tasksets must not pull in the config loader and algos/
    from configs.schema import BufferConfig, FormatConfig, GenerationConfig, ModelConfig, TasksetConfig

log = logging.getLogger("nanorft.tasksets")


@dataclasses.dataclass
class Task:
    """One row of a taskset, ready for a workflow."""

    taskset: str  # taskset name
    index: int  # row index within its taskset
    epoch: int  # pass over the tasksets this task was read in
    raw: dict  # the row as read from the file
    prompt: str | None  # plaintext prompt (format.prompt_key)
    messages: list[dict] | None  # chat messages to prompt with (system prompt included)
    reference: Any  # the reference answer (format.response_key), None if the row has none
    tools: list | None  # tool schemas (format.tools_key)
    workflow: str  # workflow name
    reward_fn: str  # reward function name
    workflow_args: dict
    reward_fn_args: dict
    rollout_args: GenerationConfig
    repeat_times: int  # responses to sample (the group size)
    is_eval: bool = False
    chat_template: str = ""  # format.chat_template: renders this task's prompt instead of the tokenizer's
    reply_prefix: str | None = None  # format.reply_prefix: text the assistant turn starts with
    prompt_cut: int = 0  # characters its messages had before load_tasks cut them (PromptBound); 0: not cut
    # the epoch's slot it was read at where its selector may read a task twice in an epoch (difficulty_based): its
    # group id names it, so that two reads are two groups; -1 elsewhere
    read_at: int = -1

    @property
    def task_id(self) -> str:
        return f"{self.taskset}/{self.index}"


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


# The longest line of a line-based data file (.jsonl, .csv), in bytes: one row. A longer line is refused before
# `datasets` reads the file: its JSON reader grows its block until a line fits, so a line without end (a file
# still being written, /dev/zero copied) was an unbounded read. A prompt this long is cut anyway (prompt_bound).
MAX_LINE_BYTES = 64 << 20
_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a FIFO (named pipe)",
    stat.S_ISSOCK: "a socket",
}


def regular_file(f: Path) -> Path:
    """`f` when it is a regular file (or a symlink to one), else a DataError naming it and what it is: /dev/zero
    reads without end (all memory), a FIFO blocks the reader until someone writes, a directory is not a file."""
    try:
        mode = f.stat().st_mode
    except OSError as e:
        raise DataError(f"{f}: cannot be read ({e.strerror or type(e).__name__})") from None
    if stat.S_ISREG(mode):
        return f
    kind = next((name for test, name in _KINDS.items() if test(mode)), "not a regular file")
    link = f" (a link to {os.path.realpath(f)})" if f.is_symlink() else ""
    raise DataError(f"{f}{link} is {kind}, not a data file: point the path at a regular file (or its folder)")


def check_lines(f: Path) -> None:
    """DataError naming the file and the line when a line is longer than MAX_LINE_BYTES; each line is read with
    that bound (a line without end is never held whole)."""
    limit = MAX_LINE_BYTES
    with open(f, "rb") as fh:
        for n, line in enumerate(iter(lambda: fh.readline(limit + 1), b""), start=1):
            if len(line) > limit:
                raise DataError(
                    f"{f}: line {n}: longer than {limit:,} bytes (tasksets.MAX_LINE_BYTES): one row per line, "
                    "and a row this long is no prompt; cut it or drop the row"
                )


def find_data_files(path: str, subset_name: str | None, split: str) -> list[Path]:
    """Files of one split: a single file, or <path>[/<subset>][/data]/<split>[-*].<ext> (Hugging Face layout).
    Only regular files (or links to them) are data files: anything else is a DataError naming it (regular_file)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        return [regular_file(p)]
    root = p / subset_name if subset_name else p
    if subset_name and not root.is_dir():
        raise DataError(f"{p}: no sub-folder {subset_name!r} for subset_name")
    for folder in (root, root / "data"):
        patterns = [pat for ext in _BUILDERS for pat in (f"{split}{ext}", f"{split}-*{ext}", f"{split}_*{ext}")]
        files = sorted(f for pat in patterns for f in folder.glob(pat))
        if files:
            return [regular_file(f) for f in files]
    raise DataError(
        f"{root}: no {split!r} split (looked for {split}.jsonl/.json/.parquet/.csv and {split}-*.* here and in data/)"
    )


def read_rows(path: str, subset_name: str | None = None, split: str = "train") -> list[tuple[str, int, dict]]:
    """Rows as (file, row number, row) from local files, or from the hub when `path` is not local."""
    import datasets  # slow to import; only readers need it

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its parse errors are re-raised below, with the line
    if Path(path).expanduser().exists():
        rows = []
        for f in find_data_files(path, subset_name, split):
            if f.suffix in (".jsonl", ".csv"):
                check_lines(f)
            try:
                ds = datasets.load_dataset(_BUILDERS.get(f.suffix, "json"), data_files=str(f), split="train")
                rows += [(str(f), i, row) for i, row in enumerate(ds)]  # NOTE: bad bytes surface here, not above
            except Exception as e:  # datasets / pyarrow / pandas errors name neither the file nor the line
                raise DataError(f"{f}: {unreadable(f, e)}") from None
        return rows
    try:
        ds = datasets.load_dataset(path, subset_name, split=split)
    except Exception as e:  # offline, unknown name, ...: say what was tried
        raise DataError(
            f"{path!r} is not a local file or folder, and loading it from the Hugging Face hub "
            f"(subset {subset_name!r}, split {split!r}) failed: {type(e).__name__}: {e}"
        ) from e
    return [(f"hub:{path}", i, row) for i, row in enumerate(ds)]


def unreadable(f: Path, e: Exception) -> str:
    """Why `datasets` could not read file `f` (its error `e`): no rows, the line that is not JSON, or the error
    underneath its own (DatasetGenerationError says only that one occurred)."""
    with open(f, "rb") as fh:
        if not any(line.strip() for line in fh):
            return "empty: no rows"
    if f.suffix in (".jsonl", ".json"):
        where = bad_line(f) if f.suffix == ".jsonl" else bad_json(f)
        if where:
            return where
    seen = [e]
    while (e.__cause__ or e.__context__) is not None and (e.__cause__ or e.__context__) not in seen:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
        seen.append(e)
    return f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:300]})"


def bad_json(f: Path) -> str:
    """'line N: why' for a .json file that is not one JSON document: JSON lines (`datasets` reads both) are checked
    line by line (`bad_line`); '' when it is valid JSON."""
    try:
        text = f.read_text(encoding="utf-8")
        if lone_surrogate(json.loads(text), ""):
            n = next((n for n, line in enumerate(text.splitlines(), 1) if _LONE_ESCAPE.search(line)), 0)
            return lone_surrogate(json.loads(text), f"line {n}: " if n else "")
        return ""
    except UnicodeDecodeError:
        return bad_line(f)
    except json.JSONDecodeError as e:
        first = next((line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()), "")
        try:
            lines = isinstance(json.loads(first), dict)  # a first line that is an object alone: JSON lines
        except json.JSONDecodeError:
            lines = False
        return bad_line(f) if lines else f"line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})"


def bad_line(f: Path) -> str:
    """'line N: why' for the first line of a JSON-lines file that is not UTF-8 or not a JSON object (the reader's
    own error names neither); '' when every line is fine."""
    with open(f, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1})"
            if not text.strip():
                continue
            try:
                value = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                return f"line {n}: not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(value, dict):
                return f"line {n}: a JSON {type(value).__name__}, not an object (one row per line)"
            if lone_surrogate(value, f"line {n}: "):
                return lone_surrogate(value, f"line {n}: ")
    return ""


# A JSON escape of half a UTF-16 pair without its other half (to find the line of a lone surrogate in a document)
_LONE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def lone_surrogate(value: Any, where: str) -> str:
    """'<where>a lone surrogate ...' when a string of a parsed JSON value holds half of a UTF-16 pair (`"\\ud800"`
    escaped alone: JSON allows it, text cannot hold it, and pyarrow's error names no line); '' otherwise."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
        return ""
    except UnicodeEncodeError as e:
        return (
            f"{where}a lone surrogate \\u{ord(text[e.start]):04x} (half of a UTF-16 pair, escaped alone) in a "
            "string: not text; fix or drop the row"
        )


_ABSENT = object()  # what `row_value` gives for a column a row does not have (None is a null value)
_NULL_NOTE = " (a JSON row that lacks a key other rows have reads as null too): give it a value or drop the row"


def row_value(row: dict, key: str) -> Any:
    """Column `key` of a row: the top-level column of that name if there is one, else a dotted path into nested dicts
    ("reward_model.ground_truth": a parquet struct column arrives as a dict); _ABSENT when neither exists."""
    if key in row:  # NOTE: first, so that a column whose name holds a literal dot keeps working
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _is_null(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))  # a CSV's empty number cell: NaN


def _no_value(row: dict, key: str, where: str, what: str) -> str:
    """Why column `key` of a row gives no value: it is null, a struct on its dotted path is null or not a struct,
    or it is missing (with the keys that are there)."""
    label = f"column {key!r} ({what})"
    if key in row:
        return f"{where}: {label} is null{_NULL_NOTE}"
    value: Any = row
    walked: list[str] = []
    for part in key.split("."):
        path = ".".join(walked)
        if walked and _is_null(value):
            return f"{where}: {label}: {path!r} is null{_NULL_NOTE}"
        if not isinstance(value, dict):
            return f"{where}: {label}: {path!r} holds {_kind(value)}, not a struct to look into"
        if part not in value:
            has = f"the row has {sorted(row)}" if not walked else f"{path!r} has {sorted(value)}"
            return f"{where}: missing {label}; {has}"
        value = value[part]
        walked.append(part)
    return f"{where}: {label} is null{_NULL_NOTE}"


def _column(row: dict, key: str, where: str, what: str, required: bool = True) -> Any:
    """Column `key` (dotted: into nested dicts) of a row; a DataError when it is missing or null, or None when the
    column is optional (`required` False)."""
    value = row_value(row, key)
    if value is _ABSENT or _is_null(value):
        if not required:
            return None
        raise DataError(_no_value(row, key, where, what))
    return value


def _kind(value: Any) -> str:
    return {dict: "a struct (dict)", list: "a list", bool: "a boolean"}.get(type(value), f"a {type(value).__name__}")


def _text(value: Any, key: str, where: str, what: str) -> str:
    """The value of a text column: a string, or a number as its string (a GSM8K-style integer answer, 42 -> "42";
    a whole float as an integer, 42.0 -> "42").
    A struct, a list or a boolean is refused: a reward compares text, and str() of a dict never matches an answer."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():  # a CSV column of 42 and 2.5 reads 42.0; the file says 42
        return str(int(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    hint = "text is needed"
    if isinstance(value, dict):
        inner = [f"{key}.{k}" for k, v in value.items() if isinstance(v, str)] or [f"{key}.{k}" for k in value]
        hint = f"name the text inside it with a dotted key: {' or '.join(inner[:5]) or '(it is empty)'}"
    elif isinstance(value, list):
        hint = "a list of {role, content} messages is read from format.prompt_key or format.messages_key only"
    raise DataError(f"{where}: column {key!r} ({what}) holds {_kind(value)}, not text: {str(value)[:80]!r}; {hint}")


def _messages(value: Any, where: str, key: str = "") -> list[dict]:
    """A chat: a non-empty list of {role, content} messages with text content (extra keys are dropped)."""
    column = f"column {key!r}: " if key else ""
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise DataError(f"{where}: {column}expected a list of {{role, content}} messages, got {str(value)[:80]!r}")
    if not value:
        raise DataError(f"{where}: {column}an empty list of messages")
    for i, m in enumerate(value):
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
            raise DataError(
                f"{where}: {column}message {i} has role {m['role']!r} and content "
                f"{str(m['content'])[:80]!r}: both must be text"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _prompt(row: dict, fmt: FormatConfig, where: str, head: list[dict]) -> tuple[str | None, list[dict]]:
    """(prompt, messages) of a plaintext-format row: the prompt column's text after `head` (the system prompt), or,
    when the column holds a chat (veRL's `prompt`: a list of {role, content}), that chat (prompt None)."""
    value = _column(row, fmt.prompt_key, where, "format.prompt_key")
    if isinstance(value, list):
        msgs = _messages(value, where, fmt.prompt_key)
        return None, msgs if msgs[0]["role"] == "system" else head + msgs
    prompt = _text(value, fmt.prompt_key, where, "format.prompt_key")
    return prompt, head + [{"role": "user", "content": prompt}]


def _answer(row: dict, key: str, where: str, what: str) -> str | list[dict]:
    """A DPO answer (chosen / rejected): text, or a list of assistant messages."""
    value = _column(row, key, where, what)
    return _messages(value, where, key) if isinstance(value, list) else _text(value, key, where, what)


def format_row(row: dict, fmt: FormatConfig, where: str, kind: str = "task") -> dict:
    """Pick the columns `fmt` names out of a row (a key may be a dotted path into nested dicts: `row_value`).

    kind "task": {prompt, messages, reference, tools}; "sft": {messages} ending with the assistant turn;
    "dpo": {messages (the prompt), chosen, rejected} (strings, or message lists). Prompts, references and answers
    must be text (a number is taken as its string): anything else is a DataError naming the row and the column.
    """
    system = fmt.system_prompt
    if fmt.system_prompt_key:
        key = fmt.system_prompt_key
        system = _text(_column(row, key, where, "format.system_prompt_key"), key, where, "format.system_prompt_key")
    head = [{"role": "system", "content": system}] if system else []
    out: dict[str, Any] = {"tools": _column(row, fmt.tools_key, where, "format.tools_key", required=False)}
    if fmt.prompt_type == "messages":
        msgs = _messages(_column(row, fmt.messages_key, where, "format.messages_key"), where, fmt.messages_key)
        if msgs[0]["role"] != "system":
            msgs = head + msgs
        if kind == "sft" and msgs[-1]["role"] != "assistant":
            raise DataError(f"{where}: an SFT conversation must end with an assistant message")
        if kind == "task" and msgs[-1]["role"] == "assistant":  # the answer is the reference
            out["reference"] = msgs[-1]["content"]
            msgs = msgs[:-1]
        out.update(prompt=None, messages=msgs)
        if kind == "task" and "reference" not in out:  # optional here: a conversation task may have none
            ref = _column(row, fmt.response_key, where, "format.response_key", required=False)
            out["reference"] = None if ref is None else _text(ref, fmt.response_key, where, "format.response_key")
    else:
        out["prompt"], out["messages"] = _prompt(row, fmt, where, head)
        if kind in ("task", "sft"):  # the reference answer, or the SFT response
            key = fmt.response_key
            answer = _text(_column(row, key, where, "format.response_key"), key, where, "format.response_key")
            if kind == "task":
                out["reference"] = answer
            else:
                out["messages"] = out["messages"] + [{"role": "assistant", "content": answer}]
    if kind == "dpo":
        out["chosen"] = _answer(row, fmt.chosen_key, where, "format.chosen_key")
        out["rejected"] = _answer(row, fmt.rejected_key, where, "format.rejected_key")
    return out


def named(row: dict, key: str | None, listed: str | None, where: str, kind: str) -> str | None:
    """The workflow or reward function a task runs: the taskset's (`listed`: the YAML's), or the one its row names in
    column `key` (format.workflow_key / reward_fn_key). NOTE: a row is data, not config: it may name a registered
    workflow or reward function (an unknown name fails the task as its workflow is built) or the one the YAML gives
    this taskset, never code to import (`module:attr`, `path/file.py:attr`), which only the YAML may name."""
    if not key:
        return listed
    value = row_value(row, key)
    if value is _ABSENT or value is None:
        return None
    if not isinstance(value, str) or (value != listed and (":" in value or "/" in value or "\\" in value)):
        raise DataError(
            f"{where}: column {key!r} names the {kind} {str(value)[:80]!r}: a row may name a registered "
            f"{kind} or this taskset's own ({listed!r}), never code to import (module:attr or a file "
            "path), which only the YAML may name"
        )
    return value


# Characters per token that no real text exceeds on average (English ~4, code ~3-10): a prompt of more than
# CHARS_PER_TOKEN x max_prompt_tokens characters is over max_prompt_tokens tokens, and is cut by characters before
# it is ever tokenised (a 10 MB question was tokenised whole, then cut to its last tokens).
CHARS_PER_TOKEN = 32


@dataclasses.dataclass(frozen=True)
class PromptBound:
    """How long a task's prompt may be, in characters, before it is tokenised (prompt_bound)."""

    chars: int  # the text of its messages, all together
    tokens: int  # the token limit it is derived from (model.max_prompt_tokens, else max_model_len)
    truncate: bool  # model.enable_prompt_truncation: cut a longer prompt (else drop its task)


def prompt_bound(model: ModelConfig) -> PromptBound | None:
    """The explorer's bound on a prompt's characters: CHARS_PER_TOKEN per token of model.max_prompt_tokens (or, unset,
    max_model_len); None when neither is set. A prompt over it is over the token limit too, so load_tasks does to it
    what the engine would do after tokenising (EngineHandle.encode): keep its end (the engine keeps the last tokens;
    its experiences are marked prompt_truncated, no loss) or, with enable_prompt_truncation off, drop its task
    (PromptTooLong)."""
    tokens = model.max_prompt_tokens or model.max_model_len
    return PromptBound(CHARS_PER_TOKEN * tokens, tokens, model.enable_prompt_truncation) if tokens else None


def cut_messages(messages: list[dict], chars: int) -> list[dict]:
    """`messages` keeping their last `chars` characters of content (the end is what the engine's cut keeps: the
    last turn and the generation prompt); earlier contents are emptied, every role stays."""
    out, left = [], chars
    for m in reversed(messages):
        content = m["content"][max(0, len(m["content"]) - left) :]
        left -= len(content)
        out.append({**m, "content": content})
    return out[::-1]


def _bounded(f: dict, bound: PromptBound | None) -> tuple[dict, int]:
    """(the formatted row with its messages cut to `bound`, the characters they had) when they are over it; the row
    and 0 when not."""
    chars = sum(len(m["content"]) for m in f["messages"])
    if bound is None or chars <= bound.chars:
        return f, 0
    msgs = cut_messages(f["messages"], bound.chars)
    return {**f, "messages": msgs, "prompt": None if f["prompt"] is None else msgs[-1]["content"]}, chars


def _warn_bounded(ts: TasksetConfig, bound: PromptBound, over: list[tuple[str, int]]) -> None:
    """One warning per taskset naming the prompts over `bound` ((where, characters) of each) and what was done."""
    first, chars = over[0]
    what = (
        f"cut to their last {bound.chars:,} characters before tokenising (their experiences are marked "
        "prompt_truncated: no loss, as the engine's cut)"
        if bound.truncate
        else "dropped, as model.enable_prompt_truncation is off (PromptTooLong)"
    )
    log.warning(
        "taskset %s: %d prompt(s) longer than %s characters (tasksets.CHARS_PER_TOKEN %d x %d tokens, "
        "model.max_prompt_tokens) were %s; the first: %s (%s characters)",
        ts.name,
        len(over),
        f"{bound.chars:,}",
        CHARS_PER_TOKEN,
        bound.tokens,
        what,
        first,
        f"{chars:,}",
    )


def load_tasks(ts: TasksetConfig, is_eval: bool = False, bound: PromptBound | None = None) -> list[Task]:
    """Every row of a (derived) taskset as a Task, in file order. Fails on the first bad row. A prompt over `bound`
    (prompt_bound) is cut, or its task dropped, with one warning for the taskset."""
    tasks, over = [], []
    rows = read_rows(ts.path, ts.subset_name, ts.split)
    bar = tqdm(rows, desc=f"taskset {ts.name}", unit=" rows", disable=not ts.enable_progress_bar)
    for index, (file, rownum, row) in enumerate(bar):
        where = f"taskset {ts.name}: {file}: row {rownum}"
        f, cut = _bounded(format_row(row, ts.format, where), bound)
        if cut:
            over.append((f"{file}: row {rownum}", cut))
            if not bound.truncate:  # type: ignore[union-attr]
                continue
        fmt = ts.format
        tasks.append(
            Task(
                taskset=ts.name,
                index=index,
                epoch=0,
                raw=row,
                prompt=f["prompt"],
                messages=f["messages"],
                reference=f.get("reference"),
                tools=f["tools"],
                workflow=named(row, fmt.workflow_key, ts.default_workflow_type, where, "workflow"),
                reward_fn=named(row, fmt.reward_fn_key, ts.default_reward_fn_type, where, "reward function"),
                workflow_args=ts.workflow_args,
                reward_fn_args=ts.reward_fn_args,
                rollout_args=ts.rollout_args,
                repeat_times=ts.repeat_times or 1,
                is_eval=is_eval,
                chat_template=fmt.chat_template,
                reply_prefix=fmt.reply_prefix,
                prompt_cut=cut,
            )
        )
    if over:
        _warn_bounded(ts, bound, over)  # type: ignore[arg-type]
    if not tasks:
        dropped = f" once the {len(over)} over-long prompt(s) were dropped" if over else ""
        raise DataError(f"taskset {ts.name}: {ts.path} ({ts.split}) has no rows{dropped}")
    return tasks


def feature_columns(ts: TasksetConfig, tasks: list[Task], keys: list[str]) -> np.ndarray:
    """[len(tasks), len(keys)] float64: column `keys[j]` (dotted: into structs) of each task's row. A DataError names
    the taskset, row and key of a missing column or a value that is not a finite number."""
    out = np.zeros((len(tasks), len(keys)), dtype=np.float64)
    for r, task in enumerate(tasks):
        for j, key in enumerate(keys):
            value = row_value(task.raw, key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not ok:
                what = (
                    "is missing"
                    if value is row_value({}, key)
                    else "is null (a JSON row that lacks a key other rows have reads as null too)"
                    if value is None
                    else f"holds {value!r}, not a finite number"
                )
                raise DataError(
                    f"taskset {ts.name}: row {task.index}: feature column {key!r} (data_selector.feature_keys of "
                    f"{ts.data_selector.selector_type}) {what}; every row needs a number there"
                )
            out[r, j] = value
    return out


def total_steps(buffer: BufferConfig, tasks_per_epoch: int, per_task: int = 1, per_step: int | None = None) -> int:
    """The run's steps: buffer.total_steps, else enough for every task of buffer.total_epochs epochs, read as one
    stream (TaskReader.read fills a step across an epoch's end). Explore steps take buffer.batch_size tasks; train
    steps take `per_step` (train_batch_size) of the `per_task` (repeat_times) experiences each task gives."""
    if buffer.total_steps:
        return buffer.total_steps
    return math.ceil(tasks_per_epoch * buffer.total_epochs * per_task / (per_step or buffer.batch_size))


class TaskReader:
    """Training tasks over epochs: several tasksets interleaved, each read by its selector, a position to save.

        reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=cfg.buffer.total_epochs)
        reader.load_state(saved)        # resume: {"epoch": e, "index": i, "sizes": [...], "selectors": [...]}
        batch = reader.read(batch_size) # [] once every epoch is done
        reader.feedback(results)        # each task's group of rewards, after they ran (difficulty_based learns)

    An epoch is len(taskset) picks of each taskset, interleaved in proportion to their sizes (slots); which row a
    pick reads is its taskset's selector's choice (selection.py: sequential, a seeded per-epoch shuffle, seeded
    sampling with replacement, sorted by feature columns, or online by estimated pass rate).
    """

    def __init__(self, tasksets: list[TasksetConfig], total_epochs: int = 1, bound: PromptBound | None = None) -> None:
        import selection  # NOTE: here: it imports configs/ (data_selector's checks), which `import tasksets` must not

        self.sets = [(ts, load_tasks(ts, bound=bound)) for ts in tasksets]
        self.selectors = [
            selection.make(ts, len(tasks), functools.partial(feature_columns, ts, tasks)) for ts, tasks in self.sets
        ]
        self.total_epochs = total_epochs
        self.epoch, self.index = 0, 0
        self._slots: tuple[int, list[tuple[int, int]]] | None = None
        # a task's (taskset number, position in its tasks) by task_id: feedback names tasks, selectors positions
        self._where = {t.task_id: (i, r) for i, (_, tasks) in enumerate(self.sets) for r, t in enumerate(tasks)}

    def __len__(self) -> int:
        """Tasks per epoch."""
        return sum(len(tasks) for _, tasks in self.sets)

    def slots(self, epoch: int) -> list[tuple[int, int]]:
        """(taskset number, k: its k-th pick of the epoch) of every task of one epoch, in reading order: each
        taskset's picks spread evenly over the epoch (the k-th at (k + 0.5) / n), ties by taskset number. The same
        for every epoch; `epoch` is kept for the selectors' sake."""
        keyed = [((k + 0.5) / len(tasks), i, k) for i, (_, tasks) in enumerate(self.sets) for k in range(len(tasks))]
        return [(i, k) for _, i, k in sorted(keyed)]

    def _rows(self, take: list[tuple[int, int]]) -> list[int]:
        """The rows of slots `take` (in order), each taskset's picks asked of its selector at once."""
        ks: dict[int, list[int]] = {}
        for i, k in take:
            ks.setdefault(i, []).append(k)
        picked = {i: iter(self.selectors[i].pick(self.epoch, its)) for i, its in ks.items()}
        return [next(picked[i]) for i, _ in take]

    def read(self, n: int) -> list[Task]:
        """The next n tasks (fewer at the very end; none when all epochs are done)."""
        out = []
        while len(out) < n and self.epoch < self.total_epochs:
            if self._slots is None:
                self._slots = (self.epoch, self.slots(self.epoch))
            slots = self._slots[1]
            take = slots[self.index : self.index + n - len(out)]
            rows = self._rows(take)
            for j, ((i, _), row) in enumerate(zip(take, rows)):
                at = self.index + j if self.selectors[i].repeats else -1
                out.append(dataclasses.replace(self.sets[i][1][row], epoch=self.epoch, read_at=at))
            self.index += len(take)
            if self.index >= len(slots):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def feedback(self, results: list[tuple[Task, list[float]]]) -> None:
        """Each task's group of rewards, after it ran (the raw rewards, before any filter): one update per taskset
        (selection.pass_rate: the mean clipped to [0, 1]; a task read twice in the batch, the mean of its rates)."""
        import selection

        rates: dict[int, dict[int, list[float]]] = {}
        for task, rewards in results:
            if rewards and task.task_id in self._where:
                i, row = self._where[task.task_id]
                rates.setdefault(i, {}).setdefault(row, []).append(selection.pass_rate(rewards))
        for i, by_row in rates.items():
            self.selectors[i].feedback({row: sum(r) / len(r) for row, r in by_row.items()})

    def metrics(self) -> dict[str, float]:
        """selection/<taskset>/...: each selector's, since the last call (selection.py)."""
        out: dict[str, float] = {}
        for sel in self.selectors:
            out |= sel.metrics()
        return out

    @property
    def exhausted(self) -> bool:
        """Every epoch read: read() gives nothing more."""
        return self.epoch >= self.total_epochs

    def state(self) -> dict:
        """The position and each selector's state (JSON), saved with the step's experiences."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "sizes": [len(t) for _, t in self.sets],
            "selectors": [sel.state() for sel in self.selectors],
        }

    def load_state(self, state: dict) -> None:
        """Resume at a saved position; a state saved before selectors had state (no "selectors") loads too (their
        orders are functions of seed and epoch)."""
        sizes = [len(t) for _, t in self.sets]
        if state.get("sizes", sizes) != sizes:
            raise DataError(f"saved taskset position is for tasksets of sizes {state['sizes']}, these have {sizes}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        for sel, saved in zip(self.selectors, state.get("selectors", [])):
            sel.load_state(saved)
