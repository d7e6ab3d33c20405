"""vllm_engine.py on real vLLM, and the fake vLLM (tests/fake_vllm) answering to it: every behaviour the fake
imitates and the adapter relies on runs against both, "fake" and "real" (vLLM 0.32's CPU build, which
`bash run.sh test` installs; on a GPU machine with vLLM the same tests run there unchanged). What a CPU cannot show
(GPUs, the memory sleep frees) is the fake's alone: tests/test_vllm_engine.py.

The real engines start once for this module (~20 s each, in the order the tests first ask): a pool of two `vllm`
engines and one `vllm_async` engine; a test that changes their weights puts the base weights back. The fake's start
per test. Where vLLM is not installed the real cases skip, except under CI, which installs it: there they fail."""

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch

import batching
import engines
import scoring
import sync
import vllm_engine
import wire
from configs.schema import InferenceModelConfig
from engines import EngineHandle, SamplingParams, make_engine
from helpers import FAKE_VLLM, ROOT, perturbed, plain_logprobs, real_vllm, use_fake_vllm
from models import load_model, load_tokenizer
from openai_api import OpenAIServer

pytestmark = pytest.mark.usefixtures("environment_kept")  # vLLM engines built in this process

KINDS = ["vllm", "vllm_async"]


def rollout_model(kind: str, **over) -> InferenceModelConfig:
    """The module's engines: fp32 (log-probs comparable with the trainer's), eager (starts in ~20 s on the CPU), a
    tenth of the host's memory each, prefix caching on (so that stale KV blocks after new weights would show),
    chunked prefill as configs.derive leaves it unset (off without GPUs)."""
    return InferenceModelConfig(
        **{
            "engine_type": kind,
            "engine_num": 2 if kind == "vllm" else 1,
            "dtype": "float32",
            "gpu_memory_utilization": 0.1,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": torch.cuda.is_available(),
            **over,
        }
    )


@pytest.fixture(scope="module")
def real_pools(tiny_model_dir):
    """kind -> the module's real engine pool, started at its first use, closed at the end of the module; and what the
    "vllm" pool answered at its start (`answers`), on the base weights."""
    real_vllm()
    pools, fresh = {}, {}

    def pool(kind: str) -> vllm_engine.EnginePool:
        if kind not in pools:
            pools[kind] = make_engine(rollout_model(kind), tiny_model_dir, 256)
            if kind == "vllm":
                fresh[kind] = answers(pools[kind], prompts(tiny_model_dir))
        return pools[kind]

    def started() -> list[list[list]]:
        pool("vllm")
        return fresh["vllm"]

    yield pool, started
    for p in pools.values():
        p.close()


# the real cases share real_pools (requested at run time, unseen by tests/conftest.py's grouping): one worker, one start
# NOTE: "real" is slow: its module's two real vLLM engines start (~40-130 s) before its first test
REAL = pytest.param(
    "real", marks=[pytest.mark.xdist_group("test_vllm_contract::real_pools"), pytest.mark.slow(seconds=5)]
)


@pytest.fixture(params=["fake", REAL])
def backend(request, monkeypatch, tiny_model_dir):
    """.pool(kind): the engine pool of this backend; .name: "fake" or "real"; .fresh(): what the "vllm" pool answers
    (`answers`) as it starts, on the base weights (the real one's, recorded at its start; the fake's pools start
    with each test, so that a test asks before it changes their weights)."""
    if request.param == "real":
        pool, fresh = request.getfixturevalue("real_pools")
        yield SimpleNamespace(name="real", pool=pool, fresh=fresh)
        return
    use_fake_vllm(monkeypatch)
    pools = {}

    def pool(kind: str) -> vllm_engine.EnginePool:
        if kind not in pools:
            pools[kind] = make_engine(rollout_model(kind), tiny_model_dir, 256)
        return pools[kind]

    yield SimpleNamespace(name="fake", pool=pool, fresh=lambda: answers(pool("vllm"), prompts(tiny_model_dir)))
    for p in pools.values():
        p.close()


def prompts(model_dir: str) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [tok.encode(t, add_special_tokens=False) for t in ("What is 2 + 3?", "Tom has 4 apples.")]


def gap(model: torch.nn.Module, prompt: list[int], samples: list, temperature: float = 1.0) -> float:
    """Largest |engine log-prob - the trainer's (a plain forward pass of `model`)| over the samples' tokens."""
    return max(
        (torch.tensor(c.logprobs) - plain_logprobs(model, prompt + c.token_ids, len(prompt), temperature))
        .abs()
        .max()
        .item()
        for c in samples
    )


