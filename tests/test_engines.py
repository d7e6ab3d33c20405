"""engines.py: HFEngine against a plain forward pass of the same model, per-request sampling params
in one batch, batching across threads, weight loading, make_engine, EngineHandle; the vLLM engines' contract
runs on real vLLM in tests/test_vllm_contract.py (its CPU build here, vLLM on a GPU machine)."""

import dataclasses
import importlib.util
import logging
import re
import threading

import pytest
import torch

import batching
import engines
import source
from configs.schema import InferenceModelConfig, ModelConfig
from engines import Completion, EngineHandle, HFEngine, make_engine
from helpers import both_config, launch, raw, write_config
from models import config_tokenizer, load_model
from sampling import PromptTooLong, SamplingParams
from tiny import CHAT_TEMPLATE as tiny_chat_template

HAVE_VLLM_GPU = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()
TEXTS = ["What is 2 + 3?", "Tom has 4 apples and buys 5 more.", "hi", "A shop had 12 pens and sold 7 of them."]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with HFEngine(tiny_model_dir) as e:
        yield e


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return load_model(tiny_model_dir)  # loaded independently of the engine


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]


def ref_logprobs(
    model, prompt: list[int], response: list[int], temperature: float, min_tokens: int = 0, eos: list[int] = ()
) -> torch.Tensor:
    """One plain forward pass over prompt + response: log_softmax(logits / T) at the response tokens, the ids `eos`
    masked (-inf) at the first `min_tokens` (what a request with min_tokens samples from)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]  # [R, V]
    logits[:min_tokens, list(eos)] = float("-inf")
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]  # [R]


def greedy_by_hand(model, prompt: list[int], max_tokens: int, eos_ids: list[int]) -> list[int]:
    """Argmax decoding without a KV cache or padding: the whole sequence every step."""
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
            if out[-1] in eos_ids:
                break
    return out


def max_logprob_diff(model, prompts, outs, temperature, min_tokens: int = 0, eos: list[int] = ()) -> float:
    return max(
        (ref_logprobs(model, p, c.token_ids, temperature, min_tokens, eos) - torch.tensor(c.logprobs))
        .abs()
        .max()
        .item()
        for p, cs in zip(prompts, outs)
        for c in cs
    )


# --- log-probs: the engine's must be what a plain forward pass computes
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_a_plain_forward_pass(engine, ref, prompts, temperature):
    params = SamplingParams(n=3, temperature=temperature, top_k=0, top_p=1.0, max_tokens=32, seed=7)
    outs = engine.generate(prompts, [params] * len(prompts))  # left-padded: prompts differ in length
    assert [len(cs) for cs in outs] == [3] * len(prompts)
    diff = max_logprob_diff(ref, prompts, outs, temperature)
    print(f"max |engine - forward| log-prob diff at T={temperature}: {diff:.2e}")
    assert diff < 1e-4


def test_top_k_top_p_filter_the_sample_not_the_logprobs(engine, ref, prompts):
    outs = engine.generate(
        prompts,
        [
            SamplingParams(n=4, temperature=0.7, top_k=5, max_tokens=24, seed=1),
            SamplingParams(n=4, temperature=0.7, top_p=0.05, max_tokens=24, seed=1),
        ]
        * 2,
    )
    assert max_logprob_diff(ref, prompts, outs, 0.7) < 1e-4  # still the unfiltered distribution
    for p, cs, (top_k, top_p) in zip(prompts, outs, [(5, 1.0), (264, 0.05)] * 2):
        for c in cs:
            with torch.no_grad():
                probs = (ref(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1 : -1] / 0.7).softmax(-1)  # [R, V]
            picked = probs.gather(-1, torch.tensor(c.token_ids)[:, None])  # [R, 1]
            assert (probs > picked).sum(-1).max().item() < top_k  # rank of the sampled token
            assert (probs * (probs > picked)).sum(-1).max().item() < top_p + 1e-6  # mass ranked above it


def test_samples_follow_the_tempered_distribution(engine, ref, prompts):
    n, temperature = 3000, 0.05  # the random model is near-flat; T = 0.05 makes a few tokens dominate
    (cs,) = engine.generate(prompts[:1], [SamplingParams(n=n, temperature=temperature, max_tokens=1, seed=0)])
    with torch.no_grad():
        probs = (ref(torch.tensor([prompts[0]])).logits[0, -1] / temperature).softmax(-1)  # [V]
    freq = torch.bincount(torch.tensor([c.token_ids[0] for c in cs]), minlength=len(probs)) / n  # [V]
    top = probs.topk(5).indices
    print("top-5 probs", probs[top].tolist(), "frequencies", freq[top].tolist())
    assert probs[top].sum() > 0.5 and (freq - probs).abs().max() < 0.04  # ~4 standard errors at n=3000


# --- per-request sampling params in one batch
def test_one_batch_mixes_lengths_greedy_and_samples(engine, ref, prompts):
    params = [
        SamplingParams(max_tokens=5, min_tokens=5, seed=1),
        SamplingParams(n=2, max_tokens=12, min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(max_tokens=30, min_tokens=30, seed=2),
    ]
    before = engine.num_batches
    outs = engine.generate(prompts, params)
    assert engine.num_batches == before + 1
    assert [[len(c.token_ids) for c in cs] for cs in outs] == [[5], [12, 12], [len(outs[2][0].token_ids)], [30]]
    assert all(c.truncated and c.finish_reason == "length" for i in (0, 1, 3) for c in outs[i])
    assert all(len(c.logprobs) == len(c.token_ids) for cs in outs for c in cs)
    greedy = outs[2][0]
    assert greedy.token_ids == greedy_by_hand(ref, prompts[2], 20, engine.eos_ids)
    assert greedy.truncated == (greedy.token_ids[-1] not in engine.eos_ids)


def test_greedy_equals_argmax_decoding(engine, ref, prompts):
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=25)] * len(prompts))
    for p, cs in zip(prompts, outs):
        assert cs[0].token_ids == greedy_by_hand(ref, p, 25, engine.eos_ids)
    assert max_logprob_diff(ref, prompts, outs, 1.0) < 1e-4  # greedy reports T = 1 log-probs


def test_stop_string_ends_the_text_at_it(engine):
    stop = list("aeiou0123456789 ")  # the untrained model emits random bytes: one shows up soon
    outs = engine.generate(
        [engine.tokenizer.encode(TEXTS[0])] * 8, [SamplingParams(max_tokens=200, stop=stop, seed=s) for s in range(8)]
    )
    for (c,) in outs:
        full = engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if c.finish_reason == "stop" and c.token_ids[-1] not in engine.eos_ids:
            assert not any(s in c.text for s in stop) and any(s in full for s in stop)
            assert full.startswith(c.text) and full[len(c.text)] in stop  # cut right before it
            assert not any(s in engine.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True) for s in stop)
    assert sum(c.finish_reason == "stop" for (c,) in outs) >= 6


def test_seed_reproduces_and_samples_differ(engine, prompts):
    p = SamplingParams(n=4, max_tokens=16, seed=123)
    a = engine.generate(prompts[:1], [p])[0]
    b = engine.generate(prompts, [p, p, p, p])[0]  # another call, another batch composition
    c = engine.generate(prompts[:1], [SamplingParams(n=4, max_tokens=16, seed=124)])[0]
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert len({tuple(x.token_ids) for x in a}) == 4  # the sample index changes the stream
    assert all(x.token_ids != y.token_ids for x, y in zip(a, c))


def test_min_tokens_suppresses_eos(tiny_model_dir):
    # A flat model (final norm weight 0 -> all logits 0): EOS (2 of 264 ids) comes ~0.8% of steps.
    with HFEngine(tiny_model_dir) as e:
        state = {k: v.clone() for k, v in e.model.state_dict().items()}
        state["model.norm.weight"].zero_()
        e.load_weights(state, version=1)
        prompt = e.tokenizer.encode("hi")
        free = e.generate([prompt], [SamplingParams(n=64, max_tokens=40, seed=0)])[0]
        held = e.generate([prompt], [SamplingParams(n=64, max_tokens=40, min_tokens=30, seed=0)])[0]
    assert sum(len(c.token_ids) < 30 for c in free) >= 5  # without min_tokens EOS does come early
    assert all(len(c.token_ids) >= 30 for c in held)
    assert all(t not in e.eos_ids for c in held for t in c.token_ids[:30])
    assert any(c.finish_reason == "stop" and c.token_ids[-1] in e.eos_ids for c in held)


def test_max_model_len_clamps_and_refuses(tiny_model_dir):
    with HFEngine(tiny_model_dir, max_model_len=20) as e:
        (c,) = e.generate([list(range(65, 80))], [SamplingParams(max_tokens=50, min_tokens=50)])[0]
        assert len(c.token_ids) == 5 and c.truncated
        with pytest.raises(ValueError, match="max_model_len=20"):
            e.generate([list(range(65, 85))], [SamplingParams()])
        with pytest.raises(ValueError, match="max_model_len=20"):
            e.submit(list(range(65, 85)), SamplingParams())


def test_batches_larger_than_max_batch_size_are_split(engine, prompts):
    engine.max_batch_size, before = 4, engine.num_batches
    try:
        outs = engine.generate(prompts[:2], [SamplingParams(n=5, max_tokens=4, seed=3)] * 2)
    finally:
        engine.max_batch_size = 64
    assert engine.num_batches - before == 3 and [len(cs) for cs in outs] == [5, 5]


# --- many callers, shared batches
def test_concurrent_submits_share_batches(engine, prompts):
    many = [prompts[i % 4] + [65 + i] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = [cs[0].token_ids for cs in engine.generate(many, [params] * 16)]
    results, barrier = [None] * 16, threading.Barrier(16)

    def runner(i):
        barrier.wait()
        results[i] = engine.submit(many[i], params).result(timeout=60)

    before = engine.num_batches
    threads = [threading.Thread(target=runner, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"16 concurrent requests ran in {engine.num_batches - before} batch(es)")
    assert engine.num_batches - before < 16
    assert [r[0].token_ids for r in results] == expected


def test_a_failed_batch_fails_its_futures_not_the_worker(engine, prompts):
    bad = engine.submit([10_000], SamplingParams(max_tokens=2))  # token id outside the vocabulary
    with pytest.raises(IndexError):
        bad.result(timeout=60)
    assert len(engine.submit(prompts[0], SamplingParams(max_tokens=3)).result(timeout=60)[0].token_ids) <= 3


def test_close_stops_the_worker(tiny_model_dir):
    e = HFEngine(tiny_model_dir)
    assert isinstance(e.submit([65, 66], SamplingParams(max_tokens=2)).result(timeout=60)[0], Completion)
    e.close()
    assert not e.batcher.worker.is_alive()
    with pytest.raises(RuntimeError):
        e.submit([65], SamplingParams())


# --- weights
def test_load_weights_from_a_folder_and_a_state_dict(tiny_model_dir, ref, prompts, tmp_path):
    other = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    other.save_pretrained(tmp_path / "other")
    other_ref = load_model(str(tmp_path / "other"))
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    with HFEngine(tiny_model_dir) as e:
        before = e.generate(prompts, [greedy] * 4)
        e.load_weights(str(tmp_path / "other"), version=3)
        after = e.generate(prompts, [greedy] * 4)
        assert e.model_version == 3 and after[0][0].model_version == 3
        assert [cs[0].token_ids for cs in after] == [greedy_by_hand(other_ref, p, 20, e.eos_ids) for p in prompts]
        assert [cs[0].token_ids for cs in after] != [cs[0].token_ids for cs in before]
        assert max_logprob_diff(other_ref, prompts, after, 1.0) < 1e-4
        # tied embeddings: a trainer's state dict may leave out lm_head.weight
        state = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
        e.load_weights(state, version=4)
        assert e.model_version == 4
        assert [cs[0].token_ids for cs in e.generate(prompts, [greedy] * 4)] == [cs[0].token_ids for cs in before]
        assert torch.equal(e.model.lm_head.weight, ref.model.embed_tokens.weight)


# --- choosing an engine
def test_make_engine_picks_and_says_why(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="nanorft.engines")
    e = make_engine(InferenceModelConfig(engine_type="auto"), tiny_model_dir, max_model_len=256)
    try:
        assert (e.engine_type == "vllm") if HAVE_VLLM_GPU else isinstance(e, HFEngine)
        assert "engine_type=auto" in caplog.text
        if not HAVE_VLLM_GPU:
            assert "rollout engine: HF" in caplog.text and ("not installed" in caplog.text or "absent" in caplog.text)
    finally:
        e.close()
    e = make_engine(InferenceModelConfig(engine_type="hf"), tiny_model_dir, max_model_len=256)
    e.close()
    assert isinstance(e, HFEngine) and "engine_type=hf in the config" in caplog.text


# --- the handle workflows get
def test_model_handle_chat_returns_consistent_experiences(engine):
    handle = EngineHandle(engine, engine.tokenizer, {"temperature": 1.0, "max_tokens": 8})
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    exps = handle.chat(messages, n=3, min_tokens=8, seed=5)
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    assert len(exps) == 3 and handle.model_version == engine.model_version
    for x in exps:
        assert x.prompt_text == prompt and x.prompt_length == len(ids) and x.tokens[: len(ids)].tolist() == ids
        assert x.tokens.dtype == torch.long and x.logprobs.dtype == torch.float32
        assert len(x.tokens) == x.prompt_length + len(x.logprobs) == x.prompt_length + 8
        assert x.truncate_status == "response_truncated"
    groups = handle.generate(["abc", "hello"], n=2, max_tokens=4)
    assert [len(g) for g in groups] == [2, 2] and groups[1][0].prompt_text == "hello"
    with pytest.raises(TypeError, match="max_new_tokens"):
        handle.chat(messages, max_new_tokens=4)
    with pytest.raises(TypeError, match="do_sample"):
        EngineHandle(engine, engine.tokenizer, {"do_sample": True})


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_score_is_each_tokens_logprob_given_those_before_it(engine, ref, temperature, monkeypatch):
    """score(): a teacher's view of sequences of different lengths (right-padded into one pass, or several passes when
    SCORE_ELEMENTS is small) is a plain forward pass over each alone; the handle's slice at prompt_length - 1 is the
    response's log-probs, the ones sampling reported."""
    handle = EngineHandle(engine, engine.tokenizer, {"temperature": temperature, "max_tokens": 10})
    exps = handle.chat([{"role": "user", "content": "What is 2 + 3?"}], n=2, seed=3) + handle.generate(["hi"])[0]
    for elements in (engines.SCORE_ELEMENTS, 1):  # one pass for all; one pass per sequence
        monkeypatch.setattr(engines, "SCORE_ELEMENTS", elements)
        scored = handle.score([x.tokens for x in exps], temperature=temperature)
        for x, lp in zip(exps, scored):
            assert lp.dtype == torch.float32 and lp.shape == (len(x.tokens) - 1,)
            full = x.tokens.tolist()
            assert torch.allclose(lp, ref_logprobs(ref, full[:1], full[1:], temperature), atol=1e-5)
            assert torch.allclose(lp[x.prompt_length - 1 :], x.logprobs, atol=1e-4)  # what sampling reported
    with pytest.raises(ValueError, match="no token to score"):
        engine.score([[5]])
    with pytest.raises(ValueError, match="longer than this engine scores: 2048 \\(its max_model_len\\)"):
        engine.score([[5] * 2049])
    with pytest.raises(ValueError, match="scoring temperature = 0"):
        engine.score([[5, 6]], temperature=0)


