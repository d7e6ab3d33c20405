"""Weight sync, both methods: checkpoint (layout, pointer, waiting, atomic folders, bitwise load) and
process group (real trainer/explorer processes over gloo: bitwise load, stop, and clear errors, never hangs)."""

import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # also when this file runs as a peer process (bottom of the file)

import entry
import pytest
import torch
from safetensors.torch import load_file, save_file

import configs
import sync
import wire
from helpers import Entry, both_config, launch, rollout_logprob_gap, versions_by_step

# NOTE: models, engines, transformers and monitor are imported where used: this file is also the peer process of the
# process-group tests, and the peers that need only wire start ~3 s of CPU sooner without them


def test_wait_notes_are_info_only_when_a_wait_is_longer_than_usual():
    """The rhythm's waits (the explorer's for weights, the trainer's for experiences) are DEBUG lines (at the start,
    every 30 s); INFO once a wait passes 3x the median of the waits so far (at least the floor), then every 30 s."""
    notes = sync.WaitNotes(floor=5.0, every=30.0)
    notes.begin()  # the first wait: nothing usual yet, so the floor
    assert [notes.level(t) for t in (0, 1, 4.9, 5, 6, 34, 35, 36)] == [
        logging.DEBUG, None, None, logging.INFO, None, None, logging.INFO, None,
    ]  # fmt: skip
    notes.end(40.0)  # usual now: 3 x 40 = 120 s
    notes.begin()
    assert [notes.level(t) for t in (0, 29, 30, 60, 89, 90, 119, 120, 149, 150)] == [
        logging.DEBUG, None, logging.DEBUG, logging.DEBUG, None, logging.DEBUG, None, logging.INFO, None, logging.INFO,
    ]  # fmt: skip
    for _ in range(4):
        notes.end(2.0)  # the waits so far: 40, 2, 2, 2, 2: median 2 s, so 3 x 2 = 6 s
    assert notes.usual() == 6.0
    notes.end(1.0)
    notes.end(1.0)  # 40, 2, 2, 2, 2, 1, 1: median 2, still 6 s
    assert notes.usual() == 6.0
    for _ in range(10):
        notes.end(0.1)  # median 0.1 s: 3 x 0.1 is under the floor, which stays
    assert notes.usual() == 5.0


def test_a_usual_wait_for_weights_is_a_debug_line_and_a_long_one_info(tmp_path, caplog):
    """The explorer's wait at a checkpoint sync point: at INFO every sync point's wait was a line (the rhythm of
    mode both); now a wait as long as usual is said at DEBUG only, one longer than usual at INFO."""
    import types

    db = types.SimpleNamespace(trainer_status=lambda: None)  # what the line reads of the DB: no trainer yet
    notes = sync.WaitNotes(floor=0.2)
    caplog.set_level(logging.DEBUG, logger="nanorft.sync")
    timer = threading.Timer(0.05, lambda: (tmp_path / sync.POINTER).write_text("1"))
    timer.start()
    assert sync.wait_for_trainer(str(tmp_path), db, 1, step=1, timeout=30, notes=notes) == (1, "", 0)
    timer.join()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "waiting for the trainer's weights" in r.message]
    assert [level for level, _ in said] == [logging.DEBUG], said
    assert "sync point after step 1: waiting for the trainer's weights of step 1 (newest: 0)" in said[0][1]
    caplog.clear()
    version, why, code = sync.wait_for_trainer(str(tmp_path), db, 2, step=2, timeout=0.5, notes=notes)
    assert (version, code) == (0, 1) and why.startswith("no weights of step 2 after 0.5 s (synchronizer.sync_timeout)")
    said = [r.levelno for r in caplog.records if "waiting for the trainer's weights of step 2" in r.message]
    assert said == [logging.DEBUG, logging.INFO], said  # at the start; past the floor (0.2 s > 3 x ~0.05 s)


def test_publish_then_load_exact_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from models import load_model, load_tokenizer

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.5)  # weights the trainer changed
    assert sync.latest_version(tmp_path) == 0
    path = sync.publish_hf(model, tok, tmp_path, step=3)
    assert path == tmp_path / "global_step_3/actor/huggingface" and sync.latest_version(tmp_path) == 3
    loaded = AutoModelForCausalLM.from_pretrained(path)  # plain transformers reads it
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_a_folder_published_in_bf16_keeps_tied_embeddings_tied(tiny_model_dir, tmp_path):
    """sync.cast (train.publish's bf16 folders) casts tied tensors once, so the folder holds the LM head once."""
    from models import load_model

    model = load_model(tiny_model_dir)
    assert model.config.tie_word_embeddings
    path = sync.publish_hf(model, None, tmp_path, 1, state_dict=sync.cast(model.state_dict(), torch.bfloat16))
    saved = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in saved and {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in model.parameters())


