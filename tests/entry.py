"""The one way a test starts an entry point (launch.py, train.py, explore.py, tiny.py, torchrun, scripts/*.py, or a
script of its own): three calls with one signature, `script, *argv, env=None, timeout=..., log=None`.

    entry.run(script, *argv)          # in this process: the default (no start-up to pay: ~5 s of imports a process)
    entry.run_process(script, *argv)  # as a process: for what only a process shows (signals, exit codes of a
                                      # crash, torchrun's ranks, a real launcher and the processes it starts)
    entry.start(script, *argv, log=p) # as a process the test will kill: a Popen-like handle, the output in `p`

`script` is a path from the repository's root (or absolute), or a module with flags=("-m",) (torchrun). `env` goes
on top of the test's environment (OMP_NUM_THREADS=1 added; a value None removes a variable). run and run_process
return a subprocess.CompletedProcess (returncode, stdout, stderr as text); a run past `timeout` raises
subprocess.TimeoutExpired.

run gives what a fresh `python script.py` gives in what tests read: sys.argv, the exit code (a SystemExit's, the
script's main's, 1 and the traceback on an exception), stdout and stderr (and the `logging` output of the run), and it
leaves this process as it found it: os.environ, the working directory, signal handlers, logging's handlers and levels
(transformers' too), torch's threads, no torch.distributed group left; a thread the run left running fails the test.
A script with a `main` is run through it (train.py's `__main__` block leaves with os._exit), any other as `__main__`.

The processes start from the fork server of tests/helpers.py (the heavy imports paid once; NANORFT_TEST_FORK=0: a
plain `python` each); a test needs to know nothing of it. COUNTS holds what this process started: pytest's summary
prints it (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = {"processes": 0, "in_process": 0}  # the harness's starts in this test process (the summary sums them)


def environment(env: dict | None) -> dict[str, str]:
    """The test's environment, one torch thread, `env` on top (a value None: the variable removed)."""
    out = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return {k: v for k, v in out.items() if v is not None}


def run_process(
    script: str, *argv: str, env: dict | None = None, timeout: float = 600, log: Path | None = None, flags=()
) -> subprocess.CompletedProcess:
    """`python [flags] script *argv` as a process, run to its end: its exit code, stdout and stderr (and, where `log`
    is given, both appended there too). Killed at `timeout`: subprocess.TimeoutExpired."""
    import helpers

    out = helpers.run_entry(str(script), list(argv), environment(env), timeout, flags=tuple(flags))
    if log is not None:
        with open(log, "a") as f:
            f.write(out.stdout + out.stderr)
    return out


def start(script: str, *argv: str, env: dict | None = None, timeout: float = 600, log: Path | None = None, flags=()):
    """`python [flags] script *argv` started as a process the test will stop (helpers.Entry: Popen's pid, poll, wait,
    send_signal, kill, returncode), its stdout and stderr in `log` (emptied first; a temporary file where None: the
    handle's `out`). `timeout` is the test's to apply (wait(timeout=...))."""
    import helpers

    if log is None:
        fd, name = tempfile.mkstemp(prefix="nanorft-entry-", suffix=".log")
        os.close(fd)
        log = Path(name)
    Path(log).write_text("")
    return helpers.Entry(str(script), list(argv), environment(env), Path(log), Path(log), flags=tuple(flags))


def run(
    script: str, *argv: str, env: dict | None = None, timeout: float = 600, log: Path | None = None, flags=()
) -> subprocess.CompletedProcess:
    """`script *argv` run to its end IN THIS PROCESS, as `python script *argv` would: see the module's docstring.
    flags=("-m",) (a module): a process, as run_process."""
    if "-m" in flags:
        return run_process(script, *argv, env=env, timeout=timeout, log=log, flags=flags)
    COUNTS["in_process"] += 1
    path = Path(script) if Path(script).is_absolute() else ROOT / script
    out, err, threads = io.StringIO(), io.StringIO(), set(threading.enumerate())
    with _kept():
        os.environ.clear()
        os.environ.update(environment(env))
        os.chdir(ROOT)
        sys.argv = [str(path), *argv]
        _transformers_verbosity()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _fresh_root_logger():
            with _alarm(timeout, [sys.executable, str(path), *argv]), _default_warning_filters():
                code = _exit_code(path, list(argv))
            leaked = _threads_left(threads)  # as the interpreter joins them at exit, their output captured
    if log is not None:
        with open(log, "a") as f:
            f.write(out.getvalue() + err.getvalue())
    assert not leaked, f"{script} left threads running: {leaked} (stop them before its main returns)"
    return subprocess.CompletedProcess([sys.executable, str(path), *argv], code, out.getvalue(), err.getvalue())