ANSWERS = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(n=3, max_tokens=12, seed=9)]


def answers(pool: vllm_engine.EnginePool, ids: list[list[int]]) -> list[list[list]]:
    """The pool's greedy answers to `ids`, then 3 seeded samples of each: the samples of each request, per params."""
    return [pool.generate(ids, [p] * len(ids)) for p in ANSWERS]


# --- sampling


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.slow
def test_n_samples_each_with_the_trainers_logprobs(backend, kind, temperature, tiny_model_dir):
    """n samples per request, all of them (vllm_async asks for FINAL_ONLY), each token's log-prob the trainer's
    log_softmax(logits / T) within 1e-4 in fp32."""
    pool, ref, ids = backend.pool(kind), load_model(tiny_model_dir), prompts(tiny_model_dir)
    outs = pool.generate(ids, [SamplingParams(n=4, temperature=temperature, max_tokens=12, seed=3)] * 2)
    for prompt, samples in zip(ids, outs):
        assert len(samples) == 4 and len({tuple(c.token_ids) for c in samples}) > 1
        assert all(len(c.logprobs) == len(c.token_ids) >= 1 for c in samples)
        assert gap(ref, prompt, samples, temperature) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_score_gives_each_tokens_logprob_at_temperature_one(backend, kind, tiny_model_dir):
    """score() (prompt_logprobs; a teacher scoring a student's tokens): each token's log-prob given those before it,
    the trainer's at temperature 1 within 1e-4 in fp32, for sequences of different lengths; sampled with top-p and a
    repetition penalty, a sample's scores are still the raw ones (prompt tokens skip vLLM's processors), and any other
    temperature, or a sequence with no room for the one token vLLM samples after it, is refused by name."""
    pool, ref, ids = backend.pool(kind), load_model(tiny_model_dir), prompts(tiny_model_dir)
    (samples,) = pool.generate(ids[:1], [SamplingParams(n=2, temperature=0.6, top_p=0.5, max_tokens=8, seed=2)])
    sequences = [ids[1], *(ids[0] + c.token_ids for c in samples)]
    for seq, lp in zip(sequences, pool.score(sequences)):
        assert len(lp) == len(seq) - 1
        want = plain_logprobs(ref, seq, 1)  # every token after the first
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="vLLM's prompt log-probs are taken at temperature 1.0"):
        pool.score(sequences, temperature=0.7)
    with pytest.raises(ValueError, match="longer than this engine scores: 255 \\(max_model_len - 1"):
        pool.score([[5] * 256])


def test_top_p_logprobs_are_renormalised_over_the_nucleus(backend, tiny_model_dir):
    """processed_logprobs: after top-p the log-probs are those of the renormalised nucleus, not the trainer's (why
    configs/checks.py refuses the off-policy correction with top-p on vLLM)."""
    pool, ref, ids = backend.pool("vllm"), load_model(tiny_model_dir), prompts(tiny_model_dir)
    (samples,) = pool.generate(ids[:1], [SamplingParams(n=3, temperature=0.6, top_p=0.3, max_tokens=6, seed=1)])
    for c in samples:
        assert (torch.tensor(c.logprobs) - plain_logprobs(ref, ids[0] + c.token_ids, len(ids[0]), 0.6) > 1e-2).all()


