"""Helpers that several test files share: configs of a run, the usual runs of the entry points (over tests/entry.py's
three calls) and the fork server their processes start from, what a DB or a checkpoint holds, reference log-probs,
vLLM switches. Plain functions; the fixtures are tests/conftest.py's (they may
call these). No test file imports another test file or conftest: what two of them need lives here.

Heavy modules (torch, transformers, the project's) are imported inside the functions that use them: a test file
that needs only `in_ci` or `raw` does not pay for them."""

from __future__ import annotations

import functools
import importlib.util
import locale
import multiprocessing.spawn
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import entry
import pytest

if TYPE_CHECKING:
    import concurrent.futures

    import torch

    from buffer import Experience
    from engines import EngineHandle
    from tasksets import Task

ROOT = Path(__file__).resolve().parents[1]
FAKE_VLLM = ROOT / "tests" / "fake_vllm"


# --- the environment: CI, vLLM (the fake of tests/fake_vllm, or the real one)


def in_ci() -> bool:
    """Whether these tests run under CI (the CI variable set, as CI services set it; CI=false, 0, no or empty: not)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def node_lines(launcher_output: str) -> dict[int, str]:
    """node k -> the shell line a launcher over several nodes printed for it (`  node k: <line>`: launch.py)."""
    found = (re.match(r"  node (\d+): (.*)", x) for x in launcher_output.splitlines())
    return {int(m[1]): m[2] for m in found if m}


def chromium_path() -> str | None:
    """The Chromium executable for the browser tests: $NANORFT_CHROMIUM, else Debian's (chromium) or Ubuntu's
    (chromium-browser) on the PATH; None when there is none."""
    import shutil

    if given := os.environ.get("NANORFT_CHROMIUM"):
        return given if os.access(given, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def need_chromium() -> str:
    """chromium_path(), Playwright to drive it, or the test skipped with the reason; under CI (.ci/run installs
    Debian's chromium, `bash run.sh test` Playwright) failed."""
    path = chromium_path()
    why = ""
    if path is None:
        why = "no Chromium here (Debian: apt-get install chromium; or set NANORFT_CHROMIUM to its executable)"
    elif importlib.util.find_spec("playwright") is None:
        why = "Playwright is not installed (the `test` extra: bash run.sh test installs it)"
    if why:
        if in_ci():
            pytest.fail(f"CI must run the studio's browser tests: {why}")
        pytest.skip(why)
    return path


def use_fake_vllm(monkeypatch):
    """`import vllm` gives the fake (tests/fake_vllm) until the test ends, the real vLLM's modules (if loaded) set
    aside meanwhile. Returns the fake module, its list of engines emptied."""
    # weight_transfer.py subclasses vLLM's classes: imported with the fake, it is the fake's until the test ends
    for name in [n for n in sys.modules if n in ("vllm", "weight_transfer") or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # restored when the test ends
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    import vllm

    import weight_transfer  # noqa: F401  (and with it the fake's vllm.distributed and vllm.model_executor)

    assert vllm.__version__.endswith("+fake"), vllm.__file__
    fake = [n for n in sys.modules if n in ("vllm", "weight_transfer") or n.startswith("vllm.")]
    for name in fake:  # set through monkeypatch: removed again when the test ends
        monkeypatch.setitem(sys.modules, name, sys.modules.pop(name))
    vllm.ENGINES.clear()
    return vllm


def real_vllm() -> None:
    """Skip where vLLM (its CPU build, or vLLM on a GPU machine) is not installed, except under CI: CI installs it
    (`bash run.sh test`), and there its tests must run."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None or "fake_vllm" in str(importlib.util.find_spec("vllm").origin):
        why = "vLLM is not installed (bash run.sh vllm)"
        if in_ci():
            pytest.fail(f"CI must run the real-vLLM tests: {why}")
        pytest.skip(why)


# --- DBs and configs


def raw(url: str, sql: str, args: tuple = ()) -> list:
    """Run one statement (`?` placeholders) on a new connection of the DB's own driver, without buffer.py, and
    commit; its rows ([] for a statement without)."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            cur = conn.execute(sql.replace("?", "%s"), args)
            return cur.fetchall() if cur.description else []
    import sqlite3

    conn = sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30)
    try:
        with conn:  # commits
            return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def write_yaml(path: Path, cfg: dict, over: dict) -> Path:
    """Write `cfg` as YAML after applying overrides {"a.b.c": value} (a value None deletes the key)."""
    import copy

    import yaml

    cfg = copy.deepcopy(cfg)
    for key, value in over.items():
        *parents, last = key.split(".")
        d = cfg
        for p in parents:
            d = d.setdefault(p, {})
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def sft_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    data = Path(tiny_model_dir).parent / "arith"
    cfg = {
        "project": "p",
        "name": "t",
        "mode": "train",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        "algorithm": {"algorithm_type": "sft", "optimizer": {"lr": 1e-3}},
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 64},
        "buffer": {
            "train_batch_size": 8,
            "total_steps": 2,
            "trainer_input": {
                "experience_buffer": {
                    "name": "sft",
                    "storage_type": "file",
                    "path": str(data / "sft.jsonl"),
                    "format": {"prompt_type": "messages"},
                }
            },
        },
        "synchronizer": {"sync_interval": 100},
        "trainer": {"save_interval": 1},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "train.yaml", cfg, over)


