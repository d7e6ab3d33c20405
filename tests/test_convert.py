"""scripts/convert.py: HF folders from nanorft checkpoints (any dtype) and from veRL / Trinity-RFT FSDP rank shards."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

import sync
from models import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from convert import convert  # noqa: E402


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_a_nanorft_checkpoint_in_bf16_loads_in_plain_transformers(tmp_path, tiny_model_dir):
    model = load_model(tiny_model_dir)
    sync.publish_hf(model, load_tokenizer(tiny_model_dir), tmp_path / "job", step=2)
    out = subprocess.run([sys.executable, "scripts/convert.py", str(tmp_path / "job/global_step_2/actor"),
                          "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert got.dtype == torch.bfloat16
    for name, t in weights(model).items():
        assert torch.equal(weights(got)[name], t.bfloat16()), name
    assert load_tokenizer(str(tmp_path / "hf")).encode("2 + 3") == load_tokenizer(tiny_model_dir).encode("2 + 3")


def save_rank_shards(rank: int, world: int, port: int, model_dir: str, actor: str) -> None:
    """What veRL / Trinity-RFT's FSDP checkpoint writes: each rank's state dict of DTensor shards."""
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = load_model(model_dir)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.save(model.state_dict(), Path(actor, f"model_world_size_{world}_rank_{rank}.pt"))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])  # 3: uneven shards (the hidden size is not a multiple of 3)
def test_fsdp_rank_shards_merge_into_the_exact_model(tmp_path, tiny_model_dir, world):
    actor = tmp_path / "global_step_5" / "actor"
    actor.mkdir(parents=True)
    mp.spawn(save_rank_shards, args=(world, free_port(), tiny_model_dir, str(actor)), nprocs=world, join=True)
    shutil.copytree(tiny_model_dir, actor / "huggingface", ignore=shutil.ignore_patterns("*.safetensors"))
    convert(actor, tmp_path / "hf")
    got, want = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), weights(load_model(tiny_model_dir))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    (actor / f"model_world_size_{world}_rank_1.pt").unlink()
    with pytest.raises(ValueError, match=rf"world size {world}, but the files of rank\(s\) \[1\] are missing"):
        convert(actor, tmp_path / "hf2")
