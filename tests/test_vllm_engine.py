"""vllm_engine.py's GPU side, against the fake vLLM (tests/fake_vllm) on pretend GPUs: what a CPU cannot show with
real vLLM. engine_num engines on their own GPUs with tensor_parallel_size workers each, weights into every worker of
every engine (bf16 on the wire), sleep / wake-up on a GPU shared with the trainer (level 1 keeps the weights, level
2 discards them), the prefix-cache reset retried while vLLM refuses it, and the one-GPU colocated run end to end.
Everything the fake imitates besides is checked against real vLLM in tests/test_vllm_contract.py."""

import dataclasses
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import sync
import vllm_engine
import weight_transfer
import wire
from configs.schema import InferenceModelConfig
from engines import EngineHandle, HFEngine, SamplingParams, make_engine
from helpers import FAKE_VLLM, both_config, launch, perturbed, rollout_logprob_gap, use_fake_vllm, versions_by_step
from models import load_tokenizer


@pytest.fixture
def vllm(monkeypatch):
    """The fake `vllm` module, importable for this test only, on a machine of 4 (pretend) GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")  # unset here, and after the test whatever make_pool sets
    return use_fake_vllm(monkeypatch)


def rollout_model(**over) -> InferenceModelConfig:
    return dataclasses.replace(
        InferenceModelConfig(engine_type="vllm", gpu_memory_utilization=0.5, enforce_eager=True, dtype="float32"),
        **over,
    )


def prompts(model_dir: str) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    return [tok.encode(t, add_special_tokens=False) for t in ("What is 2 + 3?", "hi", "Tom has 4 apples.")]


def test_engines_on_their_own_gpus_with_every_option_and_requests_spread(vllm, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,6")  # the launcher's split for this explorer
    rm = rollout_model(engine_num=2, tensor_parallel_size=2, enable_prefix_caching=False, seed=7)
    pool = make_engine(rm, tiny_model_dir, 256, repetition_penalty=1.0)
    try:
        assert [e.visible_devices for e in vllm.ENGINES] == ["3,4", "5,6"]  # engine i on GPUs [i*tp, (i+1)*tp)
        # spawned workers, so that each reads its engine's CUDA_VISIBLE_DEVICES; engine i samples with seed + i
        assert [e.multiproc_method for e in vllm.ENGINES] == ["spawn", "spawn"]
        assert [e.args.seed for e in vllm.ENGINES] == [7, 8]
        args = vllm.ENGINES[0].args
        assert (
            args.tensor_parallel_size,
            args.gpu_memory_utilization,
            args.enable_prefix_caching,
            args.seed,
            args.enforce_eager,
            args.dtype,
            args.max_model_len,
        ) == (2, 0.5, False, 7, True, "float32", 256)
        assert args.logprobs_mode == "processed_logprobs"
        assert args.weight_transfer_config == {"backend": "nccl"}  # vLLM's own engine between GPUs
        assert not args.enable_sleep_mode and [len(e.workers) for e in vllm.ENGINES] == [2, 2]
        ids = prompts(tiny_model_dir)
        futures = [pool.submit(ids[i % 3], SamplingParams(n=2, max_tokens=4, seed=i)) for i in range(8)]
        outs = [f.result() for f in futures]
        assert all(len(o) == 2 and all(1 <= len(c.token_ids) <= 4 for c in o) for o in outs)
        assert all(len(e.requests) >= 2 for e in vllm.ENGINES)  # both engines took requests
        assert sum(len(e.requests) for e in vllm.ENGINES) == 8
        pool.model_version = 4  # the explorer sets the version of the weights it started from, on every engine
        assert [e.model_version for e in pool.engines] == [4, 4] and pool.generate(
            ids[:1], [SamplingParams(max_tokens=2)]
        )[0][0].model_version == 4
    finally:
        pool.close()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,4,5,6"  # restored after each engine started
    with pytest.raises(RuntimeError, match="3 engines x 2 GPUs need 6 GPUs; this explorer sees 4"):
        make_engine(dataclasses.replace(rm, engine_num=3), tiny_model_dir, 256)


def test_an_explorer_that_sees_every_gpu_leaves_the_environment_as_it_was(vllm, tiny_model_dir, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # two GPUs, none hidden
    pool = make_engine(rollout_model(engine_num=2), tiny_model_dir, 256)
    pool.close()
    assert [e.visible_devices for e in vllm.ENGINES] == ["0", "1"] and "CUDA_VISIBLE_DEVICES" not in os.environ


@pytest.mark.parametrize("kind", ["vllm", "vllm_async"])
def test_vllm_engines_end_a_response_on_the_ids_the_hf_engine_does(vllm, tiny_model_dir, tmp_path, kind):
    """eos_ids, what workflows/episode.py ends a turn on: the tokenizer's EOS and every eos_token_id of the model's
    generation config (the tiny model's: <|im_end|> and <|endoftext|>), as the HF engine's; a sample that stops on
    any of them is "stop" and ends with it."""
    tok = load_tokenizer(tiny_model_dir)
    both = sorted(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    hf = HFEngine(tiny_model_dir)
    pool = make_engine(rollout_model(engine_type=kind), tiny_model_dir, 256)
    try:
        greedy = pool.generate(prompts(tiny_model_dir)[:1], [SamplingParams(temperature=0.0, max_tokens=8)])[0][0]
        assert pool.eos_ids == hf.eos_ids == both and EngineHandle(pool, tok).eos_ids == both
    finally:
        pool.close()
        hf.close()
    # a model whose generation config ends on the third token the model writes greedily (where it first writes it)
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": greedy.token_ids[2]}))
    pool = make_engine(rollout_model(engine_type=kind), str(other), 256)
    try:
        again = pool.generate(prompts(tiny_model_dir)[:1], [SamplingParams(temperature=0.0, max_tokens=8)])[0][0]
        assert pool.eos_ids == sorted({tok.eos_token_id, greedy.token_ids[2]})
    finally:
        pool.close()
    stop = greedy.token_ids[2]
    assert again.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1] and again.finish_reason == "stop"


def worker_weights(vllm) -> list[dict[str, torch.Tensor]]:
    return [dict(w.model_runner.model.hf.state_dict()) for e in vllm.ENGINES for w in e.workers]


def test_weights_from_a_published_folder_reach_every_worker(vllm, tiny_model_dir, tmp_path):
    pool = make_engine(rollout_model(engine_num=2, tensor_parallel_size=2), tiny_model_dir, 256)
    new = perturbed(tiny_model_dir)
    folder = sync.publish_hf(new, load_tokenizer(tiny_model_dir), tmp_path, step=3)
    try:
        pool.load_weights(str(folder), version=3)
        with pytest.raises(TypeError, match="not a state dict"):
            pool.load_weights(new.state_dict(), version=4)  # no state dicts through the explorer's memory
        greedy = pool.generate(prompts(tiny_model_dir)[:1], [SamplingParams(temperature=0.0, max_tokens=5)])[0][0]
    finally:
        pool.close()
    assert pool.model_version == 3 and greedy.model_version == 3
    for weights in worker_weights(vllm):
        for name, t in new.state_dict().items():
            assert torch.equal(weights[name], t), name
    assert [e.prefix_cache_resets for e in vllm.ENGINES] == [1, 1]  # old KV blocks are not reused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "mixed"])
def test_weights_over_the_group_go_straight_into_every_worker(vllm, tiny_model_dir, tmp_path, dtype):
    """Between GPUs, vLLM's own NCCL weight-transfer engine (the fake's over gloo): the trainer's side built by vLLM's
    trainer factory (weight_transfer.trainer_engine) once the explorer announced its 2 engines x 2 workers, its init
    info posted through the group's store; each worker joins as its own rank (1..4) and loads each tensor as it
    arrives: every worker holds the trainer's tensors exactly, and the transfer's version. A bf16 engine gets bf16 on
    the wire (the trainer casts its fp32 master weights); "mixed": bf16 and fp32 tensors in turn."""
    pool = make_engine(
        rollout_model(engine_num=2, tensor_parallel_size=2, dtype=dtype.replace("mixed", "float32")),
        tiny_model_dir,
        256,
    )
    assert pool.backend == "nccl"
    new = perturbed(tiny_model_dir)
    sender = wire.open_sender(tmp_path, "cpu", timeout=60)
    params = dict(new.named_parameters())
    specs = [
        (n, tuple(t.shape), torch.bfloat16 if dtype == "bfloat16" or (dtype == "mixed" and i % 2) else torch.float32)
        for i, (n, t) in enumerate(params.items())
    ]
    source = weight_transfer.SpecSource(lambda: (specs, (t.detach() for t in params.values())))
    sync_cfg = SimpleNamespace(sync_timeout=60, sync_host="127.0.0.1")

    def trainer() -> None:  # rank 0: its engine waits for the explorer's announcement, then rendezvous
        engine = weight_transfer.trainer_engine(pool.backend, sender, 0, source, sync_cfg)
        engine.client.version = 5
        engine.send_weights()

    sent = threading.Thread(target=trainer)
    try:
        link = wire.open_receiver(tmp_path, timeout=30, receivers=pool.join_ranks())  # announces 1 + 4 ranks
        sent.start()
        pool.join_group(wire.receive_init(link))  # vLLM's init_weight_transfer_engine with the trainer's info
        posted = wire.receive_header(link)
        assert posted["version"] == 5 and posted["update_info"]["names"] == list(params)
        assert set(posted["update_info"]["dtype_names"]) == ({dtype} if dtype != "mixed" else {"float32", "bfloat16"})
        assert pool.receive(posted) == sum(t.numel() * d.itemsize for t, (_, _, d) in zip(params.values(), specs))
        wire.ack(link)
        sent.join(timeout=60)
        assert pool.model_version == 5 and pool.weight_versions() == ["5", "5"]
        closing = threading.Thread(target=wire.close_sender, args=(sender,), kwargs={"finished": True, "grace": 30})
        closing.start()  # the trainer waits for the explorer to read its stop (as they run: at once)
        assert wire.receive_header(link) is None  # the trainer finished
        closing.join(timeout=30)
        assert not closing.is_alive()
    finally:
        pool.close()
    engines = [w.weight_transfer_engine for e in vllm.ENGINES for w in e.workers]
    assert all(e.model_update_group is None for e in engines)  # each left the group
    for weights in worker_weights(vllm):
        for name, _, sent_dtype in specs:
            assert torch.equal(weights[name], params[name].detach().to(sent_dtype).float()), name


def test_sleep_and_wake_up_on_a_shared_gpu(vllm, tiny_model_dir, monkeypatch, tmp_path):
    """The adapter sleeps at level 1 (weights kept in host memory): after wake_up it generates exactly as before,
    without a reload. Level 2 throws the weights away (the fake then refuses to generate, where vLLM would generate
    from garbage) until they are loaded again, which a weight load does."""
    pool = make_engine(rollout_model(), tiny_model_dir, 256, colocate=True)
    ids, greedy = prompts(tiny_model_dir)[:1], [SamplingParams(temperature=0.0, max_tokens=6)]
    llm = vllm.ENGINES[0]
    try:
        assert llm.args.enable_sleep_mode
        before = pool.generate(ids, greedy)[0][0].token_ids
        pool.sleep()
        with pytest.raises(RuntimeError, match="while the engine sleeps"):
            pool.generate(ids, greedy)
        pool.wake_up()
        assert pool.generate(ids, greedy)[0][0].token_ids == before  # level 1: the same weights, no reload
        monkeypatch.setattr(vllm_engine, "SLEEP_LEVEL", 2)
        pool.sleep()
        pool.wake_up()
        with pytest.raises(RuntimeError, match="discarded by sleep"):
            pool.generate(ids, greedy)
        pool.load_weights(tiny_model_dir, version=1)  # level 2 needs weights loaded after it
        assert pool.generate(ids, greedy)[0][0].token_ids == before
        # wake_up by part, as vLLM: the KV cache still sleeps after the weights woke
        llm.sleep(level=1)
        llm.wake_up(tags=["weights"])
        with pytest.raises(RuntimeError, match="sleeps"):
            llm.generate([{"prompt_token_ids": ids[0]}], vllm.SamplingParams(max_tokens=2))
        llm.wake_up(tags=["kv_cache"])
        with pytest.raises(ValueError, match="wake_up tags"):
            llm.wake_up(tags=["weight"])
        assert len(pool.generate(ids, greedy)[0]) == 1
    finally:
        pool.close()


def test_prefix_cache_reset_waits_until_vllm_does_it(vllm, tiny_model_dir):
    """vLLM's reset_prefix_cache returns False (and resets nothing) while requests hold blocks: the adapter tries
    again, and never takes new weights with the old weights' KV blocks in place."""
    pool = make_engine(rollout_model(), tiny_model_dir, 256)
    llm, answers = vllm.ENGINES[0], iter([False, False, True])
    real = llm.reset_prefix_cache
    llm.reset_prefix_cache = lambda: next(answers) and real()
    try:
        pool.load_weights(tiny_model_dir, version=2)
    finally:
        pool.close()
    assert pool.model_version == 2 and llm.prefix_cache_resets == 1 and next(answers, None) is None
    with pytest.raises(RuntimeError, match="would not reset its prefix cache"):
        vllm_engine.reset_prefix_cache(lambda: False, tries=2)


