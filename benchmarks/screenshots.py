"""Screenshots of the SCALES dashboard for the docs, from real runs, in headless Chromium
(``make screenshots`` runs this and ``examples/coord_check.py``).

    python benchmarks/screenshots.py --out docs

``dashboard_views`` trains the demo GPT (``lightning_scale.tools.demo``: 41 steps, every 20th
tracked, std, absmax and the per-tensor FP8 what-if) and saves the profile, heatmap, worst
nodes and code views (``scales_<view>.png``), TensorBoard's CUSTOM SCALARS tab, the profile
of ``fp8_e4m3_flushed`` (``fp8_profile.png``) and the nodes ranked by FP8 SNR
(``fp8_worst.png``), all at the last tracked step. ``compare_view`` trains the two runs of
``tests/compare_runs.py`` (a tiny GPT, and the same with one layer's weights x8 at
initialisation), serves them with ``tensorboard`` (as ``dashboard_load.py``) and saves
the Compare view at step 0 as ``scales_compare.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import workload  # noqa: F401 - first: puts the checkout's package on sys.path

ROOT = Path(__file__).resolve().parents[1]
#: Blocks folded in the shot, so that the rows around the scaled layer are in view.
FOLDED = ("model.tok", "model.pos", "model", "model.blocks.0")


@contextlib.contextmanager
def served(root: Path) -> Iterator[Tuple[Any, str]]:
    """(headless Chromium, the URL of ``tensorboard`` serving ``root``), both closed after."""
    from playwright.sync_api import sync_playwright

    from dashboard_load import CHROMIUM, serve

    proc, url = serve(str(root))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            yield browser, url
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def compare_view(out: Path) -> Path:
    """``out/scales_compare.png``: run ``a`` against run ``scaled`` in the Compare view at step 0."""
    sys.path.insert(0, str(ROOT))
    from tests.compare_runs import fit

    root = Path(tempfile.mkdtemp())
    fit(root, "a"), fit(root, "scaled", scaled=8.0)
    path = out / "scales_compare.png"
    with served(root) as (browser, url):
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        _open_compare(page, url, "a", "scaled", 0)
        for group in FOLDED:
            page_frame(page).click(f"svg.compare text.group[data-group='{group}']")
        page.wait_for_timeout(300)
        page.screenshot(path=str(path))
    return path


#: The demo run of the shots: its steps, how often it is tracked, what it records.
DEMO_STEPS, DEMO_EVERY = 41, 20
DEMO_STATISTICS = ["std", "absmax", "fp8_e4m3_snr_db", "fp8_e4m3_flushed", "fp8_e5m2_snr_db", "fp8_e5m2_flushed"]


def demo_logs(root: Path) -> Path:
    """The demo GPT trained ``DEMO_STEPS`` steps with ``DEMO_STATISTICS``; its log dir."""
    import lightning.pytorch as pl
    import torch

    from lightning_scale import ScaleMonitor
    from lightning_scale.tools.demo import GPTModule, token_loaders

    torch.manual_seed(0)
    train, _ = token_loaders()
    trainer = pl.Trainer(
        max_steps=DEMO_STEPS,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="demo"),
        callbacks=[ScaleMonitor(every_n_steps=DEMO_EVERY, statistics=DEMO_STATISTICS)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    trainer.fit(GPTModule(), train)
    return Path(trainer.logger.log_dir)


def dashboard_views(out: Path) -> List[Path]:
    """The views of the demo run at its last tracked step (see the module's doc)."""
    from dashboard_load import time_custom_scalars, time_views

    root = Path(tempfile.mkdtemp())
    demo_logs(root)
    with served(root) as (browser, url):
        time_views(url, browser, shots=out)
        time_custom_scalars(url, browser, shots=out)
        _fp8_views(browser.new_page(viewport={"width": 1400, "height": 900}), url, out)
    views = ("profile", "heatmap", "worst", "code", "custom_scalars")
    return [out / f"scales_{v}.png" for v in views] + [out / "fp8_profile.png", out / "fp8_worst.png"]


def _fp8_views(page: Any, url: str, out: Path) -> None:
    page.goto(f"{url}/#scales")
    frame = page_frame(page)
    frame.wait_for_selector("svg.profile g.node", timeout=60_000)
    frame.select_option("#stat", "fp8_e4m3_flushed")
    frame.wait_for_function("document.querySelector('#stat').value === 'fp8_e4m3_flushed'")
    page.wait_for_timeout(1000)
    page.screenshot(path=str(out / "fp8_profile.png"))
    frame.click("button[data-view=worst]")
    frame.wait_for_selector("tr.worst-row", timeout=60_000, state="attached")
    frame.select_option("#by", "fp8")
    page.wait_for_timeout(1000)
    page.screenshot(path=str(out / "fp8_worst.png"))
    page.close()


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
    for path in [*dashboard_views(Path(args.out)), compare_view(Path(args.out))]:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
