"""Shared fixtures. Tests run from the repository root on CPU (`bash run.sh test`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The embedded tiny model (and a small arithmetic taskset), built once per test session."""
    from tiny import build

    out = tmp_path_factory.mktemp("tiny")
    build(str(out), n_train=50, n_test=10)
    return str(out / "tiny-qwen2")
