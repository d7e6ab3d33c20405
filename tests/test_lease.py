"""One owner per role (lease.py) with real processes: a job launched twice runs once, a second explorer of one name
is refused while the first lives and replaces it at once once it is killed, a SIGKILLed launcher leaves no process
running and a relaunch finishes the job exactly once, and a second Ctrl-C ends the launcher without a traceback. The
leases' own tests, over both DB back-ends, are in tests/test_buffer_db.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import entry
import psutil
import pytest

from buffer import ExperienceDB
from helpers import both_config, launch, run_explorer

ROOT = Path(__file__).resolve().parents[1]


def wait_for(predicate, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def assert_once(url: str, rows: int) -> None:
    """The DB holds each (group_id, run_id) once and every experience was claimed by exactly one train step."""
    with ExperienceDB(url) as db:
        pairs = db.query("SELECT group_id, run_id, COUNT(*) FROM experiences GROUP BY group_id, run_id")
        uses = db.query(
            "SELECT e.id, e.use_count, COUNT(c.exp_id) FROM experiences e LEFT JOIN claims c"
            " ON c.exp_id = e.id GROUP BY e.id, e.use_count"
        )
        leases = db.meta_items("lease/")
    assert len(pairs) == rows and all(n == 1 for _, _, n in pairs), pairs
    assert all(used == 1 and claims == 1 for _, used, claims in uses), uses
    assert leases == {}  # released on the way out


@pytest.mark.slow
def test_a_job_launched_twice_runs_once(tmp_path, tiny_model_dir):
    """The second launcher of the same run directory is refused by name at once (exit 2); the first, paused
    meanwhile before writing step 2, then finishes: 3 steps of 2 tasks x 2 responses, each once in the DB and
    claimed once."""
    config = both_config(tmp_path, tiny_model_dir, continue_from_checkpoint=True)
    marker = tmp_path / "paused"
    pause = {"NANORFT_TEST_PAUSE_AT": "explore.before_write:2", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    first = entry.start("launch.py", "--config", str(config), log=tmp_path / "first.log", env=pause)
    try:
        wait_for(lambda: marker.exists() or first.poll() is not None, "the first run's explorer before step 2")
        second = launch(config, timeout=120)
        run = tmp_path / "ck" / "p" / "run"
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"launch: {run} is already being run by another launcher (pid {first.pid} on host " in second.stderr
        assert "Traceback" not in second.stderr
        marker.unlink()  # the first goes on
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert_once(f"sqlite:///{run}/buffer/exp.db", 3 * 2 * 2)


@pytest.mark.slow
def test_a_second_explorer_of_one_name_is_refused_and_replaces_a_killed_one_at_once(tmp_path, tiny_model_dir):
    """Two explorers named alike on one DB: the second is refused by name while the first lives (paused before
    writing step 2); once the first is SIGKILLed, a new one takes the role over at once (same machine: its process
    is gone, no waiting for the heartbeat to go stale) and continues after step 1: no task written twice."""
    over = {"mode": "explore", "synchronizer.sync_style": "trainer_driven", "buffer.explorer_input.eval_tasksets": []}
    config = both_config(tmp_path, tiny_model_dir, continue_from_checkpoint=True, **over)
    marker, url = tmp_path / "paused", f"sqlite:///{tmp_path}/ck/p/run/buffer/exp.db"
    pause = {"NANORFT_TEST_PAUSE_AT": "explore.before_write:2", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    first = entry.start("explore.py", "--config", str(config), log=tmp_path / "first.log", env=pause)
    try:
        wait_for(lambda: marker.exists() or first.poll() is not None, "the first explorer before step 2")
        second = run_explorer(config)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"explorer explorer is already running: pid {first.pid} on host " in second.stderr
        assert "Traceback" not in second.stderr
        first.kill()
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    start = time.monotonic()
    third = run_explorer(config)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over the lease of pid" in third.stderr and "its process is gone" in third.stderr
    assert time.monotonic() - start < 120
    with ExperienceDB(url) as db:
        pairs = db.query("SELECT group_id, run_id, COUNT(*) FROM experiences GROUP BY group_id, run_id")
        assert db.explorer_states()["explorer"]["step"] == 3 and db.meta_items("lease/") == {}
    assert len(pairs) == 3 * 2 * 2 and all(n == 1 for _, _, n in pairs), pairs


@pytest.mark.slow
def test_a_sigkilled_launcher_leaves_no_process_and_a_relaunch_finishes_once(tmp_path, tiny_model_dir):
    """The launcher alone is SIGKILLed (not its process group) while its explorer waits before writing step 2: its
    explorer and trainer end by themselves (lease.follow_launcher), and a relaunch finishes the job, each task and
    experience once. NOTE: a plain process, not forked (helpers: a forked launcher's children are the fork server's)."""
    config = both_config(tmp_path, tiny_model_dir, continue_from_checkpoint=True)
    marker = tmp_path / "paused"
    env = {**os.environ, "NANORFT_TEST_PAUSE_AT": "explore.before_write:2", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    with open(tmp_path / "first.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--config", str(config)], cwd=ROOT, env=env, stdout=out, stderr=out
        )
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, "the explorer before step 2", timeout=400)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2, (tmp_path / "first.log").read_text()[-3000:]  # explorer and trainer
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(children, timeout=60)
        left = [(p.pid, p.cmdline()) for p in alive]
        for p in alive:  # not left behind by a failing test
            p.kill()
        assert left == []
    finally:
        if proc.poll() is None:
            proc.kill()
    marker.unlink()
    out = launch(config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_once(f"sqlite:///{tmp_path}/ck/p/run/buffer/exp.db", 3 * 2 * 2)


# `python -c DEAF launch.py ...`: SIGINT ignored and blocked, then exec: what a script's background job (or a thread
# that blocked it) hands on, through exec, to what it starts
DEAF = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


@pytest.mark.slow
@pytest.mark.parametrize("inherited", ["default", "ignored and blocked"])
def test_a_second_interrupt_ends_the_launcher_at_once_without_a_traceback(tmp_path, tiny_model_dir, inherited):
    """Ctrl-C twice: the first starts the gentle stop (SIGTERM, 30 s of grace: the explorer, paused, ignores it), the
    second kills the processes and leaves with one line, exit 130, no traceback. Also when the launcher was started
    with SIGINT ignored and blocked (a real process, so that the state is inherited through exec)."""
    config = both_config(tmp_path, tiny_model_dir)
    marker = tmp_path / "paused"
    pause = {"NANORFT_TEST_PAUSE_AT": "explore.before_write:1", "NANORFT_TEST_PAUSE_MARKER": str(marker)}
    env = pause | {"NANORFT_TEST_PAUSE_DEAF": "1"}
    if inherited == "default":
        proc = entry.start("launch.py", "--config", str(config), log=tmp_path / "out.log", env=env)
    else:
        with open(tmp_path / "out.log", "w") as out:
            cmd = [sys.executable, "-c", DEAF, "launch.py", "--config", str(config)]
            proc = subprocess.Popen(cmd, cwd=ROOT, env=entry.environment(env), stdout=out, stderr=out)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, "the explorer before step 1")
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "interrupted: stopping" in (tmp_path / "out.log").read_text(), "the first interrupt")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "out.log").read_text()
    assert "interrupted again: trainer, explorer killed" in text or "interrupted again: explorer, trainer" in text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


def test_a_process_is_gone_when_dead_a_zombie_or_its_pid_reused():
    import lease

    me = lease.started(os.getpid())
    assert not lease.gone(os.getpid(), me) and not lease.gone(os.getpid(), None)
    assert lease.gone(os.getpid(), me + 1)  # the pid now names another process than the one recorded
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = lease.started(child.pid)
    child.kill()
    wait_for(lambda: lease.stat(child.pid)[0] == "Z", "the zombie", timeout=30)
    assert lease.gone(child.pid, start)  # killed, not reaped yet: a zombie
    child.wait()
    assert lease.gone(child.pid, start)


def rank_like(launcher: str) -> None:
    """A process whose parent is not the launcher (as torchrun's ranks): only the watchdog can see the launcher go."""
    import lease

    os.environ[lease.LAUNCHER_PID] = launcher
    lease.follow_launcher()
    time.sleep(120)


@pytest.mark.slow
def test_a_grandchild_of_the_launcher_ends_when_it_is_sigkilled():
    """lease.follow_launcher's watchdog: a process started by another than the launcher (torchrun's ranks) gets
    SIGTERM within seconds of the launcher's SIGKILL."""
    import lease
    from helpers import fork_context

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    rank = fork_context().Process(target=rank_like, args=(f"{launcher.pid}:{lease.started(launcher.pid)}",))
    rank.start()
    try:
        launcher.kill()  # NOTE: before or after the rank's watchdog starts: it ends either way
        launcher.wait()
        rank.join(15)
        assert rank.exitcode == -signal.SIGTERM
    finally:
        launcher.kill()
        if rank.is_alive():
            rank.kill()