# NOTE: a stuck side's own timeouts in both_config, below launch()'s 400 s so the project's message comes first. 120 s
# was too short once: under CI's load the explorer took over 120 s to start two vLLM engines (the judge test).
STUCK_AFTER = 300


def both_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    data = Path(tiny_model_dir).parent / "arith"
    fmt = {"prompt_key": "question", "response_key": "answer"}
    cfg = {
        "project": "p",
        "name": "run",
        "mode": "both",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        # an entropy bonus: the weights move every step even when every group's rewards are equal
        "algorithm": {
            "algorithm_type": "grpo",
            "repeat_times": 2,
            "optimizer": {"lr": 1e-3},
            "entropy_loss_fn_args": {"entropy_coef": 0.01},
        },
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 12},
        "buffer": {
            "batch_size": 2,
            "total_steps": 3,
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {
                "taskset": {"name": "arith", "path": str(data), "split": "train", "format": fmt},
                "eval_tasksets": [
                    {
                        "name": "arith_test",
                        "path": str(data),
                        "split": "test",
                        "format": fmt,
                        "rollout_args": {"temperature": 0.0},
                    }
                ],
            },
            "trainer_input": {"experience_buffer": {"name": "exp", "max_read_timeout": STUCK_AFTER}},
        },
        "explorer": {"runner_per_model": 4, "eval_interval": 2, "rollout_model": {"engine_type": "hf"}},
        "synchronizer": {"sync_method": "checkpoint", "sync_interval": 1, "sync_timeout": STUCK_AFTER},
        "trainer": {"save_interval": 0},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "run.yaml", cfg, over)


def write_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    data = Path(tiny_model_dir).parent / "arith"
    cfg = {
        "project": "p",
        "name": "e",
        "mode": "explore",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 2},
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 12},
        "buffer": {
            "batch_size": 3,
            "total_steps": 4,
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {
                "taskset": {
                    "name": "arith",
                    "path": str(data),
                    "split": "train",
                    "format": {"prompt_key": "question", "response_key": "answer"},
                },
                "eval_tasksets": [
                    {
                        "name": "arith_test",
                        "path": str(data),
                        "split": "test",
                        "repeat_times": 2,
                        "format": {"prompt_key": "question", "response_key": "answer"},
                    }
                ],
            },
        },
        "explorer": {
            "runner_per_model": 4,
            "eval_interval": 100,
            "eval_on_startup": False,
            "rollout_model": {"engine_type": "hf"},
        },
        "synchronizer": {"sync_method": "checkpoint", "sync_interval": 100},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "explore.yaml", cfg, over)


# --- the entry points as processes, and what their runs left

