"""Whole experiments through the launcher as a user runs them (real processes): stages (bench, SFT in
train mode, GRPO in mode both) with checkpoint sync, mode both with process-group sync, a failing
process stopping the others, what a person sees on a terminal, and two "nodes" on loopback (cluster.node_num 2)."""

import fcntl
import json
import logging
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from buffer import ExperienceDB
from conftest import plain_logprobs, write_yaml
from models import load_model
from monitor import read_history

ROOT = Path(__file__).resolve().parents[1]


def both_config(tmp_path: Path, tiny_model_dir: str, **over) -> Path:
    data = Path(tiny_model_dir).parent / "arith"
    fmt = {"prompt_key": "question", "response_key": "answer"}
    cfg = {
        "project": "p",
        "name": "run",
        "mode": "both",
        "checkpoint_root_dir": str(tmp_path / "ck"),
        # an entropy bonus: the weights move every step even when every group's rewards are equal
        "algorithm": {
            "algorithm_type": "grpo",
            "repeat_times": 2,
            "optimizer": {"lr": 1e-3},
            "entropy_loss_fn_args": {"entropy_coef": 0.01},
        },
        "model": {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 12},
        "buffer": {
            "batch_size": 2,
            "total_steps": 3,
            "default_workflow_type": "math_workflow",
            "default_reward_fn_type": "math_reward",
            "explorer_input": {
                "taskset": {"name": "arith", "path": str(data), "split": "train", "format": fmt},
                "eval_tasksets": [
                    {
                        "name": "arith_test",
                        "path": str(data),
                        "split": "test",
                        "format": fmt,
                        "rollout_args": {"temperature": 0.0},
                    }
                ],
            },
            "trainer_input": {"experience_buffer": {"name": "exp", "max_read_timeout": 120}},
        },
        "explorer": {"runner_per_model": 4, "eval_interval": 2, "rollout_model": {"engine_type": "hf"}},
        "synchronizer": {"sync_method": "checkpoint", "sync_interval": 1, "sync_timeout": 120},
        "trainer": {"save_interval": 0},
        "monitor": {"monitor_type": "none"},
    }
    return write_yaml(tmp_path / "run.yaml", cfg, over)


