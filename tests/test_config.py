"""Configs: loading, validation, CLI overrides, derived values, stages, --dry-run, and the reference YAMLs."""

import ast
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import entry
import pytest
import yaml
from omegaconf import OmegaConf

import configs
import configs.loader as loader
import launch
from configs import ConfigError, cli, derive, from_dict, normalize, read_yaml, resolve_stages, to_yaml
from configs.schema import Config
from workflows.args import check_step_wise, check_tasksets

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = sorted((ROOT / "tests/data/reference_configs").glob("*.yaml"))
OURS = sorted((ROOT / "configs").rglob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


MINIMAL = """
model:
  model_path: some/model
  max_model_len: 256
buffer:
  batch_size: 4
  explorer_input:
    taskset:
      path: data/x
"""


@pytest.mark.parametrize("path", REFERENCE + OURS, ids=lambda p: p.name)
def test_example_yaml_loads_validates_and_round_trips(path, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    cfg, dry = cli(["--config", str(path)])
    assert not dry
    stages = resolve_stages(cfg)
    assert len(stages) == max(1, len(cfg.stages))
    for stage in stages:
        again = from_dict(Config, normalize(read_yaml(write(tmp_path, to_yaml(stage)))))
        assert again == stage  # the resolved YAML loads back to the same config
        assert derive(again) == stage  # and deriving is idempotent


def test_reference_values_are_read_as_trinity_means_them(monkeypatch):
    monkeypatch.delenv("TRINITY_MODEL_PATH", raising=False)
    (cfg,) = resolve_stages(cli(["--config", str(ROOT / "tests/data/reference_configs/gsm8k.yaml")])[0])
    assert cfg.model.model_path == "Qwen/Qwen2.5-1.5B-Instruct"  # ${oc.env:VAR,default}
    assert cfg.algorithm.optimizer.lr == 1e-5 and isinstance(cfg.algorithm.optimizer.lr, float)
    assert cfg.buffer.train_batch_size == 128 * 8
    assert (cfg.model.max_prompt_tokens, cfg.model.max_response_tokens) == (1024, 1024)
    assert [t.name for t in cfg.buffer.explorer_input.tasksets] == ["gsm8k"]
    assert cfg.buffer.explorer_input.tasksets[0].repeat_times == 8
    assert cfg.buffer.explorer_input.eval_tasksets[0].repeat_times == 1
    assert cfg.buffer.explorer_input.tasksets[0].rollout_args.max_tokens == 1024
    assert cfg.algorithm.advantage_fn == "grpo" and cfg.algorithm.policy_loss_fn == "ppo"
    assert cfg.synchronizer.sync_method == "nccl"
    assert cfg.checkpoint_job_dir == str(Path("./checkpoints/<project_name>/<experiment_name>"))
    assert cfg.buffer.trainer_input.experience_buffer.path == "sqlite:///gsm8k.db"


def test_unknown_key_names_path_and_closest(tmp_path):
    bad = MINIMAL + "      formatt: {prompt_key: q}\n"
    with pytest.raises(
        ConfigError, match=r"^buffer\.explorer_input\.taskset\.formatt: unknown key; did you mean format\?$"
    ):
        cli(["--config", write(tmp_path, bad)])
    with pytest.raises(ConfigError, match=r"buffer\.explorer_input\.eval_tasksets\[1\]\.pathh: .*did you mean path"):
        cli(["--config", write(tmp_path, MINIMAL + "    eval_tasksets:\n    - {path: a}\n    - {pathh: b}\n")])


def test_wrong_type_names_path_value_and_type(tmp_path):
    with pytest.raises(ConfigError, match=r"buffer\.batch_size: 'four' is not a valid int"):
        cli(["--config", write(tmp_path, MINIMAL.replace("batch_size: 4", "batch_size: four"))])
    with pytest.raises(ConfigError, match=r"mode: 'bothh' is not one of .*did you mean both"):
        cli(["--config", write(tmp_path, MINIMAL + "mode: bothh\n")])
    with pytest.raises(ConfigError, match=r"buffer\.batch_size: 2\.5 is not a valid int"):
        cli(["--config", write(tmp_path, MINIMAL.replace("batch_size: 4", "batch_size: 2.5"))])


def test_experience_db_urls_sqlite_or_postgresql_else_named(tmp_path):
    for url in ("sqlite:///x.db", "postgresql://u:p@db.example:5432/rft", "postgres://u@h/rft", "plain/path.db"):
        cfg, _ = cli(["--config", write(tmp_path, MINIMAL), "--buffer.trainer_input.experience_buffer.path", url])
        assert derive(cfg).buffer.trainer_input.experience_buffer.path == url
    cfg, _ = cli(
        ["--config", write(tmp_path, MINIMAL), "--buffer.trainer_input.experience_buffer.path", "mysql://h/db"]
    )
    with pytest.raises(ConfigError, match=r"experience_buffer\.path: mysql:// is not an experience DB .*postgresql://"):
        derive(cfg)


def test_values_are_coerced_to_field_types(tmp_path):
    text = MINIMAL + "algorithm:\n  optimizer:\n    lr: 1e-6\n    betas: [0.9, '0.95']\ntrainer:\n  grad_clip: 2\n"
    cfg, _ = cli(["--config", write(tmp_path, text)])
    assert yaml.safe_load("x: 1e-6")["x"] == "1e-6"  # the trap: YAML 1.1 reads it as a string
    assert cfg.algorithm.optimizer.lr == 1e-6 and type(cfg.algorithm.optimizer.lr) is float
    assert cfg.algorithm.optimizer.betas == [0.9, 0.95]
    assert cfg.trainer.grad_clip == 2.0 and type(cfg.trainer.grad_clip) is float


def test_interpolation(tmp_path, monkeypatch):
    text = """
model:
  model_path: ${oc.env:NANORFT_TEST_MODEL,default/model}
  critic_model_path: ${model.model_path}
  max_model_len: ${oc.env:NANORFT_TEST_LEN,128}
mode: train
"""
    monkeypatch.delenv("NANORFT_TEST_MODEL", raising=False)
    monkeypatch.setenv("NANORFT_TEST_LEN", "512")
    cfg, _ = cli(["--config", write(tmp_path, text)])
    assert (cfg.model.model_path, cfg.model.critic_model_path, cfg.model.max_model_len) == (
        "default/model",
        "default/model",
        512,
    )
    monkeypatch.setenv("NANORFT_TEST_MODEL", "/models/m")
    cfg, _ = cli(["--config", write(tmp_path, text)])
    assert cfg.model.critic_model_path == "/models/m"
    with pytest.raises(ConfigError, match="NANORFT_UNSET_VAR"):
        cli(["--config", write(tmp_path, "model:\n  model_path: ${oc.env:NANORFT_UNSET_VAR}\n")])


def test_text_with_dollar_brace_round_trips_through_the_written_config(tmp_path):
    """OmegaConf's documented escape `\\${...}` in a YAML, and a command line's `${...}` (taken as written), are text
    the config keeps; the YAML written for the processes (to_yaml) and --dry-run's load back to the same text
    (escaped there), backslashes and `???`-like text included."""
    text = MINIMAL.replace(
        "path: data/x\n", "path: data/x\n      format: {system_prompt: 'Answer in LaTeX like \\${x}^2$'}\n"
    )
    tricky = ["${model.model_path}", "\\${a}", "\\\\${b} \\", "${", "\\???", "a ??? b"]
    cfg, _ = cli(
        [
            "--config",
            write(tmp_path, text),
            "--explorer.env_vars",
            *[x for i, v in enumerate(tricky) for x in (f"K{i}", v)],
        ]
    )
    (stage,) = resolve_stages(cfg)
    assert stage.buffer.explorer_input.tasksets[0].format.system_prompt == "Answer in LaTeX like ${x}^2$"
    assert list(stage.explorer.env_vars.values()) == tricky
    stage.monitor.monitor_args = {"tags": tricky}  # --dry-run shows these (every env_vars value as ***)
    assert from_dict(Config, normalize(read_yaml(write(tmp_path, to_yaml(stage), "w.yaml")))) == stage
    out = entry.run("launch.py", "--config", write(tmp_path, to_yaml(stage), "w.yaml"), "--dry-run", timeout=120)
    assert out.returncode == 0, out.stderr
    hidden = dataclasses.replace(stage.explorer, env_vars=dict.fromkeys(stage.explorer.env_vars, "***"))
    assert from_dict(Config, normalize(read_yaml(write(tmp_path, out.stdout, "d.yaml")))) == dataclasses.replace(
        stage, explorer=hidden
    )


def test_precedence_default_yaml_cli(tmp_path):
    path = write(tmp_path, MINIMAL + "algorithm:\n  optimizer:\n    lr: 1e-5\n")
    assert Config().algorithm.optimizer.lr == 1e-6
    assert cli(["--config", path])[0].algorithm.optimizer.lr == 1e-5
    cfg, _ = cli(
        [
            "--config",
            path,
            "--algorithm.optimizer.lr",
            "3e-6",
            "--buffer.batch_size",
            "2",
            "--algorithm.kl_loss_fn_args",
            "{kl_coef: 0.01}",
            "--trainer.use_dynamic_bsz",
            "False",
        ]
    )
    assert cfg.algorithm.optimizer.lr == 3e-6 and cfg.buffer.batch_size == 2
    assert cfg.algorithm.kl_loss_fn_args == {"kl_coef": 0.01} and cfg.trainer.use_dynamic_bsz is False
    assert cfg.model.model_path == "some/model"  # untouched YAML values survive CLI overrides
    with pytest.raises(SystemExit):
        cli(["--config", path, "--algorithm.optimizer.lrr", "3"])


def test_bare_name_resolves_in_configs_dir():
    assert configs.find_config_file("tiny") == ROOT / "configs/tiny.yaml"
    assert configs.find_config_file("gsm8k.yaml") == ROOT / "configs/gsm8k.yaml"
    with pytest.raises(ConfigError, match="not found.*tried"):
        configs.find_config_file("no_such_config")


def test_derived_values(tmp_path):
    (cfg,) = resolve_stages(
        cli(["--config", write(tmp_path, MINIMAL + "algorithm: {algorithm_type: grpo, repeat_times: 6}\n")])[0]
    )
    assert cfg.buffer.train_batch_size == 24
    assert (cfg.model.max_prompt_tokens, cfg.model.max_response_tokens) == (128, 128)
    assert cfg.trainer.max_token_len_per_gpu == 16384 and cfg.trainer.ppo_mini_batch_size == 24  # veRL's default budget
    assert cfg.buffer.explorer_input.tasksets[0].name == "taskset_0"
    assert cfg.buffer.explorer_input.taskset.path == ""  # moved into tasksets
    assert (
        cfg.buffer.trainer_input.experience_buffer.path
        == f"sqlite:///{Path('checkpoints/nanorft/rft/buffer/experience_buffer.db')}"
    )
    # explicit train_batch_size wins; prompt + response must fit
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, MINIMAL), "--buffer.train_batch_size", "7"])[0])
    assert cfg.buffer.train_batch_size == 7
    with pytest.raises(ConfigError, match="fit in max_model_len"):
        derive(
            cli(
                [
                    "--config",
                    write(tmp_path, MINIMAL),
                    "--model.max_prompt_tokens",
                    "200",
                    "--model.max_response_tokens",
                    "100",
                ]
            )[0]
        )
    with pytest.raises(ConfigError, match="model.max_model_len is unset"):
        derive(cli(["--config", write(tmp_path, MINIMAL.replace("max_model_len: 256", "max_response_tokens: 9"))])[0])
    with pytest.raises(ConfigError, match="model.model_path is required"):
        derive(Config())
    # a piece's *_args are checked when the config is derived, before any process starts
    with pytest.raises(ConfigError, match=r"algorithm\.advantage_fn_args\.gamma: unknown key"):
        derive(
            cli(
                [
                    "--config",
                    write(tmp_path, MINIMAL + "algorithm: {algorithm_type: grpo, advantage_fn_args: {gamma: 1}}\n"),
                ]
            )[0]
        )
    with pytest.raises(ConfigError, match=r"unknown policy_loss_fn 'ppx'"):
        derive(cli(["--config", write(tmp_path, MINIMAL), "--algorithm.policy_loss_fn", "ppx"])[0])
    with pytest.raises(ConfigError, match="unknown 'grpoo'; did you mean grpo"):
        derive(cli(["--config", write(tmp_path, MINIMAL + "algorithm: {algorithm_type: grpoo}\n")])[0])


