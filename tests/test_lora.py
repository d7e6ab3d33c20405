"""LoRA through peft (lora.py): the config's refusals, an adapter that alone trains, merged weights for the engines
(files and the process group) equal to the peft model, adapter checkpoints that plain peft loads, an exact resume,
one rank == two ranks, the reference model without the adapter, and an explorer starting from a saved adapter."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

import batching
import checkpoint
import explore
import lora
import models
import scoring
import sync
import train
import wire
from configs import Config, ConfigError, cli, from_dict, normalize, resolve_stages
from configs.schema import LoRAConfig, OptimizerConfig, TrainerConfig
from helpers import (
    ROOT,
    STRAIGHT,
    both_config,
    experiences,
    launch,
    plain_logprobs,
    rollout_logprob_gap,
    run_explorer,
    run_trains,
    sft_config,
    straight_and_resumed,
    versions_by_step,
    write_config,
)
from monitor import read_history

LORA = {"model.lora_configs": [{"lora_rank": 4, "lora_alpha": 8}]}
CPU = torch.device("cpu")


@pytest.fixture
def one_rank():
    """A process group of one (what train.py makes in a plain process), for FSDP2 in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def micro(seed: int = 0) -> tuple[list, dict]:
    """Three random sequences (two sharing a prompt) and their packed micro-batch."""
    exps = experiences([(9, [6, 4]), (5, [7])], seed=seed)
    batch = batching.step_batch(exps, width=7)
    return exps, batching.micro_batch(batch, batching.pack_units(batch, [0, 1, 2], True, 10**6), True, CPU)


def gap(scorer: torch.nn.Module, model: torch.nn.Module) -> float:
    """Largest |log-prob from the trainer's (FSDP2) scorer - from `model` run on each sequence alone| over micro()."""
    exps, mb = micro()
    with torch.no_grad():
        logp = scorer(mb)[0]  # [n,T]
    return max(
        (logp[k, : exps[b].response_length] - plain_logprobs(model, exps[b].tokens, exps[b].prompt_length))
        .abs()
        .max()
        .item()
        for k, b in enumerate(mb["rows"].tolist())
    )


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[None]).logits[0].float()  # [L,V]


def plain(folder: str | Path) -> torch.nn.Module:
    """A folder as plain transformers loads it (its own attention, no nanorft code)."""
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def with_random_b(hf: torch.nn.Module, adapter_cfg: LoRAConfig, seed: int = 1) -> lora.Adapter:
    """A LoRA adapter on `hf` with B drawn at random (a new one has B = 0, which would hide a wrong merge)."""
    adapter = lora.wrap(hf, adapter_cfg, "")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, q in hf.named_parameters():
            if ".lora_B." in name:
                q.copy_(torch.randn(q.shape, generator=g) * 0.05)
    return adapter


# --- the config


def resolved(lora_configs: list) -> Config:
    raw = {
        "model": {"model_path": "m", "max_model_len": 256, "lora_configs": lora_configs},
        "buffer": {"batch_size": 4, "explorer_input": {"taskset": {"path": "data/x"}}},
    }
    return resolve_stages(from_dict(Config, normalize(raw)))[0]


@pytest.mark.parametrize(
    "lora_configs, message",
    [
        ([{"lora_rank": 0}], r"model.lora_configs\[0\].lora_rank: 0 is out of range; allowed: >= 1"),
        ([{"lora_alpha": -1}], r"model.lora_configs\[0\].lora_alpha: -1.0 is out of range; allowed: > 0"),
        ([{}, {}], r"model.lora_configs = \[2 sections\] is refused: one LoRA adapter at most"),
        ([{"path": "assets"}], r"model.lora_configs\[0\].path = 'assets' is refused: not a saved peft adapter"),
        ([{"target_modules": {"q": 1}}], r"lora_configs\[0\].target_modules: \{'q': 1\} is not a valid str or list"),
        ([{"lora_ranks": 8}], r"model.lora_configs\[0\].lora_ranks: unknown key; did you mean lora_rank\?"),
    ],
)
def test_bad_lora_keys_are_refused_by_name(lora_configs, message):
    with pytest.raises(ConfigError, match=message):
        resolved(lora_configs)