def _model_cfg(tiny_model_dir: str, **kw) -> ModelConfig:
    return dataclasses.replace(ModelConfig(model_path=tiny_model_dir, max_model_len=256), **kw)


def test_config_chat_templates_and_enable_thinking_reach_every_rendering(tiny_model_dir, tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    own = config_tokenizer(_model_cfg(tiny_model_dir)).apply_chat_template(messages, tokenize=False)
    custom = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if enable_thinking %}[think]{% endif %}"
    tok = config_tokenizer(_model_cfg(tiny_model_dir, custom_chat_template=custom))
    assert own.startswith("<|im_start|>user") and tok.apply_chat_template(messages, tokenize=False) == "<hi>"
    (tmp_path / "t.jinja").write_text("FILE{{ messages[0]['content'] }}")
    path = str(tmp_path / "t.jinja")
    tok = config_tokenizer(_model_cfg(tiny_model_dir, custom_chat_template=custom, chat_template_path=path))
    assert tok.apply_chat_template(messages, tokenize=False) == "FILEhi"  # the file wins
    tok = config_tokenizer(_model_cfg(tiny_model_dir, custom_chat_template=custom, enable_thinking=True))
    assert tok.apply_chat_template(messages, tokenize=False) == "<hi>[think]"
    assert source.render(tok, messages) == tok.encode("<hi>[think]", add_special_tokens=False)  # SFT rendering too
    assert config_tokenizer(_model_cfg(tiny_model_dir)).chat_template == tiny_chat_template  # others untouched


