"""buffer.py: the experience DB that explorers write and the trainer reads, and the taskset readers.

    from buffer import Experience, ExperienceDB
    db = ExperienceDB("sqlite:///runs/gsm8k/buffer.db")
    db.write([Experience(tokens=ids, prompt_length=200, logprobs=lp, reward=1.0, group_id="t7")])
    batch = db.claim(64, step=12, timeout=30.0)   # waits up to 30 s for 64 unclaimed experiences

    reader = TaskReader(cfg.buffer.explorer_input.tasksets, total_epochs=1)
    tasks = reader.read(cfg.buffer.batch_size)    # Task objects; reader.state() is the saved position

The DB is one SQLite file in WAL mode, so any number of explorer processes can write while one
trainer process claims. Schema (version SCHEMA_VERSION, stored in `meta`):
  - experiences: one row per experience, plain columns that the `sqlite3` CLI shows (explorer,
    model_version, group_id, run_id, task_id, reward, prompt/response length), plus use_count (how
    many train steps used the row), last_claimed (unix time) and dropped_step (the train step whose
    staleness bound dropped it unused; NULL if it was not dropped).
  - payloads(id, tensors, meta): per experience, a safetensors blob of its tensors and a JSON text of
    everything else (info, metrics, texts, truncate_status). No pickle anywhere.
  - claims(exp_id, step, claimed): which train step used which experience, one row per use; this
    is what lets a trainer resumed at step S give back the experiences that steps > S had taken.
  - meta(key, value): schema_version plus free key/values: the model fingerprint (`check_identity`),
    each explorer's position and state (`explorer/<name>`), the trainer's state (`trainer`).
Every experience is written once and is then pending, claimed (used by >= 1 train step) or dropped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import sqlite3
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import safetensors.numpy
import safetensors.torch
import torch

if TYPE_CHECKING:  # annotations only: `import buffer` (for Experience) must not pull in the config loader and algos/
    from configs.schema import FormatConfig, GenerationConfig, TasksetConfig

log = logging.getLogger("nanorft.buffer")

# --- experiences

SCHEMA_VERSION = 2  # 2: experiences.dropped_step

# Stored dtype of each tensor field. Token ids go in as int32 (vocabularies are < 2**31) and come
# back as torch.long, which is what embedding layers want; masks are bool; the rest float32.
TENSOR_FIELDS = {"tokens": torch.int32, "chosen": torch.int32, "rejected": torch.int32,
                 "action_mask": torch.bool, "logprobs": torch.float32, "token_level_reward": torch.float32,
                 "advantages": torch.float32, "returns": torch.float32, "teacher_logprobs": torch.float32}
COLUMNS = ("explorer", "model_version", "group_id", "run_id", "task_id", "reward", "prompt_length")
SELECT_ROWS = (f"SELECT e.id, p.tensors, p.meta, {', '.join('e.' + c for c in COLUMNS)}"
               " FROM experiences e JOIN payloads p ON p.id = e.id WHERE e.id IN ({})")


@dataclass
class Experience:
    """One response to one task: what an explorer writes and the trainer reads.

    Shapes: L = len(tokens), R = L - prompt_length response tokens."""

    tokens: torch.Tensor  # [L] long, prompt + response token ids (DPO: prompt only)
    prompt_length: int  # number of prompt tokens at the start of `tokens`
    logprobs: torch.Tensor | None = None  # [R] float32, rollout engine log-probs of the response
    action_mask: torch.Tensor | None = None  # [R] bool, False = not an action (None: all are)
    reward: float | None = None  # scalar reward of the whole response
    token_level_reward: torch.Tensor | None = None  # [R] float32
    advantages: torch.Tensor | None = None  # [R] float32
    returns: torch.Tensor | None = None  # [R] float32
    teacher_logprobs: torch.Tensor | None = None  # [R] float32, for distillation
    chosen: torch.Tensor | None = None  # [Rc] long, DPO preferred response ids (prompt in `tokens`)
    rejected: torch.Tensor | None = None  # [Rr] long, DPO dispreferred response ids
    group_id: str = ""  # shared by the repeats of one task
    run_id: int = 0  # repeat index within the group
    task_id: str = ""
    model_version: int = 0  # weights version that generated the response
    explorer: str = ""  # name of the explorer that wrote it
    truncate_status: str | None = None  # None, "prompt_truncated" or "response_truncated"
    info: dict = field(default_factory=dict)  # free JSON-serialisable data
    metrics: dict = field(default_factory=dict)  # JSON-serialisable numbers, logged by the trainer
    prompt_text: str = ""
    response_text: str = ""
    id: int | None = None  # row id, set when read back from the DB

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


def serialise(exp: Experience) -> tuple[bytes, str]:
    """Experience -> (safetensors blob of its tensors, JSON text of its other non-column fields)."""
    arrays = {name: t.detach().to("cpu", dtype).contiguous().numpy()
              for name, dtype in TENSOR_FIELDS.items() if (t := getattr(exp, name)) is not None}
    # NOTE: safetensors.numpy.save writes the same bytes as safetensors.torch.save ~4x faster on small
    # tensors (45 vs 200 us per experience here); serialising is a large part of write()'s cost.
    blob = safetensors.numpy.save(arrays)
    meta = {"truncate_status": exp.truncate_status, "info": exp.info, "metrics": exp.metrics,
            "prompt_text": exp.prompt_text, "response_text": exp.response_text}
    return blob, json.dumps(meta, ensure_ascii=False)


def deserialise(blob: bytes, meta: str, **columns: Any) -> Experience:
    """Inverse of `serialise`; `columns` are the plain columns (COLUMNS and id).
    Token id tensors come back as torch.long, the others in their stored dtype."""
    tensors = safetensors.torch.load(blob)
    for name, t in tensors.items():
        if TENSOR_FIELDS[name] == torch.int32:
            tensors[name] = t.long()
    return Experience(**tensors, **json.loads(meta), **columns)


class DBMismatch(RuntimeError):
    """This experience DB cannot be shared with this process: another schema version or another model."""


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Cursor]:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any exception.

    IMMEDIATE takes the write lock up front (waiting up to the busy timeout). A plain BEGIN would
    start as a reader and fail with SQLITE_BUSY at its first write if another process wrote in
    between, without waiting."""
    cur = conn.cursor()
    cur.execute("BEGIN IMMEDIATE")
    try:
        yield cur
        cur.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            cur.execute("ROLLBACK")
        raise


