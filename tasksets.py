"""tasksets.py: reading tasksets and data files into tasks and rows (the explorer's input, the trainer's files).

    from tasksets import TaskReader
    reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=1)
    tasks = reader.read(cfg.buffer.batch_size)    # Task objects; reader.state() is the saved position

Local files (.jsonl/.json/.parquet/.csv, one file or a Hugging Face-style folder of splits) are read with
`datasets`; a path that is not local is tried on the hub. Every problem (missing file, split or column, a
malformed row) is a DataError naming the file, row and key.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:  # annotations only: importing tasksets must not pull in the config loader and algos/
    from configs.schema import FormatConfig, GenerationConfig, TasksetConfig


class DataError(ValueError):
    """A taskset or data file problem, naming the file, row and key."""


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

    @property
    def task_id(self) -> str:
        return f"{self.taskset}/{self.index}"


_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def find_data_files(path: str, subset_name: str | None, split: str) -> list[Path]:
    """Files of one split: a single file, or <path>[/<subset>][/data]/<split>[-*].<ext> (Hugging Face layout)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    root = p / subset_name if subset_name else p
    if subset_name and not root.is_dir():
        raise DataError(f"{p}: no sub-folder {subset_name!r} for subset_name")
    for folder in (root, root / "data"):
        patterns = [pat for ext in _BUILDERS for pat in (f"{split}{ext}", f"{split}-*{ext}", f"{split}_*{ext}")]
        files = sorted(f for pat in patterns for f in folder.glob(pat))
        if files:
            return files
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
        json.loads(f.read_text(encoding="utf-8"))
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
    return ""


