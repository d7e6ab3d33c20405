"""checkpoint.py: the trainer's checkpoints, for resuming, in Trinity-RFT's layout (beside the weights that sync.py
publishes for explorers):

    <job dir>/global_step_N/actor/{huggingface/, model/, optimizer/, rng_state_rank<r>.safetensors,
                                   trainer_state.json}   (+ critic/{huggingface/, model/, optimizer/, ...})
        model/, optimizer/: the trained weights and the optimizer's states as torch.distributed.checkpoint shards in
        safetensors files, one file (or more) per saving rank (no gather on rank 0), loaded on any number of ranks;
        huggingface/ (gathered on rank 0) as trainer.save_hf_checkpoint says (always, or only the published ones)
        a LoRA actor (lora.py): lora_adapter/ (peft's format, fp32) instead of huggingface/, which is there only when
        the step's merged weights were published for the explorer; lora_published/ (the adapter in the engine's
        dtype) when it was published for vLLM engines that serve it (sync.adapter_path)
    <job dir>/global_step_N/manifest.json              size and sha256 of every file, written last
    <job dir>/latest_checkpointed_iteration.txt        N, moved after every rank has written

    save_checkpoint(model, optim, tokenizer, job_dir, step, rank, weights, keep)   # every rank
    step = latest_checkpoint(job_dir)              # the newest undamaged one (damaged ones are named, skipped)
    load_model_shards(model, folder)               # the weights of the step's actor (or critic) folder
    state = load_checkpoint(model, optim, job_dir, step, rank)   # optimizer states and RNG
    with publishing(job_dir, step): ...            # the trainer's publishing (lora.publish), a full disk named
No pickle: safetensors for tensors, JSON for the rest.

A full, read-only or failing disk (ENOSPC, EDQUOT, EROFS, EIO) while saving or publishing ends in a StorageError that
names the step, the job directory, the checkpoint a restart resumes from and what to do; this process's temporary
files are deleted, and no pointer has moved: the previous checkpoint and published weights stay whole.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import lora
from errors import ConfigError, DataError
from sync import POINTER, full_state, in_use, read_pointer, save_hf, step_folders, weights_path, write_atomic

log = logging.getLogger("nanorft.checkpoint")
CKPT_POINTER = "latest_checkpointed_iteration.txt"  # the newest complete checkpoint


def save_checkpoint(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    tokenizer: Any,
    job_dir: str | Path,
    step: int,
    rank: int,
    weights: dict[str, torch.Tensor] | None,
    keep: int | None = None,
    critic: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
    state: dict | None = None,
    trained_with: dict[str, str] | None = None,
    hf: bool = True,
) -> None:
    """global_step_<step>/actor/{huggingface/, model/, optimizer/, rng_state_rank<r>.safetensors, trainer_state.json}
    (+ critic/{huggingface/, model/, optimizer/, trainer_state.json} with a critic); then
    latest_checkpointed_iteration.txt and trainer_meta.json move to <step>. `model` (and the critic's): the trainer's
    FSDP2 root, a scoring.TokenScorer (`.model`: the HF model). `weights`: the full state when the sync phase just
    published this step's HF folder (else None); `keep`: delete older checkpoints beyond this many (prune_checkpoints:
    never one an explorer may be loading); `state` (small JSON trainer state: the adaptive KL coefficient) and
    `trained_with` (what a resume must not change: check_resume) go in actor/trainer_state.json; `hf` false: no
    huggingface/ folders beyond what the sync phase published (trainer.save_hf_checkpoint: a resume reads model/).
    Every rank must call it. A full or failing disk ends it in a StorageError, the previous checkpoint and its
    pointer as they were. NOTE: the pointer moves last, after a barrier: a checkpoint without it is ignored."""
    job, actor = Path(job_dir), weights_path(job_dir, step).parent
    with storage(f"cannot save checkpoint step {step} in {job}", job, lambda: _checkpoint_kept(job)):
        if critic is not None:
            critic_model, critic_optim = critic
            _save_role(
                critic_model,
                critic_optim,
                tokenizer=None,
                folder=actor.parent / "critic",
                rank=rank,
                weights=None,
                meta={"global_step": step},
                hf=hf,
            )
        _save_role(
            model,
            optim,
            tokenizer=tokenizer,
            folder=actor,
            rank=rank,
            weights=weights,
            meta={"global_step": step, "state": state or {}, "trained_with": trained_with or {}},
            hf=hf,
        )
        _complete(job, step, rank)
    if keep and rank == 0:
        prune_checkpoints(job, keep)


def _complete(job: Path, step: int, rank: int) -> None:
    """The last of checkpoint `step`: each rank's RNG state; once all have written, its manifest, then
    trainer_meta.json and latest_checkpointed_iteration.txt (rank 0)."""
    actor = weights_path(job, step).parent
    rng = {"cpu": torch.get_rng_state()} | ({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})
    write_atomic(actor / f"rng_state_rank{rank}.safetensors", lambda p: safetensors.torch.save_file(rng, p))
    dist.barrier()
    if rank == 0:
        write_manifest(actor.parent)
        write_atomic(
            job / "trainer_meta.json",
            lambda p: Path(p).write_text(
                json.dumps({"latest_iteration": step, "time": time.time(), "world_size": dist.get_world_size()})
            ),
        )
        write_atomic(job / CKPT_POINTER, lambda p: Path(p).write_text(f"{step}\n"))


def publishing(job_dir: str | Path, step: int) -> contextlib.AbstractContextManager:
    """A full or failing disk while publishing step `step`'s weights (train.publish_files, lora.rewind_pointer at
    resume) as a StorageError (`storage`): the pointer still names the weights published before, which explorers
    keep using."""
    job = Path(job_dir)
    return storage(f"cannot publish the weights of step {step} in {job}", job, lambda: _published_kept(job))


# --- a full or failing disk: a named error that says what is kept and what to do


class StorageError(DataError):
    """A checkpoint or the published weights could not be written: the disk is full (ENOSPC, EDQUOT), read-only
    (EROFS) or failing (EIO). Nothing written before is lost: the pointers move only after a whole folder."""


DISK_FAULTS = {  # errno -> (what it says about the disk, what to do first)
    errno.ENOSPC: ("the disk is full", "free space on that disk (or lower trainer.max_checkpoints_to_keep)"),
    errno.EDQUOT: ("the disk quota is used up", "free space under your quota (or lower max_checkpoints_to_keep)"),
    errno.EIO: ("the disk reported an I/O error", "check the disk (dmesg) or move checkpoint_root_dir to a sound one"),
    errno.EROFS: ("the file system is read-only", "remount it writable or move checkpoint_root_dir to a writable one"),
}
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports one: "I/O error: ... (os error 28)"


def disk_fault(e: BaseException) -> tuple[str, str] | None:
    """(what the disk did, what to do) when `e`, or an exception it was raised from (or a rank's, for a
    torch.distributed.checkpoint error), is a DISK_FAULTS error: an OSError by errno, safetensors' SafetensorError by
    its text; else None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, dcp.CheckpointException):  # a torch.distributed.checkpoint save: each rank's own error
            return next(filter(None, (disk_fault(failed) for failed, _ in e.failures.values())), None)
        code = e.errno if isinstance(e, OSError) else None
        if code is None and (m := _OS_ERROR.search(str(e))):
            code = int(m.group(1))
        if code in DISK_FAULTS:
            what, todo = DISK_FAULTS[code]
            return f"{what} ({os.strerror(code)})", todo
        e = e.__cause__ or e.__context__
    return None


