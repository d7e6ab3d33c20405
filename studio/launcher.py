"""The config page's launch button: `python launch.py --config SAVED` as a child process, and its stop button.

    run = start("runs/my.yaml")          # the child in its own session (process group), console to runs/my.yaml.log
    tail(run.log)                        # the console so far (the page shows it, refreshed while the run goes)
    stop(run)                            # SIGINT to its process group: what Ctrl-C in a terminal does

The child runs in the repository (ROOT), as `bash run.sh` runs it: a relative model or data path in a config means
what it means there. It has a session of its own, so that a page rerun, a closed browser tab or the studio's own
Ctrl-C leaves it alone, and so that `stop` reaches launch.py and every process it started in its group, as a
terminal's Ctrl-C reaches the foreground group. launch.py's first SIGINT stops its stages gently (exit 130); a second
kills its children at once (launch.on_second_interrupt). NOTE: the registry is this module's (one per server
process, kept across reruns as the module stays imported): one launch per saved file at a time.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAIL_BYTES = 64 << 10  # the end of the console the page shows

_RUNS: dict[str, Launch] = {}  # resolved saved file -> its latest launch
_LOCK = threading.Lock()  # NOTE: Streamlit runs each session's script in a thread of its own


@dataclasses.dataclass
class Launch:
    """One launch: the saved config, the child, its console file, when it started."""

    config: Path
    proc: subprocess.Popen
    log: Path
    started: float

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def code(self) -> int | None:
        return self.proc.poll()


def current(config: str | Path) -> Launch | None:
    """The latest launch of this saved file in this server (running or ended), None where there was none."""
    return _RUNS.get(str(Path(config).resolve()))


def start(config: str | Path, log: str | Path | None = None) -> Launch:
    """launch.py on the saved file `config` as a child in its own session, stdout and stderr into `log` (default:
    <config>.log, emptied first). A launch of the same file still running is returned as it is, not doubled."""
    cfg = Path(config).resolve()
    with _LOCK:
        run = _RUNS.get(str(cfg))
        if run is not None and run.running:
            return run
        out = Path(log) if log else cfg.with_name(cfg.name + ".log")
        with open(out, "wb") as console:
            proc = subprocess.Popen(
                [sys.executable, "-u", "launch.py", "--config", str(cfg)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=console,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: Ctrl-C's target, apart from the server's
            )
        run = _RUNS[str(cfg)] = Launch(cfg, proc, out, time.time())
        return run


def stop(run: Launch) -> None:
    """What Ctrl-C does in a terminal: SIGINT to the run's whole process group (launch.py and what it started)."""
    if run.running:
        try:
            os.killpg(run.proc.pid, signal.SIGINT)
        except ProcessLookupError:  # ended meanwhile
            pass


def group_alive(run: Launch) -> bool:
    """Whether any process of the run's process group is left."""
    try:
        os.killpg(run.proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tail(log: str | Path, limit: int = TAIL_BYTES) -> str:
    """The last `limit` bytes of a console file as text ("" before it exists)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