@pytest.mark.slow
def test_eos_ends_a_sample_and_min_tokens_masks_it(backend, tiny_model_dir):
    """A sample ends on any of the engine's eos_ids (the tokenizer's and the generation config's, as the HF
    engine's), which stays its last token; min_tokens masks them all, and the masked positions' log-probs are the
    trainer's renormalised over the other tokens: log p - log(1 - sum of the EOS ids' p)."""
    pool, ref, ids = backend.pool("vllm"), load_model(tiny_model_dir), prompts(tiny_model_dir)[0]
    eos = pool.eos_ids
    assert eos == sorted(load_tokenizer(tiny_model_dir).convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    (free,) = pool.generate([ids], [SamplingParams(n=48, max_tokens=40, seed=5)])
    ended = [c for c in free if c.finish_reason == "stop"]
    assert ended and all(c.token_ids[-1] in eos and not set(c.token_ids[:-1]) & set(eos) for c in ended)
    assert all(len(c.token_ids) == 40 and not set(c.token_ids) & set(eos) for c in free if c not in ended)
    assert min(len(c.token_ids) for c in ended) < 10  # some end early unless masked
    (held,) = pool.generate([ids], [SamplingParams(n=48, max_tokens=40, min_tokens=10, seed=5)])
    assert all(len(c.token_ids) > 10 for c in held if c.finish_reason == "stop")
    for c in held[:4]:
        tokens = torch.tensor(ids + c.token_ids)
        with torch.no_grad():
            logp = ref(tokens[None]).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)  # [R,V]
        want = logp.gather(-1, tokens[len(ids) :, None])[:, 0]  # [R]
        want[:10] -= torch.log1p(-logp[:10, eos].exp().sum(-1))  # EOS masked: the rest renormalised
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_the_trainers_masked_logprobs_equal_vllms_with_min_tokens(backend, kind, tiny_model_dir):
    """Issue 47: with min_tokens (model.min_response_tokens is 1 by default) vLLM's processed log-probs are of the
    distribution with the EOS ids masked; the trainer's scorer masks the same positions (the rollout handle records
    min_tokens in info, batching.eos_masked): every token's log-prob is vLLM's within 1e-4, so the off-policy
    correction's ratios are 1 on the same weights; without the mask the first tokens' are not."""
    pool, ids = backend.pool(kind), prompts(tiny_model_dir)[0]
    (samples,) = pool.generate([ids], [SamplingParams(n=6, temperature=0.8, max_tokens=14, min_tokens=8, seed=4)])
    exps = [engines.experience(ids, c, 0.8, min_tokens=8) for c in samples]
    batch = batching.step_batch(exps, width=14)
    [micro] = batching.micro_batches(batch, batching.pack_units(batch, list(range(6)), True, 10**6), 10**6, None)
    mb = batching.micro_batch(batch, micro, True, torch.device("cpu"))
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        masked = scoring.TokenScorer(model, eos_ids=pool.eos_ids)(mb)[0]  # [n,T]
        plain = scoring.TokenScorer(model)(mb)[0]  # [n,T]
    for k, b in enumerate(mb["rows"].tolist()):
        R = exps[b].response_length
        torch.testing.assert_close(masked[k, :R], exps[b].logprobs, atol=1e-4, rtol=0)
    assert ((masked - plain).abs()[:, :8].amax(-1) > 1e-3).any()  # the mask moves the first tokens' log-probs


@pytest.mark.slow
def test_a_stop_string_ends_the_text_before_it(backend, tiny_model_dir):
    """A stop string ends a sample once its text holds it: the text is cut before it, the tokens end with the one
    that completed it (vLLM's behaviour, and the HF engine's), the sample is "stop"."""
    pool, tok, ids = backend.pool("vllm"), load_tokenizer(tiny_model_dir), prompts(tiny_model_dir)[0]
    for seed in range(40):  # a sample whose text has two ASCII letters or digits in a row, past its start
        (base,) = pool.generate([ids], [SamplingParams(max_tokens=30, seed=seed)])[0]
        text = base.text
        at = next((i for i in range(3, len(text) - 1) if text[i : i + 2].isascii() and text[i : i + 2].isalnum()), 0)
        if at:
            break
    stop = text[at : at + 2]
    (cut,) = pool.generate([ids], [SamplingParams(max_tokens=30, seed=seed, stop=[stop])])[0]
    assert (cut.finish_reason, cut.text) == ("stop", text[: text.index(stop)])
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)] and len(cut.logprobs) == len(cut.token_ids)
    assert stop in tok.decode(cut.token_ids) and stop not in tok.decode(cut.token_ids[:-1])


def test_a_requests_seed_decides_its_samples_and_engines_differ_without_one(backend, tiny_model_dir):
    """Same seed, same samples (twice on one engine, and on the other engine); without a seed each engine draws
    from its own generator (engine i seeded with seed + i): the two engines sample differently."""
    pool, ids = backend.pool("vllm"), prompts(tiny_model_dir)[0]

    def tokens(engine, p: SamplingParams) -> list[tuple]:
        return [tuple(c.token_ids) for c in engine.submit(ids, p).result(timeout=120)]

    first, second = pool.engines
    seeded = SamplingParams(n=3, max_tokens=10, seed=7)
    assert tokens(first, seeded) == tokens(first, seeded) == tokens(second, seeded)
    assert len(set(tokens(first, seeded))) == 3  # the n samples of one request differ
    free = SamplingParams(n=3, max_tokens=10)
    assert tokens(first, free) != tokens(second, free)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.slow
