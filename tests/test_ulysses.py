"""ulysses.py: sequence parallelism. On real gloo groups of 2 and 4 CPU ranks, a scorer whose ranks each run 1/P of a
micro-batch's columns gives the log-probs, entropies, critic values and gradients of the unsplit model, packed
(shared prompts) and padded; a model or world it cannot split is refused by name. The whole trainer's updates with it
equal the unsplit run's in tests/test_train.py (test_micro_batches_and_fsdp_ranks_give_the_same_update)."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig

import batching
import scoring
from configs.schema import TrainerConfig
from errors import ConfigError
from helpers import experiences, free_port, spawn_ranks
from models import load_critic, load_model
from ulysses import SeqParallel

# groups of (prompt length, response lengths): long enough that units straddle the ranks' columns
SPEC = [(23, [31, 9, 40]), (11, [27]), (5, [3, 18])]


def micro_batch(share: bool) -> dict:
    """One micro-batch of SPEC's sequences: packed with shared prompts, or one padded row each."""
    batch = batching.step_batch(experiences(SPEC, seed=3), width=40)
    units = batching.pack_units(batch, list(range(len(batch["rewards"]))), share, 10**6)
    return batching.micro_batch(batch, units, share, torch.device("cpu"))


def split_on_rank(rank: int, world: int, port: int, tiny: str, out: str) -> None:
    """Under a gloo group of `world` ranks, one sequence-parallel group of them all: the sharded actor's log-probs and
    entropies and the critic's values of each micro-batch, and the actor's gradients (gathered) of a loss over them,
    beside the unsplit model's, as the largest differences; rank 0 writes them to <out>/<world>.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sp = SeqParallel.make(world)
    diffs = {}
    for share in (True, False):
        mb = micro_batch(share)
        actor = scoring.build_model(tiny, TrainerConfig(), torch.device("cpu"), trainable=True, sp=sp)
        plain = scoring.TokenScorer(load_model(tiny))
        got, want = actor(mb, entropy=True, entropy_grad=True), plain(mb, entropy=True, entropy_grad=True)
        for logp, ent in (got, want):
            (logp.sum() + 0.1 * ent.sum()).backward()  # NOTE: FSDP2's mean over P ranks of P x the group's gradient
        grads = {n: p.grad.full_tensor() for n, p in actor.named_parameters()}
        critic = scoring.build_model(tiny, TrainerConfig(), torch.device("cpu"), trainable=True, critic=True, sp=sp)
        values = critic(mb)[0], scoring.TokenScorer(load_critic(tiny), critic=True)(mb)[0]
        diffs["packed" if share else "padded"] = {
            "logp": (got[0] - want[0]).abs().max().item(),
            "entropy": (got[1] - want[1]).abs().max().item(),
            "values": (values[0] - values[1]).abs().max().item(),
            "grad": max((grads[n] - p.grad).abs().max().item() for n, p in plain.named_parameters()),
            "grad_size": max(p.grad.abs().max().item() for p in plain.parameters()),
            "tokens": int(mb["response_mask"].sum()),
            "width": mb["input_ids"].shape[1],
        }
    if rank == 0:
        Path(out, f"{world}.json").write_text(json.dumps(diffs))
    dist.destroy_process_group()


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_split_the_columns_score_and_differentiate_as_the_unsplit_model(tmp_path, tiny_model_dir, world):
    """P = 2 and 4 ranks (4 is more than the tiny model's 2 KV heads: each is repeated): log-probs, entropies, values
    and every parameter's gradient equal the unsplit model's, on a packed micro-batch whose groups straddle the ranks'
    columns and on padded rows."""
    spawn_ranks(split_on_rank, (world, free_port(), tiny_model_dir, str(tmp_path)), world)
    diffs = json.loads((tmp_path / f"{world}.json").read_text())
    for layout, d in diffs.items():
        assert d["tokens"] > 100 and d["width"] % world, (layout, d)  # a width P does not divide: padded inside
        assert d["logp"] < 1e-5 and d["entropy"] < 1e-5 and d["values"] < 1e-5, (layout, d)
        assert d["grad"] < 1e-5 * max(d["grad_size"], 1.0), (layout, d)


def test_a_head_count_or_world_it_cannot_split_is_refused_by_name(tiny_model_dir):
    """The tiny model has 4 query heads and 2 KV heads: 3 ranks divide neither; 8 ranks do not divide 4 query heads;
    a group larger than the world cannot be made."""
    config = AutoConfig.from_pretrained(tiny_model_dir)
    SeqParallel(None, 4, 0).check(config)  # 2 KV heads, each repeated twice
    for size in (3, 8):
        with pytest.raises(ConfigError, match=r"trainer.ulysses_sequence_parallel_size = \d: qwen2 has 4 attention"):
            SeqParallel(None, size, 0).check(config)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size = 2 must be a positive divisor of"):
            SeqParallel.make(2)
        assert SeqParallel.make(1) is None
    finally:
        dist.destroy_process_group()


@pytest.mark.slow(seconds=20)
def test_a_long_sequence_split_over_two_ranks_keeps_about_half_the_activations(tmp_path):
    """scripts/bench_ulysses.py on the tiny shape, one packed group of 3,840 tokens on 2 gloo ranks: split, each rank
    keeps well under 3/4 of the activations an unsplit rank keeps for the backward pass (the rest of a half is the
    attention mask, which each rank holds whole), with the same loss and gradient norm (docs/LOG.md, 2026-11-30)."""
    import entry

    out = tmp_path / "sp.json"
    args = ("--shape", "tiny", "--tokens", "4096", "--work", str(tmp_path), "--json", str(out))
    run = entry.run_process("scripts/bench_ulysses.py", *args, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["tokens"] == 3840 and record["saved_ratio"] < 0.7, record
    assert record["loss_diff"] < 1e-6 and record["grad_norm_rel_diff"] < 1e-5, record
