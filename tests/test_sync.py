"""Checkpoint sync: layout, the pointer file, waiting, and that a reader never sees a half-written folder."""

import threading
import time

import torch
from transformers import AutoModelForCausalLM

import sync
from models import load_model, load_tokenizer


def test_publish_then_load_exact_weights(tiny_model_dir, tmp_path):
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # weights the trainer changed
    assert sync.latest_version(tmp_path) == 0
    path = sync.publish_hf(model, tok, tmp_path, step=3)
    assert path == tmp_path / "global_step_3/actor/huggingface" and sync.latest_version(tmp_path) == 3
    loaded = AutoModelForCausalLM.from_pretrained(path)  # plain transformers reads it
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_wait_for_version(tiny_model_dir, tmp_path):
    assert sync.wait_for_version(tmp_path, 1, timeout=0.3, poll=0.05) is None
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    t = threading.Timer(0.3, lambda: sync.publish_hf(model, tok, tmp_path, step=2))
    t.start()
    start = time.monotonic()
    got = sync.wait_for_version(tmp_path, 1, timeout=30, poll=0.05)
    t.join()
    assert got == sync.weights_path(tmp_path, 2) and time.monotonic() - start < 10
    assert (got / "config.json").is_file() and (got / "model.safetensors").is_file()
