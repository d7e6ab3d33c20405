"""proctree.py: which processes are whose, and stopping them within a bound (Linux's /proc; elsewhere nothing is found).

    proctree.descendants(os.getpid())                     # [pid, ...] of this process's children, theirs, ...
    proctree.left_by(marker, live=[explorer.pid])         # processes carrying `marker` that no live process owns
    proctree.stop_all(pids, grace=10.0)                   # SIGTERM, SIGKILL after `grace` s: (ended, killed)

Two users: the launcher reaps what a role process left running when it died (launch.reap_left: vLLM's engine core and
workers outlive a SIGKILLed explorer), and vllm_engine.EnginePool.close force-stops the processes of an engine that
did not shut down within its bound. A process is named by its pid and its start time (lease.stat: a pid is reused).
NOTE: the launcher finds what its roles started by an entry of their environment (lease.LAUNCHER_PID, its pid and
start time), which every process they start inherits unless it drops its environment: a SIGKILLed process's children
are re-parented (to init, or to a subreaper), so its descendants can no longer be found from its pid.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import lease


def table() -> dict[int, int]:
    """pid -> parent pid of every process this one can see ({} without /proc)."""
    parents = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry.name)] = int(text.rsplit(")", 1)[1].split()[1])  # NOTE: the name may hold ")"
    return parents


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """The processes below `pid` (children, theirs, ...), parents before their children."""
    parents = table() if parents is None else parents
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in found]
        found += children
        frontier = children
    return found


def carries(pid: int, entry: str) -> bool:
    """Whether `entry` ("NAME=value") is in the environment the process `pid` started with (False where unreadable:
    another user's, gone)."""
    try:
        return entry.encode() in (Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except OSError:
        return False


def left_by(entry: str, live: list[int]) -> list[int]:
    """The running processes that carry `entry` in their environment and are neither one of the `live` processes
    nor below one: what processes that have ended left behind. This process and its ancestors are never named."""
    parents = table()
    owned = set(live) | {d for pid in live for d in descendants(pid, parents)}
    mine, pid = {os.getpid()}, os.getpid()
    while pid in parents and parents[pid] not in mine:  # this process and its ancestors
        pid = parents[pid]
        mine.add(pid)
    return [p for p in parents if p not in owned and p not in mine and carries(p, entry) and running(p)]


def running(pid: int) -> bool:
    """Whether `pid` runs (not gone, not a zombie waiting for its parent)."""
    got = lease.stat(pid)
    return got is not None and got[0] != "Z"


def describe(pid: int) -> str:
    """'<pid> (<command line, first 80 characters>)' of a process, for a log line."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "gone"
    return f"{pid} ({cmd[:80]})"


def stop_all(pids: list[int], grace: float) -> tuple[list[int], list[int]]:
    """SIGTERM each process, then SIGKILL those still running after `grace` seconds (grace 0: SIGKILL at once), and
    wait up to 5 s more for them to go. Returns (the pids that ended on SIGTERM, those killed)."""
    started = {pid: lease.started(pid) for pid in pids}
    for pid in pids if grace > 0 else []:
        signal_to(pid, started[pid], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(p, started[p]) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = [p for p in pids if alive(p, started[p])]
    for pid in killed:
        signal_to(pid, started[pid], signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while any(alive(p, started[p]) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if p not in killed], killed


def still_running(pids: list[int], seconds: float) -> list[int]:
    """Those of `pids` still running after up to `seconds` (returns as soon as none is)."""
    started = {pid: lease.started(pid) for pid in pids}
    deadline = time.monotonic() + seconds
    while any(alive(p, started[p]) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p, started[p])]


def alive(pid: int, start: int | None) -> bool:
    """Whether the process `pid` started at `start` still runs (lease.gone: a zombie or a reused pid has ended)."""
    return not lease.gone(pid, start)


def signal_to(pid: int, start: int | None, sig: int) -> None:
    """Send `sig` to the process `pid` if it is still the one started at `start` (a pid is reused)."""
    if alive(pid, start):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
