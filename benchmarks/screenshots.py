"""Screenshots of the SCALES dashboard for the docs, from real runs, in headless Chromium.

    python benchmarks/screenshots.py --out docs

``compare_view`` trains the two runs of ``tests/compare_runs.py`` (a tiny GPT, and the same
with one layer's weights x8 at initialisation), serves them with ``tensorboard`` (as
``dashboard_load.py``) and saves the Compare view at step 0 as ``scales_compare.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, List

import workload  # noqa: F401 - first: puts the checkout's package on sys.path

ROOT = Path(__file__).resolve().parents[1]
#: Blocks folded in the shot, so that the rows around the scaled layer are in view.
FOLDED = ("model.tok", "model.pos", "model", "model.blocks.0")


def compare_view(out: Path) -> Path:
    """``out/scales_compare.png``: run ``a`` against run ``scaled`` in the Compare view at step 0."""
    from playwright.sync_api import sync_playwright

    from dashboard_load import CHROMIUM, serve

    sys.path.insert(0, str(ROOT))
    from tests.compare_runs import fit

    root = Path(tempfile.mkdtemp())
    fit(root, "a"), fit(root, "scaled", scaled=8.0)
    proc, url = serve(str(root))
    path = out / "scales_compare.png"
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1500, "height": 900})
            _open_compare(page, url, "a", "scaled", 0)
            for group in FOLDED:
                page_frame(page).click(f"svg.compare text.group[data-group='{group}']")
            page.wait_for_timeout(300)
            page.screenshot(path=str(path))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return path


def page_frame(page: Any) -> Any:
    """The SCALES plugin's frame in a TensorBoard page."""
    page.wait_for_function("[...document.querySelectorAll('iframe')].some((f) => f.src.includes('name=scales'))")
    return next(f for f in page.frames if "name=scales" in f.url)


def _open_compare(page: Any, url: str, run: str, other: str, step_index: int) -> None:
    page.goto(f"{url}/#scales")
    frame = page_frame(page)
    frame.wait_for_selector("svg.profile g.node", timeout=60_000)
    frame.select_option("#run", run)
    frame.click("button[data-view=compare]")
    frame.wait_for_selector("svg.compare g.cmp-node", timeout=60_000)
    frame.select_option("#other", other)
    frame.eval_on_selector("#step", f"s => {{ s.value = {step_index}; s.dispatchEvent(new Event('input')); }}")
    frame.wait_for_function(f"document.querySelector('.compare-legend')?.textContent.includes('{other} at step')")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs"), help="folder of the PNG files")
    args = parser.parse_args(argv)
    print(compare_view(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