def test_seeded_requests_over_the_token_budget(backend, kind, tiny_model_dir):
    """16 seeded requests x n 8 of ~95-token prompts: more prompt tokens than one engine step takes (4,096). NOTE:
    with chunked prefill, vLLM 0.32's CPU backend split such a batch's prefills and failed the seeded ones ("CPU
    Generator does not use offset"), killing the engine: configs.derive leaves chunked prefill off without GPUs."""
    pool, tok = backend.pool(kind), load_tokenizer(tiny_model_dir)
    ids = [tok.encode(f"What is {i % 9} + {i % 7} - 2? " * 5, add_special_tokens=False) for i in range(16)]
    assert min(map(len, ids)) * 16 * 8 > 4096
    outs = pool.generate(ids, [SamplingParams(n=8, max_tokens=8, min_tokens=8, seed=s) for s in range(16)])
    assert [len(cs) for cs in outs] == [8] * 16 and all(len(c.token_ids) == 8 for cs in outs for c in cs)
    again = pool.generate(ids[:1], [SamplingParams(n=8, max_tokens=8, min_tokens=8, seed=0)])[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in outs[0]]  # the seed alone decides


def test_the_repetition_penalty_is_in_the_logprobs(backend, tiny_model_dir):
    """model.repetition_penalty: every token already in the prompt or the response so far has its logit divided by
    the penalty (multiplied where negative) before temperature; the log-probs are of that distribution."""
    pool, ref, ids = backend.pool("vllm"), load_model(tiny_model_dir), prompts(tiny_model_dir)[0]
    for e in pool.engines:
        e.penalty = 1.5
    try:
        (samples,) = pool.generate([ids], [SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=2)])
    finally:
        for e in pool.engines:
            e.penalty = 1.0
    for c in samples:
        want = []
        for j, t in enumerate(c.token_ids):
            seen = torch.tensor(sorted(set(ids + c.token_ids[:j])))
            with torch.no_grad():
                logits = ref(torch.tensor([ids + c.token_ids[:j]])).logits[0, -1].float()
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.5, logits[seen] * 1.5)
            want.append((logits / 0.8).log_softmax(-1)[t])
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.stack(want), atol=1e-4, rtol=0)


def test_requests_spread_over_both_engines(backend, tiny_model_dir, monkeypatch):
    pool, ids, served = backend.pool("vllm"), prompts(tiny_model_dir), [0, 0]
    for i, e in enumerate(pool.engines):
        monkeypatch.setattr(
            e, "submit", lambda p, s, i=i, submit=e.submit: served.__setitem__(i, served[i] + 1) or submit(p, s)
        )
    futures = [pool.submit(ids[i % 2], SamplingParams(n=2, max_tokens=6, seed=i)) for i in range(8)]
    assert all(len(f.result(timeout=120)) == 2 for f in futures)
    assert sum(served) == 8 and min(served) >= 2


def test_the_async_engine_streams_some_samples_per_output_unless_asked_for_the_final_one(backend, tiny_model_dir):
    """vLLM's async engine, by default (CUMULATIVE), streams an output per step holding the samples that produced a
    token in it (at times not all n: vLLM's first output held sample 0 alone in some runs, always in the fake's):
    the adapter asks for FINAL_ONLY, one output with all n (and collects samples by index should they stream)."""
    engine, ids = backend.pool("vllm_async").engines[0], prompts(tiny_model_dir)[0]
    kinds = engine.vllm.sampling_params.RequestOutputKind

    async def outputs(kind) -> list[list[int]]:
        """The sample indices each streamed output holds, as it comes (NOTE: vLLM updates an output's objects in
        place as the request goes on)."""
        sp = engine.vllm.SamplingParams(n=4, max_tokens=5, seed=3, logprobs=0, output_kind=kind)
        return [
            [c.index for c in o.outputs]
            async for o in engine.llm.generate({"prompt_token_ids": ids}, sp, request_id=f"probe-{kind}")
        ]

    streamed, final = engine.call(outputs(kinds.CUMULATIVE)), engine.call(outputs(kinds.FINAL_ONLY))
    assert len(streamed) > 1 and {i for o in streamed for i in o} == {0, 1, 2, 3}
    assert final == [[0, 1, 2, 3]]


def test_engine_arguments_are_vllms(backend, tiny_model_dir):
    """Every engine argument the adapter passes is a field of vLLM's EngineArgs (a name it lacks is a TypeError)."""
    backend.pool("vllm")  # imports this backend's vllm
    import vllm

    rm = rollout_model("vllm")
    names = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    assert set(vllm_engine.engine_args(tiny_model_dir, 256, rm, 1.0, False)) <= names


