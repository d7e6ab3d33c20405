"""The trainer: real train.py processes (plain and torchrun with 2 gloo ranks), micro-batching and loss
scaling, checkpoints and exact resume, a GRPO step checked against hand-computed numbers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import safetensors.torch
import torch
from transformers import AutoModelForCausalLM

import models
import train
from buffer import Experience, ExperienceDB
from conftest import write_yaml
from models import load_model, load_tokenizer
from monitor import read_history

ROOT = Path(__file__).resolve().parents[1]


def sft_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    data = Path(tiny_model_dir).parent / "arith"
    cfg = {
        "project": "p", "name": "t", "mode": "train", "checkpoint_root_dir": str(tmp_path / "ck"),
        "algorithm": {"algorithm_type": "sft", "optimizer": {"lr": 1e-3}},
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 64},
        "buffer": {"train_batch_size": 8, "total_steps": 2,
                   "trainer_input": {"experience_buffer": {"name": "sft", "storage_type": "file",
                                                           "path": str(data / "sft.jsonl"),
                                                           "format": {"prompt_type": "messages"}}}},
        "synchronizer": {"sync_interval": 100},
        "trainer": {"save_interval": 1},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "train.yaml", cfg, over)


def run_train(config: Path, ranks: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
    """train.py as the launcher starts it: a plain process (ranks=0) or under torchrun."""
    cmd = [sys.executable, "train.py", "--config", str(config)]
    if ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *cmd[1:]]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "NANORFT_LAUNCHED": "1", "OMP_NUM_THREADS": "1"})
    return out


def weights(job: Path, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(job / f"global_step_{step}" / "actor" / "huggingface" / "model.safetensors")


# --- pieces


def test_micro_batches_respect_the_token_budget():
    lengths = [10, 50, 30, 30, 5, 60]
    mbs = models.micro_batches(lengths, budget=100, fixed=None)
    assert sorted(i for mb in mbs for i in mb) == list(range(6))  # each sequence exactly once
    for mb in mbs:  # padded size (rows x longest) within the budget, unless a sequence is alone
        assert len(mb) * max(lengths[i] for i in mb) <= 100 or len(mb) == 1
    assert mbs[0] == [5]  # longest first: 60 alone (60 + 50 padded to 120 > 100)
    assert models.micro_batches(lengths, budget=10**6, fixed=None) == [[5, 1, 2, 3, 0, 4]]
    assert [len(mb) for mb in models.micro_batches(lengths, budget=0, fixed=4)] == [4, 2]
    assert models.micro_batches([500], budget=100, fixed=None) == [[0]]  # too long: alone, not dropped
    # units (DPO pairs) stay together and in order; a unit is as long as its longest row
    units = [[0, 1], [2, 3], [4, 5]]
    # longest unit first: (4, 5) max 60, (0, 1) max 50, (2, 3) max 30; 4 rows x 60 = 240 fits 250, 6 x 60 does not
    assert models.micro_batches(lengths, budget=250, fixed=None, units=units) == [[4, 5, 0, 1], [2, 3]]
    assert models.micro_batches(lengths, budget=0, fixed=3, units=units) == [[4, 5], [0, 1], [2, 3]]  # 2 + 2 > 3


def test_collate_and_token_logprobs_match_one_sequence_at_a_time(tiny_model_dir):
    """Right padding and the shift by one: each response token's log-prob equals a forward pass of that
    sequence alone; padding and prompt positions are masked."""
    model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    exps = [Experience(tokens=torch.randint(0, 250, (n,), generator=g), prompt_length=p, reward=0.0)
            for n, p in [(20, 12), (9, 4), (31, 30)]]
    mb = models.collate(exps, {}, [0, 1, 2], torch.device("cpu"))
    with torch.no_grad():
        logp, ent = models.token_logprobs(model, mb, temperature=0.7, entropy=True)
    assert logp.shape == (3, 8) and mb["response_mask"].sum(-1).tolist() == [8, 5, 1]
    for b, x in enumerate(exps):
        with torch.no_grad():
            alone = torch.log_softmax(model(x.tokens[None]).logits[0].float() / 0.7, -1)  # [L,V]
        want = alone[x.prompt_length - 1 : -1].gather(-1, x.tokens[x.prompt_length:, None]).squeeze(-1)
        torch.testing.assert_close(logp[b, : x.response_length], want, atol=1e-5, rtol=0)
        assert not mb["response_mask"][b, x.response_length:].any()
        assert (ent[b, : x.response_length] > 0).all()


def test_learning_rate_warmup_and_cosine():
    import configs

    cfg = configs.Config()
    cfg.algorithm.optimizer.lr, cfg.algorithm.optimizer.lr_warmup_steps = 1.0, 4
    assert [train.lr_at(s, cfg.algorithm.optimizer, 10) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    cfg.algorithm.optimizer.lr_scheduler_type, cfg.algorithm.optimizer.min_lr_ratio = "cosine", 0.1
    assert train.lr_at(4, cfg.algorithm.optimizer, 10) == 1.0 and abs(train.lr_at(10, cfg.algorithm.optimizer, 10) - 0.1) < 1e-12
    assert abs(train.lr_at(7, cfg.algorithm.optimizer, 10) - (0.1 + 0.9 * 0.5)) < 1e-12  # half way: the cosine's midpoint


# --- whole runs


def test_micro_batches_and_fsdp_ranks_give_the_same_update(tmp_path, tiny_model_dir):
    """Gradient accumulation is scaled right: one micro-batch, many small micro-batches, two FSDP2 ranks
    and activation checkpointing all end at the same weights (up to float rounding, far below the size
    of the update)."""
    runs = {"one": ({"trainer.max_token_len_per_gpu": 100000}, 0),
            "many": ({"trainer.max_token_len_per_gpu": 200}, 0),
            "ranks2": ({"trainer.max_token_len_per_gpu": 100000}, 2),
            "recompute": ({"trainer.max_token_len_per_gpu": 100000, "trainer.gradient_checkpointing": True}, 0)}
    final = {}
    for name, (over, ranks) in runs.items():
        config = sft_config(tmp_path / name, tiny_model_dir, **over)
        out = run_train(config, ranks=ranks)
        assert out.returncode == 0, out.stderr[-3000:]
        final[name] = weights(tmp_path / name / "ck" / "p" / "t", 2)
    start = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = max((final["one"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3  # two AdamW steps at lr 1e-3 move the weights by about 2e-3
    for other in ("many", "ranks2", "recompute"):
        diff = max((final[other][k] - final["one"][k]).abs().max().item() for k in start)
        assert diff < moved / 100, (other, diff, moved)
    history = read_history(tmp_path / "many" / "ck" / "p" / "t" / "monitor" / "trainer.jsonl")
    assert [r["step"] for r in history] == [1, 2] and history[1]["actor/sft_loss"] < history[0]["actor/sft_loss"]


def test_checkpoint_layout_and_plain_transformers_load(tmp_path, tiny_model_dir):
    out = run_train(sft_config(tmp_path, tiny_model_dir, **{"trainer.save_interval": 1}))
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "t"
    assert (job / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (job / "latest_state_dict_iteration.txt").read_text().strip() == "2"
    assert json.loads((job / "trainer_meta.json").read_text())["latest_iteration"] == 2
    for step in (1, 2):
        actor = job / f"global_step_{step}" / "actor"
        assert {p.name for p in actor.iterdir()} == {"huggingface", "optimizer.safetensors", "trainer_state.json",
                                                       "rng_state_rank0.safetensors"}
    assert not list(job.rglob(".*tmp*"))  # no temporary leftovers
    hf = job / "global_step_2" / "actor" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.tie_word_embeddings == load_model(tiny_model_dir).config.tie_word_embeddings
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = load_tokenizer(str(hf))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > ids["input_ids"].shape[1]
    optim = safetensors.torch.load_file(job / "global_step_2" / "actor" / "optimizer.safetensors")
    assert any(k.endswith("/exp_avg_sq") for k in optim)


def test_killed_trainer_resumes_exactly(tmp_path, tiny_model_dir):
    """SIGKILL after the step-2 checkpoint, restart: the final weights equal an uninterrupted run's bitwise
    (model, optimizer, data position and RNG all restored)."""
    over = {"buffer.total_steps": 4, "trainer.save_interval": 2}
    straight = run_train(sft_config(tmp_path / "a", tiny_model_dir, **over))
    assert straight.returncode == 0, straight.stderr[-3000:]
    config = sft_config(tmp_path / "b", tiny_model_dir, **over)
    job = tmp_path / "b" / "ck" / "p" / "t"
    proc = subprocess.Popen([sys.executable, "train.py", "--config", str(config)], cwd=ROOT,
                            env={**os.environ, "NANORFT_LAUNCHED": "1", "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pointer = job / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 240
    while not (pointer.exists() and pointer.read_text().strip() == "2") and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (job / "global_step_4").exists()
    resumed = run_train(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 2" in resumed.stderr
    a, b = weights(tmp_path / "a" / "ck" / "p" / "t", 4), weights(job, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def grpo_db(path: Path, tokenizer) -> None:
    """One task, four responses: "5" twice with reward 1, "7" twice with reward 0 (one group)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    exps = []
    for run_id, (answer, reward) in enumerate([("5", 1.0), ("7", 0.0), ("5", 1.0), ("7", 0.0)]):
        resp = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        exps.append(Experience(tokens=torch.tensor(prompt + resp), prompt_length=len(prompt), reward=reward,
                               logprobs=torch.zeros(len(resp)), group_id="g0", run_id=run_id, task_id="t0"))
    with ExperienceDB(f"sqlite:///{path}") as db:
        db.write(exps)