def _column(row: dict, key: str, where: str, what: str) -> Any:
    if row.get(key) is None:
        raise DataError(f"{where}: missing column {key!r} ({what}); the row has {sorted(row)}")
    return row[key]


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise DataError(f"{where}: expected a list of {{role, content}} messages, got {str(value)[:80]!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def format_row(row: dict, fmt: FormatConfig, where: str, kind: str = "task") -> dict:
    """Pick the columns `fmt` names out of a row.

    kind "task": {prompt, messages, reference, tools}; "sft": {messages} ending with the assistant turn;
    "dpo": {messages (the prompt), chosen, rejected} (strings, or message lists for prompt_type messages).
    """
    system = fmt.system_prompt
    if fmt.system_prompt_key:
        system = _column(row, fmt.system_prompt_key, where, "format.system_prompt_key")
    head = [{"role": "system", "content": system}] if system else []
    out: dict[str, Any] = {"tools": row.get(fmt.tools_key)}
    if fmt.prompt_type == "messages":
        msgs = _messages(_column(row, fmt.messages_key, where, "format.messages_key"), where)
        if msgs and msgs[0]["role"] != "system":
            msgs = head + msgs
        if kind == "sft" and (not msgs or msgs[-1]["role"] != "assistant"):
            raise DataError(f"{where}: an SFT conversation must end with an assistant message")
        if kind == "task" and msgs and msgs[-1]["role"] == "assistant":  # the answer is the reference
            out["reference"] = msgs[-1]["content"]
            msgs = msgs[:-1]
        out.update(prompt=None, messages=msgs)
        out.setdefault("reference", row.get(fmt.response_key))
    else:
        prompt = _column(row, fmt.prompt_key, where, "format.prompt_key")
        msgs = head + [{"role": "user", "content": str(prompt)}]
        out.update(prompt=str(prompt), messages=msgs)
        if kind == "task":
            out["reference"] = _column(row, fmt.response_key, where, "format.response_key")
        elif kind == "sft":
            answer = _column(row, fmt.response_key, where, "format.response_key")
            out["messages"] = msgs + [{"role": "assistant", "content": str(answer)}]
    if kind == "dpo":
        out["chosen"] = _column(row, fmt.chosen_key, where, "format.chosen_key")
        out["rejected"] = _column(row, fmt.rejected_key, where, "format.rejected_key")
    return out


def named(row: dict, key: str | None, listed: str | None, where: str, kind: str) -> str | None:
    """The workflow or reward function a task runs: the taskset's (`listed`: the YAML's), or the one its row names in
    column `key` (format.workflow_key / reward_fn_key). NOTE: a row is data, not config: it may name a registered
    workflow or reward function (an unknown name fails the task as its workflow is built) or the one the YAML gives
    this taskset, never code to import (`module:attr`, `path/file.py:attr`), which only the YAML may name."""
    if not key:
        return listed
    value = row.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or (value != listed and (":" in value or "/" in value or "\\" in value)):
        raise DataError(f"{where}: column {key!r} names the {kind} {str(value)[:80]!r}: a row may name a registered "
                        f"{kind} or this taskset's own ({listed!r}), never code to import (module:attr or a file "
                        "path), which only the YAML may name")
    return value


def load_tasks(ts: TasksetConfig, is_eval: bool = False) -> list[Task]:
    """Every row of a (derived) taskset as a Task, in file order. Fails on the first bad row."""
    tasks = []
    rows = read_rows(ts.path, ts.subset_name, ts.split)
    bar = tqdm(rows, desc=f"taskset {ts.name}", unit=" rows", disable=not ts.enable_progress_bar)
    for index, (file, rownum, row) in enumerate(bar):
        where = f"taskset {ts.name}: {file}: row {rownum}"
        f = format_row(row, ts.format, where)
        fmt = ts.format
        tasks.append(Task(
            taskset=ts.name, index=index, epoch=0, raw=row, prompt=f["prompt"], messages=f["messages"],
            reference=f.get("reference"), tools=f["tools"],
            workflow=named(row, fmt.workflow_key, ts.default_workflow_type, where, "workflow"),
            reward_fn=named(row, fmt.reward_fn_key, ts.default_reward_fn_type, where, "reward function"),
            workflow_args=ts.workflow_args, reward_fn_args=ts.reward_fn_args, rollout_args=ts.rollout_args,
            repeat_times=ts.repeat_times or 1, is_eval=is_eval, chat_template=fmt.chat_template,
            reply_prefix=fmt.reply_prefix,
        ))
    if not tasks:
        raise DataError(f"taskset {ts.name}: {ts.path} ({ts.split}) has no rows")
    return tasks


class TaskReader:
    """Training tasks over epochs: several tasksets interleaved, a seeded order, a position to save.

        reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=cfg.buffer.total_epochs)
        reader.load_state(saved)        # resume: {"epoch": e, "index": i}
        batch = reader.read(batch_size) # [] once every epoch is done

    Within an epoch each taskset keeps its own order (sequential, a seeded per-epoch shuffle, or seeded
    sampling with replacement), and tasksets are interleaved in proportion to their sizes.
    """

    def __init__(self, tasksets: list[TasksetConfig], total_epochs: int = 1) -> None:
        self.sets = [(ts, load_tasks(ts)) for ts in tasksets]
        self.total_epochs = total_epochs
        self.epoch, self.index = 0, 0
        self._order: tuple[int, list[tuple[int, int]]] | None = None

    def __len__(self) -> int:
        """Tasks per epoch."""
        return sum(len(tasks) for _, tasks in self.sets)

    def order(self, epoch: int) -> list[tuple[int, int]]:
        """(taskset number, row index) of every task of one epoch, in reading order."""
        keyed = []
        for i, (ts, tasks) in enumerate(self.sets):
            n, sel = len(tasks), ts.data_selector
            rng = random.Random(f"{sel.seed}/{epoch}")  # NOTE: str seeds hash deterministically across runs
            rows = {"sequential": lambda: list(range(n)), "shuffle": lambda: rng.sample(range(n), n),
                    "random": lambda: rng.choices(range(n), k=n)}[sel.selector_type]()
            keyed += [((k + 0.5) / n, i, row) for k, row in enumerate(rows)]
        return [(i, row) for _, i, row in sorted(keyed)]

    def read(self, n: int) -> list[Task]:
        """The next n tasks (fewer at the very end; none when all epochs are done)."""
        out = []
        while len(out) < n and self.epoch < self.total_epochs:
            if self._order is None or self._order[0] != self.epoch:
                self._order = (self.epoch, self.order(self.epoch))
            order = self._order[1]
            take = order[self.index : self.index + n - len(out)]
            out += [dataclasses.replace(self.sets[i][1][row], epoch=self.epoch) for i, row in take]
            self.index += len(take)
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "sizes": [len(t) for _, t in self.sets]}

    def load_state(self, state: dict) -> None:
        sizes = [len(t) for _, t in self.sets]
        if state.get("sizes", sizes) != sizes:
            raise DataError(f"saved taskset position is for tasksets of sizes {state['sizes']}, these have {sizes}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