def test_a_vllm_auxiliary_model_starts_after_the_gpus_the_split_gave_the_rollout_model(tmp_path, monkeypatch):
    """An HF rollout engine takes one GPU in the split (the explorer's first); a vLLM judge then starts at GPU 1,
    where the split counted it, not on the rollout model's GPU 0 (auxiliary_handles places engines by the same
    rule, configs.resolve.explorer_gpu_plan, that the split counts with)."""
    import engines

    text = MINIMAL + (
        "cluster: {gpu_per_node: 8}\nexplorer:\n  rollout_model: {engine_type: hf}\n"
        "  auxiliary_models: [{model_path: judge, engine_type: vllm, engine_num: 2, "
        "tensor_parallel_size: 2}, {model_path: rm, engine_type: hf}, {model_path: judge2, "
        "engine_type: vllm}]\n"
    )
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, text)])[0])
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num) == (6, 2)  # 1 (HF rollout) + 4 + 0 + 1
    started = []
    monkeypatch.setattr(engines, "make_engine", lambda m, path, *a, first_gpu=0, **k: started.append((path, first_gpu)))
    monkeypatch.setattr(engines, "load_tokenizer", lambda path: object())
    engines.auxiliary_handles(cfg)
    assert started == [("judge", 1), ("rm", 5), ("judge2", 5)]  # the HF one shares the explorer's device


def test_step_wise_workflows_and_the_advantage_fn_must_match(tmp_path, caplog):
    """Checked with the workflow args (workflows.args.check_tasksets, as the launcher and the explorer start)."""

    def derive(cfg):
        (stage,) = resolve_stages(cfg)
        check_step_wise(stage)
        return stage

    step_wise = MINIMAL.replace("path: data/x", "path: data/x\n      workflow_args: {step_wise: true}")
    assert "step_wise: true" in step_wise
    with pytest.raises(
        ConfigError,
        match=r"workflow_args.step_wise writes one experience per turn, which "
        r"algorithm.advantage_fn grpo would normalise",
    ):
        derive(cli(["--config", write(tmp_path, step_wise + "algorithm: {algorithm_type: grpo}\n")])[0])
    derive(cli(["--config", write(tmp_path, step_wise + "algorithm: {algorithm_type: multi_step_grpo}\n")])[0])
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        derive(cli(["--config", write(tmp_path, MINIMAL + "algorithm: {algorithm_type: multi_step_grpo}\n")])[0])
    assert "step_wise_grpo with no taskset setting workflow_args.step_wise" in caplog.text
    with pytest.raises(ConfigError, match="algorithm.kl_penalty_fn must be none"):
        derive(
            cli(
                [
                    "--config",
                    write(tmp_path, step_wise + "algorithm: {algorithm_type: multi_step_grpo, kl_penalty_fn: k1}\n"),
                ]
            )[0]
        )


def test_gpu_split(tmp_path, caplog):
    base = (
        MINIMAL
        + "cluster: {gpu_per_node: 8}\nexplorer:\n"
        + "  rollout_model: {engine_type: vllm, engine_num: 2, tensor_parallel_size: 2}\n"
    )
    # vLLM: engine_num engines of tensor_parallel_size GPUs each; the trainer gets the rest
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, base)])[0])
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num, cfg.cluster.colocate) == (4, 4, False)
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):  # the HF engine is one engine on one GPU
        (cfg,) = resolve_stages(
            cli(
                [
                    "--config",
                    write(tmp_path, base),
                    "--explorer.rollout_model.engine_type",
                    "hf",
                    "--explorer.rollout_model.tensor_parallel_size",
                    "1",
                ]
            )[0]
        )
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num) == (1, 7)
    assert "explorer.rollout_model.engine_num = 2: the HF engine runs as one engine" in caplog.text
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, base + "mode: train\n")])[0])
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num) == (0, 8)
    with pytest.raises(
        ConfigError,
        match="engine_num 1 x tensor_parallel_size 8 = 8 GPUs of cluster.gpu_per_node 8, leaving none for the trainer",
    ):
        derive(
            cli(
                [
                    "--config",
                    write(tmp_path, base),
                    "--explorer.rollout_model.tensor_parallel_size",
                    "8",
                    "--explorer.rollout_model.engine_num",
                    "1",
                ]
            )[0]
        )
    with pytest.raises(
        ConfigError, match="engine_num 2 x tensor_parallel_size 8 = 16 GPUs, cluster.gpu_per_node gives 8"
    ):
        derive(cli(["--config", write(tmp_path, base), "--explorer.rollout_model.tensor_parallel_size", "8"])[0])
    aux = base + "  auxiliary_models: [{model_path: judge, engine_type: vllm, engine_num: 2}]\n"
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, aux)])[0])
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num) == (6, 2)  # a vLLM judge's GPUs count
    (cfg,) = resolve_stages(
        cli(["--config", write(tmp_path, aux.replace("judge, engine_type: vllm", "judge, engine_type: hf"))])[0]
    )
    assert cfg.cluster.explorer_gpu_num == 4  # an HF auxiliary model shares the explorer's device
    with pytest.raises(ConfigError, match="auxiliary models' 2 = 6 GPUs of cluster.gpu_per_node 6"):
        derive(cli(["--config", write(tmp_path, aux), "--cluster.gpu_per_node", "6"])[0])
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, MINIMAL + "cluster: {gpu_per_node: 0}\n")])[0])
    # 0 means no GPU, whatever the machine has: the HF engine and nothing to split
    assert cfg.cluster.gpu_per_node == 0 and cfg.explorer.rollout_model.engine_type == "hf"
    assert (cfg.cluster.explorer_gpu_num, cfg.cluster.trainer_gpu_num) == (0, 0)


