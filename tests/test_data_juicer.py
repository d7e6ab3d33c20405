"""Data-Juicer for real (pipelines/data_juicer.py -> pipelines/dj_worker.py in .venv-dj): a filter keeps exactly the
rows computed by hand, its stats are the numbers computed by hand (len() of the text, the share of letters and
digits), the experience operator writes them into exp.info and drops what Data-Juicer's filters drop, the shipped
recipe runs offline, and a missing venv, an unknown operator or a bad argument is a named error.

Each case that runs Data-Juicer starts its worker (~5-10 s on 2 cores). Where .venv-dj is missing (`bash run.sh dj`
sets it up; `bash run.sh test` does it first) they skip, saying so, except under CI, where they fail."""

import math
from pathlib import Path

import pytest
import torch

import pipelines
from buffer import Experience
from configs.schema import OperatorConfig
from helpers import in_ci
from pipelines import data_juicer as dj
from pipelines.registry import EXPERIENCE_OPERATORS

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples/grpo_gsm8k_experience_pipeline/dj_scoring_exp.yaml"


@pytest.fixture
def dj_venv():
    """.venv-dj with data_juicer in it, else a skip with the reason (a failure under CI)."""
    python = dj.venv() / "bin" / "python"
    if not python.exists():
        why = f"Data-Juicer's venv {dj.venv()} is missing: `bash run.sh dj` sets it up"
        if in_ci():
            pytest.fail(f"CI must run the Data-Juicer tests for real (`bash run.sh test` sets it up): {why}")
        pytest.skip(why)
    return python


def experience(response: str, reward: float = 1.0) -> Experience:
    return Experience(
        tokens=torch.tensor([1, 2, 3]), prompt_length=1, prompt_text="Q?", response_text=response, reward=reward
    )


@pytest.mark.slow(seconds=13)  # the worker's start and Data-Juicer's set-up
def test_text_length_filter_keeps_the_rows_computed_by_hand(dj_venv):
    rows = [
        {"question": "ab", "answer": "1"},  # 2 chars: < min_len, dropped
        {"question": "abc", "answer": "2"},  # 3: kept (the bounds are inclusive)
        {"question": "abcdefgh", "answer": "3", "extra": {"k": 1}},  # 8: kept
        {"question": "abcdefghi", "answer": "4"},  # 9: > max_len, dropped
        {"question": "héllo", "answer": "5"},  # 5 characters (not bytes): kept
    ]
    kept, metrics = dj.run_rows(rows, [{"text_length_filter": {"min_len": 3, "max_len": 8}}], ["question"], 1)
    assert kept == [
        {"question": "abc", "answer": "2", "text_len": 3},  # no `extra: None` from the other rows
        {"question": "abcdefgh", "answer": "3", "extra": {"k": 1}, "text_len": 8},
        {"question": "héllo", "answer": "5", "text_len": 5},
    ]
    assert all(row["text_len"] == len(row["question"]) for row in kept)
    assert metrics == {"rows_in": 5.0, "rows_out": 3.0, "text_len_mean": (3 + 8 + 5) / 3}


@pytest.mark.slow(seconds=8)  # the worker's start and Data-Juicer's set-up
def test_all_rows_dropped_and_no_rows(dj_venv):
    rows = [{"question": "ab"}, {"question": "abc"}]
    assert dj.run_rows(rows, [{"text_length_filter": {"min_len": 10}}], ["question"], 1) == (
        [],
        {"rows_in": 2.0, "rows_out": 0.0},
    )
    assert dj.run_rows([], [{"text_length_filter": {"min_len": 10}}], ["question"], 1) == (
        [],
        {"rows_in": 0.0, "rows_out": 0.0},
    )


@pytest.mark.slow(seconds=12)  # the worker's start and Data-Juicer's set-up
def test_experience_operator_writes_stats_to_info_and_drops_what_the_filter_drops(dj_venv, tmp_path):
    exps = [experience("ab1 !"), experience("!!?"), experience("abcd", reward=0.0), experience("a-b-")]
    # alnum_ratio = letters and digits / characters: 3/5, 0/3, 4/4, 2/4; min_ratio 0.6 drops "!!?" and "a-b-"
    op = pipelines.build(
        OperatorConfig(
            name="data_juicer",
            args={"operators": [{"alphanumeric_filter": {"tokenization": False, "min_ratio": 0.6}}]},
        ),
        EXPERIENCE_OPERATORS,
        pipelines.Context(cfg=None, where="data_processor.experience_pipeline.operators[0]"),
    )
    kept, metrics = op.process(exps)
    assert kept == [exps[0], exps[2]]  # the same objects, in order
    assert [e.info for e in kept] == [{"alnum_ratio": pytest.approx(0.6)}, {"alnum_ratio": 1.0}]
    assert exps[1].info == {} and exps[3].info == {}
    assert metrics == {"alnum_ratio_mean": pytest.approx((0.6 + 1.0) / 2)}


