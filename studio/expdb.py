"""studio/expdb.py: any experience DB (buffer.py's), opened read-only, for the studio's experience viewer.

    db = ExpDB("runs/p/t/buffer/exp.db")                     # or sqlite:///..., or postgresql://user@host/db
    db.count(Filters(reward=(0.5, None)))                    # how many rows the filters keep
    db.page(Filters(status="trained"), order="reward", descending=True, offset=0, limit=50)   # one page of rows
    exp, trained = db.experience(17)                         # buffer.Experience and what each train step used
    db.group("t7")                                           # the experiences of one group, in written order

Read-only twice over: SQLite through a `file:PATH?mode=ro` URI with `PRAGMA query_only`, PostgreSQL in read-only
transactions (`default_transaction_read_only`): a write through this connection fails, and the file is left as it was
(a DB that a run writes right now reads fine: WAL). Only paged queries: a page is one SELECT ... LIMIT, a count one
COUNT(*), so a DB of millions of experiences opens as fast as a small one (tests/test_studio_viewer.py times ~100k).
A path that is not an experience DB raises NotAnExperienceDB, which says what the file is and what is expected.

The per-token numbers of one experience (`token_rows`) and their HTML (`tokens_html`: spans of class "tok" with
data- attributes and a `title` for hover, every token's text html.escape'd: model output is untrusted) are here too,
so that the page script (viewer_page.py) stays a thin layer of widgets.
"""

from __future__ import annotations

import html
import json
import math
import os
import sqlite3
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from buffer import COLUMNS, Experience, deserialise
from dbconn import is_postgres, shown, sqlite_path
from errors import DataError

STATUSES = ("pending", "trained", "dropped")
STATUS_SQL = (
    "CASE WHEN e.dropped_step IS NOT NULL THEN 'dropped' WHEN e.use_count > 0 THEN 'trained' ELSE 'pending' END"
)
# the first train step that used each experience, joined where a filter or the order needs it (a page's rows get
# theirs by id: `_first_steps`). NOTE: not a correlated subquery per row: PostgreSQL computed it for every row an OFFSET
# skipped, and without fresh statistics by a scan of claims each time (a page at offset 100k of 120k rows: 490 s)
FIRST_STEP = " LEFT JOIN (SELECT exp_id, MIN(step) AS first_step FROM claims GROUP BY exp_id) f ON f.exp_id = e.id"
STEP_SQL = "f.first_step"
# the table's columns, in order: name -> its SQL
ROW_SQL = {
    "id": "e.id",
    "step": STEP_SQL,
    "group_id": "e.group_id",
    "task_id": "e.task_id",
    "run_id": "e.run_id",
    "reward": "e.reward",
    "prompt_length": "e.prompt_length",
    "response_length": "e.response_length",
    "model_version": "e.model_version",
    "explorer": "e.explorer",
    "use_count": "e.use_count",
    "status": STATUS_SQL,
}
ORDERS = ("id", "step", "reward", "response_length", "model_version", "group_id")  # what a page may be sorted by
SQLITE_MAGIC = b"SQLite format 3\x00"


class NotAnExperienceDB(DataError):
    """The viewer was pointed at something that is not an experience DB it can read (named: what it is, what is
    expected)."""


class DBReadError(DataError):
    """A read of an opened experience DB failed (a damaged SQLite file, a PostgreSQL server gone): named, no
    traceback."""


