"""scripts/convert.py: HF folders from nanorft checkpoints (any dtype, and LoRA adapters alone merged into --base) and
from veRL / Trinity-RFT FSDP rank shards (1-D meshes, and hybrid sharding's 2-D ones); weights that do not fit the
model named, nothing written."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import entry
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import sync
from helpers import free_port, spawn_ranks
from models import load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from convert import convert  # noqa: E402


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_a_nanorft_checkpoint_in_bf16_loads_in_plain_transformers(tmp_path, tiny_model_dir):
    model = load_model(tiny_model_dir)
    sync.publish_hf(model, load_tokenizer(tiny_model_dir), tmp_path / "job", step=2)
    args = [str(tmp_path / "job/global_step_2/actor"), "--out", str(tmp_path / "hf"), "--dtype", "bfloat16"]
    out = entry.run("scripts/convert.py", *args, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert got.dtype == torch.bfloat16
    for name, t in weights(model).items():
        assert torch.equal(weights(got)[name], t.bfloat16()), name
    assert load_tokenizer(str(tmp_path / "hf")).encode("2 + 3") == load_tokenizer(tiny_model_dir).encode("2 + 3")


def save_rank_shards(rank: int, world: int, port: int, model_dir: str, actor: str, replicas: int = 1) -> None:
    """What veRL / Trinity-RFT's FSDP checkpoint writes: each rank's state dict of DTensor shards. replicas > 1:
    hybrid sharding (fsdp_size = world / replicas), FSDP2 on a 2-D (ddp, fsdp) mesh: (Replicate, Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = (
        init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("ddp", "fsdp")) if replicas > 1 else None
    )
    model = load_model(model_dir)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.save(model.state_dict(), Path(actor, f"model_world_size_{world}_rank_{rank}.pt"))
    dist.destroy_process_group()


SHARDS = {"world2": (2, 1), "world3": (3, 1), "hybrid": (4, 2)}  # case -> (world size, replicas)


def save_every_case(rank: int, ports: list[int], model_dir: str, root: str) -> None:
    """Rank `rank` of each case of SHARDS it belongs to (rank < its world size), one case after another, each its
    own gloo group (its own port): what save_rank_shards writes, into root/<case>/global_step_5/actor."""
    for (case, (world, replicas)), port in zip(SHARDS.items(), ports):
        if rank < world:
            save_rank_shards(rank, world, port, model_dir, str(Path(root, case, "global_step_5", "actor")), replicas)


@pytest.fixture(scope="module")
def rank_shards(tmp_path_factory, tiny_model_dir) -> Path:
    """The folder of each case of SHARDS (<case>/global_step_5/actor: the ranks' files, and the model's config and
    tokenizer in huggingface/), written by ONE set of 4 processes (4 process starts, not 2 + 3 + 4)."""
    root = tmp_path_factory.mktemp("shards")
    for case in SHARDS:
        (root / case / "global_step_5" / "actor").mkdir(parents=True)
    ports = [free_port() for _ in SHARDS]
    world = max(w for w, _ in SHARDS.values())
    spawn_ranks(save_every_case, (ports, tiny_model_dir, str(root)), world)
    for case in SHARDS:
        actor = root / case / "global_step_5" / "actor"
        shutil.copytree(tiny_model_dir, actor / "huggingface", ignore=shutil.ignore_patterns("*.safetensors"))
    return root


def merges_exactly_then_names_a_missing_rank(actor, tmp_path, tiny_model_dir, world: int) -> None:
    """The shards in `actor` convert to the tiny model's exact weights; without rank 1's file, a named error."""
    convert(actor, tmp_path / "hf")
    got, want = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")), weights(load_model(tiny_model_dir))
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    (actor / f"model_world_size_{world}_rank_1.pt").unlink()
    with pytest.raises(ValueError, match=rf"world size {world}, but the files of rank\(s\) \[1\] are missing"):
        convert(actor, tmp_path / "hf2")


@pytest.mark.parametrize("world", [2, 3])  # 3: uneven shards (the hidden size is not a multiple of 3)
@pytest.mark.slow
def test_fsdp_rank_shards_merge_into_the_exact_model(tmp_path, tiny_model_dir, world, rank_shards):
    actor = rank_shards / f"world{world}" / "global_step_5" / "actor"
    assert sorted(p.name for p in actor.glob("*.pt")) == [f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]
    merges_exactly_then_names_a_missing_rank(actor, tmp_path, tiny_model_dir, world)


