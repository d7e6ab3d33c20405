"""The cost of a tool call in worker processes (workflows/tool_workers.py): the first call of a process (it starts
a worker: the same cost as replacing one killed at its timeout), a call to a pooled worker, and the calculator
in-process for scale.

    .venv/bin/python scripts/bench_tools.py [--runs 7] [--calls 2000]

Each run is a fresh Python process (a process starts its workers once): its first call, then the mean of --calls
pooled calls and of --calls in-process calculations. Reported: each run's first call and the median over runs of
each figure, in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(calls: int) -> dict[str, float]:
    """One process's figures, in seconds."""
    sys.path.insert(0, str(ROOT))
    from workflows.tool_use import CALCULATOR, calculate
    from workflows.tools import ToolCall, run_tool

    c = ToolCall("calculator", {"expression": "37 + 58 - 12"})
    t = time.perf_counter()
    run_tool([CALCULATOR], c)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(calls):
        run_tool([CALCULATOR], c)
    pooled = (time.perf_counter() - t) / calls
    t = time.perf_counter()
    for _ in range(calls):
        calculate("37 + 58 - 12")
    return {"first": first, "pooled": pooled, "in_process": (time.perf_counter() - t) / calls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a run's own process
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.calls)))
        return
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--one", "--calls", str(a.calls)],
                check=True,
                capture_output=True,
                text=True,
                cwd=ROOT,
            ).stdout
        )
        for _ in range(a.runs)
    ]
    print("first call of each run (ms):", " ".join(f"{r['first'] * 1e3:.1f}" for r in runs))
    for key, what in (
        ("first", "first call (starts a worker)"),
        ("pooled", "a pooled call"),
        ("in_process", "the calculator in-process"),
    ):
        print(f"{what}: median {statistics.median(r[key] for r in runs) * 1e3:.3f} ms over {a.runs} runs")


if __name__ == "__main__":
    main()
