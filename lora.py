"""lora.py: LoRA through peft (Hu et al., arXiv:2106.09685): the trainer's actor learns a low-rank update of its
linear layers, W + (alpha / r) B A, instead of W itself; vLLM engines serve that adapter on the base model, the HF
engine and everything else outside the trainer see plain (merged) weights.

    spec = start(cfg, resume)             # (LoRAConfig, saved adapter or ""), or None: full fine-tuning
    adapter = wrap(hf, *spec)             # scoring.build_model: peft's layers injected into the HF model, before
                                          # fully_shard; only A and B require grad (and go into the optimizer)
    weights = full_state(actor)           # every rank: the HF weights with the adapter merged in (rank 0)
    send_model(link, actor, version)      # the same, over the process group (wire.send_weights)
    specs, tensors = weight_stream(actor) # what send_model sends (a vLLM weight-transfer engine's source)
    state = adapter_state(actor)          # every rank: the adapter alone (rank 0), for a checkpoint or the engines
    save_adapter(actor, folder, state)    # peft's format: adapter_config.json + adapter_model.safetensors
    publish(actor, tok, job, step, state, weights)  # rank 0: the step's adapter and / or HF folder, then the pointer
    send_adapter(link, actor, version)    # the adapter alone over the process group (peft's names, its config)
    ref = WithoutAdapter(actor)           # the reference model: the actor with its adapter switched off
    merged_folder(model, saved, tokenizer, folder)   # the HF engine's start when training starts from a saved adapter
    rewind_pointer(actor, tokenizer, job, step, served)  # every rank, at a resume: the pointer at the checkpoint's
                                                         # published weights (published first where missing)

Trinity-RFT's keys (model.lora_configs, one adapter), and where nanorft departs from it:
- vLLM engines (engine_type vllm / vllm_async: sync.serves_adapter) serve the adapter as Trinity's do: they start
  from the base (model.model_path) with enable_lora (vllm_engine.lora_args: max_lora_rank the adapter's, one
  adapter, lora_dtype / fully_sharded_loras / max_cpu_loras as configured), every generate and score request names
  it (LoRARequest lora_configs[0].name, id 1), and each sync moves the adapter alone, loaded in place (vLLM's
  load_inplace): checkpoint sync publishes it as global_step_N/actor/lora_published (peft's format, the engine's
  dtype; `publish`, the pointer moved after it as for an HF folder), the process group sends its tensors with its
  adapter_config.json in the header (`send_adapter`; Trinity turns the process group off with LoRA), which the
  explorer writes as a peft folder of its own (sync.ExplorerSync.adapter_folder). At 1.5B (bf16, r 8, all-linear)
  that is 18.5 MB a sync instead of 3.09 GB (scripts/bench_lora_sync.py). The last step's merged HF folder is still
  published (the next stage, bench mode and users read it). Starting from a saved adapter (lora_configs[0].path),
  the engines load that adapter; from a new one, an adapter of zeros (`zero_adapter`: the base exactly, as the
  trainer's B = 0), so that every request names the adapter from the start.
- The HF engine (engine_type hf) has no adapter serving: it gets merged weights (W + s B A under W's own name, in
  the engine's dtype), by checkpoint or over the process group alike, and cannot tell LoRA is in play; starting
  from a saved adapter it starts from an HF folder of the two merged (`merged_folder`). `name`, `lora_dtype`,
  `fully_sharded_loras` and `max_cpu_loras` have no effect there and are warned about; `base_model_name` always.
- The reference model (a KL term, DPO) is the actor with its adapter switched off (peft's disable_adapter), as veRL's
  ref_in_actor: no second copy of the base weights, and exactly model.model_path since the base weights never change.
  Starting from a saved adapter (lora_configs[0].path), the reference is still the base without it (veRL's too).
- A checkpoint holds the adapter alone (global_step_N/actor/lora_adapter, peft's format, fp32) and its optimizer
  state; a resume rebuilds model.model_path + that adapter. The published weights (the merged HF folder, or the
  served adapter) are there when the step was also published (checkpoint sync, and always the last step), as the
  explorers, bench mode and the next stage need them; a resume from a step without them publishes them first
  (`rewind_pointer`: a restarted explorer loads the pointer's folder), bench mode merges an adapter-only step
  itself, and scripts/convert.py --base turns one into an HF folder.
- A new adapter is peft's (A Kaiming-uniform, B = 0: the first step starts exactly at the base), drawn from a fixed
  seed so that every rank draws the same; no dropout (the first update's old and current log-probs must agree).
- Only plain LoRA on linear layers is trained here (what merge() folds for the HF engine, and what vLLM serves): an
  adapter with DoRA, LoRA biases, fan-in-fan-out layers, embedding layers, the LM head (tied to the embeddings in
  small models) or extra trained modules is refused by name.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import sync
import wire
from configs.schema import LoRAConfig
from errors import ConfigError, DataError

log = logging.getLogger("nanorft.lora")
ADAPTER = "default"  # peft's name of the one adapter (lora_configs[0].name names it in vLLM's requests only)
ADAPTER_DIR = "lora_adapter"  # global_step_N/actor/<this>: a checkpoint's adapter, in peft's format
WHERE = "model.lora_configs[0]"


@dataclasses.dataclass
class Adapter:
    """The LoRA adapter inside a scoring.TokenScorer's HF model (peft's layers replace the adapted nn.Linear in place).
    A plain attribute of the scorer, not a submodule: the PeftModel wraps the same HF model."""

    peft: Any  # the peft.PeftModel: saves the adapter in peft's format; switches it off (the reference model)
    scaling: dict[str, float]  # name of each adapted layer in the HF model -> its alpha / r


def start(cfg: Any, resume: int) -> tuple[LoRAConfig, str] | None:
    """None without model.lora_configs; else its adapter and where its weights come from: a resumed run's checkpoint,
    else lora_configs[0].path ("" = a new adapter). The base is always model.model_path."""
    saved = sync.weights_path(cfg.checkpoint_job_dir, resume).parent / ADAPTER_DIR
    # NOTE: a LoRA checkpoint has no full weights to resume full fine-tuning from, and a full one no adapter
    if resume and saved.is_dir() != bool(cfg.model.lora_configs):
        raise DataError(
            f"checkpoint step {resume} of {cfg.checkpoint_job_dir} was written "
            f"{'with' if saved.is_dir() else 'without'} LoRA and model.lora_configs is "
            f"{'empty' if saved.is_dir() else 'set'}: resume with the config it was written with"
        )
    if not cfg.model.lora_configs:
        return None
    c = cfg.model.lora_configs[0]
    return c, str(saved) if resume else c.path


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def wrap(hf: torch.nn.Module, c: LoRAConfig, saved: str) -> Adapter:
    """`hf` with a LoRA adapter injected in place: the saved one at `saved`, else a new one as `c` says; its own
    weights frozen, only the adapter's A and B trainable. ConfigError / DataError naming what peft cannot do here."""
    base = getattr(hf, "name_or_path", "")
    peft = inject(hf, c, saved)
    scaling = mergeable_scaling(hf, saved)
    adapted = peft.peft_config[ADAPTER]
    if saved and adapted.base_model_name_or_path not in (None, base):
        log.warning(
            "%s was trained on %s; it is put on model.model_path = %s", saved, adapted.base_model_name_or_path, base
        )
    trained = sum(q.numel() for n, q in hf.named_parameters() if is_adapter(n))
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(
            "LoRA (%s): r %s, alpha %s on %d layers; %d of %d weights trained",
            saved or "a new adapter",
            adapted.r,
            adapted.lora_alpha,
            len(scaling),
            trained,
            sum(q.numel() for q in hf.parameters()),
        )
    return Adapter(peft, scaling)


