"""weight_transfer.py: nanorft's weight-transfer engine for vLLM (backend "nanorft_gloo"), registered with vLLM's
weight-transfer factories by a vLLM plugin (pyproject's `vllm.general_plugins` entry point: vLLM loads it in every
engine and worker process it starts), so that new weights reach vLLM's workers through vLLM's own RL lifecycle:

    llm.init_weight_transfer_engine({"init_info": {"job_dir": ..., "rank_offset": 1, "timeout": 600}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"header": <wire header>}})      # the buckets over the weight group
    llm.update_weights({"update_info": {"folder": <published HF folder>}})   # or a published folder's files
    llm.finish_weight_update(weight_version="10")

The engine's transport is wire.py's weight group (gloo on CPUs: vLLM's own engines are NCCL and CUDA IPC): each worker
joins the trainer's group as its own rank and takes the buckets straight into `model.load_weights`, inside vLLM's
layer-wise reload (start/finish), which maps HF names onto vLLM's fused layers and re-runs each layer's post-load
processing (the CPU backend repacks its GEMM weights). The trainer's side (`GlooTrainerEngine`, registered with
vLLM's trainer factory; on GPUs vLLM's own NCCL trainer engine instead: `trainer_engine`) drives the transfer through
a `StoreClient`, vLLM's client protocol over the group's store; the explorer, which holds the engines, takes the calls
from it and makes them on its engines.
A folder goes through the same lifecycle: there is no folder source in vLLM's engines, and vLLM's documented
`reload_weights` skips re-processing a tied lm_head on the CPU backend (below).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

import wire

BACKEND = "nanorft_gloo"


def register() -> None:
    """The vLLM plugin (vllm.general_plugins): register the engine with both of vLLM's factories. vLLM calls it once
    per process, the trainer before it builds its side; a second call is a no-op."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in (
        (WeightTransferEngineFactory, "GlooEngine"),
        (WeightTransferTrainerFactory, "GlooTrainerEngine"),
    ):
        if BACKEND not in factory._registry:  # NOTE: register_engine raises on a name it has
            factory.register_engine(BACKEND, __name__, cls)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's weight group is (its job dir's sync_group.json) and this engine's first rank in it."""

    job_dir: str
    rank_offset: int = 1
    timeout: float = 600.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: a wire header (the buckets follow over the group) or a published HF folder."""

    header: dict | None = None
    folder: str | None = None


class GlooEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side, one per vLLM worker (vLLM builds it at model load with the worker's model and device)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    link: wire.WeightLink | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        """Join the trainer's weight group as rank rank_offset + this worker's rank (leaving an earlier one)."""
        self.shutdown()
        rank = init_info.rank_offset + self.parallel_config.rank
        self.link = wire.open_receiver(init_info.job_dir, init_info.timeout, self.device, rank, None)

    def start_weight_update(self) -> None:
        expected_reload_warnings_off()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """NOTE: vLLM's default also calls torch.accelerator.synchronize(), which raises on a CPU worker ("Cannot
        access accelerator device when none is available"); gloo and the file reads are synchronous."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if update_info.folder is not None:
            self.model.load_weights(folder_tensors(update_info.folder, str(self.device)))
        elif self.link is None:
            raise RuntimeError("nanorft_gloo: update_weights before init_weight_transfer_engine")
        else:
            for bucket in wire.receive_buckets(self.link, update_info.header):
                self.model.load_weights(bucket)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        retie_lm_head(self.model)

    def shutdown(self) -> None:
        if self.link is not None:
            wire.drop_group(self.link)
            self.link = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the gloo engine: how long the explorer's workers wait for each transfer."""

    backend: ClassVar[str] = BACKEND
    timeout: float = 600.0