def test_published_folders_no_explorer_will_load_are_pruned(tiny_model_dir, tmp_path):
    from models import load_model, load_tokenizer

    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    (tmp_path / "global_step_9/actor/huggingface").mkdir(parents=True)  # a killed run's, after the pointer
    for step in range(1, 6):
        sync.publish_hf(model, tok, tmp_path, step)
        if step == 2:  # a checkpoint step: kept whatever comes later (max_checkpoints_to_keep prunes those)
            (tmp_path / "global_step_2/actor/trainer_state.json").write_text("{}")
    # 5: the pointer; 4: an explorer may still be loading it; 2: a checkpoint; 9: newer than the pointer
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == [f"global_step_{s}" for s in (2, 4, 5, 9)]
    assert sync.latest_version(tmp_path) == 5 and sync.prune_published(tmp_path, 5) == []


def test_checkpoint_load_is_bitwise(tiny_model_dir, tmp_path):
    """publish_hf -> HFEngine.load_weights(folder): every engine tensor equals the trainer's, bit for bit."""
    from engines import HFEngine
    from models import load_model, load_tokenizer

    model = load_model(tiny_model_dir)
    perturb(model)
    path = sync.publish_hf(model, load_tokenizer(tiny_model_dir), tmp_path, step=5)
    with HFEngine(tiny_model_dir) as engine:
        engine.load_weights(str(path), version=5)
        assert engine.model_version == 5
        got = engine.model.state_dict()
    assert model.config.tie_word_embeddings == engine.model.config.tie_word_embeddings
    if engine.model.config.tie_word_embeddings:  # one tensor in memory, both names
        assert engine.model.lm_head.weight.data_ptr() == engine.model.model.embed_tokens.weight.data_ptr()
    for name, t in model.state_dict().items():
        assert torch.equal(t, got[name]), name


# --- process-group method: real processes (this file run as a script is the peer; see the bottom)


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """The weights a trainer would have after some steps: seeded noise on every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.05)


def peer(log_dir: Path, role: str, *args: str, env: dict | None = None) -> Entry:
    """This file run as `role`'s process (bottom of the file), its output in <log_dir>/<role>.log."""
    return entry.start("tests/test_sync.py", role, *args, log=Path(log_dir) / f"{role}.log", env=env)


def finish(proc: Entry, timeout: float = 60) -> str:
    proc.wait(timeout)
    out = proc.out.read_text()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_group_sync_is_bitwise(tiny_model_dir, tmp_path):
    """Trainer and explorer processes over gloo: the engine ends with the trainer's tensors, bit for bit,
    version 3, and it generates differently; then "stop" reaches the explorer as finished."""
    trainer = peer(tmp_path, "trainer", tiny_model_dir, str(tmp_path), "3")
    explorer = peer(tmp_path, "explorer", tiny_model_dir, str(tmp_path))
    finish(trainer)
    result = json.loads(finish(explorer).strip().splitlines()[-1])
    assert result["version"] == 3 and result["model_version"] == 3 and result["then"] == "finished"
    assert result["before"] != result["after"]
    sent, got = load_file(tmp_path / "sent.safetensors"), load_file(tmp_path / "engine.safetensors")
    assert sent.keys() <= got.keys() and sent
    for name, t in sent.items():
        assert t.dtype == got[name].dtype and torch.equal(t, got[name]), name
    if "lm_head.weight" not in sent:  # tied embeddings: sent once, the engine's head follows
        assert torch.equal(got["lm_head.weight"], sent["model.embed_tokens.weight"])
    assert not (tmp_path / wire.GROUP_FILE).exists()  # the trainer removed its file


@pytest.mark.slow
def test_stop_reports_finished(tmp_path):
    trainer = peer(tmp_path, "stop", str(tmp_path))
    link = wire.open_receiver(tmp_path, timeout=20)
    assert wire.receive_weights(link) is None
    wire.close_receiver(link)
    finish(trainer)


def test_no_trainer_is_a_clear_error(tmp_path):
    """The timeout bounds the wait (NOTE: the bounds below are slack for a loaded machine, not speed claims: what
    is tested is that the explorer gives up with a named error instead of waiting on)."""
    start = time.monotonic()
    with pytest.raises(wire.SyncError, match="no trainer"):
        wire.open_receiver(tmp_path, timeout=0.5)
    assert 0.5 <= time.monotonic() - start < 30
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / wire.GROUP_FILE).write_text(
        json.dumps({"host": "127.0.0.1", "port": 1, "pid": int(dead.stdout), "backend": "gloo"})
    )  # left by a dead trainer
    with pytest.raises(wire.SyncError, match="which is gone"):
        wire.open_receiver(tmp_path, timeout=2)
    assert time.monotonic() - start < 60


