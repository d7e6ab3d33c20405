"""Monitor: the console line, the JSONL history, tensorboard events, an offline wandb run and an mlflow SQLite store,
read back; secrets hidden from the copies of the config they get; one mlflow experiment however many processes
create it at once. (A launcher run of several stages into one mlflow store: tests/test_launch.py.)"""

import dataclasses
import io
import logging
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from algos import POLICY_LOSS_FNS
from buffer import Experience
from configs.schema import Config
from helpers import fill, fork_context, mlflow_runs
from monitor import (
    CONSOLE,
    Console,
    HistoryTail,
    Monitor,
    bars_wanted,
    close_log_file,
    headline,
    log_to_file,
    mlflow_client,
    preview,
    read_history,
)


def config(tmp_path, kind: str) -> Config:
    cfg = Config(name="t")
    cfg.checkpoint_job_dir = str(tmp_path / "job")
    cfg.monitor.monitor_type = [kind]
    return cfg


def test_history_console_and_tensorboard(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="nanorft.monitor")  # the console's lines follow log.level, as in a run
    mon = Monitor(config(tmp_path, "tensorboard"), role="explorer")
    mon.log({"rollout/reward/mean": 0.25, "time/step": 1.5, "note": "text", "bad": float("nan")}, step=1)
    mon.log({"rollout/reward/mean": 0.75}, step=2)
    mon.close()
    # the console (not a terminal here): a short line; the role's log file: every record, and the full metric line
    err = capsys.readouterr().err
    assert re.search(r"^\d\d:\d\d:\d\d \[explorer\] step 1 reward 0.25 s/step 1.5 elapsed 0:00$", err, re.M), err
    assert "rollout/reward/mean=0.25" not in err
    logged = (tmp_path / "job/log/explorer.log").read_text()
    assert re.search(r"\[explorer\] step 1 perf/max_rss_gb=[0-9.]+ rollout/reward/mean=0.25 time/step=1.5", logged)
    assert "[explorer] step 2 reward 0.75" in logged  # the console's line too
    logging.getLogger("nanorft.x").info("after close")
    assert "after close" not in (tmp_path / "job/log/explorer.log").read_text()  # the handler left with the monitor
    hist = read_history(tmp_path / "job/monitor/explorer.jsonl")
    assert [h["step"] for h in hist] == [1, 2] and hist[0]["note"] == "text"
    # every record carries the process's peak memory: this test process holds torch, so > 0.1 GB
    assert 0.1 < hist[0]["perf/max_rss_gb"] <= hist[1]["perf/max_rss_gb"] < 64
    events = EventAccumulator(str(tmp_path / "job/monitor/tensorboard/explorer"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward/mean")] == [(1, 0.25), (2, 0.75)]
    assert "bad" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]


def test_console_shows_step_of_total_and_a_line_per_evaluation(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="nanorft.monitor")
    cfg = config(tmp_path, "none")
    cfg.buffer.total_steps = 20
    mon = Monitor(cfg, role="explorer")
    metrics = {
        "rollout/reward/mean": 0.5,
        "rollout/tokens_per_s": 7456.2,
        "eval/arith_test/accuracy/mean@4": 0.785,
        "eval/arith_test/reward/mean@4": 0.9,
        "eval/other/reward/mean@1": 0.25,
        **{f"x/m{i}": i for i in range(50)},
    }
    mon.log(metrics, step=20)
    mon.close()
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "[explorer] step 20/20 reward 0.5 acc 0.785 tok/s 7456 elapsed 0:00",
        "[explorer] eval step 20: arith_test accuracy 0.785, other reward 0.250",
    ]
    logged = (tmp_path / "job/log/explorer.log").read_text()
    assert "x/m49=49" in logged and lines[1] in logged