def inject(hf: torch.nn.Module, c: LoRAConfig, saved: str) -> Any:
    """peft's PeftModel around `hf`, its LoRA layers put into `hf` in place: the adapter saved at `saved`, else a new
    one as `c` says. ConfigError (a new adapter) / DataError (a saved one) where peft refuses it."""
    # NOTE: peft is imported here, not at the top: the import costs about a second per process (accelerate and the
    # rest), and only a LoRA trainer needs it
    from peft import LoraConfig, PeftModel, get_peft_model

    with torch.random.fork_rng():
        torch.manual_seed(0)  # NOTE: a new A is drawn alike on every rank (FSDP2 keeps each rank's own shard)
        try:
            if saved:
                return PeftModel.from_pretrained(hf, saved, is_trainable=True)
            config = LoraConfig(
                r=c.lora_rank,
                lora_alpha=c.lora_alpha,
                target_modules=c.target_modules,
                exclude_modules=c.exclude_modules,
                lora_dropout=0.0,
                bias="none",
            )
            return get_peft_model(hf, config)
        except ValueError as e:  # peft: no module matches target_modules, or a layer type it cannot adapt
            raise (
                DataError(f"{WHERE}: the adapter at {saved}: {e}")
                if saved
                else ConfigError(f"{WHERE}.target_modules / exclude_modules: {e}")
            ) from e