def test_a_folder_the_workers_cannot_load_is_an_oserror_and_the_explorer_loads_the_newest(
    vllm, tiny_model_dir, tmp_path
):
    """A missing (say, pruned) or empty folder: no worker loads anything, the version stays, and the error is an
    OSError, which sync.load_published answers by loading the newest published folder."""
    from safetensors.torch import save_file

    pool = make_engine(rollout_model(engine_num=2, tensor_parallel_size=2), tiny_model_dir, 256)
    empty = tmp_path / "empty"
    empty.mkdir()
    save_file({}, str(empty / "model.safetensors"))
    new = perturbed(tiny_model_dir)
    try:
        with pytest.raises(OSError, match=r"no weights in .*gone \(no folder\)"):
            pool.load_weights(str(tmp_path / "gone"), version=3)
        with pytest.raises(OSError, match=r"no weights in .*empty"):
            pool.load_weights(str(empty), version=3)
        assert pool.model_version == 0 and all(e.prefix_cache_resets == 0 for e in vllm.ENGINES)
        sync.publish_hf(new, load_tokenizer(tiny_model_dir), tmp_path, step=5)  # the newest, while 4 is gone
        assert sync.load_published(pool, str(tmp_path), 4) == 5
    finally:
        pool.close()
    assert pool.model_version == 5
    for weights in worker_weights(vllm):
        assert all(torch.equal(weights[name], t) for name, t in new.state_dict().items())