def test_the_store_listens_on_sync_host_only_and_names_it(tmp_path):
    """synchronizer.sync_host (here 127.0.0.2, standing for a node's cluster address): the store listens there and
    nowhere else, and sync_group.json names it and the host that wrote it. A file written on another host is tried
    (the explorer of a multi-node run), not skipped for a pid that names a process of that host."""
    link = wire.open_sender(tmp_path, "cpu", timeout=10, host="127.0.0.2")
    info = json.loads((tmp_path / wire.GROUP_FILE).read_text())
    assert (info["host"], info["hostname"], info["pid"]) == ("127.0.0.2", socket.gethostname(), os.getpid())
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", info["port"]), timeout=2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / wire.GROUP_FILE).write_text(json.dumps({**info, "pid": int(dead.stdout), "hostname": "node1"}))
    # NOTE: the bound is not what is checked here: 5 s ran out once under the suite's load (CI 3fca73a)
    receiver = wire.open_receiver(tmp_path, timeout=60)
    # a gloo group's ends: the trainer at sync_host, the explorer at its own address on the route there (loopback's)
    assert (link.address, receiver.address) == ("127.0.0.2", "127.0.0.1")
    receiver.store.set("probe", "from the explorer")
    assert link.store.get("probe") == b"from the explorer"
    wire.close_receiver(receiver)
    wire.close_sender(link, grace=1)


@pytest.mark.parametrize("when", ["before_header", "mid_transfer"])
@pytest.mark.slow
def test_trainer_death_is_a_clear_error(tmp_path, when):
    """The trainer dies while the explorer waits for a header, or halfway through the tensors: the explorer
    gets SyncError at once (the timeout here is far longer), not a hang. NOTE: the trainer dies at a point the
    test chooses, told through the store: once the explorer asks for the header, or once it has the header (then
    the broadcast of the tensors fails). Whether the explorer's wait has begun a moment before or after the death
    does not matter: the store or the group is gone either way."""
    trainer = peer(tmp_path, "die", str(tmp_path), when)
    link = wire.open_receiver(tmp_path, timeout=120)
    start = time.monotonic()
    with pytest.raises(wire.SyncError):
        if when == "before_header":
            link.store.set("test/waiting", "1")
            wire.receive_weights(link)
        else:
            header = wire.receive_header(link)
            link.store.set("test/got_header", "1")
            list(wire.receive_buckets(link, header))
    assert time.monotonic() - start < 60  # not the 120 s timeout: the death was noticed (slack for a loaded machine)
    trainer.wait(timeout=30)


# --- buckets: tensors of any dtypes packed into few broadcasts


def test_buckets_group_tensors_in_order_each_aligned_for_its_dtype(monkeypatch):
    """Buckets of at most BUCKET_BYTES (a larger tensor alone), every tensor at a multiple of 16 bytes, so that the
    receiver's uint8 slice can be viewed as its dtype (an odd-length bf16 tensor ends at an offset no fp32 tensor
    could start at)."""
    monkeypatch.setattr(wire, "BUCKET_BYTES", 64)
    specs = [
        ("a", (3,), torch.bfloat16),
        ("b", (5,), torch.float32),
        ("c", (40,), torch.float32),
        ("d", (1,), torch.int64),
        ("e", (2, 2), torch.bfloat16),
        ("f", (), torch.float16),
    ]
    assert wire.buckets(specs) == [[0, 1], [2], [3, 4, 5]]  # 16 + 32; 160 alone; 16 + 16 + 16
    assert wire.layout(specs, [0, 1]) == ([0, 16], 48) and wire.layout(specs, [2]) == ([0], 160)
    assert wire.layout(specs, [3, 4, 5]) == ([0, 16, 32], 48)
    for bucket in wire.buckets(specs):
        offsets, size = wire.layout(specs, bucket)
        buf = torch.zeros(size, dtype=torch.uint8)
        for i, at in zip(bucket, offsets):  # what receive_buckets does with each part
            _, shape, dtype = specs[i]
            assert buf[at : at + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape).shape == shape


def loopback(tmp_path: Path, specs: list, tensors: list, version: int = 1) -> tuple[dict, dict]:
    """send_weights in a thread of this process (a real gloo group of 2 ranks); (the header, the tensors received)."""
    link = wire.open_sender(tmp_path, "cpu", timeout=30)
    sender = threading.Thread(target=wire.send_weights, args=(link, version, specs, iter(tensors)))
    sender.start()
    receiver = wire.open_receiver(tmp_path, timeout=30)
    try:
        header = wire.receive_header(receiver)
        got = {name: t.clone() for bucket in wire.receive_buckets(receiver, header) for name, t in bucket}
        wire.ack(receiver)
        sender.join(timeout=30)
    finally:
        wire.close_sender(link, grace=0.1)
        wire.close_receiver(receiver)
    return header, got


