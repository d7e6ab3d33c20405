"""The fake of vLLM's weight-transfer factories (vllm.distributed.weight_transfer): a registry per side, by name, as
vLLM's (register_engine(name, module path, class name) raises on a name it has; create_engine builds a registered
worker engine)."""

import importlib

from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine, WeightTransferEngine


class WeightTransferEngineFactory:
    _registry: dict = {}

    @classmethod
    def register_engine(cls, name: str, module_path_or_cls, class_name: str | None = None) -> None:
        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module_path_or_cls), class_name)

    @classmethod
    def create_engine(cls, config, vllm_config, device, model) -> WeightTransferEngine:
        if config["backend"] not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {config['backend']}")
        return cls._registry[config["backend"]]()(config, vllm_config, device, model)


class WeightTransferTrainerFactory(WeightTransferEngineFactory):
    _registry: dict = {}

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None) -> TrainerWeightTransferEngine:
        return cls._registry[init_info.backend]().trainer_init(init_info, client=client, source=source)


WeightTransferEngineFactory.register_engine(
    "nccl", "vllm.distributed.weight_transfer.nccl_engine", "NCCLWeightTransferEngine"
)
WeightTransferTrainerFactory.register_engine(
    "nccl", "vllm.distributed.weight_transfer.nccl_engine", "NCCLTrainerWeightTransferEngine"
)

__all__ = ["WeightTransferEngineFactory", "WeightTransferTrainerFactory"]