def test_handle_renders_tools_template_and_reply_prefix(engine):
    handle = EngineHandle(engine, engine.tokenizer, {"max_tokens": 2})
    messages = [{"role": "user", "content": "hi"}]
    template = "{{ messages[0]['content'] }}|{{ tools | length if tools else 'none' }}|"
    (x, *_) = handle.chat(
        messages, tools=[{"name": "calc"}, {"name": "x"}], chat_template=template, reply_prefix="The answer"
    )
    assert x.prompt_text == "hi|2|The answer"  # tools reached the template; the prefix ends the prompt
    assert x.tokens[: x.prompt_length].tolist() == engine.tokenizer.encode("hi|2|The answer", add_special_tokens=False)
    assert not x.response_text.startswith("The answer")


def test_over_long_prompts_are_cut_and_masked_or_refused_once(engine):
    long = "a long prompt " * 20
    handle = EngineHandle(engine, engine.tokenizer, {"max_tokens": 3, "temperature": 0.6}, max_prompt_tokens=16)
    x, y = handle.generate([long, "short"], n=1)[0][0], handle.generate(["short"], n=1)[0][0]
    ids = engine.tokenizer.encode(long, add_special_tokens=False)
    assert x.truncate_status == "prompt_truncated" and x.tokens[:16].tolist() == ids[-16:]
    assert y.truncate_status in (None, "response_truncated") and y.info["temperature"] == 0.6
    batch = batching.step_batch([x, y], 3)
    assert not batch["response_mask"][0].any() and batch["response_mask"][1].any()  # no loss on the cut prompt
    assert batch["temperature"].tolist() == pytest.approx([0.6, 0.6])  # scored at the temperature it was sampled at
    strict = EngineHandle(engine, engine.tokenizer, {"max_tokens": 3}, max_prompt_tokens=16, truncate=False)
    with pytest.raises(PromptTooLong, match="exceeds model.max_prompt_tokens"):
        strict.generate([long])