def response_logprob(model, tokenizer, answer: str) -> float:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    resp = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    x = Experience(tokens=torch.tensor(prompt + resp), prompt_length=len(prompt), reward=0.0)
    with torch.no_grad():
        logp, _ = models.token_logprobs(model, models.collate([x], {}, [0], torch.device("cpu")), 1.0, False)
    return logp.sum().item()


def test_grpo_step_hand_checked_and_moves_probability_toward_reward(tmp_path, tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    db = tmp_path / "exp.db"
    grpo_db(db, tok)
    config = sft_config(tmp_path, tiny_model_dir, **{
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 4, "optimizer": {"lr": 1e-2}},
        "buffer.train_batch_size": 4, "buffer.total_steps": 1,
        "buffer.trainer_input.experience_buffer": {"name": "exp", "storage_type": "queue", "path": f"sqlite:///{db}",
                                                   "max_read_timeout": 5}})
    out = run_train(config)
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "t"
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


def test_trainer_without_experiences_stops_with_a_clear_message(tmp_path, tiny_model_dir):
    config = sft_config(tmp_path, tiny_model_dir, **{
        "algorithm": {"algorithm_type": "grpo", "repeat_times": 2},
        "buffer.trainer_input.experience_buffer": {"name": "exp", "storage_type": "queue", "max_read_timeout": 7}})
    out = run_train(config)
    assert out.returncode == 1
    assert "train step 1: waiting for experiences: 0 of 8 ready after 5 s" in out.stderr  # the note while waiting
    assert ("no full batch for train step 1 after 7 s (buffer.trainer_input.experience_buffer.max_read_timeout); "
            "explorers: none has written to this DB yet. Stopping") in out.stderr
    with ExperienceDB(f"sqlite:///{tmp_path / 'ck' / 'p' / 't' / 'buffer' / 'exp.db'}") as d:
        assert json.loads(d.get_meta("trainer"))["status"] == "stopped" and d.counts()["claims"] == 0