def loss_batch(B: int = 4, T: int = 5) -> dict:
    """A batch every registered policy loss can read (log-probs, advantages, masks, the pieces some need)."""
    g = torch.Generator().manual_seed(0)
    return {
        "old_logprobs": -torch.rand(B, T, generator=g),
        "ref_logprobs": -torch.rand(B, T, generator=g),
        "advantages": torch.randn(B, T, generator=g),
        "response_mask": torch.ones(B, T),
        "rewards": torch.rand(B, generator=g),
        "group_index": torch.arange(B) // 2,
        "episode_index": torch.arange(B),
        "expert_mask": torch.tensor([0.0, 1.0] * (B // 2))[:, None].expand(B, T).clone(),  # mix: both parts
        "step": torch.full((B,), 3),
    }


@pytest.mark.parametrize("name", sorted(POLICY_LOSS_FNS))
def test_the_headline_loss_is_the_policy_loss_of_every_registered_loss_and_the_entropy_is_named(name):
    """The trainer's headline `loss` is the policy loss the registered loss reports (veRL's pg_loss; mix's usual
    part; else its own <name>_loss), never actor/entropy_loss (alphabetically first: it was shown as the loss, 5.547
    every step of a GRPO run) nor actor/kl_loss; the entropy shows as `entropy`."""
    fn, cfg_cls = POLICY_LOSS_FNS[name]
    batch = loss_batch()
    _, metrics = fn(batch["old_logprobs"] + 0.1, batch, cfg_cls(), "token-mean")
    own = "pg_loss" if "pg_loss" in metrics else "usual/pg_loss" if "usual/pg_loss" in metrics else None
    own = own or next(k for k in metrics if k.endswith("_loss"))
    numbers = {f"actor/{k}": v for k, v in metrics.items()}
    numbers |= {"actor/entropy_loss": 5.547, "actor/kl_loss": 0.0123, "actor/entropy": 5.5, "critic/score/mean": -0.1}
    line = headline(numbers)
    assert line.startswith(f"reward -0.1 loss {metrics[own]:.4g} entropy 5.5"), (name, line)
    assert "5.547" not in line and "0.0123" not in line


def test_the_headline_reward_is_the_same_number_for_the_explorer_and_the_trainer():
    """The explorer's rollout/reward/mean and the trainer's critic/score/mean (the mean reward of the step's
    experiences) show as `reward`; critic/reward_mean (the advantage function's, after a KL penalty) does not."""
    assert headline({"rollout/reward/mean": -0.1, "time/rollout": 2.0}) == "reward -0.1 s/step 2"
    trainer = {"critic/reward_mean": -0.13, "critic/score/mean": -0.1, "actor/pg_loss": 0.0, "actor/entropy": 5.5}
    assert headline(trainer) == "reward -0.1 loss 0 entropy 5.5"


def test_the_short_line_has_the_elapsed_time_and_an_eta_from_the_steps_after_the_first(capsys, caplog):
    """Without bars: each step's line ends in `elapsed M:SS` (since the process started) and, from the second step
    seen, `eta M:SS` from the mean time of the steps after the first (the first took the start-up too: 30 s of
    start-up then 2 s steps give eta 2 s x the steps left, not 32 s x ...). A resumed run counts from its first step,
    an explorer's step 0 (its evaluation before training) starts nothing."""
    caplog.set_level(logging.INFO, logger="nanorft.monitor")
    now = [100.0]
    console = Console({"trainer": 10, "explorer": 10}, bars=False, start=100.0, clock=lambda: now[0])
    for t, role, step in [
        (101.0, "explorer", 0),
        (130.0, "trainer", 1),
        (131.0, "explorer", 1),
        (132.0, "trainer", 2),
        (134.0, "trainer", 3),
        (137.0, "explorer", 2),
        (3700.0, "trainer", 4),
    ]:
        now[0] = t
        console.step(role, step, {"actor/pg_loss": 0.5} if role == "trainer" else {"rollout/reward/mean": 0.5}, 10)
    lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "[explorer] step 0/10 reward 0.5 elapsed 0:01",
        "[trainer] step 1/10 loss 0.5 elapsed 0:30",
        "[explorer] step 1/10 reward 0.5 elapsed 0:31",
        "[trainer] step 2/10 loss 0.5 elapsed 0:32 eta 0:16",  # 2 s a step since step 1, 8 steps left
        "[trainer] step 3/10 loss 0.5 elapsed 0:34 eta 0:14",
        "[explorer] step 2/10 reward 0.5 elapsed 0:37 eta 0:48",  # 6 s a step since its step 1
        "[trainer] step 4/10 loss 0.5 elapsed 1:00:00 eta 1:59:00",  # (3700 - 130) / 3 = 1190 s x 6 left
    ]
    resumed = Console({"trainer": 30}, bars=False, start=0.0, clock=lambda: now[0])
    for now[0], step in [(40.0, 21), (43.0, 22)]:
        resumed.step("trainer", step, {}, 30)
    assert capsys.readouterr().err.splitlines()[1].endswith("[trainer] step 22/30 0 metrics elapsed 0:43 eta 0:24")


def test_the_bars_rate_and_eta_leave_out_the_start_up(monkeypatch):
    """On a terminal: the bar's rate and ETA count from the end of the first step, so 30 s of start-up before step 1
    and 2 s steps after it show 0.5 step/s and an ETA of 2 s x the steps left (tqdm counted the start-up as step 1's
    time: 0.06 step/s)."""
    import tqdm.std

    now = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])  # the bar's clock
    screen = Terminal()
    console = Console({"trainer": 10}, bars=True, file=screen, start=0.0, clock=lambda: now[0])
    try:
        for now[0], step in [(30.0, 1), (32.0, 2), (34.0, 3)]:
            console.step("trainer", step, {"actor/pg_loss": 0.5}, 10)
        bar = console.bars["trainer"]
        shown = bar.format_meter(**bar.format_dict)
    finally:
        console.close()
    assert re.search(r" 3/10 \[00:04<00:14, +2\.00s/step", shown), shown


def test_log_to_file_takes_every_record_until_closed(tmp_path):
    handler = log_to_file(str(tmp_path / "job"), "launch")
    logging.getLogger("nanorft.launch").warning("stage s: started")
    close_log_file(handler)
    logging.getLogger("nanorft.launch").warning("after close")
    assert (tmp_path / "job/log/launch.log").read_text().endswith("WARNING nanorft.launch: stage s: started\n")


def test_history_appends_across_restarts(tmp_path):
    for step in (1, 2):
        mon = Monitor(config(tmp_path, "none"), role="trainer")
        mon.log({"actor/pg_loss": float(step)}, step=step)
        mon.close()
    assert [h["actor/pg_loss"] for h in read_history(tmp_path / "job/monitor/trainer.jsonl")] == [1.0, 2.0]


