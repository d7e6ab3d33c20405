"""Every algorithm preset end to end, as a user runs it: `train.py --config X.yaml` (grpo, the README's loss) or
`launch.py --config X.yaml` (where train.py hands over) on the tiny model.
RL presets run mode both (explorer + trainer processes, checkpoint sync), except those that differ from grpo in the
trainer alone: they train as the stages of one mode-train process on an experience DB; sft and dpo run mode train
on data files the project makes (assets/arith/sft.jsonl, dpo.jsonl) or the test writes. Plus the
"Add your own loss" recipe from the README, done on a copy of the repository."""

import dataclasses
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from transformers import AutoModelForTokenClassification

import checkpoint
import train
from algos import PRESETS
from buffer import Experience, ExperienceDB
from configs import cli, derive
from helpers import (
    ROOT,
    both_config,
    launch,
    perturbed,
    plain_logprobs,
    run_train,
    run_trains,
    sft_teacher,
    write_yaml,
)
from models import load_model, load_tokenizer
from monitor import read_history
from source import sft_experience

RL_PRESETS = [name for name, p in PRESETS.items() if not p.train_only]


def history(tmp_path: Path, name: str = "run") -> list[dict]:
    return read_history(tmp_path / "ck" / "p" / name / "monitor" / "trainer.jsonl")


def finite(rows: list[dict]) -> None:
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad


def run_preset(preset: str, tmp_path: Path, tiny_model_dir: str, teacher: str, **extra) -> subprocess.CompletedProcess:
    """The preset in mode both, 2 steps (`extra`: more overrides, applied last), through the launcher: grpo's started
    as `python train.py --config` (train.py hands over to the launcher), the others' as launch.py (the handover is
    ~5 s of CPU a run: train.py's imports)."""
    data = Path(tiny_model_dir).parent / "arith"
    over = {
        "algorithm.algorithm_type": preset,
        "algorithm.repeat_times": 1 if preset == "ppo" else 2,
        "buffer.total_steps": 2,
        "buffer.batch_size": 3 if preset == "ppo" else 2,
        "explorer.eval_interval": 100,
        "explorer.eval_on_startup": False,
        "buffer.explorer_input.eval_tasksets": [],  # no eval: nothing here reads one
    }
    if preset == "ppo":
        over["trainer.critic_warmup"] = 1  # step 1 trains the critic alone, step 2 both
    if preset == "grpo":  # with the adaptive KL coefficient
        over["algorithm.kl_loss_fn_args"] = {"kl_coef": 0.01, "adaptive": True, "target_kl": 0.001, "horizon": 100}
    if preset == "on_policy_distill":  # the teacher scores the student's tokens in the explorer
        over["buffer.default_workflow_type"] = "on_policy_distill_workflow"
        over["explorer.auxiliary_models"] = [{"model_path": teacher, "engine_type": "hf"}]
    if preset == "multi_step_grpo":  # tool_workflow, one experience per turn
        tools = {
            "name": "arith_tools",
            "path": str(data.parent / "arith_tools"),
            "split": "train",
            "format": {"prompt_key": "question", "response_key": "answer"},
            # the untrained model's turns run to max_tokens: keep their actions (not masked as truncated)
            "workflow_args": {"step_wise": True, "max_turns": 2, "mask_truncated": False},
        }
        over |= {
            "buffer.default_workflow_type": "tool_workflow",
            "model.max_model_len": 200,
            "buffer.explorer_input.taskset": tools,
            "buffer.explorer_input.eval_tasksets": [],
        }
    script = "train.py" if preset == "grpo" else "launch.py"
    return launch(both_config(tmp_path, tiny_model_dir, **over | extra), script=script)