def mergeable_scaling(hf: torch.nn.Module, saved: str) -> dict[str, float]:
    """Each LoRA layer's scaling (alpha / r) by module name, once every one is a plain LoRA on a linear layer and
    nothing but LoRA matrices trains: what merge() can fold into the weights the engines get. ConfigError (a new
    adapter) / DataError (the one saved at `saved`) otherwise."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    what, refuse = (f"the adapter at {saved}", DataError) if saved else (f"{WHERE}.target_modules", ConfigError)
    head = hf.get_output_embeddings()
    scaling = {}
    for name, m in hf.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        if (
            not isinstance(m, LoraLinear)
            or m.fan_in_fan_out
            or m is head
            or m.use_dora.get(ADAPTER)
            or m.lora_bias.get(ADAPTER)
        ):
            raise refuse(
                f"{what}: {name} is not a plain LoRA on a linear layer (DoRA, LoRA bias, fan-in-fan-out, an embedding "
                "or the LM head), which nanorft cannot merge for the engines"
            )
        scaling[name] = float(m.scaling[ADAPTER])
    extra = [n for n, q in hf.named_parameters() if q.requires_grad and not is_adapter(n)]
    if extra:
        raise refuse(f"{what}: it trains more than LoRA matrices ({extra[:3]}...)")
    return scaling


# --- what leaves the trainer: merged weights for the engines, the adapter alone for checkpoints


def merge(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """A state dict of the HF model with an adapter, as the plain model's: W + scaling x B A [out,in] under each
    adapted layer's own name (its base_layer's), the other weights as they are, the adapter's dropped."""
    out = {}
    for key, value in state.items():
        if is_adapter(key):
            continue
        module, _, leaf = key.rpartition(".")
        if module.endswith(".base_layer"):
            layer = module.removesuffix(".base_layer")
            if leaf == "weight":
                a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]  # [r,in]
                value = value + scaling[layer] * (b.float() @ a.float()).to(value.dtype)  # [out,r] @ [r,in]
            key = f"{layer}.{leaf}"
        out[key] = value
    return out


def full_state(scorer: Any) -> dict[str, torch.Tensor]:
    """The HF weights the engines load, full, on rank 0 ({} elsewhere; every rank calls it): sync.full_state, with
    a LoRA adapter merged into the layers it adapts."""
    state = sync.full_state(scorer.model)
    adapter = getattr(scorer, "adapter", None)
    return merge(state, adapter.scaling) if adapter is not None and state else state


def send_model(link: wire.WeightLink | None, scorer: Any, version: int, dtype: torch.dtype | None = None) -> int:
    """wire.send_weights of the scorer's weights (`weight_stream`; every rank calls it; link None but on rank 0)."""
    with torch.no_grad():
        return wire.send_weights(link, version, *weight_stream(scorer, dtype))


