"""The studio's config page (studio/config_page.py, Streamlit's AppTest) and its model of the schema
(studio/schema_form.py): every key with its docstring, choices and range; a key added to the schema appears with no
edit of the page; generate -> launch.py --dry-run accepts it; load -> save round trip for every YAML in configs/ and
Trinity-RFT's examples; the loader's own refusal beside its field; secrets as ***; launch and stop as Ctrl-C."""

import ast
import dataclasses
import json
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from streamlit.testing.v1 import AppTest

from configs import resolve_stages
from configs.schema import Config
from errors import ConfigError
from helpers import both_config
from studio import launcher
from studio import schema_form as sf

ROOT = Path(__file__).resolve().parents[1]
PAGE = "studio/config_page.py"


def page(config: Path | str | None = None, expert: bool = False) -> AppTest:
    """The page run once (on `config`, as `?config=PATH` opens it), in expert mode if asked."""
    at = AppTest.from_file(str(ROOT / PAGE), default_timeout=120)
    if config:
        at.query_params["config"] = str(config)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    if expert:
        at.radio(key="cfp:view").set_value("expert").run()
        assert not at.exception, [e.value for e in at.exception]
    return at


def flat(node) -> list:
    """The page's elements in the order drawn (blocks opened)."""
    children = getattr(node, "children", None)
    if children is None:
        return [node]
    return [leaf for child in children.values() for leaf in flat(child)]


def widget(at: AppTest, key: str):
    return next(e for e in flat(at.main) if getattr(e, "key", None) == key)


def after(at: AppTest, key: str) -> list:
    """The elements right after the widget `key` up to the next widget: its error, if any."""
    elements = flat(at.main)
    i = next(i for i, e in enumerate(elements) if getattr(e, "key", None) == key)
    out = []
    for e in elements[i + 1 :]:
        if getattr(e, "key", None):
            break
        out.append(e)
    return out