# The presets that act in the explorer too (a workflow, a teacher): each its own mode-both run. PPO runs in
# test_ppo_runs_end_to_end_and_resumes_with_its_critic, on_policy_distill in
# test_on_policy_distillation_moves_the_student_to_its_teacher (its run of 12 steps meets check_preset_run too).
BOTH_PRESETS = ["grpo", "multi_step_grpo"]
# The others differ from grpo in the trainer alone (advantage fn, policy loss, KL, entropy, reference model, expert
# rows from a file, raft's filter); their mode-both run would repeat grpo's explorer and sync (jsd's: the workflow and
# teacher of on_policy_distill): they train as stages of one trainer process (mode train) on DBs the test writes.
TRAINER_PRESETS = [p for p in RL_PRESETS if p not in (*BOTH_PRESETS, "ppo", "on_policy_distill")]


def check_preset_run(preset: str, rows: list[dict], job: Path, log: str) -> None:
    """What every RL preset's run of 2 steps (or more) must show (`rows`: its trainer history; `job`: its job
    directory; `log`: what its trainer logged)."""
    assert len(rows) >= 2 and [r["step"] for r in rows] == list(range(1, len(rows) + 1)), preset
    finite(rows)
    loss_key = {
        "mix": "actor/usual/pg_loss",
        "mix_chord": "actor/usual/pg_loss",
        "opmd": "actor/opmd_loss",
        "asymre": "actor/opmd_loss",
        "raft": "actor/sft_loss",
    }.get(preset, "actor/pg_loss")
    assert loss_key in rows[1], (preset, sorted(rows[1]))
    # the actor took a step, unless every group's rewards tied (presets without an entropy bonus, e.g. sppo)
    assert rows[1]["actor/grad_norm"] > 0 or rows[1]["critic/advantages/max"] == rows[1]["critic/advantages/min"] == 0
    assert (job / f"global_step_{len(rows)}" / "actor" / "huggingface" / "model.safetensors").is_file(), preset
    if preset == "ppo":  # the critic: trained from step 1, the actor from step 2 (critic_warmup 1)
        assert "actor/grad_norm" not in rows[0] and rows[0]["critic/grad_norm"] > 0  # no actor step: no norm
        assert rows[0]["actor/update_skipped"] == 0  # critic_warmup: by design, not a skipped update
        assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean"} <= set(rows[1])
        assert rows[1]["timing_s/values"] == rows[1]["time/values"] > 0  # the critic's pass, by veRL's name too
        critic = AutoModelForTokenClassification.from_pretrained(job / "global_step_2" / "critic" / "huggingface")
        assert critic.config.num_labels == 1
    if preset == "grpo":  # step 1: the policy is the reference, KL 0 -> error -0.2 -> beta x (1 - 0.2 x 4 / 100)
        assert rows[0]["actor/kl_coef"] == pytest.approx(0.01 * (1 - 0.2 * 4 / 100))
        assert rows[1]["actor/kl_coef"] != rows[0]["actor/kl_coef"]
    if preset in ("mix", "mix_chord"):  # 2 tasks x 2 rollouts of RL, plus as many expert rows (ratio 0.5)
        assert rows[1]["sample/expert_count"] == 4 and rows[1]["batch/size"] == 8
        assert "actor/expert/sft_loss" in rows[1] if preset == "mix" else "actor/expert/sft_phi_loss" in rows[1]
    if preset == "mix_chord":
        assert [r["actor/mu"] for r in rows] == pytest.approx([0.5, 0.1])
    if preset == "raft":  # the better of each task's 2 responses (the first on a tie): half the rows
        assert all(r["critic/kept_fraction"] == 0.5 for r in rows) and "reference model: False" in log
    if preset in ("on_policy_distill", "jsd"):  # the perturbed teacher's log-probs differ from the student's
        key = "critic/kl/mean" if preset == "on_policy_distill" else "critic/jsd/mean"
        assert all(r[key] != 0 for r in rows) and rows[1]["actor/grad_norm"] > 0
    if preset == "on_policy_distill":  # the teacher scored the student's tokens in the explorer
        explored = read_history(job / "monitor" / "explorer.jsonl")
        assert any("rollout/kl_per_token/mean" in r for r in explored)