def test_trinity_keys_read_as_peft_reads_them():
    c = resolved([{"lora_rank": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "exclude_modules": "x"}])
    assert c.model.lora_configs == [
        LoRAConfig(lora_rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"], exclude_modules="x")
    ]
    assert resolved([{}]).model.lora_configs[0].target_modules == "all-linear"  # Trinity's default: a string


def test_help_shows_the_adapter_keys_and_the_command_line_sets_them(tmp_path, capsys, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {model_path: m, max_model_len: 256, lora_configs: [{lora_rank: 8}]}\n"
        "buffer: {batch_size: 4, explorer_input: {taskset: {path: data/x}}}\n"
    )
    cfg, _ = cli(
        [
            "--config",
            str(path),
            "--model.lora_configs.0.lora_alpha",
            "4",
            "--model.lora_configs.0.target_modules",
            "q_proj",
            "v_proj",
        ]
    )
    assert cfg.model.lora_configs == [LoRAConfig(lora_rank=8, lora_alpha=4.0, target_modules=["q_proj", "v_proj"])]
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli(["--config", str(path), "--help"])
    shown = capsys.readouterr().out
    assert "--model.lora_configs.0.lora_rank INT" in shown and "r: rank of the update B.A" in shown
    assert "--model.lora_configs.0.target_modules STR|" in shown and "--model.fully_sharded_loras" in shown


@pytest.mark.parametrize(
    "target, exclude, layers",
    [
        ("all-linear", None, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        (["q_proj", "v_proj"], None, {"q_proj", "v_proj"}),
        (r".*\.mlp\..*_proj", None, {"gate_proj", "up_proj", "down_proj"}),
        ("all-linear", ["down_proj", "o_proj"], {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}),
    ],
)
def test_merged_weights_give_the_peft_models_logits(tiny_model_dir, tmp_path, target, exclude, layers):
    """target_modules / exclude_modules as peft reads them, never the LM head; the merged weights (W + s B A under
    W's name) saved as the trainer publishes them load in plain transformers and give the peft model's logits."""
    hf = models.load_model(tiny_model_dir)
    adapter = with_random_b(hf, LoRAConfig(lora_rank=4, lora_alpha=8, target_modules=target, exclude_modules=exclude))
    n_layers = hf.config.num_hidden_layers
    assert {name.rsplit(".", 1)[1] for name in adapter.scaling} == layers
    assert len(adapter.scaling) == len(layers) * n_layers
    assert set(adapter.scaling.values()) == {2.0} and not isinstance(hf.lm_head, LoraLayer)
    merged = lora.merge(hf.state_dict(), adapter.scaling)
    base = safetensors.torch.load_file(Path(tiny_model_dir, "model.safetensors"))
    assert set(merged) - {"lm_head.weight"} == set(base)  # the plain model's names (the head is tied)
    sync.save_hf(hf, models.load_tokenizer(tiny_model_dir), tmp_path / "merged", merged)
    ids = torch.arange(3, 60)
    want = logits(hf, ids)  # the peft model: x W^T + s (x A^T) B^T
    got = logits(plain(tmp_path / "merged"), ids)
    assert (got - want).abs().max().item() < 1e-5
    assert (got - logits(plain(tiny_model_dir), ids)).abs().max().item() > 1e-2  # the adapter does change them


@pytest.mark.parametrize(
    "target, message",
    [
        (["nothing_here"], "model.lora_configs\\[0\\].target_modules / exclude_modules: Target modules"),
        (["lm_head"], "lm_head is not a plain LoRA on a linear layer"),
        (["embed_tokens"], "embed_tokens is not a plain LoRA on a linear layer"),
    ],
)
def test_layers_lora_cannot_merge_here_are_refused_by_name(tiny_model_dir, target, message):
    with pytest.raises(ConfigError, match=message):
        lora.wrap(models.load_model(tiny_model_dir), LoRAConfig(lora_rank=4, target_modules=target), "")


# --- the trainer's pieces, in this process (one rank)


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_dir, tmp_path, one_rank):
    """The optimizer holds the adapter's A and B and nothing else; a new adapter starts exactly at the base; after
    steps the base weights are bitwise those of the file, B has moved, the merged weights the trainer publishes give
    its log-probs, and the reference (the actor with its adapter off) scores exactly as the base model. The
    reference runs first: gradients still reach A and B after it."""
    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=(LoRAConfig(lora_rank=4), ""))
    optim = train.adamw(actor, 1e-2, OptimizerConfig())
    adapter = {name: q for name, q in actor.named_parameters() if lora.is_adapter(name)}
    assert [q for g in optim.param_groups for q in g["params"]] == list(adapter.values())
    assert len(adapter) == 2 * 7 * 4 and all(q.requires_grad for q in adapter.values())
    assert not [n for n, q in actor.named_parameters() if q.requires_grad and n not in adapter]
    base = safetensors.torch.load_file(Path(tiny_model_dir, "model.safetensors"))
    assert all(torch.equal(lora.full_state(actor)[k], base[k]) for k in base)  # B = 0: W + s B A == W bitwise
    ref, plain_base = lora.WithoutAdapter(actor), scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, False)
    mb = micro()[1]
    with torch.no_grad():
        assert torch.equal(ref(mb)[0], plain_base(mb)[0])  # the first pass of the actor: with its adapter off
    for step in range(2):
        optim.zero_grad()
        (-actor(micro(step)[1])[0].sum()).backward()
        grads = {n: q.grad.full_tensor().abs().max().item() for n, q in adapter.items() if q.grad is not None}
        want = [n for n in adapter if ".lora_B." in n or step == 1]  # at step 0, B = 0: A gets no gradient yet
        assert set(grads) == set(adapter) and min(grads[n] for n in want) > 0, step
        optim.step()
    state = sync.full_state(actor.model)
    for k, t in base.items():  # the frozen weights, under peft's base_layer names where adapted
        k = k if k in state else k.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(state[f"{k}"], t), k
    assert min(state[n.removeprefix("model.")].abs().max().item() for n in adapter if ".lora_B." in n) > 1e-3
    with torch.no_grad():
        assert torch.equal(ref(mb)[0], plain_base(mb)[0])  # still exactly the base
        assert (actor(mb)[0] - plain_base(mb)[0]).abs().max().item() > 1e-3  # while the actor has moved
    folder = sync.save_hf(actor.model, None, tmp_path / "published", lora.full_state(actor))
    assert gap(actor, plain(folder)) < 1e-5 and gap(actor, plain(tiny_model_dir)) > 1e-3


