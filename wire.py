"""wire.py: the weight group's wire protocol, trainer rank 0 -> the explorer (`synchronizer.sync_method: nccl`).
It imports nothing from the project; when weights move (the sync points, a restart) is sync.py's.

Trainer rank 0 streams the full tensors to the explorer over a group built by hand beside torchrun's default group
(gloo on CPU, NCCL on GPU; never init_process_group). Trainer rank 0 is rank 0 (the source); the receivers are ranks
1..: the HF explorer itself, or every worker of every vLLM engine (weight_transfer.GlooEngine, through vLLM's weight-
update lifecycle: each takes the buckets onto its device). The explorer announces the group's size in the store
(`open_receiver(..., receivers=n)`). For vLLM engines the trainer's side of their weight-transfer engine posts, through
the store, its init info (`post_init` / `receive_init`) and each transfer's header as {"version", "update_info"}
(weight_transfer.StoreClient; the gloo engine's update info holds this module's header, vLLM's NCCL engine's its own).

    link = open_sender(job_dir, device, timeout)       # trainer rank 0: TCPStore + <job dir>/sync_group.json
    send_weights(link, version, specs, tensors)        # every rank; specs [(name, shape, dtype)], tensors lazy
    send_model(link, model, version)                   # the same for an (FSDP2) model's parameters
    close_sender(link, finished=True)                  # "stop": a waiting explorer learns the trainer is done
    link = open_receiver(job_dir, timeout)             # explorer: find the file, connect to the store
    got = receive_weights(link)                        # (version, {name: tensor}), or None after "stop"
    # or by part: header = receive_header(link); for bucket in receive_buckets(link, header): ...; ack(link)
    # (the sender's parts: header = make_header(version, specs); post_header(link, header); send_buckets(...))
    close_receiver(link)

The wire, per transfer n: the header (JSON: version, names, shapes, dtypes, buckets; or stop) is the store
key `nanorft/header/<n>`; then the tensors, in header order, packed as raw bytes (uint8 views: bitwise exact
for every dtype, no pickle anywhere) into buckets of up to BUCKET_BYTES, one broadcast per bucket; the explorer
acks with `nanorft/ack/<n>`.
Headers go through the store, not the group, so that "stop" never blocks on a departed explorer and a
dead trainer is noticed at once (the store lives in the trainer's process: its sockets close).
NOTE: the group itself is created at the first transfer (creating it blocks until both sides are
there). The store listens on `synchronizer.sync_host`, 127.0.0.1 unless the config names another address (the
explorer on another host than trainer rank 0: mode both over several nodes); a gloo group's ends bind that address
on the trainer and, on the explorer, its own address on the route to it (`address_towards`).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

log = logging.getLogger("nanorft.wire")
GROUP_FILE = "sync_group.json"  # where trainer rank 0 tells the explorer how to reach its store
WORLD_KEY = "nanorft/world"  # the weight group's size: 1 (the trainer) + the receiving ranks, set by the explorer
INIT_KEY = "nanorft/init"  # the init info of the explorer's vLLM weight-transfer engines, set by the trainer


def _write_text_atomic(path: Path, text: str) -> None:
    """Write `path` under a temporary name, then rename it into place: a reader sees the old file or the whole new one
    (as sync.write_atomic; this module imports nothing from the project)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    address: str = "127.0.0.1"  # gloo: this end's address in the group, where the others reach it ("": any)


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
            # NOTE: each end announces the address it is bound to, so that one the others reach: the store's host on
            # the trainer, the address that routes to it on a receiver (loopback when both are on one host; the
            # explorer on node 0 and trainer rank 0 on node 1 in mode both over nodes: their network's)
            device = dist.ProcessGroupGloo.create_device
            opts._devices = [
                device(hostname=link.address) if link.address else dist.ProcessGroupGloo.create_default_device()
            ]
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
    `resumed` (a restarted explorer learns from it which versions will come: sync.ExplorerSync.over_group).
    device "cpu" -> gloo; "cuda[:i]" -> NCCL (NOTE: NCCL needs the explorer on another GPU; on one shared GPU use
    "cpu", gloo)."""
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
    return WeightLink(
        store,
        rank=0,
        backend=backend,
        device=device,
        timeout=_timeout(timeout),
        job_dir=Path(job_dir),
        resumed=resumed,
        address="" if host in ("0.0.0.0", "::") else host,
    )


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
    extra: dict | None = None,
) -> int:
    """Send one version of the weights; returns the tensors' bytes sent (header_bytes; the padding of `layout` not
    counted): its header (`make_header`, with `extra`'s JSON entries: a LoRA adapter's config) through the store,
    then its buckets (`send_buckets`).
    NOTE: call it on EVERY trainer rank, link=None on all but rank 0: producing the tensors
    (FSDP2 `full_tensor()`) is a collective, so the other ranks iterate too and drop them."""
    if link is None:
        for _ in tensors:
            pass
        return 0
    header = make_header(version, specs) | (extra or {})
    post_header(link, header)
    return send_buckets(link, header, specs, tensors)


def make_header(version: int, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> dict:
    """A transfer's header: its version, each tensor's name, shape and dtype, and the buckets they travel in."""
    return {
        "version": version,
        "names": [n for n, _, _ in specs],
        "shapes": [list(s) for _, s, _ in specs],
        "dtypes": [str(d).removeprefix("torch.") for _, _, d in specs],
        "buckets": buckets(specs),
    }


def post_header(link: WeightLink, header: dict) -> None:
    """Announce the next transfer (its header, as JSON, under the next header key)."""
    link.store.set(f"nanorft/header/{link.count}", json.dumps(header))
    link.count += 1


def send_buckets(
    link: WeightLink,
    header: dict,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    tensors: Iterable[torch.Tensor],
) -> int:
    """Broadcast a transfer's tensors (`tensors` yields the full tensors in `specs` order, lazily: one full parameter
    at a time): each is cast to its spec's dtype and copied into its bucket (`buckets`, `layout`), which is broadcast
    once full: few broadcasts, at most a bucket in extra memory. Returns the tensors' bytes."""
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
    """send_weights of an (FSDP2-sharded) model (`model_stream`; call it on every rank, link=None on all but rank
    0)."""
    with torch.no_grad():
        return send_weights(link, version, *model_stream(model, dtype))


