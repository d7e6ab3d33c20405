"""Benchmark the experience DB in buffer.py against the raw sqlite3 module doing the same SQL; with --postgres,
also on a PostgreSQL server (a throwaway one, tests/pgserver.py, default durability settings, unix socket) against
raw psycopg 3 doing the same SQL.

    .venv/bin/python scripts/bench_db.py [--repeats 5] [--batches 8] [--batch 256] [--postgres]

Experiences of 1,000 tokens (prompt 200 + response 800, with logprobs and action mask, ~8 KB of
tensors each) are written and then claimed in batches, in a fresh WAL database under a temp dir:
  (a) ExperienceDB.write         serialise + one INSERT transaction per batch
  (b) ExperienceDB.claim         queue order, one claim transaction per batch + deserialise
  (c) raw sqlite3 insert         same schema, same blob bytes serialised beforehand, executemany in
                                 one BEGIN IMMEDIATE transaction per batch
  (d) raw sqlite3 claim          select ids, update use_count, insert claims, read the blobs, in one
                                 transaction per batch; no deserialisation
  (e), (f) with --postgres: (a) and (b) on a new PostgreSQL database each repeat
  (g), (h) raw psycopg insert / claim: (c) and (d) in PostgreSQL's SQL (INSERT ... RETURNING id, FOR UPDATE SKIP
                                 LOCKED), executemany in one transaction per batch
Each is repeated --repeats times (fresh DB each time); the table shows medians. The ratio
ExperienceDB / raw is the cost of buffer.py's Python side (mostly (de)serialisation).
"""

import argparse
import contextlib
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

import buffer  # noqa: E402
from buffer import Experience, ExperienceDB  # noqa: E402

PROMPT, RESPONSE = 200, 800