class StoreClient:
    """vLLM's trainer-side client (VLLMWeightSyncClient) over the weight group's store (wire.py): the engines live in
    the explorer's process, which takes each call from the store and makes it on its engines (sync.ExplorerSync:
    `join_group` on the init info, then per transfer its engines' start / update / finish). init_weight_transfer_engine
    posts the init info; update_weights posts the transfer's header, {"version", "update_info"}, and returns (NCCL's
    trainer engine broadcasts meanwhile); start and finish are the explorer's, around each header it reads.
    `version`: the version of the weights the next transfer carries."""

    def __init__(self, link: wire.WeightLink) -> None:
        self.link, self.version = link, 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        wire.post_init(self.link, init_info)

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        wire.post_header(self.link, {"version": self.version, "update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class GlooTrainerEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side of the gloo engine: send_weights() streams the source's tensors over wire.py's group in
    buckets (every trainer rank iterates the source: gathering FSDP2 shards is a collective; rank 0 sends)."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: WeightSource | None = None) -> Any:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:  # the workers join wire.py's group: rank 1 + their index (the explorer's offsets)
            job_dir = str(client.link.job_dir)
            client.init_weight_transfer_engine({"job_dir": job_dir, "timeout": init_info.timeout, "rank_offset": 1})
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        specs = [(m.name, tuple(m.shape), m.dtype) for m in meta]
        tensors = (t for _, t in self.source)
        if not self.is_sender:
            for _ in tensors:
                pass
            return
        header = wire.make_header(self.client.version, specs)
        self.client.start_weight_update()
        self.client.update_weights({"header": header})
        wire.send_buckets(self.client.link, header, specs, tensors)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        pass  # the group is the link's: wire.close_sender


class SpecSource(WeightSource):
    """The trainer's weights as vLLM's WeightSource: `stream()` gives (specs [(name, shape, dtype)], the full tensors
    in their order), afresh each round (lora.weight_stream: LoRA merged, cast to the engine's dtype)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.pending = stream, None

    def metadata(self) -> list[Any]:
        specs, self.pending = self.stream()
        self.names = [name for name, _, _ in specs]
        return [ParamMeta(name, dtype, tuple(shape)) for name, shape, dtype in specs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors, self.pending = self.pending, None
        yield from zip(self.names, tensors)


def trainer_engine(backend: str, link: wire.WeightLink | None, rank: int, source: WeightSource, sync: Any) -> Any:
    """The trainer's side of the explorer's vLLM engines' weight-transfer engine, built by vLLM's trainer factory on
    every trainer rank (`link`: rank 0's, None elsewhere), at the first transfer: "nccl" (vLLM's, GPUs; it needs the
    group's size, which the explorer announced by then) or nanorft's gloo engine. `sync`: the synchronizer config."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    register()
    client = StoreClient(link) if link is not None else None
    if backend != "nccl":
        info = GlooTrainerInitInfo(rank=rank, timeout=sync.sync_timeout)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    world = 0
    if link is not None:
        link.store.wait([wire.WORLD_KEY], link.timeout)
        world = int(link.store.get(wire.WORLD_KEY))
    info = NCCLTrainerInitInfo(sync.sync_host, wire.free_port(sync.sync_host), world, rank=rank)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def folder_tensors(folder: str, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a published folder's safetensors files, one at a time onto `device`."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(path, "pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def check_folder(folder: str) -> int:
    """The tensors a published folder holds, every file's header read first; OSError for a missing, empty or cut
    file. NOTE: checked before start_weight_update: once vLLM's layer-wise reload has begun, the layers wait on the meta
    device for their weights, and a load that fails half-way leaves the engine unusable."""
    files = sorted(Path(folder).glob("*.safetensors"))
    try:
        count = sum(len(list(safe_open(f, "pt").keys())) for f in files)
    except Exception as e:  # safetensors raises its own SafetensorError for a cut header
        raise OSError(f"{type(e).__name__}: {e}") from e
    if not count:
        raise OSError(f"no weights in {folder}" + ("" if Path(folder).is_dir() else " (no folder)"))
    return count


def retie_lm_head(model: Any) -> None:
    """After a layer-wise reload of a model whose lm_head is tied to its input embedding: re-run the lm_head's
    post-load processing. NOTE: vLLM 0.32's finish step skips the tied lm_head (the checkpoint has no weights of its
    own for it: "ParallelLMHead: Failed to load weights") and, on the CPU backend, keeps the GEMM it packed from the
    OLD embedding, so the logits came from the old weights (docs/LOG.md, 2026-11-25; tests/test_vllm_contract.py)."""
    lm_head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
        lm_head.quant_method.process_weights_after_loading(lm_head)


class ExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for the two layers no checkpoint holds weights of by design:
    the rotary embedding (a computed cache) and an lm_head tied to the input embedding (retie_lm_head processes it
    again). Printed by every worker at every update, they read as if the sync had failed; any other layer's shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights"
            and record.args
            and record.args[0] in ("RotaryEmbedding", "ParallelLMHead")
        )


def expected_reload_warnings_off() -> None:
    """Put ExpectedReloadWarnings on vLLM's layer-wise reload logger (once per worker process)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, ExpectedReloadWarnings) for f in logger.filters):
        logger.addFilter(ExpectedReloadWarnings())
