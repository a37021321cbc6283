"""The `scales` dashboard in a real browser: headless Chromium driven by Playwright against a
real `tensorboard` server (loading the plugin through its entry point) serving the logs of
a real Trainer run. Each view is read back and compared with the logged numbers."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from _dashboard_logs import STEPS, logged, logged_labels, write_logs

from lightning_scale.dashboard import metadata

# The system browser (Playwright's own download cannot work offline); overridable for other layouts.
CHROMIUM = os.environ.get("LIGHTNING_SCALE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
FP16_MIN, FP16_MAX = 2.0**-14, 65504.0

if not os.path.exists(CHROMIUM):
    pytest.skip(f"no Chromium at {CHROMIUM} (`apt-get install -y chromium` as root; `make venv` and .ci/run do it where they can)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason='playwright is not installed (pip install -e ".[test]")')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry_point_path(tmp: Path) -> str:
    """A directory that declares the plugin's entry point, unless the installed package does.

    A source checkout used without `pip install -e .` has no entry point metadata; this
    stands in for it, so TensorBoard still finds the plugin the way a user's install does.
    """
    if any(ep.name == "scales" for ep in importlib.metadata.entry_points(group="tensorboard_plugins")):
        return ""
    info = tmp / "lightning_scale_dashboard_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lightning-scale-dashboard-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[tensorboard_plugins]\nscales = lightning_scale.dashboard.plugin:ScalesPlugin\n")
    return str(tmp)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, Path]]:
    log_dir = write_logs(tmp_path_factory.mktemp("logs"))
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), _entry_point_path(tmp_path_factory.mktemp("ep")), os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(log_dir.parent.parent), "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_plugin(url, proc)
        yield url, log_dir
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _wait_for_plugin(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            listing = json.load(urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=5))
            if listing.get("scales", {}).get("enabled"):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the scales plugin did not become active in time")


@pytest.fixture(scope="module")
def page(server: Tuple[str, Path]) -> Iterator[Tuple[Any, Any, List[str]]]:
    errors: List[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        pg = browser.new_page(viewport={"width": 1500, "height": 1000})
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on("console", lambda m: errors.append(m.text) if m.type == "error" and "plugin/scales" in (m.location or {}).get("url", "") else None)
        pg.goto(f"{server[0]}/#scales")
        frame = _plugin_frame(pg)
        frame.wait_for_selector("svg.profile g.node", timeout=30_000)
        yield pg, frame, errors
        browser.close()


def _plugin_frame(pg: Any) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for frame in pg.frames:
            if "plugin_entry.html?name=scales" in frame.url:
                return frame
        pg.wait_for_timeout(200)
    raise AssertionError(f"no scales frame among {[f.url for f in pg.frames]}")


def _profile(frame: Any) -> List[Dict[str, str]]:
    return frame.eval_on_selector_all("svg.profile g.node", "gs => gs.map(g => ({label: g.dataset.label, fwd: g.dataset.fwd, bwd: g.dataset.bwd}))")


def _check_profile(rows: List[Dict[str, str]], scalars: Dict[str, Dict[int, float]], step: int) -> None:
    for row in rows:
        for d in ("fwd", "bwd"):
            logged_std = scalars.get(f"scale/{d}/{row['label']}", {}).get(step)
            if logged_std is None:
                assert row[d] == ""
            else:
                assert float(row[d]) == pytest.approx(math.log2(logged_std), abs=1e-6), (row, d)


def test_plugin_listed_labels_in_order_and_slider(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    pg, frame, errors = page
    acc, scalars = logged(server[1])
    assert pg.get_by_text("Scales", exact=False).first.is_visible()
    nodes = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    rows = _profile(frame)
    assert [r["label"] for r in rows] == nodes
    assert frame.inner_text("#step-value") == str(STEPS - 1)
    _check_profile(rows, scalars, STEPS - 1)
    frame.eval_on_selector("#step", "s => { s.value = 0; s.dispatchEvent(new Event('input')); }")
    frame.wait_for_function("document.querySelector('#step-value').textContent === '0' && document.querySelector('.legend').textContent.includes('step 0')")
    changed = _profile(frame)
    assert changed != rows
    _check_profile(changed, scalars, 0)
    assert float(frame.inner_text("table.ratios td:nth-child(2)")) == pytest.approx(scalars["update_ratio/blocks.0.0.weight"][0], rel=1e-3)
    assert not errors


def test_profile_hover_and_collapse(page: Tuple[Any, Any, List[str]]) -> None:
    _, frame, errors = page
    frame.click("button[data-view=profile]")
    frame.wait_for_selector("svg.profile g.node")
    node = frame.locator("svg.profile g.node[data-label='blocks.1.0/linear']")
    node.hover()
    tip = frame.inner_text(".tip")
    assert "blocks.1.0/linear" in tip and "(activation)" in tip
    assert all(name in tip for name in ("std", "absmax", "below_normal_fp16"))
    before = len(_profile(frame))
    frame.click("svg.profile text.group[data-group='blocks.1']")
    frame.wait_for_function(f"document.querySelectorAll('svg.profile g.node').length < {before}")
    assert not [r for r in _profile(frame) if r["label"].startswith("blocks.1.")]
    frame.click("svg.profile text.group[data-group='blocks.1']")
    frame.wait_for_function(f"document.querySelectorAll('svg.profile g.node').length === {before}")
    assert not errors


def test_heatmap_cells_and_series(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    _, frame, errors = page
    acc, scalars = logged(server[1])
    frame.click("button[data-view=heatmap]")
    frame.wait_for_selector("svg.heatmap rect.cell")
    n = len(metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"])
    for d in ("fwd", "bwd"):
        assert frame.eval_on_selector_all(f"svg.heatmap[data-dir={d}] rect.cell", "cs => cs.length") == n * STEPS
    labels = frame.eval_on_selector_all("svg.heatmap[data-dir=fwd] text.row-label", "ts => ts.map(t => t.textContent)")
    cell = frame.locator("svg.heatmap[data-dir=fwd] rect.cell[data-row='2'][data-col='1']")
    assert float(cell.get_attribute("data-v")) == pytest.approx(math.log2(scalars[f"scale/fwd/{labels[2]}"][1]), abs=1e-6)
    cell.click()
    frame.wait_for_selector(".series-box polyline", state="attached")
    assert labels[2] in frame.inner_text(".series-box h4")
    assert not errors


def _independent_ranking(order: List[str], scalars: Dict[str, Dict[int, float]], step: int) -> List[Tuple[str, str, float]]:
    rows = []
    for label in order:  # ties keep execution order
        for d in ("fwd", "bwd"):
            if f"scale/{d}/{label}" in scalars:
                std, absmax = scalars[f"scale/{d}/{label}"][step], scalars[f"absmax/{d}/{label}"][step]
                rows.append((label, d, min(math.log2(std / FP16_MIN), math.log2(FP16_MAX / absmax))))
    return sorted(rows, key=lambda r: r[2])


def test_worst_nodes_ranking_matches_the_logged_numbers(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    _, frame, errors = page
    acc, scalars = logged(server[1])
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    frame.click("button[data-view=worst]")
    frame.wait_for_selector("table.worst tr.worst-row")
    step = int(frame.inner_text("#step-value"))
    shown = frame.eval_on_selector_all("tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.dataset.dir, +r.dataset.headroom])")
    want = _independent_ranking(order, scalars, step)
    assert [(l, d) for l, d, _ in shown] == [(l, d) for l, d, _ in want]
    assert [h for _, _, h in shown] == pytest.approx([h for _, _, h in want], abs=1e-5)
    frame.fill("#regex", r"blocks\.1")
    frame.wait_for_function("[...document.querySelectorAll('tr.worst-row')].every(r => r.dataset.label.includes('blocks.1'))")
    assert frame.eval_on_selector_all("tr.worst-row", "rs => rs.length") == len([w for w in want if "blocks.1" in w[0]])
    assert not errors


def test_code_and_validation_views(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    _, frame, errors = page
    _, scalars = logged(server[1])
    frame.click("button[data-view=code]")
    frame.wait_for_selector("pre.code")
    assert "def forward" in frame.inner_text("pre.code")
    frame.select_option("#prefix", "val_")
    frame.click("button[data-view=profile]")
    frame.wait_for_function("document.querySelector('#prefix').value === 'val_' && document.querySelectorAll('svg.profile g.node').length > 0")
    frame.wait_for_function(f"document.querySelectorAll('svg.profile g.node').length === {len(logged_labels(scalars, 'val_'))}")
    assert {r["label"] for r in _profile(frame)} == set(logged_labels(scalars, "val_"))
    assert not errors