# NOTE: the entry points a test starts itself (launch.py, train.py, explore.py: over 150 processes in a full run)
# fork from one server per test process that imported torch, transformers, the other heavy libraries and the
# project's modules once (multiprocessing's forkserver, those modules preloaded; the server never runs a test, so each
# child finds them as just imported, as a fresh process would: the project's modules read no environment at import,
# which tests/test_helpers.py checks). Each child then runs its script as `__main__`, with its own argv, environment,
# working directory and output files, and ends as the interpreter would (threading's exit hooks, non-daemon threads
# joined, atexit handlers run), as `python script.py` does, but without paying those imports again: ~0.2 s of CPU a
# start instead of 5-9 s. What such a process starts of the same entry points or torchrun (a launcher's explorer and
# trainer, learn_table's launcher runs, soak_async's restarts, torchrun's ranks) forks from the same server too (its
# `subprocess.Popen`: _ForkingPopen); vLLM's engines and any other command start as a user's do. An environment that
# differs from the server's in what those libraries read at import (IMPORT_TIME_ENV) gets a plain `python script.py`.
# It stays after the harness's in-process runs (tests/entry.py): with NANORFT_TEST_FORK=0 (no server), test_lease.py's
# slow tests took 1.6-2.3x as long in 3 of 4 side-by-side pairs on 2 shared cores (docs/LOG.md, 2026-11-29).
PRELOADED = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "transformers",
    "transformers.modeling_utils",
    "safetensors.torch",
    "tokenizers",
    "numpy",
    "yaml",
    "omegaconf",
    "tyro",
    "psutil",
    "tqdm",
    "jinja2",
    "matplotlib.pyplot",  # the launcher's plot at the end of a run
    "datasets",  # an explorer's taskset files (and pandas, pyarrow): ~1 s of CPU a start
    "peft",  # a LoRA run's adapter
    *("launch", "explore", "train"),  # and what they import of the project
    "helpers",  # this module: a child runs _entry_main
]
IMPORT_TIME_ENV = ("PYTHON", "HOME", "XDG_", "HF_", "HUGGINGFACE", "TRANSFORMERS_", "TORCH", "PYTORCH_", "OMP_", "MKL")
IMPORT_TIME_ENV += ("TOKENIZERS_", "MPL", "LD_")
REAPPLIED = ("TRANSFORMERS_VERBOSITY",)  # read at import, read again in the child (_entry_main)
RUNTIME_ENV = ("TORCHELASTIC_", "TORCH_NCCL_")  # what torchrun sets for its ranks: read when the process group starts
_server_env: dict[str, str] = {}
# the scripts whose `python SCRIPT` forks in a forked process (_ForkingPopen): run_trains' and scripts/bench_vs_trl.py's
# among them (tiny.py's assets, its TRL side)
ENTRY_POINTS = {ROOT / s for s in ("launch.py", "explore.py", "train.py", "tiny.py", "tests/train_many.py")}
ENTRY_POINTS.add(ROOT / "scripts" / "bench_vs_trl.py")


def fork_context():
    """multiprocessing's forkserver context, its server (one per test process) started with PRELOADED."""
    import multiprocessing
    import multiprocessing.forkserver

    ctx = multiprocessing.get_context("forkserver")
    if not _server_env:
        ctx.set_forkserver_preload(PRELOADED)
        multiprocessing.forkserver.ensure_running()
        _server_env.update(os.environ)
    return ctx


def forkable(env: dict[str, str]) -> bool:
    """Whether a process with `env` may fork from the server: the same values for every variable read at import, and
    the server not switched off (NANORFT_TEST_FORK=0: every process a plain `python`, the server never started)."""
    if "0" in (os.environ.get("NANORFT_TEST_FORK"), env.get("NANORFT_TEST_FORK")):
        return False
    fork_context()
    keys = {k for k in {*env, *_server_env} if k.startswith(IMPORT_TIME_ENV) and not k.startswith(RUNTIME_ENV)}
    keys -= set(REAPPLIED)
    return all(env.get(k) == _server_env.get(k) for k in keys)


class _ForkingPopen(subprocess.Popen):
    """subprocess.Popen in a forked entry point or script (the launcher's, in launch.py or in train.py handing over to
    it; scripts/learn_table.py's, soak_async.py's and bench_vs_trl.py's; torchrun's, for its ranks): `python [-u]
    SCRIPT ...` of the ENTRY_POINTS or `python [-u] -m torch.distributed.run ...`, run from the root with a forkable
    environment, gives an Entry forked from the server when its output can be files (_output_files: inherited, a file,
    DEVNULL, or PIPE read back by communicate, as subprocess.run does); any other command a real Popen."""

    outputs: tuple[str, str] = ("", "")  # this process's stdout and stderr files

    def __new__(cls, args, *rest, **kw):
        cwd, env, out, err = kw.pop("cwd", None), kw.pop("env", None), kw.pop("stdout", None), kw.pop("stderr", None)
        session, text = kw.pop("start_new_session", False), any([kw.pop("text", 0), kw.pop("universal_newlines", 0)])
        env = dict(os.environ) if env is None else env  # inherited, as Popen's
        ours = _our_command(list(args), cwd) if isinstance(args, (list, tuple)) else None
        files = _output_files(out, err) if ours else None
        if files and not rest and not kw and forkable(env):
            script, argv, flags = ours
            with _ENTRY_START:
                prepare = multiprocessing.spawn.get_preparation_data
                multiprocessing.spawn.get_preparation_data = functools.partial(_entry_preparation, prepare)
                try:
                    entry = Entry(script, argv, dict(env), Path(files[0]), Path(files[1]), session=session, flags=flags)
                finally:
                    multiprocessing.spawn.get_preparation_data = prepare
            entry.captured, entry.text = files[2], text
            return entry
        for path in files[2].values() if files else ():
            os.unlink(path)
        return super().__new__(cls)


