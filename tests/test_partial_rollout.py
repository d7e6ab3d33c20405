"""explorer.partial_rollout (in-flight weight updates, issue 47 item 3): the versions that sampled a response's tokens
(vLLM's WeightVersionSpans -> sampling.Completion.spans -> Experience.spans, the DB's spans column), the engines paused
with their requests kept around a weight update (the fake vLLM), the config key's rules, the metrics, and an explorer
whose next step's rollout runs while its sync point waits for the trainer. The real-vLLM case (a request in flight
across an update finishes with the spans of both versions) is tests/test_vllm_contract.py's."""

import sqlite3
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import explore
import sync
import vllm_engine
from buffer import Experience, ExperienceDB
from configs import ConfigError, cli, resolve_stages
from configs.schema import InferenceModelConfig
from engines import SamplingParams, experience, make_engine
from helpers import perturbed, raw, run_explorer, use_fake_vllm, write_config
from models import load_model, load_tokenizer
from monitor import read_history, rollout_metrics
from sampling import Completion
from workflows.episode import turn_spans

pytestmark = pytest.mark.usefixtures("environment_kept")  # vLLM engines built in this process

# --- vLLM's spans -> Completion


def output(n: int, spans: list | None) -> SimpleNamespace:
    """A vLLM CompletionOutput of n tokens (ids 10.., log-probs -0.1 * (i + 1)) with `weight_versions`."""
    ids = list(range(10, 10 + n))
    return SimpleNamespace(
        token_ids=ids,
        logprobs=[{t: SimpleNamespace(logprob=-0.1 * (i + 1))} for i, t in enumerate(ids)],
        text="x",
        finish_reason="length",
        weight_versions=None if spans is None else [SimpleNamespace(version=v, start=a, end=b) for v, a, b in spans],
    )


@pytest.mark.parametrize(
    "spans, engine, expected_version, expected_spans",
    [
        ([("3", 0, 4), ("4", 4, 9)], 4, 3, [(0, 3), (4, 4)]),  # an update while it ran: the oldest is its version
        ([("5", 0, 9)], 7, 5, []),  # one version (vLLM's label, not the engine's now): no spans
        ([("2", 0, 2), ("2", 2, 5), ("3", 5, 9)], 3, 2, [(0, 2), (5, 3)]),  # adjacent spans of one version merge
        ([("2", 0, 3), ("3", 3, 3), ("4", 3, 9)], 4, 2, [(0, 2), (3, 4)]),  # an empty span is no span
        (None, 6, 6, []),  # vLLM reported none: the engine's version
        ([("default", 0, 9)], 1, 1, []),  # vLLM's label before nanorft set one: the engine's version
    ],
)
def test_vllm_weight_version_spans_become_the_completions_spans(spans, engine, expected_version, expected_spans):
    (c,) = vllm_engine.completions([output(9, spans)], engine)
    assert (c.model_version, c.spans) == (expected_version, expected_spans)
    assert c.token_ids == list(range(10, 19)) and c.logprobs == pytest.approx([-0.1 * (i + 1) for i in range(9)])


def test_spans_go_from_the_completion_to_the_experience_and_through_the_db(tmp_path):
    """Completion.spans -> Experience.spans (engines.experience) -> the spans column (JSON; NULL with one version)
    -> read back, as the trainer's claim and the ranks' serialise_many give them."""
    mixed = experience([1, 2], Completion([5, 6, 7, 8], [-1.0] * 4, "t", "stop", 3, [(0, 3), (2, 4)]), 1.0)
    plain = experience([1, 2], Completion([5, 6], [-1.0] * 2, "t", "stop", 4), 1.0)
    assert (mixed.model_version, mixed.spans, plain.spans) == (3, [(0, 3), (2, 4)], [])
    url = f"sqlite:///{tmp_path}/e.db"
    with ExperienceDB(url) as db:
        db.write([mixed, plain])
        assert raw(url, "SELECT spans FROM experiences ORDER BY id") == [("[[0, 3], [2, 4]]",), (None,)]
        got = db.get([1, 2])
    assert [(x.model_version, x.spans) for x in got] == [(3, [(0, 3), (2, 4)]), (4, [])]
    from buffer import deserialise_many, serialise_many

    assert [x.spans for x in deserialise_many(serialise_many(got))] == [[(0, 3), (2, 4)], []]


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_version_2_or_3_db_gains_the_spans_column_in_place(tmp_path, version):
    url = f"sqlite:///{tmp_path}/e.db"
    with ExperienceDB(url) as db:
        db.write([Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=1.0, model_version=2)])
    path = f"{tmp_path}/e.db"
    with sqlite3.connect(path) as conn:  # as an older buffer.py left it: no spans column (nor trained table)
        conn.execute("ALTER TABLE experiences DROP COLUMN spans")
        conn.execute("DROP TABLE trained")
        if version == "2":
            conn.execute("DROP TABLE replays")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    with ExperienceDB(url) as db:
        assert db.get_meta("schema_version") == "5"
        assert [(x.model_version, x.spans) for x in db.get([1])] == [(2, [])]
        db.write([Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=1.0, spans=[(0, 1), (1, 2)])])
        assert db.get([2])[0].spans == [(0, 1), (1, 2)]


