"""Convert a checkpoint into a Hugging Face folder that plain `transformers` loads.

    python scripts/convert.py <job>/global_step_40/actor --out hf_bf16 --dtype bfloat16   # a nanorft checkpoint
    python scripts/convert.py <veRL or Trinity-RFT job>/global_step_40/actor --out hf      # FSDP rank shards

Sources (the kind is read from the folder):
- nanorft: `<actor>/huggingface/`, the checkpoint's full weights (fp32 master weights): cast to --dtype.
- veRL / Trinity-RFT FSDP: `<actor>/model_world_size_<W>_rank_<r>.pt`, one file per rank, each a state dict of
  that rank's DTensor shards (or whole tensors). Loaded with `torch.load(weights_only=True)`: only tensors and
  the DTensor classes are allowed, nothing else is unpickled. Each DTensor is put back together along its
  `Shard` dim (a `Replicate` one is taken from rank 0); the config and tokenizer come from
  `<actor>/huggingface/`, as those frameworks save them.
The output: config (with the dtype), safetensors, tokenizer, written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from models import load_tokenizer  # noqa: E402
from sync import save_hf  # noqa: E402

SHARD = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def rank_files(actor: Path) -> list[Path]:
    """The shard files of all W ranks, in rank order; ValueError naming what is missing or mixed."""
    found = {tuple(map(int, m.groups())): p for p in actor.iterdir() if (m := SHARD.fullmatch(p.name))}
    sizes = {w for w, _ in found}
    if len(sizes) != 1:
        raise ValueError(f"{actor}: shard files of several world sizes {sorted(sizes)}")
    (world,) = sizes
    missing = [r for r in range(world) if (world, r) not in found]
    if missing:
        raise ValueError(f"{actor}: world size {world}, but the files of rank(s) {missing} are missing")
    return [found[(world, r)] for r in range(world)]


def merge_shards(files: list[Path]) -> dict[str, torch.Tensor]:
    """One full state dict from the ranks' state dicts of DTensor shards (weights_only loading)."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    allowed = [DTensor, device_mesh.DeviceMesh, DTensorSpec, TensorMeta, Shard, Replicate]
    # NOTE: unpickling a DeviceMesh outside a process group warns about torch.compile; nothing is compiled here
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    with torch.serialization.safe_globals(allowed):
        states = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    full = {}
    for key, first in states[0].items():
        if not isinstance(first, DTensor):
            full[key] = first
            continue
        (placement,) = first.placements  # FSDP shards over one mesh dimension
        parts = [s[key].to_local() for s in states]
        full[key] = torch.cat(parts, dim=placement.dim) if isinstance(placement, Shard) else parts[0]
    return full


def convert(actor: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the HF folder `out` from the checkpoint folder `actor` (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    actor, hf = Path(actor), Path(actor) / "huggingface"
    if not (hf / "config.json").is_file():
        raise ValueError(f"{actor}: no huggingface/config.json (the model's config) beside the weights")
    if any(SHARD.fullmatch(p.name) for p in actor.iterdir()):
        state = merge_shards(rank_files(actor))
    else:
        state = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in safetensors.torch.load_file(f).items()}
    target = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):  # no memory for weights that are replaced at once
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict({k: v.to(target) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{actor}: the checkpoint has no weights for {missing[:5]}")
    tokenizer = load_tokenizer(str(hf)) if (hf / "tokenizer_config.json").is_file() else None
    folder = save_hf(model, tokenizer, out)
    shutil.rmtree(folder / ".cache", ignore_errors=True)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("actor", help="a checkpoint's actor folder (global_step_N/actor)")
    p.add_argument("--out", required=True, help="the HF folder to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args()
    print(f"wrote {convert(a.actor, a.out, a.dtype)}")


if __name__ == "__main__":
    main()