def test_tensors_of_mixed_dtypes_and_odd_sizes_arrive_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(wire, "BUCKET_BYTES", 100)
    gen = torch.Generator().manual_seed(0)
    specs = [
        ("odd_bf16", (3,), torch.bfloat16),
        ("f32", (7,), torch.float32),
        ("i64", (2,), torch.int64),
        ("f16", (5, 1), torch.float16),
        ("big", (30,), torch.float32),
        ("b", (1,), torch.bfloat16),
    ]
    tensors = [(torch.randn(s, generator=gen) * 100).to(d) for _, s, d in specs]
    header, got = loopback(tmp_path, specs, tensors)
    assert header["buckets"] == [[0, 1, 2, 3], [4], [5]] and wire.header_bytes(header) == sum(t.nbytes for t in tensors)
    for (name, shape, dtype), t in zip(specs, tensors):
        assert got[name].dtype == dtype and got[name].shape == shape and torch.equal(got[name], t), name


def test_several_buckets_of_mixed_dtypes_into_the_hf_engine(tiny_model_dir, tmp_path, monkeypatch):
    """The tiny model's parameters, bf16 and fp32 in turn, in buckets of at most 4 KiB: many broadcasts, and the
    engine ends with exactly what was sent (cast back to its fp32)."""
    from engines import HFEngine
    from models import load_model

    monkeypatch.setattr(wire, "BUCKET_BYTES", 4096)
    model = load_model(tiny_model_dir)
    perturb(model)
    params = dict(model.named_parameters())
    specs = [(n, tuple(t.shape), torch.bfloat16 if i % 2 else torch.float32) for i, (n, t) in enumerate(params.items())]
    header, got = loopback(tmp_path, specs, [t.detach() for t in params.values()], version=4)
    assert len(header["buckets"]) > 10
    with HFEngine(tiny_model_dir) as engine:
        engine.load_weights(got, version=4)
        state = engine.model.state_dict()
    for name, _, dtype in specs:
        assert torch.equal(state[name], params[name].detach().to(dtype).float()), name


def test_a_header_only_link_makes_no_cuda_context(tmp_path, monkeypatch):
    """A vLLM explorer reads only the headers of an NCCL group (its engines' workers take the tensors): opening the
    link and reading a header must not touch CUDA, which would put a context on its engine's GPU."""
    link = wire.open_sender(tmp_path, "cuda", timeout=10)  # announces NCCL; the group is never made here
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("the header link touched CUDA"))
    receiver = wire.open_receiver(tmp_path, timeout=10, receivers=2)
    assert receiver.backend == "nccl" and int(link.store.get(wire.WORLD_KEY)) == 3
    wire.close_sender(link, finished=True, grace=0.1)
    assert wire.receive_header(receiver) is None
    wire.close_receiver(receiver)


# --- which folders are deleted


def test_checkpoint_pruning_spares_the_folders_an_explorer_may_be_loading(tmp_path):
    """sync_interval 10, save_interval 1, max_checkpoints_to_keep 2: at step 12 the state-dict pointer is still at
    10, which max_checkpoints_to_keep alone would delete under an explorer loading it; 9 (the folder before the
    pointer) is spared too. Once the pointer moves on, both go."""
    import checkpoint

    def save(step: int) -> None:  # what train.py leaves: the published folder, then the checkpoint of the step
        if step % 10 == 0:
            (tmp_path / f"global_step_{step}/actor/huggingface").mkdir(parents=True)
            sync.set_latest(tmp_path, step)
        (tmp_path / f"global_step_{step}/actor/huggingface").mkdir(parents=True, exist_ok=True)
        (tmp_path / f"global_step_{step}/actor/trainer_state.json").write_text("{}")
        checkpoint.prune_checkpoints(tmp_path, keep=2)

    def kept() -> list[int]:
        return sorted(int(p.name.removeprefix("global_step_")) for p in tmp_path.glob("global_step_*"))

    for step in range(1, 13):
        save(step)
    assert sync.latest_version(tmp_path) == 10 and kept() == [9, 10, 11, 12]
    for step in range(13, 21):
        save(step)
    assert kept() == [19, 20]
    assert sync.in_use(tmp_path) == {19, 20}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL sync needs 2 CUDA GPUs (one per side)")