@contextlib.contextmanager
def storage(what: str, job: Path, kept: Callable[[], str]) -> Iterator[None]:
    """Turn a full or failing disk under the job directory into a StorageError: `what` failed, why, `kept()` (what
    is still there, and how to go on after the fix). This process's temporary files under `job` (write_atomic's and
    save_hf's, named .<name>.tmp-<pid>) are deleted first: a half-written file holds the space a retry needs."""
    try:
        yield
    except (Exception, dcp.CheckpointException) as e:  # NOTE: the latter is a BaseException
        fault = disk_fault(e)
        if fault is None:
            raise
        _drop_temporaries(job)
        raise StorageError(
            f"{what}: {fault[0]}. {kept()} {fault[1][0].upper()}{fault[1][1:]}, then run again "
            "with continue_from_checkpoint: true."
        ) from None


def _drop_temporaries(job: Path) -> None:
    """Delete this process's temporary files and folders under `job` (.<name>.tmp-<pid>: write_atomic, save_hf)."""
    with contextlib.suppress(OSError):  # NOTE: a failing disk may refuse this too: the error that called it matters
        for tmp in list(job.rglob(f".*.tmp-{os.getpid()}")):
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _checkpoint_kept(job: Path) -> str:
    """What a failed save left: the last complete checkpoint (latest_checkpointed_iteration.txt)."""
    try:
        last = read_pointer(job / CKPT_POINTER)
    except (DataError, OSError) as e:
        return f"{job / CKPT_POINTER} was not moved (and cannot be read now: {e})."
    if not last:
        return (
            f"No checkpoint of this run is complete yet ({job / CKPT_POINTER} is absent): the next run starts "
            "from model.model_path."
        )
    return (
        f"The last complete checkpoint, step {last} ({job / CKPT_POINTER}), is untouched: the next run resumes from it."
    )