def test_min_response_tokens_and_ignore_eos_defaults(tiny_model_dir):
    # the flat model of test_min_tokens_suppresses_eos: EOS comes early in some of 64 samples unless held back
    with HFEngine(tiny_model_dir) as e:
        state = {k: v.clone() for k, v in e.model.state_dict().items()}
        state["model.norm.weight"].zero_()
        e.load_weights(state, version=1)
        free = EngineHandle(e, e.tokenizer, {"max_tokens": 40, "seed": 0}).generate(["hi"], n=64)[0]
        held = EngineHandle(e, e.tokenizer, {"max_tokens": 40, "seed": 0, "min_tokens": 30}).generate(["hi"], n=64)[0]
        to_end = EngineHandle(e, e.tokenizer, {"max_tokens": 40, "seed": 0}, ignore_eos=True).generate(["hi"], n=64)[0]
    assert sum(x.response_length < 30 for x in free) >= 5
    assert all(x.response_length >= 30 for x in held)  # model.min_response_tokens is the handle's default min_tokens
    assert all(x.response_length == 40 for x in to_end)  # ignore_eos: every sample runs to max_tokens


def test_a_groups_prompt_is_prefilled_once(tiny_model_dir, ref, prompts):
    """3 requests x n=4: the prompt pass runs 3 rows (one per request), the decode steps 12 (one per sample), and
    every sample's log-probs still match a plain forward pass (the shared KV cache is the prompt's)."""
    with HFEngine(tiny_model_dir) as e:
        calls = []
        forward = e.model.forward

        def counting(*args, **kwargs):
            calls.append(tuple(kwargs["input_ids"].shape))
            return forward(*args, **kwargs)

        e.model.forward = counting
        outs = e.generate(prompts[:3], [SamplingParams(n=4, max_tokens=6, min_tokens=6, seed=s) for s in range(3)])
    assert calls[0] == (3, max(len(p) for p in prompts[:3]))  # [requests, longest prompt]
    assert calls[1:] and all(shape == (12, 1) for shape in calls[1:])
    assert max_logprob_diff(ref, prompts[:3], outs, 1.0, 6, e.eos_ids) < 1e-4  # of the distribution with EOS masked