WANDB_ENV = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_CONFIG_DIR", "NETRC")


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch) -> Path:
    """A HOME of the test's own (no ~/.netrc: no `wandb login`) and none of wandb's variables: nothing reaches the
    network. Returns that HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in WANDB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return home


def test_wandb_runs_offline_without_a_key(tmp_path, no_wandb_login):
    pytest.importorskip("wandb")
    mon = Monitor(config(tmp_path, "wandb"), role="trainer")
    assert mon.wandb is not None and mon.wandb.settings.mode == "offline"
    mon.log({"actor/grad_norm": 1.25}, step=1)
    mon.close()
    runs = list((tmp_path / "job/monitor/wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path):
    """`wandb login`'s netrc entry (~/.netrc, else ~/_netrc, or the file NETRC names) for the server's host
    (api.wandb.ai, or WANDB_BASE_URL's), WANDB_API_KEY, an identity token file, WANDB_MODE; nothing else (an entry
    for another host, one without a key, a file that does not parse). Files only: no network."""
    from monitor import wandb_credentials

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    assert wandb_credentials(env) == ""
    (home / ".netrc").write_text("machine github.com login me password ghp-1\n")
    assert wandb_credentials(env) == ""
    (home / ".netrc").write_text(
        "machine github.com login me password ghp-1\nmachine api.wandb.ai login user password k1\n"
    )
    assert wandb_credentials(env) == f"a key for api.wandb.ai in {home / '.netrc'}"
    assert wandb_credentials(env | {"WANDB_BASE_URL": "https://wandb.example.com"}) == ""  # another server
    other = tmp_path / "netrc"
    other.write_text("machine wandb.example.com login user password k2\n")
    server = {"WANDB_BASE_URL": "https://wandb.example.com", "NETRC": str(other)}
    assert wandb_credentials(env | server) == f"a key for wandb.example.com in {other}"
    assert wandb_credentials(env | {"NETRC": str(tmp_path / "missing")}) == ""  # NETRC wins over ~/.netrc
    (home / ".netrc").unlink()
    (home / "_netrc").write_text("machine api.wandb.ai login user password k3\n")
    assert wandb_credentials(env) == f"a key for api.wandb.ai in {home / '_netrc'}"
    (home / "_netrc").write_text("machine api.wandb.ai login user\n")  # no key
    assert wandb_credentials(env) == ""
    (home / "_netrc").write_text("machine api.wandb.ai login user password k3 bogus\n")  # does not parse
    assert wandb_credentials(env) == ""
    assert wandb_credentials(env | {"WANDB_API_KEY": "k4"}) == "WANDB_API_KEY"
    assert wandb_credentials(env | {"WANDB_IDENTITY_TOKEN_FILE": "/t"}) == "WANDB_IDENTITY_TOKEN_FILE"
    assert wandb_credentials(env | {"WANDB_MODE": "online"}) == "WANDB_MODE=online"


def test_wandb_finds_the_same_netrc_key(no_wandb_login):
    """Where the installed wandb has its own netrc reader (wbauth, in recent wandb), it finds a key for its default
    server exactly when we find one (an entry for api.wandb.ai or for its CoreWeave Forge front); where it has
    none, this is skipped (our reader is the documented netrc lookup either way)."""
    wandb = pytest.importorskip("wandb")
    wbauth = pytest.importorskip("wandb.sdk.lib.wbauth")
    from monitor import wandb_credentials

    default = wandb.Settings().base_url  # the installed wandb's own server: api.wandb.ai, or its Forge front
    for host in ("api.wandb.ai", "api.forge.coreweave.com"):
        (no_wandb_login / ".netrc").write_text(f"machine {host} login user password " + "a" * 40 + "\n")
        assert wandb_credentials(os.environ) == f"a key for {host} in {no_wandb_login / '.netrc'}"
        assert wbauth.read_netrc_auth(host=default) == "a" * 40, (host, default)
    (no_wandb_login / ".netrc").write_text("machine wandb.example.com login user password " + "a" * 40 + "\n")
    assert wandb_credentials(os.environ) == "" and wbauth.read_netrc_auth(host=default) is None


def test_wandb_decides_the_mode_when_it_has_credentials(tmp_path, no_wandb_login, monkeypatch):
    """With `wandb login`'s key in ~/.netrc the run is left to wandb (mode None: online, or what WANDB_MODE or its
    settings say); with none, offline. wandb.init is replaced here (an online run would reach the network); then a
    real run with WANDB_MODE=disabled and that key: disabled, as wandb was told, not offline."""
    wandb = pytest.importorskip("wandb")
    real_init, asked = wandb.init, []

    class Run:
        name, settings = "r", type("Settings", (), {"mode": "as wandb decides"})

        def finish(self, exit_code: int = 0) -> None:
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: asked.append(kw["mode"]) or Run())
    Monitor(config(tmp_path / "a", "wandb"), role="trainer").close()
    (no_wandb_login / ".netrc").write_text("machine api.wandb.ai login user password " + "b" * 40 + "\n")
    Monitor(config(tmp_path / "b", "wandb"), role="trainer").close()
    assert asked == ["offline", None]
    monkeypatch.setattr(wandb, "init", real_init)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # NOTE: were wandb to go online after all: no network
    wandb.teardown()  # NOTE: wandb reads its environment once per process (its first setup): read it again
    mon = Monitor(config(tmp_path / "c", "wandb"), role="trainer")
    assert mon.wandb.settings.mode == "disabled"
    mon.log({"actor/grad_norm": 1.0}, step=1)
    mon.close()


def test_mlflow_logs_every_number_under_a_name_it_accepts(tmp_path, monkeypatch):
    """A SQLite store in the job's monitor/ (the default without a tracking URI), its artifacts beside it:
    experiment = project, run = <name>_<role>, the config as an artifact; `@` (mlflow refuses it) becomes `_`."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    mon = Monitor(config(tmp_path, "mlflow"), role="trainer")
    mon.log({"actor/pg_loss": 0.5, "eval/arith/accuracy/mean@1": 0.25, "note": "text"}, step=1)
    mon.log({"actor/pg_loss": 0.25}, step=2)
    mon.close()
    client = MlflowClient(f"sqlite:///{tmp_path}/job/monitor/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nanorft").experiment_id])
    assert run.info.run_name == "t_trainer" and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((tmp_path / "job/monitor/mlartifacts").as_uri())
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == [
        (1, 0.5),
        (2, 0.25),
    ]
    assert run.data.metrics["eval/arith/accuracy/mean_1"] == 0.25 and "note" not in run.data.metrics
    assert "perf/max_rss_gb" in run.data.metrics
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.json"]