def test_several_nodes_the_explorer_on_node_0_the_trainer_on_whole_nodes(tmp_path, monkeypatch):
    """cluster.node_num > 1: the trainer spans whole nodes, the last ones (torchrun with a static rendezvous at
    master_addr); the launcher on node 0 starts what runs there and names the line for each other node."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the children's GPUs index the launcher's own

    def layout(text: str, *args: str) -> tuple[configs.Config, dict, list[str]]:
        (cfg,) = resolve_stages(cli(["--config", write(tmp_path, text), *args])[0])
        return cfg, launch.commands(cfg, Path("/j/config.yaml")), launch.other_nodes(cfg, Path("/j/config.yaml"))

    gpus = MINIMAL + (
        "cluster: {node_num: 3, gpu_per_node: 8, master_addr: node1, master_port: 29400}\n"
        "explorer:\n  rollout_model: {engine_type: vllm, engine_num: 4, tensor_parallel_size: 2}\n"
    )
    # mode both: the explorer's 8 GPUs fill node 0, the trainer has nodes 1 and 2 (node 0 starts only the explorer);
    # the explorer reaches the DB and trainer rank 0's weight store on node 1 (configs/checks.py refuses SQLite and
    # a loopback sync_host there: tests/test_config_keys.py)
    apart = ("--buffer.trainer_input.experience_buffer.path", "postgresql://u@db/x", "--synchronizer.sync_host", "n1")
    cfg, here, others = layout(gpus, *apart)
    cl = cfg.cluster
    assert (cl.explorer_gpu_num, cl.trainer_gpu_num, cl.trainer_node_num, cl.trainer_gpu_num_per_node) == (8, 16, 2, 8)
    assert list(here) == ["explorer"] and here["explorer"][1] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert [line.split(" && ")[0] for line in others] == [f"node 1: cd {os.getcwd()}", f"node 2: cd {os.getcwd()}"]
    assert others[1].split(" && ")[1].split()[1:9] == [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=8",
        "--rdzv-backend=static",
        "--rdzv-endpoint=node1:29400",
        str(ROOT / "train.py"),
    ]
    # mode train: every node, node 0 included (trainer rank 0 is there: node-rank 0)
    cfg, here, others = layout(gpus, "--mode", "train")
    assert (cfg.cluster.trainer_node_num, cfg.cluster.trainer_gpu_num_per_node) == (3, 8)
    assert "--node-rank=0" in here["trainer"][0] and [o.split(":")[0] for o in others] == ["node 1", "node 2"]
    # the CPU, the same layout with one trainer rank a node: in mode both node 0 runs the explorer alone, the trainer
    # nodes 1 and 2 (its rank 0, the DB's reader and the weights' sender, on node 1: master_addr); mode train, all
    cpu = MINIMAL + "cluster: {node_num: 3, gpu_per_node: 0, master_addr: node1, master_port: 29400}\n"
    cfg, here, others = layout(cpu, *apart)
    assert (cfg.cluster.trainer_node_num, cfg.cluster.trainer_gpu_num_per_node) == (2, 0) and list(here) == ["explorer"]
    assert here["explorer"][1] == {}  # alone on node 0: no CPU split with the trainer
    assert [o.split(" && ")[0] for o in others] == [f"node 1: cd {os.getcwd()}", f"node 2: cd {os.getcwd()}"]
    assert "--nnodes=2 --node-rank=0 --nproc-per-node=1 " in others[0] and "--node-rank=1 " in others[1]
    with pytest.raises(ConfigError, match="an SQLite DB serves the processes of one host only"):
        layout(cpu, "--synchronizer.sync_host", "n1")
    cfg, here, others = layout(cpu, "--mode", "train")
    assert (
        cfg.cluster.trainer_node_num == 3 and list(here) == ["trainer"] and "--nproc-per-node=1" in here["trainer"][0]
    )
    assert "--nnodes=3 --node-rank=0 " in " ".join(here["trainer"][0]) and len(others) == 2
    with pytest.raises(
        ConfigError,
        match="whole nodes: the rollout engines take explorer.rollout_model.engine_num 2 "
        "x tensor_parallel_size 2 = 4 GPUs of node 0's cluster.gpu_per_node 8, "
        "leaving 20 GPUs, not a multiple of 8",
    ):
        layout(gpus, *apart, "--explorer.rollout_model.engine_num", "2")
    with pytest.raises(
        ConfigError,
        match="the explorer runs on node 0, and its rollout engines need .* = 16 GPUs, "
        "more than cluster.gpu_per_node 8",
    ):
        layout(gpus, *apart, "--explorer.rollout_model.engine_num", "8")


@pytest.mark.parametrize(
    "name, layout",
    [  # what each file's comments say
        ("gsm8k.yaml", (1, 1, False)),  # one vLLM engine, the trainer on the remaining GPU
        ("async/gsm8k_explorer.yaml", (4, 0, False)),  # 4 vLLM engines on 4 GPUs
        ("async/gsm8k_explorer_new.yaml", (2, 0, False)),  # a second explorer on two GPUs that became free
        ("async/gsm8k_trainer.yaml", (0, 4, False)),  # the trainer on 4 GPUs
    ],
)
def test_the_gsm8k_configs_resolve_to_the_gpu_layout_they_describe(name, layout):
    (cfg,) = resolve_stages(cli(["--config", str(ROOT / "configs" / name)])[0])
    cl = cfg.cluster
    assert (cl.explorer_gpu_num, cl.trainer_gpu_num, cl.colocate) == layout


def test_mode_both_on_one_gpu_colocates(tmp_path, caplog, monkeypatch):
    """Trinity's colocate: one GPU shared by explorer and trainer, vLLM capped to a quarter of it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the children's GPUs index the launcher's own
    one = MINIMAL + "cluster: {gpu_per_node: 1}\nexplorer:\n  rollout_model: {engine_type: vllm}\n"
    with caplog.at_level(logging.INFO, logger="nanorft.config"):
        (cfg,) = resolve_stages(cli(["--config", write(tmp_path, one)])[0])
    cl = cfg.cluster
    assert (cl.colocate, cl.explorer_gpu_num, cl.trainer_gpu_num) == (True, 1, 1)
    assert cfg.explorer.rollout_model.gpu_memory_utilization == 0.25 and "capped to 0.25" in caplog.text
    config_file = tmp_path / "resolved.yaml"
    config_file.write_text(to_yaml(cfg))
    cmds = launch.commands(cfg, config_file)
    assert cmds["explorer"][1]["CUDA_VISIBLE_DEVICES"] == cmds["trainer"][1]["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(ConfigError, match="engine_num 2 x tensor_parallel_size 1 on one GPU shared"):
        derive(cli(["--config", write(tmp_path, one), "--explorer.rollout_model.engine_num", "2"])[0])
    (cfg,) = resolve_stages(cli(["--config", write(tmp_path, one), "--mode", "train"])[0])
    assert (cfg.cluster.colocate, cfg.cluster.trainer_gpu_num) == (False, 1)


def test_overlapping_cpu_processes_split_the_threads_and_wait_passively(tmp_path, monkeypatch):
    """Mode both without GPUs, sync_offset 1 on 6 cores: the explorer 2 threads, the trainer 6, both OpenMP threads
    that sleep when idle (launch.cpu_split); on-policy, or with the user's own OMP_NUM_THREADS, neither is set; the
    user's OMP_WAIT_POLICY is kept."""
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    cpu = MINIMAL + "cluster: {gpu_per_node: 0}\n"

    def envs(*args: str) -> list[dict]:
        (cfg,) = resolve_stages(cli(["--config", write(tmp_path, cpu), *args])[0])
        cmds = launch.commands(cfg, tmp_path / "resolved.yaml")
        return [cmds[role][1] for role in ("explorer", "trainer")]

    offset = ("--synchronizer.sync_offset", "1")
    assert envs(*offset) == [
        {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
        {"OMP_NUM_THREADS": "6", "OMP_WAIT_POLICY": "PASSIVE"},
    ]
    assert envs() == [{}, {}]  # on-policy: they take turns, each keeps every core
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert [e["OMP_WAIT_POLICY"] for e in envs(*offset)] == ["ACTIVE", "ACTIVE"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert envs(*offset) == [{}, {}]


@pytest.mark.slow
def test_gpu_per_node_0_hides_cuda_from_every_process(tmp_path):
    """One process (for time) loads a config of gpu_per_node 4 (default), then one of 0, as a launched process does
    (NANORFT_LAUNCHED: the pre-flight, which would refuse the made-up model and taskset, is the launcher's)."""
    code = (
        "import os, sys, configs\nfor c in sys.argv[1:]:\n    configs.entry(['--config', c], 'x')\n"
        "    print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | {"NANORFT_LAUNCHED": "1"}
    cpu = write(tmp_path, MINIMAL + "cluster: {gpu_per_node: 0}\n")
    out = subprocess.run(
        [sys.executable, "-c", code, write(tmp_path, MINIMAL, "d.yaml"), cpu],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["None", "''"]  # unset: torch sees what the machine has; then hidden


def test_stages_inherit_the_global_config(tmp_path):
    text = (
        MINIMAL
        + """
algorithm: {algorithm_type: grpo, repeat_times: 4, optimizer: {lr: 1e-5}}
stages:
- stage_name: warm
  mode: train
  algorithm: {algorithm_type: sft}
  buffer:
    total_steps: 3
    trainer_input: {experience_buffer: {storage_type: file, path: sft.jsonl}}
- stage_name: rl
"""
    )
    warm, rl = resolve_stages(cli(["--config", write(tmp_path, text)])[0])
    assert (warm.name, rl.name) == ("rft/warm", "rft/rl")
    assert warm.mode == "train" and rl.mode == "both"
    assert warm.algorithm.algorithm_type == "sft" and warm.algorithm.policy_loss_fn == "sft"
    # another algorithm starts from its own defaults, not from grpo's pieces and group size
    assert (warm.algorithm.repeat_times, warm.algorithm.kl_loss_fn, warm.algorithm.optimizer.lr) == (1, "none", 1e-6)
    assert rl.algorithm.optimizer.lr == 1e-5 and rl.algorithm.repeat_times == 4
    assert warm.buffer.batch_size == 4 and warm.buffer.total_steps == 3  # other sections: key by key
    assert warm.buffer.trainer_input.experience_buffer.path == "sft.jsonl"
    assert warm.synchronizer.sync_method == "checkpoint"
    assert rl.algorithm.algorithm_type == "grpo" and rl.buffer.total_steps is None
    assert rl.checkpoint_job_dir.endswith(str(Path("rft/rl")))
    with pytest.raises(ConfigError, match=r"stages\[0\] \(warm\): buffer.batch_sizee: unknown key"):
        resolve_stages(cli(["--config", write(tmp_path, text.replace("total_steps: 3", "batch_sizee: 3"))])[0])


def test_verl_trainer_config_mapped_or_warned(tmp_path, caplog):
    text = (
        MINIMAL
        + """
trainer:
  trainer_config:
    actor_rollout_ref:
      model: {enable_gradient_checkpointing: true}
      actor: {ppo_micro_batch_size_per_gpu: 16, fsdp_config: {param_offload: true}}
      ref: {fsdp_config: {param_offload: true}}
    critic: {optim: {lr: 2e-5}, cliprange_value: 0.2}
    trainer: {critic_warmup: 3, balance_batch: true}
"""
    )
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        cfg, _ = cli(["--config", write(tmp_path, text)])
    t = cfg.trainer
    assert t.gradient_checkpointing and t.param_offload and t.ref_param_offload
    assert t.micro_batch_size_per_gpu == 16 and t.critic_warmup == 3
    assert t.critic.lr == 2e-5 and t.critic.cliprange_value == 0.2
    assert "trainer.trainer_config.trainer.balance_batch" in caplog.text  # unmapped: warned by path
    clash = text.replace("trainer:\n  trainer_config:", "trainer:\n  gradient_checkpointing: false\n  trainer_config:")
    with pytest.raises(
        ConfigError, match="enable_gradient_checkpointing = True conflicts with trainer.gradient_checkpointing"
    ):
        cli(["--config", write(tmp_path, clash)])


def test_aliases_and_ignored_keys_warn(tmp_path, caplog):
    text = (
        MINIMAL
        + "ray_namespace: x\nalgorithm:\n  optimizer: {warmup_style: cosine}\nmonitor: {enable_ray_timeline: true}\n"
    )
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        cfg, _ = cli(["--config", write(tmp_path, text)])
    assert cfg.algorithm.optimizer.lr_scheduler_type == "cosine"
    assert "warmup_style is an old name" in caplog.text
    assert "ray_namespace is ignored" in caplog.text and "monitor.enable_ray_timeline is ignored" in caplog.text


REPLAY = """
  trainer_input:
    experience_buffer:
      name: exp
      storage_type: queue
      replay_buffer:
        enable: true
        priority_fn: linear_decay
        reuse_cooldown_time: 30
        priority_fn_args:
          decay: 1.5
"""


def test_trinitys_replay_buffer_block_loads_or_each_key_is_refused_by_name(tmp_path):
    """Trinity-RFT's nested experience_buffer.replay_buffer block sets use_priority_queue, reuse_cooldown_time and
    priority_decay (derived, too); another priority_fn, a key of its args nanorft lacks, or a value that contradicts
    the key beside it, is refused naming the key."""
    cfg = derive(cli(["--config", write(tmp_path, MINIMAL + REPLAY)])[0])
    eb = cfg.buffer.trainer_input.experience_buffer
    assert (eb.use_priority_queue, eb.reuse_cooldown_time, eb.priority_decay) == (True, 30.0, 1.5)
    where = "buffer.trainer_input.experience_buffer.replay_buffer"
    for old, new, error in [
        ("linear_decay", "decay_limit_randomization", f"{where}.priority_fn = 'decay_limit_randomization': "),
        ("decay: 1.5", "decay: 1.5\n          sigma: 0.1", f"{where}.priority_fn_args.sigma: not a key nanorft has"),
        ("name: exp", "name: exp\n      use_priority_queue: false", f"{where}.enable = True and .*disagree"),
    ]:
        with pytest.raises(ConfigError, match=error):
            cli(["--config", write(tmp_path, MINIMAL + REPLAY.replace(old, new))])


@pytest.mark.parametrize(
    "block, says",
    [
        ("  task_pipeline:\n    top_k: 10\n", "task_pipeline.top_k is not supported: no priority-weighted"),
        ("  task_pipeline:\n    output:\n      path: x\n", "task_pipeline.output is not supported: the task"),
        ("  experience_pipeline:\n    save_input: true\n", "save_input is not supported: the experiences a"),
        ("  experience_pipeline:\n    inputs: [a]\n", "experience_pipeline.inputs is not supported"),
    ],
)
def test_trinitys_data_processor_keys_nanorft_lacks_are_refused_by_name(tmp_path, block, says):
    """Trinity's data_processor keys with a meaning nanorft does not implement: an error that names the key and
    says why (never the unknown-key error's guess, never dropped)."""
    with pytest.raises(ConfigError, match=re.escape(says)):
        cli(["--config", write(tmp_path, MINIMAL + "data_processor:\n" + block)])


def test_save_input_false_is_what_nanorft_does_anyway(tmp_path, caplog):
    """experience_pipeline.save_input: false (Trinity's switch off) loads, with a warning saying so."""
    text = MINIMAL + "data_processor:\n  experience_pipeline:\n    save_input: false\n"
    with caplog.at_level("WARNING"):
        cli(["--config", write(tmp_path, text)])
    assert "save_input: false is nanorft's only behaviour" in caplog.text


def test_dynamic_sampling_over_sampling_needs_total_steps_in_mode_both(tmp_path):
    """The explorer's over-sampling makes a step's tasks vary: mode both (explorer and trainer taking turns) needs
    buffer.total_steps; max_num_gen_batches 1 (no over-sampling) or total_steps is fine; 0 (veRL's no cap) is out of
    range."""
    text = MINIMAL + "algorithm:\n  sample_strategy: dynamic_sampling\n"
    with pytest.raises(ConfigError, match="over-samples in the explorer .* in mode both set buffer.total_steps"):
        derive(cli(["--config", write(tmp_path, text)])[0])
    for fixed in (
        text + "  sample_strategy_args: {max_num_gen_batches: 1}\n",
        text.replace("  batch_size", "  total_steps: 5\n  batch_size"),
    ):
        derive(cli(["--config", write(tmp_path, fixed)])[0])
    with pytest.raises(ConfigError, match="max_num_gen_batches: 0 is out of range; allowed: >= 1"):
        derive(cli(["--config", write(tmp_path, text + "  sample_strategy_args: {max_num_gen_batches: 0}\n")])[0])


def test_every_schema_field_has_a_docstring():
    tree = ast.parse((ROOT / "configs/schema.py").read_text())
    missing = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    missing.append(f"{cls.name}.{node.target.id}")
    assert not missing, f"fields without a docstring: {missing}"


# lists and dicts of sections: empty by default, so their fields have no flags
SECTION_LISTS = ("tasksets", "eval_tasksets", "auxiliary_models", "stages", "auxiliary_buffers", "lora_configs")


def _flags(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += _flags(type(default), f"{prefix}{f.name}.")
        elif not (isinstance(default, (list, dict)) and f.name in SECTION_LISTS):
            out.append(f"--{prefix}{f.name}")
    return out


def test_help_lists_every_field_with_its_docstring():
    env = {**os.environ, "COLUMNS": "120"}  # one column: tyro 0.9 cuts long flags short in a multi-column layout
    # NOTE: launch.py's --help is every script's (configs.cli), and it starts in half the time
    out = entry.run("launch.py", "--config", "tiny.yaml", "--help", env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    out = out.stdout
    flags = _flags(Config)
    assert len(flags) > 150
    missing = [f for f in flags if not re.search(re.escape(f) + r"[\s│]", out)]  # a flag ends where a space or box does
    assert not missing, f"not in --help: {missing}"
    assert "Peak learning rate of the actor." in out and "Tasks per explorer step" in out
    assert "(default: 5e-05)" in out  # tiny.yaml's lr shows as the default


@pytest.mark.parametrize("script", ["train.py", "explore.py"])
@pytest.mark.slow
def test_dry_run(script, tmp_path):
    ok = entry.run(script, "--config", "tiny.yaml", "--dry-run", "--buffer.batch_size", "3", timeout=120)
    assert ok.returncode == 0, ok.stderr
    docs = list(yaml.safe_load_all(ok.stdout))
    assert [d["name"] for d in docs] == ["tiny/eval_base", "tiny/sft_warmup", "tiny/rft"]
    assert docs[2]["buffer"]["batch_size"] == 3 and docs[2]["buffer"]["train_batch_size"] == 24


def test_a_bad_config_exits_2_naming_the_key(tmp_path, capsys):
    """What train.py and explore.py do first, configs.entry (test_dry_run runs both through it), on a bad config: its
    error on stderr and exit status 2, before anything else."""
    with pytest.raises(SystemExit) as e:
        configs.entry(["--config", write(tmp_path, MINIMAL + "bufferr: {}\n"), "--dry-run"], "d")
    assert e.value.code == 2 and "bufferr: unknown key; did you mean buffer?" in capsys.readouterr().err


# explorer.env_vars whose names no pattern of secret names knew (issue 25): every env_vars value is hidden
ODD_SECRETS = {
    "AZURE_OPENAI_KEY": "az-1",
    "DB_PASS": "dbp-2",
    "GCP_CREDENTIALS": "gcp-3",
    "GITHUB_PAT": "ghp-4",
    "API_KEYS": "ak-5",
    "SESSION_COOKIE": "ck-6",
    "PLAIN": "plain-7",
}


def test_dry_run_hides_secrets_and_the_run_directorys_config_keeps_them(tmp_path):
    """--dry-run's YAML (a terminal, a CI log, an issue) shows *** for monitor_args' password and unknown keys, every
    env_vars value (whatever its name) and a password in a DB URL (one with an @ in it too), and says so in a comment;
    what the launcher writes for the processes (configs.to_yaml, the job directory's config.yaml:
    tests/test_monitor.py runs the launcher) keeps the real values."""
    env = ", ".join(f"{k}: {v}" for k, v in ODD_SECRETS.items())
    text = MINIMAL + (
        "monitor: {monitor_type: mlflow, monitor_args: {uri: 'http://127.0.0.1:5000', username: me, "
        f"password: hunter2, session: sess-8}}}}\nexplorer: {{env_vars: {{HF_TOKEN: hf_abc, {env}}}}}\n"
    )
    text = text.replace(
        "batch_size: 4\n",
        "batch_size: 4\n  trainer_input: {experience_buffer: {path: 'postgresql://rft:s3@cret@db/rft'}}\n",
    )
    # NOTE: launch.py's --dry-run is every script's (configs.entry), and it starts in half the time
    out = entry.run("launch.py", "--config", write(tmp_path, text), "--dry-run", timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# secrets are shown as ***: every env_vars value, monitor_args' values (but its ")
    secrets = ("hunter2", "hf_abc", "s3@cret", "cret@", "sess-8", *ODD_SECRETS.values())
    assert not [s for s in secrets if s in out.stdout + out.stderr]
    (doc,) = yaml.safe_load_all(out.stdout)
    assert doc["monitor"]["monitor_args"] == {
        "uri": "http://127.0.0.1:5000",
        "username": "me",
        "password": "***",
        "session": "***",
    }
    assert doc["explorer"]["env_vars"] == {"HF_TOKEN": "***", **dict.fromkeys(ODD_SECRETS, "***")}
    assert doc["buffer"]["trainer_input"]["experience_buffer"]["path"] == "postgresql://rft:***@db/rft"
    (stage,) = resolve_stages(cli(["--config", write(tmp_path, text)])[0])
    assert all(
        s in to_yaml(stage) for s in ("hunter2", "hf_abc", "postgresql://rft:s3@cret@db/rft", *ODD_SECRETS.values())
    )


@pytest.mark.parametrize(
    "extra, refused",
    [
        # warned (monitor_args' unknown key): the warning shows the mapping with its password hidden
        ("monitor: {monitor_type: mlflow, monitor_args: {password: hunter2, uri: 'http://me:hunter2@h', x: e}}\n", ""),
        # refused: by a check (a NUL in a password, in a URL with a password), by the loader (a token of the wrong type)
        ('monitor: {monitor_args: {password: "hunter2\\0"}}\n', "holds a NUL"),
        ("explorer: {env_vars: {HF_TOKEN: [hunter2]}}\n", "explorer.env_vars.HF_TOKEN: '***' is not a valid str"),
        ('explorer: {env_vars: {X: "postgresql://u:hunter2@h/db\\0"}}\n', "explorer.env_vars.X: '***' holds a NUL"),
        # every env_vars value, whatever its name; monitor_args' values but the harmless keys;
        # a URL's password with an @
        ("explorer: {env_vars: {DB_PASS: [hunter2]}}\n", "explorer.env_vars.DB_PASS: '***' is not a valid str"),
        ('explorer: {env_vars: "DB_PASS=hunter2"}\n', "explorer.env_vars: expected a mapping, got '***'"),
        ("monitor: {monitor_type: wandb, monitor_args: {entity: team, session: hunter2}}\n", ""),
        (
            'monitor: {monitor_args: {uri: "postgresql://u:hun@ter2@h/db\\0"}}\n',
            "monitor.monitor_args.uri: 'postgresql://u:***@h/db\\x00' holds a NUL",
        ),
    ],
)
def test_no_warning_or_error_shows_a_secret(tmp_path, caplog, extra, refused):
    """Warnings go to the console and every log/<role>.log, errors to the console and CI logs: a value shown in one
    has its secrets hidden as --dry-run hides them (a key named like a password, key or token; a URL's password)."""
    configs.checks._WARNED_ALREADY.clear()
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        try:
            resolve_stages(cli(["--config", write(tmp_path, MINIMAL + extra)])[0])
            said = caplog.text
        except ConfigError as e:
            said = caplog.text + str(e)
    assert refused in said if refused else "monitor.monitor_args = {" in said
    assert not [s for s in ("hunter2", "hun@", "ter2") if s in said]
    if "entity" in extra:
        assert "monitor.monitor_args = {'entity': 'team', 'session': '***'}" in said


@pytest.mark.parametrize(
    "url, show",
    [
        ("postgresql://u:p@ss@host/db", "postgresql://u:***@host/db"),  # an @ in the password
        ("redis://:p@ss@w0rd@redis-host:6379/0", "redis://:***@redis-host:6379/0"),  # no user, two @
        ("postgresql://rft:s3cret@db-host:5432/rft", "postgresql://rft:***@db-host:5432/rft"),
        ("postgresql://:s3cret@host", "postgresql://:***@host"),
        (
            "postgresql://user:pa%40ss%2Fw@host:5432/db?sslmode=require",  # %-escaped
            "postgresql://user:***@host:5432/db?sslmode=require",
        ),
        ("postgresql://u:pa/ss@host/db", "postgresql://u:***@host/db"),  # a / in the password
        ("postgresql://u:pa?ss@host/db", "postgresql://u:***@host/db"),  # a ? in the password
        ("postgresql://u:p@[::1]:5432/db", "postgresql://u:***@[::1]:5432/db"),
        ("postgresql://u:s3cret@h/db?x=a@b", "postgresql://u:***@h/db?x=a@b"),  # an @ in the query, not the password
        ("http://u:s3cret@h?token=tk&x=1", "http://u:***@h?token=***&x=1"),
        ("see postgresql://u:s3cret@h/db and https://v:p@ss@k/x", "see postgresql://u:***@h/db and https://v:***@k/x"),
        ("postgresql://u@h:5432/db", "postgresql://u@h:5432/db"),
        ("sqlite:///x.db", "sqlite:///x.db"),
    ],
)
def test_a_urls_password_is_hidden_however_spelt_and_its_host_shown(url, show):
    """dbconn.shown, which every message naming a DB or tracking URL and every config copy (`redacted`) uses: the
    password runs to the @ before the host, whatever it holds; nothing else of the URL is hidden."""
    from configs.checks import redacted, shown_value
    from dbconn import shown

    assert shown(url) == show
    assert redacted({"path": url}) == {"path": show}
    assert shown_value("buffer.trainer_input.experience_buffer.path", url) == repr(show)


@pytest.mark.parametrize(
    "key, value",
    [
        ("name", "../../etc"),
        ("name", "/tmp/x"),
        ("name", ".."),
        ("name", "a/../../b"),
        ("name", ""),
        ("name", "a\\b"),
        ("name", "a/b/c"),
        ("project", "../x"),
        ("project", "/abs"),
        ("project", "a/b"),
        ("project", "."),
        ("group", "../g"),
        ("group", "g/h"),
        ("explorer.name", "../e"),
        ("trainer.name", "t/u"),
        ("buffer.trainer_input.experience_buffer.name", "../../db"),
    ],
)
def test_names_that_would_put_the_job_outside_its_root_are_refused_by_name(tmp_path, key, value):
    """project, group and name are folders of <checkpoint_root_dir>/<project>[/<group>]/<name>, and explorer / trainer
    / experience buffer names name its files: `..`, an absolute path or a separator would write elsewhere. Refused
    when the config loads (YAML or command line), naming the key, the value and what is allowed."""
    flag = f"--{key}" if "buffer" not in key else "--buffer.trainer_input.experience_buffer.name"
    with pytest.raises(ConfigError) as e:
        resolve_stages(cli(["--config", write(tmp_path, MINIMAL), flag, value])[0])
    assert f"{key} = {value!r} is refused" in str(e.value) and "allowed: " in str(e.value)
    assert "not . or .., no / or \\" in str(e.value)


def test_names_trinity_uses_are_kept_and_the_job_stays_under_its_root(tmp_path):
    """Names with dots, dashes, spaces and brackets (Trinity-RFT's examples: qwen2.5-1.5b_grpo, <experiment_name>) are
    names to the loader (a template's <placeholder> left unset is the entry points' to refuse:
    test_a_templates_placeholder_left_in_a_name_or_path_is_refused_by_key_and_value); a stage's name is
    <name>/<stage_name> (what the config written for its processes holds), but a stage's name and the name of a run
    with stages are one folder each."""
    job = tmp_path / "ck" / "<project_name>" / "v1.2 (ablation)" / "qwen2.5-1.5b_grpo"
    args = [
        "--checkpoint_root_dir",
        str(tmp_path / "ck"),
        "--project",
        "<project_name>",
        "--group",
        "v1.2 (ablation)",
        "--name",
        "qwen2.5-1.5b_grpo",
    ]
    (stage,) = resolve_stages(cli(["--config", write(tmp_path, MINIMAL), *args])[0])
    assert Path(stage.checkpoint_job_dir) == job
    staged = MINIMAL + "stages:\n  - stage_name: sft\n  - stage_name: rl-v2.1\n"
    stages = resolve_stages(cli(["--config", write(tmp_path, staged), *args])[0])
    assert [Path(st.checkpoint_job_dir) for st in stages] == [job / "sft", job / "rl-v2.1"]
    (child,) = resolve_stages(cli(["--config", write(tmp_path, to_yaml(stages[1]), "child.yaml")])[0])
    assert child == stages[1]  # what the stage's processes load: name qwen2.5-1.5b_grpo/rl-v2.1
    staged = staged.replace("rl-v2.1", "../../rl")
    with pytest.raises(ConfigError, match=re.escape("stages[1].stage_name = '../../rl' is refused")):
        resolve_stages(cli(["--config", write(tmp_path, staged)])[0])
    with pytest.raises(ConfigError, match=r"^name = 'a/b' is refused: .* allowed: one folder name:"):
        resolve_stages(cli(["--config", write(tmp_path, staged.replace("../../rl", "rl")), "--name", "a/b"])[0])


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.temperature", 1e-40),
        ("model.temperature", 0.005),
        ("model.temperature", 1e-3),
        ("buffer.explorer_input.taskset.rollout_args.temperature", 1e-40),
        ("buffer.explorer_input.eval_tasksets[0].rollout_args.temperature", 0.009),
    ],
)
def test_temperatures_below_the_floor_are_refused_when_the_config_loads(tmp_path, key, value):
    """Between 0 (greedy) and 0.01: vLLM samples at 0.01 whatever is asked, the HF engine's logits / 1e-40 overflow
    (every step warned about, nothing trained, exit 0): refused by name, the model's, a taskset's and an eval
    taskset's alike; 0 and 0.01 load."""
    text = MINIMAL + "    eval_tasksets: [{path: data/y}]\n"
    flag, bad = [f"--{key}", str(value)], text
    if "[0]" in key:  # a list's item: set in the YAML
        flag, bad = [], text.replace("[{path: data/y}]", f"[{{path: data/y, rollout_args: {{temperature: {value}}}}}]")
    with pytest.raises(ConfigError) as e:
        resolve_stages(cli(["--config", write(tmp_path, bad), *flag])[0])
    assert str(e.value) == f"{key}: {value!r} is out of range; allowed: 0 (greedy) or >= 0.01"
    for fine in ("0", "0.01"):
        (stage,) = resolve_stages(cli(["--config", write(tmp_path, text), "--model.temperature", fine])[0])
        assert stage.buffer.explorer_input.tasksets[0].rollout_args.temperature == float(fine)


@pytest.mark.parametrize("algorithm", ["on_policy_distill", "jsd"])
def test_a_distillation_preset_without_a_teacher_is_refused_where_an_explorer_runs(tmp_path, algorithm):
    """Its advantages need teacher log-probs, which an auxiliary model writes in the explorer: mode both (or explore)
    without explorer.auxiliary_models is refused by name; a trainer alone (mode train, reading a DB) is not."""
    path = write(tmp_path, MINIMAL + f"algorithm: {{algorithm_type: {algorithm}}}\n")
    with pytest.raises(ConfigError, match=rf"^algorithm.advantage_fn = '{algorithm}' is refused: .*auxiliary_models"):
        resolve_stages(cli(["--config", path])[0])
    (stage,) = resolve_stages(cli(["--config", path, "--mode", "train"])[0])
    assert stage.algorithm.advantage_fn == algorithm and stage.algorithm.kl_loss_fn == "none"
    taught = (
        MINIMAL + f"algorithm: {{algorithm_type: {algorithm}}}\nexplorer: {{auxiliary_models: [{{model_path: t}}]}}\n"
    )
    (stage,) = resolve_stages(cli(["--config", write(tmp_path, taught, "t.yaml")])[0])
    assert stage.explorer.auxiliary_models[0].model_path == "t"


# --- bad input named (issue 13)


@pytest.mark.parametrize(
    "text, says",
    [
        (
            "model:\n  model_path: m\n  model_path: n\n",
            "line 3: key 'model_path' is written twice in one mapping (first at line 2)",
        ),
        ("project: 2024-01-01\n", "project: 2024-01-01 is a date, not a config value; quote it if it is text"),
        ("monitor:\n  monitor_args: {k: !!binary AAE=}\n", "monitor.monitor_args.k: b'\\x00\\x01' is binary data"),
        ("explorer:\n  env_vars: {~: 1}\n", "explorer.env_vars: a key that is null"),
        ("model:\n  model_path: ???\n", "model.model_path is ??? (a mandatory value left unset): set it"),
        ("model: {model_path: '${nope.x}'}\n", "cannot resolve an interpolation: Interpolation key 'nope.x' not found"),
    ],
)
def test_what_yaml_reads_beyond_plain_values_is_named_with_the_file(tmp_path, text, says):
    """Duplicate keys (PyYAML keeps the last silently), dates, binary data, null keys, OmegaConf's ???: each a
    ConfigError naming the file and the key, not "cannot resolve an interpolation" (what OmegaConf said of them)."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value)


def _laughs(width: int, levels: int) -> str:
    """A "billion laughs": each level a list of `width` aliases of the one before (width**levels strings)."""
    text = "l0: &l0 [" + ", ".join(["lol"] * width) + "]\n"
    for i in range(1, levels + 1):
        text += f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]\n"
    return text


@pytest.mark.parametrize(
    "text, says",
    [
        # 10**6 strings from 0.3 KB (today's code builds and walks them all: ~10 s; 9**9 from 551 bytes hung it)
        (_laughs(10, 6), "its aliases (*name) expand it past 100,000 values"),
        ("s: &s " + "x" * 100_000 + "\nl: [" + ", ".join(["*s"] * 200) + "]\n", "or 16,777,216 characters"),
        ("a: &x [1, *x]\n", "line 1: the value anchored here (&name) holds an alias (*name) of itself"),
        ("a:\n  b: &x\n    c: {d: *x}\n", "line 2: the value anchored here (&name) holds an alias (*name) of itself"),
        ("a: " + "[" * 150 + "]" * 150 + "\n", "nested more than 100 levels deep"),
        # the parser's own RecursionError ("nested too deeply"), or with PyYAML 6.0 (the floor) the depth check
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nested "),
    ],
    ids=["billion-laughs", "long-string-aliased", "self-containing-list", "self-containing-map", "deep", "deeper"],
)
def test_yaml_aliases_that_expand_without_bound_or_contain_themselves_are_refused(tmp_path, text, says):
    """Issue 46: 551 bytes of YAML aliases hung the loader, 1.5 KB became a 22 MB config.yaml, and a self-containing
    document was a RecursionError traceback. Each is a ConfigError naming the file, before anything is expanded."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value)


def test_a_config_that_is_a_fifo_a_device_or_too_large_is_named_without_reading_it(tmp_path, monkeypatch):
    """A FIFO blocked the read, /dev/zero never ended it: named, as --config and as a file the config names (read
    with read_yaml: trainer.trainer_config_path), as is a file over loader.MAX_YAML_BYTES."""
    os.mkfifo(tmp_path / "c.fifo")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    for path, says in ((tmp_path / "c.fifo", "a FIFO"), (tmp_path / "zero.yaml", "a device")):
        for read in (read_yaml, lambda p: cli(["--config", str(p)])):
            with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {says}, not a regular file"):
                read(path)
    monkeypatch.setattr(loader, "MAX_YAML_BYTES", 100)
    with pytest.raises(ConfigError, match=r"c.yaml: 130 bytes, over 100; a config is a few KB of YAML"):
        read_yaml(write(tmp_path, "project: " + "x" * 120 + "\n"))


def test_yaml_aliases_within_the_bounds_still_load(tmp_path):
    """What a config uses aliases for (a shared block, a merge key) loads as before, each use its own copy."""
    cfg = read_yaml(write(tmp_path, "a: &x {k: [1, 2]}\nb: *x\nc: {<<: *x, j: 2}\nd: [*x, *x]\n"))
    assert cfg == {"a": {"k": [1, 2]}, "b": {"k": [1, 2]}, "c": {"k": [1, 2], "j": 2}, "d": [{"k": [1, 2]}] * 2}
    assert cfg["a"] is not cfg["b"] and cfg["d"][0] is not cfg["d"][1]


def test_a_merge_key_may_be_overridden_in_yaml(tmp_path):
    """`<<: *anchor` then the same key: YAML's override, not a duplicate."""
    cfg = read_yaml(write(tmp_path, "a: &base {x: 1, y: 2}\nb:\n  <<: *base\n  x: 3\n"))
    assert cfg["b"] == {"x": 3, "y": 2}


# Plain values of every kind a config file holds (tests/test_config_keys.py's mutations among them), in a mapping,
# a list, under number and boolean keys, and one mapping twice through a YAML alias
ODD_VALUES = [None, -1, 0, 0.5, 10**9, 2**40, -1e-3, float("inf"), "x", "", "yes", "a\x00b", "a\\b", "$x", "{a}", True]
ODD_DOC = {"s": {str(i): v for i, v in enumerate(ODD_VALUES)}, "l": [ODD_VALUES, [{}], {}], 1: 2, 1.5: {True: [1]}}


def test_read_yaml_gives_what_pyyaml_and_omegaconf_give(tmp_path):
    """read_yaml's short cuts are exact: libyaml's parser reads what PyYAML's does (every YAML of the repo, and
    odd values as yaml.dump writes them), and where no string holds `${` or `???` the data comes back as OmegaConf
    gives it (fresh containers, an alias's two places not one object) without OmegaConf."""
    texts = [p.read_text() for p in REFERENCE + OURS + sorted((ROOT / "tests/data").rglob("*.yaml"))]
    texts += [yaml.dump(ODD_DOC), yaml.dump(ODD_DOC, Dumper=yaml.CDumper), "a: &x [1, {b: 2}]\nc: *x\n"]
    for text in texts:
        assert yaml.load(text, Loader=loader._CUniqueKeyLoader) == yaml.load(text, Loader=loader._UniqueKeyLoader)
    assert loader._CUniqueKeyLoader.__mro__[2] is getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for text in texts[-3:] + [yaml.dump(read_yaml(p)) for p in REFERENCE + OURS]:
        raw = loader.load_yaml(text)
        assert not loader._omegaconf_reads(raw)
        got = read_yaml(write(tmp_path, text))
        assert repr(got) == repr(OmegaConf.to_container(OmegaConf.create(raw), resolve=True))  # repr: nan, types
    got = read_yaml(write(tmp_path, texts[-1]))  # the alias
    assert got["c"] == got["a"] and got["c"] is not got["a"] and got["c"][1] is not got["a"][1]
    # a string OmegaConf reads otherwise (an interpolation, an escaped one, ???, an escaped ???) goes through it
    for value in ("${oc.env:HOME}", "\\${x}", "???", "\\???", "a???"):
        assert loader._omegaconf_reads({"k": [value]}) and loader._omegaconf_reads({value: 1})


@pytest.mark.parametrize(
    "target, says",
    [
        ("/bin/ls", "/bin/ls: not a text (UTF-8) file: byte 0x"),
        ("/etc", "--config /etc: a directory, not a YAML file"),
        ("/no/such.yaml", "config file not found: /no/such.yaml"),
    ],
)
def test_a_config_that_is_not_a_yaml_file_is_named(target, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        cli(["--config", target])


def test_a_bad_yaml_mapping_on_the_command_line_is_a_usage_error_naming_the_option(tmp_path, capsys):
    for value, says in (
        ("{", "not valid YAML"),
        ("[1]", "expected a YAML/JSON mapping"),
        ("{a: 2024-01-01}", "is a date"),
        ("{a: &x [*x]}", "holds an alias (*name) of itself"),  # issue 46: a RecursionError traceback before
        ("{a: " + "[" * 3000 + "]" * 3000 + "}", "nested too deeply"),
    ):
        with pytest.raises(SystemExit) as e:
            cli(["--config", write(tmp_path, MINIMAL), "--algorithm.kl_loss_fn_args", value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--algorithm.kl_loss_fn_args" in err and says in " ".join(err.split())


def test_derived_fields_set_to_something_else_are_refused_and_the_resolved_config_loads_back(tmp_path):
    for key, value, says in (
        (
            "--checkpoint_job_dir",
            "/tmp/elsewhere",
            "checkpoint_job_dir = '/tmp/elsewhere' is derived from checkpoint_root_dir, project",
        ),
        (
            "--cluster.colocate",
            "true",
            "cluster.colocate = True is derived from mode both on one GPU (here False): leave it unset",
        ),
        ("--cluster.trainer_gpu_num", "7", "cluster.trainer_gpu_num = 7 is derived from"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            resolve_stages(cli(["--config", write(tmp_path, MINIMAL + "cluster: {gpu_per_node: 0}\n"), key, value])[0])
    (stage,) = resolve_stages(cli(["--config", write(tmp_path, MINIMAL + "cluster: {gpu_per_node: 0}\n")])[0])
    again = cli(["--config", write(tmp_path, to_yaml(stage), "resolved.yaml")])[0]  # the derived values, set
    assert again.cluster.colocate is False and resolve_stages(again) == [stage]


def test_verl_trainer_config_on_the_command_line_is_mapped_too(tmp_path, caplog):
    base = write(tmp_path, MINIMAL)
    flag = "--trainer.trainer_config"
    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        cfg, _ = cli(
            [
                "--config",
                base,
                flag,
                "{actor_rollout_ref: {actor: {grad_clip: 0.3, optim: {lr: 2e-6}}}, trainer: {balance_batch: true}}",
            ]
        )
    assert cfg.trainer.grad_clip == 0.3 and cfg.algorithm.optimizer.lr == 2e-6
    assert cfg.trainer.trainer_config == {"trainer": {"balance_batch": True}}  # mapped keys leave it
    assert "trainer.trainer_config.trainer.balance_batch (veRL) has no meaning" in caplog.text
    with pytest.raises(ConfigError, match="out of range"):
        derive(cli(["--config", base, flag, "{actor_rollout_ref: {actor: {optim: {lr: -1}}}}"])[0])
    with pytest.raises(ConfigError, match="maps a key onto trainer.grad_clip = 0.3, and --trainer.grad_clip sets it"):
        cli(["--config", base, "--trainer.grad_clip", "0.5", flag, "{actor_rollout_ref: {actor: {grad_clip: 0.3}}}"])


def test_what_the_launcher_accepts_its_children_accept(tmp_path):
    """A veRL key mapped from the YAML, then the same field on the command line: the stage YAML the launcher
    writes holds the field (the mapped key has left trainer_config), and the child reads it without a conflict;
    'yes' in trainer_config is the same as true."""
    text = MINIMAL + (
        "trainer:\n  gradient_checkpointing: true\n  trainer_config:\n    actor_rollout_ref:\n"
        "      actor: {grad_clip: 1.0}\n      model: {enable_gradient_checkpointing: 'yes'}\n"
    )
    (stage,) = resolve_stages(cli(["--config", write(tmp_path, text), "--trainer.grad_clip", "0.5"])[0])
    assert stage.trainer.grad_clip == 0.5 and stage.trainer.trainer_config == {}
    (child,) = resolve_stages(cli(["--config", write(tmp_path, to_yaml(stage), "stage.yaml")])[0])
    assert child == stage


def test_a_taskset_without_a_workflow_is_warned_at_load_and_refused_when_an_explorer_starts(tmp_path, caplog):

    with caplog.at_level(logging.WARNING, logger="nanorft.config"):
        (cfg,) = resolve_stages(cli(["--config", write(tmp_path, MINIMAL)])[0])
    assert (
        "buffer.explorer_input.taskset.default_workflow_type is empty, as are buffer.default_workflow_type "
        "and buffer.explorer_input.taskset.format.workflow_key"
    ) in caplog.text
    with pytest.raises(ConfigError, match=r"tasksets\[0\] \(taskset_0\): no workflow runs these tasks"):
        check_tasksets(cfg)
    (cfg,) = resolve_stages(
        cli(["--config", write(tmp_path, MINIMAL), "--buffer.default_workflow_type", "math_workflow"])[0]
    )
    check_tasksets(cfg)


# --- the command line: lists and mappings in the YAML's syntax, no --config, placeholders, --help (issue 48)


def test_lists_and_mappings_are_set_on_the_command_line_in_the_yamls_syntax(tmp_path):
    """A list of sections (stages, tasksets: tyro has no option for them), a list of plain values and a mapping take
    the YAML's syntax on the command line, coerced as from a YAML file ('2' -> 2); tyro's own options still apply on
    top, an item's key included, and tyro's spelling of a plain list still works."""
    base = ["--config", write(tmp_path, MINIMAL + "stages:\n  - stage_name: a\n")]
    assert cli([*base, "--stages", "[]"])[0].stages == []  # a smoke run of a staged YAML without copying it
    cfg, _ = cli(
        [
            *base,
            "--stages",
            "[{stage_name: sft, mode: train}, {stage_name: rl, algorithm: {algorithm_type: grpo}}]",
            "--buffer.explorer_input.eval_tasksets=[{name: t, path: data/t, repeat_times: '2'}]",
            "--buffer.explorer_input.eval_tasksets.0.split",
            "test",
            "--explorer.env_vars",
            "{A: 1}",
            "--monitor.monitor_type",
            "[tensorboard, mlflow]",
            "--algorithm.optimizer.betas",
            "0.8",
            "0.9",
        ]
    )
    assert [(s.stage_name, s.mode) for s in cfg.stages] == [("sft", "train"), ("rl", "")]
    assert cfg.stages[1].algorithm == {"algorithm_type": "grpo"}
    (ts,) = cfg.buffer.explorer_input.eval_tasksets
    assert (ts.name, ts.path, ts.repeat_times, ts.split) == ("t", "data/t", 2, "test")
    assert cfg.explorer.env_vars == {"A": "1"} and cfg.monitor.monitor_type == ["tensorboard", "mlflow"]
    assert cfg.algorithm.optimizer.betas == [0.8, 0.9]
    assert [st.name for st in resolve_stages(cli([*base, "--stages", "[{stage_name: x}, {stage_name: y}]"])[0])] == [
        "rft/x",
        "rft/y",
    ]


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--stages", "[{stage_nam: x}]", "stages[0].stage_nam: unknown key; did you mean stage_name?"),
        ("--stages", "{stage_name: x}", "stages: expected a list, got {'stage_name': 'x'}"),
        ("--stages", "[{stage_name: x", "--stages: not valid YAML"),
        ("--stages", "[2024-01-01]", "--stages: [0]: 2024-01-01 is a date"),
        (
            "--model.lora_configs",
            "[{lora_rnk: 8}]",
            "model.lora_configs[0].lora_rnk: unknown key; did you mean lora_rank?",
        ),
        (
            "--buffer.explorer_input.eval_tasksets",
            "[{path: p, repeat_times: many}]",
            "buffer.explorer_input.eval_tasksets[0].repeat_times: 'many' is not a valid int",
        ),
        (
            "--buffer.trainer_input.auxiliary_buffers",
            "{sft: {storage_typ: file}}",
            "buffer.trainer_input.auxiliary_buffers.sft.storage_typ: unknown key; did you mean storage_type?",
        ),
        ("--monitor.monitor_type", "[tensorbord]", "monitor.monitor_type[0]: 'tensorbord' is not one of"),
    ],
)
def test_a_bad_list_or_mapping_on_the_command_line_is_named_by_its_key(tmp_path, option, value, message):
    with pytest.raises(ConfigError) as e:
        cli(["--config", write(tmp_path, MINIMAL), option, value])
    assert message in str(e.value)


def test_no_config_is_named_as_such(capsys):
    """No --config (and no model path): the error says so, not that model.model_path is required."""
    with pytest.raises(SystemExit) as e:
        configs.entry(["--mode", "train"], "d")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("config error: no --config given; pass --config FILE.yaml")
    assert "model_path is required" not in err
    assert cli(["--model.model_path", "m"])[0].model.model_path == "m"  # a config given whole on the command line


@pytest.mark.parametrize(
    "option, value, key",
    [
        ("--project", "<project_name>", "project"),
        ("--name", "<experiment_name>", "name"),
        ("--checkpoint_root_dir", "<your dir>", "checkpoint_root_dir"),
        ("--model.model_path", "/models/<model_name>", "model.model_path"),
        ("--buffer.explorer_input.taskset.path", "<path to gsm8k>", "buffer.explorer_input.taskset.path"),
        ("--stages", "[{stage_name: a, model: {model_path: <sft_output>}}]", "stages[0].model.model_path"),
    ],
)
def test_a_templates_placeholder_left_in_a_name_or_path_is_refused_by_key_and_value(
    tmp_path, capsys, option, value, key
):
    """Trinity-RFT's examples leave `<project_name>` and the like to fill in: left so, the entry points refuse them
    (--dry-run too) instead of making a folder `<project_name>`. A `<...>` in free-form text is not theirs to judge."""
    text = MINIMAL.replace("path: data/x", "path: data/x\n      workflow_args: {hint: <think> tags}")
    with pytest.raises(SystemExit) as e:
        configs.entry(["--config", write(tmp_path, text), option, value, "--dry-run"], "d")
    err = capsys.readouterr().err
    shown = value if not value.startswith("[") else "<sft_output>"
    assert e.value.code == 2 and f"config error: {key} = {shown!r}: " in err, err
    assert "a template's placeholder left unset" in err
    with pytest.raises(SystemExit) as e:
        configs.entry(["--config", write(tmp_path, text), "--dry-run"], "d")
    assert e.value.code == 0 and "<think> tags" in capsys.readouterr().out


def test_every_placeholder_left_is_named_at_once(tmp_path, capsys):
    """Trinity's gsm8k.yaml leaves both `project: <project_name>` and `name: <experiment_name>`: one run names both,
    not one per try."""
    with pytest.raises(SystemExit) as e:
        configs.entry(
            ["--config", write(tmp_path, MINIMAL), "--project", "<project_name>", "--name", "<experiment_name>"], "d"
        )
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "project = '<project_name>': " in err and "name = '<experiment_name>': " in err, err


HELP_OPTIONS = ["--config FILE", "--dry-run", "--verify-sync", "--debug", "--task N", "--taskset NAME", "--stage NAME"]


@pytest.mark.parametrize("script", ["train.py", "explore.py", "launch.py"])
def test_help_answers_without_torch_and_lists_the_scripts_own_options(script):
    """`python SCRIPT --help` imports no torch, transformers or vLLM (they took ~5 s before argv was parsed), and its
    table shows the options the scripts read themselves, with which script takes them, and the lists of sections.
    NOTE: a fresh interpreter, not the harness's (run_entry forks from a server that has torch loaded): the cold start
    is what is under test. The bound is on the process's CPU time, which other work on the machine does not stretch
    (wall time did: 6.1-6.6 s against 5 under a full suite beside other tests); the import check is exact."""
    probe = (
        "import json, runpy, sys, time; t = time.process_time(); sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "heavy = sorted({'torch', 'transformers', 'vllm'} & set(sys.modules))\n"
        "print('PROBE' + json.dumps([code, heavy, time.process_time() - t]), file=sys.stderr)\n"
    )
    env = {**os.environ, "COLUMNS": "120"}  # one column (test_help_lists_every_field_with_its_docstring)
    out = subprocess.run([sys.executable, "-c", probe, script], cwd=ROOT, env=env, capture_output=True, text=True)
    code, heavy, seconds = json.loads(out.stderr.split("PROBE")[-1])
    assert code in (0, None) and heavy == [], out.stderr
    assert seconds < 5, seconds
    for option in HELP_OPTIONS + ["--reply TEXT", "--full-rows", "--stages YAML"]:
        assert re.search(re.escape(option) + r"\s", out.stdout), option
    flat = re.sub(r"[│\s]+", " ", out.stdout)  # the table's text, its box and line breaks left out
    assert "--verify-sync launch.py, run.sh: before the run" in flat
    assert "--reply TEXT explore.py --debug: a canned response played instead of the model's, one per turn" in flat
    assert "--buffer.explorer_input.eval_tasksets YAML The whole buffer.explorer_input.eval_tasksets as a YAML" in flat
