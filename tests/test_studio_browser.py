"""The studio in a real browser: `python -m studio` served as a user serves it, headless Chromium (tests/browser.py)
opening its pages, and what it rendered checked in the DOM and in a screenshot's pixels."""

import subprocess
import sys

import pytest

from browser import Studio, open_page
from helpers import ROOT


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
        open_page(page, f"http://127.0.0.1:{studio.port}/config")
        assert "needs its key" in page.inner_text("body")
        assert page.locator('[data-testid="stSidebarNav"]').count() == 0  # no page, not even their names
        open_page(page, f"http://127.0.0.1:{studio.port}/config?key=wrong")
        assert "needs its key" in page.inner_text("body")
        open_page(page, studio.url("config"))
        assert "needs its key" not in page.inner_text("body")
        assert page.locator('[data-testid="stSidebarNav"]').count() == 1
        assert "key=" not in page.url  # the key leaves the address bar once the session holds it