@pytest.mark.parametrize("preset", BOTH_PRESETS)
@pytest.mark.slow
def test_rl_preset_runs_end_to_end(preset, tmp_path, tiny_model_dir):
    """One run per case (xdist spreads them over its workers), no eval (nothing here reads one)."""
    out = run_preset(preset, tmp_path, tiny_model_dir, teacher="")
    assert out.returncode == 0, out.stderr[-3000:]
    check_preset_run(preset, history(tmp_path), tmp_path / "ck" / "p" / "run", out.stderr)


# What a preset's stage sets beyond grpo's optimizer and entropy bonus: mix's share of expert rows (0.5: as many as
# rollouts); mix_chord's mu schedule (step 1 the peak, the decay's start; step 2 the valley)
STAGE_ALGORITHM = {
    "mix": {"sample_strategy_args": {"expert_data_ratio": 0.5}},
    "mix_chord": {
        "sample_strategy_args": {"expert_data_ratio": 0.5},
        "policy_loss_fn_args": {"mu_warmup_steps": 1, "mu_decay_steps": 1, "mu_peak": 0.5},
    },
}


def trainer_preset_stages(tmp_path: Path, tiny_model_dir: str) -> Path:
    """A mode-train experiment of one stage per preset of TRAINER_PRESETS (2 steps of 4 experiences, grpo's
    optimizer and entropy bonus), each on a DB of its own that holds the same 8 experiences: the tiny model's prompt +
    response tokens (random ids), its log-probs as an engine would return them, rewards that vary in 3 of 4 groups;
    jsd's also hold a perturbed teacher's log-probs of the responses (what on_policy_distill_workflow writes)."""
    model, teacher = load_model(tiny_model_dir), perturbed(tiny_model_dir, 0.05)
    g = torch.Generator().manual_seed(0)
    rewards = [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0], [1.0, 0.2]]  # group 1 ties
    exps, scored = [], []
    for k, rs in enumerate(rewards):
        prompt = torch.randint(3, 200, (9 + k,), generator=g)
        for i, r in enumerate(rs):
            tokens = torch.cat([prompt, torch.randint(3, 200, (5 + 3 * i + k,), generator=g)])
            lp = plain_logprobs(model, tokens, len(prompt))
            exps.append(Experience(tokens=tokens, prompt_length=len(prompt), logprobs=lp, reward=r, group_id=f"g{k}"))
            scored.append(dataclasses.replace(exps[-1], teacher_logprobs=plain_logprobs(teacher, tokens, len(prompt))))
    sft = str(Path(tiny_model_dir).parent / "arith" / "sft.jsonl")
    stages = []
    for preset in TRAINER_PRESETS:
        url = f"sqlite:///{tmp_path}/{preset}.db"
        with ExperienceDB(url) as db:
            db.write(scored if preset == "jsd" else exps)
        algorithm = {
            "algorithm_type": preset,
            "repeat_times": 2,
            "optimizer": {"lr": 1e-3},
            "entropy_loss_fn_args": {"entropy_coef": 0.01},
            **STAGE_ALGORITHM.get(preset, {}),
        }
        buffer = {"trainer_input": {"experience_buffer": {"name": preset, "path": url, "max_read_timeout": 10}}}
        if preset in ("mix", "mix_chord"):  # the expert rows: the project's SFT file
            sft_dataset = {"storage_type": "file", "path": sft, "format": {"prompt_type": "messages"}}
            buffer["trainer_input"]["auxiliary_buffers"] = {"sft_dataset": sft_dataset}
        stages.append({"stage_name": preset, "algorithm": algorithm, "buffer": buffer})
    cfg = {
        "project": "p",
        "name": "run",
        "mode": "train",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 12},
        "buffer": {"train_batch_size": 4, "total_steps": 2},
        "trainer": {"save_interval": 0},
        "monitor": {"monitor_type": "none"},
        "stages": stages,
    }
    return write_yaml(tmp_path / "stages.yaml", cfg, {})


