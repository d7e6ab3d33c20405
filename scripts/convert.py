"""Convert a checkpoint into a Hugging Face folder that plain `transformers` loads.

    python scripts/convert.py <job>/global_step_40/actor --out hf_bf16 --dtype bfloat16   # a nanorft checkpoint
    python scripts/convert.py <job>/global_step_40/actor --out hf --base Qwen/Qwen2.5-1.5B  # LoRA, adapter alone
    python scripts/convert.py <veRL or Trinity-RFT job>/global_step_40/actor --out hf      # FSDP rank shards

Sources (the kind is read from the folder):
- nanorft: `<actor>/huggingface/`, the checkpoint's full weights (fp32 master weights; a LoRA run's merged ones
  where the step was published): cast to --dtype.
- nanorft, a checkpoint saved with trainer.save_hf_checkpoint last / never: `<actor>/model/`, the trainer's sharded
  weights (torch.distributed.checkpoint in safetensors, any number of ranks), read whole; the config and tokenizer
  are those of the model it was trained on (trainer_state.json records model.model_path; --base overrides it).
- nanorft LoRA, a step that was not published: `<actor>/lora_adapter/` (peft's format) alone; --base names the
  model it was trained on (model.model_path: a folder or a hub name, loaded by models.load_model), which the adapter
  is merged into (lora.merged_model: peft's own merge); its config and tokenizer go with the output.
- veRL / Trinity-RFT FSDP: `<actor>/model_world_size_<W>_rank_<r>.pt`, one file per rank, each a state dict of
  that rank's DTensor shards (or whole tensors). Loaded with `torch.load(weights_only=True)`: only tensors and
  the DTensor classes are allowed, nothing else is unpickled. Each DTensor is put back together along its
  `Shard` dim; a `Replicate` mesh dimension (hybrid sharding, fsdp_size < world size: a (ddp, fsdp) mesh) is
  dropped, so only the files of the first copy's ranks are read, as veRL's model merger does. The config and
  tokenizer come from `<actor>/huggingface/`, as those frameworks save them.
Every weight must find its place in the model and every weight of the model must be there (a tied LM head is stored
once): otherwise the command names them and writes nothing. The output: config (with the dtype), safetensors,
tokenizer, written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import checkpoint  # noqa: E402
import lora  # noqa: E402
from models import load_model, load_tokenizer  # noqa: E402
from sync import save_hf  # noqa: E402

log = logging.getLogger("nanorft.convert")

SHARD = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def rank_files(actor: Path) -> tuple[int, dict[int, Path]]:
    """(world size W, rank -> its shard file); ValueError when the files are of several world sizes."""
    found = {tuple(map(int, m.groups())): p for p in actor.iterdir() if (m := SHARD.fullmatch(p.name))}
    sizes = {w for w, _ in found}
    if len(sizes) != 1:
        raise ValueError(f"{actor}: shard files of several world sizes {sorted(sizes)}")
    (world,) = sizes
    return world, {r: p for (_, r), p in found.items()}


def shard_ranks(key: str, t: DTensor) -> tuple[list[int], Shard | None]:
    """The ranks whose local pieces make up the whole of `t`, in order, and the placement they are cut by (None:
    one rank holds it whole). Mesh dimensions where `t` is Replicate are dropped (coordinate 0): hybrid sharding
    (veRL / Trinity-RFT with fsdp_size < world size) saves a 2-D mesh (ddp, fsdp) with (Replicate, Shard(0)), and
    the first fsdp_size ranks hold one whole copy (veRL's model merger reads the same). One Shard dimension at
    most: tensor parallel or Partial placements are refused by name."""
    index: list[Any] = []
    cut = None
    for placement in t.placements:
        if isinstance(placement, Replicate):
            index.append(0)
        elif isinstance(placement, Shard) and cut is None:
            index.append(slice(None))
            cut = placement
        else:
            raise ValueError(
                f"{key}: placements {tuple(t.placements)} on mesh {t.device_mesh.mesh_dim_names}: only "
                "FSDP layouts (one Shard mesh dimension, the others Replicate) are merged here"
            )
    return t.device_mesh.mesh[tuple(index)].flatten().tolist(), cut


def merge_shards(actor: Path) -> dict[str, torch.Tensor]:
    """One full state dict from the ranks' state dicts of DTensor shards (weights_only loading); only the files of
    the ranks that hold one whole copy are read."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    world, files = rank_files(actor)
    allowed = [DTensor, device_mesh.DeviceMesh, DTensorSpec, TensorMeta, Shard, Replicate]
    # NOTE: unpickling a DeviceMesh outside a process group warns about torch.compile; nothing is compiled here
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    states: dict[int, dict] = {}

    def load(ranks: list[int]) -> None:
        missing = [r for r in ranks if r not in files]
        if missing:
            raise ValueError(f"{actor}: world size {world}, but the files of rank(s) {missing} are missing")
        with torch.serialization.safe_globals(allowed):
            for r in ranks:
                if r not in states:
                    states[r] = torch.load(files[r], map_location="cpu", weights_only=True)

    load([0])
    layout = {k: shard_ranks(k, t) if isinstance(t, DTensor) else ([0], None) for k, t in states[0].items()}
    load(sorted({r for ranks, _ in layout.values() for r in ranks}))
    full = {}
    for key, (ranks, cut) in layout.items():
        parts = [states[r][key] for r in ranks]
        parts = [t.to_local() if isinstance(t, DTensor) else t for t in parts]
        full[key] = torch.cat(parts, dim=cut.dim) if cut is not None else parts[0]
    return full


def read_weights(actor: Path, base: str | None) -> tuple[dict[str, torch.Tensor], str]:
    """(full state dict, the HF folder or hub name whose config and tokenizer go with it) of a checkpoint's actor
    folder."""
    hf, adapter = actor / "huggingface", actor / lora.ADAPTER_DIR
    if any(SHARD.fullmatch(p.name) for p in actor.iterdir()):
        if not (hf / "config.json").is_file():
            raise ValueError(f"{actor}: no huggingface/config.json (the model's config) beside the rank shards")
        return merge_shards(actor), str(hf)
    if (hf / "config.json").is_file():
        if base:
            log.warning("%s has merged weights (huggingface/): --base %s is not used", actor, base)
        state = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in safetensors.torch.load_file(f).items()}
        return state, str(hf)
    if (actor / checkpoint.MODEL_DIR).is_dir() and not adapter.is_dir():
        base = base or trained_on(actor)
        shards = checkpoint.read_shards(actor / checkpoint.MODEL_DIR)
        return {k.removeprefix("model."): v for k, v in shards.items()}, base  # the trainer's scorer wraps `model`
    if adapter.is_dir():
        if not base:
            raise ValueError(
                f"{actor} holds a LoRA adapter alone ({lora.ADAPTER_DIR}/): name the base model it was "
                "trained on (model.model_path) with --base MODEL"
            )
        return lora.merged_model(load_model(base), str(adapter)).state_dict(), base  # a folder or a hub name
    raise ValueError(
        f"{actor}: no weights found (huggingface/, {checkpoint.MODEL_DIR}/, {lora.ADAPTER_DIR}/ or "
        "model_world_size_*_rank_*.pt)"
    )