def postgres() -> Any:
    """A throwaway PostgreSQL server with the default durability settings (fsync on), as a context manager."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from pgserver import PostgresServer

    return PostgresServer(fast=False)


def pg_version() -> str:
    from pgserver import find

    return subprocess.run([find("postgres"), "--version"], capture_output=True, text=True).stdout.split()[2]


def make_experiences(n: int) -> list[Experience]:
    g = torch.Generator().manual_seed(0)
    return [
        Experience(
            tokens=torch.randint(0, 151_000, (PROMPT + RESPONSE,), generator=g),
            prompt_length=PROMPT,
            logprobs=-torch.rand(RESPONSE, generator=g),
            action_mask=torch.ones(RESPONSE, dtype=torch.bool),
            reward=float(i % 2),
            group_id=f"task-{i // 8}",
            run_id=i % 8,
            task_id=str(i // 8),
            model_version=3,
            explorer="bench",
            info={"answer": "42"},
            metrics={"len": RESPONSE},
        )
        for i in range(n)
    ]


def bench_buffer(path: str, batches: list[list[Experience]]) -> tuple[float, float]:
    """(write, claim) throughput of ExperienceDB in experiences/s."""
    n = sum(len(b) for b in batches)
    with ExperienceDB(path) as db:
        start = time.perf_counter()
        for batch in batches:
            db.write(batch)
        write = n / (time.perf_counter() - start)
        start = time.perf_counter()
        got = sum(len(db.claim(len(batch), step=step)) for step, batch in enumerate(batches))
        claim = n / (time.perf_counter() - start)
    assert got == n, (got, n)
    return write, claim


def bench_raw(path: str, batches: list[list[Experience]]) -> tuple[float, float]:
    """(insert, claim) throughput of the raw sqlite3 module on pre-serialised rows."""
    now = time.time()
    rows = [
        [
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
                *buffer.serialise(e),
            )
            for e in batch
        ]
        for batch in batches
    ]
    n = sum(len(b) for b in rows)
    conn = sqlite3.connect(path, timeout=60.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for statement in buffer.SCHEMA.format(**buffer.TYPES["sqlite"]).split(";"):
        conn.execute(statement)
    start = time.perf_counter()
    for batch in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO experiences (created, explorer, model_version, group_id, run_id,"
            " task_id, reward, prompt_length, response_length)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [row[:-2] for row in batch],
        )
        last = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
        conn.executemany(
            "INSERT INTO payloads (id, tensors, meta) VALUES (?, ?, ?)",
            [(last - len(batch) + 1 + k, *row[-2:]) for k, row in enumerate(batch)],
        )
        conn.execute("COMMIT")
    insert = n / (time.perf_counter() - start)
    start, got = time.perf_counter(), 0
    for step, batch in enumerate(rows):
        conn.execute("BEGIN IMMEDIATE")
        ids = [
            r[0]
            for r in conn.execute("SELECT id FROM experiences WHERE use_count = 0 ORDER BY id LIMIT ?", (len(batch),))
        ]
        conn.executemany(
            "UPDATE experiences SET use_count = use_count + 1, last_claimed = ? WHERE id = ?", [(now, i) for i in ids]
        )
        conn.executemany("INSERT INTO claims (exp_id, step, claimed) VALUES (?, ?, ?)", [(i, step, now) for i in ids])
        marks = ", ".join("?" * len(ids))
        got += len(conn.execute(f"SELECT id, tensors, meta FROM payloads WHERE id IN ({marks})", ids).fetchall())
        conn.execute("COMMIT")
    claim = n / (time.perf_counter() - start)
    conn.close()
    assert got == n, (got, n)
    return insert, claim


def bench_raw_postgres(url: str, batches: list[list[Experience]]) -> tuple[float, float]:
    """(insert, claim) throughput of raw psycopg 3 on pre-serialised rows, PostgreSQL's SQL for (c) and (d)."""
    import psycopg

    now = time.time()
    rows = [
        [
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
                *buffer.serialise(e),
            )
            for e in batch
        ]
        for batch in batches
    ]
    n = sum(len(b) for b in rows)
    conn = psycopg.connect(url, autocommit=True)
    for statement in buffer.SCHEMA.format(**buffer.TYPES["postgresql"]).split(";"):
        conn.execute(statement)
    start = time.perf_counter()
    for batch in rows:
        with conn.transaction(), conn.cursor() as cur:
            cur.executemany(
                buffer.INSERT_EXPERIENCES.replace("?", "%s") + " RETURNING id", [r[:-2] for r in batch], returning=True
            )
            ids = [cur.fetchone()[0]]
            while cur.nextset():
                ids.append(cur.fetchone()[0])
            cur.executemany(
                "INSERT INTO payloads (id, tensors, meta) VALUES (%s, %s, %s)",
                [(i, *row[-2:]) for i, row in zip(ids, batch)],
            )
    insert = n / (time.perf_counter() - start)
    start, got = time.perf_counter(), 0
    for step, batch in enumerate(rows):
        with conn.transaction(), conn.cursor() as cur:
            ids = [
                r[0]
                for r in cur.execute(
                    "SELECT id FROM experiences WHERE use_count = 0 ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED",
                    (len(batch),),
                )
            ]
            cur.executemany(
                "UPDATE experiences SET use_count = use_count + 1, last_claimed = %s WHERE id = %s",
                [(now, i) for i in ids],
            )
            cur.executemany(
                "INSERT INTO claims (exp_id, step, claimed) VALUES (%s, %s, %s)", [(i, step, now) for i in ids]
            )
            got += len(cur.execute("SELECT id, tensors, meta FROM payloads WHERE id = ANY(%s)", (ids,)).fetchall())
    claim = n / (time.perf_counter() - start)
    conn.close()
    assert got == n, (got, n)
    return insert, claim