def launch(
    config: Path, *args: str, script: str = "launch.py", timeout: float = 400, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, "--config", str(config), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def versions_by_step(db: Path | str) -> list[int]:
    """The model version of each experience, in DB order (`db`: a SQLite file or a DB URL)."""
    with ExperienceDB(db if isinstance(db, str) else f"sqlite:///{db}") as d:
        rows = d.query("SELECT id, model_version FROM experiences ORDER BY id")
    return [v for _, v in rows]


def rollout_logprob_gap(db: Path | str, version: int, weights: Path) -> float:
    """Largest |rollout log-prob - log-prob under `weights`| over the experiences of `version`: the
    engine's weights at rollout time were `weights` iff this is float rounding (~1e-6)."""
    model = load_model(str(weights))
    with ExperienceDB(db if isinstance(db, str) else f"sqlite:///{db}") as d:
        ids = [i for (i,) in d.query("SELECT id FROM experiences WHERE model_version = ?", (version,))]
        exps = d.get(ids)
    assert exps
    return max((plain_logprobs(model, x.tokens, x.prompt_length) - x.logprobs).abs().max().item() for x in exps)


def test_stages_bench_sft_then_grpo_with_checkpoint_sync(tmp_path, tiny_model_dir):
    data = Path(tiny_model_dir).parent / "arith"
    config = both_config(
        tmp_path,
        tiny_model_dir,
        stages=[
            {"stage_name": "eval_base", "mode": "bench"},
            {
                "stage_name": "sft",
                "mode": "train",
                "algorithm": {"algorithm_type": "sft"},
                "buffer": {
                    "train_batch_size": 4,
                    "total_steps": 2,
                    "trainer_input": {
                        "experience_buffer": {
                            "name": "sft",
                            "storage_type": "file",
                            "path": str(data / "sft.jsonl"),
                            "format": {"prompt_type": "messages"},
                        }
                    },
                },
            },
            {"stage_name": "rft", "trainer": {"save_interval": 1}},
        ],
    )  # checkpoints: step 1's weights are kept
    out = launch(config)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "ck" / "p" / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "reward_accuracy.png").stat().st_size > 1000
    assert str(run / "summary.json") in out.stdout
    for key in ("accuracy_before_sft", "accuracy_after_sft", "accuracy_after_rft"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["steps"] == 5 and summary["wall_seconds"] > 0
    assert summary["checkpoint"] == str(run / "rft" / "global_step_3" / "actor" / "huggingface")
    stages = [e["stage"] for e in summary["eval_history"]]
    assert stages[0] == "run/eval_base" and stages[-1] == "run/rft" and "run/sft" not in stages
    assert [e["step"] for e in summary["eval_history"] if e["stage"] == "run/rft"] == [0, 2, 3]
    # the GRPO stage started from the SFT stage's weights, in both processes
    rft_cfg = (run / "rft" / "config.yaml").read_text()
    assert str(run / "sft" / "global_step_2" / "actor" / "huggingface") in rft_cfg
    # on-policy: the experiences of explore step s were generated by the weights of train step s - 1
    assert versions_by_step(run / "rft" / "buffer" / "exp.db") == [0] * 4 + [1] * 4 + [2] * 4
    # after the sync the engine held exactly the trainer's step-1 weights: the rollout log-probs of
    # version 1 match them to float rounding, and not the weights it started from
    db = run / "rft" / "buffer" / "exp.db"
    assert rollout_logprob_gap(db, 1, run / "rft" / "global_step_1" / "actor" / "huggingface") < 1e-4
    assert rollout_logprob_gap(db, 1, run / "sft" / "global_step_2" / "actor" / "huggingface") > 1e-3
    trainer = read_history(run / "rft" / "monitor" / "trainer.jsonl")
    assert [r["step"] for r in trainer] == [1, 2, 3] and all(r["batch/staleness/max"] == 0 for r in trainer)
    # every stage's processes and the launcher wrote their log files (bench: <explorer name>_bench)
    bench_log = (run / "eval_base/log/explorer_bench.log").read_text()
    assert "[explorer_bench] bench step 0: arith_test accuracy " in bench_log
    assert "stage run/sft: mode train" in (run / "sft/log/launch.log").read_text()
    assert "[trainer] step 2 actor/" in (run / "sft/log/trainer.log").read_text()


def test_a_stage_starts_from_the_weights_of_the_stage_its_start_from_names(tmp_path, tiny_model_dir):
    """stages [sft, control, rft (start_from: sft)]: control starts from sft's weights as the previous stage, and so
    does rft, not from the control's; a start_from naming no earlier stage is refused by name."""
    import launch
    import sync
    from configs import ConfigError, cli

    stages = [{"stage_name": "sft"}, {"stage_name": "control"}, {"stage_name": "rft", "start_from": "sft"}]
    cfg, _ = cli(["--config", str(both_config(tmp_path, tiny_model_dir, stages=stages))])
    run = tmp_path / "ck" / "p" / "run"
    started = {}
    for stage in launch.stages_in_order(cfg):  # each stage "publishes" step 3 before the next one is resolved
        started[stage.name] = stage.model.model_path
        sync.weights_path(stage.checkpoint_job_dir, 3).mkdir(parents=True)
        sync.set_latest(stage.checkpoint_job_dir, 3)
    sft = str(sync.weights_path(run / "sft", 3))
    assert started == {"run/sft": tiny_model_dir, "run/control": sft, "run/rft": sft}
    stages[2]["start_from"] = "rft"
    with pytest.raises(ConfigError, match=r"stages\[2\].start_from 'rft' is not an earlier stage's name"):
        list(launch.stages_in_order(cli(["--config", str(both_config(tmp_path, tiny_model_dir, stages=stages))])[0]))


def test_a_later_stage_whose_rollout_model_names_the_model_runs(tmp_path, tiny_model_dir):
    """explorer.rollout_model.model_path set to model.model_path (allowed: the same model): a later stage starts from
    the earlier stage's weights, and its processes, reading the config.yaml the launcher writes, accept it and serve
    those weights (they refused it: the rollout model named the old model.model_path)."""
    import configs
    import launch
    import sync
    from configs import cli, from_dict, normalize, read_yaml, to_yaml

    stages = [{"stage_name": "sft", "mode": "train"}, {"stage_name": "rft"}]
    config = both_config(
        tmp_path, tiny_model_dir, stages=stages, **{"explorer.rollout_model.model_path": tiny_model_dir}
    )
    seen = []
    for stage in launch.stages_in_order(cli(["--config", str(config)])[0]):
        sync.weights_path(stage.checkpoint_job_dir, 3).mkdir(parents=True)
        sync.set_latest(stage.checkpoint_job_dir, 3)
        (tmp_path / "child.yaml").write_text(to_yaml(stage))  # what run_stage writes and each child loads
        child = configs.derive(from_dict(configs.Config, normalize(read_yaml(tmp_path / "child.yaml"))))
        assert child == stage
        seen.append(child.model.model_path)
    assert seen == [tiny_model_dir, str(sync.weights_path(tmp_path / "ck" / "p" / "run" / "sft", 3))]


def test_a_stage_an_error_ends_leaves_no_mlflow_run_running(tmp_path, tiny_model_dir, monkeypatch):
    """run_in_process (how train.py and explore.py run their stages): a stage that raises after opening its monitor
    (a traceback, or a named error) ends its mlflow run FAILED; one that closes its monitor itself keeps its status
    (FINISHED)."""
    from test_train import mlflow_runs

    import configs
    import launch
    from monitor import Monitor

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def runner(error: BaseException | None):
        def run(stage: configs.Config) -> int:
            monitor = Monitor(stage, role=f"{type(error).__name__}")
            if error is not None:
                raise error
            monitor.close()
            return 0

        return run

    cfg = configs.cli(["--config", str(both_config(tmp_path, tiny_model_dir, **{"monitor.monitor_type": "mlflow"}))])[0]
    with pytest.raises(RuntimeError, match="boom"):
        launch.run_in_process(cfg, {"both": runner(RuntimeError("boom"))}, "trainer")
    assert launch.run_in_process(cfg, {"both": runner(launch.DataError("bad row"))}, "trainer") == 2
    assert launch.run_in_process(cfg, {"both": runner(None)}, "trainer") == 0
    assert mlflow_runs(uri) == {"run_RuntimeError": "FAILED", "run_DataError": "FAILED", "run_NoneType": "FINISHED"}


def test_a_monitor_that_fails_to_close_leaves_the_stage_result_and_the_other_monitors(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    """run_in_process after a stage that a named error ended: one monitor's close raising (the tracking server
    gone) is a warning; the stage still returns its exit code 2 (not a traceback) and the other monitor's run ends
    FAILED (before, the exception replaced the result and the loop stopped)."""
    from test_train import mlflow_runs

    import configs
    import launch
    from monitor import Monitor

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def run(stage: configs.Config) -> int:
        broken = Monitor(stage, role="broken")
        broken.mlflow.close = lambda failed=False: (_ for _ in ()).throw(ConnectionError("server gone"))
        Monitor(stage, role="other")
        raise launch.DataError("bad row")

    cfg = configs.cli(["--config", str(both_config(tmp_path, tiny_model_dir, **{"monitor.monitor_type": "mlflow"}))])[0]
    logger = logging.getLogger("nanorft.monitor")  # NOTE: directly: a console made earlier may stop propagation
    logger.addHandler(caplog.handler)
    try:
        assert launch.run_in_process(cfg, {"both": run}, "trainer") == 2
    finally:
        logger.removeHandler(caplog.handler)
    assert mlflow_runs(uri) == {"run_broken": "RUNNING", "run_other": "FAILED"}
    assert "could not close the broken monitor: server gone" in caplog.text


def test_a_failed_stage_ends_the_mlflow_runs_of_the_processes_the_launcher_stopped(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Mode both, the trainer fails while the explorer runs: the launcher stops the explorer (SIGTERM), which dies
    without closing its monitor; its mlflow run ends FAILED all the same (launch.run_stage: monitor.fail_left_runs;
    it stayed RUNNING). A run of an earlier stage still RUNNING (another launcher's) is left alone."""
    from mlflow.tracking import MlflowClient

    import configs
    import launch

    uri, flag = (tmp_path / "mlruns").as_uri(), tmp_path / "explorer_up"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (stage,) = configs.resolve_stages(
        configs.cli(["--config", str(both_config(tmp_path, tiny_model_dir, **{"monitor.monitor_type": "mlflow"}))])[0]
    )
    client = MlflowClient(uri)
    experiment = client.create_experiment("p")
    old = client.create_run(experiment, run_name="run_explorer").info.run_id  # another launcher's: not the stage's
    explorer = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); import configs; from monitor import Monitor; "
        "(s,) = configs.resolve_stages(configs.cli(['--config', sys.argv[2]])[0]); "
        "Monitor(s, role=s.explorer.name); open(sys.argv[3], 'w').close(); time.sleep(600)"
    )
    trainer = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.1)\nsys.exit(1)"
    monkeypatch.setattr(
        launch,
        "commands",
        lambda stage, config_file: {
            "explorer": ([sys.executable, "-c", explorer, str(ROOT), str(config_file), str(flag)], {}),
            "trainer": ([sys.executable, "-c", trainer, str(flag)], {}),
        },
    )
    time.sleep(0.01)  # NOTE: mlflow's start times are in ms: the stage starts after that run
    assert launch.run_stage(stage, "") == 1
    runs = {r.info.run_id: (r.info.run_name, r.info.status) for r in client.search_runs([experiment])}
    assert runs.pop(old) == ("run_explorer", "RUNNING")
    assert list(runs.values()) == [("run_explorer", "FAILED")]


def test_the_launcher_resolves_the_stages_once(tmp_path, tiny_model_dir, monkeypatch):
    """launch.run checks every stage, prepares mlflow and runs the stages in order from one resolve_stages (it
    resolved every stage four times)."""
    import configs
    import launch

    calls, ran, real = [], [], configs.resolve_stages
    monkeypatch.setattr(configs, "resolve_stages", lambda cfg: calls.append(1) or real(cfg))
    monkeypatch.setattr(
        launch,
        "run_stage",
        lambda stage, side: Path(stage.checkpoint_job_dir).mkdir(parents=True) or ran.append(stage.name) or 0,
    )
    monkeypatch.setattr(launch.signal, "signal", lambda *a: None)  # run() turns SIGTERM into KeyboardInterrupt
    stages = [{"stage_name": "sft", "mode": "train"}, {"stage_name": "rft"}]
    assert launch.run(configs.cli(["--config", str(both_config(tmp_path, tiny_model_dir, stages=stages))])[0]) == 0
    assert ran == ["run/sft", "run/rft"] and len(calls) == 1


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_mode_both_with_process_group_sync(tmp_path, tiny_model_dir, backend, request):
    run = tmp_path / "ck" / "p" / "run"
    db = (
        f"sqlite:///{run / 'buffer' / 'exp.db'}"
        if backend == "sqlite"
        else request.getfixturevalue("postgres").database()
    )
    over = {"synchronizer.sync_method": "nccl", "trainer.save_interval": 2}
    if backend == "postgresql":
        over["buffer.trainer_input.experience_buffer.path"] = db
    config = both_config(tmp_path, tiny_model_dir, **over)
    out = launch(config, script="train.py")  # the other documented way in: train.py hands over to the launcher
    assert out.returncode == 0, out.stderr[-4000:]
    assert versions_by_step(db) == [0] * 4 + [1] * 4 + [2] * 4
    explorer = read_history(run / "monitor" / "explorer.jsonl")
    assert [r["rollout/model_version"] for r in explorer if "rollout/model_version" in r] == [0, 1, 2]
    # no files moved the weights during the run: the state-dict pointer moved once, to the final step;
    # step 2 is the save_interval checkpoint, and the engine held exactly those weights for explore step 3
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (run / "latest_state_dict_iteration.txt").read_text().strip() == "3"
    assert rollout_logprob_gap(db, 2, run / "global_step_2" / "actor" / "huggingface") < 1e-4
    assert rollout_logprob_gap(db, 2, Path(tiny_model_dir)) > 1e-3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["accuracy_before_sft"] is None and 0.0 <= summary["accuracy_after_rft"] <= 1.0
    # per-role log files: every record and the full metric lines; the console: short lines (issue 13)
    logs = {role: (run / "log" / f"{role}.log").read_text() for role in ("launch", "trainer", "explorer")}
    assert "stage run: mode both" in logs["launch"] and "trainer finished" in logs["launch"]
    assert re.search(r"\[trainer\] step 3 actor/\S+=\S+ .*perf/throughput=\S+ ", logs["trainer"])
    assert "[trainer] step 3/3 " in logs["trainer"] and "[trainer] step 3/3 " in out.stderr
    assert re.search(r"\[explorer\] eval step 2: arith_test accuracy \d\.\d{3}\n", logs["explorer"])
    assert "[explorer] eval step 2: arith_test accuracy " in out.stderr and "rollout/reward/mean=" not in out.stderr
    steps = [line for line in out.stderr.splitlines() if "] step " in line]
    assert len(steps) >= 6 and max(map(len, steps)) <= 120, steps


def test_a_failing_trainer_stops_the_explorer(tmp_path, tiny_model_dir):
    """The trainer fails at set-up (PPO's critic model does not exist; the explorer does not load it); the
    explorer, waiting for weights, is stopped by the launcher long before its 120 s sync timeout, and the exit
    code is non-zero. An invalid loss argument never gets that far: the config refuses it before any start."""
    bad = both_config(tmp_path / "bad", tiny_model_dir, **{"algorithm.policy_loss_fn_args": {"clip_ratio_c": 0.5}})
    out = launch(bad)
    assert out.returncode == 2 and out.stderr.strip() == (
        "config error: algorithm.policy_loss_fn_args.clip_ratio_c: 0.5 is out of range; allowed: > 1"
    )
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{"algorithm.algorithm_type": "ppo", "model.critic_model_path": str(tmp_path / "no_such_critic")},
    )
    start = time.monotonic()
    out = launch(config)
    assert out.returncode != 0
    assert time.monotonic() - start < 100
    assert "trainer failed" in out.stderr and "stopping explorer" in out.stderr
    assert "no_such_critic" in out.stderr
    assert "could not draw the plot" not in out.stderr and "\nplot:    " in out.stdout