def sqlite_path(url: str) -> str:
    """'sqlite:///rel.db' -> 'rel.db', 'sqlite:////abs/x.db' -> '/abs/x.db', a plain path as is."""
    return url.removeprefix("sqlite:///")


# SQL is kept portable where it costs nothing. SQLite-specific bits: AUTOINCREMENT, BLOB, the
# PRAGMAs, BEGIN IMMEDIATE, and last_insert_rowid() in write() (PostgreSQL: SERIAL, BYTEA,
# SELECT ... FOR UPDATE SKIP LOCKED, INSERT ... RETURNING id).
SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    id INTEGER PRIMARY KEY AUTOINCREMENT, created REAL, explorer TEXT, model_version INTEGER,
    group_id TEXT, run_id INTEGER, task_id TEXT, reward REAL, prompt_length INTEGER,
    response_length INTEGER, use_count INTEGER NOT NULL DEFAULT 0, last_claimed REAL, dropped_step INTEGER);
CREATE TABLE IF NOT EXISTS payloads (id INTEGER PRIMARY KEY, tensors BLOB NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS claims (
    exp_id INTEGER NOT NULL, step INTEGER NOT NULL, claimed REAL NOT NULL);
CREATE INDEX IF NOT EXISTS experiences_pending ON experiences (id) WHERE use_count = 0 AND dropped_step IS NULL;
CREATE INDEX IF NOT EXISTS claims_step ON claims (step);
CREATE INDEX IF NOT EXISTS claims_exp ON claims (exp_id);
"""
# NOTE: the blobs live in `payloads` (same id), not in `experiences`: a claim updates use_count and
# last_claimed, and SQLite rewrites a changed row whole, overflow pages included. With ~8 KB blobs in
# the row, that rewrite was half the cost of a claim (docs/LOG.md); small rows also keep scans cheap.


class ExperienceDB:
    """Experiences in one SQLite file, shared by explorer processes (writers) and the trainer.

        with ExperienceDB("sqlite:///buffer.db") as db:
            ids = db.write(exps)                            # explorer: one transaction per batch
            batch = db.claim(64, step=3, timeout=30.0)      # trainer: wait for 64, mark them used
            db.release_after(2)                             # trainer resumed at step 2: undo step 3
            print(db.counts())                              # {'total': ..., 'pending': ..., ...}
    """

    def __init__(self, url: str, busy_timeout: float = 60.0) -> None:
        self.path = sqlite_path(url)
        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        # isolation_level=None: autocommit, so the module never opens transactions behind our
        # back; every write goes through `transaction` (BEGIN IMMEDIATE).
        self.conn = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        # WAL: readers never block writers, nor vice versa. NOTE: switching a new file to WAL needs
        # an exclusive lock, and when several processes open the same new file at once SQLite
        # answers "database is locked" without waiting (deadlock avoidance), hence the retry.
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                self.conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        # NORMAL: no fsync per commit; the WAL stays consistent, a power cut may lose the last commits.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        with transaction(self.conn) as cur:
            cur.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            row = cur.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None and row[0] != str(SCHEMA_VERSION):
                raise DBMismatch(f"{self.path}: experience DB has schema version {row[0]}, this "
                                 f"buffer.py expects {SCHEMA_VERSION}; use a new DB path")
            for statement in SCHEMA.split(";"):
                cur.execute(statement)
            cur.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)"
                        " ON CONFLICT (key) DO NOTHING", (str(SCHEMA_VERSION),))

    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def meta_items(self, prefix: str) -> dict[str, str]:
        """Every meta key/value whose key starts with `prefix` (e.g. "explorer/": each explorer's state)."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
        return dict(rows.fetchall())

    def set_meta(self, key: str, value: str, *, overwrite: bool = True) -> str:
        """Store key=value and return the stored value. With overwrite=False an existing value is
        kept and returned, so a caller can compare it with its own (e.g. a model fingerprint)."""
        conflict = "DO UPDATE SET value = excluded.value" if overwrite else "DO NOTHING"
        with transaction(self.conn) as cur:
            cur.execute(f"INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) {conflict}",
                        (key, value))
            return cur.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0]

    def write(self, exps: list[Experience], meta: dict[str, str] | None = None,
              explorer: tuple[str, dict] | None = None) -> list[int]:
        """Insert experiences in one transaction; returns their row ids, in order.

        `meta` key/values, and `explorer` = (name, state) as set_explorer_state would store it, are set in the
        same transaction: an explorer stores its taskset position this way, so that its position and its
        experiences can never disagree after a crash."""
        if explorer is not None:
            meta = {**(meta or {}), f"explorer/{explorer[0]}": json.dumps(explorer[1])}
        now = time.time()
        rows = [(now, e.explorer, e.model_version, e.group_id, e.run_id, e.task_id, e.reward,
                 e.prompt_length, e.response_length, *serialise(e)) for e in exps]
        with transaction(self.conn) as cur:
            cur.executemany("INSERT INTO meta (key, value) VALUES (?, ?)"
                            " ON CONFLICT (key) DO UPDATE SET value = excluded.value", list((meta or {}).items()))
            if not rows:
                return []
            cur.executemany(
                "INSERT INTO experiences (created, explorer, model_version, group_id, run_id, task_id,"
                " reward, prompt_length, response_length) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [row[:-2] for row in rows])
            # NOTE: we hold the write lock and AUTOINCREMENT gives max+1 to each insert, so the
            # ids are consecutive and end at last_insert_rowid() (executemany leaves lastrowid
            # unset).
            last = cur.execute("SELECT last_insert_rowid()").fetchone()[0]
            ids = list(range(last - len(rows) + 1, last + 1))
            cur.executemany("INSERT INTO payloads (id, tensors, meta) VALUES (?, ?, ?)",
                            [(i, *row[-2:]) for i, row in zip(ids, rows)])
        return ids

    def claim(self, n: int, step: int, *, timeout: float = 0.0, priority: bool = False,
              reuse_cooldown: float | None = None, decay: float = 2.0, min_version: int | None = None,
              partial: bool = True, waiting: Callable[[int, float], bool] | None = None) -> list[Experience]:
        """Atomically take up to n experiences for train step `step`; wait up to `timeout` s for n.

        Queue order (default): oldest unclaimed first. priority=True (Trinity's linear_decay):
        highest model_version - decay * use_count first, newest first on ties; a used experience is
        eligible again `reuse_cooldown` seconds after its last claim (never, if None).
        min_version (staleness control): pending experiences of older versions are marked dropped by
        this step (counted, never trained on) and only versions >= min_version are taken.
        While fewer than n are there, `waiting(available, waited_seconds)` is called at each poll;
        True means "no more will come": take what is there now. When the timeout runs out, take what
        is there if `partial`, else nothing. Returns the experiences in claim order with `id` set."""
        if reuse_cooldown is not None and not priority:
            raise ValueError("reuse_cooldown needs priority=True (queue order never reuses)")
        # NOTE: the literal predicate of the partial index, so that SQLite uses it
        eligible, order = "use_count = 0 AND dropped_step IS NULL", "id"
        if priority:
            order = f"model_version - {float(decay)!r} * use_count DESC, id DESC"
            if reuse_cooldown is not None:
                eligible = "((use_count = 0 AND dropped_step IS NULL) OR (use_count > 0 AND last_claimed <= ?))"
        if min_version is not None:
            eligible += " AND model_version >= ?"
        start, pause, take = time.monotonic(), 0.005, False  # take: waiting() said no more will come
        while True:
            now = time.time()
            args = ([now - reuse_cooldown] if priority and reuse_cooldown is not None else []) + (
                [min_version] if min_version is not None else [])
            waited = time.monotonic() - start
            # NOTE: look and claim under one write lock, and claim only when n are there or waiting is
            # over: a reader that took partial batches while waiting would starve another reader.
            with transaction(self.conn) as cur:
                if min_version is not None:
                    cur.execute("UPDATE experiences SET dropped_step = ? WHERE use_count = 0 AND dropped_step IS NULL"
                                " AND model_version < ?", (step, min_version))
                # Ids first (a scan of small rows), payloads second, for the chosen ids only.
                ids = [row[0] for row in cur.execute(
                    f"SELECT id FROM experiences WHERE {eligible} ORDER BY {order} LIMIT ?", (*args, n))]
                done = len(ids) >= n or take or waited >= timeout
                if done and len(ids) < n and not take and not partial:
                    ids = []
                if done:
                    cur.executemany("UPDATE experiences SET use_count = use_count + 1,"
                                    " last_claimed = ? WHERE id = ?", [(now, i) for i in ids])
                    cur.executemany("INSERT INTO claims (exp_id, step, claimed) VALUES (?, ?, ?)",
                                    [(i, step, now) for i in ids])
                    rows = cur.execute(SELECT_ROWS.format(", ".join("?" * len(ids))), ids).fetchall()
                    break
            # NOTE: outside the transaction: the callback may write to the DB itself (the trainer's status)
            if waiting is not None and waiting(len(ids), waited):
                take = True
                continue
            time.sleep(min(pause, max(timeout - waited, 0.0)))
            # NOTE: capped at 20 ms: in mode both the trainer waits here for every step's rollout, and a longer
            # pause was latency added to every step (a poll costs ~0.1 ms)
            pause = min(pause * 1.5, 0.02)
        if 0 < len(ids) < n:
            log.warning(f"read incomplete batch: {len(ids)} of {n} experiences after {waited:.1f} s")
        # Deserialise after COMMIT so that the write lock is held only for the SQL.
        by_id = {id: deserialise(blob, meta, id=id, **dict(zip(COLUMNS, cols)))
                 for id, blob, meta, *cols in rows}
        return [by_id[i] for i in ids]

    def get(self, ids: list[int]) -> list[Experience]:
        """The experiences with these row ids, in that order, without claiming them (the trainer's
        other ranks read what rank 0 claimed)."""
        rows = self.conn.execute(SELECT_ROWS.format(", ".join("?" * len(ids))), ids).fetchall()
        by_id = {id: deserialise(blob, meta, id=id, **dict(zip(COLUMNS, cols))) for id, blob, meta, *cols in rows}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise KeyError(f"{self.path}: no experiences with ids {missing[:5]}")
        return [by_id[i] for i in ids]

    def release_after(self, step: int) -> int:
        """Undo the claims (and staleness drops) of train steps > `step`, for a trainer resumed from
        checkpoint `step`: those experiences become claimable again as if never used. Returns the
        claims released."""
        with transaction(self.conn) as cur:
            released = cur.execute("SELECT exp_id, COUNT(*) FROM claims WHERE step > ?"
                                   " GROUP BY exp_id", (step,)).fetchall()
            cur.execute("DELETE FROM claims WHERE step > ?", (step,))
            cur.execute("UPDATE experiences SET dropped_step = NULL WHERE dropped_step > ?", (step,))
            # last_claimed goes back to the latest remaining claim, or NULL if none is left.
            cur.executemany("UPDATE experiences SET use_count = use_count - ?, last_claimed ="
                            " (SELECT MAX(claimed) FROM claims WHERE exp_id = experiences.id)"
                            " WHERE id = ?",
                            [(count, exp_id) for exp_id, count in released])
        return sum(count for _, count in released)

    # --- the trainer / explorer handshake: what each side last recorded (their only channel besides weights)

    def set_trainer_status(self, step: int, status: str) -> None:
        """The trainer's state, which a waiting explorer reads: its last finished step and "training",
        "waiting" (for experiences), "finished" or "stopped" (on an error; a restart continues)."""
        self.set_meta("trainer", json.dumps({"step": step, "status": status, "time": time.time(), "pid": os.getpid()}))

    def trainer_status(self) -> dict | None:
        """{step, status, time, pid} as the trainer last set it; None before any trainer used this DB."""
        return json.loads(self.get_meta("trainer") or "null")

    def set_explorer_state(self, name: str, state: dict) -> None:
        """Explorer `name`'s state: {step, reader (its taskset position), model_version, time, finished}."""
        self.set_meta(f"explorer/{name}", json.dumps(state))

    def explorer_states(self) -> dict[str, dict]:
        """Every explorer that wrote to this DB: name -> its last state."""
        return {k.removeprefix("explorer/"): json.loads(v) for k, v in self.meta_items("explorer/").items()}

    def explorers_finished(self) -> bool:
        """True once at least one explorer wrote to this DB and every one of them has finished."""
        states = self.explorer_states().values()
        return bool(states) and all(x.get("finished") for x in states)

    def counts(self) -> dict[str, int]:
        """Row counts: total = pending (never claimed) + claimed (at least once) + dropped; claims."""
        # One statement, so that the counts come from one snapshot even while others write.
        total, pending, dropped, claims = self.conn.execute(
            "SELECT (SELECT COUNT(*) FROM experiences), (SELECT COUNT(*) FROM experiences WHERE use_count = 0"
            " AND dropped_step IS NULL), (SELECT COUNT(*) FROM experiences WHERE dropped_step IS NOT NULL),"
            " (SELECT COUNT(*) FROM claims)").fetchone()
        return {"total": total, "pending": pending, "claimed": total - pending - dropped, "dropped": dropped,
                "claims": claims}

    def check_identity(self, identity: dict, who: str) -> None:
        """Refuse to share this DB between processes of different models: the first process stores
        `identity` (models.fingerprint: architecture and tokenizer), later ones must match it."""
        stored = json.loads(self.set_meta("identity", json.dumps(identity, sort_keys=True), overwrite=False))
        if stored != identity:
            diff = [f"{k}: DB has {stored.get(k)!r}, {who} has {identity.get(k)!r}"
                    for k in sorted(set(stored) | set(identity)) if stored.get(k) != identity.get(k)]
            raise DBMismatch(f"{self.path}: this experience DB was written for another model or tokenizer "
                             f"({'; '.join(diff)}). Point buffer.trainer_input.experience_buffer.path at "
                             "another DB, or use the same model.model_path on both sides.")

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ExperienceDB":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- tasksets


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
        files = sorted(
            f for ext in _BUILDERS for pat in (f"{split}{ext}", f"{split}-*{ext}", f"{split}_*{ext}") for f in folder.glob(pat)
        )
        if files:
            return files
    raise DataError(f"{root}: no {split!r} split (looked for {split}.jsonl/.json/.parquet/.csv and {split}-*.* here and in data/)")


def read_rows(path: str, subset_name: str | None = None, split: str = "train") -> list[tuple[str, int, dict]]:
    """Rows as (file, row number, row) from local files, or from the hub when `path` is not local."""
    import datasets  # slow to import; only readers need it

    datasets.disable_progress_bars()
    if Path(path).expanduser().exists():
        rows = []
        for f in find_data_files(path, subset_name, split):
            ds = datasets.load_dataset(_BUILDERS.get(f.suffix, "json"), data_files=str(f), split="train")
            rows += [(str(f), i, row) for i, row in enumerate(ds)]
        return rows
    try:
        ds = datasets.load_dataset(path, subset_name, split=split)
    except Exception as e:  # offline, unknown name, ...: say what was tried
        raise DataError(
            f"{path!r} is not a local file or folder, and loading it from the Hugging Face hub "
            f"(subset {subset_name!r}, split {split!r}) failed: {type(e).__name__}: {e}"
        ) from e
    return [(f"hub:{path}", i, row) for i, row in enumerate(ds)]


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
    system = _column(row, fmt.system_prompt_key, where, "format.system_prompt_key") if fmt.system_prompt_key else fmt.system_prompt
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
            out["messages"] = msgs + [{"role": "assistant", "content": str(_column(row, fmt.response_key, where, "format.response_key"))}]
    if kind == "dpo":
        out["chosen"] = _column(row, fmt.chosen_key, where, "format.chosen_key")
        out["rejected"] = _column(row, fmt.rejected_key, where, "format.rejected_key")
    return out


def load_tasks(ts: TasksetConfig, is_eval: bool = False) -> list[Task]:
    """Every row of a (derived) taskset as a Task, in file order. Fails on the first bad row."""
    tasks = []
    for index, (file, rownum, row) in enumerate(read_rows(ts.path, ts.subset_name, ts.split)):
        where = f"taskset {ts.name}: {file}: row {rownum}"
        f = format_row(row, ts.format, where)
        fmt = ts.format
        tasks.append(Task(
            taskset=ts.name, index=index, epoch=0, raw=row, prompt=f["prompt"], messages=f["messages"],
            reference=f.get("reference"), tools=f["tools"],
            workflow=row.get(fmt.workflow_key) if fmt.workflow_key else ts.default_workflow_type,
            reward_fn=row.get(fmt.reward_fn_key) if fmt.reward_fn_key else ts.default_reward_fn_type,
            workflow_args=ts.workflow_args, reward_fn_args=ts.reward_fn_args, rollout_args=ts.rollout_args,
            repeat_times=ts.repeat_times or 1, is_eval=is_eval,
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