@pytest.mark.parametrize("kind", ["FINAL_ONLY", "CUMULATIVE"])
def test_vllm_async_returns_every_sample_of_a_request(vllm, tiny_model_dir, monkeypatch, kind):
    """vLLM's async engine streams, and with n > 1 a streamed output need not hold every sample: the adapter asks for
    FINAL_ONLY (one output of all n), and collects samples by index should outputs stream anyway (CUMULATIVE: the
    fake streams an output per step, the first with sample 0 alone). Either way n = 8 gives 8 completions, the same
    ones."""
    pool = make_engine(rollout_model(engine_type="vllm_async"), tiny_model_dir, 256)
    engine, ids = pool.engines[0], prompts(tiny_model_dir)
    if kind == "CUMULATIVE":
        monkeypatch.setattr(engine, "final_only", vllm.sampling_params.RequestOutputKind.CUMULATIVE)
    try:
        out = pool.submit(ids[0], SamplingParams(n=8, max_tokens=5, seed=3)).result(timeout=120)
        streamed = []

        async def collect() -> None:
            sp = vllm.SamplingParams(n=8, max_tokens=5, seed=3, logprobs=0)
            async for o in engine.llm.generate({"prompt_token_ids": ids[0]}, sp, request_id="probe"):
                streamed.append(o)

        engine.call(collect())
    finally:
        pool.close()
    assert len(out) == 8 and all(1 <= len(c.token_ids) <= 5 for c in out) and len({tuple(c.token_ids) for c in out}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in out)
    assert len(streamed) > 1 and len(streamed[0].outputs) == 1  # the default streams, not all samples in each
    whole = vllm.ENGINES[0]._run("x", ids[0], vllm.SamplingParams(n=8, max_tokens=5, seed=3, logprobs=0))
    assert [c.token_ids for c in out] == [o.token_ids for o in whole.outputs]  # every sample, in index order