def test_the_plot_is_drawn_from_what_the_run_recorded_and_skipped_when_nothing_was(tmp_path):
    import launch as launcher

    empty = {
        "reward_history": [],
        "eval_history": [],
        "config": "c",
        "accuracy_before_sft": None,
        "accuracy_after_sft": None,
        "accuracy_after_rft": None,
    }
    assert launcher.plot(empty, tmp_path / "a.png") is False and not (tmp_path / "a.png").exists()
    some = empty | {"eval_history": [{"global_step": 0, "accuracy": 0.25}, {"global_step": 10, "accuracy": 0.5}]}
    assert launcher.plot(some, tmp_path / "b.png") is True and (tmp_path / "b.png").stat().st_size > 1000


def on_a_terminal(cmd: list[str], timeout: float = 400) -> tuple[int, str]:
    """Run `cmd` with stdin/stdout/stderr on a pseudo-terminal of 120 x 40, as in a person's shell; (exit code,
    everything it showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    p = subprocess.Popen(cmd, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 1.0)[0]:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # the other side closed: the process is gone
                break
            if not chunk:
                break
            shown += chunk
    os.close(master)
    p.kill()
    return p.wait(), shown.decode("utf-8", errors="replace")


def test_mode_both_on_one_gpu_colocates_the_hf_engine(tmp_path, tiny_model_dir):
    """cluster.gpu_per_node 1: explorer and trainer share the GPU (here the CPU: the engine's sleep moves nothing);
    the engine sleeps before every sync point and the weights come over the group through host memory."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{"synchronizer.sync_method": "nccl", "trainer.save_interval": 2, "cluster": {"gpu_per_node": 1}},
    )
    out = launch(config, env={"NANORFT_LAUNCHED": "1"})  # a pretend GPU: the pre-flight would (rightly) refuse it
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "ck" / "p" / "run"
    assert "colocate: true" in (run / "config.yaml").read_text()
    log = (run / "log" / "explorer.log").read_text()
    assert [s for s in (1, 2, 3) if f"step {s}: the engine sleeps while the trainer" in log] == [1, 2]
    assert versions_by_step(run / "buffer" / "exp.db") == [0] * 4 + [1] * 4 + [2] * 4
    assert rollout_logprob_gap(run / "buffer" / "exp.db", 2, run / "global_step_2" / "actor" / "huggingface") < 1e-4


