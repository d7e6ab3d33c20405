"""Monitor: the console line, the JSONL history, tensorboard events and an offline wandb run, read back."""

import logging
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from configs.schema import Config
from monitor import Monitor, close_log_file, log_to_file, read_history


def config(tmp_path, kind: str) -> Config:
    cfg = Config(name="t")
    cfg.checkpoint_job_dir = str(tmp_path / "job")
    cfg.monitor.monitor_type = kind
    return cfg


def test_history_console_and_tensorboard(tmp_path, caplog):
    mon = Monitor(config(tmp_path, "tensorboard"), role="explorer")
    with caplog.at_level(logging.INFO, logger="nanorft.monitor"):
        mon.log({"rollout/reward/mean": 0.25, "time/step": 1.5, "note": "text", "bad": float("nan")}, step=1)
        mon.log({"rollout/reward/mean": 0.75}, step=2)
    mon.close()
    # the console: a short line; the role's log file: every record, and the full metric line
    assert "[explorer] step 1 reward 0.25 s/step 1.5\n" in caplog.text and "rollout/reward/mean=0.25" not in caplog.text
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


def test_console_shows_step_of_total_and_a_line_per_evaluation(tmp_path, caplog):
    cfg = config(tmp_path, "none")
    cfg.buffer.total_steps = 20
    mon = Monitor(cfg, role="explorer")
    metrics = {"rollout/reward/mean": 0.5, "rollout/tokens_per_s": 7456.2, "eval/arith_test/accuracy/mean@4": 0.785,
               "eval/arith_test/reward/mean@4": 0.9, "eval/other/reward/mean@1": 0.25,
               **{f"x/m{i}": i for i in range(50)}}
    with caplog.at_level(logging.INFO, logger="nanorft.monitor"):
        mon.log(metrics, step=20)
    mon.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "nanorft.monitor"]
    assert lines == ["[explorer] step 20/20 reward 0.5 acc 0.785 tok/s 7456",
                     "[explorer] eval step 20: arith_test accuracy 0.785, other reward 0.250"]
    logged = (tmp_path / "job/log/explorer.log").read_text()
    assert "x/m49=49" in logged and lines[1] in logged


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


def test_wandb_runs_offline_without_a_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    mon = Monitor(config(tmp_path, "wandb"), role="trainer")
    assert mon.wandb is not None and mon.wandb.settings.mode == "offline"
    mon.log({"actor/grad_norm": 1.25}, step=1)
    mon.close()
    runs = list((tmp_path / "job/monitor/wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