@dataclass
class Filters:
    """Which experiences the table shows; None: no bound. Ranges are inclusive (lo, hi)."""

    step: tuple[int | None, int | None] = (None, None)  # the first train step that used it (pending: none)
    reward: tuple[float | None, float | None] = (None, None)
    response_length: tuple[int | None, int | None] = (None, None)
    model_version: tuple[int | None, int | None] = (None, None)
    group_id: str | None = None
    task_id: str | None = None
    explorer: str | None = None
    status: str | None = None  # one of STATUSES

    @property
    def by_step(self) -> bool:
        """Whether the step range is bounded (the query joins FIRST_STEP)."""
        return self.step != (None, None)

    def sql(self) -> tuple[str, list]:
        """(WHERE clause or "", its parameters)."""
        where, args = [], []
        for name, sql in (
            ("step", STEP_SQL),
            ("reward", "e.reward"),
            ("response_length", "e.response_length"),
            ("model_version", "e.model_version"),
        ):
            lo, hi = getattr(self, name)
            if lo is not None:
                where.append(f"{sql} >= ?")
                args.append(lo)
            if hi is not None:
                where.append(f"{sql} <= ?")
                args.append(hi)
        for name in ("group_id", "task_id", "explorer"):
            if getattr(self, name) not in (None, ""):
                where.append(f"e.{name} = ?")
                args.append(getattr(self, name))
        if self.status is not None:
            if self.status not in STATUSES:
                raise ValueError(f"status {self.status!r}: expected one of {', '.join(STATUSES)}")
            where.append(f"{STATUS_SQL} = ?")
            args.append(self.status)
        return (" WHERE " + " AND ".join(where)) if where else "", args


@dataclass
class Trained:
    """What one train step trained an experience on (the DB's trained table, schema version 5)."""

    step: int
    advantages: torch.Tensor  # [R]
    logprobs: torch.Tensor | None  # [R] the trainer's old_logprobs; None: that step computed none (one update)


def _sqlite_readonly(path: str) -> sqlite3.Connection:
    """A read-only connection to the SQLite file at `path`, or NotAnExperienceDB naming what is there instead."""
    p = Path(path)
    if not p.exists():
        raise NotAnExperienceDB(f"{path}: no such file; expected an experience DB (a run's <job dir>/buffer/*.db)")
    if p.is_dir():
        raise NotAnExperienceDB(f"{path} is a folder; expected an experience DB file in it (e.g. {path}/exp.db)")
    with open(p, "rb") as f:  # NOTE: a plain read; this process holds no SQLite lock on the file to lose
        head = f.read(16)
    if head != SQLITE_MAGIC:
        what = "an empty file" if not head else "not a SQLite file"
        raise NotAnExperienceDB(f"{path} is {what}; expected an experience DB (SQLite, written by nanorft's buffer.py)")
    uri = f"file:{urllib.parse.quote(str(p.resolve()))}?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=10.0, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA query_only = ON")
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")
    except sqlite3.Error as e:
        raise NotAnExperienceDB(f"{path}: cannot read it as SQLite ({e}); expected an experience DB") from None
    return conn


def _postgres_readonly(url: str) -> Any:
    """A psycopg connection whose every transaction is read-only."""
    try:
        import psycopg
    except ImportError:
        raise NotAnExperienceDB(
            f"{shown(url)}: reading PostgreSQL needs psycopg 3 (pip install -e '.[postgres]')"
        ) from None
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
        # NOTE: set here, not as the URL's options= (which a URL may hold already: a search_path)
        conn.execute("SET default_transaction_read_only = on")
        return conn
    except psycopg.Error as e:
        raise NotAnExperienceDB(f"cannot open {shown(url)}: {' '.join(str(e).split())}") from None