@pytest.mark.slow
def test_hybrid_sharding_2d_mesh_merges_from_the_first_copy(tmp_path, tiny_model_dir, rank_shards):
    """fsdp_size < world size (veRL / Trinity's hybrid sharding): a (ddp, fsdp) mesh of 2 x 2 ranks saved with
    (Replicate, Shard(0)); the first 2 ranks' files make the exact model; the replica's files are not needed.
    (Uneven shards: the 1-D test's world 3; the same concatenation.)"""
    fsdp = 2
    world = 2 * fsdp
    assert SHARDS["hybrid"] == (world, 2)
    actor = rank_shards / "hybrid" / "global_step_5" / "actor"
    for r in range(fsdp, world):  # the second copy
        (actor / f"model_world_size_{world}_rank_{r}.pt").unlink()
    merges_exactly_then_names_a_missing_rank(actor, tmp_path, tiny_model_dir, world)


def run_convert(monkeypatch, capsys, *args) -> tuple[int, str]:
    """`python scripts/convert.py ARGS` in this process (its main(), which the command runs; a process start is ~7 s
    of CPU): the exit code and what it wrote to stderr. The bf16 test and --base from a hub cache (whose location
    huggingface_hub reads once, at import) run it as a process."""
    import convert as script

    monkeypatch.setattr(sys, "argv", ["scripts/convert.py", *map(str, args)])
    capsys.readouterr()
    try:
        script.main()
    except SystemExit as e:
        return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.slow
def test_a_lora_adapter_alone_is_merged_into_the_base(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """A nanorft LoRA checkpoint without merged weights (global_step_N/actor/lora_adapter): without --base a named
    error; with it, the weights lora.merge computes for the engines (W + s B A), loadable by plain transformers."""
    import lora
    from configs.schema import LoRAConfig

    hf = load_model(tiny_model_dir)
    adapter = lora.wrap(hf, LoRAConfig(lora_rank=4, lora_alpha=8), "")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, q in hf.named_parameters():
            if ".lora_B." in name:  # a new adapter has B = 0: the merge would change nothing
                q.copy_(torch.randn(q.shape, generator=g) * 0.05)
    want = lora.merge({k: v.detach().clone() for k, v in hf.state_dict().items()}, adapter.scaling)
    actor = tmp_path / "global_step_3" / "actor"
    adapter.peft.save_pretrained(str(actor / lora.ADAPTER_DIR))
    code, err = run_convert(monkeypatch, capsys, actor, "--out", tmp_path / "hf")
    assert code == 2 and (
        "holds a LoRA adapter alone (lora_adapter/): name the base model it was trained on "
        "(model.model_path) with --base MODEL"
        in err
        and not (tmp_path / "hf").exists()
    ), err[-2000:]
    code, err = run_convert(monkeypatch, capsys, actor, "--out", tmp_path / "hf", "--base", tiny_model_dir)
    assert code == 0, err[-2000:]
    got = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32))
    assert set(got) == set(want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6
    base = weights(load_model(tiny_model_dir))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (got[q] - base[q]).abs().max() > 1e-3  # the adapter did move it
    assert load_tokenizer(str(tmp_path / "hf")).encode("2 + 3") == load_tokenizer(tiny_model_dir).encode("2 + 3")
    # --base as a hub name (from a hub cache, offline): the same weights, and the hub model's tokenizer written too
    snapshot = tmp_path / "hub" / "models--nanorft--tiny-qwen2" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("a" * 40)
    out = subprocess.run(
        [
            sys.executable,
            "scripts/convert.py",
            str(actor),
            "--out",
            str(tmp_path / "from_hub"),
            "--base",
            "nanorft/tiny-qwen2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    hub = weights(AutoModelForCausalLM.from_pretrained(tmp_path / "from_hub", dtype=torch.float32))
    assert max((hub[k] - want[k]).abs().max().item() for k in want) < 1e-6
    assert load_tokenizer(str(tmp_path / "from_hub")).encode("2 + 3") == load_tokenizer(tiny_model_dir).encode("2 + 3")


@pytest.mark.slow
def test_weights_that_do_not_fit_the_model_are_named_and_nothing_is_written(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    """An extra tensor, or a missing one, in the checkpoint: the command names it and exits 2 (load_state_dict with
    strict=False would drop the one and leave the other uninitialised)."""
    import safetensors.torch

    model = load_model(tiny_model_dir)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    for name, broken in (
        ("extra", {**state, "model.layers.0.mlp.extra.weight": torch.zeros(2)}),
        ("missing", {k: v for k, v in state.items() if k != "model.norm.weight"}),
    ):
        actor = tmp_path / name / "global_step_1" / "actor"
        sync.save_hf(model, load_tokenizer(tiny_model_dir), actor / "huggingface")
        safetensors.torch.save_file(broken, actor / "huggingface" / "model.safetensors")
        code, err = run_convert(monkeypatch, capsys, actor, "--out", tmp_path / name / "hf")
        assert code == 2 and not (tmp_path / name / "hf").exists(), err[-2000:]
        if name == "extra":
            assert "1 weight(s) that a qwen2 model has no place for: ['model.layers.0.mlp.extra.weight']" in err
        else:
            assert "the checkpoint has no weights for 1 of the model's tensors: ['model.norm.weight']" in err
