"""scoring.py: the FSDP2 wrap units come from transformers' `_no_split_modules`, not from a module layout; checked
on two model families (Qwen2 and Llama shapes, tiny configs built here) under a real 2-rank gloo group on the CPU."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import batching
import scoring
from configs.schema import TrainerConfig
from helpers import experiences, free_port, spawn_ranks

FAMILIES = ("qwen2", "llama")


def tiny_family(kind: str, out: Path) -> str:
    """A 2-layer model of `kind` with random weights, saved as an HF folder (no download: transformers builds it)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )
    config, cls = (
        (Qwen2Config(**shape), Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig(**shape), LlamaForCausalLM)
    )
    torch.manual_seed(0)
    cls(config).save_pretrained(out / kind)
    return str(out / kind)


def wrap_on_rank(rank: int, world: int, port: int, paths: dict[str, str], out: str) -> None:
    """build_model on each family under a 2-rank gloo group: the FSDP2 units (class names), each decoder layer's
    parameters as sharded DTensors, and one forward + backward through the scorer."""
    import os

    from torch.distributed.fsdp import FSDPModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    got = {}
    for kind, path in paths.items():
        model = scoring.build_model(path, TrainerConfig(), torch.device("cpu"), trainable=True)
        units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        shards = {tuple(p.to_local().shape) for layer in layers for p in layer.parameters() if p.dim() == 2}
        batch = batching.step_batch(experiences([(5, [4, 3])], seed=rank), width=4)
        mb = batching.micro_batch(batch, batching.pack_units(batch, [0, 1], True, 10**6), True, torch.device("cpu"))
        logp = model(mb)[0]
        logp.sum().backward()
        grads = [p.grad is not None for layer in layers for p in layer.parameters()]
        got[kind] = {"units": units, "shards": sorted(shards), "finite": bool(logp.isfinite().all()), "grads": grads}
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_wraps_each_decoder_layer_by_no_split_modules_on_two_families(tmp_path):
    """Qwen2 and Llama: each decoder layer (the class `_no_split_modules` names) is its own FSDP2 unit, then the root
    scorer; nothing else. Each rank holds half of each layer's matrices (dim 0 split over 2 ranks), and a forward and
    backward through the sharded scorer gives finite log-probs and a gradient on every layer parameter."""

    paths = {kind: tiny_family(kind, tmp_path) for kind in FAMILIES}
    spawn_ranks(wrap_on_rank, (2, free_port(), paths, str(tmp_path)), 2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind, layer in (("qwen2", "Qwen2DecoderLayer"), ("llama", "LlamaDecoderLayer")):
            units = got[kind]["units"]
            assert sorted(units) == sorted(["FSDPTokenScorer", f"FSDP{layer}", f"FSDP{layer}"]), (kind, units)
            # q_proj [32,32] -> [16,32]; k/v_proj [16,32] -> [8,32]; gate/up [64,32] -> [32,32]; down [32,64] -> [16,64]
            assert got[kind]["shards"] == [[8, 32], [16, 32], [16, 64], [32, 32]], (kind, got[kind]["shards"])
            assert got[kind]["finite"] and all(got[kind]["grads"]), kind


def test_wrap_units_follow_no_split_modules_whatever_the_layout(caplog):
    """GPT-2 keeps its blocks at `transformer.h` (no `model.layers`): its units are still its blocks, in order. A
    model that names no class it holds has no units, and the log says so."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=64, n_positions=32))
    assert scoring.wrap_units(gpt2) == list(gpt2.transformer.h)
    config = Qwen2Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    hf = Qwen2ForCausalLM(config)
    assert [type(m).__name__ for m in scoring.wrap_units(hf)] == ["Qwen2DecoderLayer"]
    hf._no_split_modules = ["NoSuchLayer"]
    with caplog.at_level("WARNING", logger="nanorft.scoring"):
        assert scoring.wrap_units(hf) == []
    assert "names no _no_split_modules that it holds (['NoSuchLayer'])" in caplog.text


@pytest.mark.slow(seconds=30)
def test_on_two_ranks_the_weights_are_read_once_and_every_rank_gets_them_bit_for_bit(tmp_path):
    """scripts/bench_load.py on 2 gloo ranks with a bf16 checkpoint of ~47M parameters (its 50m shape): the shards
    gathered from both ranks are the checkpoint's weights converted to fp32 bit for bit, rotary buffers included; rank
    1, which builds the model on the meta device and receives its shards from rank 0, peaks at under 3/4 of rank 0's
    host memory (when every rank loaded the whole model, both peaked alike: docs/LOG.md, 2026-11-30)."""
    import entry

    out = tmp_path / "load.json"
    run = entry.run_process("scripts/bench_load.py", "--work", str(tmp_path), "--json", str(out), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["same_weights"] and record["weights_mib"] > 80, record  # ~91 MiB of bf16
    first, second = record["per_rank"]
    assert second["peak_mib"] < 0.75 * first["peak_mib"], record
