"""configs/hub.py: a hub id (model or taskset) that this machine can neither find in its cache nor download is one
named pre-flight line, found in one probe of the endpoint (not by huggingface_hub's retries); a cached one passes and
the processes then run offline; with a reachable hub the launcher downloads it once, with a progress bar, before any
process starts. The hub is tests/fake_hub.py's stand-in over HF_ENDPOINT: a closed port, a port that never answers,
or a server of the tiny model's files."""

import os
import shutil
import time
from pathlib import Path

import entry
import pytest
from fake_hub import COMMIT, FakeHub, SilentPort, closed_port
from huggingface_hub import constants

from configs import cli, resolve_stages
from configs.hub import PROBE_TIMEOUT_S, _probe, fetch_hub, hub_problems
from configs.preflight import preflight
from errors import ConfigError
from helpers import both_config, sft_config

FMT = {"prompt_key": "question", "response_key": "answer"}
EVAL = [{"name": "ev", "path": "org/tasks", "subset_name": "main", "split": "test", "format": FMT}]


def hub_config(tmp_path: Path, tiny_model_dir: str) -> Path:
    """both_config with hub ids for its model and both tasksets (one training, one eval)."""
    return both_config(
        tmp_path,
        tiny_model_dir,
        **{
            "model.model_path": "org/absent",
            "buffer.explorer_input.taskset.path": "org/tasks",
            "buffer.explorer_input.taskset.subset_name": "main",
            "buffer.explorer_input.eval_tasksets": EVAL,
        },
    )


def hub_env_of(tmp_path: Path, endpoint: str) -> dict[str, str | None]:
    """What a launcher's environment changes (entry.run_process): HF_HOME in tmp_path/hf, the hub at `endpoint`, no
    offline switch. NOTE: huggingface_hub reads them at import: a process of its own."""
    unset = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE")
    return {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), **dict.fromkeys(unset)}  # None: unset