def test_a_worker_error_comes_back_as_a_bare_exception(backend):
    """collective_rpc re-raises a worker's exception as a bare Exception, whatever its type: the adapter tells the
    failures apart by the call they come from (a folder is checked before any worker reads it; a transfer's failure
    is a SyncError), never by the exception's type."""
    engine = backend.pool("vllm").engines[0]
    with pytest.raises(Exception, match="Worker failed with error") as info:
        engine.init_transfer({"no_such_field": 1})  # init info the engine does not know: a TypeError in the worker
    assert type(info.value) is Exception


# --- weights


@pytest.mark.parametrize("kind", KINDS)
def test_new_weights_from_a_folder_change_the_outputs_and_the_base_ones_restore_them(
    backend, kind, tiny_model_dir, tmp_path
):
    """A published folder through vLLM's in-place reload: the greedy answer changes and the log-probs are the new
    weights' within 1e-4, on a prompt whose KV blocks the old weights had cached (the prefix cache is reset); the
    base folder brings back exactly the first answer and log-probs."""
    pool, ids, tok = backend.pool(kind), prompts(tiny_model_dir)[0], load_tokenizer(tiny_model_dir)
    greedy, sampled = [SamplingParams(temperature=0.0, max_tokens=12)], [SamplingParams(n=2, max_tokens=12, seed=4)]
    before, base_samples = pool.generate([ids], greedy)[0][0], pool.generate([ids], sampled)[0]
    new = perturbed(tiny_model_dir, 0.5)
    try:
        pool.load_weights(str(sync.publish_hf(new, tok, tmp_path, step=3)), version=3)
        after = pool.generate([ids], greedy)[0][0]
        assert after.token_ids != before.token_ids and (pool.model_version, after.model_version) == (3, 3)
        assert gap(new, ids, pool.generate([ids], sampled)[0] + [after]) < 1e-4
    finally:
        pool.load_weights(tiny_model_dir, version=4)
    again = pool.generate([ids], greedy)[0][0]
    assert again.token_ids == before.token_ids and again.logprobs == pytest.approx(before.logprobs, abs=1e-6)
    assert [c.token_ids for c in pool.generate([ids], sampled)[0]] == [c.token_ids for c in base_samples]


@pytest.mark.slow
@pytest.mark.xdist_group("test_vllm_contract::real_pools")
def test_a_request_in_flight_across_a_weight_update_finishes_under_both_versions(real_pools, tiny_model_dir, tmp_path):
    """explorer.partial_rollout's engine side on real vLLM: with in_flight_updates, samples running while new weights
    load (the engine paused with its requests kept) finish with two spans, versions 6 then 7, the oldest their
    model_version (a sample with no token before the update: 7 alone); the log-probs of each span are its own
    weights' (a plain forward pass of each model over the whole sequence): the tokens after the update were sampled
    by the new weights on KV recomputed with them (vLLM preempts the kept requests and prefills them again), not on
    the old weights' KV blocks."""
    pool, ids, tok = real_pools[0]("vllm_async"), prompts(tiny_model_dir)[0], load_tokenizer(tiny_model_dir)
    old, new = load_model(tiny_model_dir), perturbed(tiny_model_dir, 0.5)
    folder = str(sync.publish_hf(new, tok, tmp_path, step=7))
    before = pool.model_version
    pool.model_version, pool.in_flight_updates = 6, True
    try:
        # NOTE: min_tokens = max_tokens: no sample ends by EOS, each runs its ~240 tokens (samples that ended early, all
        # before the update, made this test fail on a quiet machine); the references mask EOS as vLLM did
        length = 256 - len(ids) - 1
        params = SamplingParams(n=4, temperature=1.0, max_tokens=length, min_tokens=length, seed=11)
        running = pool.submit(ids, params)
        time.sleep(0.5)  # tokens under version 6 first
        assert not running.done(), "the samples ended before the update: nothing was in flight"
        pool.load_weights(folder, version=7)
        samples = running.result(timeout=300)
    finally:
        pool.in_flight_updates = False
        pool.load_weights(tiny_model_dir, version=before)
    mixed = [c for c in samples if c.spans]
    assert mixed, [(len(c.token_ids), c.model_version) for c in samples]  # some ran on after the update
    for c in samples:  # a sample vLLM had not scheduled yet (n=4 on the CPU) sampled every token under 7
        versions = [v for _, v in c.spans] or [c.model_version]
        assert versions in ([6], [6, 7], [7]) and c.model_version == versions[0] and c.spans[:1] in ([], [(0, 6)])
    for c in mixed:
        k, lp = c.spans[1][0], torch.tensor(c.logprobs)
        by_old, by_new = (eos_masked_logprobs(m, ids + c.token_ids, len(ids), pool.eos_ids) for m in (old, new))
        assert 0 < k < len(c.token_ids)
        assert (lp[:k] - by_old[:k]).abs().max() < 1e-4
        # NOTE: 1e-3 (measured 4e-4): fp32 sums over up to 250 positions; either weights' KV for the other's tokens
        # would be off by the weights' change, which the two models' own log-probs show is far larger
        assert (lp[k:] - by_new[k:]).abs().max() < 1e-3 < 0.05 < (by_old[k:] - by_new[k:]).abs().max()


