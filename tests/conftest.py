"""Shared fixtures (the helper functions that test files share are tests/helpers.py's). Tests run from the
repository root on CPU (`bash run.sh test`)."""

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import entry  # its COUNTS: the summary's line (helpers counts its starts there)

from helpers import ROOT, both_config, constant_judge, in_ci, launch, need_chromium

sys.path.insert(0, str(ROOT))

import pytest

import browser
import pgserver


def pytest_configure(config):
    """One torch thread in each test process and in every process a test starts (OMP_NUM_THREADS, inherited):
    pytest-xdist already runs a worker per core, and torch's second thread spins on a core that is busy (an eval of 50
    problems took 6-12 s of CPU with two threads at load ~6, 0.7 s with one)."""
    import os

    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# the session-scoped runs that tests of several files read (below): grouped as a module-scoped fixture is
SHARED_RUNS = {"staged_run"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Tests that share a module-scoped fixture (one run several tests read, an engine), or one of SHARED_RUNS, get
    one xdist_group, so that `--dist loadgroup` (`bash run.sh test`) runs them on one worker and the fixture is paid
    once, not once per worker (tests linked through a chain of such fixtures share the group)."""
    uses = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        fixtures = info.name2fixturedefs.items() if info else []
        names = [n for n, defs in fixtures if defs[-1].scope == "module" or n in SHARED_RUNS]
        uses[item] = [n if n in SHARED_RUNS else f"{item.module.__name__}::{n}" for n in names]
    group = {}  # fixture -> its group's representative (union-find)

    def find(x):
        while group.setdefault(x, x) != x:
            x = group[x]
        return x

    for names in uses.values():
        for n in names[1:]:
            group[find(n)] = find(names[0])
    for item, names in uses.items():
        if names:
            item.add_marker(pytest.mark.xdist_group(find(names[0])))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the scheduler hands out the tests in this order
        slow_first(items)


def slow_first(items: list) -> None:
    """The slow tests (and every test of a group holding one) before the others, the longest first (a test's
    `slow(seconds=...)`, its measured wall time on 2 busy cores; unmarked ones keep their order), then the rest in
    order. NOTE: xdist hands out the groups first (the largest first), then single tests in this order, a few ahead to
    each worker; when the vLLM runs (60-120 s each) came last among the slow ones, one worker took three of them while
    the other ran every quick test, and finished ~60 s after it."""

    def group(item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return (mark.args[0] if mark.args else mark.kwargs.get("name", "")) if mark else item.nodeid

    cost = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark:
            cost[group(item)] = cost.get(group(item), 0) + mark.kwargs.get("seconds", 0)
    items.sort(key=lambda item: (group(item) not in cost, -cost.get(group(item), 0)))


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands its harness counts (tests/entry.py) to the controller, which sums them."""
    if hasattr(session.config, "workerinput"):
        session.config.workeroutput["entry_counts"] = dict(entry.COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    for key, n in getattr(node, "workeroutput", {}).get("entry_counts", {}).items():
        entry.COUNTS[key] += n


def pytest_terminal_summary(terminalreporter):
    """One line: the entry points the tests ran, as processes and in-process (tests/entry.py: all workers')."""
    counts = entry.COUNTS
    terminalreporter.write_line(
        f"entry points: {counts['processes']} processes started, {counts['in_process']} runs in-process"
    )


@pytest.fixture(autouse=True)
def fresh_config_warnings():
    """configs/checks.py says each warning once per process; each test is a fresh start (caplog sees it)."""
    from configs import checks

    checks._WARNED_ALREADY.clear()


@pytest.fixture(scope="module")
def environment_kept():
    """The environment as it was before the module, put back after it (`pytestmark = pytest.mark.usefixtures(...)`
    where engines are built in the tests' process). NOTE: vLLM's CPU platform sets variables in the process that
    builds an engine (TORCHINDUCTOR_COMPILE_THREADS, LD_PRELOAD, ...); left set, they differ from the tests' fork
    server's, and every later entry point on that worker starts as a plain process (helpers.forkable)."""
    with mock.patch.dict(os.environ):
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The embedded tiny model (and a small arithmetic taskset), built once per test session. NOTE: with the byte
    tokenizer (token id == byte), which tests that count tokens by characters rely on; the embedded default's bpe
    tokenizer has tests of its own (tests/test_tiny.py)."""
    from tiny import build

    out = tmp_path_factory.mktemp("tiny")
    build(str(out), n_train=50, n_test=10, tokenizer="byte")
    return str(out / "tiny-qwen2")


@pytest.fixture(scope="session")
def judge_dir(tiny_model_dir, tmp_path_factory) -> str:
    """A copy of the tiny model trained to answer every judge prompt "Score: 7" (helpers.constant_judge: ~10 s of
    CPU), built once per test session: under pytest-xdist, by the first worker that asks, in the session's folder that
    all workers share, while the others wait on a lock (the tiny model is built the same in every worker); the tests
    that grade with it only read it."""
    import fcntl

    if "PYTEST_XDIST_WORKER" not in os.environ:  # no xdist: this process is the session
        return constant_judge(tiny_model_dir, tmp_path_factory.mktemp("judge") / "judge-model")
    shared = tmp_path_factory.getbasetemp().parent / "judge-model"  # the session's folder, above each worker's
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not shared.is_dir():
            built = constant_judge(tiny_model_dir, tmp_path_factory.mktemp("judge") / "judge-model")
            os.rename(built, shared)  # the same file system: whole or not there
    return str(shared)


@pytest.fixture(scope="session")
def staged_run(tmp_path_factory, tiny_model_dir) -> tuple[Path, subprocess.CompletedProcess]:
    """One launcher run of three stages (a bench, SFT in mode train for 2 steps, GRPO in mode both for 3 steps with
    checkpoint sync, evaluations at steps 0, 2 and 3) with monitor_type mlflow and no tracking URI, and a secret among
    the explorer's env_vars: (its root dir, the launcher's output); the run is <root>/ck/p/run. Read by
    tests/test_launch.py (the stages' hand-over, what mlflow holds) and tests/test_studio_run.py (the run page): one
    run for both (SHARED_RUNS: their tests go to one worker)."""
    root = tmp_path_factory.mktemp("staged")
    data = Path(tiny_model_dir).parent / "arith"
    sft = {
        "name": "sft",
        "storage_type": "file",
        "path": str(data / "sft.jsonl"),
        "format": {"prompt_type": "messages"},
    }
    config = both_config(
        root,
        tiny_model_dir,
        **{"monitor.monitor_type": "mlflow", "explorer.env_vars": {"HF_TOKEN": "hf_abc"}},
        stages=[
            {"stage_name": "eval_base", "mode": "bench"},
            {
                "stage_name": "sft",
                "mode": "train",
                "algorithm": {"algorithm_type": "sft"},
                "buffer": {"train_batch_size": 4, "total_steps": 2, "trainer_input": {"experience_buffer": sft}},
            },
            {"stage_name": "rft", "trainer": {"save_interval": 1}},
        ],
    )  # checkpoints: step 1's weights are kept
    return root, launch(config, env={k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")})


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for the session (tests/pgserver.py). Where none can start, the PostgreSQL cases are
    skipped with the reason, except under CI, which installs the server: there they fail."""
    why = pgserver.missing()
    if why:
        if in_ci():
            pytest.fail(f"CI must run the experience DB tests on PostgreSQL too: {why}")
        pytest.skip(why)
    with pgserver.PostgresServer() as pg:
        yield pg


@pytest.fixture(scope="session")
def headless():
    """A headless Chromium (Playwright's Browser) for the session: tests/browser.py. Where none can start, the browser
    tests are skipped with the reason, except under CI, which installs Chromium: there they fail
    (helpers.need_chromium)."""
    need_chromium()
    with browser.chromium() as b:
        yield b


@pytest.fixture(autouse=True)
def main_module_kept(monkeypatch):
    """NOTE: Streamlit's AppTest runs a page as sys.modules["__main__"] and leaves it there; multiprocessing then
    hands that module to every process started later (forkserver: it runs the page again in the child, which dies
    with exit 1 and no output), so a launch after an AppTest failed. Restored after each test."""
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """An experience DB URL that nothing has used yet, once per back-end: a SQLite file, a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/buffer.db"
    return request.getfixturevalue("postgres").database()


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs at tmp_path/disk (mounting needs root: skipped, saying why, elsewhere), unmounted after."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    yield disk
    if subprocess.run(["umount", str(disk)]).returncode:
        subprocess.run(["umount", "-l", str(disk)], check=True)
