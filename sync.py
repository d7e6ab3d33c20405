"""sync.py: when and how weights move from the trainer to the explorer.

Checkpoint method (`synchronizer.sync_method: checkpoint`), Trinity-RFT's layout:

    <job dir>/global_step_N/actor/huggingface/     HF folder (config, safetensors, tokenizer)
    <job dir>/latest_state_dict_iteration.txt      N, the newest weights an explorer may load

    publish_hf(model, tokenizer, job_dir, step)    # trainer: write the folder, then move the pointer
    version = latest_version(job_dir)              # explorer: poll the pointer (0 = none yet)

    <job dir>/global_step_N/actor/lora_published/  LoRA served by vLLM engines (serves_adapter): the adapter alone,
                                                   in peft's format, instead (lora.publish; the last step both)

NOTE: the folder is written under a temporary name and renamed into place, and only then is the pointer file
replaced (also by rename): a reader that follows the pointer never sees a half-written folder.

The trainer's checkpoints (for resuming), in the same global_step_N folders: checkpoint.py.

Process-group method (`synchronizer.sync_method: nccl`): trainer rank 0 streams the tensors to the explorer over a
group built by hand (gloo on CPU, NCCL on GPU); its wire protocol (links, buckets, headers) is wire.py's. A LoRA
adapter served by vLLM engines travels alone, to the explorer's process, which writes it as a peft folder of its own
and has its engines load that in place (ExplorerSync.take_weights).

When weights move, the one rule both sides follow: `weights_needed` (the explorer's sync points) and `publishes`
(the train steps whose weights the trainer publishes or sends). A step may write fewer experiences than
batch_size x repeat_times (dropped tasks): each explorer records with every step the version it will wait for
(`sync_wait`), and the trainer takes a step's partial batch (or none) once every explorer waits for that step's
weights or has finished (`holds`), so that train step numbers, and the versions above, never shift.

The explorer's side of the handshake, `ExplorerSync`, built once at the explorer's set-up (explore.py):

    engine, version = start_engine(cfg, base, make)    # make(folder): the engine, on the newest published weights
    weights = ExplorerSync(cfg, db, engine)
    stop = weights.resume(step)                        # mode both, restarted after `step`: the weights it needs first
    stop, metrics = weights.after_step(step)           # the sync point after `step`: wait, load or receive
    future = weights.after_step_behind(step)           # the same in the background (explorer.partial_rollout)
    weights.close()

Inside: checkpoint sync polls the pointer (`wait_for_trainer`, naming the trainer's state from the DB) and loads the
newest undamaged folder (`load_published`); process-group sync receives over the group (`receive`); on a GPU shared
with the trainer (cluster.colocate) the engine sleeps while the trainer has its turn (`trainer_turn`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import wire
from errors import DataError

log = logging.getLogger("nanorft.sync")
POINTER = "latest_state_dict_iteration.txt"


HF_DIR, SERVED_DIR = "huggingface", "lora_published"  # what global_step_N/actor/ publishes for the explorers
ADAPTER_FILE = "adapter_model.safetensors"  # peft's name of an adapter's weights file


def weights_path(job_dir: str | Path, step: int) -> Path:
    """The HF folder of the weights after train step `step`."""
    return Path(job_dir, f"global_step_{step}", "actor", HF_DIR)


def adapter_path(job_dir: str | Path, step: int) -> Path:
    """The LoRA adapter published after train step `step` for vLLM engines that serve it (`serves_adapter`): peft's
    format, in the engine's dtype. NOTE: not the checkpoint's actor/lora_adapter (fp32, written again by every save):
    a folder an explorer may be loading is never rewritten in place."""
    return Path(job_dir, f"global_step_{step}", "actor", SERVED_DIR)


def serves_adapter(cfg: Any) -> bool:
    """Whether the explorer's engines serve the trainer's LoRA adapter (vLLM's enable_lora: every request names it)
    and so get the adapter alone at each sync, not merged weights: model.lora_configs set and a vLLM rollout engine
    (engine_type vllm / vllm_async, or auto resolving to vLLM: engines.engine_kind, which the trainer asks too). The
    HF engine has no adapter serving: it keeps getting merged weights. A config without a model section (a partial
    one, as --verify-sync's explorer side) serves none."""
    if not getattr(getattr(cfg, "model", None), "lora_configs", None):
        return False
    from engines import engine_kind  # NOTE: here: engines imports transformers, which sync's importers may not need

    return engine_kind(cfg.explorer.rollout_model)[0] != "hf"


def published_dir(cfg: Any) -> str:
    """What an explorer of this config loads from global_step_N/actor/: the adapter (`serves_adapter`) or HF."""
    return SERVED_DIR if serves_adapter(cfg) else HF_DIR


def write_atomic(path: str | Path, write: Callable[[str], Any]) -> None:
    """Create `path` through `write(temporary path)`, then rename it into place: readers see the old
    file or the whole new one, never a part (os.replace is atomic on POSIX)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    except BaseException:  # e.g. a full disk: a half-written temporary would hold the space a retry needs
        tmp.unlink(missing_ok=True)
        raise


def _write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda p: Path(p).write_text(text))


def set_latest(job_dir: str | Path, step: int) -> None:
    """Point latest_state_dict_iteration.txt at `step` (a resumed trainer rewinds it to its checkpoint)."""
    _write_text_atomic(Path(job_dir, POINTER), f"{step}\n")


def save_hf(model: Any, tokenizer: Any, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """An HF folder (config, safetensors, tokenizer) written under a temporary name and renamed into place.
    `state_dict`: full weights to save instead of the model's own (e.g. gathered from FSDP2 shards)."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)  # safetensors; tied embeddings stored once
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    # NOTE: an older folder of this name (a killed run's) is renamed away, not deleted in place: a reader
    # holding its files open keeps reading whole files, and the name is missing for a moment only.
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def publish_hf(
    model: Any, tokenizer: Any, job_dir: str | Path, step: int, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Save the weights as global_step_<step>'s HF folder, then point latest_state_dict_iteration.txt to it, then
    delete the published folders no explorer will load any more (`prune_published`)."""
    final = save_hf(model, tokenizer, weights_path(job_dir, step), state_dict)
    set_latest(job_dir, step)
    prune_published(job_dir, step)
    return final


def prune_published(job_dir: str | Path, newest: int) -> list[int]:
    """Delete the folders of steps published for explorers only (no checkpoint there: those are kept by
    max_checkpoints_to_keep) older than `newest`, the pointer's step, except the one just before it, which an
    explorer may still be loading (and if it vanishes, load_published loads the newest). Steps after
    `newest` (a killed run's, before its resume rewound the pointer) are left to be replaced. Returns the steps
    deleted."""
    job = Path(job_dir)
    published = sorted(s for s in published_steps(job) if s < newest)
    gone = [s for s in published[:-1] if not (job / f"global_step_{s}" / "actor" / "trainer_state.json").exists()]
    for s in gone:
        shutil.rmtree(job / f"global_step_{s}", ignore_errors=True)
    return gone


def in_use(job_dir: str | Path) -> set[int]:
    """The steps whose folders an explorer may be loading: the pointer's, and the newest HF folder before it (the
    pointer moved a moment ago). Neither prune_published nor the checkpoint pruning (checkpoint.py) deletes them."""
    newest = latest_version(job_dir)
    if not newest:
        return set()
    before = [s for s in published_steps(job_dir) if s < newest]
    return {newest, *([max(before)] if before else [])}


def published_steps(job_dir: str | Path) -> set[int]:
    """The steps with published weights of either kind (an HF folder, a served LoRA adapter)."""
    return {*step_folders(job_dir, f"actor/{HF_DIR}"), *step_folders(job_dir, f"actor/{SERVED_DIR}")}


def step_of(hf_folder: Path) -> int:
    return int(hf_folder.parent.parent.name.removeprefix("global_step_"))


STEP_FOLDER = re.compile(r"global_step_(\d+)")


def step_folders(job_dir: str | Path, inside: str) -> dict[int, Path]:
    """step -> <job dir>/global_step_<step>/<inside>, for each such path that exists. A folder named otherwise
    (global_step_3_damaged, global_step_2.bak: set aside by hand) holds no step of this run and is left out."""
    out = {}
    for path in Path(job_dir).glob(f"global_step_*/{inside}"):
        match = STEP_FOLDER.fullmatch(path.relative_to(job_dir).parts[0])
        if match:
            out[int(match.group(1))] = path
    return out


def read_pointer(path: Path) -> int:
    """The step a pointer file (latest_state_dict_iteration.txt, latest_checkpointed_iteration.txt) names; 0 when
    there is none (or it is empty); a DataError naming the file when it holds anything but a step number."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable bytes, ...
        raise DataError(
            f"{path}: cannot be read as a step number ({e}); move it away (the run starts afresh, or "
            "from the checkpoint its pointer names)"
        ) from None
    if not text:
        return 0
    if not text.isdigit():
        raise DataError(
            f"{path}: holds {text[:40]!r}, not a step number; write the step of a complete "
            "global_step_<N> folder into it, or move it away"
        )
    return int(text)


def latest_version(job_dir: str | Path) -> int:
    """The newest published step, 0 when nothing is published yet."""
    return read_pointer(Path(job_dir, POINTER))


def latest_weights(job_dir: str | Path) -> Path | None:
    """The newest published HF folder of a job, or None."""
    version = latest_version(job_dir)
    return weights_path(job_dir, version) if version else None


def damage(folder: Path) -> str:
    """'' when a published HF folder is whole as far as its headers tell: config.json (a published adapter's:
    adapter_config.json) is JSON, and every safetensors file (the index's shards, or model.safetensors) has a header
    that parses and the size that header gives; else what is wrong, naming the file. NOTE: the tensors are not
    hashed (a publish would read every byte again): a flipped bit inside a tensor is not seen; a truncated,
    overwritten or missing file is."""
    try:
        json.loads((folder / ("adapter_config.json" if folder.name == SERVED_DIR else "config.json")).read_text())
        index = folder / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else [p.name for p in folder.glob("*.safetensors")]
        )
        if not files:
            return f"{folder} has no *.safetensors file"
        for name in files:
            with open(folder / name, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size)) if 0 < size <= 100 * 2**20 else None
                if not isinstance(header, dict):
                    return f"{folder / name} has no safetensors header"
                end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                got = os.fstat(f.fileno()).st_size
            if got != 8 + size + end:
                return f"{folder / name} has {got} bytes; its header says {8 + size + end}"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{folder}: {type(e).__name__}: {e}"
    return ""


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """A LoRA adapter folder in peft's format, as vLLM loads it: adapter_config.json (`config`) and
    adapter_model.safetensors (`tensors` under peft's file names; no pickle), written under a temporary name and
    renamed into place (an older folder of that name renamed away first, as save_hf does)."""
    import safetensors.torch

    tmp, old = (folder.with_name(f".{folder.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # NOTE: copies: received tensors are views into one bucket, and safetensors refuses tensors that share memory
    safetensors.torch.save_file({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}, tmp / ADAPTER_FILE)
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def usable_weights(job_dir: str | Path, newest: int, above: int = 0, kind: str = HF_DIR) -> tuple[Path, int] | None:
    """The newest published folder of a step in (above, newest] that is not damaged (`damage`): (folder, step), or
    None. A missing or damaged one is named in a warning and skipped (left as it is), as the trainer skips a
    damaged checkpoint (checkpoint.latest_checkpoint). `kind`: HF_DIR, or SERVED_DIR (`published_dir`)."""
    folders = step_folders(job_dir, f"actor/{kind}")
    for step in range(newest, above, -1):
        if step not in folders:
            if step == newest:
                log.warning(
                    "%s names step %d, whose weights folder %s is missing",
                    Path(job_dir, POINTER),
                    step,
                    weights_path(job_dir, step).with_name(kind),
                )
            continue
        why = damage(folders[step])
        if not why:
            return folders[step], step
        log.warning("the published weights of step %d are damaged and skipped (left as they are): %s", step, why)
    return None


# --- when weights move: the one rule both sides follow


def weights_needed(explorer_step: int, cfg: Any) -> int:
    """The weights version an explorer must have after its step `explorer_step` before it goes on (sync_style
    fixed): at every sync_interval-th step after the first sync_offset ones, the weights of the trainer step
    that consumed its step explorer_step - sync_offset; 0 = no sync point, go on with what it has.
    sync_offset 0 is on-policy: every step's rollout uses the weights trained on the step before."""
    s, b = cfg.synchronizer, cfg.buffer
    k = explorer_step - s.sync_offset
    if k <= 0 or k % s.sync_interval:
        return 0
    return k * b.batch_size * cfg.algorithm.repeat_times // b.train_batch_size


def publishes(train_step: int, cfg: Any, total: int) -> bool:
    """Whether the trainer publishes (checkpoint method) or sends (process group) the weights of `train_step`
    (of `total`). Fixed style: when they are what an explorer step waits for (weights_needed), that step not
    being the explorer's last; the other styles, every sync_interval steps."""
    s, b = cfg.synchronizer, cfg.buffer
    if s.sync_style != "fixed":
        return train_step % s.sync_interval == 0
    per_step = b.batch_size * cfg.algorithm.repeat_times  # experiences an explorer step writes
    first = -(-train_step * b.train_batch_size // per_step)  # explorer steps whose data ends at this train step
    last = -(-(train_step + 1) * b.train_batch_size // per_step)
    explorer_steps = total * b.train_batch_size // per_step
    return any(
        weights_needed(k + s.sync_offset, cfg) == train_step and k + s.sync_offset < explorer_steps
        for k in range(max(first, 1), max(last, first + 1))
    )


def sync_wait(explorer_step: int, cfg: Any, model_version: int) -> int:
    """The weights version an explorer waits for at its sync point after step `explorer_step` (holding an engine of
    `model_version`), recorded in its DB state with the step's experiences (explore.write) so that the trainer knows,
    not guesses, when no more experiences come before it trains a step (`holds`): fixed style and process-group
    sync, weights_needed; explorer_driven, the first version newer than its own that the trainer publishes (every
    sync_interval steps: `publishes`); 0 when it will not wait (no sync point, weights it already has,
    trainer_driven, the explorer's last step: its caller's)."""
    s = cfg.synchronizer
    need = weights_needed(explorer_step, cfg)
    if not need:
        return 0
    if s.sync_method == "nccl" or s.sync_style == "fixed":
        return need if need > model_version else 0
    if s.sync_style == "explorer_driven":
        return -(-(model_version + 1) // s.sync_interval) * s.sync_interval
    return 0


def holds(state: dict, train_step: int, cfg: Any) -> bool:
    """Whether an explorer, by its state in the DB (buffer.ExperienceDB.explorer_states), writes nothing more before
    the trainer has trained (and published) `train_step`: it has finished, or after its recorded step it waits for
    weights of that step or newer (`sync_wait`). A state written before sync_wait was recorded (a run relaunched
    after an older nanorft) gives the fixed rule, weights_needed of its step, in the trainer's config. The trainer
    takes a step's partial batch once every explorer holds (source.Source.waiting)."""
    if state.get("finished"):
        return True
    wait = state.get("sync_wait")
    if wait is None:
        wait = weights_needed(int(state.get("step", 0)), cfg)
    return wait >= train_step


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors in `dtype` (the others as they are). Tensors that share memory (tied
    embeddings) share the cast one. NOTE: else save_pretrained no longer sees them tied and writes the LM head
    twice (vocab x hidden more bytes: ~0.47 GB for Qwen2.5-1.5B in bf16)."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state.items():
        key = (v.device, v.data_ptr(), v.shape, v.stride(), v.dtype)
        out[k] = done[key] if key in done else done.setdefault(key, v.to(wire.as_dtype(v, dtype)))
    return out


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights on rank 0's CPU; {} on other ranks. Every rank must call it."""
    # NOTE: imported here, by the trainer only: ~0.9 s of CPU at import that the launcher and explorers would pay
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- the explorer's side: waiting for the trainer, loading published weights, receiving them over the group


def start_weights(cfg: Any) -> tuple[str, int] | None:
    """The newest undamaged published weights of this job, (folder, step): a restarted explorer's engine starts with
    them (usable_weights); None when nothing is published (the explorer starts from its starting model). A DataError
    when the pointer names a step and no folder up to it can be loaded."""
    job = cfg.checkpoint_job_dir
    newest = latest_version(job)
    if not newest:
        return None
    found = usable_weights(job, newest, kind=published_dir(cfg))
    if found is None:
        raise DataError(
            f"{Path(job, POINTER)} names step {newest}, and no published weights folder up to it "
            "is there undamaged (see the warnings above): restart the trainer (it resumes from its "
            "newest checkpoint and publishes again), or move the pointer away to start from "
            "model.model_path"
        )
    if found[1] != newest:
        log.warning(
            "the explorer starts from the published weights of step %d, the newest undamaged (not %d)", found[1], newest
        )
    return str(found[0]), found[1]


def start_engine(cfg: Any, base: str, make: Callable[[str], Any]) -> tuple[Any, int]:
    """The explorer's engine, `make(folder)`, on the newest usable published weights (start_weights) or on `base`
    when none are published: (engine, the version it has). NOTE: a restarted explorer starts while the trainer runs
    on, and publishing prunes all but the folder before the pointer (prune_published): when the folder is deleted as
    the engine loads it (two more steps published meanwhile), the engine starts again on the newest."""
    while True:
        path, version = start_weights(cfg) or (base, 0)
        try:
            return make(path), version
        except Exception as e:
            if not version or Path(path).exists():
                raise
            log.warning(
                "the weights of step %d were deleted as the engine loaded them (%s): loading the newest", version, e
            )


def trainer_state(db: Any) -> str:
    """What the trainer last recorded in the DB (buffer.ExperienceDB.trainer_status), for log lines."""
    t = db.trainer_status()
    if t is None:
        return "no trainer has used this DB yet"
    return f"trainer at step {t['step']}, {t['status']}, last seen {time.time() - t['time']:.0f} s ago (pid {t['pid']})"


class WaitNotes:
    """The log lines of one kind of wait that is the normal rhythm of a run (the explorer's for the trainer's
    weights, the trainer's for experiences: in mode both each side waits for the other every step). A wait is said
    at INFO once it is longer than usual, then every `every` s while it lasts; before that (and when the log level is
    DEBUG) at DEBUG, at its start and every `every` s. Longer than usual: over 3x the median of this process's
    waits of that kind so far (the last 200), and at least `floor` s (the first wait: `floor`).
    NOTE: at INFO every sync point's wait was a line: 1.7 of every 3.7 console lines of a redirected mode-both run."""

    def __init__(self, floor: float = 5.0, every: float = 30.0) -> None:
        self.past: deque[float] = deque(maxlen=200)  # the seconds of the waits that ended
        self.floor, self.every = floor, every
        self.next_note, self.loud = 0.0, False

    def usual(self) -> float:
        """Seconds past which a wait is longer than usual."""
        return max(self.floor, 3 * statistics.median(self.past)) if self.past else self.floor

    def begin(self) -> None:
        """A new wait starts."""
        self.next_note, self.loud = 0.0, False

    def level(self, waited: float) -> int | None:
        """The level of a line `waited` s into this wait (logging.INFO or DEBUG), or None: no line now."""
        if not self.loud and waited >= self.usual():
            self.loud, self.next_note = True, waited + self.every
            return logging.INFO
        if waited < self.next_note:
            return None
        self.next_note = waited + self.every
        return logging.INFO if self.loud else logging.DEBUG

    def end(self, waited: float) -> None:
        """This wait ended after `waited` s: it counts in what is usual."""
        self.past.append(waited)


def wait_for_trainer(
    job: str, db: Any, want: int, step: int, timeout: float, notes: WaitNotes | None = None
) -> tuple[int, str, int]:
    """Checkpoint sync: block until the trainer has published weights of version >= want (polling
    latest_state_dict_iteration.txt every 10 ms: a read of one small file). (that version, "", 0), or
    (0, why not, exit code): 0 when the trainer has finished (no newer weights will come), 1 when `timeout`
    (sync_timeout) ran out. The line saying what it waits for is INFO only when the wait is longer than usual
    (`notes`: the explorer's waits so far), else DEBUG."""
    start, notes = time.monotonic(), notes or WaitNotes()
    notes.begin()
    while (have := latest_version(job)) < want:
        waited = time.monotonic() - start
        trainer = db.trainer_status()
        if trainer is not None and trainer["status"] == "finished":
            return 0, f"the trainer finished at step {trainer['step']} (newest weights: step {have})", 0
        if waited >= timeout:
            return (
                0,
                f"no weights of step {want} after {timeout:g} s (synchronizer.sync_timeout); {trainer_state(db)}",
                1,
            )
        if (level := notes.level(waited)) is not None and log.isEnabledFor(level):  # trainer_state(): a query
            log.log(
                level,
                "sync point after step %d: waiting for the trainer's weights of step %d (newest: %d) in %s; %s",
                step,
                want,
                have,
                job,
                trainer_state(db),
            )
        time.sleep(0.01)
    notes.end(time.monotonic() - start)
    return have, "", 0


def load_published(engine: Any, job: str, version: int, kind: str = HF_DIR) -> int:
    """Load published weights into the engine: `version`'s, or if its folder is missing or damaged the newest
    undamaged one newer than the engine's (usable_weights), or none (the engine keeps its weights; a warning
    says so; the next sync point tries again); the newest if the folder is being replaced as it is read (a
    resumed trainer re-publishing a step). `kind`: the folders it loads (`published_dir`: HF, or the LoRA adapter
    that vLLM engines serve). Returns the version the engine has."""
    for attempt in range(5):
        found = usable_weights(job, version, above=engine.model_version, kind=kind)
        if found is not None and (found[1] == version or attempt > 0):
            try:
                engine.load_weights(str(found[0]), version=found[1])
                return found[1]
            except OSError as e:
                log.warning("could not load the weights of step %d (%s); retrying with the newest", found[1], e)
        elif found is None and attempt > 0:
            log.warning(
                "no undamaged published weights newer than the engine's (step %d) up to step %d: the explorer "
                "goes on with its weights",
                engine.model_version,
                version,
            )
            return engine.model_version
        time.sleep(1.0)  # NOTE: first a second for a folder being replaced, then the fallback
        version = latest_version(job)
    raise RuntimeError(f"could not load published weights from {job}")


class ExplorerSync:
    """The explorer's side of the weight handshake, built once at its set-up: `resume` before the first rollout of a
    restart in mode both, `after_step` at each step's sync point, `close` at the end. `db` and `engine` are used by
    what they offer: the DB's trainer_status (for log lines); the engine's model_version, load_weights, sleep /
    wake_up (cluster.colocate), and a vLLM pool's join_ranks / join_group / receive (its workers join the group)."""

    def __init__(self, cfg: Any, db: Any, engine: Any) -> None:
        self.cfg, self.db, self.engine = cfg, db, engine
        self.kind = published_dir(cfg)  # the published folders it loads: HF, or the LoRA adapter its engines serve
        self.adapters: Path | None = None  # an adapter received over the group: its private folder (take_weights)
        self.receiver: wire.WeightLink | None = None  # the process-group link to the trainer, opened at its first use
        self.joined = False  # whether a vLLM pool's workers joined this link's group
        self.waits = WaitNotes()  # how long this explorer's waits for weights usually are (their log lines)

    def resume(self, step: int) -> int | None:
        """Mode both, an explorer restarted after step `step`: before its first rollout, the weights of the last
        sync point up to it (version w), which it may not have received before it stopped; on a GPU shared with the
        trainer, which retrains up to w, the engine sleeps meanwhile. Checkpoint sync: the files published at w
        (waited for); process group: `over_group`. None to go on, or the exit code to stop with."""
        want = next((w for k in range(step, 0, -1) if (w := weights_needed(k, self.cfg))), 0)
        if self.engine.model_version >= want:
            return None
        if self.cfg.synchronizer.sync_method == "nccl":
            why, code = self.over_group(want, step)
        else:
            with self.trainer_turn(step, True):
                why, code = self.from_files(want, step)
        name = self.cfg.explorer.name
        if self.engine.model_version < want:
            (log.error if code else log.info)(
                "explorer %s restarted after step %d: no weights of step %d: %s; stopping.", name, step, want, why
            )
            return code
        log.info(
            "explorer %s restarted after step %d with the weights of step %d", name, step, self.engine.model_version
        )
        return None

    def after_step(self, step: int) -> tuple[int | None, dict[str, float]]:
        """The sync point after step `step`: the weights it needs (weights_needed), if any, over the process group
        (nccl) or as published files (checkpoint, `load_newer`); on a GPU shared with the trainer the engine sleeps
        while the trainer trains them. (None to go on, or the exit code to stop with; metrics)."""
        want = weights_needed(step, self.cfg)
        with self.trainer_turn(step, bool(want)):
            if self.cfg.synchronizer.sync_method != "nccl":
                return self.load_newer(step)
            if not want or self.engine.model_version >= want:  # a restart may have loaded them already (resume)
                return None, {}
            code, metrics = self.receive(want, step)
            return code or None, metrics

    def after_step_behind(self, step: int) -> concurrent.futures.Future:
        """explorer.partial_rollout: `after_step(step)` on a thread of its own while the next step's rollout runs
        (the engines' weight update keeps the requests in flight: vllm_engine.EnginePool.keep_requests); its result,
        or its exception, in the future, which the explorer takes before it writes that step. NOTE: a daemon thread
        (a wait of up to sync_timeout never holds the process's exit), on its own DB connection (ExperienceDB.twin:
        a SQLite connection serves only the thread that made it), while the explorer's thread uses no ExplorerSync
        method until it has the result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            main = self.db
            try:
                with main.twin() if hasattr(main, "twin") else contextlib.nullcontext(main) as own:
                    self.db = own
                    try:
                        got = self.after_step(step)
                    finally:
                        self.db = main  # NOTE: before the result is set: the explorer's next call may come at once
            except BaseException as e:  # noqa: BLE001 - raised in the explorer's thread by future.result()
                future.set_exception(e)
                return
            future.set_result(got)

        threading.Thread(target=run, name=f"sync-after-{step}", daemon=True).start()
        return future

    def close(self) -> None:
        """Tell the trainer this explorer takes no more weights (process group); drop the link."""
        if self.receiver is not None:
            wire.close_receiver(self.receiver)
        if self.adapters is not None:
            shutil.rmtree(self.adapters, ignore_errors=True)

    def load_newer(self, step: int) -> tuple[int | None, dict[str, float]]:
        """Checkpoint sync after step `step`: fixed style, the weights weights_needed names (waiting for them);
        explorer_driven, any newer than the engine's (waiting for them); trainer_driven, whatever is published
        (never waiting). (None to go on, or the exit code to stop with; metrics)."""
        s, t0, job = self.cfg.synchronizer, time.monotonic(), self.cfg.checkpoint_job_dir
        fixed = weights_needed(step, self.cfg)
        if not (fixed or s.sync_style == "trainer_driven"):
            return None, {}
        version = latest_version(job)
        want = {"fixed": fixed, "explorer_driven": self.engine.model_version + 1}.get(s.sync_style, 0)
        if version < want:
            version, why, code = wait_for_trainer(job, self.db, want, step, s.sync_timeout, self.waits)
            if not version:
                (log.error if code else log.info)(
                    "explorer %s stops after step %d: %s.%s",
                    self.cfg.explorer.name,
                    step,
                    why,
                    f" Restart to continue after step {step}." if code else "",
                )
                return code, {}
        if version > self.engine.model_version:
            load_published(self.engine, job, version, self.kind)
            return None, {"time/sync": time.monotonic() - t0}
        return None, {}

    def from_files(self, want: int, step: int) -> tuple[str, int]:
        """The published weights of version `want` or newer, into the engine (waited for): ("", 0), or (why not, exit
        code: 0 when the trainer finished first)."""
        job, s = self.cfg.checkpoint_job_dir, self.cfg.synchronizer
        version, why, code = wait_for_trainer(job, self.db, want, step, s.sync_timeout, self.waits)
        loaded = load_published(self.engine, job, version, self.kind) if version else 0
        if version and loaded < want:  # its retry took an older folder
            return f"the newest weights published, of step {loaded}, are older", 1
        return why, code

    def receive(self, want: int, step: int) -> tuple[int, dict[str, float]]:
        """Process-group sync after step `step`: the trainer's weights of step `want`, into the engine. (exit code,
        metrics)."""
        t0 = time.monotonic()
        try:
            got = self.take_weights()
        except wire.SyncError as err:
            got, why = None, str(err)
        else:
            why = "the trainer finished and sent stop"
        if got is None:
            log.error(
                "no weights of step %d from the trainer: %s; stopping. Restart to continue after step %d.",
                want,
                why,
                step,
            )
            return 1, {}
        version, size = got
        if version != want:
            log.warning("sync point after step %d: got weights of step %d, expected %d", step, version, want)
        seconds = time.monotonic() - t0
        return 0, {"sync/bytes": size, "sync/receive_seconds": seconds, "time/sync": seconds}

    def over_group(self, want: int, step: int) -> tuple[str, int]:
        """Process-group sync at a restart after step `step`: R, the step the trainer resumed from (its
        sync_group.json), decides: R >= `want`, the files it published at its resume; R < want, the versions it
        sends as it retrains, in order, up to want. NOTE: R as the trainer says it, not the checkpoint pointer's
        step, which the trainer skips when that checkpoint is damaged (it resumes from an older one and sends
        versions the explorer would not wait for). ("", 0), or (why not, 1)."""
        try:
            while self.engine.model_version < want:  # the retrained versions, in the order the trainer sends them
                with self.trainer_turn(step, True):  # NOTE: for each: a woken engine (a vLLM one wakes to load) sleeps
                    if self.link().resumed >= want:
                        return self.from_files(want, step)
                    if self.take_weights() is None:
                        return "the trainer finished and sent stop", 1
        except wire.SyncError as err:
            return str(err), 1
        return "", 0

    def take_weights(self) -> tuple[int, int] | None:
        """The next weights over the trainer's group, into the engine: (version, bytes), or None after its stop.
        The HF engine receives them in this process; vLLM engines' workers join the group (with the init info the
        trainer's side of their weight-transfer engine posted) and take them onto their GPUs through vLLM's
        weight-update lifecycle (vllm_engine.EnginePool.receive), this process reading only the header."""
        workers = self.engine.join_ranks() if hasattr(self.engine, "join_ranks") else 0
        link = self.link()
        if workers and not self.joined and (init := wire.receive_init(link)) is not None:
            self.engine.join_group(init)  # the trainer's init info, posted before its first transfer to this link
            self.joined = True
        header = wire.receive_header(link)
        if header is None:
            return None
        if workers:
            size = self.engine.receive(header)
        else:
            state = {name: t for bucket in wire.receive_buckets(link, header) for name, t in bucket}
            if "adapter_config" in header:  # the LoRA adapter alone, for vLLM engines that serve it
                self.engine.load_weights(str(self.adapter_folder(header, state)), version=header["version"])
            else:
                self.engine.load_weights(state, version=header["version"])
            size = wire.header_bytes(header)
        wire.ack(link)
        return header["version"], size

    def adapter_folder(self, header: dict, state: dict[str, torch.Tensor]) -> Path:
        """A LoRA adapter received over the group (lora.send_adapter: peft's file names, its adapter_config.json in
        the header) written as peft saves it, for the engines to load in place: v<version>/ in this explorer's
        private folder (made at the first; deleted at close), the folders of older versions deleted (the engines hold
        the adapter they loaded; a request names the folder, read only where vLLM has no adapter of its id)."""
        if self.adapters is None:
            self.adapters = Path(tempfile.mkdtemp(prefix="nanorft-adapter-"))
        folder = self.adapters / f"v{header['version']}"
        for old in self.adapters.iterdir():
            shutil.rmtree(old, ignore_errors=True)
        return write_adapter(folder, state, header["adapter_config"])

    def link(self) -> wire.WeightLink:
        """The process-group link to the trainer, opened at its first use (up to sync_timeout), announcing the ranks
        that will receive (vLLM: every worker, which join it at the first transfer: take_weights)."""
        job, timeout = self.cfg.checkpoint_job_dir, self.cfg.synchronizer.sync_timeout
        if self.receiver is None:
            workers = self.engine.join_ranks() if hasattr(self.engine, "join_ranks") else 0
            self.receiver = wire.open_receiver(job, timeout, receivers=workers or 1)
        return self.receiver

    @contextlib.contextmanager
    def trainer_turn(self, step: int, waits: bool) -> Iterator[None]:
        """While this explorer waits for weights the trainer is still to train (`waits`) on one GPU shared with it
        (cluster.colocate): the engine sleeps, its memory free for the trainer, and wakes up after."""
        sleeps = waits and self.cfg.cluster.colocate
        if sleeps:
            self.engine.sleep()
            log.info("step %d: the engine sleeps while the trainer uses the shared GPU", step)
        try:
            yield
        finally:
            if sleeps:
                self.engine.wake_up()


def pause_for_test(point: str, step: int) -> None:
    """Tests only: with NANORFT_TEST_PAUSE_AT=<point>:<step>, the process touches the file
    NANORFT_TEST_PAUSE_MARKER at that point and waits there, so that a test can kill it at a known place
    (a kill timed by the clock races the run: on a fast machine the explorer had finished before the kill), or let it
    go on by deleting the marker. NANORFT_TEST_PAUSE_DEAF=1: SIGTERM is ignored meanwhile (a process slow to stop)."""
    if os.environ.get("NANORFT_TEST_PAUSE_AT") == f"{point}:{step}":
        marker = Path(os.environ["NANORFT_TEST_PAUSE_MARKER"])
        if os.environ.get("NANORFT_TEST_PAUSE_DEAF"):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        marker.touch()
        while marker.exists():
            time.sleep(0.1)
