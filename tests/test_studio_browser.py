"""The studio in a real browser: `python -m studio` served as a user serves it, headless Chromium (tests/browser.py)
opening its pages, and what it rendered checked in the DOM and in a screenshot's pixels."""

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
from PIL import Image

from browser import Studio, open_page, wait_idle
from helpers import ROOT, both_config, launch, need_chromium, raw


def test_the_browser_tests_chromium_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch):
    """The `headless` fixture (helpers.need_chromium): .ci/run installs the browser, so under CI a missing one fails
    the browser tests instead of skipping them."""
    monkeypatch.setenv("NANORFT_CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run the studio's browser tests"):
        need_chromium()
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="no Chromium here"):
        need_chromium()
    browser = tmp_path / "chromium"
    browser.write_text("#!/bin/sh\n")
    browser.chmod(0o755)
    monkeypatch.setenv("NANORFT_CHROMIUM", str(browser))
    assert need_chromium() == str(browser)
    assert "apt_install chromium" in (ROOT / ".ci/run").read_text()


def test_off_loopback_without_a_key_is_refused():
    out = subprocess.run(
        [sys.executable, "-m", "studio", "--host", "0.0.0.0"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "not loopback" in out.stderr and "--key" in out.stderr


@pytest.mark.slow(20)
def test_a_keyed_studio_shows_nothing_without_its_key(headless):
    with Studio(key="s3cret-key") as studio:
        page = headless.new_page()
        open_page(page, f"http://127.0.0.1:{studio.port}/")
        assert "needs its key" in page.inner_text("body")
        assert page.locator('[data-testid="stSidebarNav"]').count() == 0  # no page, not even their names
        open_page(page, f"http://127.0.0.1:{studio.port}/?key=wrong")
        assert "needs its key" in page.inner_text("body")
        open_page(page, studio.url(""))
        assert "needs its key" not in page.inner_text("body")
        assert page.locator('[data-testid="stSidebarNav"]').count() == 1
        assert "key=" not in page.url  # the key leaves the address bar once the session holds it


# --- the pages on a short real run, as a browser renders them


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """A short real run (mode both, 3 steps, 2 updates a step: the trainer's log-probs recorded). Its reward is a coin
    flip seeded by each response's text (tests/data/dapo_reward.py): the untrained tiny model's rewards would all tie,
    and every advantage be 0; 4 coins a group tie with probability 1/8."""
    tmp = tmp_path_factory.mktemp("studio_browser")
    over = {
        "trainer.ppo_epochs": 2,
        "algorithm.repeat_times": 4,
        "buffer.default_reward_fn_type": f"{ROOT}/tests/data/dapo_reward.py:tie_or_coin",
        "buffer.explorer_input.taskset.reward_fn_args": {"tied_below": 0},
    }
    out = launch(both_config(tmp, tiny_model_dir, **over))
    assert out.returncode == 0, out.stderr[-4000:]
    return tmp / "ck" / "p" / "run"


@pytest.fixture(scope="module")
def studio():
    with Studio() as served:
        yield served


def rgb(css: str) -> tuple[float, ...]:
    """`rgb(r, g, b)` / `rgba(r, g, b, a)` -> the numbers."""
    return tuple(float(x) for x in re.findall(r"[\d.]+", css))


@pytest.mark.slow(60)
def test_the_viewer_colours_a_known_experiences_tokens_by_their_advantage(run_dir, studio, headless):
    """The experience with the largest |advantage| the run trained on, opened by address: one span per token, each
    response token's data-adv the trained table's advantage, its background green above 0 and red below (the
    computed style and, for the token itself, the pixels of a screenshot of it)."""
    db = run_dir / "buffer" / "exp.db"
    rows = raw(f"sqlite:///{db}", "SELECT exp_id, tensors FROM trained ORDER BY exp_id")  # one step each (no reuse)
    trained = {i: safetensors.torch.load(bytes(t))["advantages"] for i, t in rows}
    exp_id = max(trained, key=lambda i: float(trained[i].abs().max()))
    advantages = trained[exp_id]
    assert float(advantages.abs().max()) > 0.1
    sql = "SELECT prompt_length + response_length FROM experiences WHERE id = ?"
    [(length,)] = raw(f"sqlite:///{db}", sql, (exp_id,))
    page = headless.new_page(viewport={"width": 1400, "height": 1000})
    open_page(page, studio.url("experiences", db=str(db), exp=str(exp_id)))
    shown = page.locator(f'div.exp-shown[data-exp-id="{exp_id}"] div.toks')  # not a group member's tokens
    shown.locator("span.tok").first.wait_for()
    tokens = shown.locator("span.tok")
    assert tokens.count() == length
    response = shown.locator('span.tok[data-part="response"]')
    assert response.count() == len(advantages)
    for i in range(response.count()):
        token = response.nth(i)
        adv = float(token.get_attribute("data-adv"))
        assert adv == pytest.approx(float(advantages[i]), abs=1e-4)
        r, g, b, *alpha = rgb(token.evaluate("e => getComputedStyle(e).backgroundColor"))
        if adv > 0:
            assert g > r, (i, adv, r, g, b)
        elif adv < 0:
            assert r > g, (i, adv, r, g, b)
    strongest = max(range(len(advantages)), key=lambda i: abs(float(advantages[i])))
    shot = Image.open(io.BytesIO(response.nth(strongest).screenshot())).convert("RGB")
    r, g, b = np.asarray(shot, dtype=float).mean(axis=(0, 1))  # [H,W,3] -> the token's mean colour
    assert (g > r) if float(advantages[strongest]) > 0 else (r > g), (r, g, b)


@pytest.mark.slow(30)
def test_the_config_page_loads_a_trinity_yaml_and_puts_a_refusal_beside_its_field(studio, headless):
    """Trinity's own GRPO example (tests/data/reference_configs) opened by address; an lr of -1 typed into its field
    shows the loader's message right under that field."""
    page = headless.new_page(viewport={"width": 1400, "height": 1000})
    open_page(page, studio.url("", config="tests/data/reference_configs/grpo_example.yaml"))
    field = page.locator(".st-key-cf-algorithm-optimizer-lr input")
    field.wait_for()
    assert float(field.input_value()) == pytest.approx(1e-6)
    field.fill("-1")
    field.press("Enter")
    wait_idle(page)
    beside = page.locator(".st-key-cf-algorithm-optimizer-lr + div, .st-key-cf-algorithm-optimizer-lr ~ div").first
    assert "algorithm.optimizer.lr" in beside.inner_text() and "out of range" in beside.inner_text()


@pytest.mark.slow(30)
def test_the_run_page_draws_the_runs_curves_and_summary(run_dir, studio, headless):
    page = headless.new_page(viewport={"width": 1400, "height": 1000})
    open_page(page, studio.url("run", job=str(run_dir)))
    for curve in ("reward", "accuracy", "loss"):
        chart = page.locator(f".st-key-run_chart_{curve} .stVegaLiteChart").first
        chart.locator("svg.marks, canvas").first.wait_for()  # Vega draws an SVG, or a canvas (older Streamlit)
        page.wait_for_timeout(1000)  # NOTE: the marks fade in
        box = chart.bounding_box()
        assert box["width"] > 100 and box["height"] > 50, curve
        pixels = np.asarray(Image.open(io.BytesIO(chart.screenshot())).convert("RGB"), dtype=float)  # [H,W,3]
        line = (pixels[..., 2] - pixels[..., 0] > 60).sum()  # the curve's blue, not the grey axes and grid
        assert line > 50, (curve, line)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"{summary['accuracy_after_rft']:g}" in page.locator(".st-key-run_summary").inner_text()
