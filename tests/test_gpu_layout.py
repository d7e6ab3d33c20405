"""The GPU path's config side, checked without a GPU: the embedded default on one GPU (`--cluster.gpu_per_node 1`:
colocated, HF engine, bf16), every dtype spelling reaching every consumer as a torch name, the launcher's GPUs
taken from its own CUDA_VISIBLE_DEVICES, and Trinity's `sync_method: memory`."""

from pathlib import Path

import pytest
import torch

import configs
import engines
import launch
import train
from configs import ConfigError, cli, resolve_stages
from configs.checks import DTYPE_NAMES, DTYPES
from models import torch_dtype

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def stages(*args: str) -> list[configs.Config]:
    return resolve_stages(cli(["--config", TINY, *args])[0])


def test_the_embedded_default_on_one_gpu_colocates_the_hf_engine_in_bf16(monkeypatch, tmp_path):
    """`bash run.sh configs/tiny.yaml --cluster.gpu_per_node 1`: the bench and SFT stages on the GPU, then GRPO with
    the HF engine and the trainer sharing GPU 0 (the engine's model in host memory while the trainer steps),
    weights published in bf16 (checkpoint sync), both processes on the same GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bench, sft, rft = stages("--cluster.gpu_per_node", "1")
    assert [s.mode for s in (bench, sft, rft)] == ["bench", "train", "both"]
    cl, rm = rft.cluster, rft.explorer.rollout_model
    assert (cl.colocate, cl.explorer_gpu_num, cl.trainer_gpu_num, cl.trainer_gpu_num_per_node) == (True, 1, 1, 1)
    assert (rm.engine_type, rm.dtype, rft.synchronizer.sync_method) == ("hf", "bfloat16", "checkpoint")
    assert (sft.cluster.trainer_gpu_num, sft.cluster.colocate) == (1, False)
    cmds = launch.commands(rft, tmp_path / "config.yaml")
    assert cmds["explorer"][1] == cmds["trainer"][1] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert cmds["trainer"][0][1:] == [str(ROOT / "train.py"), "--config", str(tmp_path / "config.yaml")]  # 1 rank
    assert train.engine_dtype(rft, torch.device("cuda")) == torch.bfloat16  # what the trainer publishes in
    built = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engines, "HFEngine", lambda path, **kw: built.update(kw) or kw)
    engines.make_engine(rm, "model", 200, colocate=True)
    assert (built["device"], built["dtype"]) == ("cuda", "bfloat16")  # the explorer's engine
    # the CPU stays the default (issue 13): the same file without the flag
    assert {s.cluster.gpu_per_node for s in stages()} == {0}


DTYPE_CASES = [
    ("auto", "bfloat16", "float32"),
    ("bf16", "bfloat16", "bfloat16"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("fp16", "float16", "float16"),
    ("half", "float16", "float16"),
    ("float16", "float16", "float16"),
    ("fp32", "float32", "float32"),
    ("float", "float32", "float32"),
    ("float32", "float32", "float32"),
]


def test_the_dtype_spellings_accepted_are_the_ones_derived_and_tested():
    """configs/checks.py's DTYPES (the range) is built from DTYPE_NAMES (what derive maps): every spelling it
    accepts but auto maps to a torch floating-point dtype, and the test below covers each."""
    assert {s for s, *_ in DTYPE_CASES} == set(DTYPES)
    assert all(isinstance(getattr(torch, DTYPE_NAMES.get(s, s)), torch.dtype) for s in DTYPES if s != "auto")


@pytest.mark.parametrize("spelling, on_gpu, on_cpu", DTYPE_CASES)
def test_every_dtype_spelling_reaches_every_consumer_as_a_torch_name(spelling, on_gpu, on_cpu, monkeypatch):
    """configs/checks.py accepts nine spellings; configs.derive turns each into the torch name that the trainer
    (train.engine_dtype), models.load_model and vLLM's engine arguments (tests/fake_vllm checks vLLM's names) read."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for gpus, want in (("1", on_gpu), ("0", on_cpu)):
        *_, rft = stages("--cluster.gpu_per_node", gpus, "--explorer.rollout_model.dtype", spelling)
        assert rft.explorer.rollout_model.dtype == want
        assert configs.derive(rft).explorer.rollout_model.dtype == want  # idempotent
        assert torch_dtype(want) == getattr(torch, want)
        cuda = train.engine_dtype(rft, torch.device("cuda"))
        assert cuda == getattr(torch, want) and train.engine_dtype(rft, torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="'bf16' is not a torch floating-point dtype name"):
        torch_dtype("bf16")  # a caller that skipped configs.derive is told so


def test_the_launcher_picks_gpus_from_its_own_cuda_visible_devices(monkeypatch, tmp_path, capsys):
    """`CUDA_VISIBLE_DEVICES=3 bash run.sh ...`: the children run on GPU 3, not on GPU 0; a split indexes into the
    launcher's list; a layout that needs more GPUs than the list shows is a config error before anything starts."""
    *_, rft = stages("--cluster.gpu_per_node", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    cmds = launch.commands(rft, tmp_path / "c.yaml")
    assert cmds["explorer"][1] == cmds["trainer"][1] == {"CUDA_VISIBLE_DEVICES": "3"}
    *_, split = stages("--cluster.gpu_per_node", "3")  # HF engine on the first GPU, the trainer on the other two
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1, 5,7")
    cmds = launch.commands(split, tmp_path / "c.yaml")
    assert (cmds["explorer"][1], cmds["trainer"][1]) == (
        {"CUDA_VISIBLE_DEVICES": "GPU-a1"},
        {"CUDA_VISIBLE_DEVICES": "5,7"},
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    with pytest.raises(ConfigError, match=r"needs GPUs \[1, 2\] of this node's, but CUDA_VISIBLE_DEVICES='5,7'"):
        launch.commands(split, tmp_path / "c.yaml")
    monkeypatch.setattr(launch, "run_stage", lambda *a: pytest.fail("a stage started"))
    assert (
        launch.run(cli(["--config", TINY, "--cluster.gpu_per_node", "3", "--checkpoint_root_dir", str(tmp_path)])[0])
        == 2
    )
    assert "config error: cluster: the layout needs GPUs [1, 2]" in capsys.readouterr().err


def test_trinitys_memory_sync_is_the_process_group_through_host_memory(monkeypatch):
    """Trinity's sync_method memory (the full weights through host memory, forced when colocated) is nanorft's
    process-group method: on one shared GPU its group is gloo, i.e. through host memory; where the process group
    does not apply (a lone trainer) it falls back to checkpoint, as nccl does."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, sft, rft = stages("--cluster.gpu_per_node", "1", "--synchronizer.sync_method", "memory")
    assert (rft.synchronizer.sync_method, rft.cluster.colocate) == ("nccl", True)
    assert (sft.mode, sft.synchronizer.sync_method) == ("train", "checkpoint")
