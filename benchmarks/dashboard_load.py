"""Load time of the `scales` dashboard in headless Chromium, and screenshots of its views.

    python benchmarks/dashboard_load.py --logdir lightning_logs [--screenshots docs]

Starts `tensorboard --load_fast=false` on 127.0.0.1 (the plugin found through its entry
point, or a stand-in declaration for a source checkout), then times, from navigation: the
profile drawn with every node, the heatmap drawn, the worst-nodes table drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(logdir: str) -> "tuple[subprocess.Popen, str]":
    import importlib.metadata

    paths = [str(ROOT)]
    if not any(ep.name == "scales" for ep in importlib.metadata.entry_points(group="tensorboard_plugins")):
        tmp = Path(tempfile.mkdtemp())
        info = tmp / "lightning_scale_dashboard_bench-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning-scale-dashboard-bench\nVersion: 0\n")
        (info / "entry_points.txt").write_text("[tensorboard_plugins]\nscales = lightning_scale.dashboard.plugin:ScalesPlugin\n")
        paths.append(str(tmp))
    port = _port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"], env=env, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if json.load(urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5)).get("scales", {}).get("enabled"):
                _wait_loaded(url)
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the scales plugin did not become active")


def _wait_loaded(url: str) -> None:
    """Until TensorBoard has read every event (the heatmap's cell count stops changing): timings start
    from a loaded server, as a user's second look does."""
    last = None
    while True:
        runs = json.load(urllib.request.urlopen(f"{url}/data/plugin/scales/runs", timeout=30))
        run = urllib.parse.quote(next(iter(runs), ""))
        heat = json.load(urllib.request.urlopen(f"{url}/data/plugin/scales/heatmap?run={run}", timeout=60)) if runs else {"fwd": [], "bwd": []}
        size = sum(v is not None for rows in (heat["fwd"], heat["bwd"]) for row in rows for v in row)
        if size and size == last:
            return
        last = size
        time.sleep(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--screenshots", default=None, help="folder for scales_<view>.png")
    parser.add_argument("--name", default="", help="screenshot name suffix")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    proc, url = _serve(args.logdir)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            t0 = time.perf_counter()
            page.goto(f"{url}/#scales")
            frame = next(f for f in _frames(page) if "name=scales" in f.url)
            frame.wait_for_selector("svg.profile g.node", timeout=120_000)
            n = frame.eval_on_selector_all("svg.profile g.node", "g => g.length")
            t_profile = time.perf_counter() - t0
            shots = {"profile": None}
            _shot(page, args, "profile")
            for view, sel in (("heatmap", "svg.heatmap rect.cell"), ("worst", "tr.worst-row"), ("code", "pre.code, p.note")):
                t1 = time.perf_counter()
                frame.click(f"button[data-view={view}]")
                frame.wait_for_selector(sel, timeout=120_000, state="attached")
                shots[view] = time.perf_counter() - t1
                if view == "heatmap":
                    frame.locator("svg.heatmap[data-dir=bwd] rect.cell").nth(min(n - 1, 40) * 1).click()
                    frame.wait_for_selector(".series-box polyline", state="attached")
                _shot(page, args, view)
            print(f"{args.logdir}: {n} nodes; profile drawn {t_profile:.2f} s after navigation; " + ", ".join(f"{v} {t:.2f} s" for v, t in shots.items() if t is not None))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _frames(page):  # type: ignore[no-untyped-def]
    for _ in range(300):
        if any("name=scales" in f.url for f in page.frames):
            return page.frames
        page.wait_for_timeout(100)
    return page.frames


def _shot(page, args, view: str) -> None:  # type: ignore[no-untyped-def]
    if args.screenshots:
        page.screenshot(path=str(Path(args.screenshots) / f"scales_{view}{args.name}.png"))


if __name__ == "__main__":
    main()
