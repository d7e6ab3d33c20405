"""buffer.py: the experience DB that explorers write and the trainer reads.

    from buffer import Experience, ExperienceDB
    db = ExperienceDB("sqlite:///runs/gsm8k/buffer.db")
    db.write([Experience(tokens=ids, prompt_length=200, logprobs=lp, reward=1.0, group_id="t7")])
    batch = db.claim(64, step=12, timeout=30.0)   # waits up to 30 s for 64 unclaimed experiences

The DB is one SQLite file in WAL mode, so any number of explorer processes can write while one
trainer process claims; or, for explorers on other hosts, a PostgreSQL database
(`postgresql://user:password@host:5432/db`, through psycopg 3: the `postgres` extra) with the same tables,
the same SQL where it can be the same, and the same semantics (the connections, and a PostgreSQL connection lost
under a running process: dbconn.py). Schema (version SCHEMA_VERSION, stored in `meta`):
  - experiences: one row per experience, plain columns that the `sqlite3` CLI shows (explorer,
    model_version, group_id, run_id, task_id, reward, prompt/response length, spans: the versions that sampled a
    response whose weights changed while it ran, JSON [[first token, version], ...], else NULL), plus use_count (how
    many train steps used the row), last_claimed (unix time) and dropped_step (the train step whose
    staleness bound dropped it unused; NULL if it was not dropped).
  - payloads(id, tensors, meta): per experience, a safetensors blob of its tensors and a JSON text of
    everything else (info, metrics, texts, truncate_status). No pickle anywhere.
  - claims(exp_id, step, claimed): which train step used which experience, one row per use; this
    is what lets a trainer resumed at step S give back the experiences that steps > S had taken.
  - replays(exp_id, step, advantages): with reuse (the priority queue with a cooldown), the advantages the trainer
    computed at an experience's first use (train step `step`), safetensors bytes; a reuse trains on them again.
  - trained(exp_id, step, tensors): what train step `step` trained an experience on, per response token: a
    safetensors blob of its advantages [R] and, where the trainer computed them, its logprobs [R] (the step's
    old_logprobs); one row per use (for whoever reads the DB: the studio's experience viewer; the trainer never does).
  - meta(key, value): schema_version plus free key/values: the model fingerprint (`check_identity`),
    each explorer's position and state (`explorer/<name>`), the trainer's state (`trainer`).
Every experience is written once and is then pending, claimed (used by >= 1 train step) or dropped.
A full, read-only or failing disk, or a damaged DB file, ends a call in DBFault (a DBMismatch: named, no traceback),
the failed transaction rolled back (dbconn.py).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import safetensors.numpy
import safetensors.torch
import torch

# NOTE: the back-ends live in dbconn.py; these names are buffer's too (its users import them from here)
from dbconn import (  # noqa: F401
    DBBusy,
    DBFault,
    DBMismatch,
    DBUnavailable,
    PostgresLink,
    db_timeout,
    is_postgres,
    open_sqlite,
    shown,
    sqlite_faults,
    sqlite_path,
    transaction,
)

log = logging.getLogger("nanorft.buffer")
T = TypeVar("T")

# --- experiences

# 2: experiences.dropped_step; 3: replays; 4: experiences.spans; 5: trained (a version 2, 3 or 4 DB is upgraded in
# place: `_upgrade`)
SCHEMA_VERSION = 5

# Stored dtype of each tensor field. Token ids go in as int32 (vocabularies are < 2**31) and come
# back as torch.long, which is what embedding layers want; masks are bool; the rest float32.
TENSOR_FIELDS = {
    "tokens": torch.int32,
    "action_mask": torch.bool,
    "logprobs": torch.float32,
    "advantages": torch.float32,
    "teacher_logprobs": torch.float32,
}
COLUMNS = ("explorer", "model_version", "group_id", "run_id", "task_id", "reward", "prompt_length", "spans")
SELECT_ROWS = (
    f"SELECT e.id, p.tensors, p.meta, {', '.join('e.' + c for c in COLUMNS)}, r.advantages"
    " FROM experiences e JOIN payloads p ON p.id = e.id LEFT JOIN replays r ON r.exp_id = e.id WHERE e.id IN ({})"
)


@dataclass
class Experience:
    """One response to one task: what an explorer writes and the trainer reads.

    Shapes: L = len(tokens), R = L - prompt_length response tokens.

    Trinity-RFT's Experience also has token_level_reward, returns and chosen / rejected; they are left out because
    nothing here reads them, and a workflow that set one would see it ignored (now: a TypeError). The trainer places
    the scalar reward itself and computes the returns; a DPO pair is two experiences sharing a group_id
    (source.dpo_experiences). A DB written when they existed still reads: deserialise drops the tensors it no longer
    knows. teacher_logprobs (on-policy distillation) was among them once and is back: a blob without it reads as
    None."""

    tokens: torch.Tensor  # [L] long, prompt + response token ids
    prompt_length: int  # number of prompt tokens at the start of `tokens`
    logprobs: torch.Tensor | None = None  # [R] float32, rollout engine log-probs of the response
    action_mask: torch.Tensor | None = None  # [R] bool, False = not an action (None: all are)
    reward: float | None = None  # scalar reward of the whole response
    advantages: torch.Tensor | None = None  # [R] float32, an explorer-side advantage fn's (step_wise_grpo)
    # [R] float32, a teacher's log-probs of the response tokens (on_policy_distill_workflow; algos/on_policy_distill)
    teacher_logprobs: torch.Tensor | None = None
    group_id: str = ""  # shared by the repeats of one task
    run_id: int = 0  # repeat index within the group (like task_id: a DB column, for whoever reads the DB)
    task_id: str = ""
    model_version: int = 0  # weights version that generated the response (the oldest, when `spans` holds several)
    # [(first response token index, version)] where the weights that sampled the response change (explorer.
    # partial_rollout: an update while it ran), in order; empty: every token is model_version's. In the DB: the
    # spans column, JSON text (NULL when empty)
    spans: list[tuple[int, int]] = field(default_factory=list)
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
    arrays = {
        name: t.detach().to("cpu", dtype).contiguous().numpy()
        for name, dtype in TENSOR_FIELDS.items()
        if (t := getattr(exp, name)) is not None
    }
    # NOTE: safetensors.numpy.save writes the same bytes as safetensors.torch.save ~4x faster on small
    # tensors (45 vs 200 us per experience here); serialising is a large part of write()'s cost.
    blob = safetensors.numpy.save(arrays)
    meta = {
        "truncate_status": exp.truncate_status,
        "info": exp.info,
        "metrics": exp.metrics,
        "prompt_text": exp.prompt_text,
        "response_text": exp.response_text,
    }
    return blob, json.dumps(meta, ensure_ascii=False)


def deserialise(blob: bytes, meta: str, **columns: Any) -> Experience:
    """Inverse of `serialise`; `columns` are the plain columns (COLUMNS and id).
    Token id tensors come back as torch.long, the others in their stored dtype. A tensor of a field that Experience
    no longer has (token_level_reward, returns, chosen, rejected: an older buffer.py's) is dropped."""
    tensors = {name: t for name, t in safetensors.torch.load(blob).items() if name in TENSOR_FIELDS}
    for name, t in tensors.items():
        if TENSOR_FIELDS[name] == torch.int32:
            tensors[name] = t.long()
    spans = columns.pop("spans", None)  # the column's JSON text, serialise_many's list, or NULL / absent
    spans = json.loads(spans) if isinstance(spans, str) else spans or []
    return Experience(**tensors, **json.loads(meta), **columns, spans=[(int(a), int(v)) for a, v in spans])


def spans_column(exp: Experience) -> str | None:
    """The spans column of an experience: its spans as JSON text, NULL when it has none (one version)."""
    return json.dumps([[int(a), int(v)] for a, v in exp.spans]) if exp.spans else None


def from_rows(rows: list) -> dict[int, Experience]:
    """SELECT_ROWS' rows as experiences by id; one with a replays row carries the advantages of its first use."""
    out = {}
    for id, blob, meta, *cols, replay in rows:
        out[id] = deserialise(blob, meta, id=id, **dict(zip(COLUMNS, cols)))
        if replay is not None:
            out[id].advantages = safetensors.torch.load(bytes(replay))["advantages"]
    return out


def serialise_many(exps: list[Experience]) -> bytes:
    """Experiences as one byte string (to send them between trainer ranks; no pickle): per experience the
    lengths of its safetensors blob and of its JSON (the other fields and the columns), then both."""
    parts = []
    for exp in exps:
        blob, meta = serialise(exp)
        head = json.dumps({"meta": meta, "columns": {c: getattr(exp, c) for c in (*COLUMNS, "id")}}).encode()
        parts += [len(blob).to_bytes(8, "little"), len(head).to_bytes(8, "little"), blob, head]
    return b"".join(parts)


def deserialise_many(data: bytes) -> list[Experience]:
    """Inverse of `serialise_many`."""
    out, at = [], 0
    while at < len(data):
        n_blob, n_head = int.from_bytes(data[at : at + 8], "little"), int.from_bytes(data[at + 8 : at + 16], "little")
        blob, head = data[at + 16 : at + 16 + n_blob], json.loads(data[at + 16 + n_blob : at + 16 + n_blob + n_head])
        out.append(deserialise(blob, head["meta"], **head["columns"]))
        at += 16 + n_blob + n_head
    return out


# --- the two back-ends: a SQLite file, or a PostgreSQL database


# One schema for both back-ends, with their type names filled in. SQLite's REAL is 8 bytes, PostgreSQL's 4: there
# it is DOUBLE PRECISION (a 4-byte float cannot tell two unix times 100 s apart). The other differences are in
# ExperienceDB: BEGIN IMMEDIATE vs BEGIN + FOR UPDATE SKIP LOCKED, last_insert_rowid() vs INSERT ... RETURNING id.
SCHEMA = """
CREATE TABLE IF NOT EXISTS experiences (
    id {id}, created {real}, explorer TEXT, model_version INTEGER,
    group_id TEXT, run_id INTEGER, task_id TEXT, reward {real}, prompt_length INTEGER,
    response_length INTEGER, use_count INTEGER NOT NULL DEFAULT 0, last_claimed {real}, dropped_step INTEGER,
    spans TEXT);
CREATE TABLE IF NOT EXISTS payloads (id {int} PRIMARY KEY, tensors {blob} NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS claims (
    exp_id {int} NOT NULL, step INTEGER NOT NULL, claimed {real} NOT NULL);
CREATE INDEX IF NOT EXISTS experiences_pending ON experiences (id) WHERE use_count = 0 AND dropped_step IS NULL;
CREATE INDEX IF NOT EXISTS claims_step ON claims (step);
CREATE INDEX IF NOT EXISTS claims_exp ON claims (exp_id);
{replays};
{trained}
"""
# Version 3's table (and all that upgrading a version 2 DB adds).
REPLAYS = """
CREATE TABLE IF NOT EXISTS replays (exp_id {int} PRIMARY KEY, step INTEGER NOT NULL, advantages {blob} NOT NULL);
CREATE INDEX IF NOT EXISTS replays_step ON replays (step)
"""
# Version 5's table (what upgrading a version 2, 3 or 4 DB adds): one row per (experience, train step that used it)
TRAINED = """
CREATE TABLE IF NOT EXISTS trained (
    exp_id {int} NOT NULL, step INTEGER NOT NULL, tensors {blob} NOT NULL, PRIMARY KEY (exp_id, step));
CREATE INDEX IF NOT EXISTS trained_step ON trained (step)
"""
TYPES = {
    "sqlite": {"id": "INTEGER PRIMARY KEY AUTOINCREMENT", "int": "INTEGER", "real": "REAL", "blob": "BLOB"},
    "postgresql": {
        "id": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
        "int": "BIGINT",
        "real": "DOUBLE PRECISION",
        "blob": "BYTEA",
    },
}
INSERT_EXPERIENCES = (
    "INSERT INTO experiences (created, explorer, model_version, group_id, run_id, task_id, reward,"
    " prompt_length, response_length, spans) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# Version 4's column (what upgrading a version 3 DB adds): NULL for the rows it holds (one version each)
SPANS_COLUMN = "ALTER TABLE experiences ADD COLUMN spans TEXT"
SETUP_LOCK = 0x6E616E6F  # PostgreSQL advisory lock key of ExperienceDB's set-up ("nano")
# NOTE: the blobs live in `payloads` (same id), not in `experiences`: a claim updates use_count and
# last_claimed, and SQLite rewrites a changed row whole, overflow pages included. With ~8 KB blobs in
# the row, that rewrite was half the cost of a claim (docs/LOG.md); small rows also keep scans cheap.


@dataclass(frozen=True)
class _Eligible:
    """Which experiences a claim may take, and in which order (see ExperienceDB.claim)."""

    priority: bool
    reuse_cooldown: float | None
    decay: float
    min_version: int | None
    groups: bool  # whole groups (see ExperienceDB.claim)

    def sql(self, now: float) -> tuple[str, str, list]:
        """(WHERE predicate, ORDER BY, its parameters)."""
        # NOTE: the literal predicate of the partial index, so that SQLite uses it
        eligible, order, args = "use_count = 0 AND dropped_step IS NULL", "id", []
        if self.priority:
            order = f"model_version - {float(self.decay)!r} * use_count DESC, id DESC"
            if self.reuse_cooldown is not None:
                eligible = "((use_count = 0 AND dropped_step IS NULL) OR (use_count > 0 AND last_claimed <= ?))"
                args.append(now - self.reuse_cooldown)
        if self.min_version is not None:
            eligible += " AND model_version >= ?"
            args.append(self.min_version)
        return eligible, order, args


def whole_groups(picked: list[tuple[int, str]], members: dict[str, list[int]], n: int) -> tuple[list[int], bool]:
    """Claim order by whole groups: the groups of `picked` ((id, group_id) in claim order; "" is a group of its
    own), each as all its `members`, while they fit in n. (ids, full): full when n are taken or the next group does
    not fit (a first group larger than n is taken whole, alone)."""
    units = {g or f"#{i}": members.get(g, [i]) if g else [i] for i, g in picked}  # NOTE: first-seen order
    ids: list[int] = []
    for unit in units.values():
        if ids and len(ids) + len(unit) > n:
            return ids, True
        ids += unit
        if len(ids) >= n:
            return ids, True
    return ids, False


def fenced(fence: Callable[[Any], None], body: Callable[[Any], T]) -> Callable[[Any], T]:
    """body, after `fence` in the same transaction."""

    def run(cur: Any) -> T:
        fence(cur)
        return body(cur)

    return run


class ExperienceDB:
    """Experiences in one SQLite file or PostgreSQL database, shared by explorer processes (writers) and the trainer.

    with ExperienceDB("sqlite:///buffer.db") as db:           # or "postgresql://user@host/db"
        ids = db.write(exps)                            # explorer: one transaction per batch
        batch = db.claim(64, step=3, timeout=30.0)      # trainer: wait for 64, mark them used
        db.release_after(2)                             # trainer resumed at step 2: undo step 3
        print(db.counts())                              # {'total': ..., 'pending': ..., ...}
    """

    def __init__(self, url: str, busy_timeout: float | None = None) -> None:
        """busy_timeout: seconds a call waits for a lock, or for a lost PostgreSQL server (dbconn.py); unset:
        dbconn.db_timeout(), $NANORFT_DB_TIMEOUT or 60 s."""
        busy_timeout = db_timeout() if busy_timeout is None else busy_timeout
        self.url, self.postgres, self.busy_timeout = url, is_postgres(url), busy_timeout
        self.path = shown(url) if self.postgres else sqlite_path(url)  # what messages name
        # lease.hold's check, run first in every transaction: a process whose role was taken over writes nothing
        self.fence: Callable[[Any], None] | None = None
        self.conn = PostgresLink(url, busy_timeout) if self.postgres else open_sqlite(self.path, busy_timeout)
        try:
            self._set_up()
        except DBMismatch:
            raise
        except Exception as e:  # PostgreSQL: e.g. no right to CREATE in the schema (PostgreSQL 15's public)
            if not self.postgres:
                raise
            raise DBMismatch(
                f"{self.path}: cannot set up the experience DB's tables: {' '.join(str(e).split())}"
            ) from None

    def twin(self) -> ExperienceDB:
        """Another connection to this DB, for another thread of this process (lease.py's heartbeat), without the checks
        and set-up that opening it did. NOTE: not through open_sqlite: its refuse_foreign reads the file with a plain
        open() and close(), and closing any descriptor of a file drops every POSIX lock this process holds on it,
        SQLite's included. Another process's SQLite then took this one's connection for gone and deleted the WAL under
        it: from then on it read an old snapshot and its commits went to a deleted file (measured: a trainer that
        never saw step 2)."""
        twin = object.__new__(ExperienceDB)
        twin.url, twin.postgres, twin.busy_timeout, twin.path, twin.fence = (
            self.url,
            self.postgres,
            self.busy_timeout,
            self.path,
            None,
        )
        if self.postgres:
            twin.conn = PostgresLink(self.url, self.busy_timeout)
        else:  # WAL mode is the file's; synchronous is each connection's
            twin.conn = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
            twin.conn.execute("PRAGMA synchronous=NORMAL")
        return twin

    def _set_up(self) -> None:
        """The tables (created if missing) in one transaction, after the schema version and foreign-data checks."""
        self._atomic(self._create_tables)

    def _create_tables(self, cur: Any) -> None:
        if self.postgres:
            # NOTE: CREATE TABLE IF NOT EXISTS is not safe against itself in PostgreSQL: two processes creating
            # a table at once can fail on a catalog index. This lock (held to COMMIT) takes turns.
            cur.execute("SELECT pg_advisory_xact_lock(?)", (SETUP_LOCK,))
            self._refuse_foreign(cur)
        cur.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
        row = cur.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None and row[0] in ("2", "3", "4"):
            self._upgrade(cur, int(row[0]))
            return
        if row is not None and row[0] != str(SCHEMA_VERSION):
            raise DBMismatch(
                f"{self.path}: experience DB has schema version {row[0]}, this "
                f"buffer.py expects {SCHEMA_VERSION}; use a new DB path"
            )
        if row is not None:
            # NOTE: the version row is written last, in the transaction that made every table and index: they exist.
            # Not running the DDL again matters in PostgreSQL, where CREATE INDEX IF NOT EXISTS takes a SHARE lock on
            # its table even when the index exists: an explorer opening the DB beside a trainer's release_after
            # (claims, then experiences) deadlocked on the two tables in the other order.
            return
        types = TYPES["postgresql" if self.postgres else "sqlite"]
        tables = SCHEMA.format(**types, replays=REPLAYS.format(**types), trained=TRAINED.format(**types))
        for statement in tables.split(";"):
            cur.execute(statement)
        cur.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?) ON CONFLICT (key) DO NOTHING",
            (str(SCHEMA_VERSION),),
        )

    def _upgrade(self, cur: Any, version: int) -> None:
        """A version 2, 3 or 4 DB to version 5, adding what each later version added: the replays table (3), the spans
        column (4), the trained table (5). Nothing else changed (its rows stay as they are: no spans, one version each,
        nothing recorded of the steps that trained them)."""
        types = TYPES["postgresql" if self.postgres else "sqlite"]
        added = []
        if version < 3:
            for statement in REPLAYS.format(**types).split(";"):
                cur.execute(statement)
            added.append("the replays table")
        if version < 4:
            cur.execute(SPANS_COLUMN)
            added.append("the spans column")
        for statement in TRAINED.format(**types).split(";"):
            cur.execute(statement)
        added.append("the trained table")
        cur.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        log.info(
            "%s: experience DB upgraded from schema version %d to %d (%s)",
            self.path,
            version,
            SCHEMA_VERSION,
            ", ".join(added),
        )

    def _refuse_foreign(self, cur: Any) -> None:
        """PostgreSQL: DBMismatch when the database (its current schema) holds another program's tables, or when the
        URL's search_path names no schema that exists."""
        if cur.execute("SELECT current_schema()").fetchone()[0] is None:
            raise DBMismatch(
                f"{self.path}: the search_path names no schema that exists; create it first (CREATE "
                "SCHEMA <name>) or drop the options= part of the URL"
            )
        tables = {
            r[0]
            for r in cur.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
            )
        }
        if tables and "meta" not in tables:
            raise DBMismatch(
                f"{self.path} holds the tables of another program ({', '.join(sorted(tables))}); point "
                "buffer.trainer_input.experience_buffer.path at a new database, or at a schema of its "
                "own with ?options=-csearch_path%3D<schema> (nothing was changed)"
            )

    def _atomic(self, body: Callable[[Any], T]) -> T:
        """body(cursor) in one transaction: COMMIT at the end, ROLLBACK on any exception; its result. SQLite: BEGIN
        IMMEDIATE (the write lock up front); PostgreSQL: BEGIN, row locks taken by the statements (claims: FOR UPDATE
        SKIP LOCKED), a lost connection handled as dbconn.PostgresLink.run says. A full or failing disk, or a damaged
        file: DBFault (dbconn.sqlite_faults), after the ROLLBACK. With a `fence` (lease.py), it runs first, in the same
        transaction: lease.LeaseLost, and nothing written, once this process's role was taken over."""
        if self.fence is not None:
            body = fenced(self.fence, body)
        if not self.postgres:
            with sqlite_faults(self.path, self.busy_timeout, "a write transaction"), transaction(self.conn) as cur:
                return body(cur)
        return self.conn.run(body, atomic=True)

    def query(self, sql: str, args: Any = ()) -> list:
        """The rows of one read-only statement (written with `?` placeholders), outside any transaction."""
        if not self.postgres:
            with sqlite_faults(self.path, self.busy_timeout, "a read"):
                return self.conn.execute(sql, args).fetchall()
        return self.conn.run(lambda cur: cur.execute(sql, args).fetchall(), atomic=False)

    def get_meta(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def meta_items(self, prefix: str) -> dict[str, str]:
        """Every meta key/value whose key starts with `prefix` (e.g. "explorer/": each explorer's state)."""
        return dict(self.query("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix)))

    def set_meta(self, key: str, value: str, *, overwrite: bool = True) -> str:
        """Store key=value and return the stored value. With overwrite=False an existing value is
        kept and returned, so a caller can compare it with its own (e.g. a model fingerprint)."""
        conflict = "DO UPDATE SET value = excluded.value" if overwrite else "DO NOTHING"

        def body(cur: Any) -> str:
            cur.execute(f"INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) {conflict}", (key, value))
            return cur.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0]

        return self._atomic(body)

    def write(
        self, exps: list[Experience], meta: dict[str, str] | None = None, explorer: tuple[str, dict] | None = None
    ) -> list[int]:
        """Insert experiences in one transaction; returns their row ids, in order.

        `meta` key/values, and `explorer` = (name, state) as set_explorer_state would store it, are set in the
        same transaction: an explorer stores its taskset position this way, so that its position and its
        experiences can never disagree after a crash."""
        if explorer is not None:
            meta = {**(meta or {}), f"explorer/{explorer[0]}": json.dumps(explorer[1])}
        now = time.time()
        rows = [
            (
                now,
                e.explorer,
                e.model_version,
                e.group_id,
                e.run_id,
                e.task_id,
                e.reward,
                e.prompt_length,
                e.response_length,
                spans_column(e),
                *serialise(e),
            )
            for e in exps
        ]

        def body(cur: Any) -> list[int]:
            cur.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                list((meta or {}).items()),
            )
            if not rows:
                return []
            ids = self._insert_experiences(cur, [row[:-2] for row in rows])
            cur.executemany(
                "INSERT INTO payloads (id, tensors, meta) VALUES (?, ?, ?)",
                [(i, *row[-2:]) for i, row in zip(ids, rows)],
            )
            return ids

        return self._atomic(body)

    def _insert_experiences(self, cur: Any, rows: list[tuple]) -> list[int]:
        """INSERT the rows' plain columns; their ids, in order."""
        if self.postgres:  # one result (the id) per row, in order: psycopg's executemany with returning
            return cur.executemany(INSERT_EXPERIENCES + " RETURNING id", rows, returning=True).returned()
        cur.executemany(INSERT_EXPERIENCES, rows)
        # NOTE: we hold the write lock and AUTOINCREMENT gives max+1 to each insert, so the ids are consecutive and
        # end at last_insert_rowid() (executemany leaves lastrowid unset).
        last = cur.execute("SELECT last_insert_rowid()").fetchone()[0]
        return list(range(last - len(rows) + 1, last + 1))

    def claim(
        self,
        n: int,
        step: int,
        *,
        timeout: float = 0.0,
        priority: bool = False,
        reuse_cooldown: float | None = None,
        decay: float = 2.0,
        min_version: int | None = None,
        partial: bool = True,
        groups: bool = False,
        waiting: Callable[[int, float], bool] | None = None,
    ) -> list[Experience]:
        """Atomically take up to n experiences for train step `step`; wait up to `timeout` s for n.

        Queue order (default): oldest unclaimed first. priority=True (Trinity's linear_decay):
        highest model_version - decay * use_count first, newest first on ties; a used experience is
        eligible again `reuse_cooldown` seconds after its last claim (never, if None).
        Whole groups (`groups`, and always with priority): the order picks groups, each claimed with all its
        eligible experiences (those sharing its group_id; one without a group_id is a group of its own) in the
        order they were written, as Trinity's priority queue holds one task's experiences as one item; groups are
        taken while they fit in n, and the claim is full when n are taken or the next group does not fit (a first
        group larger than n alone is taken whole). So a group is claimed, reused and released together.
        min_version (staleness control): pending experiences of older versions are marked dropped by
        this step (counted, never trained on) and only versions >= min_version are taken.
        While fewer than n are there, `waiting(available, waited_seconds)` is called at each poll;
        True means "no more will come": take what is there now. When the timeout runs out, take what
        is there if `partial`, else nothing. Returns the experiences in claim order with `id` set; one
        reused after its first use with reuse on carries the advantages that use stored (`keep_advantages`)."""
        if reuse_cooldown is not None and not priority:
            raise ValueError("reuse_cooldown needs priority=True (queue order never reuses)")
        which = _Eligible(priority, reuse_cooldown, decay, min_version, groups or priority)
        start, pause, take = time.monotonic(), 0.005, False  # take: waiting() said no more will come
        while True:
            waited = time.monotonic() - start
            ids, rows = self._claim_once(n, step, which, final=take or waited >= timeout, keep_partial=take or partial)
            if rows is not None:
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
        by_id = from_rows(rows)
        return [by_id[i] for i in ids]

    def _claim_once(
        self, n: int, step: int, which: _Eligible, final: bool, keep_partial: bool
    ) -> tuple[list[int], list | None]:
        """One look under the write lock. With n eligible (or `final`) claim them and return (ids, rows); a
        final look with fewer than n claims them only if `keep_partial`. Otherwise claim nothing: (ids seen, None).

        Look and claim happen under one write lock, and a claim is made only when n are there or waiting is
        over: a reader that took partial batches while waiting would starve another reader. PostgreSQL has no
        database-wide write lock: the look locks the rows it picks (FOR UPDATE), skipping rows that another
        claim has locked (SKIP LOCKED), so that two trainers never take the same experience nor wait on each
        other."""
        now = time.time()
        eligible, order, args = which.sql(now)
        lock = " FOR UPDATE SKIP LOCKED" if self.postgres else ""

        def body(cur: Any) -> tuple[list[int], list | None]:
            if which.min_version is not None:
                cur.execute(
                    "UPDATE experiences SET dropped_step = ? WHERE use_count = 0 AND dropped_step IS NULL"
                    " AND model_version < ?",
                    (step, which.min_version),
                )
            # Ids first (a scan of small rows), payloads second, for the chosen ids only.
            picked = cur.execute(
                f"SELECT id, group_id FROM experiences WHERE {eligible} ORDER BY {order} LIMIT ?{lock}", (*args, n)
            ).fetchall()
            if which.groups:
                ids, full = whole_groups(picked, self._members(cur, picked, eligible, args, lock), n)
            else:
                ids, full = [row[0] for row in picked], len(picked) >= n
            if not full and not final:
                return ids, None
            if not full and not keep_partial:
                ids = []
            cur.executemany(
                "UPDATE experiences SET use_count = use_count + 1, last_claimed = ? WHERE id = ?",
                [(now, i) for i in ids],
            )
            cur.executemany(
                "INSERT INTO claims (exp_id, step, claimed) VALUES (?, ?, ?)", [(i, step, now) for i in ids]
            )
            # NOTE: `IN ()` is an error in PostgreSQL (SQLite takes it)
            return ids, cur.execute(SELECT_ROWS.format(", ".join("?" * len(ids))), ids).fetchall() if ids else []

        return self._atomic(body)

    def _members(self, cur: Any, picked: list, eligible: str, args: list, lock: str) -> dict[str, list[int]]:
        """The eligible experiences of the groups among `picked` (id, group_id), by group_id, in written order."""
        names = list(dict.fromkeys(g for _, g in picked if g))
        members: dict[str, list[int]] = {}
        if names:  # NOTE: `IN ()` is an error in PostgreSQL
            rows = cur.execute(
                f"SELECT id, group_id FROM experiences WHERE {eligible} AND group_id IN "
                f"({', '.join('?' * len(names))}) ORDER BY id{lock}",
                (*args, *names),
            )
            for i, g in rows:
                members.setdefault(g, []).append(i)
        return members

    def get(self, ids: list[int]) -> list[Experience]:
        """The experiences with these row ids, in that order, without claiming them (the trainer's
        other ranks read what rank 0 claimed)."""
        rows = self.query(SELECT_ROWS.format(", ".join("?" * len(ids))), ids) if ids else []
        by_id = from_rows(rows)
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise KeyError(f"{self.path}: no experiences with ids {missing[:5]}")
        return [by_id[i] for i in ids]

    def keep_advantages(self, step: int, advantages: dict[int, torch.Tensor]) -> None:
        """Replay: the advantages [R] that train step `step` computed for experiences (by id) at their first use, which
        their reuses then claim with them (a first use's stay: a later call for the same id changes nothing)."""
        rows = [
            (i, step, safetensors.numpy.save({"advantages": a.detach().to("cpu", torch.float32).contiguous().numpy()}))
            for i, a in advantages.items()
        ]
        self._atomic(
            lambda cur: cur.executemany(
                "INSERT INTO replays (exp_id, step, advantages) VALUES (?, ?, ?) ON CONFLICT (exp_id) DO NOTHING", rows
            )
        )

    def keep_trained(self, step: int, tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """What train step `step` trained each experience (by id) on: {"advantages": [R], "logprobs": [R] (optional)},
        as the trained table's rows (a step run again after a resume replaces its rows)."""
        rows = [
            (
                i,
                step,
                safetensors.numpy.save(
                    {k: v.detach().to("cpu", torch.float32).contiguous().numpy() for k, v in t.items()}
                ),
            )
            for i, t in tensors.items()
        ]
        sql = (
            "INSERT INTO trained (exp_id, step, tensors) VALUES (?, ?, ?)"
            " ON CONFLICT (exp_id, step) DO UPDATE SET tensors = excluded.tensors"
        )
        self._atomic(lambda cur: cur.executemany(sql, rows))

    def release_after(self, step: int) -> int:
        """Undo the claims (and staleness drops, and the replay advantages stored) of train steps > `step`, for a
        trainer resumed from checkpoint `step`: those experiences become claimable again as if never used. Returns
        the claims released."""

        def body(cur: Any) -> int:
            released = cur.execute(
                "SELECT exp_id, COUNT(*) FROM claims WHERE step > ? GROUP BY exp_id", (step,)
            ).fetchall()
            cur.execute("DELETE FROM claims WHERE step > ?", (step,))
            cur.execute("DELETE FROM replays WHERE step > ?", (step,))  # those uses are undone: first uses again
            cur.execute("DELETE FROM trained WHERE step > ?", (step,))
            cur.execute("UPDATE experiences SET dropped_step = NULL WHERE dropped_step > ?", (step,))
            # last_claimed goes back to the latest remaining claim, or NULL if none is left.
            cur.executemany(
                "UPDATE experiences SET use_count = use_count - ?, last_claimed ="
                " (SELECT MAX(claimed) FROM claims WHERE exp_id = experiences.id)"
                " WHERE id = ?",
                [(count, exp_id) for exp_id, count in released],
            )
            return sum(count for _, count in released)

        return self._atomic(body)

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
        ((total, pending, dropped, claims),) = self.query(
            "SELECT (SELECT COUNT(*) FROM experiences), (SELECT COUNT(*) FROM experiences WHERE use_count = 0"
            " AND dropped_step IS NULL), (SELECT COUNT(*) FROM experiences WHERE dropped_step IS NOT NULL),"
            " (SELECT COUNT(*) FROM claims)"
        )
        return {
            "total": total,
            "pending": pending,
            "claimed": total - pending - dropped,
            "dropped": dropped,
            "claims": claims,
        }

    def check_identity(self, identity: dict, who: str) -> None:
        """Refuse to share this DB between processes of different models: the first process stores
        `identity` (models.fingerprint: architecture and tokenizer), later ones must match it."""
        stored = json.loads(self.set_meta("identity", json.dumps(identity, sort_keys=True), overwrite=False))
        if stored != identity:
            diff = [
                f"{k}: DB has {stored.get(k)!r}, {who} has {identity.get(k)!r}"
                for k in sorted(set(stored) | set(identity))
                if stored.get(k) != identity.get(k)
            ]
            raise DBMismatch(
                f"{self.path}: this experience DB was written for another model or tokenizer "
                f"({'; '.join(diff)}). Point buffer.trainer_input.experience_buffer.path at "
                "another DB, or use the same model.model_path on both sides."
            )

    def check_advantages(self, origin: str, who: str) -> None:
        """Refuse to share this DB between processes that disagree on where the experiences' advantages come from
        (configs.resolve.advantage_origin: the trainer, or an explorer-side advantage fn and its args): a trainer
        of step_wise_grpo cannot train on an explorer's rows without stored advantages, and a trainer of another
        advantage fn would ignore them. The first process stores `origin` (and `who` it is), later ones must match."""
        mine = json.dumps({"origin": origin, "by": who})
        stored = json.loads(self.set_meta("advantages", mine, overwrite=False))
        if stored["origin"] != origin:
            raise DBMismatch(
                f"{self.path}: the advantages of this DB's experiences come from {stored['origin']} "
                f"(stored by {stored['by']}), and {who} has them from {origin}: the explorers and the "
                "trainer sharing a DB need the same explorer-side algorithm.advantage_fn "
                "(step_wise_grpo, with the same advantage_fn_args) or none. Point "
                "buffer.trainer_input.experience_buffer.path at another DB, or align the configs."
            )

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ExperienceDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