def test_the_process_group_sends_the_merged_weights_under_the_plain_names(tiny_model_dir, tmp_path, one_rank):
    """sync_method nccl with LoRA: what the explorer receives (and loads strictly into a plain model) is the merged
    weights, bit for bit what the checkpoint method would publish, in the engine's dtype."""
    import threading

    from engines import HFEngine

    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=(LoRAConfig(lora_rank=4), ""))
    with torch.no_grad():
        for name, q in actor.named_parameters():
            if ".lora_B." in name:
                q.fill_(0.01)
    merged = lora.full_state(actor)
    sender, got = wire.open_sender(tmp_path, "cpu", 60), {}
    receiver = threading.Thread(
        target=lambda: got.update(zip(("version", "state"), wire.receive_weights(wire.open_receiver(tmp_path, 60))))
    )
    receiver.start()
    sent = lora.send_model(sender, actor, 7, torch.bfloat16)
    receiver.join(60)
    wire.close_sender(sender, grace=0.1)
    names = {n for n, _ in models.load_model(tiny_model_dir).named_parameters()}
    assert got["version"] == 7 and set(got["state"]) == names and sent > 0
    assert all(torch.equal(got["state"][n], merged[n].bfloat16()) for n in names)
    with HFEngine(tiny_model_dir) as engine:
        engine.load_weights({n: t.float() for n, t in got["state"].items()}, version=7)  # strict: the plain names


def test_an_explorer_starts_where_the_trainer_does_from_a_saved_adapter(tiny_model_dir, tmp_path, one_rank):
    """model.lora_configs[0].path: the trainer starts from base + that adapter, and the explorer's engine from a
    folder of the two merged by peft (lora.merged_folder): the same log-probs."""
    hf = models.load_model(tiny_model_dir)
    adapter = with_random_b(hf, LoRAConfig(lora_rank=4, lora_alpha=8))
    adapter.peft.save_pretrained(str(tmp_path / "saved"))
    cfg = Config()
    cfg.model.model_path, cfg.checkpoint_job_dir = tiny_model_dir, str(tmp_path / "job")
    cfg.model.lora_configs = [LoRAConfig(path=str(tmp_path / "saved"), lora_rank=32)]  # the saved rank wins (4)
    folder = explore.base_weights(cfg)
    assert folder == str(tmp_path / "job" / "lora_start" / "explorer")
    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=lora.start(cfg, 0))
    assert actor.adapter.peft.peft_config["default"].r == 4
    assert gap(actor, plain(folder)) < 1e-5 and gap(actor, plain(tiny_model_dir)) > 1e-3


# --- whole runs of train.py