def test_on_a_terminal_a_progress_bar_per_process_and_no_chatter(tmp_path, tiny_model_dir):
    config = both_config(tmp_path, tiny_model_dir)
    code, shown = on_a_terminal([sys.executable, "launch.py", "--config", str(config)])
    assert code == 0, shown[-4000:]
    # the launcher draws both processes' bars from their histories: step/total, the numbers watched, the rate
    assert re.search(r"\rtrainer: 100%\|[^|]*\| 3/3 \[[^]]*s/step, reward \S+ loss \S+ tok/s \S+ s/step", shown), shown
    assert re.search(r"\rexplorer: 100%\|[^|]*\| 3/3 \[[^]]*, reward \S+ acc \S+ tok/s", shown), shown
    assert "[explorer] eval step 2: arith_test accuracy " in shown  # a line at each evaluation, above the bars
    assert re.search(
        r"stage run finished in \d+ s: trainer step 3: .*; explorer step 3: .*; last eval arith_test "
        r"accuracy \d\.\d{3}",
        shown,
    )
    # the processes' own INFO records and per-step lines go to their log files only
    assert "nanorft.explore" not in shown and "nanorft.train" not in shown and "] step 1/3" not in shown, shown
    run = tmp_path / "ck" / "p" / "run"
    assert "INFO nanorft.explore: " in (run / "log" / "explorer.log").read_text()
    assert "[trainer] step 1/3 " in (run / "log" / "trainer.log").read_text()
    # step 1's published weights were deleted once step 3's came (no checkpoint there, no explorer to load them)
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2", "global_step_3"]


