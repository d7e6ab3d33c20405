"""sync.py: how weights move from the trainer to the explorer.

Checkpoint method (`synchronizer.sync_method: checkpoint`), Trinity-RFT's layout:

    <job dir>/global_step_N/actor/huggingface/     HF folder (config, safetensors, tokenizer)
    <job dir>/latest_state_dict_iteration.txt      N, the newest weights an explorer may load

    publish_hf(model, tokenizer, job_dir, step)    # trainer: write the folder, then move the pointer
    version = latest_version(job_dir)              # explorer: poll the pointer (0 = none yet; the
                                                   # waiting, with the trainer's state, is explore.py's)

NOTE: the folder is written under a temporary name and renamed into place, and only then is the pointer file
replaced (also by rename): a reader that follows the pointer never sees a half-written folder.

The trainer's checkpoints (for resuming), in the same global_step_N folders: checkpoint.py.

Process-group method (`synchronizer.sync_method: nccl`): trainer rank 0 streams the full tensors to
the explorer over a group built by hand beside torchrun's default group (gloo on CPU, NCCL on GPU; never
init_process_group). Trainer rank 0 is rank 0 (the source); the receivers are ranks 1..: the HF explorer
itself, or every worker of every vLLM engine (vllm_engine.WeightReceiver: each takes the buckets onto its GPU).
The explorer announces the group's size in the store (`open_receiver(..., receivers=n)`).

    link = open_sender(job_dir, device, timeout)       # trainer rank 0: TCPStore + <job dir>/sync_group.json
    send_weights(link, version, specs, tensors)        # every rank; specs [(name, shape, dtype)], tensors lazy
    send_model(link, model, version)                   # the same for an (FSDP2) model's parameters
    close_sender(link, finished=True)                  # "stop": a waiting explorer learns the trainer is done
    link = open_receiver(job_dir, timeout)             # explorer: find the file, connect to the store
    got = receive_weights(link)                        # (version, {name: tensor}), or None after "stop"
    # or by part: header = receive_header(link); for bucket in receive_buckets(link, header): ...; ack(link)
    close_receiver(link)

The wire, per transfer n: the header (JSON: version, names, shapes, dtypes, buckets; or stop) is the store
key `nanorft/header/<n>`; then the tensors, in header order, packed as raw bytes (uint8 views: bitwise exact
for every dtype, no pickle anywhere) into buckets of up to BUCKET_BYTES, one broadcast per bucket; the explorer
acks with `nanorft/ack/<n>`.
Headers go through the store, not the group, so that "stop" never blocks on a departed explorer and a
dead trainer is noticed at once (the store lives in the trainer's process: its sockets close).
NOTE: the group itself is created at the first transfer (creating it blocks until both sides are
there). The store listens on `synchronizer.sync_host`, 127.0.0.1 unless the config names another address (the
explorer on another host than trainer rank 0: mode both on GPUs over several nodes, where the group is NCCL's).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from errors import DataError

log = logging.getLogger("nanorft.sync")
POINTER = "latest_state_dict_iteration.txt"
GROUP_FILE = "sync_group.json"  # where trainer rank 0 tells the explorer how to reach its store
WORLD_KEY = "nanorft/world"  # the weight group's size: 1 (the trainer) + the receiving ranks, set by the explorer


def weights_path(job_dir: str | Path, step: int) -> Path:
    """The HF folder of the weights after train step `step`."""
    return Path(job_dir, f"global_step_{step}", "actor", "huggingface")


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
    explorer may still be loading (and if it vanishes, explore.load_published loads the newest). Steps after
    `newest` (a killed run's, before its resume rewound the pointer) are left to be replaced. Returns the steps
    deleted."""
    job = Path(job_dir)
    published = sorted(s for s in step_folders(job, "actor/huggingface") if s < newest)
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
    before = [s for s in step_folders(job_dir, "actor/huggingface") if s < newest]
    return {newest, *([max(before)] if before else [])}


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
    """'' when a published HF folder is whole as far as its headers tell: config.json is JSON, and every safetensors
    file (the index's shards, or model.safetensors) has a header that parses and the size that header gives; else
    what is wrong, naming the file. NOTE: the tensors are not hashed (a publish would read every byte again): a
    flipped bit inside a tensor is not seen; a truncated, overwritten or missing file is."""
    try:
        json.loads((folder / "config.json").read_text())
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


