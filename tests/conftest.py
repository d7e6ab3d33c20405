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


FAKE_VLLM = ROOT / "tests" / "fake_vllm"


def use_fake_vllm(monkeypatch):
    """`import vllm` gives the fake (tests/fake_vllm) until the test ends, the real vLLM's modules (if loaded) set
    aside meanwhile. Returns the fake module, its list of engines emptied."""
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # restored when the test ends
    monkeypatch.syspath_prepend(str(FAKE_VLLM))
    import vllm

    assert vllm.__version__.endswith("+fake"), vllm.__file__
    for name in ("vllm", "vllm.sampling_params"):  # set through monkeypatch: removed again when the test ends
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


def constant_judge(tiny_model_dir: str, out: Path, reply: str = "Score: 7", steps: int = 40) -> str:
    """A copy of the tiny model trained (a few dozen steps, high lr) to answer every judge prompt with `reply`: an
    honest real model whose output parses as a grade."""
    import shutil

    import torch

    from models import load_model, load_tokenizer
    from workflows.judge import PROMPT as JUDGE_PROMPT

    shutil.copytree(tiny_model_dir, out)
    tok, model = load_tokenizer(str(out)), load_model(str(out))
    rows = []
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
        rows.append((prompt, tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        labels[b, len(p) : len(p) + len(r)] = torch.tensor(r)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return str(out)