def expected_lines(tmp_path: Path, why: str) -> list[str]:
    cwd, cache, dcache = Path.cwd(), tmp_path / "hf" / "hub", tmp_path / "hf" / "datasets"
    taskset = (
        f"'org/tasks' (subset 'main') is no local file or folder (from {cwd}) nor a dataset in the datasets cache "
        f"({dcache}), and the hub cannot give it ({why}): set {{}} to a local file or folder, or fill the cache once "
        "where the hub is reachable (a run there does) and run with HF_DATASETS_OFFLINE=1"
    )
    return [
        f"model.model_path = 'org/absent': 'org/absent' is no local folder (from {cwd}) nor a model in the HF cache "
        f"({cache}), and the hub cannot give it ({why}): set model.model_path to a local model folder, or fill the "
        "cache once where the hub is reachable (`hf download org/absent`) and run with HF_HUB_OFFLINE=1",
        "buffer.explorer_input.taskset.path (tasksets[0]) = 'org/tasks': "
        + taskset.format("buffer.explorer_input.taskset.path (tasksets[0])"),
        "buffer.explorer_input.eval_tasksets[0].path = 'org/tasks': "
        + taskset.format("buffer.explorer_input.eval_tasksets[0].path"),
    ]


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """This process's HF caches in tmp_path/hf (empty), downloads on, the endpoint probe forgotten."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    _probe.cache_clear()
    yield monkeypatch
    _probe.cache_clear()


@pytest.mark.parametrize("endpoint", ["closed port", "silent port"])
def test_hub_ids_without_hub_access_are_named_in_one_line_each_after_one_short_probe(
    tmp_path, tiny_model_dir, hub_env, endpoint
):
    """Before: with downloads on (HF_HUB_OFFLINE unset) a hub id passed the pre-flight, and the explorer and trainer
    each retried the hub (1+2+4+8+8 s per file) before failing without naming the key; taskset ids were not checked.
    Now one HEAD to the endpoint decides, with a 2.5 s timeout, once for all three ids: a refused connection at once,
    a port that never answers at the timeout."""
    (stage,) = resolve_stages(cli(["--config", str(hub_config(tmp_path, tiny_model_dir))])[0])
    with SilentPort() as silent:
        url = closed_port() if endpoint == "closed port" else silent
        hub_env.setattr(constants, "ENDPOINT", url)
        start = time.monotonic()
        with pytest.raises(ConfigError) as info:
            preflight([stage])
        took = time.monotonic() - start
    reason = "[Errno 111] Connection refused" if endpoint == "closed port" else "timed out"
    why = f"no answer from {url} within 2.5 s ({reason})"
    assert str(info.value) == "this machine cannot run the config:\n  " + "\n  ".join(expected_lines(tmp_path, why))
    if endpoint == "closed port":
        assert took < 1.0, took
    else:  # one probe for three hub ids: one timeout, not three
        assert PROBE_TIMEOUT_S <= took < 2 * PROBE_TIMEOUT_S, took


def test_hub_offline_switches_name_the_switch_without_asking_the_hub(tmp_path, tiny_model_dir, hub_env):
    """HF_HUB_OFFLINE (models and datasets) and HF_DATASETS_OFFLINE (datasets only) are read as they are: no probe."""
    (stage,) = resolve_stages(cli(["--config", str(hub_config(tmp_path, tiny_model_dir))])[0])
    with SilentPort() as silent:
        hub_env.setattr(constants, "ENDPOINT", silent)  # a probe would take 2.5 s
        hub_env.setenv("HF_DATASETS_OFFLINE", "1")
        hub_env.setattr(constants, "HF_HUB_OFFLINE", True)
        start = time.monotonic()
        lines = [line for line, _ in hub_problems([stage])]
        assert time.monotonic() - start < 1.0
        assert lines == expected_lines(tmp_path, "HF_HUB_OFFLINE is set")
        hub_env.setattr(constants, "HF_HUB_OFFLINE", False)
        with FakeHub({}) as hub:  # a hub that answers: the model can be downloaded
            hub_env.setattr(constants, "ENDPOINT", hub.url)
            lines = [line for line, _ in hub_problems([stage])]
        assert lines == expected_lines(tmp_path, "HF_DATASETS_OFFLINE is set")[1:]


def test_a_hub_id_the_hub_does_not_have_is_named_by_the_download_before_anything_starts(
    tmp_path, tiny_model_dir, hub_env
):
    """The hub answers but has no such repo (a typo): the launcher's download fails naming the key (exit 2 in
    configs.entry), instead of each process failing in transformers."""
    (stage,) = resolve_stages(cli(["--config", str(hub_config(tmp_path, tiny_model_dir))])[0])
    with FakeHub({}) as hub:
        hub_env.setattr(constants, "ENDPOINT", hub.url)
        with pytest.raises(ConfigError) as info:
            fetch_hub([stage])
    assert str(info.value).startswith(
        "model.model_path = 'org/absent': downloading it from the hub failed: RepositoryNotFoundError: "
    ), str(info.value)


def cache_model(tmp_path: Path, tiny_model_dir: str, repo: str) -> None:
    """The tiny model as `repo` in tmp_path/hf/hub, laid out as huggingface_hub's cache."""
    root = tmp_path / "hf" / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(tiny_model_dir, root / "snapshots" / COMMIT)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)


def test_cached_hub_ids_pass_without_the_hub_and_the_processes_then_run_offline(tmp_path, tiny_model_dir, hub_env):
    """A model in the HF cache and a dataset in `datasets`' cache are no problem without network; the launcher then
    sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, so that its processes read the cache without retrying the hub."""
    (stage,) = resolve_stages(cli(["--config", str(hub_config(tmp_path, tiny_model_dir))])[0])
    stage.model.model_path = stage.model.critic_model_path = "org/cached"
    cache_model(tmp_path, tiny_model_dir, "org/cached")
    (tmp_path / "hf" / "datasets" / "org___tasks" / "main" / "0.0.0" / "abc123").mkdir(parents=True)
    hub_env.setattr(constants, "ENDPOINT", closed_port())
    assert hub_problems([stage]) == []
    fetch_hub([stage])
    assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert constants.HF_HUB_OFFLINE is True