def _exit_code(path: Path, argv: list[str]) -> int:
    """Run the script (its main where it has one: main(argv), or main() reading sys.argv); the exit code `python`
    would give: main's return or SystemExit's code (a message: printed, 1), 1 and the traceback on an exception."""
    try:
        module = _module(path)
        if module is None:
            runpy.run_path(str(path), run_name="__main__")
            return 0
        code = module.main(argv) if inspect.signature(module.main).parameters else module.main()
        return code if isinstance(code, int) else 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001  (as the interpreter: a traceback, exit 1; KeyboardInterrupt too)
        if isinstance(e, subprocess.TimeoutExpired):
            raise
        traceback.print_exc()
        return 1


def _module(path: Path):
    """The imported module of an entry point with a `main` (launch, train, explore, tiny, scripts/NAME, the one of
    the repository's root or scripts/ that `path` is); None for any other script (run as `__main__`)."""
    import importlib

    if path.parent == ROOT:
        name = path.stem
    elif path.parent == ROOT / "scripts":
        name = f"scripts.{path.stem}"
    else:
        return None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(name)
    return module if callable(getattr(module, "main", None)) else None


@contextlib.contextmanager
def _alarm(timeout: float, args: list[str]):
    """subprocess.TimeoutExpired raised in the run after `timeout` seconds (SIGALRM; the main thread only)."""
    if threading.current_thread() is not threading.main_thread() or not timeout:
        yield
        return

    def expired(*_):
        raise subprocess.TimeoutExpired(args, timeout)

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@contextlib.contextmanager
def _default_warning_filters():
    """The warning filters of a fresh `python` (its DeprecationWarnings shown for `__main__` alone), not pytest's,
    which show every library's (a run's would fill the summary)."""
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        yield


@contextlib.contextmanager
def _fresh_root_logger():
    """The root logger as a fresh process has it: no handler, level WARNING, so that the run's logging.basicConfig
    (configs.entry's) adds its handler, bound to the sys.stderr of that moment: this run's captured one. NOTE: pytest's
    handlers are set aside too: caplog does not see a run's records (its stderr has them)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def _transformers_verbosity() -> None:
    """transformers' level from TRANSFORMERS_VERBOSITY, which it reads once, at its import (a launcher sets it for
    its children): as a fresh process that imports it would have it (put back after the run with the loggers)."""
    if "transformers" in sys.modules and os.environ.get("TRANSFORMERS_VERBOSITY"):
        from transformers.utils import logging as hf_logging

        level = hf_logging.log_levels.get(os.environ["TRANSFORMERS_VERBOSITY"])
        if level is not None:
            hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _kept():
    """What a run may change of this process, put back after it."""
    import torch

    saved = _logging_state()
    environ, cwd, argv, threads = dict(os.environ), os.getcwd(), sys.argv[:], torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals() if signal.getsignal(s) is not None}
    _fresh_process_state()
    try:
        with _no_tqdm_monitor():
            yield
    finally:
        _destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        sys.argv = argv
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                signal.signal(s, h)
        _put_back_logging(saved)


def _fresh_process_state() -> None:
    """What a process starts without and a previous run in this one may have left: what is said once a process
    (configs' warnings, the tool parser's choice)."""
    from configs import checks
    from workflows import tool_parsers

    checks._WARNED_ALREADY.clear()
    tool_parsers._log_once.cache_clear()


@contextlib.contextmanager
def _no_tqdm_monitor():
    """NOTE: tqdm starts a monitor thread with its first bar (a model's loading), which lives as long as the process:
    no monitor during a run (its bars are the same without it), so that no thread of the run outlives it."""
    import tqdm

    interval = tqdm.tqdm.monitor_interval
    tqdm.tqdm.monitor_interval = 0
    try:
        yield
    finally:
        tqdm.tqdm.monitor_interval = interval


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _threads_left(before: set, wait: float = 5.0) -> list[str]:
    """The threads started since `before` that still run after up to `wait` seconds (those ending get the time)."""
    import time

    deadline = time.monotonic() + wait
    while True:
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return [t.name for t in left]
        time.sleep(0.02)


def _loggers() -> dict[str, logging.Logger]:
    """Every logger that exists now, by name ("": the root)."""
    loggers = {"": logging.getLogger()}
    loggers.update({n: lg for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)})
    return loggers


def _logging_state() -> dict:
    """Every logger's level, handlers, propagate and disabled; the root's too; logging.disable's level."""
    state = {n: (lg.level, lg.handlers[:], lg.propagate, lg.disabled) for n, lg in _loggers().items()}
    return {"loggers": state, "disable": logging.root.manager.disable}


def _put_back_logging(saved: dict) -> None:
    """The loggers as _logging_state saw them; one the run made: no level, no handler, propagating."""
    state = saved["loggers"]
    for name, lg in _loggers().items():
        level, handlers, propagate, disabled = state.get(name, (logging.NOTSET, [], True, False))
        lg.setLevel(level)
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
    logging.disable(saved["disable"])