def per_experience_us(fn: object, items: list, repeats: int = 3) -> float:
    """Median over repeats of the time per item, in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - start) / len(items) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8, help="batches per repeat")
    parser.add_argument("--batch", type=int, default=256, help="experiences per write / claim")
    parser.add_argument("--postgres", action="store_true", help="also on a throwaway PostgreSQL server")
    args = parser.parse_args()
    exps = make_experiences(args.batches * args.batch)
    batches = [exps[i : i + args.batch] for i in range(0, len(exps), args.batch)]
    results: dict[str, list[float]] = {"write": [], "claim": [], "raw insert": [], "raw claim": []}
    if args.postgres:
        results.update({"pg write": [], "pg claim": [], "pg raw insert": [], "pg raw claim": []})
    with tempfile.TemporaryDirectory() as tmp, postgres() if args.postgres else contextlib.nullcontext() as pg:
        for r in range(args.repeats):
            measured = [
                *bench_buffer(os.path.join(tmp, f"buffer{r}.db"), batches),
                *bench_raw(os.path.join(tmp, f"raw{r}.db"), batches),
            ]
            if pg is not None:
                measured += [*bench_buffer(pg.database(), batches), *bench_raw_postgres(pg.database(), batches)]
            for key, value in zip(results, measured):
                results[key].append(value)
    sample = exps[:1000]
    blobs = [buffer.serialise(e) for e in sample]
    as_dicts = [
        {"tokens": e.tokens.to(torch.int32), "logprobs": e.logprobs, "action_mask": e.action_mask} for e in sample
    ]
    codec_us = {  # per experience; the two library writers get tensors already in the stored dtypes
        "buffer.serialise": per_experience_us(buffer.serialise, sample),
        "safetensors.torch.save": per_experience_us(safetensors.torch.save, as_dicts),
        "safetensors.numpy.save": per_experience_us(
            lambda d: safetensors.numpy.save({k: v.numpy() for k, v in d.items()}), as_dicts
        ),
        "buffer.deserialise": per_experience_us(lambda b: buffer.deserialise(*b, prompt_length=PROMPT), blobs),
    }
    med = {k: statistics.median(v) for k, v in results.items()}

    print(
        f"python {platform.python_version()}, torch {torch.__version__}, sqlite {sqlite3.sqlite_version}, "
        f"{os.cpu_count()} CPUs{'; PostgreSQL ' + pg_version() if args.postgres else ''}; "
        f"{args.repeats} repeats x {args.batches} batches x {args.batch} "
        f"experiences "
        f"of {PROMPT}+{RESPONSE} tokens ({len(blobs[0][0])} B blob)"
    )
    print(f"| {'measurement':<34} | {'median exp/s':>12} | {'min':>8} | {'max':>8} |")
    print(f"|{'-' * 36}|{'-' * 13}:|{'-' * 9}:|{'-' * 9}:|")
    names = {
        "write": "(a) ExperienceDB.write",
        "claim": "(b) ExperienceDB.claim",
        "raw insert": "(c) raw sqlite3 insert",
        "raw claim": "(d) raw sqlite3 claim",
        "pg write": "(e) ExperienceDB.write, PostgreSQL",
        "pg claim": "(f) ExperienceDB.claim, PostgreSQL",
        "pg raw insert": "(g) raw psycopg insert",
        "pg raw claim": "(h) raw psycopg claim",
    }
    for key, name in ((k, v) for k, v in names.items() if k in results):
        low, high = min(results[key]), max(results[key])
        print(f"| {name:<34} | {med[key]:>12,.0f} | {low:>8,.0f} | {high:>8,.0f} |")
    print(
        f"ratio write / raw insert = {med['write'] / med['raw insert']:.2f}, "
        f"claim / raw claim = {med['claim'] / med['raw claim']:.2f}"
    )
    if args.postgres:
        print(
            f"PostgreSQL: ratio write / raw insert = {med['pg write'] / med['pg raw insert']:.2f}, "
            f"claim / raw claim = {med['pg claim'] / med['pg raw claim']:.2f}; PostgreSQL / SQLite: write "
            f"{med['pg write'] / med['write']:.2f}, claim {med['pg claim'] / med['claim']:.2f}"
        )
    print(
        "per experience (median of 3 passes over 1,000): "
        + ", ".join(f"{name} {us:.1f} us" for name, us in codec_us.items())
    )


if __name__ == "__main__":
    main()
