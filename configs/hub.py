"""The Hugging Face hub in the pre-flight: every hub id a resolved config names (models and datasets), whether this
machine can have it, and fetching it once, in the launcher, before any process starts.

    hub_problems(stages)   # configs.preflight: one line per hub id that is neither cached nor downloadable here
    fetch_hub(stages)      # configs.entry, after the pre-flight: downloads what is missing, with progress bars

A path is a hub id where it is no local path and reads `org/name` (models.py and tasksets.py then ask the hub).
Whether the hub can be reached is decided once per process: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE; for datasets
also HF_DATASETS_OFFLINE) set, or one HEAD request to the endpoint (HF_ENDPOINT, default https://huggingface.co) that
gets no answer within PROBE_TIMEOUT_S. NOTE: not huggingface_hub's own requests: they retry with back-off (1+2+4+8+8
s per file), which on a machine without network was a minute of retry warnings (44, in both processes) and 4
tracebacks naming no key (docs/LOG.md, 2026-11-29). Where the hub cannot be reached and everything is cached, the
processes run with HF_HUB_OFFLINE=1 and HF_DATASETS_OFFLINE=1, so that they read the cache without asking the hub.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from errors import ConfigError

log = logging.getLogger("nanorft.hub")

PROBE_TIMEOUT_S = 2.5  # one HEAD to the endpoint; the hub answers in well under a second where it is reachable
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TRUE = {"1", "ON", "YES", "TRUE"}
# what transformers and vLLM read from a model repo; weights as safetensors, else (second pass) PyTorch .bin files
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
BIN_FILES = ["*.bin"]


@dataclasses.dataclass(frozen=True)
class HubRef:
    """One hub id a config names: `key` (the config key to fix), `kind` "model" or "dataset"; a dataset's subset and
    split as the reader asks for them."""

    key: str
    kind: str
    repo: str
    subset: str | None = None
    split: str = "train"


def is_hub_id(path: str) -> bool:
    """Whether `path` would be asked of the hub: no local path, `org/name`, and no local folder `org`."""
    return (
        bool(path)
        and not Path(path).expanduser().exists()
        and _HUB_ID.fullmatch(path) is not None
        and not Path(path.split("/")[0]).exists()
    )


def hub_refs(stage: Any, models: bool = True) -> list[HubRef]:
    """Every hub id `stage` names: its models (model_path and critic_model_path, not with models=False: a stage after
    a training stage starts from that stage's weights; auxiliary models), its tasksets and file buffers."""
    m = stage.model
    paths = {"model.model_path": m.model_path, "model.critic_model_path": m.critic_model_path} if models else {}
    if paths and m.critic_model_path == m.model_path:  # the derived default: one model, named once
        del paths["model.critic_model_path"]
    out = [HubRef(key, "model", path) for key, path in paths.items()]
    out += [
        HubRef(f"explorer.auxiliary_models[{i}].model_path", "model", a.model_path)
        for i, a in enumerate(stage.explorer.auxiliary_models)
        if a.engine_type != "external"
    ]
    inp, tin = stage.buffer.explorer_input, stage.buffer.trainer_input
    # NOTE: the resolver moved a Trinity-style `taskset` to tasksets[0] (configs.resolve._derive_tasksets)
    sets = [
        ("taskset.path (tasksets[0])" if i == 0 else f"tasksets[{i}].path", ts) for i, ts in enumerate(inp.tasksets)
    ]
    sets += [(f"eval_tasksets[{i}].path", ts) for i, ts in enumerate(inp.eval_tasksets)]
    out += [HubRef(f"buffer.explorer_input.{k}", "dataset", ts.path, ts.subset_name, ts.split) for k, ts in sets]
    bufs = [("experience_buffer", tin.experience_buffer)]
    bufs += [(f"auxiliary_buffers.{name}", b) for name, b in tin.auxiliary_buffers.items()]
    out += [
        HubRef(f"buffer.trainer_input.{k}.path", "dataset", b.path, b.subset_name, b.split)
        for k, b in bufs
        if b.storage_type == "file"
    ]
    return [r for r in out if is_hub_id(r.repo)]


@functools.cache
def _probe(endpoint: str) -> str | None:
    """Why `endpoint` gives no answer (refused, unknown host, silent past PROBE_TIMEOUT_S), or None where it answers
    (any HTTP status is an answer). Once per endpoint and process."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        if isinstance(e.reason, ssl.SSLError):  # something answered; huggingface_hub's own TLS setup may agree with it
            return None
        return f"no answer from {endpoint} within {PROBE_TIMEOUT_S:g} s ({e.reason})"
    except (OSError, ValueError) as e:  # TimeoutError (connected, then silent), ConnectionError; a malformed URL
        return f"no answer from {endpoint} within {PROBE_TIMEOUT_S:g} s ({e or type(e).__name__})"
    return None


def offline_reason(kind: str) -> str | None:
    """Why hub `kind` ("model" / "dataset") downloads cannot happen here (an offline switch set, or the endpoint's
    probe), or None where they can."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    if kind == "dataset" and os.environ.get("HF_DATASETS_OFFLINE", "").upper() in _TRUE:
        return "HF_DATASETS_OFFLINE is set"
    return _probe(constants.ENDPOINT)


def model_cached(repo: str) -> bool:
    """Whether the local HF cache holds model `repo` (its config.json)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # a name the hub refuses (HFValidationError: "--", "..", a trailing "."): in no cache
        return False


def datasets_cache() -> Path:
    """`datasets`' cache folder (HF_DATASETS_CACHE, else <HF_HOME>/datasets), without importing `datasets`."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets").expanduser()


def dataset_cached(repo: str, subset: str | None) -> bool:
    """Whether `datasets` would load hub dataset `repo` (`subset`) from its cache offline: a prepared
    <cache>/<org>___<snake name>/<subset>/<version>/<hash> folder (datasets.load's CachedDatasetModuleFactory)."""
    org, name = repo.split("/")
    # NOTE: datasets.naming.camelcase_to_snakecase, here because importing `datasets` takes 1-2 s
    snake = re.sub(r"([a-z\d])([A-Z])", r"\1_\2", re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)).lower()
    root = datasets_cache() / f"{org}___{snake}"
    return any(p.is_dir() for p in root.glob(f"{subset or '*'}/*/*"))


