"""The harness's process starts (helpers.Entry): a script run from the fork server behaves as `python script.py` does
in what the tests read (exit code, output, environment, working directory, argv, `__main__`, the way out)."""

import os
import signal
import subprocess
import sys
import time

import entry
import pytest

from helpers import ROOT, Entry, forkable, run_entry

SCRIPT = """import atexit, concurrent.futures, json, multiprocessing, os, sys, threading, time
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("NANORFT_T"), "name": __name__,
                  "parent": multiprocessing.parent_process() is None, "path0": sys.path[0]}), flush=True)
atexit.register(lambda: print("atexit ran", file=sys.stderr))
threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True))).start()
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(int)  # left running: its worker ends at threading's exit hook
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "hf":  # transformers' level, set at its import from TRANSFORMERS_VERBOSITY
    from transformers.utils import logging

    print("transformers level", logging.get_verbosity(), flush=True)
if how == "wait":
    open(sys.argv[2], "w").close()
    time.sleep(60)
sys.exit({"ok": 0, "hf": 0, "code": 3, "text": "stopped: a message"}[how])
"""


def both(tmp_path, how: str, env: dict) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **env}
    plain = subprocess.run([sys.executable, str(script), how], cwd=ROOT, env=env, capture_output=True, text=True)
    return plain, run_entry(str(script), [how], env, timeout=60)


