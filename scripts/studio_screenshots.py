"""The docs' screenshots of the studio (docs/studio/*.png), made by the browser the tests use: `python -m studio` served
as a user serves it, headless Chromium through Playwright (tests/browser.py), one page each.

    .venv/bin/python scripts/studio_screenshots.py --run checkpoints/nanorft/tiny    # a run of `bash run.sh`
    .venv/bin/python scripts/studio_screenshots.py --run DIR --config configs/tiny.yaml --out docs/studio

The experiences page shows the experience of the run's last RFT stage with the widest spread of advantages (the trained
table, DB schema 5), its group beside it.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path

import safetensors.torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from browser import Studio, chromium, open_page  # noqa: E402

VIEWPORT = {"width": 1500, "height": 2600}  # tall: Streamlit scrolls inside the page, a screenshot shows the viewport


def rft_db(run: Path) -> Path:
    """The experience DB of the run's last stage that has one (<stage>/buffer/*.db)."""
    found = sorted(run.glob("*/buffer/*.db"), key=lambda p: p.stat().st_mtime) or sorted(run.glob("buffer/*.db"))
    if not found:
        raise SystemExit(f"{run}: no experience DB under <stage>/buffer/: give a run directory of `bash run.sh`")
    return found[-1]


def telling_experience(db: Path) -> int:
    """The id of the trained experience whose advantages spread the most (ties: the latest)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT exp_id, tensors FROM trained ORDER BY exp_id").fetchall()
    if not rows:
        raise SystemExit(f"{db}: no trained rows (a DB older than schema 5): run `bash run.sh` again")
    spread = {i: float(safetensors.torch.load(bytes(t))["advantages"].abs().max()) for i, t in rows}
    return max(spread, key=lambda i: (spread[i], i))


def shoot(page, url: str, path: Path, ready: str) -> None:
    open_page(page, url)
    page.locator(ready).first.wait_for()
    page.wait_for_timeout(1500)  # NOTE: charts fade in after the script's run ends
    page.screenshot(path=str(path), full_page=True)
    print(f"wrote {path}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, default=ROOT / "checkpoints/nanorft/tiny", help="a run directory")
    ap.add_argument("--config", default="configs/tiny.yaml", help="the config the config page opens")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/studio")
    args = ap.parse_args(argv)
    run, db = args.run.resolve(), rft_db(args.run.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    with Studio() as studio, chromium() as browser:
        page = browser.new_page(viewport=VIEWPORT)
        shoot(page, studio.url("", config=args.config), args.out / "config.png", ".st-key-cf-algorithm-optimizer-lr")
        exp = str(telling_experience(db))
        shoot(page, studio.url("experiences", db=str(db), exp=exp), args.out / "experiences.png", "div.toks span.tok")
        shoot(page, studio.url("run", job=str(run)), args.out / "run.png", ".stVegaLiteChart svg.marks")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