AUX_WORKFLOW = '''
from workflows import Workflow, apply_reward


class AskTheJudge(Workflow):
    """The policy answers; the auxiliary model (a second engine in the explorer) is asked about each answer."""

    def run(self):
        exps = self.model.chat([{"role": "user", "content": self.task.prompt}], n=self.task.repeat_times)
        (name,) = self.auxiliary_models
        for e in exps:
            (said,) = self.auxiliary_models[name].chat([{"role": "user", "content": e.response_text}], max_tokens=4)
            apply_reward(e, {"aux_tokens": float(said.response_length), "aux_is_" + name.replace("-", "_"): 1.0})
        return exps
'''


def test_auxiliary_models_run_in_the_explorer_and_reach_workflows_by_name(tmp_path, tiny_model_dir):
    (tmp_path / "aux_flow.py").write_text(AUX_WORKFLOW)
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "buffer.default_workflow_type": f"{tmp_path / 'aux_flow.py'}:AskTheJudge",
            "buffer.total_steps": 2,
            "explorer.auxiliary_models": [{"model_path": tiny_model_dir, "engine_type": "hf"}],
            "buffer.explorer_input.eval_tasksets": [],
        },
    )
    out = launch(config)
    assert out.returncode == 0, out.stderr[-4000:]
    run = tmp_path / "ck" / "p" / "run"
    with ExperienceDB(f"sqlite:///{run / 'buffer' / 'exp.db'}") as db:
        metrics = [json.loads(m)["metrics"] for (m,) in db.query("SELECT meta FROM payloads")]
    assert len(metrics) == 8 and all(m["aux_is_tiny_qwen2"] == 1.0 and 1 <= m["aux_tokens"] <= 4 for m in metrics)
    assert (run / "log" / "explorer.log").read_text().count("rollout engine: HF on cpu") == 2