def weight_stream(scorer: Any, dtype: torch.dtype | None = None) -> tuple[list, Any]:
    """The specs and full tensors (lazily) of the scorer's HF model for the engines (wire.model_stream; every rank
    calls it: gathering is a collective); with a LoRA adapter, the merged weights under the plain model's parameter
    names (gathered whole on rank 0 first, as the checkpoint method does: no specs elsewhere)."""
    if getattr(scorer, "adapter", None) is None:
        return wire.model_stream(scorer.model, dtype)
    state = full_state(scorer)
    names = [n.replace(".base_layer.", ".") for n, _ in scorer.model.named_parameters() if not is_adapter(n)]
    specs = [(n, tuple(state[n].shape), wire.as_dtype(state[n], dtype)) for n in names] if state else []
    return specs, (state[n] for n, _, _ in specs)


def rewind_pointer(scorer: Any, tokenizer: Any, job_dir: str | Path, step: int, served: bool = False) -> None:
    """A trainer resumed from checkpoint `step` points latest_state_dict_iteration.txt at that step's published
    weights (rank 0), for an explorer (re)starting from the pointer: its HF folder, or with engines that serve the
    adapter (`served`: sync.serves_adapter) its published adapter. A checkpoint may lack them (a LoRA one, or one
    saved with trainer.save_hf_checkpoint last / never; the step was checkpointed, not published: process-group sync,
    or checkpoint sync between sync points): they are published first (`publish`: the folder complete before the
    pointer moves). Every rank calls it (the gather is a collective)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    folder = sync.adapter_path(job_dir, step) if served else sync.weights_path(job_dir, step)
    if folder.is_dir():
        if rank0:
            sync.set_latest(job_dir, step)
        return
    adapter = adapter_state(scorer) if served else None
    weights = None if served else full_state(scorer)
    if rank0:
        publish(scorer, tokenizer, job_dir, step, adapter, weights)
        log.info("checkpoint step %d has no published weights: published for the explorer", step)


def publish(
    scorer: Any,
    tokenizer: Any,
    job_dir: str | Path,
    step: int,
    adapter: dict[str, torch.Tensor] | None,
    weights: dict[str, torch.Tensor] | None,
) -> None:
    """Rank 0: the weights of `step` for the explorers: the adapter (`adapter`: adapter_state's, for engines that
    serve it; sync.adapter_path) and / or the full HF folder (`weights`, merged: full_state's), each complete
    (renamed into place) before latest_state_dict_iteration.txt moves to `step`; then the published folders no
    explorer loads any more are deleted (sync.prune_published). A caller wraps it in checkpoint.publishing."""
    if adapter is not None:
        save_adapter(scorer, sync.adapter_path(job_dir, step), adapter)
    if weights is not None:
        sync.save_hf(scorer.model, tokenizer, sync.weights_path(job_dir, step), weights)
    sync.set_latest(job_dir, step)
    sync.prune_published(job_dir, step)


def adapter_state(scorer: Any) -> dict[str, torch.Tensor]:
    """The adapter's A and B, full, on rank 0's CPU ({} elsewhere), named as in the HF model. Every rank calls it:
    gathering a sharded tensor is a collective."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    with torch.no_grad():
        for name, q in scorer.model.named_parameters():
            if is_adapter(name):
                full = q.full_tensor() if isinstance(q, DTensor) else q
                if rank == 0:
                    out[name] = full.detach().to("cpu", copy=True)
    return out


def save_adapter(scorer: Any, folder: Path, state: dict[str, torch.Tensor]) -> None:
    """The adapter as peft saves it (adapter_config.json, adapter_model.safetensors, README.md), loadable by
    peft.PeftModel.from_pretrained on model.model_path; written under a temporary name and renamed into place."""
    tmp, old = (folder.with_name(f".{folder.name}.{what}-{os.getpid()}") for what in ("tmp", "old"))
    shutil.rmtree(tmp, ignore_errors=True)
    # NOTE: peft names a PeftModel's weights base_model.model.<name in the HF model>; it drops the adapter's name
    scorer.adapter.peft.save_pretrained(str(tmp), state_dict={f"base_model.model.{k}": v for k, v in state.items()})
    if folder.exists():  # NOTE: renamed away, not deleted in place (as sync.save_hf): an engine may be reading it
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


# --- the adapter alone to vLLM engines that serve it (sync.serves_adapter): published, or over the process group


def peft_name(name: str) -> str:
    """An adapter weight's name in peft's file (what vLLM reads): base_model.model.<HF name>, the adapter's dropped."""
    return f"base_model.model.{name}".replace(f".{ADAPTER}.", ".")


def send_adapter(link: wire.WeightLink | None, scorer: Any, version: int, dtype: torch.dtype | None = None) -> int:
    """wire.send_weights of the adapter alone (every rank calls it: the gather is a collective; link None but on
    rank 0), in `dtype` (the engine's; None: fp32 as trained), under peft's file names, its adapter_config.json in
    the header: the explorer writes them as peft saves an adapter (sync.ExplorerSync.adapter_folder) and its
    engines load that in place. Returns the bytes sent (0 on ranks > 0)."""
    state = adapter_state(scorer)
    if link is None:
        return 0
    state = {peft_name(k): v for k, v in sync.cast(state, dtype).items()}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in state.items()]
    return wire.send_weights(link, version, specs, state.values(), {"adapter_config": adapter_config(scorer)})