def _published_kept(job: Path) -> str:
    """What a failed publish left: the weights explorers load (latest_state_dict_iteration.txt) and the checkpoint."""
    try:
        last = read_pointer(job / POINTER)
    except (DataError, OSError):  # the checkpoint's line below says more
        last = None
    held = f"explorers keep the weights of step {last}" if last else "explorers keep their starting weights"
    return f"{job / POINTER} was not moved ({held}). {_checkpoint_kept(job)}"


def prune_checkpoints(job: Path, keep: int) -> list[int]:
    """Delete checkpoints older than the newest `keep`, except the folders an explorer may be loading
    (sync.in_use: the state-dict pointer's step and the HF folder before it; e.g. sync_interval 10, save_interval 1,
    keep 2: at step 12 the pointer is still at 10). Returns the steps deleted."""
    spared = in_use(job)
    gone = [s for s in sorted(checkpoint_steps(job))[:-keep] if s not in spared]
    for old in gone:
        shutil.rmtree(job / f"global_step_{old}", ignore_errors=True)
    return gone


def _save_role(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    tokenizer: Any,
    folder: Path,
    rank: int,
    weights: dict[str, torch.Tensor] | None,
    meta: dict,
    hf: bool = True,
) -> None:
    """<folder>/{huggingface/, model/, optimizer/, trainer_state.json} of one model (actor or critic); a LoRA actor's
    lora_adapter/ instead of huggingface/ (which the sync phase may have written). model/ and optimizer/: the trained
    weights and the optimizer's states, sharded as the parameters are, each rank writing its own (save_shards:
    nothing gathered); huggingface/ (the weights gathered on rank 0) only where `hf` asks for it."""
    published = weights is not None  # the actor's HF folder of this step was just written by the sync phase
    adapter = lora.adapter_state(model) if model.adapter is not None else None  # LoRA: the adapter alone
    if rank == 0 and adapter is not None:
        lora.save_adapter(model, folder / lora.ADAPTER_DIR, adapter)
    if hf and adapter is None and not published:
        weights = full_state(model.model)
        if rank == 0:  # NOTE: not "if the folder exists": it may be a killed run's, of other weights
            save_hf(model.model, tokenizer, folder / "huggingface", weights)
    del weights
    save_shards(model_tensors(model), folder / MODEL_DIR, rank)
    tensors, groups = optimizer_tensors(model, optim)
    save_shards(tensors, folder / OPTIMIZER_DIR, rank)
    if rank == 0:
        write_atomic(
            folder / "trainer_state.json",
            lambda p: Path(p).write_text(json.dumps(meta | {"param_groups": groups}, indent=1)),
        )
    dist.barrier()


MODEL_DIR, OPTIMIZER_DIR = "model", "optimizer"  # sharded: one safetensors file (or more) per saving rank


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained parameters as this rank holds them (FSDP2 shards: DTensors, the parameters themselves), by fqn;
    a frozen one (a LoRA actor's base weights) is left out: it is model.model_path's; a tied one (the LM head of
    tied embeddings) once, under its first name (safetensors refuses two names for one tensor)."""
    trained = {name for name, q in model.named_parameters() if q.requires_grad}  # NOTE: a tied parameter once
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in state.items() if k in trained}


def optimizer_tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, list]:
    """The optimizer's states as this rank holds them, {"<parameter fqn>/<state name>": tensor} (FSDP2 shards:
    DTensors; a fresh optimizer's are made first, zero), and its param groups."""
    osd = get_optimizer_state_dict(model, optim)
    return {f"{fqn}/{k}": v for fqn, s in osd["state"].items() for k, v in s.items()}, osd["param_groups"]


def save_shards(tensors: dict[str, torch.Tensor], folder: Path, rank: int) -> None:
    """`tensors` (each rank's shards of them) into `folder` with torch.distributed.checkpoint in safetensors files (no
    pickle), each rank writing the shards it holds; a tensor every rank holds whole (Adam's step) is written once.
    Any older content of `folder` (a killed save, another world size's files) is replaced whole: the files are written
    into a temporary folder that takes its name once every rank has written. Every rank must call it."""
    owner = [os.getpid()]  # NOTE: the folder is named after rank 0's process: its storage() deletes it on a fault
    dist.broadcast_object_list(owner, src=0)
    tmp = folder.with_name(f".{folder.name}.tmp-{owner[0]}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    files = file_indices(tensors, dist.get_world_size())
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), files, save_distributed=True))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)