def attribute_docstrings() -> dict[tuple[str, str], str]:
    """(class, field) -> the string literal under it in configs/schema.py, read with ast (independently of tyro)."""
    tree = ast.parse((ROOT / "configs/schema.py").read_text())
    out = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node, nxt in zip(cls.body, cls.body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                out[cls.name, node.target.id] = " ".join(nxt.value.value.split())
    return out


def every_path(cls: type = Config, prefix: str = "") -> list[str]:
    """Every field's path, walked with dataclasses directly: items of a list of sections as [], of a mapping as *."""
    out = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        out.append(path)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out += every_path(type(default), f"{path}.")
        else:
            item = sf._items_class(sf._unwrap(sf.type_hints(cls)[f.name])[0])
            if item:
                out += every_path(item[1], f"{path}[]." if item[0] == "list" else f"{path}.*.")
    return out


# --- the schema's model


def test_schema_fields_cover_the_schema_with_docstrings_choices_and_ranges():
    fields = {f.path: f for f in sf.schema_fields()}
    assert sorted(fields) == sorted(every_path())
    items = (
        "buffer.explorer_input.tasksets[].format.prompt_key",
        "buffer.explorer_input.eval_tasksets[].name",
        "explorer.auxiliary_models[].model_path",
        "model.lora_configs[].lora_rank",
        "stages[].stage_name",
        "data_processor.task_pipeline.operators[].name",
        "buffer.trainer_input.auxiliary_buffers.*.path",
    )
    for item in items:
        assert item in fields, item
    docs = attribute_docstrings()
    for f in fields.values():
        if f.owner.__module__ == "configs.schema":
            assert " ".join(f.doc.split()) == docs[f.owner.__name__, f.name], f.path
        assert f.doc, f.path
    assert fields["mode"].choices == ("both", "train", "explore", "bench")
    assert fields["algorithm.optimizer.lr"].range_text == "> 0"  # checks.RANGES
    assert "range: > 0" in fields["algorithm.optimizer.lr"].help
    assert "one of none, " in fields["algorithm.rollout_correction.rollout_rs"].range_text  # checks.ranges()


def test_every_field_in_exactly_one_expert_section_and_beginner_keys_exist():
    tops = [f.name for f in dataclasses.fields(Config)]
    for top in tops:
        named = [name for name, keys in sf.SECTIONS.items() if top in keys]
        assert len(named) <= 1, top
    for f in sf.schema_fields():
        assert [name for name in sf.SECTIONS if name == f.section] == [f.section]
    assert {sf.section_of(p) for p in ("cluster.node_num", "log.level", "stages", "project")} == {"the rest"}
    assert sf.section_of("algorithm.optimizer.lr") == "trainer" and sf.section_of("synchronizer.sync_method") == (
        "explorer and synchronizer"
    )
    for path in sf.BEGINNER:
        assert sf.field_at(path) is not None, path


def test_error_field_is_the_longest_path_named():
    raw = dataclasses.asdict(sf.load(ROOT / "configs/tiny.yaml"))
    assert sf.error_field("algorithm.optimizer.lr: -1.0 is out of range; allowed: > 0", raw) == "algorithm.optimizer.lr"
    assert sf.error_field("stages[0] (eval_base): algorithm.optimizer.lr: -1.0 is out of range", raw) == (
        "algorithm.optimizer.lr"  # inherited: the global key
    )
    assert sf.error_field("stages[1] (sft_warmup): algorithm.optimizer.lr: -1.0 is out", raw) == "stages[1].algorithm"
    assert sf.error_field("monitor.monitor_type[0]: 'x' is not one of [...]", raw) == "monitor.monitor_type"
    assert sf.error_field("something else entirely", raw) == ""


# --- round trips


@pytest.mark.parametrize("path", sf.example_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_load_save_round_trip(path, tmp_path):
    cfg = sf.load(path)
    saved = sf.save(cfg, tmp_path / "sub" / "saved.yaml")
    assert sf.load(saved) == cfg
    # the keys a person writes: none at its default
    assert all(getattr(Config(), k) != getattr(cfg, k) for k in yaml.safe_load(saved.read_text()))


def test_every_config_yaml_is_offered():
    offered = set(sf.example_configs())
    assert set((ROOT / "configs").rglob("*.yaml")) <= offered
    assert set((ROOT / "tests/data/reference_configs").glob("*.yaml")) <= offered


@pytest.mark.slow(40)
@pytest.mark.parametrize("name", ["configs/tiny.yaml", "tests/data/reference_configs/grpo_example.yaml"])
def test_saved_copy_passes_dry_run_with_the_same_resolved_config(name, tmp_path):
    saved = sf.save(sf.load(ROOT / name), tmp_path / "elsewhere" / "copy.yaml")
    outs = [
        subprocess.run([sys.executable, "launch.py", "--config", str(p), "--dry-run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
        for p in (ROOT / name, saved)
    ]  # fmt: skip
    assert [o.returncode for o in outs] == [0, 0], outs[1].stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout


def test_a_file_spec_keeps_working_when_saved_elsewhere(tmp_path):
    """`file.py:attr` is relative to the YAML's folder (anchor_files); a copy saved elsewhere holds it absolute. A
    model or data path is relative to where launch.py runs (the repository): kept as written."""
    (tmp_path / "a").mkdir()
    src = tmp_path / "a" / "mine.yaml"
    src.write_text("model: {model_path: assets/tiny-qwen2}\nbuffer: {default_reward_fn_type: rewards/mine.py:score}\n")
    cfg = sf.load(src)
    assert cfg.buffer.default_reward_fn_type == f"{tmp_path / 'a' / 'rewards' / 'mine.py'}:score"
    saved = sf.save(cfg, tmp_path / "b" / "c" / "copy.yaml")
    assert sf.load(saved) == cfg
    assert yaml.safe_load(saved.read_text())["model"] == {"model_path": "assets/tiny-qwen2"}


# --- the page


@pytest.mark.slow(15)
def test_page_shows_every_key_with_docstring_choices_and_range():
    at = page(ROOT / "configs/tiny.yaml", expert=True)
    table = at.dataframe[0].value
    fields = sf.schema_fields()
    assert list(table["key"]) == [f.path for f in fields]
    assert list(table["doc"]) == [f.doc for f in fields]
    mode = widget(at, "cf:mode")
    assert mode.options == ["both", "train", "explore", "bench"] and mode.value == "both"
    lr = widget(at, "cf:algorithm.optimizer.lr")
    assert lr.value == 5e-5 and "Peak learning rate of the actor." in lr.help and "range: > 0" in lr.help
    # a list of sections: one expander per item, each with the item's fields
    assert widget(at, "cf:stages[1].stage_name").value == "sft_warmup"
    assert "Stage name" in widget(at, "cf:stages[1].stage_name").help
    drawn = {e.key for e in flat(at.main) if str(getattr(e, "key", "")).startswith("cf:")}
    for f in fields:  # every top-level field and section key has its widget
        if "[" not in f.path and "*" not in f.path and f.kind not in ("section", "items"):
            assert f"cf:{f.path}" in drawn, f.path


@pytest.mark.slow(40)
def test_a_key_added_to_the_schema_appears_without_editing_the_page(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv", "checkpoints", "assets", "__pycache__", "docs")
    )
    schema = repo / "configs" / "schema.py"
    anchor = "    monitor_args: ArgsDict = _field(dict)\n"
    text = schema.read_text()
    assert anchor in text
    added = '    studio_probe: int = 7\n    """A key the test added: its docstring reaches the page."""\n'
    schema.write_text(text.replace(anchor, added + anchor, 1))
    script = (
        "import json\nfrom streamlit.testing.v1 import AppTest\n"
        "at = AppTest.from_file('studio/config_page.py', default_timeout=120)\nat.run()\n"
        "at.radio(key='cfp:view').set_value('expert').run()\n"
        "w = [e for e in at.number_input if e.key == 'cf:monitor.studio_probe']\n"
        "print(json.dumps({'help': w[0].help if w else None, 'value': w[0].value if w else None,"
        " 'errors': [e.value for e in at.exception]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shown = json.loads(out.stdout.strip().splitlines()[-1])
    assert shown["errors"] == [] and shown["value"] == 7
    assert "A key the test added: its docstring reaches the page." in shown["help"]
    assert "default: 7" in shown["help"]


@pytest.mark.slow(40)
def test_generated_beginner_config_passes_dry_run(tiny_model_dir, tmp_path):
    at = page()
    data = str(Path(tiny_model_dir).parent / "arith")
    values = {
        "project": "p", "name": "studio", "checkpoint_root_dir": str(tmp_path / "ck"),
        "model.model_path": tiny_model_dir,
        "buffer.explorer_input.taskset.name": "arith", "buffer.explorer_input.taskset.path": data,
        "buffer.explorer_input.taskset.split": "train", "buffer.explorer_input.taskset.format.prompt_key": "question",
        "buffer.explorer_input.taskset.format.response_key": "answer",
        "buffer.default_workflow_type": "math_workflow", "buffer.default_reward_fn_type": "math_reward",
        "algorithm.algorithm_type": "grpo",
    }  # fmt: skip
    for key, value in values.items():
        widget(at, f"cf:{key}").set_value(value)
    numbers = {"algorithm.repeat_times": 2, "buffer.total_steps": 2, "buffer.batch_size": 2,
               "model.max_prompt_tokens": 160, "model.max_response_tokens": 12}  # fmt: skip
    for key, value in numbers.items():
        widget(at, f"cf:{key}").set_value(value)
    widget(at, "cf:algorithm.optimizer.lr").set_value(1e-4)
    widget(at, "cfp:save_path").set_value(str(tmp_path / "made.yaml"))
    at.run()
    assert not at.error, [e.value for e in at.error]
    widget(at, "cfp:save").click().run()
    saved = yaml.safe_load((tmp_path / "made.yaml").read_text())
    assert saved["algorithm"] == {"algorithm_type": "grpo", "repeat_times": 2, "optimizer": {"lr": 1e-4}}
    assert saved["model"] == {"model_path": tiny_model_dir, "max_prompt_tokens": 160, "max_response_tokens": 12}
    out = subprocess.run([sys.executable, "launch.py", "--config", str(tmp_path / "made.yaml"), "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    resolved = yaml.safe_load(out.stdout)
    assert resolved["buffer"]["train_batch_size"] == 4  # derived: batch_size 2 x repeat_times 2
    assert resolved["model"]["model_path"] == tiny_model_dir


def _loader_message(cfg: Config) -> str:
    with pytest.raises(ConfigError) as e:
        resolve_stages(cfg)
    return str(e.value)


@pytest.mark.slow(15)
def test_refused_values_show_the_loaders_message_beside_their_field():
    at = page(ROOT / "configs/tiny_ppo.yaml")
    cfg = sf.load(ROOT / "configs/tiny_ppo.yaml")
    assert not at.error
    widget(at, "cf:algorithm.optimizer.lr").set_value(-1.0).run()
    expected = _loader_message(dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, optimizer=dataclasses.replace(cfg.algorithm.optimizer, lr=-1.0))))  # fmt: skip
    assert "algorithm.optimizer.lr: -1.0 is out of range; allowed: > 0" in expected
    assert [e.value for e in after(at, "cf:algorithm.optimizer.lr") if e.type == "error"] == [expected]
    assert [e.value for e in at.error] == [expected]  # only there
    widget(at, "cf:algorithm.optimizer.lr").set_value(1e-5).run()
    assert not at.error
    widget(at, "cf:algorithm.algorithm_type").set_value("no_such_algo").run()
    expected = _loader_message(dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, algorithm_type="no_such_algo")))  # fmt: skip
    assert "no_such_algo" in expected
    assert [e.value for e in after(at, "cf:algorithm.algorithm_type") if e.type == "error"] == [expected]
    widget(at, "cf:algorithm.algorithm_type").set_value("ppo").run()
    at.radio(key="cfp:view").set_value("expert").run()
    widget(at, "cf:monitor.monitor_type").set_value("[tensorbord]").run()  # a bad Literal (list of them)
    shown = [e.value for e in after(at, "cf:monitor.monitor_type") if e.type == "error"]
    assert len(shown) == 1 and shown[0].startswith("monitor.monitor_type[0]: 'tensorbord' is not one of")
    assert "did you mean tensorboard?" in shown[0]
    assert at.button(key="cfp:save").disabled  # nothing refused is saved


@pytest.mark.slow(15)
def test_load_from_the_list_keeps_the_address_and_items_are_added_and_removed():
    at = page("no/such/file.yaml")  # the loader's refusal, and the defaults meanwhile
    assert [e.value for e in at.error][0].startswith("no/such/file.yaml: cannot be read")
    assert "editing: the defaults" in at.caption[0].value
    at.selectbox(key="cfp:pick").set_value("configs/tiny_ppo.yaml")
    at.button(key="cfp:load").click().run()
    assert at.query_params["config"] == "configs/tiny_ppo.yaml"  # a reload opens the same file
    assert "editing: configs/tiny_ppo.yaml" in at.caption[0].value
    at.radio(key="cfp:view").set_value("expert").run()
    evals = sf.load(ROOT / "configs/tiny_ppo.yaml").buffer.explorer_input.eval_tasksets
    n = len(evals)
    at.button(key="cfp:add:buffer.explorer_input.eval_tasksets").click().run()
    item = f"buffer.explorer_input.eval_tasksets[{n}]"
    assert [e.value for e in after(at, f"cf:{item}.path") if e.type == "error"] == [f"{item}.path is required"]
    given = {"name": "extra", "path": "assets/arith", "split": "test", "format.prompt_key": "question",
             "format.response_key": "answer"}  # fmt: skip
    for key, value in given.items():
        widget(at, f"cf:{item}.{key}").set_value(value)
    at.run()
    assert not at.error, [e.value for e in at.error]
    assert "- name: extra" in at.code[0].value
    new = f"cf:{item}.name"
    assert "Tasksets evaluated" in " ".join(e.value for e in at.markdown)
    at.button(key=f"cfp:remove:buffer.explorer_input.eval_tasksets[{n}]").click().run()
    assert not any(getattr(e, "key", None) == new for e in flat(at.main))
    assert "extra" not in at.code[0].value


@pytest.mark.slow(10)
def test_the_loaders_and_checks_warnings_are_shown_on_every_rerun():
    at = page(ROOT / "tests/data/reference_configs/ppo_example.yaml")
    for _ in range(2):  # checks warns once per process; the page on every rerun
        warned = [e.value for e in at.warning]
        assert "config: trainer.trainer_config.critic.model.use_remove_padding (veRL) has no meaning in nanorft and " \
            "is not used" in warned  # fmt: skip
        assert any(w.endswith("no workflow runs these tasks, and an explorer refuses to start") for w in warned)
        at.run()


@pytest.mark.slow(15)
def test_secrets_are_hidden_in_the_page(tmp_path):
    cfg = sf.load(ROOT / "configs/tiny_ppo.yaml")
    cfg.explorer.env_vars = {"HF_HOME": "/srv/hf-cache-sekrit1"}
    cfg.monitor.monitor_args = {"api_key": "sekrit2-key", "base_url": "http://wandb.local"}
    cfg.explorer.rollout_model.openai_api_key = "sekrit3"
    source = sf.save(cfg, tmp_path / "secret.yaml")
    assert stat.S_IMODE(source.stat().st_mode) == 0o600  # holds_secret: only its owner may read it
    at = page(source, expert=True)
    code = at.code[0].value
    assert "'***'" in code and "http://wandb.local" in code
    assert not at.error, [e.value for e in at.error]
    shown = [e.value for e in at.code] + [e.value for e in at.text_area] + [e.value for e in at.markdown]
    assert not any("sekrit" in str(v) for v in shown), shown
    key = widget(at, "cf:explorer.rollout_model.openai_api_key")  # a secret string: a password input
    assert key.value == "sekrit3" and key.proto.type == key.proto.PASSWORD
    assert widget(at, "cf:explorer.rollout_model.model_path").proto.type == key.proto.DEFAULT
    widget(at, "cfp:save_path").set_value(str(tmp_path / "out.yaml"))
    widget(at, "cfp:save").click().run()
    back = sf.load(tmp_path / "out.yaml")  # the saved file keeps the real values (0600)
    assert back.explorer.env_vars == cfg.explorer.env_vars and back.monitor.monitor_args == cfg.monitor.monitor_args
    assert back.explorer.rollout_model.openai_api_key == "sekrit3"
    assert stat.S_IMODE((tmp_path / "out.yaml").stat().st_mode) == 0o600


@pytest.mark.slow(10)
def test_a_sigterm_while_the_explorer_leaves_prints_no_traceback():
    """What a stop showed once in three: launch.py SIGTERMs the explorer that the Ctrl-C is already ending, and its
    SIGTERM handler (explore.py's __main__) raised SystemExit inside an exit hook: a traceback on the console."""
    script = (
        "import atexit, os, signal, sys, time\nimport explore\n"
        "signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))  # as explore.py's __main__\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5), print('hook done')))\n"
        "explore.leave(130)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 130 and "hook done" in out.stdout, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "SystemExit" not in out.stderr, out.stderr[-2000:]


@pytest.mark.slow(90)
def test_launch_shows_the_console_and_stop_is_ctrl_c(tiny_model_dir, tmp_path):
    config = both_config(tmp_path, tiny_model_dir, **{"buffer.total_steps": 200})
    saved = tmp_path / "saved.yaml"
    at = page(config)
    widget(at, "cfp:save_path").set_value(str(saved))
    widget(at, "cfp:launch").click().run()
    run = launcher.current(saved)
    assert run is not None and run.running
    try:
        deadline = time.monotonic() + 240
        while "step 1" not in launcher.tail(run.log) and run.running and time.monotonic() < deadline:
            time.sleep(1)
        assert run.running, launcher.tail(run.log)[-3000:]
        at.run()
        console = at.code[-1].value
        assert "step 1" in console, console[-2000:]
        assert launcher.start(saved) is run  # one running launch per saved file
        widget(at, "cfp:stop").click().run()
        code = run.proc.wait(timeout=120)
    finally:
        if run.running:
            os.killpg(run.proc.pid, signal.SIGKILL)
    assert code == 130, launcher.tail(run.log)[-3000:]  # launch.py's exit on Ctrl-C
    deadline = time.monotonic() + 30
    while launcher.group_alive(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not launcher.group_alive(run)
    console = launcher.tail(run.log)
    assert "Traceback" not in console and "interrupted: stopping trainer, explorer" in console, console[-3000:]
    # stopped cleanly: the summary written, the DB whole, the latest checkpoint complete
    job = tmp_path / "ck" / "p" / "run"
    summary = json.loads((job / "summary.json").read_text())
    latest = int((job / "latest_state_dict_iteration.txt").read_text())
    assert summary["steps"] == latest >= 1
    assert (job / f"global_step_{latest}" / "actor" / "huggingface" / "model.safetensors").is_file()
    with sqlite3.connect(f"file:{job / 'buffer' / 'exp.db'}?mode=ro", uri=True) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    at.run()
    assert "ended (exit code 130)" in " ".join(e.value for e in at.markdown)