def test_vllm_async_streams_each_request_into_the_running_engine(vllm, tiny_model_dir):
    pool = make_engine(rollout_model(engine_type="vllm_async"), tiny_model_dir, 256, colocate=True)
    ids = prompts(tiny_model_dir)
    try:
        futures = [pool.submit(ids[i % 3], SamplingParams(n=2, max_tokens=3, seed=i)) for i in range(6)]
        outs = [f.result(timeout=120) for f in futures]
        engine = pool.engines[0].llm
        assert all(len(o) == 2 for o in outs) and engine.max_in_flight > 1  # not one batch after another
        pool.sleep()
        pool.wake_up()
        with pytest.raises(ValueError, match="leaves no room"):
            pool.submit(ids[0] * 200, SamplingParams(max_tokens=3))  # refused before it reaches vLLM
        pool.load_weights(str(Path(tiny_model_dir)), version=1)
        assert pool.model_version == 1 and engine.engine.prefix_cache_resets == 1
    finally:
        pool.close()
    assert engine.shut and engine.shut_on_loop  # shut down on the loop that runs the engine


@pytest.mark.slow(seconds=30)
def test_mode_both_on_one_shared_gpu_with_vllm_engines_end_to_end(tmp_path, tiny_model_dir):
    """The whole loop through the launcher with the fake vLLM in the explorer: one (pretend) GPU shared by
    explorer and trainer (cluster.colocate: the engine sleeps while the trainer steps), weights over the group into
    the vLLM worker at every step: the rollouts of step s come from exactly the trainer's weights of step s - 1."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "synchronizer.sync_method": "nccl",
            "trainer.save_interval": 2,
            "cluster": {"gpu_per_node": 1},
            # vLLM's processed log-probs would renormalise without EOS (configs/checks.py)
            "model.min_response_tokens": 0,
            "explorer.rollout_model": {"engine_type": "vllm", "dtype": "float32"},
        },
    )
    # NOTE: a pretend GPU: the pre-flight (rightly) refuses cluster.gpu_per_node 1 on this machine, so this run
    # starts as the launcher's children do, without it
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")]), "NANORFT_LAUNCHED": "1"}
    out = launch(config, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "ck" / "p" / "run"
    resolved = (run / "config.yaml").read_text()
    assert "colocate: true" in resolved and "gpu_memory_utilization: 0.25" in resolved
    assert versions_by_step(run / "buffer" / "exp.db") == [0] * 4 + [1] * 4 + [2] * 4
    # step 2's weights (the save_interval checkpoint) were in the vLLM worker for explore step 3, exactly
    assert rollout_logprob_gap(run / "buffer" / "exp.db", 2, run / "global_step_2" / "actor" / "huggingface") < 1e-4


def test_engines_shut_down_with_nanorfts_bound_and_once(vllm, tiny_model_dir):
    """Each engine stops its engine core through vLLM's shutdown with vllm_engine.STOP_S, not vLLM's default 5 s,
    which the worker overran on a busy CPU (force-killed at every end: docs/LOG.md, 2026-11-29); `vllm` through its
    engine client (0.32's LLM has no shutdown()). A second close (atexit's, after the explorer's) does nothing."""
    pools = [make_engine(rollout_model(engine_type=kind), tiny_model_dir, 256) for kind in ("vllm", "vllm_async")]
    llm, async_llm = (p.engines[0].llm for p in pools)
    for pool in pools + pools:
        pool.close()
    assert llm.llm_engine.engine_core.shutdowns == [vllm_engine.STOP_S]
    assert async_llm.shut and async_llm.shut_on_loop and async_llm.shut_timeout == vllm_engine.STOP_S


def test_a_close_that_hangs_ends_by_killing_the_engines_processes(monkeypatch, caplog):
    """An engine whose close hangs (an engine core that will not answer) cannot hold the explorer's end: after
    timeout + CLOSE_MARGIN_S the processes recorded at the engine's start are SIGKILLed, with a warning naming
    each."""
    import subprocess
    import sys
    import time

    import lease

    release = threading.Event()

    class Stuck:
        engine_type, tokenizer, eos_ids, model_version = "vllm", None, [], 0

        def close(self, timeout: float = 0.0) -> None:
            release.wait()

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pool = vllm_engine.EnginePool([Stuck()], 1)
    pool.procs = {proc.pid: lease.started(proc.pid)}
    monkeypatch.setattr(vllm_engine, "CLOSE_MARGIN_S", 0.5)
    logger = logging.getLogger("nanorft.vllm_engine")  # NOTE: directly: a console made earlier may stop propagation
    logger.addHandler(caplog.handler)
    try:
        start = time.monotonic()
        closing = threading.Thread(target=pool.close, args=(0.5,), daemon=True)
        closing.start()
        closing.join(30)
        assert not closing.is_alive() and time.monotonic() - start < 10
        assert proc.wait(timeout=10) == -9
    finally:
        logger.removeHandler(caplog.handler)
        release.set()
        proc.kill()
    assert f"vLLM engine processes still running 1 s after the vLLM engines began to close: {proc.pid} (" in caplog.text