def test_a_conversations_spans_are_its_turns_shifted_to_where_they_start():
    """turn_spans' docstring example by hand: turns [10, 14) and [20, 25) after a prompt of 10 tokens; turn 2 started
    on version 3 and went on on 4 from its third token (response index 20 - 10 + 2 = 12)."""
    assert turn_spans([(10, 14), (20, 25)], 10, [[], [(0, 3), (2, 4)]], [3, 3]) == [(0, 3), (12, 4)]
    assert turn_spans([(10, 14), (20, 25)], 10, [[], []], [3, 4]) == [(0, 3), (10, 4)]  # a turn per version
    assert turn_spans([(10, 14), (20, 25)], 10, [[], []], [3, 3]) == []  # one version


def test_mixed_responses_are_counted_in_the_rollout_metrics():
    """rollout/partial_responses: responses with spans; rollout/tokens_from_new_weights: their tokens from the second
    span on (response of 6 tokens, second span from 2: 4; of 5 from 4: 1)."""

    def exp(n: int, spans: list) -> Experience:
        return Experience(tokens=torch.arange(2 + n), prompt_length=2, reward=0.0, spans=spans)

    results = [(None, [exp(6, [(0, 1), (2, 2)]), exp(5, [(0, 1), (4, 2)]), exp(3, [])], "")]
    m = rollout_metrics(results, 1.0)
    assert (m["rollout/partial_responses"], m["rollout/tokens_from_new_weights"]) == (2, 5)


# --- the engines paused with their requests kept (the fake vLLM)


def test_a_weight_update_keeps_the_requests_in_flight_only_when_asked(tiny_model_dir, tmp_path, monkeypatch):
    """Without in_flight_updates a load pauses nothing (explore steps do not overlap); with it every engine is paused
    with mode keep around the load and resumed after; vLLM's weight label follows the engine's version."""
    fake = use_fake_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")
    rm = InferenceModelConfig(engine_type="vllm_async", engine_num=2, enforce_eager=True, dtype="float32")
    pool = make_engine(rm, tiny_model_dir, 256)
    folder = str(sync.publish_hf(perturbed(tiny_model_dir), load_tokenizer(tiny_model_dir), tmp_path, step=1))
    try:
        llms = [e.llm for e in pool.engines]
        pool.load_weights(folder, version=1)
        assert [llm.paused for llm in llms] == [{}, {}] and [llm.engine.weight_version for llm in llms] == ["1", "1"]
        pool.in_flight_updates = True
        running = pool.submit([1, 2, 3], SamplingParams(max_tokens=8))
        pool.load_weights(folder, version=2)
        assert [llm.paused for llm in llms] == [{"keep": 1}, {"keep": 1}]
        assert not any(llm.is_paused_now for llm in llms) and [llm.engine.weight_version for llm in llms] == ["2", "2"]
        assert running.result()[0].model_version in (1, 2)  # the fake reports no spans: the version it started on
    finally:
        pool.close()
    assert fake is not None


# --- the config key


@pytest.mark.parametrize(
    "over, refused",
    [
        ({"explorer.rollout_model.engine_type": "vllm"}, "engine_type: vllm_async"),
        ({"explorer.rollout_model.engine_type": "hf"}, "engine_type: vllm_async"),
        ({"explorer.rollout_model.engine_type": "vllm_async"}, ""),
    ],
)
def test_partial_rollout_is_refused_by_name_where_it_cannot_run(tmp_path, tiny_model_dir, over, refused):
    config = write_config(tmp_path, tiny_model_dir, **{"explorer.partial_rollout": True, **over})
    if not refused:
        (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
        assert cfg.explorer.partial_rollout
        return
    with pytest.raises(ConfigError, match=r"explorer\.partial_rollout") as e:
        resolve_stages(cli(["--config", str(config)])[0])
    assert refused in str(e.value)


def test_partial_rollout_is_refused_on_a_gpu_shared_with_the_trainer(tmp_path, tiny_model_dir):
    """cluster.colocate is derived (mode both on one GPU): the rule checked on the resolved config with it set."""
    from configs.checks import check_support

    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{"explorer.partial_rollout": True, "explorer.rollout_model.engine_type": "vllm_async"},
    )
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    cfg.cluster.colocate = True
    with pytest.raises(ConfigError, match=r"explorer\.partial_rollout.*cluster\.colocate"):
        check_support(cfg)


