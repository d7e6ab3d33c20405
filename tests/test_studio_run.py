"""The studio's run page (studio/run_page.py over studio/runs.py) with Streamlit's AppTest, on a run directory that a
short real launcher run wrote (a bench stage, SFT, GRPO in mode both): each stage's curves on the global step axis,
the summary; lines appended while the page is open appear at its next run, a torn last line is left for later; the
running / failed / stopped states; a directory that is no job dir gets a message."""

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
from streamlit import dataframe_util  # the studio extra: `bash run.sh test` installs it
from streamlit.testing.v1 import AppTest

from helpers import ROOT, launch, sft_config
from studio import runs

PAGE = str(ROOT / "studio" / "run_page.py")


@pytest.fixture(scope="module")
def run_dir(staged_run) -> Path:
    """<root>/ck/p/run as `launch.py` leaves it after three stages (conftest's staged_run, which tests/test_launch.py
    reads too): eval_base (bench), sft (2 steps), rft (3 steps, an evaluation at steps 0 and 2 and at the end)."""
    root, out = staged_run
    assert out.returncode == 0, out.stderr[-4000:]
    return root / "ck" / "p" / "run"


@pytest.fixture
def copy_of(run_dir, tmp_path) -> Path:
    """A copy of the run to edit (the module's run stays as written)."""
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def page(job: str | Path) -> AppTest:
    at = AppTest.from_file(PAGE, default_timeout=60)
    at.query_params["job"] = str(job)
    return at.run()


def charts(at: AppTest) -> dict[str, "list[dict]"]:
    """Each drawn chart's curve rows (its first dataset), by the key of its container (run_chart_<curve>)."""
    out = {}
    for block in _blocks(at):
        key = block_key(block)
        if key.startswith("run_chart_"):
            for el in _elements(block):
                if el.type in ("vega_lite_chart", "arrow_vega_lite_chart"):  # its name since Streamlit 1.5x, before
                    data = el.proto.datasets[0].data.data
                    out[key] = dataframe_util.convert_arrow_bytes_to_pandas_df(data).to_dict("records")
    return out


def specs(at: AppTest) -> dict[str, dict]:
    """Each drawn chart's Vega-Lite spec, by the key of its container."""
    return {
        block_key(b): json.loads(el.proto.spec)
        for b in _blocks(at)
        if block_key(b).startswith("run_chart_")
        for el in _elements(b)
        if el.type in ("vega_lite_chart", "arrow_vega_lite_chart")
    }


def block_key(block) -> str:
    """A container's key: Block.key in recent Streamlit, else the end of its element id ($$ID-<hash>-<key>)."""
    if key := getattr(block, "key", None):
        return key
    match = re.fullmatch(r"\$\$ID-[0-9a-f]+-(.+)", getattr(block.proto, "id", ""))
    return match.group(1) if match else ""


def _blocks(at: AppTest):
    stack = list(at._tree.children.values())
    while stack:
        node = stack.pop()
        if type(node).__name__ == "Block":
            yield node
        stack.extend(getattr(node, "children", {}).values())


