"""The fake of vllm.distributed.weight_transfer.base: the classes a weight-transfer engine subclasses and the request
types of the engines' lifecycle calls, with vLLM's names and fields (tests/test_vllm_contract.py compares them)."""

from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

TInit = TypeVar("TInit")
TUpdate = TypeVar("TUpdate")


@dataclass
class WeightTransferInitInfo:
    pass


@dataclass
class WeightTransferUpdateInfo:
    pass


@dataclass
class TrainerInitInfo:
    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass
class WeightTransferInitRequest:
    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    update_info: Any = field(default_factory=dict)


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: Any
    shape: tuple[int, ...]


class WeightSource:
    def metadata(self) -> list[ParamMeta]:
        raise NotImplementedError

    def __iter__(self):
        raise NotImplementedError


class ModuleSource(WeightSource):
    """vLLM's WeightSource over a module's named_parameters (its full tensors)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self._module.named_parameters()]

    def __iter__(self):
        yield from self._module.named_parameters()


class WeightTransferEngine(Generic[TInit, TUpdate]):
    init_info_cls: type
    update_info_cls: type

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
        self.parallel_config, self.model_config = vllm_config.parallel_config, vllm_config.model_config

    def parse_init_info(self, init_dict: dict) -> Any:
        return self.init_info_cls(**init_dict)

    def parse_update_info(self, update_dict: dict) -> Any:
        return self.update_info_cls(**update_dict)


class TrainerWeightTransferEngine(Generic[TInit]):
    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        self.client, self.source, self.is_sender = client, source, is_sender