@pytest.mark.slow
def test_a_forked_entry_point_exits_writes_and_sees_what_a_fresh_process_does(tmp_path):
    assert forkable({**os.environ, "NANORFT_T": "x", "TRANSFORMERS_VERBOSITY": "error"})
    assert forkable({**os.environ, "TORCHELASTIC_RUN_ID": "x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})  # torchrun's
    assert not forkable({**os.environ, "TORCH_HOME": "/elsewhere"})
    for how in ("ok", "code", "text", "raise", "hf"):
        plain, forked = both(tmp_path, how, {"NANORFT_T": how, "TRANSFORMERS_VERBOSITY": "error"})
        # NOTE: the plain "hf" imports transformers while the thread runs: its lines may come in another order
        same = sorted if how == "hf" else list
        assert (forked.returncode, same(forked.stdout.splitlines())) == (
            plain.returncode,
            same(plain.stdout.splitlines()),
        ), (how, forked.stderr)
        assert plain.returncode == {"ok": 0, "hf": 0, "code": 3, "text": 1, "raise": 1}[how]
        assert '"parent": true' in plain.stdout and f'"var": "{how}"' in plain.stdout
        assert '"name": "__main__"' in plain.stdout and "thread done" in plain.stdout
        assert "atexit ran" in forked.stderr and "atexit ran" in plain.stderr
        assert ("transformers level 40" in plain.stdout) == (how == "hf")
        said = {"text": "stopped: a message", "raise": "ValueError: boom"}.get(how, "")
        assert said in forked.stderr and said in plain.stderr and ("Traceback" in forked.stderr) == (how == "raise")


@pytest.mark.slow
def test_a_forked_entry_point_takes_signals_and_an_import_time_variable_gets_a_plain_process(tmp_path):
    script, marker = tmp_path / "s.py", tmp_path / "waiting"
    script.write_text(SCRIPT)
    proc = entry.start(str(script), "wait", str(marker), log=tmp_path / "log.txt")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.out.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM and proc.proc is not None  # forked, killed as Popen reports it
    proc = entry.start(str(script), "ok", log=tmp_path / "log2.txt", env={"PYTHONPATH": str(tmp_path)})
    assert proc.wait(timeout=60) == 0 and proc.plain is not None  # PYTHONPATH is read at start: a plain process
    # start_new_session, as scripts/soak_async.py starts its processes: a session of its own by the time the start
    # returns (a kill right after it reaches the child, as Popen's does)
    marker.unlink()
    log = tmp_path / "log3.txt"
    proc = Entry(str(script), ["wait", str(marker)], dict(os.environ), log, log, session=True)
    assert os.getpgid(proc.pid) == proc.pid and proc.proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


LAUNCHER = """import os, subprocess, sys
here = dict(cwd=os.getcwd(), env=os.environ)
child = subprocess.Popen([sys.executable, sys.argv[1], "--help"], **here)
other = subprocess.Popen([sys.executable, "-c", "print('plain', flush=True)"])
print(type(child).__name__, child.wait(), type(other).__mro__[1].__name__, other.wait(), flush=True)
torchrun = subprocess.Popen((sys.executable, "-u", "-m", "torch.distributed.run", "--help"), env=os.environ)
print(type(torchrun).__name__, torchrun.wait(), flush=True)
with open(sys.argv[2], "w") as log:
    command = [sys.executable, sys.argv[1], "--help"]
    with subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **here) as to_file:
        print(type(to_file).__name__, to_file.communicate(timeout=60), to_file.returncode, flush=True)
with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=os.getcwd()) as piped:
    shown = piped.communicate(timeout=60)
    print(type(piped).__name__, shown[1], piped.returncode, flush=True)
with open(sys.argv[2] + ".piped", "w") as f:
    f.write(shown[0])
"""


@pytest.mark.slow
def test_a_forked_launcher_forks_its_explorer_and_trainer_and_starts_anything_else_as_popen(tmp_path):
    """A launcher run from the fork server: its `python explore.py` (or train.py, launch.py) forks too (an Entry), its
    output where the launcher's goes, to the file it names, to DEVNULL or to PIPE, as subprocess.run uses it (the
    environment inherited, the piped output read back as text), in a session of its own where asked, and so does
    `python -u -m torch.distributed.run` (as torchrun's own Popen calls it for its ranks, the working directory
    inherited); another command is a plain process."""
    launcher, script, log = tmp_path / "launch.py", str(ROOT / "explore.py"), tmp_path / "child.log"
    launcher.write_text(LAUNCHER)
    plain = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
    torchrun = [sys.executable, "-u", "-m", "torch.distributed.run", "--help"]
    plain_torchrun = subprocess.run(torchrun, cwd=ROOT, capture_output=True, text=True)
    forked = run_entry(str(launcher), [script, str(log)], dict(os.environ), timeout=120)
    assert plain.returncode == 0 and plain_torchrun.returncode == 0 and forked.returncode == 0, forked.stderr
    lines = ["Entry 0 Popen 0", "Entry 0", "Entry (None, None) 0", "Entry None 0"]  # `python -c`: a Popen
    ends = "\nEntry 0\nEntry (None, None) 0\nEntry None 0\n"
    assert "\nEntry 0 Popen 0\n" in forked.stdout and forked.stdout.endswith(ends)
    assert sorted(forked.stdout.splitlines()) == sorted(
        [*plain.stdout.splitlines(), *plain_torchrun.stdout.splitlines(), "plain", *lines]
    )
    assert log.read_text() == plain.stdout and log.with_name("child.log.piped").read_text() == plain.stdout


def test_the_projects_modules_read_no_environment_as_they_are_imported():
    """The fork server imports the project's modules once (helpers.PRELOADED) and its children find them so: the state
    a fresh process would have only while no module reads the environment or argv at import. Module and class bodies,
    default values and decorators run at import; function bodies and `if __name__ == "__main__":` do not."""
    import ast

    def reads(node: ast.AST) -> list[int]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            now = [*node.args.defaults, *node.args.kw_defaults, *getattr(node, "decorator_list", [])]
            return [n for d in now if d is not None for n in reads(d)]
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return []
        here = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        if here and (node.value.id, node.attr) in {("os", "environ"), ("os", "getenv"), ("sys", "argv")}:
            return [node.lineno]
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and {"environ", "getenv"} & {a.name for a in node.names}
        ):
            return [node.lineno]
        return [n for child in ast.iter_child_nodes(node) for n in reads(child)]

    files = [*ROOT.glob("*.py"), *ROOT.glob("algos/*.py"), *ROOT.glob("configs/*.py"), *ROOT.glob("workflows/*.py")]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files for n in reads(ast.parse(f.read_text()))]
    assert len(files) > 40 and not found, found


# --- entry.run: an entry point in the test's own process gives what `python script.py` gives, and leaves no trace

