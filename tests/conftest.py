"""Shared fixtures. Tests run from the repository root on CPU (`bash run.sh test`)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest

import pgserver


@pytest.fixture(autouse=True)
def fresh_config_warnings():
    """configs/checks.py says each warning once per process; each test is a fresh start (caplog sees it)."""
    from configs import checks

    checks._WARNED_ALREADY.clear()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The embedded tiny model (and a small arithmetic taskset), built once per test session."""
    from tiny import build

    out = tmp_path_factory.mktemp("tiny")
    build(str(out), n_train=50, n_test=10)
    return str(out / "tiny-qwen2")


def in_ci() -> bool:
    """Whether these tests run under CI (the CI variable set, as CI services set it; CI=false, 0, no or empty: not)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


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


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """An experience DB URL that nothing has used yet, once per back-end: a SQLite file, a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/buffer.db"
    return request.getfixturevalue("postgres").database()


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


def plain_logprobs(model, tokens, prompt_length: int, temperature: float = 1.0):
    """log_softmax(logits / T) of a response's tokens from one plain forward pass of that sequence alone (no
    padding, no packing): the reference the trainer's and the engines' log-probs are checked against."""
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(tokens)[None]).logits[0].float() / temperature  # [L,V]
    targets = torch.as_tensor(tokens)[prompt_length:]  # [R]
    return logits[prompt_length - 1 : -1].log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # [R]