def eos_masked_logprobs(model: torch.nn.Module, tokens: list[int], prompt_length: int, eos: list[int]) -> torch.Tensor:
    """plain_logprobs at temperature 1 with the `eos` ids masked at every response position (min_tokens = max_tokens:
    the distribution vLLM sampled from)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, prompt_length - 1 : -1].float()  # [R,V]
    logits[:, eos] = float("-inf")
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[prompt_length:])[:, None])[:, 0]  # [R]


def test_a_folder_the_workers_cannot_load_is_an_oserror_and_nothing_changes(backend, tiny_model_dir, tmp_path):
    """A missing folder, one without weights, one with a cut file: an OSError naming it (sync.load_published
    then loads the newest published folder), the version stays, the engine answers as before."""
    pool, ids = backend.pool("vllm"), prompts(tiny_model_dir)[0]
    greedy = [SamplingParams(temperature=0.0, max_tokens=8)]
    before, version = pool.generate([ids], greedy)[0][0].token_ids, pool.model_version
    empty, cut = tmp_path / "empty", tmp_path / "cut"
    empty.mkdir()
    cut.mkdir()
    data = (Path(tiny_model_dir) / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    for folder, why in (
        (tmp_path / "gone", r"no weights in .*gone \(no folder\)"),
        (empty, "no weights in"),
        (cut, "SafetensorError"),
    ):
        with pytest.raises(OSError, match=f"vLLM workers could not load {folder}: {why}"):
            pool.load_weights(str(folder), version=version + 1)
    assert pool.model_version == version and pool.generate([ids], greedy)[0][0].token_ids == before


def send_in_thread(job_dir: Path, model: torch.nn.Module, version: int) -> threading.Thread:
    """A trainer's rank 0 in a thread, its side of the engines' weight-transfer engine built by vLLM's trainer
    factory (weight_transfer.trainer_engine: GlooTrainerEngine, which the plugin registers, driving the StoreClient):
    serve the group, post the init info, send `model`'s weights (vLLM's ModuleSource; in buckets of 8 KiB: many),
    stop."""
    from vllm.distributed.weight_transfer.base import ModuleSource

    import weight_transfer

    link = wire.open_sender(job_dir, "cpu", timeout=60)
    engine = weight_transfer.trainer_engine(
        "nanorft_gloo", link, 0, ModuleSource(model), SimpleNamespace(sync_timeout=60)
    )
    engine.client.version = version

    def send() -> None:
        engine.send_weights()
        wire.close_sender(link, finished=True, grace=30)

    return threading.Thread(target=send, daemon=True)


@pytest.mark.slow
def test_weights_over_the_group_equal_a_fresh_engine_on_them(backend, tiny_model_dir, tmp_path, monkeypatch):
    """Weights received over the trainer's group (gloo here, NCCL on GPUs: the same code) by both engines' workers,
    bucket by bucket through vLLM's in-place reload, into engines that held other weights (from a folder, checked):
    greedy tokens and log-probs equal those of an engine started on the same weights (the pool itself as it
    started, on the base weights: the trainer sends those); vLLM's weight checksums equal those of the same weights
    loaded from their published folder, and vLLM holds the transfer's version."""
    pool, ids, tok = backend.pool("vllm"), prompts(tiny_model_dir), load_tokenizer(tiny_model_dir)
    started, base = backend.fresh(), load_model(tiny_model_dir)
    monkeypatch.setattr(wire, "BUCKET_BYTES", 8192)
    sender = send_in_thread(tmp_path, base, 5)
    try:
        pool.load_weights(tiny_model_dir, version=3)  # the published folder of the weights the trainer sends
        published = pool.checksums()
        held = perturbed(tiny_model_dir, 0.3)
        pool.load_weights(str(sync.save_hf(held, tok, tmp_path / "held")), version=4)
        assert all(sums.keys() == published[0].keys() != sums for sums in pool.checksums())
        other = pool.generate(ids, [ANSWERS[0]] * 2)
        assert max(gap(held, p, cs) for p, cs in zip(ids, other)) < 1e-4  # every weight was another's
        link = wire.open_receiver(tmp_path, timeout=60, receivers=pool.join_ranks())
        pool.join_group(wire.receive_init(link))
        sender.start()
        posted = wire.receive_header(link)
        header = posted["update_info"]["header"]
        assert len(header["buckets"]) > 10 and pool.receive(posted) == wire.header_bytes(header)
        wire.ack(link)
        assert wire.receive_header(link) is None  # the trainer's stop
        # every engine holds, bit for bit, what loading the published folder gave it (vLLM's checksums), as version 5
        assert pool.checksums() == [published[0]] * len(pool.engines) and len(published[0]) > 10
        assert pool.weight_versions() == ["5"] * len(pool.engines)
        received = answers(pool, ids)
    finally:
        pool.load_weights(tiny_model_dir, version=6)
        sender.join(timeout=60)
    assert pool.model_version == 6
    assert [c.token_ids for cs in other for c in cs] != [c.token_ids for cs in started[0] for c in cs]
    for got, want in zip(received, started):
        for a, b in zip(got, want):
            assert [c.token_ids for c in a] == [c.token_ids for c in b]
            torch.testing.assert_close(
                torch.tensor([x for c in a for x in c.logprobs]),
                torch.tensor([x for c in b for x in c.logprobs]),
                atol=1e-5,
                rtol=0,
            )
    assert gap(base, ids[0], received[1][0]) < 1e-4