IN_PROCESS = """import json, logging, os, signal, sys, threading, time
import torch
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("NANORFT_T"), "name": __name__}))
print("to stderr", file=sys.stderr)
logging.basicConfig(level=logging.INFO)
logging.getLogger("nanorft.t").info("a log line")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
how = sys.argv[1]
os.environ["NANORFT_SET_BY_RUN"] = "1"
os.chdir(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: None)
logging.getLogger().setLevel(logging.DEBUG)
logging.getLogger("transformers").setLevel(logging.DEBUG)
logging.getLogger("nanorft.new_by_run").addHandler(logging.StreamHandler())
torch.set_num_threads(3)
if how in ("group", "leak"):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}/rdv", rank=0, world_size=1)
if how == "leak":
    threading.Thread(target=time.sleep, args=(20,), daemon=True, name="left-behind").start()
if how == "raise":
    raise ValueError("boom")
sys.exit({"ok": 0, "group": 0, "leak": 0, "code": 3, "text": "stopped: a message"}[how])
"""


def process_state(loggers_of: dict | None = None) -> dict:
    """What an in-process run must leave as it found it; `loggers_of`: an earlier state, whose loggers alone are
    compared (a logger the run made stays in logging's registry: it must hold no level and no handler)."""
    import logging

    import torch
    import torch.distributed as dist

    every = {n: lg for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    loggers = {n: (lg.level, list(lg.handlers), lg.propagate) for n, lg in every.items()}
    if loggers_of is not None:
        made = {n: loggers[n] for n in loggers if n not in loggers_of["loggers"]}
        assert all(state == (logging.NOTSET, [], True) for state in made.values()), made
        loggers = {n: loggers[n] for n in loggers_of["loggers"]}
    return {
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "signals": {s: signal.getsignal(s) for s in signal.valid_signals()},
        "root": (logging.getLogger().level, list(logging.getLogger().handlers)),
        "loggers": loggers,
        "threads": torch.get_num_threads(),
        "group": dist.is_initialized(),
    }


@pytest.mark.slow
def test_an_entry_point_run_in_process_gives_what_a_process_gives_and_leaves_the_process_as_it_was(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(IN_PROCESS)
    before, counts = process_state(), dict(entry.COUNTS)
    for how in ("ok", "code", "text", "raise", "group"):
        args = (str(script), how, str(tmp_path))
        alone = entry.run_process(*args, env={"NANORFT_T": how})
        here = entry.run(*args, env={"NANORFT_T": how})
        assert (here.returncode, sorted(here.stdout.splitlines())) == (
            alone.returncode,
            sorted(alone.stdout.splitlines()),
        ), (how, here.stderr)
        assert alone.returncode == {"ok": 0, "group": 0, "code": 3, "text": 1, "raise": 1}[how]
        assert f'"var": "{how}"' in here.stdout and '"name": "__main__"' in here.stdout and "thread done" in here.stdout
        assert f'"cwd": "{ROOT}"' in here.stdout
        for out in (here, alone):
            assert "to stderr" in out.stderr and "a log line" in out.stderr, (how, out.stderr)
            said = {"text": "stopped: a message", "raise": "ValueError: boom"}.get(how, "")
            assert said in out.stderr and ("Traceback" in out.stderr) == (how == "raise")
        assert process_state(before) == before, how
    assert entry.COUNTS == {"processes": counts["processes"] + 5, "in_process": counts["in_process"] + 5}


@pytest.mark.slow
def test_an_entry_point_run_in_process_that_leaves_a_thread_running_fails_the_test(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(IN_PROCESS)
    before = process_state()
    with pytest.raises(AssertionError, match="left threads running: .*left-behind"):
        entry.run(str(script), "leak", str(tmp_path))
    assert process_state(before) == before


def test_an_entry_point_with_a_main_runs_in_process_through_it_and_counts(tmp_path):
    """launch.py, train.py, explore.py: main(argv), not their `__main__` block (train.py's leaves with os._exit); a
    bad config's exit code and message as a process gives them; entry.COUNTS counts each way."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: explore\nno_such_key: 1\n")
    counts = dict(entry.COUNTS)
    for script in ("train.py", "explore.py", "launch.py"):
        here = entry.run(script, "--config", str(bad))
        assert here.returncode == 2 and "no_such_key" in here.stderr, (script, here.stderr)
    assert entry.COUNTS == {**counts, "in_process": counts["in_process"] + 3}