def _output_files(out: Any, err: Any) -> tuple[str, str, dict[int, str]] | None:
    """Popen's stdout and stderr as the files a forked Entry writes, and {0 (stdout) / 1: the file} of those piped
    (PIPE: a temporary file that Entry.communicate reads back): inherited (None) -> this process's own, DEVNULL ->
    os.devnull, STDOUT (stderr) -> stdout's, an open file -> its path. None where one is none of these."""
    paths, captured = [], {}
    for i, stream in enumerate((out, err)):
        if stream is None:
            paths.append(_ForkingPopen.outputs[i])
        elif stream == subprocess.DEVNULL:
            paths.append(os.devnull)
        elif stream == subprocess.STDOUT and i == 1:
            paths.append(paths[0])
        elif stream == subprocess.PIPE:
            fd, captured[i] = tempfile.mkstemp(prefix="nanorft-pipe-")
            os.close(fd)
            paths.append(captured[i])
        elif isinstance(getattr(stream, "name", None), str):
            paths.append(stream.name)
        else:
            for path in captured.values():
                os.unlink(path)
            return None
    return paths[0], paths[1], captured


def _our_command(args: list[str], cwd: str | None) -> tuple[str, list[str], tuple[str, ...]] | None:
    """(script or module, its argv, python's flags) of `python [-u] SCRIPT|-m MODULE ...` run from the root, where
    SCRIPT is one of the entry points and MODULE torchrun; None for any other command."""
    if not args or args[0] != sys.executable or Path(cwd or os.getcwd()) != ROOT:
        return None
    flags = ("-u",) if args[1:2] == ["-u"] else ()
    args = args[1 + len(flags) :]
    if args[:2] == ["-m", "torch.distributed.run"]:
        return args[1], args[2:], (*flags, "-m")
    if args and ROOT / args[0] in ENTRY_POINTS:
        return str(ROOT / args[0]), args[1:], flags
    return None


_ENTRY_START = threading.Lock()


def _entry_preparation(prepare, name: str) -> dict:
    """What an Entry started in a forked entry point starts from (multiprocessing.spawn.get_preparation_data): tests/ on
    its path, where _entry_main is, and not this process's main module (the child runs its own script: the parent's
    would run again in it as `__mp_main__`)."""
    data = prepare(name)
    data["sys_path"] = [*data["sys_path"], str(ROOT / "tests")]
    return {k: v for k, v in data.items() if k not in ("init_main_from_path", "init_main_from_name")}


def _entry_main(
    script: str,
    argv: list[str],
    env: dict[str, str],
    out: str,
    err: str,
    server_env: dict[str, str],
    session: bool = False,
    flags: tuple[str, ...] = (),
) -> None:
    """In the forked child: `python [flags] script *argv` (flags "-u", "-m": `script` is a module) with `env`, stdout
    to `out` and stderr to `err` (appended), in a session of its own where `session` (Popen's start_new_session). The
    entry points it starts (a launcher's explorer and trainer, torchrun's ranks) fork from the same server
    (`server_env`: its environment)."""
    import atexit
    import runpy
    import traceback

    _become_fresh(env, out, err, server_env, session, "-u" in flags)
    sys.argv = [script, *argv]
    here = str(ROOT) if "-m" in flags else str((ROOT / script).parent)
    sys.path[:] = [here] + [p for p in sys.path if p not in (str(ROOT), str(ROOT / "tests"))]
    code = 0
    try:
        if "-m" in flags:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # the interpreter's way out: threading's exit hooks (executors' workers), the non-daemon threads, atexit's
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _become_fresh(env: dict[str, str], out: str, err: str, server_env: dict, session: bool, unbuffered: bool) -> None:
    """What `python` sets up before a script runs, in a child of the server: its environment, working directory,
    output files (unbuffered: `-u`), session, main-process state and transformers' logging from that environment."""
    import io
    import multiprocessing.forkserver
    import multiprocessing.process
    import multiprocessing.resource_tracker

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    # NOTE: a child of the server has the server's address and "alive" fd (multiprocessing sets them), not its pid:
    # ensure_running would start a second server
    multiprocessing.forkserver._forkserver.ensure_running = multiprocessing.resource_tracker.ensure_running
    if session:
        os.setsid()
    _server_env.update(server_env)
    _ForkingPopen.outputs = (out, err)
    subprocess.Popen = subprocess_handler.Popen = _ForkingPopen  # the second: torchrun's, bound at its import
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if unbuffered:
        raw = {fd: open(fd, "wb", buffering=0, closefd=False) for fd in (1, 2)}
        sys.stdout = io.TextIOWrapper(raw[1], encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(raw[2], encoding="utf-8", errors="backslashreplace", write_through=True)
    else:
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False)
    # NOTE: transformers sets its loggers' level (TRANSFORMERS_VERBOSITY, which a launcher sets for its children), their
    # stream and propagation (CI) once, at import
    from transformers.utils import logging as hf_logging

    hf_logging._reset_library_root_logger()
    hf_logging._configure_library_root_logger()
    multiprocessing.process._parent_process = None  # a main process, as `python script.py` is


