"""Benchmark the experience DB in buffer.py against the raw sqlite3 module doing the same SQL.

    .venv/bin/python scripts/bench_db.py [--repeats 5] [--batches 8] [--batch 256]

Experiences of 1,000 tokens (prompt 200 + response 800, with logprobs and action mask, ~8 KB of
tensors each) are written and then claimed in batches, in a fresh WAL database under a temp dir:
  (a) ExperienceDB.write         serialise + one INSERT transaction per batch
  (b) ExperienceDB.claim         queue order, one claim transaction per batch + deserialise
  (c) raw sqlite3 insert         same schema, same blob bytes serialised beforehand, executemany in
                                 one BEGIN IMMEDIATE transaction per batch
  (d) raw sqlite3 claim          select ids, update use_count, insert claims, read the blobs, in one
                                 transaction per batch; no deserialisation
Each is repeated --repeats times (fresh DB each time); the table shows medians. The ratio
ExperienceDB / raw is the cost of buffer.py's Python side (mostly (de)serialisation).
"""

import argparse
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import safetensors.numpy  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

import buffer  # noqa: E402
from buffer import Experience, ExperienceDB  # noqa: E402

PROMPT, RESPONSE = 200, 800


def make_experiences(n: int) -> list[Experience]:
    g = torch.Generator().manual_seed(0)
    return [Experience(tokens=torch.randint(0, 151_000, (PROMPT + RESPONSE,), generator=g),
                       prompt_length=PROMPT, logprobs=-torch.rand(RESPONSE, generator=g),
                       action_mask=torch.ones(RESPONSE, dtype=torch.bool),
                       reward=float(i % 2), group_id=f"task-{i // 8}", run_id=i % 8, task_id=str(i // 8),
                       model_version=3, explorer="bench", info={"answer": "42"}, metrics={"len": RESPONSE})
            for i in range(n)]


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
    rows = [[(now, e.explorer, e.model_version, e.group_id, e.run_id, e.task_id, e.reward, e.prompt_length,
              e.response_length, *buffer.serialise(e)) for e in batch] for batch in batches]
    n = sum(len(b) for b in rows)
    conn = sqlite3.connect(path, timeout=60.0, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for statement in buffer.SCHEMA.split(";"):
        conn.execute(statement)
    start = time.perf_counter()
    for batch in rows:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO experiences (created, explorer, model_version, group_id, run_id,"
                         " task_id, reward, prompt_length, response_length)"
                         " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", [row[:-2] for row in batch])
        last = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
        conn.executemany("INSERT INTO payloads (id, tensors, meta) VALUES (?, ?, ?)",
                         [(last - len(batch) + 1 + k, *row[-2:]) for k, row in enumerate(batch)])
        conn.execute("COMMIT")
    insert = n / (time.perf_counter() - start)
    start, got = time.perf_counter(), 0
    for step, batch in enumerate(rows):
        conn.execute("BEGIN IMMEDIATE")
        ids = [r[0] for r in conn.execute(
            "SELECT id FROM experiences WHERE use_count = 0 ORDER BY id LIMIT ?", (len(batch),))]
        conn.executemany("UPDATE experiences SET use_count = use_count + 1, last_claimed = ? WHERE id = ?",
                         [(now, i) for i in ids])
        conn.executemany("INSERT INTO claims (exp_id, step, claimed) VALUES (?, ?, ?)",
                         [(i, step, now) for i in ids])
        marks = ", ".join("?" * len(ids))
        got += len(conn.execute(f"SELECT id, tensors, meta FROM payloads WHERE id IN ({marks})",
                                ids).fetchall())
        conn.execute("COMMIT")
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
    args = parser.parse_args()
    exps = make_experiences(args.batches * args.batch)
    batches = [exps[i:i + args.batch] for i in range(0, len(exps), args.batch)]
    results: dict[str, list[float]] = {"write": [], "claim": [], "raw insert": [], "raw claim": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            write, claim = bench_buffer(os.path.join(tmp, f"buffer{r}.db"), batches)
            insert, raw_claim = bench_raw(os.path.join(tmp, f"raw{r}.db"), batches)
            for key, value in zip(results, (write, claim, insert, raw_claim)):
                results[key].append(value)
    sample = exps[:1000]
    blobs = [buffer.serialise(e) for e in sample]
    as_dicts = [{"tokens": e.tokens.to(torch.int32), "logprobs": e.logprobs, "action_mask": e.action_mask}
                for e in sample]
    codec_us = {  # per experience; the two library writers get tensors already in the stored dtypes
        "buffer.serialise": per_experience_us(buffer.serialise, sample),
        "safetensors.torch.save": per_experience_us(safetensors.torch.save, as_dicts),
        "safetensors.numpy.save": per_experience_us(lambda d: safetensors.numpy.save(
            {k: v.numpy() for k, v in d.items()}), as_dicts),
        "buffer.deserialise": per_experience_us(
            lambda b: buffer.deserialise(*b, prompt_length=PROMPT), blobs),
    }
    med = {k: statistics.median(v) for k, v in results.items()}

    print(f"python {platform.python_version()}, torch {torch.__version__}, sqlite {sqlite3.sqlite_version}, "
          f"{os.cpu_count()} CPUs; {args.repeats} repeats x {args.batches} batches x {args.batch} "
          f"experiences "
          f"of {PROMPT}+{RESPONSE} tokens ({len(blobs[0][0])} B blob)")
    print(f"| {'measurement':<24} | {'median exp/s':>12} | {'min':>8} | {'max':>8} |")
    print(f"|{'-' * 26}|{'-' * 13}:|{'-' * 9}:|{'-' * 9}:|")
    names = {"write": "(a) ExperienceDB.write", "claim": "(b) ExperienceDB.claim",
             "raw insert": "(c) raw sqlite3 insert", "raw claim": "(d) raw sqlite3 claim"}
    for key, name in names.items():
        low, high = min(results[key]), max(results[key])
        print(f"| {name:<24} | {med[key]:>12,.0f} | {low:>8,.0f} | {high:>8,.0f} |")
    print(f"ratio write / raw insert = {med['write'] / med['raw insert']:.2f}, "
          f"claim / raw claim = {med['claim'] / med['raw claim']:.2f}")
    print("per experience (median of 3 passes over 1,000): "
          + ", ".join(f"{name} {us:.1f} us" for name, us in codec_us.items()))

if __name__ == "__main__":
    main()
