"""Worker processes that run tool calls (workflows/tools.py's run_tool) and the user's own reward functions
(workflows.Reward: `value=True`, the returned {component: number} as JSON) with a real timeout.

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

Containment (tests/test_tools.py): a worker leads a process group of its own (start_new_session) and is killed
with os.killpg, so what a tool started dies with it (a child that calls setsid escapes: this is no sandbox); a
result over MAX_RESULT_BYTES is cut in the worker, saying so, and the parent reads a reply in one linear pass; a
worker inherits ENV_ALLOWED, LC_* and the names listed in NANORFT_TOOL_ENV (comma-separated, e.g. a search tool's
SERPER_API_KEY), not the explorer's secrets (HF_TOKEN, PGPASSWORD). NOTE: that keeps them out of os.environ (a
tool or a library that logs it), but a tool runs as the same user and could read /proc/<explorer pid>/environ.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_RESULT_BYTES = 16384
"""Results and error texts are cut to this many UTF-8 bytes (about 4,000 tokens: plenty for one observation)."""
MAX_REPLY_BYTES = 8 * MAX_RESULT_BYTES + 4096
"""A longer reply line is refused: json.dumps writes a byte of a cut result as 6 bytes at most (\\u00XX), so only a
tool that writes to the reply pipe itself gets there."""
ENV_ALLOWED = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "TEMP",
    "TMP",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONIOENCODING",
    "PYTHONUTF8",
    "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
)
"""The variables a worker inherits (and LC_*): what Python and a tool's subprocesses need to start and to find
files, temporary space and locale; none holds a secret. More with NANORFT_TOOL_ENV (the module docstring)."""


def get_attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def load_object(ref: dict) -> Callable[..., Any]:
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


def cut(text: str) -> str:
    """`text` cut to MAX_RESULT_BYTES bytes of UTF-8, saying so."""
    if len(text) * 4 <= MAX_RESULT_BYTES:  # fast path: a character is at most 4 bytes
        return text
    data = text.encode("utf-8", "replace")  # "replace": a lone surrogate
    if len(data) <= MAX_RESULT_BYTES:
        return text
    kept = data[:MAX_RESULT_BYTES].decode("utf-8", "ignore")  # "ignore": a character split at the cut
    return f"{kept}... [cut: result was {len(data)} bytes, cap {MAX_RESULT_BYTES}]"


# --- the worker processes


def serve() -> None:
    """A worker's loop (`python -c`): one JSON request a line on stdin, one JSON reply a line on the original
    stdout; the tool's own prints go to stderr. Exits at EOF, or when its parent is gone (a watchdog thread: a
    tool that hangs must not outlive the explorer; it kills the worker's process group, the tool's children too)."""
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = os.getppid()

    def watchdog() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)  # the worker leads its group (start_new_session): itself included

    threading.Thread(target=watchdog, daemon=True).start()
    reply.write('{"ready": true}\n')
    reply.flush()
    for line in sys.stdin:
        try:  # NOTE: decoding the request in the try: arguments nested too deeply for this process are an error
            req = json.loads(line)
            value = load_object(req["ref"])(*req.get("args", ()), **req["arguments"])
            if req.get("value"):  # a reward's {component: number}, as JSON (numpy's numbers as floats)
                text = json.dumps({"value": value}, default=float)
                if len(text) > MAX_RESULT_BYTES:
                    raise ValueError(f"its value is over {MAX_RESULT_BYTES} bytes as JSON")
            else:  # a tool's result: its text
                text = json.dumps({"result": cut(str(value))})
        except BaseException as e:  # the tool's own failure (bad arguments included) is the model's observation
            text = json.dumps({"error": cut(f"{type(e).__name__}: {e}")})
        reply.write(text + "\n")
        reply.flush()


# A worker loads this file alone (not the workflows package, which imports torch): see the module docstring.
_SERVE = (
    "import importlib.util, json, os, sys; sys.path[:0] = json.loads(os.environ['NANORFT_TOOL_PATH']); "
    "s = importlib.util.spec_from_file_location('workflows.tool_workers', os.environ['NANORFT_TOOL_WORKERS']); "
    "m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m.serve()"
)


def worker_env(whole: bool = False) -> dict[str, str]:
    """A worker's environment: ENV_ALLOWED, LC_* and the names in NANORFT_TOOL_ENV from ours (`whole`: all of ours,
    for the user's own code that the config names, such as a reward function), and where it finds its code."""
    extra = {name.strip() for name in os.environ.get("NANORFT_TOOL_ENV", "").split(",")}
    env = {k: v for k, v in os.environ.items() if whole or k in ENV_ALLOWED or k.startswith("LC_") or k in extra}
    env.update(
        NANORFT_TOOL_PATH=json.dumps([p or os.getcwd() for p in sys.path]),
        NANORFT_TOOL_WORKERS=os.path.abspath(__file__),
    )
    return env