def model_stream(
    model: torch.nn.Module, dtype: torch.dtype | None = None
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[torch.Tensor]]:
    """An (FSDP2-sharded) model's specs and its full tensors, lazily: one full parameter at a time, gathered on every
    rank; tied weights appear once. `dtype`: floating-point parameters are sent in it (e.g. bf16 for a bf16 engine:
    half the bytes); default their own."""
    params = dict(model.named_parameters())
    specs = [(k, tuple(v.shape), as_dtype(v, dtype)) for k, v in params.items()]
    return specs, (v.full_tensor() if isinstance(v, DTensor) else v for v in params.values())


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


def free_port(host: str) -> int:
    """A port free on `host` now (for a rendezvous another library opens: vLLM's NCCL weight-transfer engine)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def address_towards(host: str, port: int) -> str:
    """This host's address on its route to `host` (the source address the kernel picks: a UDP socket's connect
    sends nothing): 127.0.0.1 for a loopback host, else the address of the network that reaches it."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


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
                address = address_towards(info["host"], info["port"])
                if receivers is not None:
                    store.set(WORLD_KEY, str(1 + receivers))
                    served = f"{info['host']}:{info['port']}"
                    log.info("weight sync: receiving from the %s group served on %s, at %s", backend, served, address)
                return WeightLink(
                    store,
                    rank=rank,
                    backend=backend,
                    device=dev,
                    timeout=_timeout(timeout),
                    job_dir=Path(job_dir),
                    resumed=int(info.get("resumed", 0)),
                    address=address,
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


def post_init(link: WeightLink, init_info: dict) -> None:
    """Trainer rank 0: the init info of the receivers' weight-transfer engines (a vLLM engine's workers: vLLM's
    init_weight_transfer_engine), posted once before its first transfer to them."""
    link.store.set(INIT_KEY, json.dumps(init_info))


def receive_init(link: WeightLink) -> dict | None:
    """Explorer: the trainer's init info for its engines, waited for up to link.timeout; None when the next header
    (the trainer's stop) comes first: a trainer that never sends posts none. SyncError when neither comes."""
    deadline, key = time.monotonic() + link.timeout.total_seconds(), f"nanorft/header/{link.count}"
    while time.monotonic() < deadline:
        try:
            if link.store.check([INIT_KEY]):
                return json.loads(link.store.get(INIT_KEY))
            if link.store.check([key]):
                return None
        except RuntimeError as e:  # the store died with the trainer's process
            raise SyncError(f"no init info from the trainer: {str(e).splitlines()[0]}") from e
        time.sleep(0.05)
    raise SyncError(f"no init info from the trainer after {link.timeout.total_seconds():g} s")


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