# --- several nodes: two "nodes" on this machine, rendezvousing on 127.0.0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(config: Path, out: Path, timeout: float = 300) -> tuple[int, str, subprocess.CompletedProcess]:
    """`python launch.py --config CONFIG` as node 0 (output to files under `out`), then the line it prints for
    node 1, run as printed by bash. Returns (the launcher's exit code, its stderr, node 1's process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "node0.out", "w") as stdout, open(out / "node0.err", "w") as stderr:
        node0 = subprocess.Popen(
            [sys.executable, "launch.py", "--config", str(config)], cwd=ROOT, env=env, stdout=stdout, stderr=stderr
        )
    deadline, line = time.monotonic() + 120, None
    while line is None and node0.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        line = next(
            (
                x.removeprefix("  node 1: ")
                for x in (out / "node0.err").read_text().splitlines()
                if x.startswith("  node 1: ")
            ),
            None,
        )
    try:
        assert line is not None, (out / "node0.err").read_text()[-3000:]
        node1 = subprocess.run(["bash", "-c", line], cwd="/", env=env, capture_output=True, text=True, timeout=timeout)
        code = node0.wait(timeout=timeout)
    finally:
        if node0.poll() is None:
            node0.kill()
    return code, (out / "node0.err").read_text(), node1


def test_two_nodes_train_as_one_node_of_the_same_world_size(tmp_path, tiny_model_dir):
    """cluster.node_num 2 (one CPU rank per node): the launcher on node 0 prints the line for node 1 once; run as
    printed (from another directory), it joins, and the two SFT steps end at exactly the weights of one torchrun of
    two ranks on one node."""
    from test_train import run_train, sft_config, weights

    port = free_port()
    config = sft_config(
        tmp_path / "nodes", tiny_model_dir, **{"cluster": {"node_num": 2, "gpu_per_node": 0, "master_port": port}}
    )
    code, err, node1 = two_nodes(config, tmp_path / "out")
    assert code == 0 and node1.returncode == 0, err[-3000:] + node1.stderr[-3000:]
    assert (
        err.count("  node 1: ") == 1
        and f"--nnodes=2 --node-rank=1 --nproc-per-node=1 --rdzv-backend=static --rdzv-endpoint=127.0.0.1:{port} "
        in err
    )
    job = tmp_path / "nodes" / "ck" / "p" / "t"
    assert "trainer: 2 rank(s) on cpu" in (job / "log" / "trainer.log").read_text()
    one = run_train(sft_config(tmp_path / "one", tiny_model_dir), ranks=2)
    assert one.returncode == 0, one.stderr[-3000:]
    start = safetensors.torch.load_file(Path(tiny_model_dir) / "model.safetensors")
    apart, together = weights(job, 2), weights(tmp_path / "one" / "ck" / "p" / "t", 2)
    assert all(torch.equal(apart[k], together[k]) for k in start)
    assert max((apart[k] - start[k]).abs().max().item() for k in start) > 1e-3  # and they moved


def test_two_nodes_in_mode_both_with_process_group_sync(tmp_path, tiny_model_dir):
    """On the CPU, node 0 runs the explorer beside trainer rank 0 (the DB and the weight store stay on one host),
    node 1 the second trainer rank: on-policy GRPO gets every step's weights over the group."""
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "synchronizer.sync_method": "nccl",
            "cluster": {"node_num": 2, "gpu_per_node": 0, "master_port": free_port()},
        },
    )
    code, err, node1 = two_nodes(config, tmp_path / "out")
    assert code == 0 and node1.returncode == 0, err[-3000:] + node1.stderr[-3000:]
    run = tmp_path / "ck" / "p" / "run"
    assert versions_by_step(run / "buffer" / "exp.db") == [0] * 4 + [1] * 4 + [2] * 4
    trainer = (run / "log" / "trainer.log").read_text()
    assert "trainer: 2 rank(s) on cpu" in trainer and "weight sync: gloo group served on 127.0.0.1:" in trainer
    assert json.loads((run / "summary.json").read_text())["exit_code"] == 0