def adapter_of(job: Path, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(job / f"global_step_{step}/actor/lora_adapter/adapter_model.safetensors")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (job directory, exit code and stderr) of the LoRA SFT runs of the slow tests below: those of one rank
    in ONE train.py process, in this order, and the one of two ranks in a torchrun launch (helpers.run_trains):
    "saved" (2 steps, a checkpoint each), "saved_full" (the same run directory, 3 steps, no LoRA: refused), "bench"
    (as "saved"), "straight" (STRAIGHT: straight_and_resumed's) and "ranks0" / "ranks2" / "ulysses2" (as "saved", the
    last with sequence parallelism)."""
    tmp = tmp_path_factory.mktemp("lora")
    saved_ck = str(tmp / "saved" / "ck")
    runs = {
        "saved": ({**LORA, "trainer.save_interval": 1}, 0),
        "saved_full": ({"buffer.total_steps": 3, "checkpoint_root_dir": saved_ck}, 0),
        "bench": ({**LORA, "trainer.save_interval": 1}, 0),
        "straight": ({**LORA, **STRAIGHT}, 0),
        "ranks0": (LORA, 0),
        "ranks2": (LORA, 2),
        "ulysses2": ({**LORA, "trainer.ulysses_sequence_parallel_size": 2}, 2),  # columns split (ulysses.py)
    }
    out = {}
    for ranks in (0, 2):
        names = [n for n, (_, r) in runs.items() if r == ranks]
        configs = [sft_config(tmp / n, tiny_model_dir, **runs[n][0]) for n in names]
        for name, result in zip(names, run_trains(configs, ranks=ranks)):
            out[name] = Path(runs[name][0].get("checkpoint_root_dir", tmp / name / "ck")) / "p" / "t", result
    return out


def finished(runs: dict, name: str) -> Path:
    """The job directory of the run `name` of `runs`, which ended well."""
    job, out = runs[name]
    assert out.returncode == 0, (name, out.stderr[-3000:])
    return job


@pytest.mark.slow
def test_checkpoints_hold_the_adapter_that_plain_peft_loads(lora_runs, tiny_model_dir):
    """global_step_N/actor/lora_adapter in peft's format and the adapter's optimizer state, listed in the manifest;
    the merged HF folder only where the step was published (the last); PeftModel.from_pretrained(base, adapter)
    gives that folder's logits. The same run continued without LoRA ("saved_full"): refused by name."""
    job = finished(lora_runs, "saved")
    one, two = job / "global_step_1" / "actor", job / "global_step_2" / "actor"
    assert {p.name for p in one.iterdir()} == {
        "lora_adapter",
        "model",
        "optimizer",
        "trainer_state.json",
        "rng_state_rank0.safetensors",
    }
    assert {p.name for p in two.iterdir()} == {p.name for p in one.iterdir()} | {"huggingface"}
    assert {p.name for p in (two / "lora_adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    manifest = json.loads((job / "global_step_2" / "manifest.json").read_text())
    assert {"actor/lora_adapter/adapter_model.safetensors", "actor/lora_adapter/adapter_config.json"} <= set(manifest)
    saved = adapter_of(job, 2)
    assert len(saved) == 2 * 7 * 4 and all(".lora_A." in k or ".lora_B." in k for k in saved)
    optim = checkpoint.read_optimizer(two)  # Adam's state of A and B alone
    assert {k.rsplit("/", 1)[0] for k in optim} == {
        "model." + k.removeprefix("base_model.model.").replace(".weight", ".default.weight") for k in saved
    }
    assert not torch.equal(
        adapter_of(job, 1)[next(k for k in saved if "lora_B" in k)], saved[next(k for k in saved if "lora_B" in k)]
    )
    peft_model = PeftModel.from_pretrained(plain(tiny_model_dir), str(two / "lora_adapter")).eval()
    ids = torch.arange(3, 60)
    published = plain(two / "huggingface")
    assert (logits(peft_model, ids) - logits(published, ids)).abs().max().item() < 1e-5
    assert (logits(published, ids) - logits(plain(tiny_model_dir), ids)).abs().max().item() > 1e-3
    base = safetensors.torch.load_file(Path(tiny_model_dir, "model.safetensors"))
    merged = safetensors.torch.load_file(two / "huggingface" / "model.safetensors")
    assert set(merged) == set(base) and torch.equal(
        merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"]
    )
    full_job, full = lora_runs["saved_full"]  # the same run, no LoRA
    assert full_job == job and (
        full.returncode == 2
        and "checkpoint step 2 of" in full.stderr
        and "was written with LoRA and model.lora_configs is empty: resume with the config it was written with"
        in full.stderr
    )


@pytest.mark.slow
def test_a_killed_lora_trainer_resumes_exactly(tmp_path, tiny_model_dir, lora_runs):
    """SIGKILL after the step-2 checkpoint, restart from base + the step-2 adapter: step 4's adapter, optimizer
    state and published weights equal an uninterrupted run's bitwise."""
    straight = finished(lora_runs, "straight")
    straight, resumed, stderr = straight_and_resumed(tmp_path, tiny_model_dir, straight=straight, **LORA)
    assert "LoRA (" in stderr and "lora_adapter" in stderr  # the restart loaded the checkpoint's adapter
    for name in ("lora_adapter/adapter_model.safetensors", "optimizer", "huggingface/model.safetensors"):
        a, b = (saved_tensors(job / "global_step_4" / "actor", name) for job in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    two, four = adapter_of(resumed, 2), adapter_of(resumed, 4)
    assert not all(torch.equal(two[k], four[k]) for k in two)  # steps 3 and 4 did train


@pytest.mark.slow
def test_two_fsdp_ranks_train_the_adapter_as_one_does(lora_runs):
    """Two FSDP2 ranks, and two ranks that split each micro-batch's columns (ulysses.py), end at one rank's adapter."""
    final = {ranks: adapter_of(finished(lora_runs, f"ranks{ranks}"), 2) for ranks in (0, 2)}
    final["ulysses2"] = adapter_of(finished(lora_runs, "ulysses2"), 2)
    assert (lora_runs["ranks2"][0] / "global_step_2" / "actor" / "rng_state_rank1.safetensors").is_file()  # 2 ranks
    b = [k for k in final[0] if ".lora_B." in k]
    moved = max(final[0][k].abs().max().item() for k in b)  # B starts at 0
    assert moved > 1e-3
    for other in (2, "ulysses2"):
        assert max((final[other][k] - final[0][k]).abs().max().item() for k in final[0]) < moved / 100, other


@pytest.mark.slow(seconds=35)
def test_mode_both_with_lora_killed_after_a_checkpoint_resumes(tmp_path, tiny_model_dir):
    """GRPO with a KL loss to the reference (the actor without its adapter), the merged weights sent over the process
    group. Process-group sync publishes no HF folder until the last step, so checkpoint step 2 holds the adapter
    alone. The whole run (launcher, trainer, explorer) is SIGKILLed while the trainer waits right after saving step 2,
    then relaunched: the trainer writes step 2's merged weights before pointing the explorer at them, the explorer
    starts from them (no 'Repo id' error), and step 3 is sampled from exactly base + the step-2 adapter. The KL is 0
    at step 1 (B = 0) and not after."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **LORA,
        **{
            "synchronizer.sync_method": "nccl",
            "trainer.save_interval": 2,
            "algorithm.optimizer.lr": 1e-2,
            "algorithm.kl_loss_fn": "k2",
            "algorithm.kl_loss_fn_args": {"kl_coef": 0.1},
            "buffer.total_steps": 4,
            "continue_from_checkpoint": True,
        },
    )
    run, marker = tmp_path / "ck" / "p" / "run", tmp_path / "paused"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "NANORFT_TEST_PAUSE_AT": "train.after_save:2",
        "NANORFT_TEST_PAUSE_MARKER": str(marker),
    }
    with open(tmp_path / "first.txt", "w") as err:  # a file, not a pipe: a full pipe would block the run
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--config", str(config)],
            cwd=ROOT,
            env=env,
            stdout=err,
            stderr=err,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), (tmp_path / "first.txt").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both its processes
    proc.wait()
    assert (run / "global_step_2" / "actor" / "lora_adapter").is_dir()
    assert not (run / "global_step_2" / "actor" / "huggingface").exists()  # adapter only: nothing was published
    out = launch(config)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from checkpoint step 2" in out.stderr and "Repo id" not in out.stderr
    db = run / "buffer" / "exp.db"
    assert versions_by_step(db) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    merged = lora.merged_folder(
        plain(tiny_model_dir),
        str(run / "global_step_2" / "actor" / "lora_adapter"),
        models.load_tokenizer(tiny_model_dir),
        tmp_path / "merged2",
    )
    assert rollout_logprob_gap(db, 2, merged) < 1e-4
    assert rollout_logprob_gap(db, 2, Path(tiny_model_dir)) > 1e-3
    kl = {r["step"]: r["actor/kl_loss"] for r in read_history(run / "monitor" / "trainer.jsonl")}
    assert abs(kl[1]) < 1e-7 and kl[3] > 1e-6, kl


@pytest.mark.slow
def test_bench_evaluates_adapter_only_checkpoints_merged(lora_runs, tiny_model_dir):
    """Bench mode on a LoRA run: step 1's checkpoint holds the adapter alone, step 2's the merged folder too; both are
    evaluated, step 1 as model.model_path + its adapter (merged in a temporary folder, gone afterwards)."""
    job = finished(lora_runs, "bench")
    tmp_path = job.parents[2]  # the run's folder: the explorer's config next to the trainer's
    adapter = job / "global_step_1" / "actor" / "lora_adapter"
    assert not (adapter.parent / "huggingface").exists()
    config = write_config(tmp_path, tiny_model_dir, name="t")
    (cfg,) = resolve_stages(cli(["--config", str(config)])[0])
    assert explore.bench_targets(cfg) == [(1, str(adapter)), (2, str(job / "global_step_2/actor/huggingface"))]
    with explore.bench_weights(cfg, str(adapter)) as folder:
        peft_model = PeftModel.from_pretrained(plain(tiny_model_dir), str(adapter)).eval()
        ids = torch.arange(3, 60)
        assert (logits(plain(folder), ids) - logits(peft_model, ids)).abs().max().item() < 1e-5
        assert (logits(plain(folder), ids) - logits(plain(tiny_model_dir), ids)).abs().max().item() > 1e-3
    assert not Path(folder).exists()
    out = run_explorer(config, "--mode", "bench")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"bench step 1 ({adapter}): " in out.stdout and "bench step 2 (" in out.stdout
    assert not list(job.glob(".bench-merged-*"))


def saved_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of the file `name` of a checkpoint's actor folder; "optimizer": its optimizer states, whole."""
    return checkpoint.read_optimizer(folder) if name == "optimizer" else safetensors.torch.load_file(folder / name)


# --- the adapter alone to vLLM engines that serve it (sync.serves_adapter)


class AdapterEngine:
    """The explorer's engine as sync.py uses it when it serves an adapter: receives none over the group itself
    (join_ranks 0), loads folders (what it was given, and the folder's tensors as they were then)."""

    def __init__(self) -> None:
        self.model_version, self.loaded = 0, []

    def join_ranks(self) -> int:
        return 0

    def load_weights(self, source, version: int) -> None:
        assert isinstance(source, str), "an engine serving an adapter loads folders"
        tensors = safetensors.torch.load_file(Path(source, sync.ADAPTER_FILE))
        config = json.loads(Path(source, "adapter_config.json").read_text())
        self.loaded.append((version, source, tensors, config))
        self.model_version = version


def served_config(tmp_path: Path, tiny_model_dir: str, engine_type: str = "vllm_async") -> Config:
    cfg = Config()
    cfg.model.model_path, cfg.checkpoint_job_dir = tiny_model_dir, str(tmp_path / "job")
    cfg.model.lora_configs = [LoRAConfig(lora_rank=4, lora_alpha=8)]
    cfg.explorer.rollout_model.engine_type = engine_type
    return cfg


def peft_logits_gap(tiny_model_dir: str, actor: torch.nn.Module, folder: str) -> float:
    """Largest |log-prob| gap between the trainer's actor and model_path + the adapter at `folder` as plain peft
    loads it (peft's own merge: what vLLM serves is checked against this in tests/test_vllm_e2e.py)."""
    return gap(actor, lora.merged_model(plain(tiny_model_dir), folder).eval())


def test_only_vllm_engines_serve_the_adapter(tmp_path, tiny_model_dir):
    """vLLM engines serve the adapter (they get it alone at each sync); the HF engine gets merged weights; no LoRA,
    nothing served. The published folders each loads follow."""
    assert sync.serves_adapter(served_config(tmp_path, tiny_model_dir, "vllm"))
    assert sync.serves_adapter(served_config(tmp_path, tiny_model_dir, "vllm_async"))
    assert not sync.serves_adapter(served_config(tmp_path, tiny_model_dir, "hf"))
    cfg = served_config(tmp_path, tiny_model_dir)
    cfg.model.lora_configs = []
    assert not sync.serves_adapter(cfg)
    assert sync.published_dir(served_config(tmp_path, tiny_model_dir)) == "lora_published"
    assert sync.published_dir(cfg) == "huggingface"


def test_the_process_group_sends_the_adapter_alone_to_engines_that_serve_it(tiny_model_dir, tmp_path, one_rank):
    """sync_method nccl, vLLM engines serving the adapter: only A and B travel (peft's file names, the engine's
    dtype), with the adapter's config in the header; the explorer writes them as a peft folder (no pickle) that its
    engines load in place, and that folder is the trainer's adapter: plain peft on model_path gives the actor's
    log-probs. The bytes are a small fraction of the merged weights'."""
    import threading

    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=(LoRAConfig(lora_rank=4), ""))
    with torch.no_grad():
        for name, q in actor.named_parameters():
            if ".lora_B." in name:
                q.normal_(0, 0.05)
    cfg = served_config(tmp_path, tiny_model_dir)
    cfg.checkpoint_job_dir, engine = str(tmp_path), AdapterEngine()
    explorer = sync.ExplorerSync(cfg, None, engine)
    sender, got = wire.open_sender(tmp_path, "cpu", 60), {}
    receiver = threading.Thread(target=lambda: got.update(taken=explorer.take_weights()))
    receiver.start()
    sent = lora.send_adapter(sender, actor, 7)
    receiver.join(60)
    wire.close_sender(sender, grace=0.1)
    merged_bytes = sum(t.numel() * t.element_size() for t in lora.full_state(actor).values())
    assert got["taken"] == (7, sent) and 0 < sent < merged_bytes / 20
    ((version, folder, tensors, config),) = engine.loaded
    assert version == 7 and config["r"] == 4 and config["peft_type"] == "LORA"
    state = lora.adapter_state(actor)
    assert tensors.keys() == {lora.peft_name(k) for k in state}
    assert all(torch.equal(tensors[lora.peft_name(k)], v) for k, v in state.items())
    assert peft_logits_gap(tiny_model_dir, actor, folder) < 1e-5 and gap(actor, plain(tiny_model_dir)) > 1e-3
    explorer.close()
    assert not Path(folder).exists()  # the explorer's private folder goes with it


def test_checkpoint_sync_publishes_the_adapter_alone_and_the_explorer_loads_it(tiny_model_dir, tmp_path, one_rank):
    """sync_method checkpoint, vLLM engines serving the adapter: a sync point's step publishes the adapter alone
    (global_step_N/actor/lora_published, peft's format), then moves the pointer; the last step also the merged HF
    folder (the next stage and users read it). A restarted explorer starts from the newest adapter, one at a sync
    point loads the adapter of its step; a damaged adapter is skipped as a damaged HF folder is. A resumed trainer
    publishes its checkpoint's adapter where it is missing before it points there."""
    from types import SimpleNamespace

    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=(LoRAConfig(lora_rank=4), ""))
    cfg = served_config(tmp_path, tiny_model_dir)
    job = Path(cfg.checkpoint_job_dir)
    p = SimpleNamespace(cfg=cfg, actor=actor, tokenizer=None, rank=0, engine_dtype=None)
    for step in (1, 2):
        with torch.no_grad():
            for name, q in actor.named_parameters():
                if ".lora_B." in name:
                    q.normal_(0, 0.05)
        assert train.publish_files(p, step, hf=False, exact=False) is None  # nothing full gathered
    assert sync.latest_version(job) == 2 and not sync.weights_path(job, 2).exists()
    folder = sync.adapter_path(job, 2)
    assert not sync.damage(folder) and peft_logits_gap(tiny_model_dir, actor, str(folder)) < 1e-5
    assert sync.start_weights(cfg) == (str(folder), 2)
    engine = AdapterEngine()
    assert sync.load_published(engine, str(job), 2, sync.published_dir(cfg)) == 2
    assert engine.loaded[0][:2] == (2, str(folder))
    (folder / sync.ADAPTER_FILE).write_bytes((folder / sync.ADAPTER_FILE).read_bytes()[:-8])  # cut
    assert "adapter_model.safetensors has" in sync.damage(folder)
    assert sync.start_weights(cfg) == (str(sync.adapter_path(job, 1)), 1)
    weights = train.publish_files(p, 3, hf=True, exact=True)  # the last step: the merged folder too
    assert weights and sync.weights_path(job, 3).is_dir() and sync.adapter_path(job, 3).is_dir()
    assert sync.prune_published(job, 3) == [] and not sync.adapter_path(job, 1).exists()  # pruned by step 3's
    lora.rewind_pointer(actor, None, job, 5, served=True)  # a checkpoint step never published
    assert sync.latest_version(job) == 5 and not sync.damage(sync.adapter_path(job, 5))
    assert not sync.weights_path(job, 5).exists()


class PeftEngine(AdapterEngine):
    """An engine serving an adapter as vLLM does, played by plain peft: log-probs of model_path + the adapter it
    loaded last (none: the base). `ignores`: it drops the adapters it is given (a broken load)."""

    def __init__(self, base: str, ignores: bool = False) -> None:
        super().__init__()
        self.base, self.ignores, self.model = base, ignores, plain(base)

    def load_weights(self, source, version: int) -> None:
        super().load_weights(source, version)
        if not self.ignores:
            self.model = lora.merged_model(plain(self.base), source).eval()

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return [plain_logprobs(self.model, s, 1).tolist() for s in sequences]

    def weight_versions(self) -> list[str]:
        return [str(self.model_version)]

    def close(self) -> None:
        pass


@pytest.mark.parametrize("ignores", [False, True])
def test_verify_sync_of_a_served_adapter_compares_log_probs(tiny_model_dir, tmp_path, monkeypatch, ignores):
    """--verify-sync with vLLM engines serving the adapter: vLLM's checksums cover no adapter, so the check is the
    engines' log-probs with the adapter sent over the group against those with its folder, and not the base's. An
    engine that drops the adapter it is given is named."""
    import sync_check
    import vllm_engine

    cfg = served_config(tmp_path, tiny_model_dir)
    cfg.synchronizer.sync_timeout = 60
    monkeypatch.setattr(vllm_engine, "lora_args", lambda model, folder: {"enable_lora": True})
    monkeypatch.setattr(sync_check, "make_engine", lambda *a, **k: PeftEngine(tiny_model_dir, ignores))
    problem = sync_check.verify(cfg)
    assert problem == (
        "the engines' log-probs after the adapter arrived are the base model's: no adapter is applied"
        if ignores
        else ""
    )


def test_vllm_engines_start_on_the_base_serving_the_saved_adapter(tiny_model_dir, tmp_path, monkeypatch):
    """Training from a saved adapter (lora_configs[0].path) with vLLM engines: they start on model_path with
    enable_lora, max_lora_rank the saved adapter's (4: vLLM's smallest above, 8; not lora_rank's 32), and load that
    adapter as it is, named lora_configs[0].name: no merged lora_start/ folder is written. Restarted after step 2
    was published, they load step 2's adapter instead."""
    from helpers import real_vllm

    real_vllm()  # vllm_engine.lora_args reads the ranks vLLM allows
    saved = str(tmp_path / "saved")
    with_random_b(models.load_model(tiny_model_dir), LoRAConfig(lora_rank=4, lora_alpha=8)).peft.save_pretrained(saved)
    cfg = served_config(tmp_path, tiny_model_dir)
    cfg.model.lora_configs = [LoRAConfig(path=saved, lora_rank=32, name="mine")]
    made = []

    def make_engine(rm, path, *args, lora=None, **kwargs):
        made.append((path, lora))
        return AdapterEngine()

    monkeypatch.setattr(explore, "make_engine", make_engine)
    engine, version = explore.rollout_engines(cfg)
    ((path, served),) = made
    assert path == tiny_model_dir and served["enable_lora"] and served["name"] == "mine"
    assert served["max_lora_rank"] == 8 and served["max_loras"] == 1
    assert version == 0 and [v[:2] for v in engine.loaded] == [(0, saved)]
    assert not (tmp_path / "job" / "lora_start").exists()
    shutil.copytree(saved, sync.adapter_path(cfg.checkpoint_job_dir, 2))
    sync.set_latest(cfg.checkpoint_job_dir, 2)
    engine, version = explore.rollout_engines(cfg)
    assert version == 2 and [v[:2] for v in engine.loaded] == [(0, str(sync.adapter_path(cfg.checkpoint_job_dir, 2)))]


def test_a_new_adapter_is_served_as_zeros_until_the_first_sync(tiny_model_dir, tmp_path, one_rank):
    """A new adapter: vLLM engines start serving lora.zero_adapter (built on the meta device, no weight read), so
    that every request names the adapter from the start: the trainer's new adapter's layers, names, shapes and
    config, all zeros: plain peft on model_path with it gives exactly the trainer's first log-probs (B = 0)."""
    c = LoRAConfig(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    folder = lora.zero_adapter(tiny_model_dir, c, tmp_path / "lora_start" / "explorer")
    actor = scoring.build_model(tiny_model_dir, TrainerConfig(), CPU, True, adapter=(c, ""))
    tensors = safetensors.torch.load_file(folder / sync.ADAPTER_FILE)
    trained = {lora.peft_name(k): v.shape for k, v in lora.adapter_state(actor).items()}
    assert {k: v.shape for k, v in tensors.items()} == trained and not any(t.any() for t in tensors.values())
    assert json.loads((folder / "adapter_config.json").read_text()) == lora.adapter_config(actor)
    assert gap(actor, lora.merged_model(plain(tiny_model_dir), str(folder)).eval()) < 1e-6
    assert lora.zero_adapter(tiny_model_dir, c, folder) == folder  # a restart writes it again in place
