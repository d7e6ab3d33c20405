"""The studio served as a user serves it (`python -m studio`, a process of its own) and a real headless Chromium
driven by Playwright, for the tests that check what a browser renders (tests/test_studio_browser.py) and for the
docs' screenshots (scripts/studio_screenshots.py).

    with Studio(key="k") as studio, chromium() as browser:
        page = browser.new_page()
        open_page(page, studio.url("experiences", db=str(db)))   # waits until the app's script has run
        page.locator(".tok").count()

The browser is Debian's `chromium` package (.ci/run installs it, as it installs PostgreSQL); Playwright drives it
through `executable_path`, so nothing is downloaded. NANORFT_CHROMIUM names another binary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from helpers import chromium_path, free_port

ROOT = Path(__file__).resolve().parents[1]


class Studio:
    """`python -m studio` on a free loopback port (a key when given), stopped (its process group) on exit. Its console
    goes to `log` (a temporary file when None): the message of a failed start."""

    def __init__(self, key: str | None = None, cwd: Path = ROOT, log: Path | None = None, timeout: float = 90) -> None:
        self.port, self.key, self.cwd, self.timeout = free_port(), key, cwd, timeout
        self.log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"nanorft-studio-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def url(self, page: str = "", **query: str) -> str:
        """The address of a page ("" = the config page: the default one is served at / only; experiences; run)
        with its query parameters, the key among them when the server has one."""
        query = {**query, **({"key": self.key} if self.key else {})}
        return f"http://127.0.0.1:{self.port}/{page}" + (f"?{urllib.parse.urlencode(query)}" if query else "")

    def __enter__(self) -> Studio:
        argv = [sys.executable, "-m", "studio", "--port", str(self.port)] + (["--key", self.key] if self.key else [])
        env = {k: v for k, v in os.environ.items() if k != "NANORFT_STUDIO_KEY"}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=self.cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the studio exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                health = f"http://127.0.0.1:{self.port}/_stcore/health"
                if urllib.request.urlopen(health, timeout=2).read() == b"ok":
                    return self
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"the studio did not answer in {self.timeout:g} s: {self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright's Browser), closed on exit. NOTE: --no-sandbox: CI runs as root, where
    Chromium's sandbox refuses to start."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def open_page(page: Any, url: str, timeout: float = 60) -> None:
    """Go to `url` and wait until the app's script has run to its end (Streamlit marks its root element's
    data-test-script-state `notRunning` then) and the page is connected."""
    page.goto(url)
    wait_idle(page, timeout)


def wait_idle(page: Any, timeout: float = 60) -> None:
    """Wait until the app's script has finished its current run (after a click or an input)."""
    page.wait_for_timeout(300)  # NOTE: a click's rerun starts asynchronously: without this the old state may match
    page.wait_for_selector(
        '[data-testid="stApp"][data-test-script-state="notRunning"][data-test-connection-state="CONNECTED"]',
        timeout=timeout * 1000,
    )
