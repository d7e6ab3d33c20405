"""The fake of vLLM's dense NCCL weight-transfer engine (vllm.distributed.weight_transfer.nccl_engine), for the GPU
path a CPU cannot run: the same classes, fields and lifecycle (the trainer's side posts the workers' init info through
its client while it opens its endpoint, then per round: start, update_weights concurrently with its broadcast,
finish), with the tensors broadcast one by one over a gloo group that meets at (master_address, master_port) in place
of NCCL (so `packed` and the buffer sizes only travel). tests/test_vllm_contract.py compares the fields with vLLM's."""

import datetime
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2


@dataclass
class NCCLTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


@dataclass(kw_only=True)
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str | None = field(default=None, repr=False)
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


@dataclass
class NCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def group(address: str, port: int, rank: int, world: int) -> Any:
    """The stand-in for vLLM's StatelessProcessGroup + PyNcclCommunicator: gloo over a TCPStore rank 0 serves."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(address, port, world, rank == 0, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, world, opts)


class NCCLWeightTransferEngine(WeightTransferEngine):
    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo
    model_update_group = None

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.model_update_group = group(init_info.master_address, init_info.master_port, rank, init_info.world_size)

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        info = self.parse_update_info(update_info)
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.model_update_group.broadcast(weight, 0).wait()
            self.model.load_weights([(name, weight)])

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        self.model_update_group = None


class NCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    init_info_cls = NCCLTrainerInitInfo
    model_update_group = None

    @classmethod
    def trainer_init(cls, init_info: NCCLTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker = NCCLWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            packed=init_info.packed,
        )
        payload = {k: v for k, v in asdict(worker).items() if v is not None}
        with ThreadPoolExecutor(max_workers=1) as exe:  # the workers rendezvous while the endpoint opens
            future = exe.submit(client.init_weight_transfer_engine, payload)
            engine.model_update_group = group(init_info.master_address, init_info.master_port, 0, init_info.world_size)
            future.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        info = NCCLWeightTransferUpdateInfo(
            [m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta], [list(m.shape) for m in meta]
        )
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(self.client.update_weights, asdict(info))
            for (_, tensor), m in zip(self.source, meta):
                self.model_update_group.broadcast(tensor.detach().to(m.dtype).contiguous(), 0).wait()
            future.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.model_update_group = None