def _count(kind: str, n: int = 1) -> None:
    """tests/entry.py's COUNTS (in a forked launcher, its own: not counted)."""
    entry.COUNTS[kind] += n


class Entry:
    """`python [flags] script *argv` started from the fork server (or, where `forkable` says no, as a plain process),
    its stdout and stderr appended to the files `out` and `err` (one file for both: stderr=STDOUT), in a session of its
    own where `session` (Popen's start_new_session: os.killpg reaches it and the plain processes it starts; NOTE: not
    the entry points it starts, which fork from the server, outside its session: a test that kills a launcher's whole
    process group starts it with a real Popen, as test_lora's does). Flags: "-u" (unbuffered
    output), "-m" (`script` is a module: torchrun). Popen's pid, poll, wait, send_signal, terminate, kill, returncode,
    communicate and `with` (what subprocess.run calls)."""

    captured: dict[int, str] = {}  # _ForkingPopen's: {0 (stdout) / 1: the file} of the outputs piped
    text = False  # the piped outputs read back as str

    def __init__(
        self,
        script: str,
        argv: list[str],
        env: dict[str, str],
        out: Path,
        err: Path,
        session: bool = False,
        flags: tuple[str, ...] = (),
    ) -> None:
        _count("processes")
        self.args, self.out, self.plain, self.proc = [sys.executable, *flags, script, *argv], out, None, None
        if forkable(env):
            args, start = (script, argv, env, str(out), str(err), _server_env), {"session": session, "flags": flags}
            self.proc = fork_context().Process(target=_entry_main, args=args, kwargs=start)
            self.proc.start()
            self.pid = self.proc.pid
            while session and self._in_our_group():  # NOTE: as Popen, return once killpg(pid) reaches it
                time.sleep(0.001)
        else:
            with open(out, "a") as o, open(err, "a") as e:
                self.plain = subprocess.Popen(
                    self.args, cwd=ROOT, env=env, stdout=o, stderr=e, start_new_session=session
                )
            self.pid = self.plain.pid

    def _in_our_group(self) -> bool:
        """Whether the forked child runs and has not yet made its own session (_entry_main)."""
        try:
            return self.poll() is None and os.getpgid(self.pid) != self.pid
        except ProcessLookupError:
            return False

    @property
    def returncode(self) -> int | None:
        return self.plain.returncode if self.plain else self.proc.exitcode

    def poll(self) -> int | None:
        return self.plain.poll() if self.plain else self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        if self.plain:
            return self.plain.wait(timeout)
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[Any, Any]:
        """Popen's, for subprocess.run: the wait, then what went to PIPE (read back from its file: str where `text`,
        universal newlines as Popen's), None for an output that went elsewhere."""
        self.wait(timeout)
        got = [None, None]
        for i, path in self.captured.items():
            data = Path(path).read_bytes()
            if self.text:
                data = data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")
            got[i] = data
        for path in self.captured.values():
            os.unlink(path)
        self.captured = {}
        return got[0], got[1]

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, *exc) -> None:
        self.wait()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def kill_explorer_before_write(config: Path, tmp_path: Path, step: int) -> None:
    """explore.py on `config`, SIGKILLed where step `step` has been rolled out and nothing of it written (its pause
    point explore.before_write: never a clock delay, so the run cannot end before the kill); its output in
    <tmp_path>/stderr.txt."""
    marker, log = tmp_path / "paused", tmp_path / "stderr.txt"
    env = {"NANORFT_TEST_PAUSE_AT": f"explore.before_write:{step}", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    proc = entry.start("explore.py", "--config", str(config), log=log, env=env)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), log.read_text()[-3000:] if proc.poll() is not None else "no pause"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def run_entry(
    script: str, argv: list[str], env: dict[str, str], timeout: float, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """subprocess.run(`python [flags] script *argv`, env=env, capture_output=True, text=True, timeout=timeout) from
    the fork server: a process killed at its timeout raises subprocess.TimeoutExpired."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch(), err.touch()
        proc = Entry(script, argv, env, out, err, flags=flags)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(
            proc.args, code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a process group's rendezvous, a server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args=args, nprocs=nprocs, join=True), the ranks forked from the fork server
    (fork_context) instead of started afresh. NOTE: they get the server's environment, not this test's."""
    import torch.multiprocessing as mp

    _count("processes", nprocs)
    if not forkable(dict(os.environ)):
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")
        return
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def launch(
    config: Path, *args: str, script: str = "launch.py", timeout: float = 400, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The launcher on `config` (or `script`: train.py handing over to it), as a process: it starts the explorer's
    and trainer's processes, and reaps them."""
    return entry.run_process(script, "--config", str(config), *args, env=env, timeout=timeout)


def run_train(config: Path, ranks: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    """train.py as the launcher starts it: in this process (ranks=0) or under torchrun (its ranks: processes)."""
    if not ranks:
        return entry.run("train.py", "--config", str(config), env={"NANORFT_LAUNCHED": "1"}, timeout=timeout)
    torchrun = ["--standalone", f"--nproc_per_node={ranks}", "train.py", "--config", str(config)]
    return entry.run_process(
        "torch.distributed.run", *torchrun, env={"NANORFT_LAUNCHED": "1"}, timeout=timeout, flags=("-m",)
    )


def run_explorer(config: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """explore.py on `config`, in this process."""
    return entry.run("explore.py", "--config", str(config), *args, env=env)


STRAIGHT = {"buffer.total_steps": 4, "trainer.save_interval": 2}  # straight_and_resumed's runs


def straight_and_resumed(
    tmp_path: Path, tiny_model_dir: str, straight: Path | None = None, **over
) -> tuple[Path, Path, str]:
    """Two SFT runs of 4 steps, checkpoints every 2: one straight through (or `straight`: the job directory of one that
    ran already, sft_config with STRAIGHT and `over`); one SIGKILLed after saving step 2 (it waits there:
    sync.pause_for_test), then restarted. Returns their job directories and the restart's stderr."""
    over = {**STRAIGHT, **over}
    if straight is None:
        out = run_train(sft_config(tmp_path / "a", tiny_model_dir, **over))
        assert out.returncode == 0, out.stderr[-3000:]
        straight = tmp_path / "a" / "ck" / "p" / "t"
    config = sft_config(tmp_path / "b", tiny_model_dir, **over)
    job = tmp_path / "b" / "ck" / "p" / "t"
    marker = tmp_path / "paused"  # the trainer touches it after saving step 2, then waits
    env = {
        "NANORFT_LAUNCHED": "1",
        "NANORFT_TEST_PAUSE_AT": "train.after_save:2",
        "NANORFT_TEST_PAUSE_MARKER": str(marker),
    }
    proc = entry.start("train.py", "--config", str(config), log=tmp_path / "stderr.txt", env=env)
    deadline = time.monotonic() + 240
    while not marker.exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert marker.exists(), (tmp_path / "stderr.txt").read_text()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (job / "global_step_4").exists()
    resumed = run_train(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 2" in resumed.stderr
    return straight, job, resumed.stderr


def weights(job: Path, step: int) -> dict[str, torch.Tensor]:
    """The actor weights that train step `step` saved under the job directory `job` (its HF safetensors)."""
    import safetensors.torch

    return safetensors.torch.load_file(job / f"global_step_{step}" / "actor" / "huggingface" / "model.safetensors")


def versions_by_step(db: Path | str) -> list[int]:
    """The model version of each experience, in DB order (`db`: a SQLite file or a DB URL)."""
    from buffer import ExperienceDB

    with ExperienceDB(db if isinstance(db, str) else f"sqlite:///{db}") as d:
        rows = d.query("SELECT id, model_version FROM experiences ORDER BY id")
    return [v for _, v in rows]


def rollout_logprob_gap(db: Path | str, version: int, weights: Path) -> float:
    """Largest |rollout log-prob - log-prob under `weights`| over the experiences of `version`: the
    engine's weights at rollout time were `weights` iff this is float rounding (~1e-6)."""
    from buffer import ExperienceDB
    from models import eos_ids, load_model, load_tokenizer

    model = load_model(str(weights))
    with ExperienceDB(db if isinstance(db, str) else f"sqlite:///{db}") as d:
        ids = [i for (i,) in d.query("SELECT id FROM experiences WHERE model_version = ?", (version,))]
        exps = d.get(ids)
    assert exps
    eos = eos_ids(load_tokenizer(str(weights)), model.generation_config)
    return max((behaviour_logprobs(model, x, eos) - x.logprobs).abs().max().item() for x in exps)


def behaviour_logprobs(model, x, eos: list[int]):
    """plain_logprobs of experience `x` at temperature 1 from the distribution its engine sampled from: the EOS ids
    masked where the request's min_tokens masked them (batching.eos_masked), as the engines' and trainer's are."""
    import torch

    import batching

    with torch.no_grad():
        logits = model(torch.as_tensor(x.tokens)[None]).logits[0, x.prompt_length - 1 : -1].float()  # [R,V]
    masked = batching.eos_masked(x)  # [R]
    logits[masked[:, None] & torch.isin(torch.arange(logits.shape[-1]), torch.tensor(eos))[None]] = float("-inf")
    targets = torch.as_tensor(x.tokens)[x.prompt_length :]  # [R]
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # [R]


def mlflow_runs(uri: str) -> dict[str, str]:
    """run name -> status of every run in the mlflow store at `uri`."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return {
        r.info.run_name: r.info.status
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
    }


# --- tasks, models, experiences and log-probs


def make_task(**fields) -> Task:
    """A task with plain values (prompt "x", no messages, no workflow), `fields` replacing them."""
    from configs.schema import GenerationConfig
    from tasksets import Task

    plain = dict(
        taskset="t",
        index=0,
        epoch=0,
        raw={},
        prompt="x",
        messages=None,
        reference=None,
        tools=None,
        workflow="",
        reward_fn="",
        workflow_args={},
        reward_fn_args={},
        rollout_args=GenerationConfig(),
        repeat_times=1,
    )
    return Task(**{**plain, **fields})


class ScriptedEngine:
    """Plays the model: each request gets the next scripted text's ids (+ EOS, or the id given with the text as
    (text, end id)), log-prob -0.5 per token."""

    def __init__(self, tokenizer, texts: list, eos_ids: list[int] | None = None) -> None:
        self.tokenizer, self.texts, self.requests = tokenizer, list(texts), []
        self.model_version = 3
        if eos_ids:
            self.eos_ids = eos_ids

    def submit(self, ids, params) -> concurrent.futures.Future:
        import concurrent.futures

        from engines import Completion

        self.requests.append((list(ids), params))
        text, end = self.texts.pop(0), self.tokenizer.eos_token_id
        if isinstance(text, tuple):
            text, end = text
        out = self.tokenizer.encode(text, add_special_tokens=False)[: params.max_tokens]
        cut = len(out) == params.max_tokens
        out += [] if cut else [end]
        f = concurrent.futures.Future()
        f.set_result([Completion(out, [-0.5] * len(out), text, "length" if cut else "stop", self.model_version)])
        return f


def scripted(tokenizer, texts, **handle) -> EngineHandle:
    """A handle whose engine plays the model: ScriptedEngine."""
    from engines import EngineHandle

    return EngineHandle(ScriptedEngine(tokenizer, texts), tokenizer, {"max_tokens": 200}, **handle)


def tool_task(**fields) -> Task:
    """A tool_workflow task whose answer needs the calculator: 37 + 58 - 12 = 83, three turns at most."""
    from configs.schema import GenerationConfig

    question = "What is 37 + 58 - 12?"
    tool = dict(
        prompt=question,
        messages=[{"role": "user", "content": question}],
        reference="#### 83",
        workflow="tool_workflow",
        reward_fn="math_reward",
        workflow_args={"max_turns": 3},
        rollout_args=GenerationConfig(temperature=1.0),
        repeat_times=3,
    )
    return make_task(**{**tool, **fields})


def experiences(spec: list[tuple[int, list[int]]], seed: int = 0) -> list[Experience]:
    """Random token ids: one group per (prompt length, [response lengths]) of `spec`, its members sharing the prompt."""
    import torch

    from buffer import Experience

    g, out = torch.Generator().manual_seed(seed), []
    for k, (p, responses) in enumerate(spec):
        prompt = torch.randint(0, 250, (p,), generator=g)
        for r in responses:
            out.append(
                Experience(
                    tokens=torch.cat([prompt, torch.randint(0, 250, (r,), generator=g)]),
                    prompt_length=p,
                    reward=0.0,
                    group_id=f"g{k}",
                    info={"taskset": "hot" if k % 2 else "cold"},
                )
            )
    return out


def perturbed(model_dir: str, scale: float = 0.05):
    """The model of `model_dir` with Gaussian noise of std `scale` added to every weight (fixed seeds)."""
    import torch

    from models import load_model

    model = load_model(model_dir)
    with torch.no_grad():
        for i, w in enumerate(model.parameters()):
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) * scale)
    return model


def plain_logprobs(model, tokens, prompt_length: int, temperature: float = 1.0):
    """log_softmax(logits / T) of a response's tokens from one plain forward pass of that sequence alone (no
    padding, no packing): the reference the trainer's and the engines' log-probs are checked against."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)[None]).logits[0].float() / temperature  # [L,V]
    targets = torch.as_tensor(tokens)[prompt_length:]  # [R]
    return logits[prompt_length - 1 : -1].log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # [R]


def sft_teacher(tiny_model_dir: str, out: Path, steps: int = 60, lr: float = 3e-3, rows: int = 16) -> str:
    """A copy of the tiny model trained by plain SFT (full batches of the first `rows` embedded SFT demonstrations next
    to it, `steps` AdamW steps): a teacher that puts its mass on the demonstrations' layout ("4 * 2 = 8\\n#### 8")."""
    import json

    from models import load_tokenizer

    tok, demos = load_tokenizer(tiny_model_dir), []
    for line in (Path(tiny_model_dir).parent / "arith" / "sft.jsonl").read_text().splitlines()[:rows]:
        messages = json.loads(line)["messages"]
        text = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        prompt = tok.encode(text, add_special_tokens=False)
        demos.append((prompt, tok.encode(messages[-1]["content"], add_special_tokens=False) + [tok.eos_token_id]))
    return trained_to_reply(tiny_model_dir, out, demos, steps, lr)


def constant_judge(tiny_model_dir: str, out: Path) -> str:
    """A copy of the tiny model trained (40 steps, high lr) to answer every judge prompt with "Score: 7": an honest
    real model whose output parses as a grade (tests/conftest.py's judge_dir builds it once per test session)."""
    from models import load_tokenizer
    from workflows.judge import PROMPT as JUDGE_PROMPT

    tok, rows = load_tokenizer(tiny_model_dir), []
    for k in range(8):
        text = JUDGE_PROMPT.format(
            question=f"What is {k} + {k + 3}?",
            reference=f"#### {2 * k + 3}",
            response="x" * (k * 7 % 23) + f" #### {k}",
            max_score="10",
        )
        prompt = tok.encode(
            tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        rows.append((prompt, tok.encode("Score: 7", add_special_tokens=False) + [tok.eos_token_id]))
    return trained_to_reply(tiny_model_dir, out, rows, steps=40)


def trained_to_reply(
    tiny_model_dir: str, out: Path, rows: list[tuple[list[int], list[int]]], steps: int = 80, lr: float = 3e-3
) -> str:
    """A copy of the tiny model trained (high lr) to continue each (context ids, reply ids) row with its reply, and
    with 2048 positions (its config's max_position_embeddings: RoPE has no weights for it) for long chat templates:
    an honest real model that writes what a test needs (a tool call in a family's format, then the answer)."""
    import json
    import shutil

    import torch

    from models import load_model, load_tokenizer

    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tok, model = load_tokenizer(str(out)), load_model(str(out))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        labels[b, len(p) : len(p) + len(r)] = torch.tensor(r)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # NOTE: one thread: on 2 busy cores, two made a step of this tiny model ~10x the CPU time (0.5 s against 0.05 s
    # at 2 x 128 tokens), spinning
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    return str(out)


# --- several trainer runs in one process (or one torchrun launch)


def run_trains(
    configs: list[Path], ranks: int = 0, timeout: float = 600, env: dict | None = None
) -> list[subprocess.CompletedProcess]:
    """run_train for each of `configs`, one after another: in this process (ranks=0, entry.run), or in ONE torchrun
    launch of `ranks` ranks (tests/train_many.py: each run sets up, trains and closes down as train.py does, without
    paying another start of the ranks). Each run's exit code and stderr (rank 0's), as run_train gives them."""
    import json

    env = {"NANORFT_LAUNCHED": "1", **(env or {})}
    if not ranks:
        return [entry.run("train.py", "--config", str(c), env=env, timeout=timeout) for c in configs]
    with tempfile.TemporaryDirectory() as tmp:
        script, codes = ROOT / "tests" / "train_many.py", Path(tmp, "codes.json")
        errs = [Path(tmp, f"stderr{i}.txt") for i in range(len(configs))]
        args = [str(codes), *(str(x) for pair in zip(configs, errs) for x in pair)]
        torchrun = ["--standalone", f"--nproc_per_node={ranks}", str(script), *args]
        out = entry.run_process("torch.distributed.run", *torchrun, env=env, timeout=timeout, flags=("-m",))
        assert out.returncode == 0 and codes.is_file(), (
            out.stderr[-3000:],
            [e.read_text()[-2000:] for e in errs if e.is_file()],
        )
        return [
            subprocess.CompletedProcess(str(c), code, "", e.read_text())
            for c, code, e in zip(configs, json.loads(codes.read_text()), errs)
        ]


def fill(folder: Path) -> Path:
    """Write a file in `folder` until its filesystem is full; the file."""
    import errno

    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler
