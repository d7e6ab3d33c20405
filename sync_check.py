"""sync_check.py: `--verify-sync`, the launcher's check of the weight path before a run (configs' pre-flight checks
the machine; this moves weights): each stage that syncs over the process group moves the model's weights once into
its configured rollout engines, as the trainer sends them, then loads the same weights from their folder, and the
engines' checksums must agree (vLLM's compute_weight_checksums; the HF engine's own), and vLLM's weight version be
the transfer's. vLLM engines that serve a LoRA adapter (sync.serves_adapter) get the adapter alone: vLLM's checksums
cover the model's parameters, not its adapters, so their check is the engines' log-probs instead (`verify_adapter`).

    bash run.sh configs/tiny.yaml --verify-sync      # launch.py: before the stages start; a difference stops it
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

import lora
import sync
import wire
from configs.schema import Config
from engines import engine_kind, make_engine
from errors import ConfigError
from models import load_model, torch_dtype

log = logging.getLogger("nanorft.sync_check")


def verify_stages(stages: list[Config]) -> None:
    """ConfigError naming the first stage whose engines do not hold the weights sent (`verify`)."""
    for stage in stages:
        if stage.mode not in ("both", "explore") or stage.synchronizer.sync_method != "nccl":
            log.info("--verify-sync: stage %s does not sync over the process group: nothing to verify", stage.name)
            continue
        saved = dict(os.environ)
        try:
            problem = verify(stage)
        finally:  # NOTE: vLLM's CPU platform sets LD_PRELOAD, TORCHINDUCTOR_* in the process that builds an engine:
            os.environ.clear()  # the stages the launcher starts next must not inherit them from a check
            os.environ.update(saved)
        if problem:
            raise ConfigError(f"--verify-sync, stage {stage.name}: {problem}")
        log.info("--verify-sync: stage %s: the engines hold the weights sent, bit for bit", stage.name)


def verify(cfg: Any) -> str:
    """--verify-sync: one transfer of the model's weights over the process group into the configured rollout
    engines, as the trainer sends them (vLLM: through their weight-transfer engine's trainer side), then the same
    weights from their folder: the engines' checksums (vLLM's compute_weight_checksums; the HF engine's own) must be
    equal, and vLLM's weight version the transfer's. "" when they are, else what differs."""
    if sync.serves_adapter(cfg):
        return verify_adapter(cfg)
    rm, path = cfg.explorer.rollout_model, cfg.model.model_path
    engine = make_engine(rm, path, rm.max_model_len, cfg.model.repetition_penalty)
    try:
        with tempfile.TemporaryDirectory() as job:
            sender = wire.open_sender(job, "cpu", cfg.synchronizer.sync_timeout)
            model, dtype = load_model(path), torch_dtype(rm.dtype) if torch.cuda.is_available() else None
            send = threading.Thread(target=verify_send, args=(engine_kind(rm)[0], sender, model, dtype, cfg))
            send.start()
            local = SimpleNamespace(
                checkpoint_job_dir=job, synchronizer=cfg.synchronizer, model=cfg.model, explorer=cfg.explorer
            )
            got = sync.ExplorerSync(local, None, engine).take_weights()
            send.join()
            wire.close_sender(sender, grace=0)
        sent, versions = engine.checksums(), getattr(engine, "weight_versions", lambda: [str(engine.model_version)])()
        engine.load_weights(path, version=2)
        loaded = engine.checksums()
    finally:
        engine.close()
    differ = sorted({k for a, b in zip(sent, loaded) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})
    if got is None or {*versions} != {"1"}:
        return f"the transfer did not arrive as version 1: the engines hold {versions}"
    return f"{len(differ)} weights differ after the transfer, e.g. {differ[:3]}" if differ else ""


def verify_send(kind: str, link: wire.WeightLink, model: torch.nn.Module, dtype: Any, cfg: Any) -> None:
    """verify's trainer: the model's weights as version 1, as train.send sends them to `kind` engines."""
    scorer = SimpleNamespace(model=model)
    if kind == "hf":
        lora.send_model(link, scorer, 1, dtype)
        return
    import vllm_engine
    import weight_transfer  # NOTE: imports vLLM: only here, for vLLM engines

    backend = vllm_engine.weight_backend(torch.cuda.is_available(), cfg.cluster.colocate)
    if backend == "nccl":  # NOTE: NCCL joins ranks on distinct GPUs: the sender on the last, the engines' are first
        model.to(f"cuda:{torch.cuda.device_count() - 1}")
    source = weight_transfer.SpecSource(lambda: lora.weight_stream(scorer, dtype))
    engine = weight_transfer.trainer_engine(backend, link, 0, source, cfg.synchronizer)
    engine.client.version = 1
    with torch.no_grad():
        engine.send_weights()


PROBE = list(range(5, 45))  # the token ids verify_adapter scores (any ids below the vocabulary's size)


def verify_adapter(cfg: Any) -> str:
    """--verify-sync of vLLM engines serving a LoRA adapter: lora_configs[0]'s adapter (its B drawn non-zero, seeded:
    a new adapter's B = 0 would leave the base's log-probs, whatever arrived) sent over the process group as the
    trainer sends it (lora.send_adapter), which the explorer writes and its engines load in place; then the same
    adapter from the folder peft writes (lora.save_adapter). The engines' log-probs of a probe sequence must be
    equal, bit for bit, and not the base's, and vLLM's weight version the transfer's. "" when so, else what
    differs."""
    import vllm_engine

    rm, c, dtype = cfg.explorer.rollout_model, cfg.model.lora_configs[0], None
    scorer = SimpleNamespace(model=load_model(cfg.model.model_path))
    scorer.adapter = lora.wrap(scorer.model, c, c.path)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        for name, q in scorer.model.named_parameters():
            if ".lora_B." in name:
                q.normal_(0, 0.05)
    if torch.cuda.is_available():
        dtype = torch_dtype(rm.dtype)
    served = {"name": c.name or "policy", **vllm_engine.lora_args(cfg.model, c.path)}
    engine = make_engine(rm, cfg.model.model_path, rm.max_model_len, cfg.model.repetition_penalty, lora=served)
    try:
        base = engine.score([PROBE])
        with tempfile.TemporaryDirectory() as job:
            sender = wire.open_sender(job, "cpu", cfg.synchronizer.sync_timeout)
            send = threading.Thread(target=lora.send_adapter, args=(sender, scorer, 1, dtype))
            send.start()
            local = SimpleNamespace(
                checkpoint_job_dir=job, synchronizer=cfg.synchronizer, model=cfg.model, explorer=cfg.explorer
            )
            weights = sync.ExplorerSync(local, None, engine)
            got = weights.take_weights()
            send.join()
            wire.close_sender(sender, grace=0)
            weights.close()
            sent, versions = engine.score([PROBE]), engine.weight_versions()
            state = lora.adapter_state(scorer)
            lora.save_adapter(scorer, Path(job, "adapter"), sync.cast(state, dtype) if dtype else state)
            engine.load_weights(str(Path(job, "adapter")), version=2)
            loaded = engine.score([PROBE])
    finally:
        engine.close()
    if got is None or {*versions} != {"1"}:
        return f"the adapter did not arrive as version 1: the engines hold {versions}"
    if sent == base:
        return "the engines' log-probs after the adapter arrived are the base model's: no adapter is applied"
    gap = max(abs(a - b) for a, b in zip(sent[0], loaded[0]))
    return f"the log-probs with the adapter sent differ from those with its folder by up to {gap:g}" if gap else ""