def test_the_openai_api_over_vllm_engines_with_the_openai_client(backend, tiny_model_dir):
    """openai_api.py serves the pool: chat completions with n, token ids and the trainer's log-probs."""
    pool, tok, ref = backend.pool("vllm"), load_tokenizer(tiny_model_dir), load_model(tiny_model_dir)
    server = OpenAIServer(EngineHandle(pool, tok, {}, max_model_len=256), "tiny")
    client = openai.OpenAI(base_url=server.start() + "/v1", api_key="EMPTY", max_retries=0)
    try:
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            n=3,
            temperature=0.7,
            max_tokens=6,
            seed=1,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    finally:
        server.stop()
    assert len(out.choices) == 3
    for c in out.choices:
        got = torch.tensor([t.logprob for t in c.logprobs.content])
        want = plain_logprobs(ref, out.prompt_token_ids + c.token_ids, len(out.prompt_token_ids), 0.7)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# --- last: this test leaves the engines' weights half-updated, as a trainer's death mid-transfer does

TRAINER = """
import os, sys
from safetensors.torch import load_file
import wire
wire.BUCKET_BYTES = 8192
link = wire.open_sender(sys.argv[1], "cpu", timeout=60)
params = load_file(os.path.join(sys.argv[2], "model.safetensors"))  # the model's weights (transformers unimported)
specs = [(n, tuple(p.shape), p.dtype) for n, p in params.items()]
first = wire.buckets(specs)[0]
# what weight_transfer.GlooTrainerEngine posts through its StoreClient (without importing vLLM here)
wire.post_init(link, {"job_dir": sys.argv[1], "timeout": 60, "rank_offset": 1})
header = wire.make_header(1, specs)
wire.post_header(link, {"version": 1, "update_info": {"header": header}})

def tensors():
    for i, p in enumerate(params.values()):
        if i == len(first):  # the first bucket went out: die before the second
            os._exit(3)
        yield p

wire.send_buckets(link, header, specs, tensors())
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_transfer_gives_the_restart_message(backend, tiny_model_dir, tmp_path, caplog):
    """The trainer dies after the first of many buckets: the explorer (sync.ExplorerSync.receive) logs that no
    weights of the step came, why, and to restart, and returns exit code 1; no traceback, no hang."""
    pool = backend.pool("vllm")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(tmp_path), tiny_model_dir],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    cfg = SimpleNamespace(checkpoint_job_dir=str(tmp_path), synchronizer=SimpleNamespace(sync_timeout=120))
    weights = sync.ExplorerSync(cfg, None, pool)
    start = time.monotonic()
    try:
        code, metrics = weights.receive(5, step=4)
    finally:
        trainer.wait(timeout=60)
    assert (code, metrics, trainer.returncode) == (1, {}, 3) and time.monotonic() - start < 100
    assert "no weights of step 5 from the trainer: weight transfer 0 broke after" in caplog.text
    assert "stopping. Restart to continue after step 4." in caplog.text
    assert pool.model_version != 5


class Kept:
    """The module's engine pool lent to code that closes the pool it made: everything but close() is the pool's."""

    def __init__(self, pool: vllm_engine.EnginePool) -> None:
        self.pool = pool

    def __getattr__(self, name: str):
        return getattr(self.pool, name)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_verify_sync_on_the_engines(backend, tiny_model_dir, tmp_path, monkeypatch):
    """--verify-sync (sync_check.verify) on a vllm_async engine: a stage's config, the model's weights through the
    trainer's side of the gloo engine and vLLM's lifecycle, then from their folder: vLLM's checksums agree and its
    weight version is the transfer's. (The module's engine, not one of its own: it holds the base weights again after,
    the folder's.)"""
    import configs
    import sync_check
    from helpers import both_config

    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{"synchronizer.sync_method": "nccl", "explorer.rollout_model": {"engine_type": "vllm_async"}},
    )
    (stage,) = configs.resolve_stages(configs.cli(["--config", str(config)])[0])
    pool = backend.pool("vllm_async")
    monkeypatch.setattr(sync_check, "make_engine", lambda *a, **k: Kept(pool))
    assert sync_check.verify(stage) == ""
    assert pool.weight_versions() == ["2"]  # the folder's load came after the transfer's version 1