class ExpDB:
    """One experience DB, read-only (see the module docstring)."""

    def __init__(self, where: str) -> None:
        where = where.strip()
        self.postgres = is_postgres(where)
        self.where = shown(where) if self.postgres else sqlite_path(where)  # what messages and the page show
        self.path = None if self.postgres else self.where
        self.conn = _postgres_readonly(where) if self.postgres else _sqlite_readonly(self.where)
        try:
            self.version, self.tables = self._check()
        except BaseException:
            self.conn.close()
            raise

    def _check(self) -> tuple[int, set[str]]:
        """(schema version, tables) of an experience DB, else NotAnExperienceDB saying what the DB holds."""
        if self.postgres:
            listed = "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        else:
            listed = "SELECT name FROM sqlite_master WHERE type = 'table'"
        try:
            tables = {r[0] for r in self._rows(listed)}
        except DBReadError as e:  # e.g. a damaged file
            raise NotAnExperienceDB(f"{e}; expected an experience DB") from None
        needed = {"meta", "experiences", "payloads", "claims"}
        if not needed <= tables:
            holds = f"the tables {', '.join(sorted(tables))}" if tables else "no tables"
            raise NotAnExperienceDB(
                f"{self.where} holds {holds}, not an experience DB (expected the tables "
                f"{', '.join(sorted(needed))}: a DB that nanorft's explorers write, e.g. <job dir>/buffer/exp.db)"
            )
        row = self._rows("SELECT value FROM meta WHERE key = 'schema_version'")
        if not row or not str(row[0][0]).isdigit() or not 2 <= int(row[0][0]):
            raise NotAnExperienceDB(f"{self.where}: no readable schema version in its meta table ({row})")
        return int(row[0][0]), tables

    def _rows(self, sql: str, args: Any = ()) -> list:
        """The rows of one SELECT (written with `?` placeholders); a failed read (a damaged file, a lost server): a
        DBReadError naming the DB."""
        try:
            if self.postgres:
                return self.conn.execute(sql.replace("?", "%s"), args).fetchall()
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.Error as e:
            raise DBReadError(f"{self.where}: reading it failed ({e})") from None
        except Exception as e:  # psycopg's errors (psycopg is imported only for a PostgreSQL DB)
            if not self.postgres or not type(e).__module__.startswith("psycopg"):
                raise
            raise DBReadError(f"{self.where}: reading it failed ({' '.join(str(e).split())})") from None

    def count(self, filters: Filters | None = None) -> int:
        f = filters or Filters()
        where, args = f.sql()
        return self._rows(f"SELECT COUNT(*) FROM experiences e{FIRST_STEP if f.by_step else ''}{where}", args)[0][0]

    def page(
        self,
        filters: Filters | None = None,
        order: str = "id",
        descending: bool = False,
        offset: int = 0,
        limit: int = 50,
    ) -> list[dict]:
        """One page of the table: dicts of ROW_SQL's columns, sorted by `order` (one of ORDERS; then by id)."""
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: expected one of {', '.join(ORDERS)}")
        f = filters or Filters()
        where, args = f.sql()
        joined = f.by_step or order == "step"
        way = "DESC" if descending else "ASC"
        cols = ", ".join(f"{sql if name != 'step' or joined else 'NULL'} AS {name}" for name, sql in ROW_SQL.items())
        # NOTE: NULLS LAST both ways and on both back-ends (their defaults differ): pending rows (no step) last
        sort = f"{ROW_SQL[order]} {way} NULLS LAST, e.id {way}" if order != "id" else f"e.id {way}"
        sql = f"SELECT {cols} FROM experiences e{FIRST_STEP if joined else ''}{where} ORDER BY {sort} LIMIT ? OFFSET ?"
        rows = [dict(zip(ROW_SQL, r)) for r in self._rows(sql, [*args, int(limit), int(offset)])]
        if not joined and rows:
            first = self._first_steps([r["id"] for r in rows])
            for r in rows:
                r["step"] = first.get(r["id"])
        return rows

    def _first_steps(self, ids: list[int]) -> dict[int, int]:
        """The first train step that used each of these experiences (those used at all)."""
        marks = ", ".join("?" * len(ids))
        return dict(self._rows(f"SELECT exp_id, MIN(step) FROM claims WHERE exp_id IN ({marks}) GROUP BY exp_id", ids))

    def _select(self, where: str) -> str:
        """SELECT of what buffer.deserialise reads (older DBs: no spans column before version 4)."""
        cols = ", ".join("e." + c if c != "spans" or self.version >= 4 else "NULL" for c in COLUMNS)
        return f"SELECT e.id, p.tensors, p.meta, {cols} FROM experiences e JOIN payloads p ON p.id = e.id WHERE {where}"

    def _experiences(self, rows: list) -> list[Experience]:
        return [deserialise(bytes(blob), meta, id=i, **dict(zip(COLUMNS, cols))) for i, blob, meta, *cols in rows]

    def experience(self, exp_id: int) -> tuple[Experience, list[Trained]]:
        """Experience `exp_id` (KeyError if none) and what each train step trained it on, by step."""
        rows = self._rows(self._select("e.id = ?"), (int(exp_id),))
        if not rows:
            raise KeyError(f"{self.where}: no experience with id {exp_id}")
        trained = []
        if "trained" in self.tables:
            for step, blob in self._rows("SELECT step, tensors FROM trained WHERE exp_id = ? ORDER BY step", (exp_id,)):
                t = safetensors.torch.load(bytes(blob))
                trained.append(Trained(step, t["advantages"], t.get("logprobs")))
        return self._experiences(rows)[0], trained

    def group(self, group_id: str, limit: int = 64) -> list[Experience]:
        """The experiences of group `group_id` in written order (at most `limit`)."""
        return self._experiences(self._rows(self._select("e.group_id = ? ORDER BY e.id LIMIT ?"), (group_id, limit)))

    def choices(self, column: str, limit: int = 200) -> list:
        """The distinct values of a small column (explorer, model_version) for the filters' pick lists."""
        if column not in ("explorer", "model_version"):
            raise ValueError(column)
        return [r[0] for r in self._rows(f"SELECT DISTINCT {column} FROM experiences ORDER BY 1 LIMIT ?", (limit,))]

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ExpDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- token text: the tokenizer of the model that wrote the DB