def checkpoint_steps(job: Path) -> list[int]:
    return list(step_folders(job, "actor/trainer_state.json"))


def latest_checkpoint(job: str | Path) -> int:
    """The step of the newest complete, undamaged checkpoint, 0 when there is none. A checkpoint whose files do not
    match its manifest is skipped with a warning naming the file (and left in place); DataError when every
    checkpoint is damaged."""
    newest = read_pointer(Path(job, CKPT_POINTER))
    if not newest:
        return 0
    steps = sorted((s for s in checkpoint_steps(Path(job)) if s <= newest), reverse=True)
    if not steps:
        raise DataError(
            f"{Path(job, CKPT_POINTER)} names step {newest}, and {job} has no checkpoint up to it (no "
            "global_step_<N>/actor/trainer_state.json); move the pointer away to start afresh"
        )
    for step in steps:
        damage = check_manifest(Path(job, f"global_step_{step}"))
        if not damage:
            if step != newest:
                log.warning("resuming from checkpoint step %d, the newest undamaged one (not %d)", step, newest)
            return step
        log.warning("checkpoint step %d is damaged and skipped (left as it is): %s", step, damage)
    raise DataError(f"{job}: every checkpoint is damaged (see the warnings above); move them away to start afresh")


def trained_with(model_path: str, algorithm_type: str) -> dict[str, str]:
    """What a checkpoint records of the settings a resume must not change: the base model (the KL reference and a
    LoRA adapter's base are model.model_path, not the checkpoint's weights) and the algorithm (the optimizer state
    and the trainer state belong to its loss). A local path is kept absolute, so that a relaunch from another
    folder compares equal."""
    local = Path(model_path).expanduser()
    return {
        "model.model_path": str(local.resolve()) if local.exists() else model_path,
        "algorithm.algorithm_type": algorithm_type,
    }


def check_resume(job: str | Path, step: int, now: dict[str, str]) -> None:
    """ConfigError when checkpoint `step` of `job` was trained with other values of the settings in `now`
    (trained_with) than this run's: resuming would silently change the KL reference model, or reuse another loss's
    optimizer state. A checkpoint that recorded none (older code) is resumed as before."""
    meta_file = weights_path(job, step).parent / "trainer_state.json"
    try:
        saved = json.loads(meta_file.read_text()).get("trained_with") or {}
    except (OSError, ValueError, AttributeError) as e:
        raise DataError(f"{meta_file}: cannot be read ({e}); move the checkpoint away to start afresh") from None
    changed = [(k, saved[k], v) for k, v in now.items() if k in saved and saved[k] != v]
    if changed:
        shown = "; ".join(f"{k} is {v!r}, the checkpoint was trained with {was!r}" for k, was, v in changed)
        raise ConfigError(
            f"{job} has checkpoint step {step}, and this run would resume it with other settings: {shown}. Set "
            f"them back to resume, or start a new run from the checkpoint's weights (another name, model.model_path: "
            f"{weights_path(job, step)}), or move {job} away"
        )


MANIFEST = "manifest.json"  # a checkpoint's files: relative path -> [size, sha256], written last


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file of a checkpoint folder (rank 0, after every rank has written)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(folder).as_posix(): [p.stat().st_size, _sha256(p)] for p in files}
    write_atomic(folder / MANIFEST, lambda p: Path(p).write_text(json.dumps(entries, indent=1)))