@pytest.mark.slow(seconds=10)  # the worker's start and Data-Juicer's set-up
def test_the_shipped_recipe_runs_offline_and_scores_the_response(dj_venv):
    looping = "a" * 100  # every 10-character n-gram is the same one: char_rep_ratio 1.0 > 0.5, dropped
    exps = [experience("The answer is 42."), experience(looping), experience("7 * 6 = 42")]
    op = dj.ExperienceDataJuicer(config_path=str(RECIPE))
    kept, metrics = op.process(exps)
    assert kept == [exps[0], exps[2]]
    # no 10-gram repeats in either: char_rep_ratio 0; alnum: 13 of 17 characters, 4 of 10
    assert exps[0].info == {"char_rep_ratio": 0.0, "alnum_ratio": pytest.approx(13 / 17), "text_len": 17}
    assert exps[2].info == {"char_rep_ratio": 0.0, "alnum_ratio": pytest.approx(4 / 10), "text_len": 10}
    assert metrics["text_len_mean"] == 13.5 and math.isclose(metrics["char_rep_ratio_mean"], 0.0)


@pytest.mark.slow(seconds=9)  # the worker's start and Data-Juicer's set-up
def test_config_path_and_operators_run_in_that_order(dj_venv, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("process:\n  - text_length_filter:\n      min_len: 3\n")
    kept, metrics = dj.run_rows(
        [{"q": "ab"}, {"q": "abc"}, {"q": "abcdef"}], [{"text_length_filter": {"max_len": 5}}], ["q"], 1, str(recipe)
    )
    assert kept == [{"q": "abc", "text_len": 3}] and metrics["rows_out"] == 1.0


@pytest.mark.slow(seconds=5)  # asks the worker for Data-Juicer's operator list (once per process)
def test_unknown_operator_names_the_close_ones(dj_venv):
    with pytest.raises(
        dj.DataJuicerError,
        match=r"'text_lenght_filter' is not a Data-Juicer operator\. "
        r"Close names: text_length_filter",
    ):
        dj.run_rows([{"q": "abc"}], [{"text_lenght_filter": {}}], ["q"], 1)
    with pytest.raises(dj.DataJuicerError, match=r"operators\[0\].*process\[0\]: 'alphanumeric_filtr'"):
        dj.ExperienceDataJuicer(
            operators=[{"alphanumeric_filtr": {}}],
            context=pipelines.Context(cfg=None, where="experience_pipeline.operators[0]"),
        )


@pytest.mark.slow(seconds=7)  # the worker's start and Data-Juicer's set-up
def test_a_bad_argument_carries_data_juicers_own_message(dj_venv):
    with pytest.raises(dj.DataJuicerError, match=r"Data-Juicer failed: .*Unknown parameter 'min_lenn'"):
        dj.run_rows([{"q": "abc"}], [{"text_length_filter": {"min_lenn": 3}}], ["q"], 1)


def test_a_missing_venv_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("NANORFT_DJ_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(
        dj.DataJuicerError,
        match=r"Data-Juicer is not installed: .*no-venv has no bin/python.*"
        r"`bash run.sh dj`",
    ):
        dj.run_rows([{"q": "abc"}], [{"text_length_filter": {}}], ["q"], 1)
    with pytest.raises(dj.DataJuicerError, match=r"`bash run.sh dj`"):
        dj.ExperienceDataJuicer(operators=[{"text_length_filter": {}}])


def test_a_venv_without_data_juicer_says_how_to_install_it(monkeypatch, tmp_path):
    import venv

    venv.create(tmp_path / "bare")  # a python with no data_juicer
    monkeypatch.setenv("NANORFT_DJ_VENV", str(tmp_path / "bare"))
    with pytest.raises(
        dj.DataJuicerError,
        match=r"bare has no data_juicer .*No module named 'data_juicer'.*"
        r"`bash run.sh dj`",
    ):
        dj.run_rows([{"q": "abc"}], [{"text_length_filter": {}}], ["q"], 1)


def test_bad_arguments_of_the_experience_operator(monkeypatch, tmp_path):
    with pytest.raises(dj.ConfigError, match="data_juicer needs config_path .* or operators"):
        dj.ExperienceDataJuicer()
    with pytest.raises(dj.ConfigError, match="config_path 'nope.yaml' is not a file"):
        dj.ExperienceDataJuicer(config_path="nope.yaml")
    with pytest.raises(dj.ConfigError, match="one {op_name: {args}} mapping"):
        dj.run_rows([{"q": "abc"}], ["text_length_filter"], ["q"], 1)