def hub_problem(ref: HubRef) -> str | None:
    """Why hub id `ref` cannot be had here (not cached, and no download possible), with what to set; or None."""
    cached = model_cached(ref.repo) if ref.kind == "model" else dataset_cached(ref.repo, ref.subset)
    if cached or (why := offline_reason(ref.kind)) is None:
        return None
    from huggingface_hub import constants

    if ref.kind == "model":
        return (
            f"{ref.repo!r} is no local folder (from {Path.cwd()}) nor a model in the HF cache "
            f"({constants.HF_HUB_CACHE}), and the hub cannot give it ({why}): set {ref.key} to a local model folder, "
            f"or fill the cache once where the hub is reachable (`hf download {ref.repo}`) and run with "
            "HF_HUB_OFFLINE=1"
        )
    subset = f" (subset {ref.subset!r})" if ref.subset else ""
    return (
        f"{ref.repo!r}{subset} is no local file or folder (from {Path.cwd()}) nor a dataset in the datasets cache "
        f"({datasets_cache()}), and the hub cannot give it ({why}): set {ref.key} to a local file or folder, or "
        "fill the cache once where the hub is reachable (a run there does) and run with HF_DATASETS_OFFLINE=1"
    )


def stage_refs(stages: list[Any]) -> list[tuple[HubRef, str]]:
    """(hub id, the name of the first stage naming it) for every hub id of the stages, once each; model paths only up
    to the first stage that trains (later stages start from its weights: launch.stages_in_order)."""
    out: dict[HubRef, str] = {}
    trained = False
    for stage in stages:
        for ref in hub_refs(stage, models=not trained):
            out.setdefault(ref, stage.name)
        trained = trained or stage.mode in ("train", "both")
    return list(out.items())


def hub_problems(stages: list[Any]) -> list[tuple[str, str]]:
    """(line, stage name) per hub id of any stage that this machine can neither find cached nor download (stage_refs);
    each line names its key and what to set."""
    return [(f"{ref.key} = {ref.repo!r}: {why}", name) for ref, name in stage_refs(stages) if (why := hub_problem(ref))]


def fetch_hub(stages: list[Any]) -> None:
    """Where the hub is reachable: download every hub id the stages name that the cache lacks, once, here, with
    progress bars (the processes then find it in the cache); a failed download (unknown or gated repo, no such split)
    is a ConfigError naming the key. Where it is not (the pre-flight let only cached ids through): the processes run
    offline. Called by the launcher (and a script run on its own) after the pre-flight."""
    refs = {ref.repo if ref.kind == "model" else ref: ref for ref, _ in stage_refs(stages)}  # a model once per repo
    if not refs:
        return
    from huggingface_hub import constants

    if not constants.is_offline_mode() and _probe(constants.ENDPOINT):
        go_offline()
        return
    for ref in refs.values():
        if offline_reason(ref.kind):  # HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: the cache only (the pre-flight checked)
            continue
        try:
            if ref.kind == "model" and not model_cached(ref.repo):
                download_model(ref.repo)
            elif ref.kind == "dataset" and not dataset_cached(ref.repo, ref.subset):
                download_dataset(ref)
        except Exception as e:  # RepositoryNotFoundError, GatedRepoError, DatasetNotFoundError, a missing split...
            why = " ".join(str(e).split())  # huggingface_hub's messages run over several lines
            raise ConfigError(
                f"{ref.key} = {ref.repo!r}: downloading it from the hub failed: {type(e).__name__}: {why}"
            ) from None


def go_offline() -> None:
    """The hub is unreachable and everything the config names is cached: this process and its children read the cache
    without asking the hub first. NOTE: huggingface_hub reads HF_HUB_OFFLINE once, at import (constants.HF_HUB_OFFLINE,
    which its is_offline_mode() and transformers' consult): this process sets the constant as well; children read the
    environment."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    log.info("the hub cannot be reached and the config's hub ids are cached: running with HF_HUB_OFFLINE=1")


def download_model(repo: str) -> None:
    """Model `repo` into the HF cache: configs, tokenizer and safetensors weights (PyTorch .bin weights where the repo
    has no safetensors), with huggingface_hub's progress bars."""
    from huggingface_hub import snapshot_download

    log.info("downloading model %s from the hub into the HF cache (once; the processes read it there)", repo)
    folder = Path(snapshot_download(repo, allow_patterns=MODEL_FILES))
    if not any(folder.glob("*.safetensors")):
        snapshot_download(repo, allow_patterns=BIN_FILES)


def download_dataset(ref: HubRef) -> None:
    """Hub dataset `ref` (its subset and split) into `datasets`' cache, with its progress bars: what tasksets.read_rows
    then loads."""
    import datasets

    log.info("downloading dataset %s (subset %s, split %s) from the hub (once)", ref.repo, ref.subset, ref.split)
    datasets.enable_progress_bars()
    datasets.load_dataset(ref.repo, ref.subset, split=ref.split)