def job_model(db_path: str | None) -> str | None:
    """The model folder of the job whose DB this is: a DB in <job dir>/buffer/ -> that job's config.yaml (or the
    trainer's / explorer's) model.model_path, when it is a folder that exists; else None."""
    if not db_path:
        return None
    job = Path(db_path).resolve().parent
    if job.name != "buffer":
        return None
    import yaml

    for name in ("config.yaml", "config_trainer.yaml", "config_explorer.yaml"):
        cfg = job.parent / name
        if cfg.is_file():
            with open(cfg) as f:
                model = ((yaml.safe_load(f) or {}).get("model") or {}).get("model_path")
            if model and os.path.isdir(model):
                return str(model)
    return None


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model folder, or a DataError saying why none loads."""
    if not os.path.isdir(model):
        raise DataError(f"{model}: no such model folder; give the folder of the model that wrote the DB")
    from models import load_tokenizer as load

    try:
        return load(model)
    except (OSError, ValueError) as e:
        raise DataError(f"{model}: cannot load a tokenizer from it ({' '.join(str(e).split())})") from None


# --- one experience's tokens: their numbers, and their HTML


def token_rows(exp: Experience, trained: Trained | None, tokenizer: Any = None) -> list[dict]:
    """One dict per token of `exp` (prompt, then response): i, id, text (the tokenizer's; without one "[id]"), part
    ("prompt" / "response"), and for response tokens mask (trained: 1), lp (rollout log-prob), tlp (the trainer's
    log-prob), adv (advantage): None where not recorded. Advantages: the train step's (`trained`), else those an
    explorer stored with the experience."""
    ids = [int(t) for t in exp.tokens.tolist()]
    P, R = exp.prompt_length, exp.response_length
    mask = exp.action_mask if exp.action_mask is not None else torch.ones(R, dtype=torch.bool)  # [R]
    adv = trained.advantages if trained is not None else exp.advantages  # [R] or None
    tlp = trained.logprobs if trained is not None else None  # [R] or None

    def at(t: torch.Tensor | None, j: int) -> float | None:
        return float(t[j]) if t is not None and j < len(t) else None

    out = []
    for i, tok in enumerate(ids):
        row = {"i": i, "id": tok, "text": tokenizer.decode([tok]) if tokenizer is not None else f"[{tok}]"}
        if i < P:
            out.append(row | {"part": "prompt", "mask": None, "lp": None, "tlp": None, "adv": None})
            continue
        j = i - P
        out.append(
            row
            | {
                "part": "response",
                "mask": int(bool(mask[j])) if j < R else None,
                "lp": at(exp.logprobs, j),
                "tlp": at(tlp, j),
                "adv": at(adv, j),
            }
        )
    return out


QUANTITIES = {  # what the response's tokens may be coloured by: label -> (value of a token row, diverging)
    "advantage": (lambda r: r["adv"], True),
    "rollout log-prob": (lambda r: r["lp"], False),
    "trainer log-prob": (lambda r: r["tlp"], False),
    "trainer - rollout log-prob": (lambda r: None if r["tlp"] is None or r["lp"] is None else r["tlp"] - r["lp"], True),
}


def colour(value: float | None, scale: float, diverging: bool) -> str:
    """A token's background: diverging (advantage, a difference) red below 0, green above; a log-prob blue, the
    stronger the less likely; none without a value. Alpha = |value| / scale, at most 1 (0.85 drawn)."""
    if value is None or not math.isfinite(value) or scale <= 0:
        return "transparent"
    alpha = round(0.85 * min(abs(value) / scale, 1.0), 3)
    if diverging:
        rgb = "0,160,60" if value > 0 else "220,40,40"
    else:
        rgb = "40,90,220"
    return f"rgba({rgb},{alpha})"


def fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.4f}"


def tokens_html(rows: list[dict], quantity: str = "advantage") -> str:
    """The tokens as HTML: one <span class="tok"> each, with data-i, data-id, data-part, data-mask, data-adv, data-lp,
    data-tlp, data-value (the coloured quantity's; "" where none), its colour as background and the numbers in its
    title (shown on hover); a response token not trained (mask 0) is struck through, a trained one underlined. Every
    text escaped (model output is untrusted)."""
    value, diverging = QUANTITIES[quantity]
    values = [value(r) for r in rows if r["part"] == "response"]
    scale = max((abs(v) for v in values if v is not None and math.isfinite(v)), default=0.0)
    spans = []
    for r in rows:
        v = value(r) if r["part"] == "response" else None
        title = f"token {r['i']} id {r['id']} {json.dumps(r['text'], ensure_ascii=False)}\n{r['part']}" + (
            f" mask {r['mask']}\nrollout logprob {fmt(r['lp'])}\ntrainer logprob {fmt(r['tlp'])}\n"
            f"advantage {fmt(r['adv'])}"
            if r["part"] == "response"
            else ""
        )
        line = "text-decoration:line-through;opacity:0.55;" if r["mask"] == 0 else ""
        line = line or ("border-bottom:2px solid #333;" if r["mask"] == 1 else "color:#777;")
        data = {k: "" if r[k] is None else r[k] for k in ("i", "id", "part", "mask")}
        data |= {k: "" if r[k] is None else repr(float(r[k])) for k in ("adv", "lp", "tlp")}
        data["value"] = "" if v is None else repr(float(v))
        attrs = " ".join(f'data-{k}="{html.escape(str(x), quote=True)}"' for k, x in data.items())
        text = html.escape(r["text"]).replace("\n", "\u21b5\n")  # shown, and a line break (pre-wrap)
        spans.append(
            f'<span class="tok tok-{r["part"]}" {attrs} title="{html.escape(title, quote=True)}" '
            f'style="background:{colour(v, scale, diverging)};{line}white-space:pre-wrap">{text}</span>'
        )
    return f'<div class="toks" data-quantity="{html.escape(quantity)}" style="line-height:1.9">{"".join(spans)}</div>'