class Worker:
    """One worker process, leading a process group of its own, and the pipes to it."""

    def __init__(self, whole_env: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(whole_env),
            start_new_session=True,
        )
        self.rest = b""  # what came after the last reply line (nothing, unless a tool wrote to the reply pipe)
        if self.read(120.0) != {"ready": True}:
            self.kill()
            raise RuntimeError("a tool worker process did not start")

    def read(self, timeout: float) -> dict | None:
        """The next reply line; None after `timeout` s; {"lost": why} if the worker's end of the pipe closed, or
        for a line over MAX_REPLY_BYTES or not JSON. One linear pass: chunks are joined once."""
        deadline, fd = time.monotonic() + timeout, self.proc.stdout.fileno()
        chunks, size = [self.rest], len(self.rest)
        while b"\n" not in chunks[-1]:  # NOTE: only the new chunk is searched (a growing buffer was quadratic)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.rest = b"".join(chunks)
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # EOF: the worker died
                return {"lost": "the tool's process died"}
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                return {"lost": f"the tool broke its worker: its reply is over {MAX_REPLY_BYTES} bytes"}
            chunks.append(chunk)
        line, _, self.rest = b"".join(chunks).partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return {"lost": "the tool broke its worker: its reply is not JSON"}

    def send(self, request: bytes) -> None:
        """Write one request line (JSON and a newline, encoded by the caller)."""
        self.proc.stdin.write(request)
        self.proc.stdin.flush()

    def kill(self) -> None:
        """Kill the worker's process group (the worker and whatever its tools started), then close our ends of its
        pipes (else every worker killed at a timeout would hold two file descriptors until garbage collection)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
            os.killpg(self.proc.pid, signal.SIGKILL)  # NOTE: before wait(): the unreaped leader holds the group id
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # NOTE: stdin's close flushes into a dead pipe: BrokenPipeError
                pipe.close()


class Workers:
    """A pool of at most `size` worker processes shared by every episode of this process (runner threads call it
    concurrently; a caller waits for a free worker, which does not count against its timeout). `whole_env`: the
    workers get this process's whole environment (worker_env)."""

    def __init__(self, size: int = 4, whole_env: bool = False) -> None:
        self.size, self.idle, self.busy, self.whole_env = size, [], 0, whole_env
        self.live: set[Worker] = set()  # idle and busy, killed at exit (a hung tool's worker too)
        self.cond = threading.Condition()
        atexit.register(self.close)

    def call(
        self, ref: dict, arguments: dict, timeout: float, args: tuple = (), value: bool = False, by: float = 0.0
    ) -> dict:
        """{"result": text} | {"error": text} | {"timeout": True}; the result cut to MAX_RESULT_BYTES. `args`: the
        function's positional arguments; `value`: {"value": what it returned} as JSON instead of its text; `by`: a
        time.monotonic() deadline for the whole call, the wait for a free worker included (a reward's attempt
        abandoned meanwhile must not take a worker from the live ones)."""
        try:  # encoded before a worker is taken: arguments that cannot be sent cost no worker
            request = json.dumps({"ref": ref, "args": list(args), "arguments": arguments, "value": value})
            request = request.encode() + b"\n"
        except (ValueError, TypeError, RecursionError) as e:
            return {"error": f"the tool call's arguments cannot be sent to the tool ({type(e).__name__}: {e})"}
        worker = self.take(by)
        if worker is None:
            return {"timeout": True}
        if by:
            timeout = min(timeout, by - time.monotonic())
        try:
            worker.send(request)
            out = worker.read(timeout)
        except OSError:  # BrokenPipeError: it died before it read the request
            out = {"lost": "the tool's process died"}
        if out is None or "lost" in out:
            worker.kill()  # NOTE: the real cut-off; the next call starts a fresh worker
            with self.cond:
                self.live.discard(worker)
            self.give_back(None)
            return {"timeout": True} if out is None else {"error": out["lost"]}
        self.give_back(worker)
        return out

    def take(self, by: float = 0.0) -> Worker | None:
        """An idle worker, or a new one while fewer than `size` are busy; None once deadline `by` (if set) passed."""
        with self.cond:
            while not self.idle and self.busy >= self.size:
                if by and by <= time.monotonic():
                    return None
                self.cond.wait(by - time.monotonic() if by else None)
            self.busy += 1
            if self.idle:
                return self.idle.pop()
        try:
            worker = Worker(self.whole_env)  # started outside the lock: others may use the idle workers meanwhile
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
