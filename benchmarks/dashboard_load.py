"""Load time of the `scales` dashboard and of TensorBoard's CUSTOM SCALARS tab in headless
Chromium, and screenshots of the dashboard's views.

    python benchmarks/dashboard_load.py --logdir lightning_logs [--screenshots docs]
    python benchmarks/dashboard_load.py --gpt-layers 4 24 56   # writes demo-GPT logs first

Starts `tensorboard --load_fast=false` on 127.0.0.1 (the plugin found through its entry
point, or a stand-in declaration for a source checkout), waits until it has read every
event, then times, from navigation: the profile drawn with every node; then each switch of
view (heatmap, worst nodes, code); then, on a fresh page, CUSTOM SCALARS from navigation
to its first chart with a line drawn (or to its "no layout" state). ``--gpt-layers`` first
trains the demo GPT (narrow: width 8, 3 steps, every step tracked, default ScaleMonitor
options otherwise) with that many layers, one log per size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("LIGHTNING_SCALE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# A chart of the CUSTOM SCALARS tab with a line drawn (Plottable's SVG), or its empty state.
CUSTOM_DRAWN = "tf-custom-scalar-multi-line-chart-card path.line, tf-custom-scalar-dashboard .no-data-warning"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(logdir: str) -> Tuple[subprocess.Popen, str]:
    """A TensorBoard on ``logdir`` with the plugin, once it has read every event."""
    import importlib.metadata

    paths = [str(ROOT)]
    if not any(ep.name == "scales" for ep in importlib.metadata.entry_points(group="tensorboard_plugins")):
        tmp = Path(tempfile.mkdtemp())
        info = tmp / "lightning_scale_dashboard_bench-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning-scale-dashboard-bench\nVersion: 0\n")
        (info / "entry_points.txt").write_text(
            "[tensorboard_plugins]\nscales = lightning_scale.dashboard.plugin:ScalesPlugin\n"
        )
        paths.append(str(tmp))
    port = _port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if (
                json.load(urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5))
                .get("scales", {})
                .get("enabled")
            ):
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
        heat = (
            json.load(urllib.request.urlopen(f"{url}/data/plugin/scales/heatmap?run={run}", timeout=60))
            if runs
            else {"fwd": [], "bwd": []}
        )
        size = sum(v is not None for rows in (heat["fwd"], heat["bwd"]) for row in rows for v in row)
        if size and size == last:
            return
        last = size
        time.sleep(2)


def _frame(page: Any) -> Any:
    for _ in range(300):
        for f in page.frames:
            if "name=scales" in f.url:
                return f
        page.wait_for_timeout(100)
    raise RuntimeError("no scales frame")


def time_views(url: str, browser: Any, shots: Optional[Path] = None, suffix: str = "") -> Dict[str, Any]:
    """Seconds from navigation to the profile drawn, then per switch of view; the page's errors."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: List[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    t0 = time.perf_counter()
    page.goto(f"{url}/#scales")
    frame = _frame(page)
    frame.wait_for_selector("svg.profile g.node", timeout=120_000)
    out: Dict[str, Any] = {
        "nodes": frame.eval_on_selector_all("svg.profile g.node", "g => g.length"),
        "profile": time.perf_counter() - t0,
    }
    _shot(page, shots, "profile", suffix)
    for view, sel in (("heatmap", "canvas.hm-canvas"), ("worst", "tr.worst-row"), ("code", "pre.code, p.note")):
        t1 = time.perf_counter()
        frame.click(f"button[data-view={view}]")
        frame.wait_for_selector(sel, timeout=120_000, state="attached")
        out[view] = time.perf_counter() - t1
        if view == "heatmap":
            out["heatmap_elements"] = frame.evaluate("document.querySelectorAll('*').length")
            out["heatmap_fetches"] = frame.evaluate(
                "performance.getEntriesByType('resource').filter((e) => e.name.includes('/heatmap?')).length"
            )
            out["heatmap_bytes"] = frame.evaluate(
                "Math.max(0, ...performance.getEntriesByType('resource').filter((e) => "
                "e.name.includes('/heatmap?')).map((e) => e.decodedBodySize))"
            )
        if view == "heatmap" and shots:
            canvas = frame.locator("canvas.hm-canvas[data-dir=bwd]").first
            canvas.click(position={"x": canvas.bounding_box()["width"] - 3, "y": 20})
            frame.wait_for_selector(".series-box polyline", state="attached")
            page.mouse.move(5, 5)
        _shot(page, shots, view, suffix)
    out["errors"] = errors
    page.close()
    return out


