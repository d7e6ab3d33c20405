"""scripts/bench_vs_trl.py end to end on a few steps: both contenders (nanorft in mode both, on-policy; TRL's
GRPOTrainer, from the bench extra that `bash run.sh test` installs) on the same workload, so that the benchmark cannot
rot (its third contender, nanorft with sync_offset 1, is the same run on a config that differs in that key: checked
without running it); scripts/bench_vllm.py on a small workload, likewise. The figures themselves are
in docs/LOG.md (the full runs take ~20 and ~8 minutes)."""

import json
import sys
from pathlib import Path

import entry
import pytest

from helpers import ROOT, real_vllm


@pytest.mark.slow(seconds=105)
def test_bench_vs_trl_runs_both_sides_and_reports_every_figure(tmp_path):
    args = ["--work", str(tmp_path / "work"), "--seeds", "0", "--steps", "2", "--sft-steps", "4"]
    args += ["--json", str(tmp_path / "bench.json"), "--eval-limit", "50", "--no-offset"]
    # one thread a process, as helpers.launch runs the entry points: on busy cores, torch's second thread spins
    # (measured: an eval of 50 problems took 6-12 s of CPU with 2 threads at load ~6, 0.7 s with one)
    out = entry.run_process("scripts/bench_vs_trl.py", *args, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert sorted(r["framework"] for r in results) == ["TRL", "nanorft"]
    for r in results:
        assert r["completions"] == 2 * 16 * 8  # 2 steps of 16 prompts x 8 samples
        assert r["wall_s"] > 0 and r["step_s"] > 0 and r["rollout_s"] > 0 and r["tokens"] > r["completions"]
        assert 0 < r["peak_rss_gb"] < 20 and r["command_s"] > r["wall_s"]
        assert 0 <= r["before"] <= 1 and 0 <= r["after"] <= 1
        assert (Path(r["weights"]) / "config.json").is_file()
    assert "| TRL | 0 |" in out.stdout and "TRL / this, seed by seed" in out.stdout


def test_the_sync_offset_contender_differs_in_its_sync_offset_alone(tmp_path):
    """bench_vs_trl's "nanorft sync_offset 1" run: the on-policy run's config but for synchronizer.sync_offset (and
    its name), as the launcher resolves it."""
    import yaml

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_vs_trl

    from configs import cli, resolve_stages

    made = {k: bench_vs_trl.nanorft_config(tmp_path, tmp_path / "start", 0, 3, k) for k in (0, 1)}
    stages = {}
    for k, cfg in made.items():
        (tmp_path / f"o{k}.yaml").write_text(yaml.safe_dump(cfg))
        (stages[k],) = resolve_stages(cli(["--config", str(tmp_path / f"o{k}.yaml")])[0])
    assert stages[0].synchronizer.sync_offset == 0 and stages[1].synchronizer.sync_offset == 1
    made[1]["synchronizer"]["sync_offset"], made[1]["name"] = 0, made[0]["name"]
    assert made[0] == made[1]


@pytest.mark.slow(seconds=50)
def test_bench_vllm_reports_every_figure(tmp_path):
    real_vllm()
    args = ["--models", "1m", "--prompts", "2", "--n", "2", "--tokens", "4", "--repeats", "1", "--no-compiled"]
    out = entry.run_process("scripts/bench_vllm.py", *args, "--json", str(tmp_path / "rows.json"), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["model"] == "1m" and row["params"] == 1019008 and row["vllm_tok_s"] > 0 and row["hf_tok_s"] > 0
    assert 0 < row["start_s"] < 300 and all(0 < row[k] < 60 for k in ("vllm_folder_s", "vllm_group_s", "hf_folder_s"))
    assert "vLLM/HF" in out.stdout