def test_a_stage_config_is_written_for_its_owner_only_whatever_it_holds(tmp_path):
    """The config the processes read holds the real secrets, and which values are secret no name pattern knows
    (an env var DB_PASS, a monitor_args key of wandb's own): launch.write_stage_config makes it 0600 always, a new
    file (under a permissive umask) and one an earlier run left world-readable, with the stage's config in it."""
    from configs import cli, resolve_stages
    from launch import write_stage_config

    config = write_yaml(
        tmp_path / "c.yaml",
        {
            "model": {"model_path": "some/model", "max_model_len": 256},
            "buffer": {"batch_size": 4, "explorer_input": {"taskset": {"path": "data/x"}}},
            "explorer": {"env_vars": {"DB_PASS": "dbp-2"}},
            "monitor": {"monitor_args": {"session": "sess-9"}},
        },
        {},
    )
    (stage,) = resolve_stages(cli(["--config", str(config)])[0])
    old = tmp_path / "old.yaml"
    old.write_text("explorer: {env_vars: {DB_PASS: earlier}}\n" * 100)
    old.chmod(0o644)
    umask = os.umask(0)
    try:
        written = [write_stage_config(stage, tmp_path / "new.yaml"), write_stage_config(stage, old)]
    finally:
        os.umask(umask)
    for path in written:
        assert path.stat().st_mode & 0o777 == 0o600
        assert "DB_PASS: dbp-2" in path.read_text() and "earlier" not in path.read_text()
        (again,) = resolve_stages(cli(["--config", str(path)])[0])
        assert again == stage