def check_manifest(folder: Path) -> str:
    """'' when every file of the manifest is there with its size and sha256; else what is wrong, naming the file.
    A checkpoint written before manifests existed passes with a warning."""
    try:
        entries = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        log.warning("%s has no %s (written by an older nanorft): its files cannot be checked", folder, MANIFEST)
        return ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:  # a directory, bytes, ...
        return f"{folder / MANIFEST} cannot be read as JSON ({e})"
    shape = isinstance(entries, dict) and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
        for v in entries.values()
    )
    if not shape:
        return f"{folder / MANIFEST} is not a manifest (a mapping of file -> [size, sha256])"
    for name, (size, digest) in entries.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
        if _sha256(path) != digest:
            return f"{path} differs from what was written (sha256)"
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    job_dir: str | Path,
    step: int,
    rank: int,
    critic: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
) -> dict:
    """Optimizer states (actor, and critic when given) and RNG of checkpoint `step` (the weights were loaded
    from its HF folders); returns the trainer state saved with it."""
    actor = weights_path(job_dir, step).parent
    meta = _load_optimizer(model, optim, actor)
    if critic is not None:
        _load_optimizer(*critic, actor.parent / "critic")
    rng_file = actor / f"rng_state_rank{rank}.safetensors"
    if rng_file.is_file():
        rng = safetensors.torch.load_file(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return meta.get("state", {})


SHARD_FILE_BYTES = 2**26  # what a rank writes to one file of model/ or optimizer/, at most (one tensor may exceed it)


def file_indices(tensors: dict[str, torch.Tensor], world: int) -> dict[str, int]:
    """key -> the file (1, 2, ...) it is written to: consecutive keys, about SHARD_FILE_BYTES of each rank's share
    a file. NOTE: torch.distributed.checkpoint's safetensors writer serializes a whole file in memory (twice over),
    so this bounds what a save adds to a rank's memory; the same on every rank (global shapes)."""
    out, index, size = {}, 1, 0
    for key, t in tensors.items():
        share = t.numel() * t.element_size() // (world if t.dim() else 1)
        if size and size + share > SHARD_FILE_BYTES:
            index, size = index + 1, 0
        out[key], size = index, size + share
    return out


def read_shards(folder: Path) -> dict[str, torch.Tensor]:
    """What save_shards wrote into `folder`, each tensor whole, read in this process alone (no process group: a person,
    a script or a test looking at them)."""
    reader = dcp.HuggingFaceStorageReader(str(folder))
    saved = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
    with warnings.catch_warnings():  # NOTE: its "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def read_optimizer(folder: Path) -> dict[str, torch.Tensor]:
    """The optimizer states of a checkpoint's actor or critic folder, whole: {"<parameter fqn>/<state>": tensor}."""
    if (folder / "optimizer.safetensors").is_file():  # older code's
        return safetensors.torch.load_file(folder / "optimizer.safetensors")
    return read_shards(folder / OPTIMIZER_DIR)


def load_model_shards(model: torch.nn.Module, folder: Path) -> None:
    """The trained weights of a checkpoint's actor or critic folder (model/, as save_shards wrote them on any number
    of ranks) into `model`, each rank reading the parts of its own shards. Every rank must call it."""
    tensors = model_tensors(model)
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(folder / MODEL_DIR)))
    set_model_state_dict(model, tensors, options=StateDictOptions(strict=False))


def _load_optimizer(model: torch.nn.Module, optim: torch.optim.Optimizer, folder: Path) -> dict:
    """Load <folder>/optimizer/ into `optim`, each rank reading the parts of the saved shards it holds now (on as
    many ranks as saved it or any other number); returns <folder>/trainer_state.json. A checkpoint of older code
    holds the states whole in <folder>/optimizer.safetensors: read as such."""
    meta = json.loads((folder / "trainer_state.json").read_text())
    whole = folder / "optimizer.safetensors"
    if whole.is_file():
        tensors, full = safetensors.torch.load_file(whole), True
    else:
        tensors, full = optimizer_tensors(model, optim)[0], False
        dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(folder / OPTIMIZER_DIR)))
    state: dict[str, dict] = {}
    for key, v in tensors.items():
        fqn, name = key.rsplit("/", 1)
        state.setdefault(fqn, {})[name] = v
    set_optimizer_state_dict(
        model,
        optim,
        {"state": state, "param_groups": meta["param_groups"]},
        options=StateDictOptions(full_state_dict=full),
    )
    return meta