# --- the explorer: the next step's rollout runs while the sync point waits


@pytest.mark.parametrize("partial", [True, False])
def test_with_partial_rollout_the_next_steps_rollout_runs_while_the_sync_point_waits(
    tmp_path, tiny_model_dir, monkeypatch, partial
):
    """Checkpoint sync, 4 steps, a "trainer" that publishes the weights of step k only once the explorer's rollout of
    step k + 1 has started (it waits for them at the sync point after step k). With partial_rollout the explorer runs
    that rollout meanwhile, loads the weights as they come, and writes step k + 1 only after: every step written, each
    on the versions by hand (steps 1 and 2 started on 0, 3 on 1, 4 on 2). Without it the explorer waits at the sync
    point after step 1 and never starts step 2's rollout: it stops at its sync_timeout."""
    use_fake_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "")
    config = write_config(
        tmp_path,
        tiny_model_dir,
        **{
            "explorer.rollout_model.engine_type": "vllm_async",
            "explorer.rollout_model.enforce_eager": True,
            "explorer.partial_rollout": partial,
            "synchronizer.sync_method": "checkpoint",
            "synchronizer.sync_timeout": 8.0 if partial else 2.0,  # without: waited out, as short as it can be
            "synchronizer.sync_interval": 1,
            "explorer.eval_on_startup": False,
        },
    )
    started, rollout = [], explore.rollout

    def recorded(x, tasks):
        started.append((x.step + 1, x.engine.model_version))  # the step it runs, the version its requests start on
        return rollout(x, tasks)

    monkeypatch.setattr(explore, "rollout", recorded)
    job = tmp_path / "ck" / "p" / "e"
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)

    ended = threading.Event()  # the explorer returned: nothing more will start (the publisher stops waiting)

    def trainer() -> None:
        for k in (1, 2, 3):
            deadline = time.monotonic() + 30
            while len(started) <= k and not ended.is_set() and time.monotonic() < deadline:  # step k + 1 started
                time.sleep(0.01)
            if len(started) <= k:
                return
            sync.publish_hf(model, tok, job, step=k)

    publisher = threading.Thread(target=trainer, daemon=True)
    publisher.start()
    out = run_explorer(config)
    code, errors = out.returncode, out.stderr
    ended.set()
    publisher.join()
    if not partial:
        assert code == 1 and started == [(1, 0)]
        assert "no weights of step 1 after 2 s" in errors
        return
    assert code == 0, errors
    assert started == [(1, 0), (2, 0), (3, 1), (4, 2)]
    rows = sqlite3.connect(next(job.rglob("*.db"))).execute("SELECT model_version FROM experiences ORDER BY id")
    assert [v for (v,) in rows] == [0] * 12 + [1] * 6 + [2] * 6  # 4 steps x 3 tasks x 2 runs
    history = read_history(job / "monitor/explorer.jsonl")
    idle = [h["time/sync_idle"] for h in history if "time/sync_idle" in h]
    assert len(idle) == 3 and all(s >= 0 for s in idle)


def test_the_correction_reweights_only_the_tokens_the_old_weights_sampled():
    """A response of 4 tokens whose spans are [(0, 3), (2, 4)], trained at version 4 (pi_old = version 4's): its
    rollout log-probs are version 3's for tokens 0-1 and version 4's for tokens 2-3, so token-level TIS
    (algos/correction.py, unchanged) weighs tokens 2-3 by exactly 1 and tokens 0-1 by min(exp(old - rollout), C):
    by hand exp(-0.5 - -0.7) = exp(0.2) = 1.2214 and exp(-1.0 - -0.2) = exp(-0.8) = 0.4493, C = 2."""
    from algos.correction import rollout_is_weights

    old = torch.tensor([[-0.5, -1.0, -0.3, -2.0]])  # [B,T] the trainer's, version 4
    rollout = torch.tensor([[-0.7, -0.2, -0.3, -2.0]])  # [B,T] version 3's for tokens 0-1, then version 4's
    weights, metrics = rollout_is_weights(old, rollout, torch.ones(1, 4, dtype=torch.bool), "token", 2.0)
    assert weights[0].tolist() == pytest.approx([1.2214028, 0.4493290, 1.0, 1.0])
    assert metrics["rollout_corr/abs_diff"] == pytest.approx((0.2 + 0.8) / 4)
