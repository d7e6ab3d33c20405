"""The trainer: real train.py processes (plain and torchrun with 2 gloo ranks), micro-batching and loss
scaling, checkpoints and exact resume, a GRPO step checked against hand-computed numbers."""

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import entry
import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

import batching
import checkpoint
import configs
import scoring
import sync
import train
from algos import ADVANTAGE_FNS
from algos.utils import AGG_MODES
from buffer import Experience, ExperienceDB
from helpers import (
    STRAIGHT,
    behaviour_logprobs,
    both_config,
    experiences,
    free_port,
    launch,
    mlflow_runs,
    plain_logprobs,
    run_train,
    run_trains,
    sft_config,
    spawn_ranks,
    straight_and_resumed,
    weights,
)
from models import eos_ids, load_model, load_tokenizer
from monitor import read_history
from tasksets import DataError

ROOT = Path(__file__).resolve().parents[1]


# --- pieces


def bare_parts(cfg, device: torch.device, tokenizer, actor) -> train.Parts:
    """Parts of a 4-step run on rank 0 of 1 with `actor` and nothing else built (no optimizer, reference, critic,
    data source, sender or monitor): what publish / engine_dtype / saves read."""
    return train.Parts(
        cfg=cfg,
        rank=0,
        world=1,
        device=device,
        sp=None,
        tokenizer=tokenizer,
        actor=actor,
        optim=None,
        ref=None,
        critic=None,
        critic_optim=None,
        pieces={"advantage_fn": None},
        kl_coef={},
        source=None,
        total=4,
        resume=0,
        temperatures={},
        sender=None,
        monitor=None,
    )


def test_units_and_micro_batches_respect_the_token_budget():
    batch = batching.step_batch(experiences([(10, [5, 7, 3]), (20, [30]), (4, [2, 2])]), width=8)
    assert batch["responses"].shape == (6, 30)  # T = max(width, the longest response)
    rows = list(range(6))
    # shared prompts: a unit per group (its prompt once, then each response); a group that would pass the budget
    # is split, each part repeating the prompt; without sharing, one sequence per unit
    assert batching.pack_units(batch, rows, True, 1000) == [[0, 1, 2], [3], [4, 5]]
    assert [batching.unit_length(batch, u) for u in batching.pack_units(batch, rows, True, 1000)] == [25, 50, 8]
    assert batching.pack_units(batch, rows, True, 20) == [[0, 1], [2], [3], [4, 5]]
    assert batching.pack_units(batch, rows, False, 1000) == [[i] for i in rows]
    assert batching.pack_units(batch, rows, False, 1000, paired=True) == [[0, 1], [2, 3], [4, 5]]
    units = batching.pack_units(batch, rows, True, 1000)
    # largest first; a micro-batch holds at most the budget of packed tokens, a larger unit goes alone
    assert batching.micro_batches(batch, units, 60, None) == [[[3]], [[0, 1, 2], [4, 5]]]
    assert batching.micro_batches(batch, units, 40, None) == [[[3]], [[0, 1, 2], [4, 5]]]
    assert batching.micro_batches(batch, units, 30, None) == [[[3]], [[0, 1, 2]], [[4, 5]]]
    assert batching.micro_batches(batch, units, 10**6, None) == [[[3], [0, 1, 2], [4, 5]]]
    assert batching.micro_batches(batch, units, 0, 3) == [[[3]], [[0, 1, 2]], [[4, 5]]]  # fixed: 3 sequences at most


def plans(spec: list, mini_batch_size: int, world: int, paired: bool = False) -> list[list]:
    """make_batch's plan on each rank of `world` for the groups of `spec` (helpers.experiences), with
    trainer.ppo_mini_batch_size `mini_batch_size`: [rank][mini-batch] -> the rows of that rank's micro-batches."""
    cfg = configs.Config()
    cfg.trainer.max_token_len_per_gpu, cfg.trainer.ppo_mini_batch_size = 16384, mini_batch_size
    cfg.model.max_response_tokens = 8
    exps = experiences(spec)
    out = []
    for rank in range(world):
        p = types.SimpleNamespace(
            cfg=cfg,
            temperatures={},
            share=True,
            source=types.SimpleNamespace(paired=paired),
            data_rank=rank,
            data_world=world,
            sp_size=1,
        )
        out.append([sorted(i for micro in mini for u in micro for i in u) for mini in train.make_batch(p, exps, 1)[1]])
    return out


def test_mini_batches_hold_ppo_mini_batch_size_experiences_over_all_ranks():
    """trainer.ppo_mini_batch_size cuts the whole step batch into mini-batches, each then shared by the ranks: every
    optimizer step sees that many experiences, whatever the ranks and group sizes. (The ranks cut their own shares
    before: on 2 ranks with a group each, mini-batch 1 was the whole batch and 2 was empty; a mini-batch smaller than
    a group left mini-batches empty, and metrics averaged over them.)"""
    two_groups = [(4, [3, 3]), (5, [2, 2])]
    assert plans(two_groups, 2, 1) == [[[0, 1], [2, 3]]]
    one, two = plans(two_groups, 2, 2)  # each mini-batch: 2 experiences, one on each rank
    assert [sorted(a + b) for a, b in zip(one, two)] == [[0, 1], [2, 3]] and all(one + two)
    assert plans(two_groups, 1, 1) == [[[0], [1], [2], [3]]]  # a group larger than a mini-batch is cut
    one, two = plans(two_groups, 1, 2)
    assert [a + b for a, b in zip(one, two)] == [[0], [1], [2], [3]] and one[0] == [0] and two[1] == [1]
    # 3 groups of 4 in mini-batches of 6: 6 and 6 (one group cut), not 8 and 4
    assert plans([(4, [3] * 4), (5, [2] * 4), (6, [1] * 4)], 6, 1) == [[[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 10, 11]]]
    assert plans(two_groups, 3, 1) == [[[0, 1, 2, 3]]]  # 4 / 3 rounds to 1 mini-batch
    # DPO pairs (chosen, rejected) stay whole: 4 pairs in mini-batches of 2 rows, and of 1 (still a pair each)
    pairs = [(4, [3, 3]), (5, [2, 2]), (6, [1, 1]), (7, [1, 1])]
    assert plans(pairs, 2, 1, paired=True) == plans(pairs, 1, 1, paired=True) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    assert batching.mini_batches([[0, 1, 2, 3, 4, 5], [6, 7]], 2, True) == [[[0, 1, 2, 3]], [[4, 5], [6, 7]]]
    assert train.n_mini_batches(8, 1, paired=True) == 4 and train.n_mini_batches(3, 8) == 1


def test_update_metrics_average_over_the_updates_that_ran(monkeypatch):
    """A mini-batch whose rows all left the loss (a group filtered out by std_threshold) makes no update and does not
    dilute the step's metrics: a loss metric of 1.0 on every micro-batch averages to 1.0 (it was 0.5)."""
    batch = batching.step_batch(experiences([(4, [3, 3]), (5, [2, 2])]), width=4)
    batch["response_mask"][2:] = False  # the second group filtered out
    plan = [[[[0, 1]]], [[[2, 3]]]]
    monkeypatch.setattr(train, "reduce_sum", lambda values, device: values)
    monkeypatch.setattr(train, "reduce_max", lambda value, device: value)
    model = torch.nn.Linear(2, 1)
    cfg = configs.Config()
    cfg.trainer.ppo_epochs = 2
    p = types.SimpleNamespace(cfg=cfg, data_world=1, sp_size=1, device=torch.device("cpu"), share=True)
    sums, norms, skipped = train.optimize(
        p,
        model=model,
        optim=torch.optim.AdamW(model.parameters(), lr=1e-3),
        batch=batch,
        plan=plan,
        loss_fn=lambda p, mb: (model.weight.sum(), {"one": 1.0}),
        mode="token-mean",
        lr=1e-3,
        grad_clip=1.0,
        prefix="actor/",
        step=1,
    )
    assert sums == {"actor/one": 1.0} and len(norms) == 2 and skipped == 0  # 2 epochs x the one mini-batch with tokens


def test_stored_advantages_are_laid_out_only_when_an_experience_carries_them():
    """step_batch builds the [B,T] stored_advantages (an explorer-side advantage fn's: step_wise_grpo) only when
    some experience carries advantages: every other algorithm's step allocates and fills nothing for them."""
    exps = experiences([(4, [3, 2])])
    batch = batching.step_batch(exps, width=4)
    assert "stored_advantages" not in batch and batch["has_stored_advantages"].tolist() == [False, False]
    exps[1].advantages = torch.tensor([0.5, -0.5])
    batch = batching.step_batch(exps, width=4)
    assert batch["has_stored_advantages"].tolist() == [False, True]
    assert batch["stored_advantages"].tolist() == [[0.0] * 4, [0.5, -0.5, 0.0, 0.0]]
    # the trainer's advantage phase with either batch: grpo without them, step_wise_grpo reading them back
    for name, rows in (("grpo", experiences([(4, [3, 2])])), ("step_wise_grpo", exps)):
        for x in rows:
            x.advantages = None if name == "grpo" else torch.full((x.response_length,), 0.25)
        batch = batching.step_batch(rows, width=4)
        batch["token_level_rewards"], batch["scores"] = torch.zeros(2, 4), torch.zeros(2)  # shape_rewards' outputs
        batch["sequence_rewards"] = torch.zeros(2)
        fn, cfg = ADVANTAGE_FNS[name]
        p = types.SimpleNamespace(rl=True, pieces={"advantage_fn": (fn, cfg())})
        m = train.compute_advantages(p, batch)
        assert batch["advantages"].tolist() == (
            [[0.0] * 4] * 2 if name == "grpo" else [[0.25] * 3 + [0.0], [0.25] * 2 + [0.0] * 2]
        )
        # veRL's critic/advantages/max|min: over the response tokens, not the padding's zeros
        assert m["critic/advantages/max"] == m["critic/advantages/min"] == (0.0 if name == "grpo" else 0.25)