@pytest.mark.slow
def test_trainer_side_presets_train_as_stages_of_one_trainer(tmp_path, tiny_model_dir):
    """Every preset of TRAINER_PRESETS: 2 steps each (a stage each, train.py as the launcher starts it), with the
    checks of test_rl_preset_runs_end_to_end."""
    out = run_train(trainer_preset_stages(tmp_path, tiny_model_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    for preset in TRAINER_PRESETS:
        job = tmp_path / "ck" / "p" / "run" / preset
        check_preset_run(preset, history(tmp_path, f"run/{preset}"), job, (job / "log" / "trainer.log").read_text())


def offline_config(tmp_path: Path, tiny_model_dir: str, algorithm: str, path: Path, fmt: dict, **over) -> Path:
    cfg = {
        "project": "p",
        "name": "run",
        "mode": "train",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        "algorithm": {"algorithm_type": algorithm, "optimizer": {"lr": 1e-3}},
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 64},
        "buffer": {
            "train_batch_size": 8,
            "total_steps": 3,
            "trainer_input": {
                "experience_buffer": {"name": "data", "storage_type": "file", "path": str(path), "format": fmt}
            },
        },
        "trainer": {"save_interval": 0},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "train.yaml", cfg, over)


def sft_files(tmp_path: Path, data: Path) -> dict[str, tuple[Path, dict]]:
    """The three SFT layouts: messages (the project's file), plaintext columns, multi-turn conversations."""
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"q": r["question"], "a": r["answer"]}) + "\n" for r in rows))
    multi = tmp_path / "multi.jsonl"
    multi.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": a["question"]},
                        {"role": "assistant", "content": a["answer"]},
                        {"role": "user", "content": b["question"]},
                        {"role": "assistant", "content": b["answer"]},
                    ]
                }
            )
            + "\n"
            for a, b in zip(rows[::2], rows[1::2])
        )
    )
    return {
        "messages": (data / "sft.jsonl", {"prompt_type": "messages"}),
        "plaintext": (plain, {"prompt_type": "plaintext", "prompt_key": "q", "response_key": "a"}),
        "multi_turn": (multi, {"prompt_type": "messages", "enable_concatenated_multi_turn": True}),
    }


@pytest.mark.slow
def test_sft_train_mode_on_each_data_layout(tmp_path, tiny_model_dir):
    """A stage per layout, in one trainer process (train.py as the launcher starts it): each stage 3 steps."""
    files = sft_files(tmp_path, Path(tiny_model_dir).parent / "arith")
    stages = [
        {"stage_name": layout, "buffer": {"trainer_input": {"experience_buffer": {"path": str(path), "format": fmt}}}}
        for layout, (path, fmt) in files.items()
    ]
    path, fmt = files["messages"]
    out = run_train(offline_config(tmp_path, tiny_model_dir, "sft", path, fmt, stages=stages))
    assert out.returncode == 0, out.stderr[-3000:]
    for layout in files:
        rows = history(tmp_path, f"run/{layout}")
        assert [r["step"] for r in rows] == [1, 2, 3], layout
        finite(rows)
        # lr 1e-3 from an untrained model (the first stage) or from the previous stage's 3 steps: NLL falls
        assert rows[-1]["actor/sft_loss"] < rows[0]["actor/sft_loss"], layout
    # each stage read its own file: a multi-turn row trains on both assistant turns of two tasks
    lengths = {layout: history(tmp_path, f"run/{layout}")[0]["response_length/mean"] for layout in files}
    assert lengths["multi_turn"] > 2 * lengths["plaintext"] and lengths["plaintext"] == lengths["messages"], lengths