def test_group_sync_nccl(tmp_path):
    trainer = peer(tmp_path, "nccl_trainer", str(tmp_path), env={"CUDA_VISIBLE_DEVICES": "0"})
    link = wire.open_receiver(tmp_path, timeout=60, device="cuda:1")
    assert link.backend == "nccl"
    version, state = wire.receive_weights(link)
    assert version == 1 and state["w"].device.type == "cuda"
    assert torch.equal(state["w"].cpu(), torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    assert wire.receive_weights(link) is None
    wire.close_receiver(link)
    finish(trainer)


# --- the peers


def run_trainer(model_dir: str, job_dir: str, version: str) -> None:
    from models import load_model

    model = load_model(model_dir)
    perturb(model)
    params = dict(model.named_parameters())  # tied weights appear once
    link = wire.open_sender(job_dir, "cpu", timeout=30)
    specs = [(n, tuple(p.shape), p.dtype) for n, p in params.items()]
    wire.send_weights(link, int(version), specs, (p.detach() for p in params.values()))
    save_file({n: p.detach().contiguous() for n, p in params.items()}, Path(job_dir, "sent.safetensors"))
    wire.close_sender(link, finished=True)


def run_explorer(model_dir: str, job_dir: str) -> None:
    from engines import HFEngine, SamplingParams

    prompt, greedy = [[1, 2, 3, 4, 5]], [SamplingParams(temperature=0.0, max_tokens=12)]
    with HFEngine(model_dir) as engine:
        before = engine.generate(prompt, greedy)[0][0].token_ids
        link = wire.open_receiver(job_dir, timeout=30)
        version, state = wire.receive_weights(link)
        engine.load_weights(state, version)
        after = engine.generate(prompt, greedy)[0][0].token_ids
        then = "finished" if wire.receive_weights(link) is None else "more"
        wire.close_receiver(link)
        dump = {n: t.detach().clone().contiguous() for n, t in engine.model.state_dict().items()}  # clone: untie
        save_file(dump, Path(job_dir, "engine.safetensors"))
        print(
            json.dumps(
                {
                    "version": version,
                    "model_version": engine.model_version,
                    "before": before,
                    "after": after,
                    "then": then,
                }
            )
        )


def run_stop(job_dir: str) -> None:
    link = wire.open_sender(job_dir, "cpu", timeout=30)
    wire.close_sender(link, finished=True, grace=20)


def run_die(job_dir: str, when: str) -> None:
    link = wire.open_sender(job_dir, "cpu", timeout=30)
    if when == "before_header":
        link.store.wait(["test/waiting"], link.timeout)  # the explorer asks for the header
        os._exit(3)

    def tensors():
        yield torch.ones(1000)
        link.store.wait(["test/got_header"], link.timeout)  # the explorer has the header
        os._exit(3)  # killed after the first of two tensors, before the bucket is broadcast

    wire.send_weights(link, 1, [("a", (1000,), torch.float32), ("b", (1000,), torch.float32)], tensors())


def run_nccl_trainer(job_dir: str) -> None:
    link = wire.open_sender(job_dir, "cuda:0", timeout=60)
    w = torch.arange(12, dtype=torch.bfloat16, device="cuda").reshape(3, 4)
    wire.send_weights(link, 1, [("w", (3, 4), torch.bfloat16)], [w])
    wire.close_sender(link, finished=True, grace=30)


def run_fake_trainer(model_dir: str, job_dir: str, versions: str) -> None:
    """Sends versions 1..n of perturbed weights, as train.py would at its sync points, then stop."""
    from models import load_model

    model = load_model(model_dir)
    link = wire.open_sender(job_dir, "cpu", timeout=60)
    for version in range(1, int(versions) + 1):
        perturb(model, seed=version)
        params = dict(model.named_parameters())
        specs = [(n, tuple(p.shape), p.dtype) for n, p in params.items()]
        wire.send_weights(link, version, specs, (p.detach() for p in params.values()))
    wire.close_sender(link, finished=True)


@pytest.mark.parametrize("train_batch", [128, 64, 256])  # the explorer writes 128 experiences a step
@pytest.mark.parametrize("interval,offset", [(1, 0), (1, 1), (2, 0), (3, 1), (3, 2)])
def test_the_trainer_publishes_exactly_what_explorer_steps_wait_for(train_batch, interval, offset):
    """One rule on both sides: the trainer's publishes() is true for a step exactly when that step's weights are
    what some explorer step waits for (weights_needed), that step not being the explorer's last."""
    cfg = configs.Config()
    cfg.buffer.batch_size, cfg.algorithm.repeat_times, cfg.buffer.train_batch_size = 16, 8, train_batch
    cfg.synchronizer.sync_interval, cfg.synchronizer.sync_offset = interval, offset
    total = 20 * 128 // train_batch  # trainer steps; the explorer writes the same 20 x 128 experiences
    published = [t for t in range(1, total + 1) if sync.publishes(t, cfg, total)]
    waited_for = sorted({sync.weights_needed(e, cfg) for e in range(1, 20)} - {0})  # explorer steps 1..19 (not 20)
    assert published == waited_for
    if train_batch == 128:  # on-policy (offset 0): every explorer step waits for the step just trained
        assert [sync.weights_needed(e, cfg) for e in range(1, 5)] == [
            max(e - offset, 0) if (e - offset) % interval == 0 else 0 for e in range(1, 5)
        ]


def accounting_cfg(train_batch: int, interval: int, offset: int, style: str = "fixed") -> configs.Config:
    """16 tasks x 8 repeats = 128 experiences an explorer step, train_batch a train step."""
    cfg = configs.Config()
    cfg.buffer.batch_size, cfg.algorithm.repeat_times, cfg.buffer.train_batch_size = 16, 8, train_batch
    cfg.synchronizer.sync_interval, cfg.synchronizer.sync_offset = interval, offset
    cfg.synchronizer.sync_method, cfg.synchronizer.sync_style = "checkpoint", style
    return cfg


def held_by(cfg: configs.Config, train_step: int, explorer_steps: int = 40) -> int:
    """The first explorer step after which the explorer, by the state it writes with it, holds for train step
    `train_step` (sync.holds): the step whose sync point waits for its weights."""
    return next(
        k
        for k in range(1, explorer_steps)
        if sync.holds({"step": k, "sync_wait": sync.sync_wait(k, cfg, 0)}, train_step, cfg)
    )


@pytest.mark.parametrize(
    "train_batch, interval, offset, first",
    [
        (128, 1, 0, [1, 2, 3, 4]),  # on-policy: train step t waits on explorer step t
        (128, 1, 1, [2, 3, 4, 5]),  # one step ahead: explorer step t + 1 waits for train step t
        (64, 1, 0, [1, 1, 2, 2]),  # two train steps per explorer step: both wait on it
        (256, 1, 0, [2, 4, 6, 8]),  # one train step per two explorer steps
        (128, 2, 0, [2, 2, 4, 4]),  # sync every second step: train steps 1 and 2 wait on explorer step 2
        (128, 3, 1, [4, 4, 4, 7]),
    ],
)
def test_which_explorer_step_a_train_step_waits_on(train_batch, interval, offset, first):
    """A train step takes a partial batch once the explorer has written the step whose sync point waits for its
    weights (or a later one): never before (the explorer still writes for it), and the explorer reaches that step
    without needing the weights of this train step or a later one (no deadlock)."""
    cfg = accounting_cfg(train_batch, interval, offset)
    assert [held_by(cfg, t) for t in range(1, 5)] == first
    for t in range(1, 5):
        before = [sync.sync_wait(k, cfg, 0) for k in range(1, held_by(cfg, t))]
        assert all(w < t for w in before), (t, before)  # nothing before it waits for train step t or later


def test_holds_finished_old_states_and_the_other_styles():
    """A finished explorer holds every step; a state written before sync_wait was recorded (an older nanorft's) gives
    weights_needed of its step; an explorer that already has the weights (a restart) does not wait; explorer_driven
    waits for any version newer than its own; trainer_driven never waits."""
    cfg = accounting_cfg(128, 1, 0)
    assert sync.holds({"step": 0, "finished": True}, 99, cfg)
    assert sync.holds({"step": 3}, 3, cfg) and not sync.holds({"step": 2}, 3, cfg)
    assert sync.sync_wait(3, cfg, 0) == 3 and sync.sync_wait(3, cfg, 3) == 0
    cfg = accounting_cfg(128, 1, 0, "explorer_driven")
    assert sync.sync_wait(3, cfg, 1) == 2
    cfg = accounting_cfg(128, 2, 0, "explorer_driven")  # the trainer publishes every second step
    assert sync.sync_wait(4, cfg, 2) == 4 and sync.sync_wait(4, cfg, 3) == 4
    assert [t for t in range(1, 9) if sync.publishes(t, cfg, 8)] == [2, 4, 6, 8]
    cfg = accounting_cfg(128, 1, 0, "trainer_driven")
    assert sync.sync_wait(3, cfg, 1) == 0


def documented_versions() -> dict[tuple[int, int], list[int]]:
    """docs/checkpoints.md's table: (sync_interval, sync_offset) -> the weights version of explorer steps 1, 2, ..."""
    rows = {}
    for line in (ROOT / "docs" / "checkpoints.md").read_text().splitlines():
        if m := re.fullmatch(r"\| (\d+), (\d+)[^|]*\|((?: \d+ \|)+)", line):
            rows[int(m[1]), int(m[2])] = [int(v) for v in m[3].replace("|", " ").split()]
    return rows


def test_the_documented_versions_of_each_explorer_step_follow_weights_needed():
    """Each row of the docs' table: explorer step e rolls out with the weights its last sync point before it got
    (sync.weights_needed of steps e - 1, e - 2, ...; 0 before any), one explorer step per train step."""
    rows = documented_versions()
    assert set(rows) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    cfg = configs.Config()
    cfg.buffer.batch_size, cfg.algorithm.repeat_times, cfg.buffer.train_batch_size = 2, 2, 4
    for (interval, offset), versions in rows.items():
        cfg.synchronizer.sync_interval, cfg.synchronizer.sync_offset = interval, offset
        rule = [next((w for k in range(e - 1, 0, -1) if (w := sync.weights_needed(k, cfg))), 0) for e in range(1, 8)]
        assert versions == rule, (interval, offset)


@pytest.mark.slow
def test_sync_interval_2_offset_1_in_mode_both_rolls_out_with_the_documented_versions(tmp_path, tiny_model_dir):
    """Mode both, sync_interval 2, sync_offset 1 (checkpoint sync), 6 steps: the version each experience records is the
    docs' table's for its explorer step; the engine really held those weights (its rollout log-probs are theirs); the
    trainer's staleness is train step - 1 - that version."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "synchronizer.sync_interval": 2,
            "synchronizer.sync_offset": 1,
            "buffer.total_steps": 6,
            "trainer.save_interval": 2,  # steps 2, 4 and 6 kept: the weights the explorer loaded
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    out = launch(config)
    assert out.returncode == 0, out.stderr[-4000:]
    run, table = tmp_path / "ck" / "p" / "run", documented_versions()[2, 1][:6]
    db = run / "buffer" / "exp.db"
    assert table == [0, 0, 0, 2, 2, 4] and versions_by_step(db) == [v for v in table for _ in range(4)]
    for version in (2, 4):
        assert rollout_logprob_gap(db, version, sync.weights_path(run, version)) < 1e-4
    assert rollout_logprob_gap(db, 2, Path(tiny_model_dir)) > 1e-3  # not the weights it started with
    from monitor import read_history

    history = read_history(run / "monitor" / "trainer.jsonl")
    assert (
        [m["batch/staleness/max"] for m in history] == [s - 1 - v for s, v in enumerate(table, 1)] == [0, 1, 2, 1, 2, 1]
    )


DROPPING_REWARD = """
from workflows.math import math_reward


def score(response, reference, *, drop: list[str] | None = None):
    if reference in (drop or []):
        raise RuntimeError("this reward raises for this task")
    return math_reward(response, reference)
"""


def dropping_run(tmp_path: Path, tiny_model_dir: str, dropped: list[int], **over) -> Path:
    """A mode-both GRPO run (2 tasks x 2 repeats a step, 4 steps, on-policy, checkpoint sync) whose reward raises for
    the train tasks of these row numbers, the workflow tried once; a stuck step fails it within 90 s, not 300."""
    rows = (Path(tiny_model_dir).parent / "arith" / "train.jsonl").read_text().splitlines()
    reward = tmp_path / "dropping.py"
    reward.write_text(DROPPING_REWARD)
    return both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "buffer.total_steps": 4,
            "buffer.default_reward_fn_type": f"{reward}:score",
            "buffer.explorer_input.taskset.reward_fn_args": {"drop": [json.loads(rows[i])["answer"] for i in dropped]},
            "buffer.explorer_input.eval_tasksets": [],
            "buffer.trainer_input.experience_buffer.max_read_timeout": 90,
            "synchronizer.sync_timeout": 90,
            "explorer.max_retry_times": 0,
            **over,
        },
    )


def claims_by_step(db: Path) -> tuple[dict[int, list[str]], list[int]]:
    """train step -> the group ids it trained on; the model version of each experience, by id."""
    from buffer import ExperienceDB

    with ExperienceDB(f"sqlite:///{db}") as d:
        claims = d.query("SELECT c.step, e.group_id FROM claims c JOIN experiences e ON e.id = c.exp_id ORDER BY e.id")
    out: dict[int, list[str]] = {}
    for step, group in claims:
        out.setdefault(step, []).append(group.rsplit("/", 1)[-1])
    return out, versions_by_step(db)


@pytest.mark.slow(seconds=35)
@pytest.mark.parametrize("method", ["checkpoint", "nccl"])
def test_dropped_tasks_refilled_and_a_short_and_an_empty_step_still_end(tmp_path, tiny_model_dir, method):
    """Mode both, GRPO, on-policy: the reward raises for train tasks 0 and 2-6. Step 1 (tasks 0, 1) refills task 0
    with task 2, dropped too: it writes task 1's group alone; step 2 (3, 4, refilled with 5, 6) writes nothing.
    The trainer takes step 1's 2 experiences and step 2's none (no update, its weights published, or sent over the
    process group, unchanged) as soon as the explorer waits for their weights, and the run ends: every experience
    trained once, the explorer's steps 3 and 4 rolled out on the versions their sync points waited for, the drops
    counted."""
    config = dropping_run(tmp_path, tiny_model_dir, [0, 2, 3, 4, 5, 6], **{"synchronizer.sync_method": method})
    start = time.monotonic()
    out = launch(config, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert time.monotonic() - start < 90  # no step waited out max_read_timeout or sync_timeout
    run = tmp_path / "ck" / "p" / "run"
    claims, versions = claims_by_step(run / "buffer" / "exp.db")
    assert claims == {1: ["1", "1"], 3: ["7", "7", "8", "8"], 4: ["9", "9", "10", "10"]}
    assert versions == [0, 0, 2, 2, 2, 2, 3, 3, 3, 3]
    from monitor import read_history

    explorer = read_history(run / "monitor" / "explorer.jsonl")
    assert [(m["rollout/failed_count"], m["rollout/refilled_tasks"], m["rollout/missing_tasks"]) for m in explorer] == [
        (2, 1, 1),
        (4, 2, 2),
        (0, 0, 0),
        (0, 0, 0),
    ]
    trainer = read_history(run / "monitor" / "trainer.jsonl")
    assert [(m["batch/size"], m["batch/short"]) for m in trainer] == [(2, 1.0), (0, 1.0), (4, 0.0), (4, 0.0)]


@pytest.mark.slow(seconds=45)
def test_a_run_stuck_on_a_short_step_by_an_older_nanorft_finishes_when_relaunched(tmp_path, tiny_model_dir):
    """The state an older nanorft left: the explorer wrote its short step 1 (task 0 dropped, and task 2 in its place)
    and waited at the sync point for weights that never came (here an explorer alone, stopped by its sync_timeout),
    its DB state without sync_wait. Relaunched in mode both on the same job directory and DB, the trainer takes
    step 1's partial batch (the state's step gives its sync point), the explorer goes on after step 1, and the run
    ends with every experience trained once."""
    config = dropping_run(tmp_path, tiny_model_dir, [0, 2, 3, 4, 5, 6], **{"synchronizer.sync_timeout": 5})
    out = launch(config, "--mode", "explore", timeout=600)
    assert out.returncode == 1 and "Restart to continue after step 1" in out.stderr, out.stderr[-4000:]
    from buffer import ExperienceDB

    db = tmp_path / "ck" / "p" / "run" / "buffer" / "exp.db"
    with ExperienceDB(f"sqlite:///{db}") as d:
        state = d.explorer_states()["explorer"]
        assert state["step"] == 1 and d.counts()["total"] == 2
        d.set_explorer_state("explorer", {k: v for k, v in state.items() if k not in ("sync_wait", "written")})
    start = time.monotonic()
    out = launch(dropping_run(tmp_path, tiny_model_dir, [0, 2, 3, 4, 5, 6]), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert time.monotonic() - start < 90  # no step waited out max_read_timeout or sync_timeout
    claims, versions = claims_by_step(db)
    assert claims == {1: ["1", "1"], 3: ["7", "7", "8", "8"], 4: ["9", "9", "10", "10"]}
    assert versions == [0, 0, 2, 2, 2, 2, 3, 3, 3, 3]


if __name__ == "__main__":
    {
        "trainer": run_trainer,
        "explorer": run_explorer,
        "stop": run_stop,
        "die": run_die,
        "nccl_trainer": run_nccl_trainer,
        "fake_trainer": run_fake_trainer,
    }[sys.argv[1]](*sys.argv[2:])


def verify_stage(tmp_path: Path, tiny_model_dir: str, **over) -> configs.Config:
    config = both_config(tmp_path, tiny_model_dir, **{"synchronizer.sync_method": "nccl", **over})
    (stage,) = configs.resolve_stages(configs.cli(["--config", str(config)])[0])
    return stage


def test_verify_sync_finds_the_engine_holds_the_weights_sent_and_names_a_transfer_that_changed_them(
    tmp_path, tiny_model_dir, monkeypatch
):
    """--verify-sync (sync_check.verify) on the HF engine: the model's weights over the group, then from their
    folder: the engine's checksums agree. A trainer that sends other weights (a perturbed model) is named: every weight
    differs; the launcher then stops before any stage, with a config error."""
    import launch
    import sync_check

    stage = verify_stage(tmp_path, tiny_model_dir, **{"explorer.rollout_model": {"engine_type": "hf"}})
    assert sync_check.verify(stage) == ""
    from helpers import perturbed

    send, other = sync_check.verify_send, perturbed(tiny_model_dir)
    monkeypatch.setattr(sync_check, "verify_send", lambda kind, link, model, *rest: send(kind, link, other, *rest))
    assert re.fullmatch(r"\d+ weights differ after the transfer, e\.g\. .*", sync_check.verify(stage))
    monkeypatch.setattr(launch, "run", lambda cfg: pytest.fail("a stage started"))
    config = both_config(tmp_path, tiny_model_dir, **{"synchronizer.sync_method": "nccl"})
    assert launch.main(["--config", str(config), "--verify-sync"]) == 2