def test_a_masked_response_keeps_its_reward_in_its_group_and_in_the_logged_score():
    """A response cut at max_tokens and masked (mask_truncated: no action tokens) still counts with its own reward in
    its group's GRPO statistics and in critic/score (the explorer's rollout/reward); only its tokens leave the loss.
    Hand-computed: rewards [-0.1, -0.1 (masked), 1.0, -0.1 (masked)]: mean 0.175, deviations [-0.275, -0.275, 0.825,
    -0.275], unbiased std sqrt((3 x 0.275^2 + 0.825^2) / 3) = 0.55, so A = -0.5 and +1.5 on the unmasked rows.
    (Before, the masked rows counted as reward 0: mean 0.225, and critic/score/mean 0.225.)"""
    exps = experiences([(4, [3, 3, 3, 3])])
    for x, reward, masked in zip(exps, [-0.1, -0.1, 1.0, -0.1], [False, True, False, True]):
        x.reward = reward
        if masked:
            x.action_mask, x.truncate_status = torch.zeros(3, dtype=torch.bool), "response_truncated"
    cfg = configs.Config()
    cfg.algorithm.kl_penalty_fn = "none"  # grpo's preset (configs.derive)
    fn, adv_cfg = ADVANTAGE_FNS["grpo"]
    p = types.SimpleNamespace(rl=True, cfg=cfg, pieces={"advantage_fn": (fn, adv_cfg())})
    batch = batching.step_batch(exps, width=3)
    metrics = train.shape_rewards(p, batch) | train.compute_advantages(p, batch)
    torch.testing.assert_close(batch["advantages"][:, 0], torch.tensor([-0.5, 0.0, 1.5, 0.0]), atol=1e-5, rtol=0)
    assert batch["advantages"][[1, 3]].abs().sum() == 0  # the masked rows train nothing
    assert metrics["critic/score/mean"] == pytest.approx(0.175) and metrics["critic/score/min"] == pytest.approx(-0.1)
    assert metrics["critic/reward_mean"] == pytest.approx(0.175)
    # every response masked, all -0.1: the trainer's score is the explorer's -0.1, not 0; every advantage 0
    for x in exps:
        x.reward, x.action_mask = -0.1, torch.zeros(3, dtype=torch.bool)
    batch = batching.step_batch(exps, width=3)
    metrics = train.shape_rewards(p, batch) | train.compute_advantages(p, batch)
    assert metrics["critic/score/mean"] == pytest.approx(-0.1) and metrics["critic/reward_mean"] == pytest.approx(-0.1)
    assert batch["advantages"].abs().sum() == 0


def test_packed_logprobs_match_one_sequence_at_a_time(tiny_model_dir, monkeypatch):
    """Shared prompts and bin-packed rows, or one padded row per sequence, cut into micro-batches any way: each
    response token's log-prob (at its taskset's temperature) equals a forward pass of that sequence alone;
    padding is 0, the entropy positive; a response without a prompt has no score for its first token."""
    model = scoring.TokenScorer(load_model(tiny_model_dir))
    exps = experiences([(12, [8, 0, 5]), (4, [9]), (30, [1, 6]), (7, [3])]) + [
        Experience(tokens=torch.arange(60, 66), prompt_length=0, reward=0.0)
    ]
    batch = batching.step_batch(exps, width=4, temperatures={"hot": 1.3, "cold": 0.7})
    for share in (True, False):
        for budget in (10**6, 25):
            units = batching.pack_units(batch, list(range(len(exps))), share, budget)
            seen = []
            for micro in batching.micro_batches(batch, units, budget, None):
                mb = batching.micro_batch(batch, micro, share, torch.device("cpu"))
                with torch.no_grad():
                    logp, ent = model(mb, entropy=True)
                for k, b in enumerate(mb["rows"].tolist()):
                    x, seen = exps[b], seen + [b]
                    start = 1 if x.prompt_length == 0 else 0
                    want = plain_logprobs(
                        model.model, x.tokens, max(x.prompt_length, 1), batch["temperature"][b].item()
                    )
                    torch.testing.assert_close(logp[k, start : x.response_length], want, atol=2e-5, rtol=0)
                    assert not logp[k, x.response_length :].any() and not logp[k, :start].any()
                    assert (ent[k, start : x.response_length] > 0).all()
            assert sorted(seen) == list(range(len(exps))), (share, budget)


def test_rollout_and_trainer_logprobs_mean_the_same_thing_at_t_0_6(tiny_model_dir):
    """Issue 14: the HF engine's log-probs are of the full temperature-scaled distribution (top-k / top-p filter
    the sample only), and the trainer scores each experience at the temperature it was sampled at: the first
    token's importance ratio between trainer and rollout is 1 within 1e-4."""
    from engines import EngineHandle, HFEngine

    with HFEngine(tiny_model_dir) as engine:
        handle = EngineHandle(engine, engine.tokenizer, {"temperature": 0.6, "top_p": 0.8, "top_k": 5, "max_tokens": 6})
        exps = handle.chat([{"role": "user", "content": "What is 3 + 4?"}], n=4, seed=3)
    batch = batching.step_batch(exps, width=6)
    scorer = scoring.TokenScorer(load_model(tiny_model_dir))
    units = batching.pack_units(batch, list(range(len(exps))), True, 10**6)
    [micro] = batching.micro_batches(batch, units, 10**6, None)
    mb = batching.micro_batch(batch, micro, True, torch.device("cpu"))
    with torch.no_grad():
        logp, _ = scorer(mb, entropy=False)
    ratios = [(logp[k, 0] - exps[b].logprobs[0]).exp().item() for k, b in enumerate(mb["rows"].tolist())]
    assert len(ratios) == 4 and max(abs(r - 1) for r in ratios) < 1e-4, ratios
    assert min(x.logprobs[0].item() for x in exps) < -1e-3  # not a token the filters made certain


def test_eos_masked_positions_follow_each_requests_min_tokens():
    """batching.eos_masked: info["min_tokens"] (an int: the first positions of the response; a list: the first
    positions of each turn, the runs of action_mask, of a conversation kept as one experience); none recorded (rows
    from a file): nothing masked. In the step batch, [B,T] with padding False."""
    one = Experience(tokens=torch.arange(10), prompt_length=4, info={"min_tokens": 3})
    turns = Experience(
        tokens=torch.arange(14),
        prompt_length=2,
        action_mask=torch.tensor([1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1, 1]).bool(),  # turns at 0..2, 5..8, 10..11
        info={"min_tokens": [2, 3, 5]},
    )
    assert batching.eos_masked(one).tolist() == [True] * 3 + [False] * 3
    assert batching.eos_masked(turns).int().tolist() == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert not batching.eos_masked(Experience(tokens=torch.arange(6), prompt_length=2)).any()
    batch = batching.step_batch([one, turns], width=13)
    assert batch["eos_masked"].int().tolist() == [[1] * 3 + [0] * 10, [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0]]


def test_trainer_and_hf_engine_logprobs_mask_eos_where_min_tokens_did(tiny_model_dir):
    """Issue 47: a request with min_tokens samples from the distribution with every EOS id masked at its first
    min_tokens tokens; the HF engine's log-probs are of that distribution (the plain model's renormalised over the
    other tokens: log p - log(1 - sum of the EOS ids' p), as vLLM's processed log-probs), and the trainer's scorer
    masks the same positions (info["min_tokens"] -> batching.eos_masked): every token's ratio is 1 within 1e-4."""
    from engines import EngineHandle, HFEngine
    from models import eos_ids

    with HFEngine(tiny_model_dir) as engine:
        handle = EngineHandle(engine, engine.tokenizer, {"temperature": 0.8, "min_tokens": 6, "max_tokens": 10})
        exps = handle.chat([{"role": "user", "content": "What is 3 + 4?"}], n=4, seed=3)
        eos = engine.eos_ids
    model = load_model(tiny_model_dir)
    assert eos == eos_ids(load_tokenizer(tiny_model_dir), model.generation_config) and len(eos) == 2
    shift = []  # how far the mask moves the first token's log-prob: the test must see it
    for x in exps:
        assert x.info["min_tokens"] == 6
        with torch.no_grad():
            logp = (model(x.tokens[None]).logits[0, x.prompt_length - 1 : -1].float() / 0.8).log_softmax(-1)  # [R,V]
        want = logp.gather(-1, x.tokens[x.prompt_length :, None])[:, 0]  # [R]
        shift.append(torch.log1p(-logp[0, eos].exp().sum()).abs().item())
        want[:6] -= torch.log1p(-logp[:6, eos].exp().sum(-1))  # EOS masked: the rest renormalised
        torch.testing.assert_close(x.logprobs, want, atol=1e-4, rtol=0)
    assert max(shift) > 1e-3, shift
    batch = batching.step_batch(exps, width=10)
    scorer = scoring.TokenScorer(model, eos_ids=eos)
    units = batching.pack_units(batch, list(range(len(exps))), True, 10**6)
    [micro] = batching.micro_batches(batch, units, 10**6, None)
    mb = batching.micro_batch(batch, micro, True, torch.device("cpu"))
    with torch.no_grad():
        logp, ent = scorer(mb, entropy=True)
    for k, b in enumerate(mb["rows"].tolist()):
        R = exps[b].response_length
        torch.testing.assert_close(logp[k, :R], exps[b].logprobs, atol=1e-4, rtol=0)
        assert torch.isfinite(ent[k, :R]).all() and (ent[k, :R] > 0).all()


@pytest.mark.slow
def test_packed_gradients_match_one_sequence_at_a_time(tiny_model_dir):
    """The backward pass too: the gradient of a weighted sum of log-probs is the same with shared prompts and
    per-segment attention, with one padded row per sequence, and with each sequence run alone through the plain
    model (groups of different prompt lengths, cut into two micro-batches)."""
    exps = experiences([(17, [6, 9, 4, 8]), (23, [7, 5]), (11, [9, 3, 6])])
    batch = batching.step_batch(exps, width=10)
    weights = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))  # [B,T]

    def packed(share: bool) -> dict[str, torch.Tensor]:
        scorer = scoring.TokenScorer(load_model(tiny_model_dir))
        units = batching.pack_units(batch, list(range(len(exps))), share, 10**6)
        for micro in batching.micro_batches(batch, units, 45, None):
            mb = batching.micro_batch(batch, micro, share, torch.device("cpu"))
            (scorer(mb)[0] * weights[mb["rows"]]).sum().backward()
        return {n.removeprefix("model."): q.grad for n, q in scorer.named_parameters()}

    plain = load_model(tiny_model_dir)
    for b, x in enumerate(exps):
        logits = plain(x.tokens[None]).logits[0, x.prompt_length - 1 : -1].float()  # [R,V]
        logp = logits.log_softmax(-1).gather(-1, x.tokens[x.prompt_length :, None])[:, 0]  # [R]
        (logp * weights[b, : x.response_length]).sum().backward()
    for share in (True, False):
        grads = packed(share)
        for name, q in plain.named_parameters():
            torch.testing.assert_close(grads[name], q.grad, atol=1e-5, rtol=1e-4, msg=f"{name} (share={share})")