def test_a_request_that_breaks_a_shared_batch_fails_alone_and_bad_values_are_refused_at_submit():
    """sampling.Batcher: a batch that fails is run again one request at a time, so only the request that breaks it
    fails (here run_batch raises for any batch holding a "poisoned" max_tokens); check_request refuses, naming the
    field, the values that broke a decode before (min_tokens 2**63, NaN temperature) before they are queued."""
    from sampling import Batcher, check_request

    def run_batch(prompts, params):
        if any(p.max_tokens == 13 for p in params):
            raise RuntimeError("poisoned batch")
        return [[Completion([p[0]], [0.0], "x", "stop")] for p in prompts]

    batcher = Batcher(run_batch, max_model_len=64, wait_s=0.2, max_wait_s=1.0)
    try:
        futures = [batcher.submit([i + 1], SamplingParams(max_tokens=13 if i == 2 else 4)) for i in range(5)]
        with pytest.raises(RuntimeError, match="poisoned batch"):
            futures[2].result(timeout=30)
        assert [f.result(timeout=30)[0].token_ids for k, f in enumerate(futures) if k != 2] == [[1], [2], [4], [5]]
    finally:
        batcher.close()
    for field, value, message in [
        ("min_tokens", 2**63, r"min_tokens = 9223372036854775808: an integer in \[0, "),
        ("n", 0, r"n = 0: an integer in \[1, "),
        ("top_k", -5, "top_k = -5"),
        ("temperature", float("nan"), "temperature = nan"),
        ("temperature", 1e-300, "temperature = 1e-300: 0 .greedy. or a finite number"),
        ("top_p", float("nan"), "top_p = nan"),
        ("seed", 2**64, "seed = "),
    ]:
        with pytest.raises(ValueError, match=message):
            check_request([1, 2], SamplingParams(**{field: value}), 64)
    check_request([1, 2], SamplingParams(temperature=0, seed=-1, top_k=0, min_tokens=100), 64)  # all valid