def zero_adapter(model_path: str, c: LoRAConfig, folder: Path) -> Path:
    """A new adapter as `c` says with A = B = 0 (the trainer's new one has B = 0 and a random A: B A = 0 alike, the
    base model exactly), in peft's format at `folder`: what vLLM engines serve before the first sync, so that every
    request names the adapter from the start. NOTE: a request started without one goes on without it after the
    adapter is loaded (explorer.partial_rollout keeps requests in flight across a sync). Built on the meta device
    from model_path's config: no weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    hf.name_or_path = model_path
    peft = inject(hf, c, "")
    state = {peft_name(n): torch.zeros(q.shape) for n, q in hf.named_parameters() if is_adapter(n)}
    return sync.write_adapter(folder, state, adapter_config(SimpleNamespace(model=hf, adapter=Adapter(peft, {}))))


def adapter_config(scorer: Any) -> dict:
    """The adapter's adapter_config.json as peft writes it (PeftConfig.save_pretrained; sets as lists, the base
    model's name filled in as PeftModel.save_pretrained does)."""
    import copy
    import json
    import tempfile

    config = copy.deepcopy(scorer.adapter.peft.peft_config[ADAPTER])
    config.base_model_name_or_path = config.base_model_name_or_path or getattr(scorer.model, "name_or_path", None)
    config.inference_mode = True
    with tempfile.TemporaryDirectory() as tmp:
        config.save_pretrained(tmp)
        return json.loads(Path(tmp, "adapter_config.json").read_text())


class WithoutAdapter(torch.nn.Module):
    """The actor as the reference model: its forward with the adapter switched off, i.e. the base model (its weights
    never change), without a second copy of them (veRL's ref_in_actor)."""

    def __init__(self, actor: torch.nn.Module) -> None:
        super().__init__()
        self.actor = actor

    def forward(self, mb: dict, entropy: bool = False, entropy_grad: bool = False) -> tuple[torch.Tensor, Any]:
        # NOTE: peft flips requires_grad of A and B off and back on around this; FSDP2 takes it up at each unshard
        with self.actor.adapter.peft.disable_adapter():
            return self.actor(mb, entropy, entropy_grad)


def merged_model(model: torch.nn.Module, saved: str) -> torch.nn.Module:
    """`model` (the base) with the adapter saved at `saved` merged in by peft itself (merge_and_unload): a plain
    model again. DataError when `saved` is not an adapter peft can put on this model."""
    from peft import PeftModel  # NOTE: here, as in wrap

    try:
        return PeftModel.from_pretrained(model, saved).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as e:  # peft: no adapter_config.json, modules or shapes that differ
        raise DataError(
            f"the LoRA adapter at {saved} does not fit {getattr(model, 'name_or_path', 'the model')}: "
            f"{' '.join(str(e).split())[:500]}"
        ) from e


def merged_folder(model: torch.nn.Module, saved: str, tokenizer: Any, folder: Path) -> Path:
    """An HF folder of `model` with the saved adapter merged in (`merged_model`): the weights an explorer starts from
    when training starts from a saved adapter (the trainer starts from base + adapter), or a bench of an
    adapter-only checkpoint."""
    return sync.save_hf(merged_model(model, saved), tokenizer, folder)