def test_an_mlflow_run_whose_config_cannot_be_logged_ends_failed(tmp_path, monkeypatch):
    """MlflowSink made its run, then logging the config failed: the run ends FAILED (no Monitor holds the sink
    yet, so nothing else could end it: it stayed RUNNING), and the error reaches the caller."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(MlflowClient, "log_dict", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        Monitor(config(tmp_path, "mlflow"), role="trainer")
    assert mlflow_runs(f"sqlite:///{tmp_path}/job/monitor/mlflow.db") == {"t_trainer": "FAILED"}


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in a person's shell."""

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_per_process_with_the_headline_and_eval_lines_above(tmp_path, monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    assert bars_wanted() and not bars_wanted(io.StringIO())
    handler = logging.StreamHandler(screen)  # the console's log handler, as logging.basicConfig makes it
    logging.getLogger().addHandler(handler)
    try:
        console = Console({"trainer": 4, "explorer": None}, bars=True)
        console.step("trainer", 1, {"actor/pg_loss": 0.5, "perf/throughput": 99.0})
        console.step("explorer", 2, {"rollout/reward/mean": 0.25, "eval/arith_test/accuracy/mean@1": 0.5}, total=4)
        logging.getLogger("nanorft.x").warning("a warning while the bars are up")
        console.close()
    finally:
        logging.getLogger().removeHandler(handler)
    out = screen.getvalue()
    assert re.search(r"trainer: +25%\|.*\| 1/4 .*loss 0.5 tok/s 99", out), out
    assert re.search(r"explorer: +50%\|.*\| 2/4 .*reward 0.25 acc 0.5", out), out
    assert "[explorer] eval step 2: arith_test accuracy 0.500\n" in out
    assert "a warning while the bars are up" in out  # log records go above the bars, through tqdm
    assert "[trainer] step" not in out  # no per-step lines under a bar


def test_under_the_launcher_the_process_leaves_the_console_to_it(tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level(logging.INFO, logger="nanorft.monitor")
    monkeypatch.setenv(CONSOLE, "launcher")
    mon = Monitor(config(tmp_path, "none"), role="trainer")
    mon.log({"actor/pg_loss": 1.0}, step=1)
    mon.close()
    assert capsys.readouterr().err == ""
    assert "[trainer] step 1 loss 1" in (tmp_path / "job/log/trainer.log").read_text()  # the file keeps the line


def test_history_tail_gives_new_complete_records_only(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text('{"step": 1}\n')
    tail = HistoryTail(path)  # records written before are not news
    assert tail.read() == []
    with open(path, "a") as f:
        f.write('{"step": 2}\n{"st')
        f.flush()
        assert tail.read() == [{"step": 2}]  # the half-written line waits
        f.write('ep": 3}\n')
    assert tail.read() == [{"step": 3}] and tail.read() == []
    assert HistoryTail(tmp_path / "none.jsonl").read() == []


def test_preview_puts_the_lowest_and_highest_reward_samples_in_the_history_and_log_file(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="nanorft.monitor")
    exps = [
        Experience(
            tokens=torch.tensor([1, 2, 3]), prompt_length=1, reward=r, prompt_text=f"q{r}", response_text=f"a{r}"
        )
        for r in (0.5, -1.0, 2.0)
    ]
    shown = preview(exps) | preview([Experience(tokens=torch.tensor([1, 2]), prompt_length=1)])
    assert shown == {
        "preview/lowest": "reward -1 | 'q-1.0' -> 'a-1.0'",
        "preview/highest": "reward 2 | 'q2.0' -> 'a2.0'",
    }
    mon = Monitor(config(tmp_path, "none"), role="trainer")
    mon.log({"actor/pg_loss": 1.0, **shown}, step=1)
    mon.close()
    assert read_history(tmp_path / "job/monitor/trainer.jsonl")[0]["preview/highest"] == shown["preview/highest"]
    assert "[trainer] preview/lowest: reward -1 | 'q-1.0' -> 'a-1.0'" in (tmp_path / "job/log/trainer.log").read_text()
    assert "preview" not in capsys.readouterr().err  # the console keeps its short line


# env_vars of names no pattern of secret names knew (issue 25): AZURE_OPENAI_KEY, DB_PASS, ..._CREDENTIALS, ...
SECRETS = {
    "monitor.monitor_args": {"password": "hunter2", "username": "me", "session": "sess-9"},
    "buffer.trainer_input.experience_buffer.path": "postgresql://rft:s3@cret@db-host:5432/rft",
    "explorer.env_vars": {
        "HF_TOKEN": "hf_abc",
        "OPENAI_API_KEY": "sk-xyz",
        "AZURE_OPENAI_KEY": "az-1",
        "DB_PASS": "dbp-2",
        "GCP_CREDENTIALS": "gcp-3",
        "GITHUB_PAT": "ghp-4",
        "API_KEYS": "ak-5",
        "SESSION_COOKIE": "ck-6",
        "PLAIN": "plain-7",
    },
}
HIDDEN = (
    "hunter2",
    "sess-9",
    "s3@cret",
    "cret@",
    "hf_abc",
    "sk-xyz",
    "az-1",
    "dbp-2",
    "gcp-3",
    "ghp-4",
    "ak-5",
    "ck-6",
    "plain-7",
)


def with_secrets(tmp_path, kind: str) -> Config:
    cfg = config(tmp_path, kind)
    cfg.monitor.monitor_args = dict(SECRETS["monitor.monitor_args"])
    cfg.buffer.trainer_input.experience_buffer.path = SECRETS["buffer.trainer_input.experience_buffer.path"]
    cfg.explorer.env_vars = dict(SECRETS["explorer.env_vars"])
    return cfg


def test_redacted_hides_every_env_var_monitor_args_but_harmless_keys_passwords_keys_and_url_passwords():
    """Every env_vars value (in a stage's overrides too), every monitor_args value but SHOWN_MONITOR_ARGS (URLs
    there with their passwords hidden), a key named like a secret elsewhere; nothing else."""
    from configs.checks import redacted
    from configs.resolve import holds_secret
    from configs.schema import StageConfig

    cfg = Config()
    assert redacted(cfg) == dataclasses.asdict(cfg) and not holds_secret(cfg)  # nothing secret: nothing changed
    cfg.monitor.monitor_args = {
        "password": "hunter2",
        "api_key": "k",
        "uri": "https://u:pw@mlflow.example",
        "entity": "team",
        "tags": ["a", "b"],
        "mode": "offline",
        "session": "s",
        "extra": 1,
    }
    cfg.buffer.trainer_input.experience_buffer.path = "postgresql://rft:s3@cret@db/rft?sslmode=require"
    cfg.explorer.env_vars = {**SECRETS["explorer.env_vars"], "EMPTY": ""}
    cfg.buffer.explorer_input.taskset.workflow_args = {"github_pat": "g", "db_pass": "d", "auth": "a", "turns": 3}
    cfg.stages = [StageConfig(stage_name="s", explorer={"env_vars": {"DB_PASS": "dbp-2"}})]
    out = redacted(cfg)
    assert out["monitor"]["monitor_args"] == {
        "password": "***",
        "api_key": "***",
        "entity": "team",
        "uri": "https://u:***@mlflow.example",
        "tags": ["a", "b"],
        "mode": "offline",
        "session": "***",
        "extra": "***",
    }
    assert out["buffer"]["trainer_input"]["experience_buffer"]["path"] == "postgresql://rft:***@db/rft?sslmode=require"
    assert out["explorer"]["env_vars"] == {**dict.fromkeys(SECRETS["explorer.env_vars"], "***"), "EMPTY": ""}
    assert out["buffer"]["explorer_input"]["taskset"]["workflow_args"] == {
        "github_pat": "***",
        "db_pass": "***",
        "auth": "***",
        "turns": 3,
    }
    assert out["stages"][0]["explorer"] == {"env_vars": {"DB_PASS": "***"}}
    assert out["buffer"]["trainer_input"]["experience_buffer"]["format"]["prompt_key"] == "prompt"  # a *_key: kept
    assert holds_secret(cfg) and cfg.monitor.monitor_args["password"] == "hunter2"  # the config itself unchanged


def test_the_config_that_mlflow_and_wandb_get_has_its_secrets_hidden(tmp_path, monkeypatch, no_wandb_login):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for env in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # MlflowSink sets them from monitor_args
        monkeypatch.delenv(env, raising=False)
    mon = Monitor(with_secrets(tmp_path / "m", "mlflow"), role="trainer")
    mon.close()
    client = MlflowClient(f"sqlite:///{tmp_path}/m/job/monitor/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("nanorft").experiment_id])
    params = run.data.params
    assert params["monitor.monitor_args.password"] == "***" and params["explorer.env_vars.DB_PASS"] == "***"
    assert params["buffer.trainer_input.experience_buffer.path"] == "postgresql://rft:***@db-host:5432/rft"
    assert not [(k, secret) for k, v in params.items() for secret in HIDDEN if secret in v]
    saved = (Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))).read_text()
    assert '"password": "***"' in saved and "postgresql://rft:***@db-host:5432/rft" in saved
    assert '"PLAIN": "***"' in saved and '"username": "me"' in saved
    assert not [secret for secret in HIDDEN if secret in saved]
    pytest.importorskip("wandb")
    mon = Monitor(with_secrets(tmp_path / "w", "wandb"), role="trainer")
    assert mon.wandb.config["monitor"]["monitor_args"]["password"] == "***"
    assert mon.wandb.config["explorer"]["env_vars"]["DB_PASS"] == "***"
    mon.close()
    written = [p for p in (tmp_path / "w/job/monitor/wandb").rglob("*") if p.is_file()]  # debug.log among them
    assert written and not [(p.name, s) for p in written for s in HIDDEN if s.encode() in p.read_bytes()]


def _create(uri: str, name: str, barrier) -> str:
    from mlflow.tracking import MlflowClient

    from monitor import mlflow_experiment

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    barrier.wait()
    return mlflow_experiment(MlflowClient(uri), uri, name)


@pytest.mark.slow
@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_processes_creating_the_experiment_at_once_make_one(tmp_path, monkeypatch, store):
    """A file store checks names without a lock: four processes that get-or-create one experiment at the same moment
    must find one experiment, the same id in each (and in the default SQLite store)."""
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri() if store == "file" else f"sqlite:///{tmp_path}/mlflow.db"
    # NOTE: the store itself first, as the launcher's prepare_mlflow makes it before any process starts: a file
    # store's constructor writes its default experiment (0) when the folder is new, and four at once race there
    # ("Yaml file .../mlruns/0/meta.yaml exists"), which is not the race this test is about
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    MlflowClient(uri).search_experiments()
    ctx = fork_context()  # four processes that did not import mlflow yet, torch and the rest already imported
    with ctx.Manager() as manager:
        barrier = manager.Barrier(4)
        with ctx.Pool(4) as pool:
            ids = pool.starmap(_create, [(uri, "p", barrier)] * 4)
    assert len(set(ids)) == 1
    named = [e for e in MlflowClient(uri).search_experiments() if e.name == "p"]
    assert [e.experiment_id for e in named] == ids[:1]


def test_a_create_that_loses_the_race_takes_the_winners_experiment():
    """On a server the second create fails with RESOURCE_ALREADY_EXISTS: the experiment is looked up again."""
    from mlflow.exceptions import MlflowException

    from monitor import mlflow_experiment

    class Server:
        def __init__(self):
            self.made = None

        def get_experiment_by_name(self, name):
            return self.made

        def create_experiment(self, name, artifact_location=None):
            self.made = type("Experiment", (), {"experiment_id": "7"})()  # another process, a moment before
            raise MlflowException("RESOURCE_ALREADY_EXISTS: experiment p already exists")

    assert mlflow_experiment(Server(), "http://127.0.0.1:5000", "p") == "7"


@pytest.mark.slow
def test_several_sinks_at_once_and_trinitys_single_name(tmp_path, monkeypatch):
    """monitor_type [tensorboard, mlflow]: every number reaches both (as TRL's report_to list); a Trinity YAML's
    single `monitor_type: wandb` loads as [wandb], the command line takes several names, the resolved config keeps
    the list, and none beside a sink (or a sink twice) is refused by name."""
    import configs
    from configs import ConfigError, cli, resolve_stages

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = config(tmp_path, "tensorboard")
    cfg.monitor.monitor_type = ["tensorboard", "mlflow"]
    mon = Monitor(cfg, role="trainer")
    mon.log({"actor/pg_loss": 0.5}, step=1)
    mon.close()
    events = EventAccumulator(str(tmp_path / "job/monitor/tensorboard/trainer"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("actor/pg_loss")] == [(1, 0.5)]
    assert mlflow_runs(f"sqlite:///{tmp_path}/job/monitor/mlflow.db") == {"t_trainer": "FINISHED"}
    yaml_file = tmp_path / "trinity.yaml"
    yaml_file.write_text(
        "model: {model_path: m, max_model_len: 256}\nbuffer: {batch_size: 4, explorer_input: {taskset: {path: x}}}\n"
        "monitor:\n  monitor_type: wandb\n  monitor_args: {base_url: 'http://127.0.0.1:9'}\n"
    )
    assert cli(["--config", str(yaml_file)])[0].monitor.monitor_type == ["wandb"]
    both = cli(["--config", str(yaml_file), "--monitor.monitor_type", "tensorboard", "wandb"])[0]
    assert both.monitor.monitor_type == ["tensorboard", "wandb"]
    again = tmp_path / "resolved.yaml"
    again.write_text(configs.to_yaml(both))
    assert cli(["--config", str(again)])[0].monitor.monitor_type == ["tensorboard", "wandb"]
    for bad in (["none", "wandb"], ["wandb", "wandb"]):
        with pytest.raises(ConfigError, match=r"monitor.monitor_type = \[.*\] is refused: each sink once, or none"):
            resolve_stages(
                cli(["--config", str(yaml_file), "--model.model_path", "m", "--monitor.monitor_type", *bad])[0]
            )


# --- a full disk under the job folder, and the torn lines it left


def test_a_full_disk_under_the_job_folder_loses_a_steps_metrics_with_one_warning(small_disk, caplog, capsys):
    """A real full filesystem: the history's and tensorboard's writes fail with ENOSPC. Each sink warns once, the
    process goes on, no half record stays in the history, and the sinks write again once there is room (before:
    the raw OSError of the history's write stopped the explorer, and a write cut short left half a line)."""
    cfg = Config(name="t")
    cfg.checkpoint_job_dir = str(small_disk / "job")
    cfg.monitor.monitor_type = ["tensorboard"]
    mon = Monitor(cfg, role="explorer")
    mon.log({"rollout/reward/mean": 0.25}, step=1)
    filler = fill(small_disk)
    with caplog.at_level(logging.WARNING, logger="nanorft.monitor"):
        for step in (2, 3):  # a record longer than a page: a write of it is cut short, not refused whole
            mon.log({"rollout/reward/mean": 0.5, "note": "n" * 6000}, step=step)
        assert caplog.text.count("could not write the metrics of step 2 to history") == 1, caplog.text
        assert "step 3" not in caplog.text  # said once
        filler.unlink()
        mon.log({"rollout/reward/mean": 0.75}, step=4)
    assert "the metrics of step 4 went to history again" in caplog.text
    mon.close()
    text = (small_disk / "job/monitor/explorer.jsonl").read_text()
    assert [h["step"] for h in read_history(small_disk / "job/monitor/explorer.jsonl")] == [1, 4], text[:300]
    assert text.endswith("\n") and len(text.splitlines()) == 2  # whole lines only
    assert "Traceback" not in capsys.readouterr().err  # the log file's failures: one line, no logging traceback


# NOTE: tensorboard's own writer thread dies of the ENOSPC too, and threading's hook prints it (docs/trainer.md)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_monitor_made_on_a_full_disk_goes_on_without_what_it_cannot_write(small_disk, caplog):
    """A process that starts on a full disk: tensorboard's first event cannot be written (its writer raised ENOSPC
    from the Monitor's constructor, a traceback at set-up); it runs without tensorboard, saying so, and its history
    gets the records once there is room."""
    filler = fill(small_disk)
    cfg = Config(name="t")
    cfg.checkpoint_job_dir = str(small_disk / "job")
    cfg.monitor.monitor_type = ["tensorboard"]
    with caplog.at_level(logging.WARNING, logger="nanorft.monitor"):
        mon = Monitor(cfg, role="explorer")
        mon.log({"rollout/reward/mean": 0.25}, step=1)
        filler.unlink()
        mon.log({"rollout/reward/mean": 0.5}, step=2)
        mon.close()
    assert "no tensorboard events for this process" in caplog.text
    assert "could not write the metrics of step 1 to history" in caplog.text
    assert [h["step"] for h in read_history(small_disk / "job/monitor/explorer.jsonl")] == [2]


def test_readers_skip_a_torn_line_naming_file_and_line_and_a_writer_starts_a_new_line(tmp_path, caplog):
    """A history that a full disk or a kill left with half a record: read_history and HistoryTail skip it with a
    warning naming the file and the line (before: json's error stopped every later launcher of the job), and a
    monitor appending to it starts on a line of its own instead of gluing its record to the half one."""
    path = tmp_path / "job/monitor/trainer.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"step": 1, "actor/pg_loss": 1.0}\n{"step": 2, "actor/pg_lo\n\xff\xfe\n[3]\n{"step": 3}\n{"st')
    tail = HistoryTail(path)
    tail.offset = 0  # read it from the start
    with caplog.at_level(logging.WARNING, logger="nanorft.monitor"):
        assert [h["step"] for h in read_history(path)] == [1, 3]
        assert [h["step"] for h in tail.read()] == [1, 3]  # the last line waits for its newline
    for n in (2, 3, 4):
        assert f"trainer.jsonl, line {n}: skipped" in caplog.text
    mon = Monitor(config(tmp_path, "none"), role="trainer")
    mon.log({"actor/pg_loss": 4.0}, step=4)
    mon.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanorft.monitor"):
        assert [h["step"] for h in read_history(path)] == [1, 3, 4]
    assert "line 6: skipped" in caplog.text and b'\n{"st\n{"step": 4, ' in path.read_bytes()


def test_mlflows_own_client_finds_runs_by_their_lr_in_the_sqlite_store_without_a_flag(tmp_path, monkeypatch):
    """The default store is SQLite (<job dir>/monitor/mlflow.db), which mlflow 3's client (and `mlflow ui`) opens
    with no MLFLOW_ALLOW_FILE_STORE: the resolved config is there as params, flattened, so runs filter by lr; a
    list is one JSON value and a value over mlflow's 6000 characters is cut."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for lr, role in ((1e-6, "trainer"), (2e-6, "explorer")):  # two runs of one store (one job's two processes)
        cfg = config(tmp_path, "mlflow")
        cfg.algorithm.optimizer.lr = lr
        cfg.model.model_path = "m" * 7000
        cfg.monitor.monitor_type = ["mlflow", "tensorboard"]
        mon = Monitor(cfg, role=role)
        mon.log({"actor/pg_loss": lr}, step=1)
        mon.close()
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    assert (tmp_path / "job/monitor/mlflow.db").is_file() and not (tmp_path / "job/monitor/mlruns").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/job/monitor/mlflow.db")
    experiment = client.get_experiment_by_name("nanorft").experiment_id
    (run,) = client.search_runs([experiment], "params.\"algorithm.optimizer.lr\" = '1e-06'")
    assert run.info.run_name == "t_trainer" and run.data.metrics["actor/pg_loss"] == 1e-6
    (other,) = client.search_runs([experiment], "params.\"algorithm.optimizer.lr\" = '2e-06'")
    assert other.info.run_name == "t_explorer"
    params = run.data.params
    assert params["monitor.monitor_type"] == '["mlflow", "tensorboard"]' and params["name"] == "t"
    assert params["model.model_path"] == "m" * 5997 + "..."
    assert params["trainer.name"] == "trainer" and "trainer" not in params  # leaves only, by their paths


def test_making_a_sqlite_store_keeps_the_processes_log_handlers(tmp_path, monkeypatch):
    """A new SQLite store's tables come from mlflow's alembic migrations; in mlflow 3.3 (the floor) their env.py
    calls logging.config.fileConfig, which swapped the root logger's handlers for alembic.ini's: the launcher's log
    file stayed empty from `prepare_mlflow` on. The process's handlers and level are the same after. (With a newer
    mlflow, whose migrations leave logging alone, this passes either way: the floors' run is where it can fail.)"""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = logging.getLogger()
    mine = logging.FileHandler(tmp_path / "role.log")
    root.addHandler(mine)
    try:
        before, level = list(root.handlers), root.level
        mlflow_client(config(tmp_path, "mlflow"), tmp_path / "job" / "monitor")
        assert root.handlers == before and root.level == level
    finally:
        root.removeHandler(mine)
        mine.close()
    assert (tmp_path / "job/monitor/mlflow.db").is_file()


def test_tensorboard_gets_the_config_as_text_its_secrets_hidden(tmp_path):
    """tensorboard's TEXT tab: the resolved config (YAML in a markdown code block), read back with tensorboard's
    own EventAccumulator; its secrets hidden as in wandb's and mlflow's copies."""
    cfg = with_secrets(tmp_path, "tensorboard")
    cfg.algorithm.optimizer.lr = 3e-6
    mon = Monitor(cfg, role="trainer")
    mon.close()
    events = EventAccumulator(str(tmp_path / "job/monitor/tensorboard/trainer"))
    events.Reload()
    (event,) = events.Tensors("config/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 0 and "\n    algorithm:\n" in text and "\n      optimizer:\n        lr: 3.0e-06\n" in text
    assert "password: '***'" in text and "DB_PASS: '***'" in text
    assert not [secret for secret in HIDDEN if secret in text]


def test_the_fields_names_are_logged_beside_nanorfts(tmp_path):
    """veRL's timing_s/* and TRL's frac_reward_zero_std: the same numbers as nanorft's time/* and
    critic/score/zero_std_ratio, under both names, by side (a trainer's time/step is veRL's step; an explorer's
    time/rollout its gen); a bench process gets none."""
    cfg = config(tmp_path, "none")
    trainer = {"time/step": 4.0, "time/update": 2.5, "time/adv": 0.25, "critic/score/zero_std_ratio": 0.5}
    explorer = {"time/rollout": 3.0, "time/eval": 1.5, "time/step": 9.0}
    for role, metrics in (("trainer", trainer), ("explorer", explorer), ("explorer_bench", explorer)):
        mon = Monitor(cfg, role=role)
        mon.log(metrics, step=1)
        mon.close()
    [t] = read_history(tmp_path / "job/monitor/trainer.jsonl")
    assert (t["timing_s/step"], t["timing_s/update_actor"], t["timing_s/adv"]) == (4.0, 2.5, 0.25)
    assert t["frac_reward_zero_std"] == 0.5 and t["time/step"] == 4.0  # nanorft's name stays
    [e] = read_history(tmp_path / "job/monitor/explorer.jsonl")
    assert (e["timing_s/gen"], e["timing_s/testing"]) == (3.0, 1.5) and "timing_s/step" not in e
    [b] = read_history(tmp_path / "job/monitor/explorer_bench.jsonl")
    assert not [k for k in b if k.startswith("timing_s/")]


def test_score_metrics_hand_checked():
    """critic/score/* (before the KL penalty), critic/rewards/* (what the advantage function sees) and the fraction
    of groups whose scores are all equal (TRL's frac_reward_zero_std), by hand: groups {1, 0}, {1, 1}, {0.5, 0.5},
    {0}: three of four tied (a group of one among them)."""
    from monitor import score_metrics

    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.0])
    rewards = scores - torch.tensor([0.1, 0.2, 0.0, 0.4, 0.0, 0.0, 0.3])  # a KL penalty per sequence
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    m = score_metrics(scores, rewards, groups)
    assert m["critic/score/mean"] == pytest.approx(4.0 / 7)
    assert (m["critic/score/max"], m["critic/score/min"]) == (1.0, 0.0)
    assert m["critic/rewards/mean"] == pytest.approx((4.0 - 1.0) / 7)
    assert m["critic/rewards/max"] == 1.0 and m["critic/rewards/min"] == pytest.approx(-0.3)
    assert m["critic/score/zero_std_ratio"] == 0.75
    assert (
        score_metrics(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))[
            "critic/score/zero_std_ratio"
        ]
        == 0.0
    )


def test_without_sqlalchemy_the_default_mlflow_store_is_a_named_config_error(tmp_path, monkeypatch):
    """mlflow-skinny alone (no SQLAlchemy) cannot open the default SQLite store: the launcher's pre-flight says
    what to install, before any process starts, instead of mlflow's late traceback."""
    from configs import ConfigError
    from monitor import prepare_mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)  # an import of it fails, as where it is not installed
    with pytest.raises(ConfigError, match=r"SQLite store needs sqlalchemy: pip install -e '\.\[mlflow\]'"):
        prepare_mlflow([config(tmp_path, "mlflow")], tmp_path / "run")
    assert not (tmp_path / "run/monitor/mlflow.db").exists()