def test_sft_multi_turn_masks_every_assistant_turn(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    msgs = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    last = sft_experience(msgs, tok, 256)
    both = sft_experience(msgs, tok, 256, multi_turn=True)
    assert torch.equal(last.tokens, both.tokens)  # the same rendered conversation
    decode = lambda x: tok.decode(x.tokens[x.prompt_length :][x.action_mask])  # noqa: E731
    assert decode(last) == "4<|im_end|>"
    assert decode(both) == "2<|im_end|>4<|im_end|>"  # the user turn between them is not trained on
    assert "2+2?" in tok.decode(both.tokens[both.prompt_length :][~both.action_mask])


@pytest.mark.slow
def test_dpo_train_mode_learns_the_preference(tmp_path, tiny_model_dir):
    data = Path(tiny_model_dir).parent / "arith"
    config = offline_config(
        tmp_path,
        tiny_model_dir,
        "dpo",
        data / "dpo.jsonl",
        {"prompt_key": "prompt"},
        **{"buffer.total_steps": 6, "algorithm.policy_loss_fn_args": {"beta": 0.5}},
    )
    out = launch(config)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reference model: True" in out.stderr
    rows = history(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[0]["batch/size"] == 8  # 4 pairs a step
    finite(rows)
    # step 1: the policy is the reference, so every implicit reward is 0 and the loss is log 2
    assert rows[0]["actor/dpo_loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[0]["actor/reward_margin"] == pytest.approx(0.0, abs=1e-4)
    later = rows[3:]  # new pairs every step: the margin on pairs not yet seen grows
    assert min(r["actor/reward_margin"] for r in later) > 0 and max(r["actor/dpo_loss"] for r in later) < math.log(2)


MY_LOSS = '''"""my_pg: REINFORCE with a baseline-free advantage, -A * logp (a README example)."""

from __future__ import annotations

import dataclasses
import itertools

import torch

from algos.utils import aggregate


@dataclasses.dataclass
class Config:
    scale: float = 1.0
    """s: multiplies the loss."""


def compute(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], cfg: Config,
            loss_agg_mode: str) -> tuple[torch.Tensor, dict[str, float]]:
    loss = cfg.scale * aggregate(-batch["advantages"] * logprobs, batch["response_mask"], loss_agg_mode)  # []
    return loss, {"my_pg_loss": loss.item()}
'''


@pytest.mark.slow(seconds=30)
def test_a_loss_added_in_one_new_file_is_selected_from_yaml_and_trains(tmp_path, tiny_model_dir):
    """The README's "Add your own loss": one new file in algos/, one registry line, then the YAML names it."""
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "checkpoints", "assets", "__pycache__", "tests", "docs", "*.png"
        ),
    )
    (repo / "algos" / "my_pg.py").write_text(MY_LOSS)
    init = repo / "algos" / "registry.py"  # the registries (algos/__init__.py gives them on first use)
    text = init.read_text().replace("from algos import (", "from algos import (my_pg, ", 1)
    text = text.replace(
        "POLICY_LOSS_FNS: dict[str, tuple[Callable, type]] = {\n",
        'POLICY_LOSS_FNS: dict[str, tuple[Callable, type]] = {\n    "my_pg": (my_pg.compute, my_pg.Config),\n',
        1,
    )
    init.write_text(text)
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "algorithm.policy_loss_fn": "my_pg",
            "buffer.total_steps": 2,
            "algorithm.policy_loss_fn_args": {"scale": 2.0},
            "buffer.explorer_input.eval_tasksets": [],  # no eval: nothing here reads one
        },
    )
    out = subprocess.run(
        [sys.executable, "train.py", "--config", str(config)], cwd=repo, capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "grpo + my_pg" in out.stderr
    rows = history(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all("actor/my_pg_loss" in r for r in rows)
    assert rows[1]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_ppo_runs_end_to_end_and_resumes_with_its_critic(tmp_path, tiny_model_dir):
    """The ppo preset (test_rl_preset_runs_end_to_end's checks), saving every step; stopped after step 2, it continues
    at step 3 with the critic's weights and optimizer state."""
    resumable = {"trainer.save_interval": 1, "continue_from_checkpoint": True}
    out = run_preset("ppo", tmp_path, tiny_model_dir, "", **resumable)
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "run"
    check_preset_run("ppo", history(tmp_path), job, out.stderr)
    critic2 = (job / "global_step_2" / "critic" / "huggingface" / "model.safetensors").read_bytes()
    out = run_preset("ppo", tmp_path, tiny_model_dir, "", **resumable, **{"buffer.total_steps": 3})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from checkpoint step 2" in out.stderr
    rows = history(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    state = json.loads((job / "global_step_3" / "critic" / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # AdamW's step counter continued from the checkpoint (3 updates, not 1): the optimizer state was loaded
    opt = checkpoint.read_optimizer(job / "global_step_3" / "critic")
    assert {v.item() for k, v in opt.items() if k.endswith("/step")} == {3.0}
    assert (job / "global_step_3" / "critic" / "huggingface" / "model.safetensors").read_bytes() != critic2


def test_dynamic_sampling_drops_tied_groups_and_refills(tmp_path, tiny_model_dir):
    """sample_strategy dynamic_sampling (DAPO): a claimed group whose rewards all tie is dropped and
    replaced by the next group already in the DB; with nothing to refill from, the batch shrinks."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{"mode": "train", "algorithm.sample_strategy": "dynamic_sampling", "buffer.train_batch_size": 4},
    )
    cfg = derive(cli(["--config", str(config)])[0])
    db = ExperienceDB(cfg.buffer.trainer_input.experience_buffer.path)
    rewards = {"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [1.0, 0.0], "d": [0.0, 0.0], "e": [1.0, 0.0]}  # a, d tie
    db.write(
        [
            Experience(tokens=torch.tensor([1, 2, 3]), prompt_length=2, reward=r, group_id=g, run_id=k)
            for g, rs in rewards.items()
            for k, r in enumerate(rs)
        ]
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        source = train.Source(cfg, load_tokenizer(tiny_model_dir), 0, torch.device("cpu"))
        assert [x.group_id for x in source.read(1)] == ["b", "b", "c", "c"] and source.dropped_groups == 1
        assert [x.group_id for x in source.read(2)] == ["e", "e"] and source.dropped_groups == 1  # d: none left
    finally:
        dist.destroy_process_group()
    assert db.counts()["pending"] == 0  # the dropped groups were consumed by their step, not left behind


DAPO_REWARD = f"{ROOT}/tests/data/dapo_reward.py:tie_or_coin"  # tasks 0-7 tie, the others' responses flip coins


def claimed_groups(url: str) -> dict[int, dict[str, list[float]]]:
    """Train step -> the groups it claimed -> their rewards (every experience of the group that step claimed)."""
    with ExperienceDB(url) as db:
        rows = db.query("SELECT c.step, e.group_id, e.reward FROM claims c JOIN experiences e ON e.id = c.exp_id")
    out: dict[int, dict[str, list[float]]] = {}
    for step, group, reward in rows:
        out.setdefault(step, {}).setdefault(group, []).append(reward)
    return out


@pytest.mark.slow
def test_dynamic_sampling_over_samples_in_the_explorer_in_mode_both(tmp_path, tiny_model_dir):
    """DAPO's dynamic sampling, mode both (real processes, on-policy): the groups of tasks 0-9 tie, the others' are
    coin flips (tests/data/dapo_reward.py); 2 tasks x 4 responses a step. Step 1 runs the tasks in 4 batches (0-1,
    2-3, 4-5, 6-7), hits max_num_gen_batches 4 (logged) and is filled with the tied groups of tasks 0 and 1, which
    the trainer keeps (nothing to replace them with); step 2 drops tasks 8 and 9 and runs extra tasks until both
    groups vary, as does step 3 when a group ties. Every batch trained is 2 whole groups of 4; the explorer's saved
    position is past every task it ran."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "algorithm.repeat_times": 4,
            "algorithm.sample_strategy": "dynamic_sampling",
            "algorithm.sample_strategy_args": {"max_num_gen_batches": 4},
            "buffer.default_reward_fn_type": DAPO_REWARD,
            "buffer.explorer_input.taskset.reward_fn_args": {"tied_below": 10},
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    out = launch(config)
    assert out.returncode == 0, out.stderr[-3000:]
    job = tmp_path / "ck" / "p" / "run"
    dapo = {
        r["step"]: {k.split("/")[-1]: v for k, v in r.items() if k.startswith("rollout/dynamic_sampling/")}
        for r in read_history(job / "monitor" / "explorer.jsonl")
    }
    assert dapo[1] == {"num_gen_batches": 4, "extra_tasks": 6, "dropped_groups": 6, "tied_groups_kept": 2, "cap_hit": 1}
    assert (
        "dynamic sampling: step 1 has 0 of 2 groups with reward variance after 4 batches of tasks (6 extra tasks):"
        " max_num_gen_batches reached; 2 tied groups fill it" in (job / "log" / "explorer.log").read_text()
    )
    assert all(dapo[s]["cap_hit"] == 0 and dapo[s]["tied_groups_kept"] == 0 for s in (2, 3)), dapo
    assert dapo[2]["extra_tasks"] >= 2 and dapo[2]["dropped_groups"] >= 2  # tasks 8 and 9, at least
    url = derive(cli(["--config", str(config)])[0]).buffer.trainer_input.experience_buffer.path
    with ExperienceDB(url) as db:
        assert db.counts()["total"] == 3 * 2 * 4  # only the groups of the steps: the dropped ones are not written
        index = db.explorer_states()["explorer"]["reader"]["index"]
    assert index == sum(2 + dapo[s]["extra_tasks"] for s in (1, 2, 3))
    claims = claimed_groups(url)
    assert {g.rsplit("/", 1)[1]: r for g, r in claims[1].items()} == {"0": [0.0] * 4, "1": [0.0] * 4}
    for step in (2, 3):  # the trainer's batches: 2 whole groups, each with reward variance
        assert len(claims[step]) == 2 and all(len(r) == 4 and min(r) < max(r) for r in claims[step].values())
    trainer = read_history(job / "monitor" / "trainer.jsonl")
    assert [(r["batch/size"], r["sample/dropped_tied_groups"]) for r in trainer] == [(8, 0)] * 3


@pytest.mark.slow
def test_ppo_update_is_the_same_on_one_and_two_ranks(tmp_path, tiny_model_dir):
    """One PPO step (values, GAE over the whole batch, critic then actor update) on the same experiences:
    a plain process, torchrun with two FSDP2 ranks, and two ranks that split each micro-batch's columns (sequence
    parallelism: old log-probs, values and losses over the split) end at the same actor and critic weights."""
    tok = load_tokenizer(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    exps = [
        Experience(
            tokens=torch.randint(3, tok.vocab_size - 10, (n,), generator=g), prompt_length=p, reward=r, group_id=f"g{i}"
        )
        for i, (n, p, r) in enumerate(
            [
                (20, 8, 1.0),
                (14, 6, 0.0),
                (30, 9, 0.5),
                (12, 4, 1.0),
                (25, 10, 0.0),
                (18, 7, 0.2),
                (22, 5, 1.0),
                (16, 8, 0.0),
            ]
        )
    ]
    configs = {}
    for name, sp in (("ranks0", 1), ("ranks2", 1), ("ulysses2", 2)):
        run = tmp_path / name
        db = run / "exp.db"
        db.parent.mkdir(parents=True)
        ExperienceDB(f"sqlite:///{db}").write(exps)
        cfg = {
            "project": "p",
            "name": "t",
            "mode": "train",
            "checkpoint_root_dir": str(run / "ck"),
            "algorithm": {"algorithm_type": "ppo", "optimizer": {"lr": 1e-3}},
            "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 32, "max_response_tokens": 32},
            "buffer": {
                "train_batch_size": 8,
                "total_steps": 1,
                "trainer_input": {
                    "experience_buffer": {"name": "exp", "path": f"sqlite:///{db}", "max_read_timeout": 10}
                },
            },
            "trainer": {"critic": {"lr": 1e-3}, "ulysses_sequence_parallel_size": sp},
            "monitor": {"monitor_type": "none"},
        }
        configs[name] = write_yaml(run / "t.yaml", cfg, {})
    outs = [run_train(configs["ranks0"]), *run_trains([configs["ranks2"], configs["ulysses2"]], ranks=2)]
    final = {}
    for name, out in zip(configs, outs):
        assert out.returncode == 0, (name, out.stderr[-3000:])
        step = tmp_path / name / "ck" / "p" / "t" / "global_step_1"
        final[name] = {
            role: safetensors.torch.load_file(step / role / "huggingface" / "model.safetensors")
            for role in ("actor", "critic")
        }
    start = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    moved = max((final["ranks0"]["actor"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-4  # one AdamW step at lr 1e-3
    for name, role in itertools.product(("ranks2", "ulysses2"), ("actor", "critic")):
        diff = max((final[name][role][k] - final["ranks0"][role][k]).abs().max().item() for k in final["ranks0"][role])
        assert diff < moved / 100, (name, role, diff, moved)


@pytest.mark.slow
def test_on_policy_distillation_moves_the_student_to_its_teacher(tmp_path, tiny_model_dir):
    """on_policy_distill in mode both: the untrained tiny model (the student) samples, a teacher (a copy SFT-trained
    for 20 steps on 16 demonstrations: it puts its mass on the answers' layout) scores the student's tokens in the
    explorer, and the trainer follows the per-token reverse-KL signal. Over 12 steps the student's per-token KL to
    the teacher on its own samples (rollout/kl_per_token: mean of student - teacher log-prob) falls to less than half
    of the first steps' (measured: 3.8 -> 0.2, docs/LOG.md), and the teacher's log-likelihood of the student's tokens
    rises. The run is the preset's end-to-end run too (check_preset_run)."""
    teacher = sft_teacher(tiny_model_dir, tmp_path / "teacher", steps=20)
    over = {
        "algorithm.repeat_times": 4,
        "algorithm.optimizer.lr": 5e-3,
        "buffer.batch_size": 4,
        "buffer.total_steps": 12,
        "model.max_response_tokens": 16,
    }
    out = run_preset("on_policy_distill", tmp_path, tiny_model_dir, teacher, **over)
    assert out.returncode == 0, out.stderr[-3000:]
    check_preset_run("on_policy_distill", history(tmp_path), tmp_path / "ck" / "p" / "run", out.stderr)
    explored = read_history(tmp_path / "ck" / "p" / "run" / "monitor" / "explorer.jsonl")
    kl = [r["rollout/kl_per_token/mean"] for r in explored if "rollout/kl_per_token/mean" in r]
    teacher_lp = [r["rollout/teacher_logprob/mean"] for r in explored if "rollout/teacher_logprob/mean" in r]
    assert len(kl) == 12
    print("per-token KL by step:", [round(k, 3) for k in kl])
    assert kl[0] > 1.0  # the untrained student is far from its teacher
    assert sum(kl[-2:]) / 2 < 0.5 * sum(kl[:2]) / 2
    assert sum(teacher_lp[-2:]) / 2 > sum(teacher_lp[:2]) / 2 + 1.0  # nats per token
    rows = history(tmp_path)
    assert rows[-1]["critic/kl/mean"] < 0.5 * rows[0]["critic/kl/mean"]  # the trainer's view: sum_t (old - teacher)