def trained_on(actor: Path) -> str:
    """The base model a nanorft checkpoint records (trainer_state.json's trained_with: model.model_path), whose config
    and tokenizer go with its weights; ValueError asking for --base where it records none."""
    try:
        meta = json.loads((actor / "trainer_state.json").read_text())
        return meta["trained_with"]["model.model_path"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{actor}/trainer_state.json names no base model: name it with --base MODEL") from None


def convert(actor: str | Path, out: str | Path, dtype: str = "float32", base: str | None = None) -> Path:
    """Write the HF folder `out` from the checkpoint folder `actor` (see the module docstring). ValueError naming
    the weights the model has no place for, or lacks, before anything is written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    actor = Path(actor)
    if not actor.is_dir():
        raise ValueError(f"{actor} is not a folder (a checkpoint's global_step_N/actor)")
    state, hf = read_weights(actor, base)
    target = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):  # no memory for weights that are replaced at once
        model = AutoModelForCausalLM.from_config(config)
    result = model.load_state_dict({k: v.to(target) for k, v in state.items()}, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(
            f"{actor}: {len(result.unexpected_keys)} weight(s) that a {config.model_type} model has no "
            f"place for: {sorted(result.unexpected_keys)[:5]}; nothing was written"
        )
    model.tie_weights()  # a tied LM head is stored once, as the embeddings
    held = model.state_dict()
    missing = [k for k in result.missing_keys if held[k].is_meta]
    if missing:
        raise ValueError(
            f"{actor}: the checkpoint has no weights for {len(missing)} of the model's tensors: "
            f"{missing[:5]}; nothing was written"
        )
    # a checkpoint's huggingface/ may lack the tokenizer (veRL's without one); a hub name's comes from the hub
    tokenizer = load_tokenizer(hf) if not Path(hf).is_dir() or (Path(hf) / "tokenizer_config.json").is_file() else None
    folder = save_hf(model, tokenizer, out)
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("actor", help="a checkpoint's actor folder (global_step_N/actor)")
    p.add_argument("--out", required=True, help="the HF folder to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--base", help="the base model (model.model_path) of a LoRA adapter alone or of model/ shards")
    a = p.parse_args()
    try:
        print(f"wrote {convert(a.actor, a.out, a.dtype, a.base)}")
    except (ValueError, OSError) as e:  # bad input: the message says it all
        print(f"convert: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