# --- the fake's RL API against the installed vLLM's

LIFECYCLE = [
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "update_weight_version",
    "get_weight_version",
    "shutdown_weight_transfer_engine",
]


def fake_signatures(path: Path, cls: str) -> dict[str, list[str]]:
    """The fake's class `cls` in `path` (parsed, not imported: `import vllm` is the real one here): method -> its
    parameter names after self, keyword-only ones marked '*name'."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {
        f.name: [a.arg for a in f.args.args[1:]] + [f"*{a.arg}" for a in f.args.kwonlyargs]
        for f in node.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def real_signature(fn) -> list[str]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [f"*{p.name}" if p.kind is p.KEYWORD_ONLY else p.name for p in params]


def test_the_fakes_rl_api_has_the_installed_vllms_names_and_signatures():
    """Every lifecycle call the adapter makes, on LLM and on the async engine, and the worker methods behind them, and
    the base classes' fields the engine reads: the fake's names and parameters are the installed vLLM's."""
    real_vllm()
    import vllm
    from vllm.distributed.weight_transfer import base
    from vllm.v1.worker.gpu_worker import Worker

    fake = FAKE_VLLM / "vllm" / "__init__.py"
    for cls, real in (("LLM", vllm.LLM), ("AsyncLLMEngine", vllm.AsyncLLMEngine)):
        ours = fake_signatures(fake, cls)
        for name in [*LIFECYCLE, *(["compute_weight_checksums"] if cls != "LLM" else [])]:
            assert ours[name] == real_signature(getattr(real, name)), (cls, name)
        if cls == "AsyncLLMEngine":
            assert all(inspect.iscoroutinefunction(getattr(real, n)) for n in LIFECYCLE)
            for name in ("pause_generation", "resume_generation", "is_paused"):  # partial rollout's keep_requests
                assert ours[name] == real_signature(getattr(real, name)), (cls, name)
    worker = fake_signatures(fake, "Worker")
    for name in ("init_weight_transfer_engine", "start_weight_update", "finish_weight_update"):
        assert worker[name] == real_signature(getattr(Worker, name)), name
    assert worker["compute_weight_checksums"] == real_signature(Worker.compute_weight_checksums)
    fake_base = FAKE_VLLM / "vllm" / "distributed" / "weight_transfer" / "base.py"
    for cls in ("WeightTransferInitRequest", "WeightTransferUpdateRequest"):
        node = next(n for n in ast.parse(fake_base.read_text()).body if getattr(n, "name", "") == cls)
        fields = [a.target.id for a in node.body if isinstance(a, ast.AnnAssign)]
        assert fields == [f.name for f in dataclasses.fields(getattr(base, cls))], cls