# --- an external auxiliary model: an OpenAI-compatible endpoint (engines.ExternalHandle)


class Scripted:
    """An HTTP server on loopback that answers every POST after `delay` seconds with `body` (status `status`): a
    stand-in for a broken or slow endpoint. Its URL: `.url` (with /v1); `.requests`: the bodies it got."""

    def __init__(self, body: bytes, status: int = 200, delay: float = 0.0) -> None:
        import http.server
        import json

        requests = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                threading.Event().wait(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting (a timeout)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def external(url: str, **over):
    from configs.schema import ExternalModelConfig

    return ExternalModelConfig(**{"base_url": url, "model_name": "judge", "api_key_env": "", **over})


def test_an_external_handle_sends_chat_messages_and_reads_the_reply():
    """What reaches the endpoint: the model name, the messages, n = 1 and the sampling keys (OpenAI's as fields,
    vLLM's top_k in the body), with the key from the environment variable the config names; the reply's text comes
    back, one per conversation, in order."""
    from engines import ExternalHandle

    reply = b'{"id": "c", "object": "chat.completion", "created": 0, "model": "judge", "choices": [{"index": 0, '
    reply += b'"message": {"role": "assistant", "content": "Score: 7"}, "finish_reason": "stop"}]}'
    server = Scripted(reply)
    try:
        handle = ExternalHandle(external(server.url), "explorer.auxiliary_models[0]")
        conversations = [[{"role": "user", "content": f"grade {k}"}] for k in range(3)]
        assert handle.replies(conversations, temperature=0.0, max_tokens=16, top_k=5) == ["Score: 7"] * 3
        got = sorted(server.requests, key=lambda r: r["messages"][0]["content"])
        assert [r["messages"] for r in got] == conversations
        assert {(r["model"], r["n"], r["temperature"], r["max_tokens"], r["top_k"]) for r in got} == {
            ("judge", 1, 0.0, 16, 5)
        }
        with pytest.raises(TypeError, match="unknown sampling argument"):
            handle.replies(conversations, presence_penalty=1.0)
    finally:
        server.close()


@pytest.mark.parametrize(
    "body, status, delay, says",
    [
        (b'{"error": {"message": "model overloaded"}}', 503, 0.0, "HTTP 503: "),
        (b'{"id": "c", "object": "chat.completion", "created": 0, "model": "j", "choices": []}', 200, 0.0, "a reply w"),
        (b"<html>not json</html>", 200, 0.0, "a bad reply \\(JSONDecodeError: Expecting value"),
        (b"{}", 200, 2.0, "no reply within 0.5 s"),
    ],
    ids=["error-status", "no-choices", "not-json", "timeout"],
)
def test_an_external_endpoints_failure_is_a_named_error(body, status, delay, says):
    """An error status, a reply with no text, a body that is no JSON, a reply later than `timeout`: each is an
    ExternalModelError naming the endpoint and what went wrong (the judgement fails; nothing else does)."""
    from engines import ExternalHandle, ExternalModelError

    server = Scripted(body, status, delay)
    try:
        handle = ExternalHandle(external(server.url, timeout=0.5, max_retries=0), "explorer.auxiliary_models[0]")
        with pytest.raises(ExternalModelError, match=f"external model 'judge' at {server.url}: {says}"):
            handle.replies([[{"role": "user", "content": "hi"}]], temperature=0.0)
    finally:
        server.close()


def test_an_external_endpoint_that_is_down_or_without_its_key(monkeypatch):
    """A closed port: "cannot connect", at once (no retries); the API key's variable unset: a ConfigError naming the
    key and the variable, before any request."""
    import socket

    from configs import ConfigError
    from engines import ExternalHandle, ExternalModelError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed once the block ends
    handle = ExternalHandle(external(url, max_retries=0), "explorer.auxiliary_models[0]")
    with pytest.raises(ExternalModelError, match=f"external model 'judge' at {url}: cannot connect"):
        handle.replies([[{"role": "user", "content": "hi"}]])
    monkeypatch.delenv("NANORFT_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"auxiliary_models\[1\].external_model_config.api_key_env = 'NANORFT_NO_SU"):
        ExternalHandle(external(url, api_key_env="NANORFT_NO_SUCH_KEY"), "explorer.auxiliary_models[1]")


@pytest.mark.slow
def test_mode_both_with_an_external_judge_on_loopback(tmp_path, tiny_model_dir, judge_dir, caplog):
    """A real run (launch.py, mode both: explorer and trainer processes) whose llm_judge_workflow grades with an
    external auxiliary model: nanorft's own OpenAI-compatible API (openai_api.py) started here on loopback over a
    model trained to answer "Score: 7", behind an API key that the config names by its environment variable only.
    Every experience's reward is the judge's 0.7, and the key is in no file of the run. Then an explorer (mode
    explore) whose judge is down: each task fails by name (ExternalModelError, cannot connect) and is dropped,
    and the explorer runs its steps to the end."""
    import explore
    from configs import cli, resolve_stages
    from openai_api import OpenAIServer

    aux = {"engine_type": "external", "external_model_config": {"model_name": "judge-7b"}}
    aux["external_model_config"]["api_key_env"] = "NANORFT_TEST_JUDGE_KEY"
    judged = {
        "buffer.default_workflow_type": "llm_judge_workflow",
        "buffer.default_reward_fn_type": None,
        "buffer.explorer_input.taskset.workflow_args": {"judge_max_tokens": 16},
        "buffer.explorer_input.eval_tasksets": [],
        "explorer.max_retry_times": 0,
    }
    with HFEngine(judge_dir) as engine:
        handle = EngineHandle(engine, engine.tokenizer, max_model_len=512)
        server = OpenAIServer(handle, "judge-7b", api_key="k-secret-judge")
        url = server.start() + "/v1"
        try:
            aux["external_model_config"]["base_url"] = url
            both = {"explorer.auxiliary_models": [aux], "buffer.total_steps": 2}
            config = both_config(tmp_path / "both", tiny_model_dir, **judged, **both)
            out = launch(config, env={"NANORFT_TEST_JUDGE_KEY": "k-secret-judge"})
        finally:
            server.stop()
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "both" / "ck" / "p" / "run"
    rewards = raw(f"sqlite:///{run / 'buffer' / 'exp.db'}", "SELECT reward FROM experiences")
    assert len(rewards) == 2 * 2 * 2 and {r for (r,) in rewards} == {0.7}  # 2 steps x 2 tasks x 2 responses
    written = [p for p in run.rglob("*") if p.is_file() and p.suffix in (".yaml", ".json", ".jsonl", ".log")]
    assert written and not [p for p in written if b"k-secret-judge" in p.read_bytes()]
    # the same endpoint, now down (the server stopped): each task fails by name, the explorer carries on (in this
    # process: the explorer as a process is the run above's)
    aux["external_model_config"]["api_key_env"] = ""
    config = write_config(tmp_path / "down", tiny_model_dir, **judged, **{"explorer.auxiliary_models": [aux]})
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    with caplog.at_level(logging.ERROR, logger="nanorft.explore"):
        assert explore.explore(cfg) == 0
    dropped = re.findall(
        r"task (\S+) dropped after 1 attempts: ExternalModelError: external model 'judge-7b' at "
        + re.escape(url)
        + ": cannot connect",
        caplog.text,
    )
    # 4 steps x (3 tasks + 3 read in their place: explorer.max_refill_rounds 1), each task once
    assert len(dropped) == len(set(dropped)) == 4 * (3 + 3), caplog.text[-3000:]


# --- scripts/profile_decode.py: where a decode step's time goes (docs/LOG.md, 2026-11-29)
def test_profile_decode_splits_each_run_into_prefill_forward_and_the_rest(tiny_model_dir, capsys):
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_decode.py"
    spec = importlib.util.spec_from_file_location("profile_decode", script)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    taskset = Path(tiny_model_dir).parent / "arith" / "test.jsonl"
    args = ["--model", tiny_model_dir, "--taskset", str(taskset), "--prompts", "2", "--n", "3", "--max-tokens", "5"]
    results = profile.main([*args, "--rounds", "1", "--threads", "1"])
    assert sorted(results) == ["engine", "generate"]
    for r in results["engine"] + results["generate"]:
        # 6 rows of at most 5 tokens: at most 4 forward passes after the prefill (the last token needs none)
        assert 0 < r["tokens"] <= 2 * 3 * 5 and 1 <= r["steps"] <= 4
        # NOTE: the parts and the whole are read from the thread's CPU clock at different moments: 1 ms of slack
        assert 0 < r["prefill_s"] and 0 < r["forward_s"] and r["prefill_s"] + r["forward_s"] <= r["cpu_s"] + 1e-3
        assert r["cpu_s"] <= r["wall_s"] + 1e-3
    out = capsys.readouterr().out
    assert "1 torch thread(s)" in out and out.count("| engine |") == 1 and out.count("| generate |") == 1