def test_a_cached_hub_id_loads_the_tokenizer_its_folder_loads(tmp_path, tiny_model_dir, hub_env):
    """models.load_tokenizer reads a hub id's tokenizer_config.json in the HF cache, as a folder's: before, a hub id
    went to AutoTokenizer, which gave the tiny model Qwen2Tokenizer (an NFC normalizer: other ids for "cafe\u0301")."""
    from models import load_tokenizer

    cache_model(tmp_path, tiny_model_dir, "org/cached")
    hub_env.setattr(constants, "HF_HUB_OFFLINE", True)
    hub, folder = load_tokenizer("org/cached"), load_tokenizer(tiny_model_dir)
    assert type(hub) is type(folder)
    assert hub.encode("cafe\u0301") == folder.encode("cafe\u0301") != folder.encode("caf\u00e9")


@pytest.mark.slow(seconds=15)
def test_the_launcher_names_hub_ids_it_cannot_have_and_starts_nothing(tmp_path, tiny_model_dir):
    """Trinity's GSM8K case in small: the launcher exits 2 with the named lines, no retry line, no traceback, no run
    directory (before: both processes started and retried the hub for a minute)."""
    config = hub_config(tmp_path, tiny_model_dir)
    url = closed_port()
    out = entry.run_process("launch.py", "--config", str(config), env=hub_env_of(tmp_path, url), timeout=120)
    why = f"no answer from {url} within 2.5 s ([Errno 111] Connection refused)"
    lines = expected_lines(tmp_path, why)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == "config error: this machine cannot run the config:\n  " + "\n  ".join(lines)
    assert not (tmp_path / "ck").exists()


@pytest.mark.slow(seconds=45)
def test_with_a_hub_the_launcher_downloads_model_and_data_once_before_the_processes_start(tmp_path, tiny_model_dir):
    """A reachable hub (the fake one over HF_ENDPOINT, serving the tiny model as org/tiny and its SFT data as dataset
    org/sft): the launcher downloads both into the caches with progress bars before the trainer starts, which then
    finds them there (each file fetched once in the whole run); a second run, with no hub (a closed port), runs from
    those caches: the launcher runs its processes offline, so that they read the cache at once (before:
    huggingface_hub retried the hub for every file, "Retrying in 1s [Retry 1/5]"..., before it fell back on the
    cache). One test for both (a launcher run here starts its processes afresh: HF_* set)."""
    data = tmp_path / "sft_repo"
    data.mkdir()
    shutil.copy(Path(tiny_model_dir).parent / "arith" / "sft.jsonl", data / "train.jsonl")
    config = sft_config(
        tmp_path,
        tiny_model_dir,
        **{"model.model_path": "org/tiny", "buffer.trainer_input.experience_buffer.path": "org/sft"},
    )
    with FakeHub({"org/tiny": tiny_model_dir, "datasets/org/sft": data}) as hub:
        out = entry.run_process("launch.py", "--config", str(config), env=hub_env_of(tmp_path, hub.url), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "Fetching 6 files: 100%" in out.stderr  # huggingface_hub's bar, in the launcher
    rows = len((data / "train.jsonl").read_text().splitlines())
    assert f"Generating train split: {rows} examples" in out.stderr, out.stderr[-3000:]  # `datasets`' bar
    model, dataset, stage = (
        log.index("downloading model org/tiny"),
        log.index("downloading dataset org/sft"),
        log.index("stage t: mode train"),
    )
    assert model < stage and dataset < stage, log[-3000:]
    gets = [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(p.rsplit("/", 1)[1] for p in gets) == sorted(
        [p.name for p in Path(tiny_model_dir).iterdir()] + ["train.jsonl"]
    ), hub.requests
    snapshot = tmp_path / "hf" / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in Path(tiny_model_dir).iterdir())
    # the hub gone: the caches the launcher filled pass the pre-flight and the run reads them, retrying nothing
    again = entry.run_process(
        "launch.py", "--config", str(config), "--name", "t2", env=hub_env_of(tmp_path, closed_port()), timeout=300
    )
    assert again.returncode == 0 and "Retry" not in again.stdout + again.stderr, again.stderr[-3000:]
    assert (tmp_path / "ck" / "p" / "t2").is_dir()