def time_custom_scalars(
    url: str, browser: Any, timeout_s: float = 120.0, shots: Optional[Path] = None
) -> Dict[str, Any]:
    """Seconds from navigation to CUSTOM SCALARS' first chart with a line (None: not within ``timeout_s``)."""
    layout = json.load(urllib.request.urlopen(f"{url}/data/plugin/custom_scalars/layout", timeout=30))
    charts = sum(len(c.get("chart", [])) for c in layout.get("category", []))
    opened = sum(len(c.get("chart", [])) for c in layout.get("category", []) if not c.get("closed"))
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    t0 = time.perf_counter()
    page.goto(f"{url}/#custom_scalars")
    try:
        page.wait_for_selector(CUSTOM_DRAWN, timeout=timeout_s * 1000, state="attached")
        seconds: Optional[float] = time.perf_counter() - t0
    except Exception:  # playwright's TimeoutError
        seconds = None
    if shots:
        page.wait_for_timeout(1000)
        page.screenshot(path=str(shots / "scales_custom_scalars.png"))
    page.close()
    return {"charts": charts, "open": opened, "categories": len(layout.get("category", [])), "first_chart": seconds}


def _shot(page: Any, folder: Optional[Path], view: str, suffix: str) -> None:
    if folder:
        page.screenshot(path=str(folder / f"scales_{view}{suffix}.png"))


def write_gpt_logs(layers: int, root: Path) -> Path:
    """The demo GPT with ``layers`` narrow layers, 3 steps, every step tracked
    (``tests/dashboard/_dashboard_logs.py``)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from _dashboard_logs import write_gpt_logs as write

    return write(root, layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logdir", default=None)
    parser.add_argument(
        "--gpt-layers", type=int, nargs="*", default=None, help="write demo-GPT logs of these depths and time each"
    )
    parser.add_argument("--screenshots", default=None, help="folder for scales_<view>.png (of the first log timed)")
    parser.add_argument("--custom-timeout", type=float, default=120.0)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    logdirs = [args.logdir] if args.logdir else []
    for layers in args.gpt_layers or []:
        logdirs.append(str(write_gpt_logs(layers, Path(tempfile.mkdtemp())).parent.parent))
    for k, logdir in enumerate(logdirs):
        proc, url = serve(logdir)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(
                    executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
                )
                views = time_views(url, browser, Path(args.screenshots) if args.screenshots and k == 0 else None)
                custom = time_custom_scalars(
                    url, browser, args.custom_timeout, Path(args.screenshots) if args.screenshots and k == 0 else None
                )
                browser.close()
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        first = "not within the timeout" if custom["first_chart"] is None else f"{custom['first_chart']:.2f} s"
        print(
            f"{logdir}: {views['nodes']} nodes; profile {views['profile']:.2f} s after navigation; heatmap "
            f"{views['heatmap']:.2f} s, "
            f"worst {views['worst']:.2f} s, code {views['code']:.2f} s; heatmap: {views['heatmap_elements']} elements, "
            f"{views['heatmap_fetches']} fetch of {views['heatmap_bytes'] / 1e6:.2f} MB; CUSTOM SCALARS "
            f"{custom['charts']} charts in {custom['categories']} "
            f"categories ({custom['open']} open), first chart {first}; page errors: {views['errors'] or 'none'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