def usable_weights(job_dir: str | Path, newest: int, above: int = 0) -> tuple[Path, int] | None:
    """The newest published folder of a step in (above, newest] that is not damaged (`damage`): (folder, step), or
    None. A missing or damaged one is named in a warning and skipped (left as it is), as the trainer skips a
    damaged checkpoint (checkpoint.latest_checkpoint)."""
    folders = step_folders(job_dir, "actor/huggingface")
    for step in range(newest, above, -1):
        if step not in folders:
            if step == newest:
                log.warning(
                    "%s names step %d, whose weights folder %s is missing",
                    Path(job_dir, POINTER),
                    step,
                    weights_path(job_dir, step),
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


# --- process-group method


class SyncError(RuntimeError):
    """The other side never came, died, or broke the protocol."""


@dataclass
class WeightLink:
    """One side of the trainer -> explorer weight link."""

    store: dist.TCPStore  # served by trainer rank 0's process; the explorer is a client
    rank: int  # 0 = trainer (the source); 1.. the receivers (the HF explorer, or each vLLM worker)
    backend: str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    device: torch.device  # where tensors travel from / arrive on
    timeout: datetime.timedelta  # each wait for the other side
    job_dir: Path
    group: Any = None  # ProcessGroupGloo / ProcessGroupNCCL, made at the first transfer
    count: int = 0  # headers sent / received so far (the next header key)
    resumed: int = 0  # the checkpoint step the trainer resumed from (0: none); its first version sent is later


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _group(link: WeightLink) -> Any:
    """The group of the trainer and every receiver (made once; blocks until all of them make it too, up to
    link.timeout). Its size is what the explorer announced (`open_receiver(..., receivers=n)`)."""
    if link.group is None:
        link.store.wait([WORLD_KEY], link.timeout)
        world = int(link.store.get(WORLD_KEY))
        store = dist.PrefixStore("nanorft/weights", link.store)
        if link.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL  # only in CUDA builds of torch

            opts = ProcessGroupNCCL.Options()
            opts._timeout = link.timeout
            link.group = ProcessGroupNCCL(store, link.rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = link.timeout
            # NOTE: loopback: a gloo group (CPU tensors) joins an explorer on trainer rank 0's host (the CPU layout
            # keeps both on node 0; a GPU shared with the explorer is one node)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            link.group = dist.ProcessGroupGloo(store, link.rank, world, opts)
    return link.group


def _broadcast(link: WeightLink, buf: torch.Tensor) -> None:
    """Broadcast a uint8 buffer from the trainer (rank 0) to the explorer, in place."""
    _group(link).broadcast(buf, 0).wait()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)  # same memory, 1 byte per element: bitwise exact


def open_sender(
    job_dir: str | Path, device: str | torch.device, timeout: float, host: str = "127.0.0.1", resumed: int = 0
) -> WeightLink:
    """Trainer rank 0: serve a store on `host` (a free port) and write <job dir>/sync_group.json, which names it
    (a wildcard host, 0.0.0.0 or ::, by this machine's name) and the checkpoint step this trainer resumed from,
    `resumed` (a restarted explorer learns from it which versions will come: explore.over_group). device "cpu" ->
    gloo; "cuda[:i]" -> NCCL (NOTE: NCCL needs the explorer on another GPU; on one shared GPU use "cpu", gloo)."""
    device = torch.device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family)  # bound here so that the store listens on `host` only
    port = sock.getsockname()[1]
    store = dist.TCPStore(
        host, port, 2, True, _timeout(timeout), wait_for_workers=False, master_listen_fd=sock.detach()
    )  # the store owns the socket from now on
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    shown = socket.getfqdn() if host in ("0.0.0.0", "::") else host
    info = {
        "host": shown,
        "port": port,
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "backend": backend,
        "resumed": resumed,
    }
    _write_text_atomic(Path(job_dir, GROUP_FILE), json.dumps(info) + "\n")
    log.info("weight sync: %s group served on %s:%d (%s)", backend, host, port, Path(job_dir, GROUP_FILE))
    return WeightLink(store, 0, backend, device, _timeout(timeout), Path(job_dir), resumed=resumed)