def test_chunked_vocabulary_projection_gives_the_same_values_and_gradients(tiny_model_dir, monkeypatch):
    """Chunks of the [tokens, V] logits, recomputed in the backward pass, change neither log-probs, entropy nor
    gradients (up to float rounding)."""
    batch = batching.step_batch(experiences([(10, [20, 17, 5]), (6, [25])]), width=25)
    mb = batching.micro_batch(batch, batching.pack_units(batch, [0, 1, 2, 3], True, 10**6), True, torch.device("cpu"))
    grads, outs = [], []
    for elements in (scoring.CHUNK_ELEMENTS, 264 * 7):  # all at once; 7 tokens a chunk (10 chunks)
        monkeypatch.setattr(scoring, "CHUNK_ELEMENTS", elements)
        model = scoring.TokenScorer(load_model(tiny_model_dir))
        logp, ent = model(mb, entropy=True, entropy_grad=True)
        (logp.sum() + 0.1 * ent.sum()).backward()
        outs.append((logp.detach(), ent.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=1e-5, rtol=1e-4)


def test_learning_rate_warmup_and_cosine():
    import configs

    cfg = configs.Config()
    cfg.algorithm.optimizer.lr, cfg.algorithm.optimizer.lr_warmup_steps = 1.0, 4
    assert [train.lr_at(s, cfg.algorithm.optimizer, 10) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    cfg.algorithm.optimizer.lr_scheduler_type, cfg.algorithm.optimizer.min_lr_ratio = "cosine", 0.1
    assert (
        train.lr_at(4, cfg.algorithm.optimizer, 10) == 1.0
        and abs(train.lr_at(10, cfg.algorithm.optimizer, 10) - 0.1) < 1e-12
    )
    assert (
        abs(train.lr_at(7, cfg.algorithm.optimizer, 10) - (0.1 + 0.9 * 0.5)) < 1e-12
    )  # half way: the cosine's midpoint


# --- whole runs: the slow tests' trainer runs, in two launches

# the runs of test_micro_batches_and_fsdp_ranks_give_the_same_update, for each loss_agg_mode: name -> (keys, ranks)
AGG_RUNS = {
    "one": ({"trainer.max_token_len_per_gpu": 100000}, 0),
    "many": ({"trainer.max_token_len_per_gpu": 200}, 0),
    "many_padded": ({"trainer.max_token_len_per_gpu": 200, "trainer.use_remove_padding": False}, 0),
    "ranks2": ({"trainer.max_token_len_per_gpu": 100000}, 2),
    # sequence parallelism: each packed micro-batch's columns split over the 2 ranks (ulysses.py); padded rows too,
    # with activation checkpointing (its recomputed forward runs the all-to-alls again)
    "ulysses2": ({"trainer.max_token_len_per_gpu": 100000, "trainer.ulysses_sequence_parallel_size": 2}, 2),
    "ulysses2_padded": (
        {
            "trainer.max_token_len_per_gpu": 200,
            "trainer.use_remove_padding": False,
            "trainer.ulysses_sequence_parallel_size": 2,
            "trainer.gradient_checkpointing": True,
        },
        2,
    ),
}
LOSS_AND_NORM = ("actor/sft_loss", "actor/grad_norm")  # at each step
# 4 ranks as 2 data-parallel groups of 2 sequence-parallel ranks (token-mean only)
ULYSSES_2X2 = {"trainer.max_token_len_per_gpu": 100000, "trainer.ulysses_sequence_parallel_size": 2}
PPO_EPOCHS = {"buffer.total_steps": 1, "trainer.ppo_epochs": 2, "trainer.ppo_mini_batch_size": 4}
THREE_STEPS = {"buffer.total_steps": 3, "trainer.save_interval": 1}


def from_db(db: Path, algorithm: dict, **over) -> dict:
    """sft_config's keys for a one-step run of `algorithm` on the 4 experiences of grpo_db's DB `db`."""
    queue = {"name": "exp", "storage_type": "queue", "path": f"sqlite:///{db}", "max_read_timeout": 5}
    return {
        "algorithm": algorithm,
        "buffer.train_batch_size": 4,
        "buffer.total_steps": 1,
        "buffer.trainer_input.experience_buffer": queue,
        **over,
    }


def slow_runs(tmp: Path, tiny_model_dir: str) -> dict[str, tuple[dict, int]]:
    """name -> (sft_config's keys, ranks) of each whole trainer run the slow tests below read; the experience DBs they
    read, written into `tmp`."""
    runs = {
        f"{mode}/{name}": ({**over, "algorithm.loss_agg_mode": mode}, ranks)
        for mode in AGG_MODES
        for name, (over, ranks) in AGG_RUNS.items()
    }
    runs["token-mean/recompute"] = (
        {"trainer.max_token_len_per_gpu": 100000, "trainer.gradient_checkpointing": True},
        0,
    )
    runs["token-mean/ulysses2x2"] = ({**ULYSSES_2X2, "algorithm.loss_agg_mode": "token-mean"}, 4)
    runs |= {"ppo_epochs/0": (PPO_EPOCHS, 0), "ppo_epochs/2": (PPO_EPOCHS, 2), "straight": (STRAIGHT, 0)}
    runs["damaged"] = (THREE_STEPS, 0)
    tok = load_tokenizer(tiny_model_dir)
    for name in ("grpo", "step_wise/rows", "step_wise/record"):  # their DBs: tmp/<name>/exp.db
        (tmp / name).mkdir(parents=True)
        grpo_db(tmp / name / "exp.db", tok, explorer="grpo_explorer" if name.startswith("step_wise") else "")
    grpo = {"algorithm_type": "grpo", "repeat_times": 4, "optimizer": {"lr": 1e-2}}
    runs["grpo"] = (from_db(tmp / "grpo" / "exp.db", grpo), 0)
    for case in ("rows", "record"):  # the step-wise trainer's DBs: without and with the explorer's record
        db = tmp / "step_wise" / case / "exp.db"
        if case == "record":
            with ExperienceDB(f"sqlite:///{db}") as d:
                d.check_advantages("the trainer", "explorer grpo_explorer")  # what explore.set_up stores
        runs[f"step_wise/{case}"] = (
            from_db(db, {"algorithm_type": "multi_step_grpo", "repeat_times": 4}, name=case),
            0,
        )
    empty = {"name": "exp", "storage_type": "queue", "max_read_timeout": 7}
    grpo = {"algorithm_type": "grpo", "repeat_times": 2}
    runs["no_experiences"] = ({"algorithm": grpo, "buffer.trainer_input.experience_buffer": empty}, 0)
    return runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (job directory, exit code and stderr) of each of slow_runs: those of one rank in ONE train.py process,
    those of two ranks in ONE torchrun launch (helpers.run_trains: each run sets up and closes down as its own process
    would; ~0.7 s a run instead of a process start's ~5 s, or a torchrun launch's ~15 s)."""
    tmp = tmp_path_factory.mktemp("trained")
    runs, out = slow_runs(tmp, tiny_model_dir), {}
    for ranks in (0, 2, 4):
        names = [n for n, (_, r) in runs.items() if r == ranks]
        configs = [sft_config(tmp / n, tiny_model_dir, **runs[n][0]) for n in names]
        for name, result in zip(names, run_trains(configs, ranks=ranks)):
            out[name] = tmp / name / "ck" / "p" / runs[name][0].get("name", "t"), result
    return out


def finished(trained: dict, name: str) -> Path:
    """The job directory of the run `name` of `trained`, which ended well."""
    job, out = trained[name]
    assert out.returncode == 0, (name, out.stderr[-3000:])
    return job


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.slow
def test_micro_batches_and_fsdp_ranks_give_the_same_update(trained, tiny_model_dir, mode):
    """Gradient accumulation is scaled right for every loss_agg_mode: one micro-batch, many small micro-batches
    (packed, or padded rows without packing), two FSDP2 ranks, activation checkpointing and sequence parallelism (each
    micro-batch's columns split over 2 ranks, packed and padded; and 4 ranks as 2 groups of 2) all end at the same
    weights (up to float rounding, far below the size of the update); those on several ranks with the same losses and
    gradient norms."""
    token_mean = ["token-mean/recompute", "token-mean/ulysses2x2"] if mode == "token-mean" else []
    runs = [f"{mode}/{name}" for name in AGG_RUNS] + token_mean
    final = {name: weights(finished(trained, name), 2) for name in runs}
    two = trained[f"{mode}/ranks2"][0] / "global_step_2" / "actor"
    assert (two / "rng_state_rank1.safetensors").is_file()  # it did run on 2 ranks (run_trains under torchrun)
    if token_mean:
        four = trained["token-mean/ulysses2x2"][0] / "global_step_2" / "actor"
        assert (four / "rng_state_rank3.safetensors").is_file()
    one = final[f"{mode}/one"]
    start = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = max((one[k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # two AdamW steps at lr 1e-3 move the weights by about 2e-3
    for other in set(runs) - {f"{mode}/one"}:
        diff = max((final[other][k] - one[k]).abs().max().item() for k in start)
        assert diff < moved / 100, (other, diff, moved)
    history = read_history(trained[f"{mode}/many"][0] / "monitor" / "trainer.jsonl")
    assert [r["step"] for r in history] == [1, 2] and history[1]["actor/sft_loss"] < history[0]["actor/sft_loss"]
    # NOTE: AdamW's update hardly changes when every gradient is scaled alike: the gradient norms show the scale
    seen = {
        name: [r[k] for r in read_history(trained[name][0] / "monitor" / "trainer.jsonl") for k in LOSS_AND_NORM]
        for name in runs
        if "ulysses" in name or name.endswith("/one") or name.endswith("/ranks2")
    }
    for name, steps in seen.items():
        assert steps == pytest.approx(seen[f"{mode}/one"], rel=1e-4, abs=1e-5), (name, seen)


@pytest.mark.slow
def test_ppo_epochs_over_mini_batches_give_the_same_update_on_one_and_two_ranks(trained, tiny_model_dir):
    """ppo_epochs 2 over 2 mini-batches of 4 of the step's 8 experiences: a plain process and torchrun with two FSDP2
    ranks make the same 4 AdamW steps on the same mini-batches, and end at the same weights (each rank used to cut its
    own share into mini-batches: 2 ranks trained other mini-batches than 1)."""
    final = {}
    for ranks in (0, 2):
        job = finished(trained, f"ppo_epochs/{ranks}")
        final[ranks] = weights(job, 1)
        optimizer = checkpoint.read_optimizer(job / "global_step_1" / "actor")
        assert {v.item() for k, v in optimizer.items() if k.endswith("/step")} == {4.0}
    start = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = max((final[0][k] - start[k]).abs().max().item() for k in start)
    diff = max((final[2][k] - final[0][k]).abs().max().item() for k in start)
    assert moved > 1e-3 and diff < moved / 100, (diff, moved)


def save_or_resume_on_rank(rank: int, world: int, port: int, tiny: str, job: str, out: str) -> None:
    """Under a gloo group of `world` ranks: with no checkpoint in `job`, one AdamW step of the tiny model on random
    gradients, saved as checkpoint step 1; else that checkpoint resumed as train.py does (the tiny model, then the
    checkpoint's model/ shards and optimizer states), its whole optimizer states and weights written to
    <out>/<world>.st."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    resume = checkpoint.latest_checkpoint(job)
    model = scoring.build_model(tiny, configs.Config().trainer, torch.device("cpu"), trainable=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if resume:
        checkpoint.load_model_shards(model, sync.weights_path(job, 1).parent)
        checkpoint.load_checkpoint(model, optim, job, 1, rank)
        osd = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        weights = sync.full_state(model.model)
        if rank == 0:
            state = {f"{fqn}/{k}": v for fqn, s in osd["state"].items() for k, v in s.items()}
            whole = state | {f"weights/{k}": v.clone() for k, v in weights.items()}  # NOTE: the tied head, apart
            safetensors.torch.save_file(whole, f"{out}/{world}.st")
    else:
        torch.manual_seed(0)
        for q in model.parameters():
            q.grad = torch.randn_like(q)  # a DTensor: each rank's shard of it
        optim.step()
        checkpoint.save_checkpoint(model, optim, load_tokenizer(tiny), job, 1, rank, None)
    dist.destroy_process_group()


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("saved_on", [1, 2])
def test_weights_and_optimizer_states_saved_on_some_ranks_resume_on_any_number_bit_for_bit(
    tmp_path, tiny_model_dir, saved_on
):
    """The weights and the optimizer's states are saved sharded (actor/model/, actor/optimizer/: one file of shards
    per rank, no gather), and a checkpoint saved on 1 or 2 ranks resumes on 1 and on 2: each resumed trainer holds
    exactly the states saved (checkpoint.read_optimizer reads them whole) and the weights of the HF folder saved
    beside them, bit for bit; so do the states of older code, whole in optimizer.safetensors."""
    job, port = tmp_path / "job", free_port()
    spawn_ranks(save_or_resume_on_rank, (saved_on, port, tiny_model_dir, str(job), str(tmp_path)), saved_on)
    actor = job / "global_step_1" / "actor"
    for kind in ("model", "optimizer"):
        files = sorted(p.name for p in (actor / kind).iterdir())
        assert files == [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in range(1, saved_on + 1)]
    saved = checkpoint.read_optimizer(actor)
    weights = safetensors.torch.load_file(actor / "huggingface" / "model.safetensors")
    assert {v.item() for k, v in saved.items() if k.endswith("/step")} == {1.0}
    assert any(v.abs().sum() > 0 for k, v in saved.items() if k.endswith("/exp_avg"))
    for world in (1, 2, "older"):  # "older": the states whole in optimizer.safetensors, as older code saved them
        if world == "older":
            safetensors.torch.save_file(saved, actor / "optimizer.safetensors")
            shutil.rmtree(actor / "optimizer")
            checkpoint.write_manifest(actor.parent)
        ranks = 2 if world == "older" else world
        spawn_ranks(save_or_resume_on_rank, (ranks, free_port(), tiny_model_dir, str(job), str(tmp_path)), ranks)
        got = safetensors.torch.load_file(tmp_path / f"{ranks}.st")
        assert {k for k in got if not k.startswith("weights/")} == set(saved), world
        assert all(torch.equal(got[k], v) for k, v in saved.items()), world
        assert all(torch.equal(got[f"weights/{k}"], v) for k, v in weights.items()), world


@pytest.mark.slow
def test_checkpoint_layout_and_plain_transformers_load(trained, tiny_model_dir):
    job = finished(trained, "token-mean/one")  # 2 steps, a checkpoint each (sft_config's save_interval 1)
    assert (job / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (job / "latest_state_dict_iteration.txt").read_text().strip() == "2"
    assert json.loads((job / "trainer_meta.json").read_text())["latest_iteration"] == 2
    for step in (1, 2):
        actor = job / f"global_step_{step}" / "actor"
        assert {p.name for p in actor.iterdir()} == {
            "huggingface",
            "model",
            "optimizer",
            "trainer_state.json",
            "rng_state_rank0.safetensors",
        }
        assert [p.name for p in (actor / "optimizer").iterdir()] == ["shard-00001-model-00001-of-00001.safetensors"]
    assert not list(job.rglob(".*tmp*"))  # no temporary leftovers
    hf = job / "global_step_2" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.tie_word_embeddings == load_model(tiny_model_dir).config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = load_tokenizer(str(hf))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    optim = checkpoint.read_optimizer(job / "global_step_2" / "actor")
    assert any(k.endswith("/exp_avg_sq") for k in optim)


def test_published_folders_are_in_the_engine_dtype_and_a_checkpoints_stays_fp32(tmp_path, tiny_model_dir, monkeypatch):
    """A trainer on GPU for a bf16 engine publishes bf16 folders (half the bytes of its fp32 master weights); a
    folder that is also a checkpoint's weights stays fp32, so a resume continues from the exact weights."""
    cfg = configs.Config()
    cfg.checkpoint_job_dir, cfg.trainer.save_interval, cfg.explorer.rollout_model.dtype = str(tmp_path), 2, "bfloat16"
    cfg.buffer.batch_size, cfg.algorithm.repeat_times, cfg.buffer.train_batch_size = 16, 8, 128  # publishes 1..3
    model = load_model(tiny_model_dir)
    monkeypatch.setattr(train.sync, "full_state", lambda m: dict(m.state_dict()))  # no process group here
    cfg.synchronizer.sync_method = "checkpoint"
    actor = types.SimpleNamespace(model=model)
    p = bare_parts(cfg, torch.device("cuda"), load_tokenizer(tiny_model_dir), actor)
    assert p.engine_dtype == torch.bfloat16 and [s for s in range(1, 5) if p.saves(s)] == [2, 4]
    for step in (1, 2):
        assert train.publish(p, step) is not None
    job = Path(cfg.checkpoint_job_dir)
    bf16, fp32 = (
        safetensors.torch.load_file(job / f"global_step_{s}/actor/huggingface/model.safetensors") for s in (1, 2)
    )
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16} and {t.dtype for t in fp32.values()} == {torch.float32}
    for name, t in fp32.items():
        assert torch.equal(t, model.state_dict()[name]) and torch.equal(bf16[name], t.bfloat16()), name
    loaded = load_model(str(job / "global_step_1/actor/huggingface"))  # an engine loads it as it would any folder
    embed = "model.embed_tokens.weight"
    assert torch.equal(loaded.get_input_embeddings().weight, bf16[embed].float())
    cpu = dataclasses.replace(p, device=torch.device("cpu"))  # the HF engine on CPU runs in fp32
    assert cpu.engine_dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("hf", ["always", "never"])
def test_killed_trainer_resumes_exactly(tmp_path, tiny_model_dir, trained, hf):
    """SIGKILL after the step-2 checkpoint, restart: the final weights equal an uninterrupted run's bitwise
    (model, optimizer, data position and RNG all restored). With trainer.save_hf_checkpoint never, step 2's
    checkpoint has no HF folder: the restart reads its model/ shards (and publishes the folder for explorers), and
    scripts/convert.py makes an HF folder of those shards alone that equals the straight run's step-2 weights."""
    over = {"trainer.save_hf_checkpoint": hf}
    straight, resumed, stderr = straight_and_resumed(tmp_path, tiny_model_dir, finished(trained, "straight"), **over)
    a, b = weights(straight, 4), weights(resumed, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    two = resumed / "global_step_2" / "actor"
    published = "checkpoint step 2 has no published weights: published for the explorer" in stderr
    assert published == (hf == "never") and (two / "huggingface").is_dir(), stderr[-3000:]
    if hf == "never":
        manifest = json.loads((two.parent / "manifest.json").read_text())
        assert not [k for k in manifest if "huggingface" in k] and any(k.startswith("actor/model/") for k in manifest)
        alone = tmp_path / "shards_alone"
        shutil.copytree(two / "model", alone / "model")
        shutil.copy(two / "trainer_state.json", alone)
        out = entry.run("scripts/convert.py", str(alone), "--out", str(tmp_path / "converted"))
        assert out.returncode == 0, out.stderr[-3000:]
        got, want = safetensors.torch.load_file(tmp_path / "converted" / "model.safetensors"), weights(straight, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def grpo_db(path: Path, tokenizer, explorer: str = "") -> None:
    """One task, four responses: "5" twice with reward 1, "7" twice with reward 0 (one group), written by
    `explorer`."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    exps = []
    for run_id, (answer, reward) in enumerate([("5", 1.0), ("7", 0.0), ("5", 1.0), ("7", 0.0)]):
        resp = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        exps.append(
            Experience(
                tokens=torch.tensor(prompt + resp),
                prompt_length=len(prompt),
                reward=reward,
                logprobs=torch.zeros(len(resp)),
                group_id="g0",
                run_id=run_id,
                task_id="t0",
                explorer=explorer,
            )
        )
    with ExperienceDB(f"sqlite:///{path}") as db:
        db.write(exps)


def response_logprob(model, tokenizer, answer: str) -> float:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    resp = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return plain_logprobs(model, prompt + resp, len(prompt)).sum().item()


@pytest.mark.slow
def test_grpo_step_hand_checked_and_moves_probability_toward_reward(trained, tiny_model_dir):
    """One GRPO step on grpo_db's group (slow_runs' "grpo": lr 1e-2)."""
    tok = load_tokenizer(tiny_model_dir)
    job = finished(trained, "grpo")
    db = job.parents[2] / "exp.db"  # slow_runs wrote it next to the run's config
    [m] = read_history(job / "monitor" / "trainer.jsonl")
    # rewards [1, 0, 1, 0]: mean 0.5, unbiased std 0.5774 -> advantages +-0.866
    assert abs(m["critic/advantages/max"] - 0.8660) < 1e-3 and abs(m["critic/advantages/min"] + 0.8660) < 1e-3
    assert m["critic/score/mean"] == 0.5
    # one update on fresh old log-probs: ratio 1, nothing clipped, no KL to the reference yet
    assert m["actor/pg_clipfrac"] == 0.0 and abs(m["actor/ppo_kl"]) < 1e-6 and abs(m["actor/kl_loss"]) < 1e-6
    # equal lengths, zero-mean advantages: the token-mean loss is 0 at ratio 1 (its gradient is not)
    assert abs(m["actor/pg_loss"]) < 1e-6 and m["actor/grad_norm"] > 0
    before, after = load_model(tiny_model_dir), load_model(str(job / "global_step_1" / "actor" / "huggingface"))
    # the rewarded answer gains on the unrewarded one (Adam's first step is sign-like, so both
    # sequences may move together through their shared end token; the gap is what GRPO changes)
    gap = [response_logprob(m, tok, "5") - response_logprob(m, tok, "7") for m in (before, after)]
    assert gap[1] > gap[0] + 0.5, gap
    assert response_logprob(after, tok, "5") > response_logprob(before, tok, "5")
    with ExperienceDB(f"sqlite:///{db}") as d:
        assert d.counts()["pending"] == 0


@pytest.mark.slow
def test_each_step_records_what_it_trained_each_experience_on(tmp_path, tiny_model_dir):
    """The DB's trained table (the studio viewer's): one GRPO step on grpo_db's group gives each experience its
    advantages per response token, +-0.866 (rewards [1, 0, 1, 0]: mean 0.5, unbiased std 0.5774); with one update the
    step computes no old log-probs and records none; with ppo_epochs 2 it records them, the step's starting weights'
    (a plain forward pass of the base model, by hand: helpers.behaviour_logprobs)."""
    tok = load_tokenizer(tiny_model_dir)
    grpo = {"algorithm_type": "grpo", "repeat_times": 4}
    runs = {"one": {}, "epochs": {"trainer.ppo_epochs": 2}}
    for name in runs:
        (tmp_path / name).mkdir()
        grpo_db(tmp_path / name / "exp.db", tok)
    outs = run_trains(
        [
            sft_config(tmp_path / n, tiny_model_dir, **from_db(tmp_path / n / "exp.db", grpo, **o))
            for n, o in runs.items()
        ]
    )
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    base, eos = load_model(tiny_model_dir), eos_ids(tok, load_model(tiny_model_dir).generation_config)
    for name in runs:
        with ExperienceDB(f"sqlite:///{tmp_path / name / 'exp.db'}") as d:
            rows = d.query("SELECT exp_id, step, tensors FROM trained ORDER BY exp_id")
            exps = d.get([r[0] for r in rows])
        assert [(r[0], r[1]) for r in rows] == [(1, 1), (2, 1), (3, 1), (4, 1)], name
        for (_, _, blob), x in zip(rows, exps):
            got = safetensors.torch.load(bytes(blob))
            sign = 1.0 if x.reward == 1.0 else -1.0
            assert torch.allclose(got["advantages"], torch.full((x.response_length,), sign * 0.8660), atol=1e-3)
            if name == "one":
                assert "logprobs" not in got
            else:
                assert torch.allclose(got["logprobs"], behaviour_logprobs(base, x, eos), atol=1e-4), name


def masked_db(path: Path, tokenizer) -> None:
    """Two groups of four responses to grpo_db's prompt, the first claimed first: g0 rewards [-0.1, -0.1, 1.0, -0.1]
    with its 2nd and 4th responses cut at max_tokens and masked (no action tokens, as a workflow's mask_truncated
    writes them), g1 four masked responses of reward -0.1 (nothing in it to train)."""
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    resp = tokenizer.encode("5", add_special_tokens=False) + [tokenizer.eos_token_id]
    groups = {"g0": ([-0.1, -0.1, 1.0, -0.1], [False, True, False, True]), "g1": ([-0.1] * 4, [True] * 4)}
    with ExperienceDB(f"sqlite:///{path}") as db:
        for group, (rewards, masked) in groups.items():
            db.write(
                [
                    Experience(
                        tokens=torch.tensor(prompt + resp),
                        prompt_length=len(prompt),
                        reward=reward,
                        logprobs=torch.zeros(len(resp)),
                        action_mask=torch.full((len(resp),), not cut),
                        truncate_status="response_truncated" if cut else None,
                        group_id=group,
                        run_id=run_id,
                        task_id=group,
                    )
                    for run_id, (reward, cut) in enumerate(zip(rewards, masked))
                ]
            )


@pytest.mark.slow
def test_a_step_with_nothing_to_train_is_a_named_skipped_update_with_the_explorers_reward(tmp_path, tiny_model_dir):
    """Step 1 trains its two unmasked responses, with the masked ones' rewards in the group (advantages -0.5 and 1.5:
    test_a_masked_response_keeps_its_reward_in_its_group_and_in_the_logged_score); step 2 has only masked responses:
    a warning line names the skipped update and why, actor/update_skipped 1 and the running count actor/skipped_steps
    1, no loss or gradient norm, the explorer's reward -0.1 as critic/score/mean, and the weights stay as they were."""
    masked_db(tmp_path / "exp.db", load_tokenizer(tiny_model_dir))
    grpo = {"algorithm_type": "grpo", "repeat_times": 4, "optimizer": {"lr": 1e-2}}
    config = sft_config(tmp_path, tiny_model_dir, **from_db(tmp_path / "exp.db", grpo, **{"buffer.total_steps": 2}))
    [out] = run_trains([config])
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "t"
    one, two = read_history(job / "monitor" / "trainer.jsonl")
    assert (one["actor/update_skipped"], one["actor/skipped_steps"]) == (0, 0) and one["actor/grad_norm"] > 0
    assert one["critic/advantages/max"] == pytest.approx(1.5, abs=1e-4)
    assert one["critic/advantages/min"] == pytest.approx(-0.5, abs=1e-4)
    assert one["critic/score/mean"] == pytest.approx(0.175) and "actor/pg_loss" in one
    assert (two["actor/update_skipped"], two["actor/skipped_steps"]) == (1, 1)
    assert two["critic/score/mean"] == pytest.approx(-0.1) and two["critic/reward_mean"] == pytest.approx(-0.1)
    assert not {"actor/pg_loss", "actor/entropy_loss", "actor/grad_norm"} & set(two), sorted(two)
    assert (
        "train step 2: actor update skipped (actor/skipped_steps 1): none of its 4 experiences has a token to train: "
        "4 cut at the token limit (model.max_response_tokens 64) and masked" in out.stderr
    ), out.stderr[-3000:]
    assert "train step 1: actor update skipped" not in out.stderr
    a, b = weights(job, 1), weights(job, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- ppo_epochs with mini-batches, the reward KL penalty and DAPO's overlong shaping: one mode-both run, hand-checked

KL_START, KL_TARGET, KL_HORIZON = 0.5, 0.01, 8  # the penalty's adaptive beta
OVERLONG_BUFFER, OVERLONG_FACTOR, MAX_RESPONSE = 6, 0.5, 12  # max_response_tokens: both_config's


@pytest.fixture(scope="module")
def settings_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A GRPO run in mode both through the launcher (3 steps of 2 tasks x 2 responses, on-policy) with what no other
    run sets: ppo_epochs 2 over mini-batches of 2 experiences (4 optimizer steps a train step), a reward KL penalty (k3,
    adaptive beta) and DAPO's overlong shaping; a checkpoint every step. Its job directory."""
    tmp = tmp_path_factory.mktemp("settings")
    config = both_config(
        tmp,
        tiny_model_dir,
        **{
            "trainer.ppo_epochs": 2,
            "trainer.ppo_mini_batch_size": 2,
            "trainer.save_interval": 1,
            "algorithm.kl_penalty_fn": "k3",
            "algorithm.kl_penalty_fn_args": {
                "kl_coef": KL_START,
                "adaptive": True,
                "target_kl": KL_TARGET,
                "horizon": KL_HORIZON,
            },
            "algorithm.overlong_reward": {
                "enable": True,
                "buffer_len": OVERLONG_BUFFER,
                "penalty_factor": OVERLONG_FACTOR,
            },
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    out = launch(config)
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp / "ck" / "p" / "run"


@pytest.fixture(scope="module")
def step_logprobs(settings_run, tiny_model_dir) -> dict[int, list[tuple[Experience, torch.Tensor, torch.Tensor]]]:
    """train step -> (experience, log-probs under the weights the step started from, under the reference model) of
    each experience the step claimed in the DB; plain forward passes, one sequence at a time, not the trainer's code
    (of the distribution the engine sampled from: EOS masked where min_tokens masked it, as the trainer's are)."""
    base = load_model(tiny_model_dir)  # the reference model, and the actor of step 1
    eos = eos_ids(load_tokenizer(tiny_model_dir), base.generation_config)
    out = {}
    with ExperienceDB(f"sqlite:///{settings_run / 'buffer' / 'exp.db'}") as d:
        for step in (1, 2, 3):
            ids = [i for (i,) in d.query("SELECT exp_id FROM claims WHERE step = ? ORDER BY exp_id", (step,))]
            start = base if step == 1 else load_model(str(sync.weights_path(settings_run, step - 1)))
            out[step] = [(x, behaviour_logprobs(start, x, eos), behaviour_logprobs(base, x, eos)) for x in d.get(ids)]
    return out


@pytest.mark.slow
def test_ppo_epochs_over_mini_batches_step_from_the_old_logprobs_of_the_steps_start(
    settings_run, step_logprobs, tiny_model_dir
):
    """ppo_epochs 2 x 2 mini-batches: 4 AdamW steps per train step (the optimizer state's step counter), every one on
    the old log-probs of the step's starting weights (what the old-log-prob pass computes before the update: every
    other test makes one update per step, where that pass is skipped), while the weights move within the step."""
    log_text = (settings_run / "log" / "trainer.log").read_text()
    assert "4 optimizer step(s) per train step (ppo_epochs 2 x 2 mini-batch(es))" in log_text
    history = read_history(settings_run / "monitor" / "trainer.jsonl")
    assert [m["step"] for m in history] == [1, 2, 3]
    before = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    for m in history:
        step = m["step"]
        optimizer = checkpoint.read_optimizer(settings_run / f"global_step_{step}" / "actor")
        counters = {v.item() for k, v in optimizer.items() if k.endswith("/step")}
        assert counters == {4.0 * step}, counters  # 2 epochs x 2 mini-batches a step, none skipped
        assert m["actor/skipped_steps"] == 0 and math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0
        after = weights(settings_run, step)
        assert max((after[k] - before[k]).abs().max().item() for k in before) > 1e-3  # 4 AdamW steps at lr 1e-3
        before = after
        # on-policy: the rollout log-probs are those of the step's starting weights (a plain forward pass) ...
        gap = max((start - x.logprobs).abs().max().item() for x, start, _ in step_logprobs[step])
        assert gap < 1e-4, gap
        # ... and the old log-probs every update used are the rollout ones: mean |old - rollout| over the 4 updates
        assert m["rollout_corr/abs_diff"] < 1e-5, m["rollout_corr/abs_diff"]
        # the later updates of the step saw weights the earlier ones moved: their ratios are not 1
        assert abs(m["actor/ppo_kl"]) > 1e-4 and m["actor/pg_clipfrac"] > 0


@pytest.mark.slow
def test_kl_penalty_and_overlong_shaping_hand_checked_against_the_db(settings_run, step_logprobs):
    """Each step's shaped rewards recomputed by hand from the experiences it claimed in the DB (rewards, response
    lengths) and independent log-probs under its starting weights and the reference model: DAPO's overlong term
    0.5 x min(0, (12 - 6 - L) / 6), minus beta x sum_t k3 with k3 = exp(ref - logp) - 1 - (ref - logp); beta adapted
    after every step from the KL measured (Ziegler et al.); then GRPO's advantages of the shaped rewards."""
    history = read_history(settings_run / "monitor" / "trainer.jsonl")
    lengths = [x.response_length for rows in step_logprobs.values() for x, _, _ in rows]
    start = MAX_RESPONSE - OVERLONG_BUFFER
    # responses under the threshold, on the slope and past it: the check means something
    assert min(lengths) <= start and any(start < n < MAX_RESPONSE for n in lengths) and max(lengths) == MAX_RESPONSE
    beta = KL_START
    for m in history:
        rows = step_logprobs[m["step"]]
        d = [logp - ref for _, logp, ref in rows]  # [R] each: logp - ref_logp
        k3 = [torch.exp(-x) - 1 + x for x in d]  # [R] each
        seq_kl = torch.tensor([k.mean().item() for k in k3])  # [B]
        shaping = torch.tensor(
            [OVERLONG_FACTOR * min(0.0, (start - x.response_length) / OVERLONG_BUFFER) for x, *_ in rows]
        )
        scored = torch.tensor([x.reward for x, *_ in rows]) + shaping  # veRL's score: before the KL penalty
        score = scored - beta * torch.tensor([k.sum().item() for k in k3])  # veRL's rewards: what GRPO sees
        assert m["critic/kl_coef"] == pytest.approx(beta, rel=1e-9)
        assert m["critic/kl"] == pytest.approx(seq_kl.mean().item(), rel=1e-4, abs=1e-7)
        assert m["critic/overlong_penalty/mean"] == pytest.approx(shaping.mean().item(), abs=1e-6)
        for stat in ("mean", "max", "min"):
            assert m[f"critic/rewards/{stat}"] == pytest.approx(getattr(score, stat)().item(), abs=1e-5), stat
            assert m[f"critic/score/{stat}"] == pytest.approx(getattr(scored, stat)().item(), abs=1e-5), stat
        groups = [x.group_id for x, *_ in rows]
        tied = [len({scored[i].item() for i, h in enumerate(groups) if h == g}) == 1 for g in set(groups)]
        assert m["critic/score/zero_std_ratio"] == m["frac_reward_zero_std"] == sum(tied) / len(tied)  # TRL's name
        truncated = [x.truncate_status == "response_truncated" for x, *_ in rows]
        assert m["response_length/clip_ratio"] == pytest.approx(sum(truncated) / len(rows))
        for ours, verl in (("old_logprobs", "old_log_prob"), ("ref_logprobs", "ref"), ("adv", "adv")):
            assert m[f"timing_s/{verl}"] == m[f"time/{ours}"] > 0  # veRL's names, the same timers
        adv = torch.zeros(len(rows))
        for g in set(groups):
            idx = [i for i, h in enumerate(groups) if h == g]
            adv[idx] = (score[idx] - score[idx].mean()) / (score[idx].std() + 1e-6)
        length = torch.tensor([float(x.response_length) for x, *_ in rows])
        assert m["critic/advantages/mean"] == pytest.approx((adv * length).sum().item() / length.sum().item(), abs=1e-4)
        assert m["critic/advantages/max"] == pytest.approx(adv.max().item(), abs=1e-4)
        beta *= 1 + min(max(seq_kl.mean().item() / KL_TARGET - 1, -0.2), 0.2) * len(rows) / KL_HORIZON
    assert history[0]["critic/kl"] == 0.0  # step 1: the actor is the reference
    assert history[1]["critic/kl_coef"] != KL_START  # the coefficient adapted


@pytest.mark.slow
def test_a_step_wise_trainer_names_the_explorers_whose_rows_carry_no_advantages(trained):
    """A trainer of multi_step_grpo (step_wise_grpo: advantages computed in the explorer) on experiences without
    stored advantages (an explorer whose config has grpo wrote them; the DB recorded nothing of it, as a DB of an
    earlier nanorft): a named error with the explorer's name at the first step, no traceback (it raised a bare
    ValueError). With the DB's record (every explorer stores where its advantages come from), the trainer is
    refused at start, before any model is loaded (slow_runs' "step_wise/rows" and "step_wise/record")."""
    for case in ("rows", "record"):
        job, out = trained[f"step_wise/{case}"]
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        if case == "rows":
            assert (
                "4 of 4 experiences carry no advantages, which algorithm.advantage_fn step_wise_grpo computes in "
                "the explorer (batching.group_advantages): explorer(s) grpo_explorer wrote them with another "
                "advantage_fn"
            ) in out.stderr
        else:
            assert (
                "the advantages of this DB's experiences come from the trainer (stored by explorer "
                "grpo_explorer), and the trainer has them from the explorer: step_wise_grpo {"
            ) in out.stderr
            assert job.name == case and job.parent.is_dir() and not (job / "global_step_1").exists()


def test_a_set_up_failure_ends_the_mlflow_run_as_failed(quick_runs):
    """The trainer opens its monitor first (its log file gets set-up's records), and with monitor_type mlflow that
    creates the run; a set-up refusal (a DB of another model) then ended the process with the run still RUNNING.
    It ends FAILED (launch.run_in_process closes what a stage left open)."""
    job, out = quick_runs["mlflow"]
    uri = (job.parents[2] / "mlruns").as_uri()
    assert out.returncode == 2 and "written for another model or tokenizer" in out.stderr, out.stderr[-2000:]
    assert mlflow_runs(uri) == {"t_trainer": "FAILED"}


@pytest.mark.slow
def test_trainer_without_experiences_stops_with_a_clear_message(trained):
    """slow_runs' "no_experiences": a GRPO trainer on an empty DB, max_read_timeout 7 s."""
    job, out = trained["no_experiences"]
    assert out.returncode == 1
    assert "train step 1: waiting for experiences: 0 of 8 ready after 5 s" in out.stderr  # the note while waiting
    assert (
        "no full batch for train step 1 after 7 s (buffer.trainer_input.experience_buffer.max_read_timeout); "
        "explorers: none has written to this DB yet. Stopping"
    ) in out.stderr
    with ExperienceDB(f"sqlite:///{job / 'buffer' / 'exp.db'}") as d:
        assert json.loads(d.get_meta("trainer"))["status"] == "stopped" and d.counts()["claims"] == 0


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_and_the_newest_whole_one_resumes(trained, tiny_model_dir, caplog):
    job = finished(trained, "damaged")  # slow_runs': 3 steps, a checkpoint each
    manifest = json.loads((job / "global_step_3" / "manifest.json").read_text())
    assert {
        "actor/huggingface/model.safetensors",
        "actor/optimizer/shard-00001-model-00001-of-00001.safetensors",
        "actor/trainer_state.json",
        "actor/rng_state_rank0.safetensors",
    } <= set(manifest)
    assert checkpoint.latest_checkpoint(job) == 3
    weights_3 = job / "global_step_3" / "actor" / "huggingface" / "model.safetensors"
    weights_3.write_bytes(weights_3.read_bytes()[:-100])  # truncated
    shard = job / "global_step_2" / "actor" / "optimizer" / "shard-00001-model-00001-of-00001.safetensors"
    shard.unlink()  # missing
    with caplog.at_level(logging.WARNING, logger="nanorft.sync"):
        assert checkpoint.latest_checkpoint(job) == 1
    assert f"checkpoint step 3 is damaged and skipped (left as it is): {weights_3} has" in caplog.text
    assert f"{shard} is missing" in caplog.text
    assert "resuming from checkpoint step 1, the newest undamaged one (not 3)" in caplog.text
    assert weights_3.is_file() and (job / "global_step_2").is_dir()  # nothing deleted
    resumed = run_train(job.parents[2] / "train.yaml")  # its config again
    assert resumed.returncode == 0 and "resumed from checkpoint step 1" in resumed.stderr, resumed.stderr[-3000:]
    assert checkpoint.latest_checkpoint(job) == 3  # steps 2 and 3 written again, whole
    for step in (1, 2, 3):  # every one damaged: a named error, not a silent fresh start
        state = job / f"global_step_{step}" / "actor" / "trainer_state.json"
        state.write_text(state.read_text() + " ")
    with pytest.raises(DataError, match="every checkpoint is damaged"):
        checkpoint.latest_checkpoint(job)


def test_resuming_with_another_base_model_or_algorithm_is_refused_by_name(tmp_path, tiny_model_dir):
    """Issue 46: a changed model.model_path silently changed the KL reference, a changed algorithm_type reused the old
    optimizer state. A checkpoint records both; a resume with others stops (exit 2, no traceback) naming both values,
    before any model is built; the same settings (the same folder through another spelling) resume."""
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    settings = [  # the first run saves step 1; the others resume it (sft_config writes r/train.yaml: each moved)
        {"buffer.total_steps": 1},
        {"buffer.total_steps": 2, "model.model_path": str(other)},
        {"buffer.total_steps": 2, "algorithm": {"algorithm_type": "dpo"}},
        {"buffer.total_steps": 2, "model.model_path": os.path.relpath(tiny_model_dir, ROOT)},  # the same folder
    ]
    paths = [
        sft_config(tmp_path / "r", tiny_model_dir, **over).rename(tmp_path / f"{i}.yaml")
        for i, over in enumerate(settings)
    ]
    outs = run_trains(paths)
    job = tmp_path / "r" / "ck" / "p" / "t"
    assert outs[0].returncode == 0, outs[0].stderr[-3000:]
    saved = json.loads((job / "global_step_1" / "actor" / "trainer_state.json").read_text())["trained_with"]
    assert saved == {"model.model_path": str(Path(tiny_model_dir).resolve()), "algorithm.algorithm_type": "sft"}
    for out, key, now, was in (
        (outs[1], "model.model_path", str(other.resolve()), str(Path(tiny_model_dir).resolve())),
        (outs[2], "algorithm.algorithm_type", "dpo", "sft"),
    ):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert (
            f"{job} has checkpoint step 1, and this run would resume it with other settings: {key} is {now!r}, "
            f"the checkpoint was trained with {was!r}. Set them back to resume" in " ".join(out.stderr.split())
        )
    assert outs[3].returncode == 0 and "resumed from checkpoint step 1" in outs[3].stderr, outs[3].stderr[-3000:]
    assert checkpoint.latest_checkpoint(job) == 2


def fake_checkpoint(job: Path, step: int) -> Path:
    """A checkpoint folder with the files latest_checkpoint looks at, and its manifest."""
    actor = job / f"global_step_{step}" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    (actor / "huggingface" / "model.safetensors").write_bytes(b"w" * 10)
    (actor / "trainer_state.json").write_text("{}")
    checkpoint.write_manifest(actor.parent)
    return actor.parent


@pytest.mark.parametrize(
    "case",
    [
        "pointer abc",
        "pointer -1",
        "pointer a directory",
        "pointer to nothing",
        "manifest a list",
        "manifest a directory",
        "manifest entry a number",
        "renamed folders",
    ],
)
def test_damaged_pointers_manifests_and_renamed_folders_are_named(tmp_path, case, caplog):
    """No ValueError / IsADirectoryError: a DataError naming the file, or the damaged checkpoint skipped with a
    warning naming its manifest; folders renamed by hand (global_step_3_damaged, global_step_2.bak) are not steps."""
    job, pointer = tmp_path, tmp_path / checkpoint.CKPT_POINTER
    fake_checkpoint(job, 1)
    pointer.write_text("1\n")
    if case.startswith("pointer"):
        if case == "pointer a directory":
            pointer.unlink()
            pointer.mkdir()
        else:
            pointer.write_text({"pointer abc": "abc", "pointer -1": "-1", "pointer to nothing": "5"}[case])
            shutil.rmtree(job / "global_step_1") if case == "pointer to nothing" else None
        says = {
            "pointer abc": "holds 'abc', not a step number",
            "pointer -1": "holds '-1', not a step number",
            "pointer a directory": "cannot be read as a step number",
            "pointer to nothing": f"names step 5, and {job} has no checkpoint up to it",
        }[case]
        with pytest.raises(DataError, match=re.escape(f"{pointer}") + ".*" + re.escape(says)) as e:
            checkpoint.latest_checkpoint(job)
        assert "see the warnings above" not in str(e.value)
        return
    if case == "renamed folders":
        fake_checkpoint(job, 2).rename(job / "global_step_2.bak")
        fake_checkpoint(job, 3).rename(job / "global_step_3_damaged")
        pointer.write_text("3\n")
        sync.set_latest(job, 3)
        assert checkpoint.checkpoint_steps(job) == [1] and sync.step_folders(job, "actor/huggingface") == {
            1: job / "global_step_1" / "actor" / "huggingface"
        }
        assert sync.prune_published(job, 3) == [] and (job / "global_step_2.bak").is_dir()
        with caplog.at_level(logging.WARNING):
            assert checkpoint.latest_checkpoint(job) == 1
        return
    manifest = job / "global_step_1" / "manifest.json"
    fake_checkpoint(job, 2)
    pointer.write_text("2\n")
    manifest2 = job / "global_step_2" / "manifest.json"
    if case == "manifest a directory":
        manifest2.unlink()
        manifest2.mkdir()
    else:
        manifest2.write_text("[1, 2]" if case == "manifest a list" else '{"actor/trainer_state.json": 2}')
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest_checkpoint(job) == 1  # the older, whole one
    assert f"checkpoint step 2 is damaged and skipped (left as it is): {manifest2}" in caplog.text
    assert manifest.is_file() and manifest2.exists()


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (job directory, exit code and stderr) of the quick tests' trainer runs, in ONE train.py process
    (helpers.run_trains): 3 steps keeping 2 checkpoints; one resuming from a garbage pointer; one whose model folder
    is gone; one refused at set-up (a DB of another model) with monitor_type mlflow."""
    tmp = tmp_path_factory.mktemp("quick")
    (tmp / "garbage" / "ck" / "p" / "t").mkdir(parents=True)
    (tmp / "garbage" / "ck" / "p" / "t" / checkpoint.CKPT_POINTER).write_text("abc\n")
    (tmp / "mlflow").mkdir()
    with ExperienceDB(f"sqlite:///{tmp / 'mlflow' / 'exp.db'}") as d:
        d.check_identity({"model_type": "llama"}, "another explorer")
    runs = {
        "max_checkpoints": {**THREE_STEPS, "trainer.max_checkpoints_to_keep": 2},
        "garbage": {},
        "gone": {"model.model_path": str(tmp / "gone" / "moved_away")},
        "mlflow": {  # last: the only run with an mlflow monitor
            "algorithm": {"algorithm_type": "grpo", "repeat_times": 2},
            "monitor.monitor_type": "mlflow",
            "buffer.trainer_input.experience_buffer": {
                "name": "exp",
                "storage_type": "queue",
                "path": f"sqlite:///{tmp / 'mlflow' / 'exp.db'}",
            },
        },
    }
    configs = [sft_config(tmp / name, tiny_model_dir, **over) for name, over in runs.items()]
    outs = run_trains(configs, env={"MLFLOW_TRACKING_URI": (tmp / "mlflow" / "mlruns").as_uri()})
    return {name: (tmp / name / "ck" / "p" / "t", out) for name, out in zip(runs, outs)}


def test_a_trainer_with_a_garbage_pointer_stops_with_a_named_error_in_its_log(quick_runs):
    """The role log opens first: the error of set-up (here: resuming) is in log/trainer.log too."""
    job, out = quick_runs["garbage"]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    says = f"{job / checkpoint.CKPT_POINTER}: holds 'abc', not a step number"
    assert says in out.stderr and says in (job / "log" / "trainer.log").read_text()


def test_max_checkpoints_to_keep_prunes_the_oldest(quick_runs):
    job = finished(quick_runs, "max_checkpoints")  # 3 steps, a checkpoint each, 2 kept
    assert sorted(checkpoint.checkpoint_steps(job)) == [2, 3] and checkpoint.latest_checkpoint(job) == 3


def read_on_rank(rank: int, world: int, port: int, db_url: str, model_dir: str, out: str) -> None:
    """A trainer rank's Source under a real gloo group; on ranks > 0 opening the DB fails the test."""
    import source

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    if rank > 0:

        def refuse(*args, **kwargs):
            raise AssertionError(f"rank {rank} opened the experience DB")

        source.ExperienceDB = refuse
    cfg = configs.Config()
    cfg.model.model_path, cfg.buffer.train_batch_size, cfg.algorithm.sample_strategy = model_dir, 4, "default"
    cfg.buffer.trainer_input.experience_buffer.path = db_url
    cfg.buffer.trainer_input.experience_buffer.max_read_timeout = 30
    src = source.Source(cfg, load_tokenizer(model_dir), rank, torch.device("cpu"))
    got = [[(x.id, x.tokens.tolist(), x.reward, x.group_id) for x in src.read(step)] for step in (1, 2)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_only_rank_0_reads_the_db_and_every_rank_gets_its_batch(tmp_path, tiny_model_dir):

    url = f"sqlite:///{tmp_path / 'exp.db'}"
    with ExperienceDB(url) as db:
        db.write(experiences([(3, [2, 4]), (5, [1, 3]), (2, [6, 6]), (4, [1, 1])]))
    spawn_ranks(read_on_rank, (2, free_port(), url, tiny_model_dir, str(tmp_path)), 2)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero == one and [len(batch) for batch in zero] == [4, 4]
    assert sorted(x[0] for batch in zero for x in batch) == list(range(1, 9))  # each experience once


def test_the_critic_cuts_its_micro_batches_by_its_own_size(monkeypatch):
    """use_dynamic_bsz off: the critic's update runs micro-batches of trainer.critic.micro_batch_size_per_gpu
    sequences, the actor's of trainer.micro_batch_size_per_gpu (veRL's critic.ppo_micro_batch_size_per_gpu)."""
    batch = batching.step_batch(experiences([(4, [3, 3, 3, 3, 3, 3])]), width=8)
    units = batching.pack_units(batch, list(range(6)), False, 1000)
    plan = [batching.micro_batches(batch, units, 0, 1)]  # the actor's: 1 sequence each
    cfg = configs.Config()
    cfg.trainer.use_dynamic_bsz, cfg.trainer.micro_batch_size_per_gpu = False, 1
    cfg.trainer.critic.micro_batch_size_per_gpu = 4
    seen = {}

    def optimize(p, *, model, optim, batch, plan, loss_fn, mode, lr, grad_clip, prefix, step):
        seen[prefix] = [[len(u) for micro in mini for u in micro] for mini in plan], [len(m) for m in plan[0]]
        return {}, [], 0

    monkeypatch.setattr(train, "optimize", optimize)
    monkeypatch.setattr(train, "reduce_sum", lambda values, device: values)
    off = types.SimpleNamespace(adaptive=False)
    p = types.SimpleNamespace(
        cfg=cfg,
        critic=object(),
        critic_optim=None,
        actor=None,
        optim=None,
        total=1,
        world=1,
        device="cpu",
        pieces={"policy_loss_fn": (None, off), "kl_loss_fn": (None, off), "kl_penalty_fn": (None, off)},
        kl_coef={},
        skipped=0,
    )
    train.update(p, batch, plan, 1)
    assert seen["actor/"][1] == [1] * 6 and seen["critic/"][1] == [4, 2]  # sequences per micro-batch
    assert seen["critic/"][0] == seen["actor/"][0]  # the same sequences in each mini-batch


# --- a full or failing disk, a missing model folder: named errors, nothing lost

# train.py as a process whose disk fills up while it writes step 2's optimizer states: torch.distributed.checkpoint
# has opened the shard's file when its bytes cannot be written (ENOSPC)
FULL_AT_STEP_2 = """import errno, os, runpy, sys
import safetensors.torch
dump, saves = safetensors.torch.save, []
def full(tensors, *args, **kwargs):
    saves.extend(["optimizer"] if any(k.endswith("/exp_avg") for k in tensors) else [])
    if saves.count("optimizer") == 2:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return dump(tensors, *args, **kwargs)
safetensors.torch.save = full
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.slow
def test_a_full_disk_while_saving_a_checkpoint_is_named_and_the_last_one_resumes(tmp_path, tiny_model_dir):
    """The disk fills up in step 2's checkpoint: the trainer stops with one named line (exit 2, no traceback) that
    says which checkpoint is whole and what to do; the pointer still names step 1, whose files match their manifest,
    and the half-written file is gone. Run again once there is room: it resumes from step 1 and saves step 2."""
    config = sft_config(tmp_path, tiny_model_dir, **{"buffer.total_steps": 2, "trainer.save_interval": 1})
    out = subprocess.run(
        [sys.executable, "-c", FULL_AT_STEP_2, "--config", str(config)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NANORFT_LAUNCHED": "1", "OMP_NUM_THREADS": "1"},
    )
    job = tmp_path / "ck" / "p" / "t"
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        f"trainer of stage t stops: cannot save checkpoint step 2 in {job}: the disk is full (No space left on "
        f"device). The last complete checkpoint, step 1 ({job / checkpoint.CKPT_POINTER}), is untouched: the next "
        "run resumes from it. Free space on that disk (or lower trainer.max_checkpoints_to_keep), then run again "
        "with continue_from_checkpoint: true."
    ) in out.stderr
    assert (job / checkpoint.CKPT_POINTER).read_text() == "1\n" and checkpoint.latest_checkpoint(job) == 1
    assert not list(job.rglob(".*tmp*")) and not (job / "global_step_2" / "actor" / "optimizer").exists()
    resumed = run_train(config)
    assert resumed.returncode == 0 and "resumed from checkpoint step 1" in resumed.stderr, resumed.stderr[-3000:]
    assert checkpoint.latest_checkpoint(job) == 2


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
def test_a_full_or_failing_disk_while_publishing_is_named_and_the_explorers_weights_stay(
    tmp_path, tiny_model_dir, monkeypatch, error
):
    """Publishing step 2's weights fails part-way (a full disk, an I/O error): a StorageError (a DataError: the
    process names it and stops) says what happened and what to do; the explorers' pointer still names step 1, whose
    folder loads, and the half-written folder is gone."""
    import errno

    code = getattr(errno, error)
    cfg = configs.Config()
    cfg.checkpoint_job_dir, cfg.trainer.save_interval, cfg.synchronizer.sync_method = str(tmp_path), 0, "checkpoint"
    cfg.buffer.batch_size, cfg.algorithm.repeat_times, cfg.buffer.train_batch_size = 16, 8, 128  # publishes 1..3
    model = load_model(tiny_model_dir)
    monkeypatch.setattr(train.sync, "full_state", lambda m: dict(m.state_dict()))  # no process group here
    p = bare_parts(cfg, torch.device("cpu"), load_tokenizer(tiny_model_dir), types.SimpleNamespace(model=model))
    assert train.publish(p, 1) is not None and sync.latest_version(tmp_path) == 1

    def failing(folder, **kwargs):
        Path(folder).mkdir()
        (Path(folder) / "model.safetensors").write_bytes(b"x" * 4096)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(model, "save_pretrained", failing)
    with pytest.raises(checkpoint.StorageError) as info:
        train.publish(p, 2)
    what, todo = {
        "ENOSPC": ("the disk is full", "Free space on that disk (or lower trainer.max_checkpoints_to_keep)"),
        "EIO": ("the disk reported an I/O error", "Check the disk (dmesg) or move checkpoint_root_dir to a sound one"),
    }[error]
    assert isinstance(info.value, DataError) and str(info.value) == (
        f"cannot publish the weights of step 2 in {tmp_path}: {what} ({os.strerror(code)}). "
        f"{tmp_path / sync.POINTER} was not moved (explorers keep the weights of step 1). No checkpoint of this run is "
        f"complete yet ({tmp_path / checkpoint.CKPT_POINTER} is absent): the next run starts from model.model_path. "
        f"{todo}, then run again with continue_from_checkpoint: true."
    )
    assert sync.latest_version(tmp_path) == 1 and not list(tmp_path.rglob(".*tmp*"))
    assert load_model(str(tmp_path / "global_step_1" / "actor" / "huggingface")) is not None


def test_a_launched_trainer_whose_model_folder_is_gone_stops_with_a_named_error(quick_runs):
    """The launcher's pre-flight found the folder; a launched trainer (which skips it) finds it gone: one named line
    and exit 2, not transformers' traceback (which takes a missing folder for a malformed hub id)."""
    job, out = quick_runs["gone"]
    gone = job.parents[2] / "moved_away"
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert (
        f"trainer of stage t stops: cannot load a model from {gone}: {gone} does not exist; fix the key that "
        "names it (model.model_path, model.critic_model_path, explorer.auxiliary_models[].model_path)"
    ) in out.stderr


def test_reused_rows_train_on_the_advantages_of_their_first_use():
    """compute_advantages: a row that carries the advantages stored at its first use (a reuse, claimed with them:
    buffer.ExperienceDB.claim) trains on them; the other rows get the advantage fn's. Here REINFORCE++ whitens over
    the batch, so the reused row's recomputed value (another batch) would differ from its first use's."""
    cfg = configs.Config()
    a = cfg.algorithm
    a.advantage_fn, a.policy_loss_fn, a.entropy_loss_fn = "reinforceplusplus", "ppo", "default"
    a.kl_loss_fn, a.kl_penalty_fn = "none", "none"
    p = dataclasses.replace(bare_parts(cfg, torch.device("cpu"), None, None), pieces=train.loss_pieces(a))
    exps = experiences([(3, [4, 4]), (2, [3, 5])])
    for x, r in zip(exps, [1.0, 0.0, 1.0, 1.0]):
        x.reward = r

    def advantages() -> torch.Tensor:
        batch = batching.step_batch(exps, width=6)
        train.shape_rewards(p, batch)
        train.compute_advantages(p, batch)
        return batch["advantages"]  # [B,T]

    fresh = advantages()
    exps[2].advantages = torch.tensor([0.5, -0.5, 0.25])  # [R] its first use's
    reused = advantages()
    assert torch.equal(reused[2], torch.tensor([0.5, -0.5, 0.25, 0.0, 0.0, 0.0]))
    assert not torch.allclose(fresh[2, :3], reused[2, :3])
    assert torch.equal(reused[[0, 1, 3]], fresh[[0, 1, 3]])


@pytest.mark.slow(seconds=30)
def test_empty_steps_on_two_ranks_make_no_update_and_publish_their_weights(tmp_path, tiny_model_dir):
    """Mode train under torchrun on 2 gloo ranks; the explorer wrote steps 1 and 2 with no experience (every task
    dropped) and waits for the weights of step 2: each train step is empty on both ranks (rank 0 tells the other), makes
    no update, and publishes its weights unchanged; the run ends at once instead of after max_read_timeout."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "mode": "train",
            "buffer.total_steps": 2,
            "buffer.trainer_input.experience_buffer.max_read_timeout": 60,
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    job = tmp_path / "ck" / "p" / "run"
    with ExperienceDB(f"sqlite:///{job / 'buffer' / 'exp.db'}") as db:
        db.set_explorer_state("explorer", {"step": 2, "sync_wait": 2, "written": 0, "finished": False})
    out = run_train(config, ranks=2)
    assert out.returncode == 0, out.stderr[-4000:]
    assert (
        "train step 1: actor update skipped (actor/skipped_steps 1): no experiences were written for it" in out.stderr
    )
    history = read_history(job / "monitor" / "trainer.jsonl")
    assert [(m["batch/size"], m["batch/short"]) for m in history] == [(0, 1.0)] * 2
    assert [(m["actor/update_skipped"], m["actor/skipped_steps"]) for m in history] == [(1, 1), (1, 2)]
    start = load_model(tiny_model_dir).state_dict()
    for step in (1, 2):
        published = load_model(str(sync.weights_path(job, step))).state_dict()
        assert all(torch.equal(published[k], v) for k, v in start.items()), step


def test_sft_batches_draw_each_epochs_order_once(monkeypatch):
    """source.pick: a batch's examples come in their epoch's seeded order (tag/epoch seeds a permutation of the file,
    as before), and that order is drawn once per epoch, not once per example read (which was: 32 permutations of 4,000
    rows a step, ~8% of the embedded default's SFT step, docs/LOG.md)."""
    import random

    import source

    source.epoch_order.cache_clear()
    real, calls = random.Random.sample, []
    monkeypatch.setattr(random.Random, "sample", lambda self, *a: calls.append(a) or real(self, *a))
    examples = [[i] for i in range(50)]  # one "experience" per example: its index
    got = source.pick(examples, 45, 10, "t")  # the last 5 of epoch 0, the first 5 of epoch 1
    order = [real(random.Random(f"t/{e}"), range(50), 50) for e in (0, 1)]
    assert got == order[0][45:] + order[1][:5]
    assert len(calls) == 2
    assert source.pick(examples, 55, 10, "t") == order[1][5:15] and len(calls) == 2  # the next step: no new draw