def _elements(block):
    stack = list(block.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(getattr(node, "children", {}).values())


def lines_of(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """A chart's curves: line -> [(global step, value)] in step order."""
    out: dict[str, list] = {}
    for r in sorted(rows, key=lambda r: r["global_step"]):
        out.setdefault(r["line"], []).append((r["global_step"], r["value"]))
    return out


def job_param(at: AppTest) -> str:
    """?job= as the page left it (AppTest gives a list or a string by Streamlit's version)."""
    value = at.query_params["job"]
    return value[-1] if isinstance(value, list) else value


def history(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow(seconds=90)
def test_the_page_shows_each_stages_curves_and_the_summary(run_dir):
    at = page(run_dir)
    assert not at.exception and not at.error
    summary = json.loads((run_dir / "summary.json").read_text())
    assert at.success[0].value.startswith(f"finished in {summary['wall_seconds']} s: stage rft, step 3 / 3")
    assert at.multiselect(key="run_metrics").value == ["reward", "accuracy", "loss"]
    assert at.toggle(key="run_live").value is False  # ended: nothing more to read
    got = charts(at)
    assert set(got) == {"run_chart_reward", "run_chart_accuracy", "run_chart_loss"}
    # reward: the rft stage's rollout reward at global steps 3..5 (after sft's 2), the values its explorer wrote
    explorer = history(run_dir / "rft" / "monitor" / "explorer.jsonl")
    want = [(2 + r["step"], r["rollout/reward/mean"]) for r in explorer if "rollout/reward/mean" in r]
    assert lines_of(got["run_chart_reward"]) == {"rft": want} and [s for s, _ in want] == [3, 4, 5]
    # accuracy: the bench stage's one point at 0 and rft's evaluations, as summary.json's eval_history holds them
    acc = lines_of(got["run_chart_accuracy"])
    assert set(acc) == {"eval_base", "rft"}
    evals = {(e["stage"].rsplit("/", 1)[-1], e["global_step"], e["accuracy"]) for e in summary["eval_history"]}
    assert {(line, g, v) for line, pts in acc.items() for g, v in pts} == evals
    assert [g for g, _ in acc["rft"]] == [2, 4, 5]
    # a panel per stage, as wide as reward_accuracy.png's segment of it: a bench stage's point 0.35 of a stage's
    panels = [(p["title"], p["width"]) for p in specs(at)["run_chart_accuracy"]["hconcat"]]
    assert [t for t, _ in panels] == ["eval_base", "rft"] and abs(panels[0][1] / panels[1][1] - 0.35) < 0.01
    # loss: sft's loss at steps 1, 2 and rft's policy loss at 3..5, each the trainer's own number
    loss = lines_of(got["run_chart_loss"])
    sft = history(run_dir / "sft" / "monitor" / "trainer.jsonl")
    assert loss["sft · actor/sft_loss"] == [(r["step"], r["actor/sft_loss"]) for r in sft if "actor/sft_loss" in r]
    rft = history(run_dir / "rft" / "monitor" / "trainer.jsonl")
    assert loss["rft · actor/pg_loss"] == [(2 + r["step"], r["actor/pg_loss"]) for r in rft if "actor/pg_loss" in r]
    # the summary, as summary.json holds it
    shown = {m.label: m.value for m in at.metric}
    for key, label in runs.SUMMARY_FIELDS.items():
        assert shown[label] == str(summary[key]), label
    assert any(summary["checkpoint"] in md.value for md in at.markdown)
    assert job_param(at) == str(run_dir)
    # another directory typed in the box: the address follows it (a reload shows that one)
    at.text_input(key="run_job").set_value(str(run_dir / "sft")).run()
    assert job_param(at) == str(run_dir / "sft") and set(charts(at)) == {"run_chart_loss"}
    assert "reward: nothing recorded yet" in [c.value for c in at.caption]


@pytest.mark.slow(seconds=90)
def test_one_stage_job_dir_and_another_metric(run_dir):
    at = page(run_dir / "sft")
    assert not at.exception and not at.error
    assert at.warning[0].value.startswith("not running, no summary.json")  # a stage's dir holds no summary
    at.multiselect(key="run_metrics").set_value(["actor/lr"]).run()
    sft = history(run_dir / "sft" / "monitor" / "trainer.jsonl")
    assert lines_of(charts(at)["run_chart_actor_lr"]) == {"sft": [(r["step"], r["actor/lr"]) for r in sft]}
    at.toggle(key="run_per_stage").set_value(False).run()  # one global step axis: one chart, the same curve
    assert "hconcat" not in specs(at)["run_chart_actor_lr"]
    assert lines_of(charts(at)["run_chart_actor_lr"]) == {"sft": [(r["step"], r["actor/lr"]) for r in sft]}


@pytest.mark.slow(seconds=90)
def test_lines_appended_while_the_page_is_open_appear_and_a_torn_line_waits(copy_of):
    """The run as it was after rft's step 1: the page shows it running; then its trainer and explorer write step 2
    and half of the explorer's step 3: the next run of the page shows step 2 only; the line completed, step 3 too."""
    (copy_of / "summary.json").unlink()
    (copy_of / "launch.lock").write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    later = {}  # history -> its lines of steps 2 and 3, held back
    for path in (copy_of / "rft" / "monitor").glob("*.jsonl"):
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(line for line in lines if json.loads(line)["step"] <= 1))
        later[path] = [line for line in lines if json.loads(line)["step"] > 1]
    at = page(copy_of)
    assert at.info[0].value.startswith("running: stage rft, step 1 / 3")
    assert at.toggle(key="run_live").value is True  # the page reads the files again every REFRESH_S
    assert [g for g, _ in lines_of(charts(at)["run_chart_reward"])["rft"]] == [3]
    explorer = copy_of / "rft" / "monitor" / "explorer.jsonl"
    for path, lines in later.items():
        with open(path, "ab") as f:
            f.write(b"".join(line for line in lines if json.loads(line)["step"] == 2))
    step3 = [line for line in later[explorer] if json.loads(line)["step"] == 3]
    with open(explorer, "ab") as f:
        f.write(step3[0][: len(step3[0]) // 2])  # the explorer is half-way through a line
    at.run()
    assert not at.exception
    assert [g for g, _ in lines_of(charts(at)["run_chart_reward"])["rft"]] == [3, 4]
    assert at.info[0].value.startswith("running: stage rft, step 2 / 3")
    with open(explorer, "ab") as f:
        f.write(step3[0][len(step3[0]) // 2 :] + b"".join(step3[1:]))
    at.run()
    assert [g for g, _ in lines_of(charts(at)["run_chart_reward"])["rft"]] == [3, 4, 5]
    assert at.info[0].value.startswith("running: stage rft, step 3 / 3")


@pytest.mark.slow(seconds=20)
def test_a_failed_run_shows_its_exit_code_and_its_logs(tmp_path, tiny_model_dir):
    """A run whose trainer stops on a bad data row (a single stage: its job dir is the run dir): failed with the
    launcher's exit code, the error in the logs shown."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": "not a list"}\n' * 20)
    out = launch(sft_config(tmp_path, tiny_model_dir, **{"buffer.trainer_input.experience_buffer.path": str(bad)}))
    assert out.returncode == 2, out.stderr[-2000:]
    at = page(tmp_path / "ck" / "p" / "t")
    assert not at.exception
    assert at.error[0].value == "FAILED (exit code 2) at stage t, no step recorded"
    assert any("expected a list of {role, content} messages" in code.value for code in at.code)
    assert at.toggle(key="run_live").value is False


def test_a_directory_that_is_no_job_dir_gets_a_message(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    at = page(tmp_path)
    assert not at.exception
    assert f"{tmp_path} is not a job directory" in at.error[0].value
    assert "no such directory" in page(tmp_path / "missing").error[0].value


def test_an_empty_box_asks_for_a_directory():
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    assert not at.exception and "Give a run directory" in at.info[0].value


@pytest.mark.slow(seconds=90)
def test_the_runs_under_checkpoints_are_listed_and_one_picked_opens(run_dir, tmp_path, monkeypatch):
    (tmp_path / "checkpoints").symlink_to(run_dir.parent.parent)  # ./checkpoints/p/run
    monkeypatch.chdir(tmp_path)
    at = AppTest.from_file(PAGE, default_timeout=60).run()
    found = at.selectbox(key="run_found")
    assert found.options == ["checkpoints/p/run"]  # the run, not its three stages' job dirs
    found.set_value("checkpoints/p/run").run()
    assert at.text_input(key="run_job").value == "checkpoints/p/run" and job_param(at) == "checkpoints/p/run"
    assert set(charts(at)) == {"run_chart_reward", "run_chart_accuracy", "run_chart_loss"}
