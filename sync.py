"""sync.py: how weights move from the trainer to the explorer.

Checkpoint method (`synchronizer.sync_method: checkpoint`), Trinity-RFT's layout:

    <job dir>/global_step_N/actor/huggingface/     HF folder (config, safetensors, tokenizer)
    <job dir>/latest_state_dict_iteration.txt      N, the newest weights an explorer may load

    publish_hf(model, tokenizer, job_dir, step)    # trainer: write the folder, then move the pointer
    version = latest_version(job_dir)              # explorer: poll the pointer (0 = none yet)
    path = wait_for_version(job_dir, v, timeout)   # explorer at a sync point: block until >= v

NOTE: the folder is written under a temporary name and renamed into place, and only then is the
pointer file replaced (also by rename). A reader that follows the pointer therefore never sees a
half-written folder, even if the trainer is killed mid-save.

The process-group method (`nccl`, a hand-built gloo/NCCL group beside torchrun's) comes with the
trainer.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("nanorft.sync")
POINTER = "latest_state_dict_iteration.txt"


def weights_path(job_dir: str | Path, step: int) -> Path:
    """The HF folder of the weights after train step `step`."""
    return Path(job_dir, f"global_step_{step}", "actor", "huggingface")


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old or the new content, never a mix


def publish_hf(model: Any, tokenizer: Any, job_dir: str | Path, step: int) -> Path:
    """Save `model` (a transformers PreTrainedModel, full weights) as global_step_<step>, then point to it."""
    final = weights_path(job_dir, step)
    tmp = final.with_name(f".huggingface.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # safetensors; tied embeddings are stored once and restored on load
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _write_text_atomic(Path(job_dir, POINTER), f"{step}\n")
    return final


def latest_version(job_dir: str | Path) -> int:
    """The newest published step, 0 when nothing is published yet."""
    try:
        return int(Path(job_dir, POINTER).read_text().strip() or 0)
    except FileNotFoundError:
        return 0


def latest_weights(job_dir: str | Path) -> Path | None:
    """The newest published HF folder of a job, or None."""
    version = latest_version(job_dir)
    return weights_path(job_dir, version) if version else None


def wait_for_version(job_dir: str | Path, version: int, timeout: float, poll: float = 0.5) -> Path | None:
    """Block until weights of at least `version` are published; their folder, or None after `timeout` s."""
    deadline, last_note = time.monotonic() + timeout, time.monotonic()
    while (have := latest_version(job_dir)) < version:
        if time.monotonic() >= deadline:
            return None
        if time.monotonic() - last_note > 30:
            log.info("waiting for weights of step %d from the trainer (newest: %d)", version, have)
            last_note = time.monotonic()
        time.sleep(poll)
    return weights_path(job_dir, have)