BUCKET_BYTES = 256 * 2**20  # tensors travel packed into buffers of up to this size (a larger tensor: its own)
ALIGN = 16  # bytes: each tensor starts at a multiple of this in its bucket (any dtype's itemsize divides it)


def _padded(shape: Any, dtype: torch.dtype) -> int:
    """A tensor's bytes in a bucket, rounded up to ALIGN."""
    return -(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN


def buckets(specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> list[list[int]]:
    """The indices of `specs`, in order, grouped into buckets of at most BUCKET_BYTES (one broadcast each; a tensor
    larger than that alone in its own). Sizes count each tensor's padding to ALIGN bytes (`layout`)."""
    out: list[list[int]] = []
    size = 0
    for i, (_, shape, dtype) in enumerate(specs):
        n = _padded(shape, dtype)
        if not out or size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


def layout(specs: list[tuple[str, tuple[int, ...], torch.dtype]], bucket: list[int]) -> tuple[list[int], int]:
    """(byte offset of each tensor of `bucket`, the bucket's bytes): tensors one after another, each starting at a
    multiple of ALIGN. NOTE: `uint8_buffer[offset:].view(dtype)` needs the offset to be a multiple of the dtype's
    itemsize (a bf16 tensor of odd length followed by an fp32 one is not, unpadded): both sides use this layout."""
    offsets, end = [], 0
    for i in bucket:
        offsets.append(end)
        end += _padded(specs[i][1], specs[i][2])
    return offsets, end


def send_weights(
    link: WeightLink | None,
    version: int,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[torch.Tensor],
) -> int:
    """Send one version of the weights; returns the tensors' bytes sent (header_bytes; the padding of `layout` not
    counted). `tensors` yields the full tensors in `specs` order, lazily (one full parameter at a time); each is
    cast to its spec's dtype and copied into its bucket (`buckets`, `layout`), which is broadcast once full: few
    broadcasts, at most a bucket in extra memory.
    NOTE: call it on EVERY trainer rank, link=None on all but rank 0: producing the tensors
    (FSDP2 `full_tensor()`) is a collective, so the other ranks iterate too and drop them."""
    if link is None:
        for _ in tensors:
            pass
        return 0
    header = {
        "version": version,
        "names": [n for n, _, _ in specs],
        "shapes": [list(s) for _, s, _ in specs],
        "dtypes": [str(d).removeprefix("torch.") for _, _, d in specs],
        "buckets": buckets(specs),
    }
    link.store.set(f"nanorft/header/{link.count}", json.dumps(header))
    link.count += 1
    sent, stream = 0, iter(tensors)
    for bucket in header["buckets"]:
        offsets, size = layout(specs, bucket)
        buf = None
        for i, at in zip(bucket, offsets):
            name, shape, dtype = specs[i]
            t = next(stream)
            if tuple(t.shape) != tuple(shape):
                raise SyncError(f"{name}: tensor of shape {tuple(t.shape)}, spec says {tuple(shape)}")
            part = _as_bytes(t.detach().to(device=link.device, dtype=dtype))
            if len(bucket) == 1 and part.numel() == size:  # a tensor alone, no padding: sent as it is, no copy
                buf = part
                break
            buf = torch.zeros(size, dtype=torch.uint8, device=link.device) if buf is None else buf  # padding: 0
            buf[at : at + part.numel()].copy_(part)
        _broadcast(link, buf)
        sent += sum(math.prod(specs[i][1]) * specs[i][2].itemsize for i in bucket)
    return sent


def send_model(link: WeightLink | None, model: torch.nn.Module, version: int, dtype: torch.dtype | None = None) -> int:
    """send_weights of an (FSDP2-sharded) model: one full parameter at a time, gathered on every rank
    (call it on every rank, link=None on all but rank 0); tied weights appear once. `dtype`: floating-point
    parameters are sent in it (e.g. bf16 for a bf16 engine: half the bytes); default their own."""
    params = dict(model.named_parameters())
    specs = [(k, tuple(v.shape), as_dtype(v, dtype)) for k, v in params.items()]
    with torch.no_grad():
        tensors = (v.full_tensor() if isinstance(v, DTensor) else v for v in params.values())
        return send_weights(link, version, specs, tensors)


def close_sender(link: WeightLink, finished: bool = True, grace: float = 10.0) -> None:
    """Send "stop" (finished=False: the trainer failed), wait up to `grace` s for a waiting explorer to
    read it (an explorer that closed its end is not waited for), remove sync_group.json."""
    n = link.count
    link.store.set(f"nanorft/header/{n}", json.dumps({"stop": True, "finished": finished}))
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not any(
        link.store.check([k]) for k in (f"nanorft/ack/{n}", "nanorft/closed")
    ):
        time.sleep(0.05)
    path = Path(link.job_dir, GROUP_FILE)
    try:
        if json.loads(path.read_text())["pid"] == os.getpid():  # ours, not a newer trainer's
            path.unlink()
    except (FileNotFoundError, ValueError, KeyError):
        pass
    drop_group(link)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_receiver(
    job_dir: str | Path,
    timeout: float,
    device: str | torch.device | None = None,
    rank: int = 1,
    receivers: int | None = 1,
) -> WeightLink:
    """Explorer: wait up to `timeout` s for a live trainer's sync_group.json and connect to its store as group rank
    `rank`; `receivers`: the explorer announces how many ranks will receive (1: itself; vLLM: its workers, which
    connect with their own rank and receivers=None). device: where tensors arrive under NCCL (default: the current
    CUDA device, looked up at the first bucket: a link that only reads headers, a vLLM explorer's, never touches CUDA,
    so it makes no CUDA context on its engines' GPU); gloo receives on the CPU.
    A file left by a dead trainer is skipped (it may be replaced by a new one before the deadline); one written on
    another host is tried (its store answers or not)."""
    path, deadline, why = Path(job_dir, GROUP_FILE), time.monotonic() + timeout, f"no {GROUP_FILE}"
    while True:
        try:
            info = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):  # not there yet, or (never, as it is renamed) half-written
            info = None
        # NOTE: a pid names a process of the host that wrote the file: only there can it be checked
        here = info is not None and info.get("hostname", socket.gethostname()) == socket.gethostname()
        if here and not _pid_alive(info["pid"]):
            why = f"{path} was written by process {info['pid']}, which is gone"
        elif info is not None:
            try:
                attempt = max(1.0, min(5.0, deadline - time.monotonic()))
                store = dist.TCPStore(info["host"], info["port"], 2, False, _timeout(attempt))
                store.set_timeout(_timeout(timeout))
                backend = info["backend"]
                dev = torch.device(device or "cuda") if backend == "nccl" else torch.device("cpu")
                if receivers is not None:
                    store.set(WORLD_KEY, str(1 + receivers))
                return WeightLink(
                    store, rank, backend, dev, _timeout(timeout), Path(job_dir), resumed=int(info.get("resumed", 0))
                )
            except RuntimeError as e:  # DistNetworkError etc.: the port is not (or no longer) served
                why = f"cannot reach the trainer's store at {info['host']}:{info['port']}: {e}".splitlines()[0]
        if time.monotonic() >= deadline:
            raise SyncError(f"no trainer to receive weights from after {timeout:g} s: {why}")
        time.sleep(0.2)


def _device(link: WeightLink) -> torch.device:
    """Where this receiver's tensors arrive: link.device, a bare "cuda" resolved to the current device (once)."""
    if link.device.type == "cuda" and link.device.index is None:
        link.device = torch.device("cuda", torch.cuda.current_device())
    return link.device


def receive_weights(link: WeightLink) -> tuple[int, dict[str, torch.Tensor]] | None:
    """Block (up to link.timeout) for the next weights: (version, {name: tensor}), or None after a finished
    trainer's "stop". SyncError when it is gone, failed, or times out."""
    header = receive_header(link)
    if header is None:
        return None
    state = {name: t for bucket in receive_buckets(link, header) for name, t in bucket}
    ack(link)
    return header["version"], state


def receive_header(link: WeightLink) -> dict | None:
    """The next transfer's header (version, names, shapes, dtypes, buckets), or None after a "stop" from a finished
    trainer (acknowledged). SyncError when the trainer is gone, failed, or the wait times out."""
    key = f"nanorft/header/{link.count}"
    try:
        link.store.wait([key], link.timeout)
        header = json.loads(link.store.get(key))
    except RuntimeError as e:  # the store died with the trainer's process, or the wait timed out
        raise SyncError(f"no weights from the trainer (transfer {link.count}): {str(e).splitlines()[0]}") from e
    if header.get("stop"):
        ack(link)
        if not header["finished"]:
            raise SyncError("the trainer stopped on an error")
        return None
    return header


def receive_buckets(link: WeightLink, header: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The transfer's tensors, one bucket at a time as they arrive on link.device: [(name, tensor)], views into
    the bucket's buffer (no copies). Every receiving rank of the group takes every bucket."""
    done = 0
    try:
        specs = [
            (name, tuple(shape), _dtype(name, d))
            for name, shape, d in zip(header["names"], header["shapes"], header["dtypes"], strict=True)
        ]
        for bucket in header["buckets"]:
            offsets, size = layout(specs, bucket)
            buf = torch.empty(size, dtype=torch.uint8, device=_device(link))
            _broadcast(link, buf)
            yield [
                (name, buf[at : at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
                for (name, shape, dtype), at in zip((specs[i] for i in bucket), offsets)
            ]
            done += len(bucket)
    except SyncError:
        raise
    except RuntimeError as e:  # gloo: "Connection closed by peer" when the trainer dies mid-transfer
        raise SyncError(f"weight transfer {link.count} broke after {done} tensors: {str(e).splitlines()[0]}") from e


def header_bytes(header: dict) -> int:
    """The bytes a transfer carries."""
    return sum(
        math.prod(shape) * _dtype(name, d).itemsize
        for name, shape, d in zip(header["names"], header["shapes"], header["dtypes"])
    )


def _dtype(name: str, dtype_name: str) -> torch.dtype:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise SyncError(f"{name}: unknown dtype {dtype_name!r} in the header")
    return dtype


def ack(link: WeightLink) -> None:
    """Tell the trainer this transfer (or its stop) arrived; the next header key follows."""
    link.store.set(f"nanorft/ack/{link.count}", "1")
    link.count += 1


def close_receiver(link: WeightLink) -> None:
    """Tell the trainer not to wait for this explorer any more; drop the group."""
    try:
        link.store.set("nanorft/closed", "1")
    except RuntimeError:
        pass  # the trainer is already gone
    drop_group(link)


def drop_group(link: WeightLink) -> None:
    """Shut this rank's side of the weight group down (a vLLM worker's, when its engine closes); the store stays."""
    if link.group is not None and hasattr(link.group, "shutdown"):
        link.group.shutdown()
    link.group = None


def as_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """`dtype` for a floating-point tensor (None: its own), a non-floating tensor's own dtype."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating-point tensors in `dtype` (the others as they are). Tensors that share memory (tied
    embeddings) share the cast one. NOTE: else save_pretrained no longer sees them tied and writes the LM head
    twice (vocab x hidden more bytes: ~0.47 GB for Qwen2.5-1.5B in bf16)."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state.items():
        key = (v.device, v.data_ptr(), v.shape, v.stride(), v.dtype)
        out[k] = done[key] if key in done else done.setdefault(key, v.to(as_dtype(v, dtype)))
    return out


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights on rank 0's CPU; {} on other ranks. Every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def pause_for_test(point: str, step: int) -> None:
    """Tests only: with NANORFT_TEST_PAUSE_AT=<point>:<step>, the process touches the file
    NANORFT_TEST_PAUSE_MARKER at that point and waits there, so that a test can kill it at a known place
    (a kill timed by the clock races the run: on a fast machine the explorer had finished before the kill)."""
    if os.environ.get("NANORFT_TEST_PAUSE_AT") == f"{point}:{step}":
        Path(os.environ["NANORFT_TEST_PAUSE_MARKER"]).touch()
        while True:
            time.sleep(60)
