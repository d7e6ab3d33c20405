"""Worker processes that run tool calls (workflows/tools.py's run_tool) with a real timeout.

    out = WORKERS.call({"module": "workflows.calculator", "file": ".../calculator.py", "attr": "calculate"},
                       {"expression": "2 + 3"}, timeout=10.0)   # {"result": "5"} | {"error": ...} | {"timeout": True}

A Python thread cannot be stopped, so a tool that hangs in a thread keeps it for good (and its pool slot), and the
interpreter waits for it at exit. Here a call runs in a worker process that is killed at the timeout. The request
(the function's module / file / name and the call's arguments, parsed JSON) and the reply (the result's str())
travel as JSON lines over pipes: nothing is pickled. Workers are plain `python -c` subprocesses, not
multiprocessing children (spawn and forkserver re-run the parent's main script in every child), that load this
file alone (standard library only), so a worker starts in tens of milliseconds; a tool's module is then loaded
from its file on the worker's first call to it (the calculator: standard library only; a module that imports
torch: seconds, once per worker). Workers are kept in a small pool and reused (per-call overhead in docs/LOG.md);
a killed one is replaced at the next call; a worker whose parent is gone exits (a watchdog thread), and the pool
kills its workers at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable


def get_attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def resolve(ref: dict) -> Callable[..., Any]:
    """The function `ref` ({"module", "file", "attr"}, tools.reference) names, in the worker: its module's file is
    loaded once, under the module's name when it has one (without importing its package first, so that a module
    of standard-library imports loads in milliseconds), else as a module of its own."""
    name = ref["module"] or "nanorft_tool_file:" + ref["file"]
    if name not in sys.modules:
        if not ref["file"]:
            importlib.import_module(name)
        else:
            spec = importlib.util.spec_from_file_location(ref["module"] or Path(ref["file"]).stem, ref["file"])
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    return get_attr(sys.modules[name], ref["attr"])


# --- the worker processes


def serve() -> None:
    """A worker's loop (`python -c`): one JSON request a line on stdin, one JSON reply a line on the original
    stdout; the tool's own prints go to stderr. Exits at EOF, or when its parent is gone (a watchdog thread: a
    tool that hangs must not outlive the explorer)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = os.getppid()

    def watchdog() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    reply.write('{"ready": true}\n')
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            out = {"result": str(resolve(req["ref"])(**req["arguments"]))}
        except BaseException as e:  # the tool's own failure (bad arguments included) is the model's observation
            out = {"error": f"{type(e).__name__}: {e}"}
        reply.write(json.dumps(out) + "\n")
        reply.flush()


# A worker loads this file alone (not the workflows package, which imports torch): see the module docstring.
_SERVE = ("import importlib.util, json, os, sys; sys.path[:0] = json.loads(os.environ['NANORFT_TOOL_PATH']); "
          "s = importlib.util.spec_from_file_location('workflows.tool_workers', os.environ['NANORFT_TOOL_WORKERS']); "
          "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m.serve()")


class Worker:
    """One worker process and the pipes to it."""

    def __init__(self) -> None:
        env = {**os.environ, "NANORFT_TOOL_PATH": json.dumps([p or os.getcwd() for p in sys.path]),
               "NANORFT_TOOL_WORKERS": os.path.abspath(__file__)}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.buf = b""
        if self.read(120.0) != {"ready": True}:
            self.kill()
            raise RuntimeError("a tool worker process did not start")

    def read(self, timeout: float) -> dict | None:
        """The next reply line; None after `timeout` s; {"died": True} if the worker's end of the pipe closed."""
        deadline, fd = time.monotonic() + timeout, self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:  # EOF: the worker died
                return {"died": True}
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """Kill the worker, then close our ends of its pipes (else every worker killed at a timeout would hold two
        file descriptors until garbage collection)."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # NOTE: stdin's close flushes into a dead pipe: BrokenPipeError
                pipe.close()


class Workers:
    """A pool of at most `size` worker processes shared by every episode of this process (runner threads call it
    concurrently; a caller waits for a free worker, which does not count against its timeout)."""

    def __init__(self, size: int = 4) -> None:
        self.size, self.idle, self.busy = size, [], 0
        self.live: set[Worker] = set()  # idle and busy, killed at exit (a hung tool's worker too)
        self.cond = threading.Condition()
        atexit.register(self.close)

    def call(self, ref: dict, arguments: dict, timeout: float) -> dict:
        """{"result": text} | {"error": text} | {"timeout": True}."""
        worker = self.take()
        try:
            worker.send({"ref": ref, "arguments": arguments})
            out = worker.read(timeout)
        except OSError:  # BrokenPipeError: it died before it read the request
            out = {"died": True}
        if out is None or "died" in out:
            worker.kill()  # NOTE: the real cut-off; the next call starts a fresh worker
            with self.cond:
                self.live.discard(worker)
            self.give_back(None)
            return {"timeout": True} if out is None else {"error": "the tool's process died"}
        self.give_back(worker)
        return out

    def take(self) -> Worker:
        with self.cond:
            while not self.idle and self.busy >= self.size:
                self.cond.wait()
            self.busy += 1
            if self.idle:
                return self.idle.pop()
        try:
            worker = Worker()  # started outside the lock: others may use the idle workers meanwhile
        except BaseException:
            self.give_back(None)
            raise
        with self.cond:
            self.live.add(worker)
        return worker

    def give_back(self, worker: Worker | None) -> None:
        with self.cond:
            self.busy -= 1
            if worker is not None:
                self.idle.append(worker)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            live, self.idle = list(self.live), []
            self.live.clear()
        for w in live:
            w.kill()


WORKERS = Workers()
