"""Shared fixtures. Tests run from the repository root on CPU (`bash run.sh test`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest


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
