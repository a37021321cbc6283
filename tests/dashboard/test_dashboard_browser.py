"""The `scales` dashboard in a real browser: headless Chromium driven by Playwright against a
real `tensorboard` server (loading the plugin through its entry point) serving the logs of
a real Trainer run. Each view is read back and compared with the logged numbers."""

from __future__ import annotations

import contextlib
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
from _dashboard_logs import STEPS, Blocks, logged, logged_labels, write_logs

from lightning_scale.capture import capture
from lightning_scale.dashboard import metadata
from lightning_scale.dashboard.layout import module_group

# The system browser (Playwright's own download cannot work offline); overridable for other layouts.
CHROMIUM = os.environ.get("LIGHTNING_SCALE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
FP16_MIN, FP16_MAX = 2.0**-14, 65504.0

if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no Chromium at {CHROMIUM} (`apt-get install -y chromium` as root; `make venv` and .ci/run do it where they "
        f"can)",
        allow_module_level=True,
    )
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
    (info / "entry_points.txt").write_text(
        "[tensorboard_plugins]\nscales = lightning_scale.dashboard.plugin:ScalesPlugin\n"
    )
    return str(tmp)


@contextlib.contextmanager
def tensorboard(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `tensorboard` on `logdir` with the plugin active; its URL."""
    port = _free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            p
            for p in (str(ROOT), _entry_point_path(tmp_path_factory.mktemp("ep")), os.environ.get("PYTHONPATH", ""))
            if p
        ),
    )
    cmd = [
        sys.executable,
        "-m",
        "tensorboard.main",
        "--logdir",
        str(logdir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load_fast=false",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for_plugin(url, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, Path]]:
    log_dir = write_logs(tmp_path_factory.mktemp("logs"))
    with tensorboard(log_dir.parent.parent, tmp_path_factory) as url:
        yield url, log_dir


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


@contextlib.contextmanager
def browser_page(url: str) -> Iterator[Tuple[Any, List[str]]]:
    """A page of headless Chromium at `url` and the list its errors are gathered in."""
    errors: List[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        pg = browser.new_page(viewport={"width": 1500, "height": 1000})
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.on(
            "console",
            lambda m: (
                errors.append(m.text)
                if m.type == "error" and "plugin/scales" in (m.location or {}).get("url", "")
                else None
            ),
        )
        pg.goto(url)
        try:
            yield pg, errors
        finally:
            browser.close()


@pytest.fixture(scope="module")
def page(server: Tuple[str, Path]) -> Iterator[Tuple[Any, Any, List[str]]]:
    with browser_page(f"{server[0]}/#scales") as (pg, errors):
        frame = _plugin_frame(pg)
        frame.wait_for_selector("svg.profile g.node", timeout=30_000)
        yield pg, frame, errors


def _plugin_frame(pg: Any) -> Any:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for frame in pg.frames:
            if "plugin_entry.html?name=scales" in frame.url:
                return frame
        pg.wait_for_timeout(200)
    raise AssertionError(f"no scales frame among {[f.url for f in pg.frames]}")


def _profile(frame: Any) -> List[Dict[str, str]]:
    return frame.eval_on_selector_all(
        "svg.profile g.node", "gs => gs.map(g => ({label: g.dataset.label, fwd: g.dataset.fwd, bwd: g.dataset.bwd}))"
    )


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
    frame.wait_for_function(
        "document.querySelector('#step-value').textContent === '0' && "
        "document.querySelector('.legend').textContent.includes('step 0')"
    )
    changed = _profile(frame)
    assert changed != rows
    _check_profile(changed, scalars, 0)
    assert float(frame.inner_text("table.ratios td:nth-child(2)")) == pytest.approx(
        scalars["update_ratio/blocks.0.0.weight"][0], rel=1e-3
    )
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


def test_profile_marks_nodes_outside_a_format_and_keeps_its_axis_in_view(
    server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]
) -> None:
    pg, frame, errors = page
    _, scalars = logged(server[1])
    frame.click("button[data-view=profile]")
    frame.wait_for_selector("svg.profile g.node")
    step = int(frame.inner_text("#step-value"))
    outside = [
        l
        for l in logged_labels(scalars)
        if any(
            scalars.get(f"scale/{d}/{l}", {}).get(step, 1.0) < FP16_MIN
            or scalars.get(f"absmax/{d}/{l}", {}).get(step, 0.0) > FP16_MAX
            for d in ("fwd", "bwd")
        )
    ]
    assert outside  # the test sees some
    assert sorted(frame.eval_on_selector_all("svg.profile g.node.out", "gs => gs.map(g => g.dataset.label)")) == sorted(
        outside
    )
    assert f"{len(outside)} of {len(logged_labels(scalars))} nodes outside fp16" in frame.inner_text(".legend")
    assert "absmax" in frame.inner_text(".legend")  # logged here
    frame.check("#only")
    frame.wait_for_function(f"document.querySelectorAll('svg.profile g.node').length === {len(outside)}")
    assert sorted(r["label"] for r in _profile(frame)) == sorted(outside)
    frame.uncheck("#only")
    frame.wait_for_function(f"document.querySelectorAll('svg.profile g.node').length === {len(logged_labels(scalars))}")
    assert crossings(frame, "svg.profile-axis") == []  # edge labels whole, no line through them
    assert "fp16 · e5m2 min◂" in frame.eval_on_selector_all(
        "svg.profile-axis text.edge-label", "ts => ts.map(t => t.textContent)"
    )
    pg.set_viewport_size({"width": 1500, "height": 300})  # scrolled far down, the axis stays in view
    frame.evaluate("window.scrollTo(0, document.body.scrollHeight)")
    frame.wait_for_timeout(100)
    assert "-12" in visible_texts(frame, "svg.profile-axis text.axis")
    pg.set_viewport_size({"width": 1500, "height": 1000})
    frame.evaluate("window.scrollTo(0, 0)")
    assert not errors


def heatmap_cell(pg: Any, frame: Any, d: str, row: int, col: int, click: bool = False) -> str:
    """The tooltip the heatmap shows with the mouse over the cell of node `row` at step index
    `col` (level with the row's label, on that block's canvas); a click there if `click`."""
    label = frame.locator(f".row-label[data-row='{row}']")
    label.evaluate("l => l.scrollIntoView({block: 'center'})")
    canvas = frame.locator(f".hm-block:has(.row-label[data-row='{row}']) canvas.hm-canvas[data-dir={d}]")
    cw, box, at = float(canvas.get_attribute("data-cw")), canvas.bounding_box(), label.bounding_box()
    x, y = box["x"] + (col + 0.5) * cw, at["y"] + at["height"] / 2
    pg.mouse.move(x, y)
    if click:
        pg.mouse.click(x, y)
    return frame.inner_text(".tip")


def visible_texts(frame: Any, selector: str) -> List[str]:
    """Texts of the elements matching `selector` that are really on screen (in the viewport, not hidden)."""
    return frame.eval_on_selector_all(
        selector,
        """els => els.filter((e) => { const r = e.getBoundingClientRect();
                    return e.checkVisibility() && r.height >= 8 && r.bottom > 0 && r.top < innerHeight
                      && r.right > 0 && r.left < innerWidth; })
                  .map((e) => e.textContent)""",
    )


def crossings(frame: Any, svg: str) -> List[str]:
    """Texts of `svg` that a line of it crosses, or that stick out of it."""
    return frame.eval_on_selector(
        svg,
        """(svg) => { const lines = [...svg.querySelectorAll('line')].map((l) => l.getBBox());
             const w = svg.width.baseVal.value; const out = [];
             for (const t of svg.querySelectorAll('text')) { const b = t.getBBox();
               if (b.x < -0.5 || b.x + b.width > w + 0.5) out.push('outside: ' + t.textContent);
               if (lines.some((l) => l.x > b.x + 0.5 && l.x < b.x + b.width - 0.5
                                && l.y < b.y + b.height - 1 && l.y + l.height > b.y + 1)) {
                 out.push('crossed: ' + t.textContent); } }
             return out; }""",
    )


def test_heatmap_rows_labelled_cells_and_series(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    pg, frame, errors = page
    acc, scalars = logged(server[1])
    frame.click("button[data-view=heatmap]")
    frame.wait_for_selector("canvas.hm-canvas")
    assert frame.is_hidden("#step-control")  # the heatmap shows every step: no slider
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    labels = frame.eval_on_selector_all(".row-label", "ls => ls.map(l => l.dataset.row)")
    assert [doc["labels"][int(i)] for i in labels] == doc["labels"]
    shown = visible_texts(frame, ".row-label")
    assert shown and all(t.lstrip("◆ ") in doc["labels"] for t in shown)
    bands = frame.eval_on_selector_all(".hm-band", "bs => bs.map(b => b.dataset.group)")
    groups = [module_group(l, l in doc["parameters"]) for l in doc["labels"]]
    assert bands == [g for k, g in enumerate(groups) if k == 0 or g != groups[k - 1]]  # a band per run of a block
    for row, col in ((2, 1), (len(doc["labels"]) - 1, STEPS - 1)):
        label = doc["labels"][row]
        tip = heatmap_cell(pg, frame, "fwd", row, col)
        assert tip.startswith(f"{label} · fwd · step {col} · log2 std ")
        assert float(tip.rsplit(" ", 1)[1]) == pytest.approx(math.log2(scalars[f"scale/fwd/{label}"][col]), abs=0.006)
    assert crossings(frame, "svg.colourbar") == []  # colour-bar labels: no tick through them, none cut off
    frame.click(".hm-band[data-group='blocks.1']")  # fold a block
    frame.wait_for_function("!document.querySelector(\".hm-block[data-group='blocks.1'] .row-label\")")
    assert not [
        t
        for t in frame.eval_on_selector_all(".row-label", "ls => ls.map(l => l.textContent)")
        if t.startswith("blocks.1.")
    ]
    frame.click(".hm-band[data-group='blocks.1']")
    frame.wait_for_selector(".hm-block[data-group='blocks.1'] .row-label")
    assert not errors


def test_heatmap_series_panel_opens_in_view_with_axes(
    server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]
) -> None:
    pg, frame, errors = page
    acc, scalars = logged(server[1])
    frame.click("button[data-view=heatmap]")
    frame.wait_for_selector("canvas.hm-canvas")
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    row = len(doc["labels"]) - 2
    heatmap_cell(pg, frame, "bwd", row, 1, click=True)
    frame.wait_for_selector(".series-box polyline", state="attached")
    box = frame.eval_on_selector(
        ".series-box",
        "b => { const r = b.getBoundingClientRect(); return [r.top, r.bottom, r.left, r.right, innerHeight, "
        "innerWidth]; }",
    )
    assert 0 <= box[0] and box[1] <= box[4] and 0 <= box[2] and box[3] <= box[5]  # in view, wherever the row was
    assert doc["labels"][row] in frame.inner_text(".series-box h4")
    assert frame.eval_on_selector_all(".series-box text.tick.x", "ts => ts.map(t => +t.textContent)") == list(
        range(STEPS)
    )
    assert len(frame.eval_on_selector_all(".series-box text.tick.y", "ts => ts")) >= 3
    titles = frame.eval_on_selector_all(".series-box text.axis-title", "ts => ts.map(t => t.textContent)")
    assert titles == ["step", "log2 std"]
    want = [math.log2(scalars[f"scale/bwd/{doc['labels'][row]}"][s]) for s in range(STEPS)]
    ys = [float(p.split(",")[1]) for p in frame.get_attribute(".series-box polyline.bwd", "points").split()]
    assert len(ys) == STEPS and all(
        (ys[a] < ys[b]) == (want[a] > want[b]) for a in range(STEPS) for b in range(STEPS) if want[a] != want[b]
    )  # higher value, higher point
    frame.click(".series-box .close")
    assert frame.is_hidden(".series-box")
    assert not errors


ALIASES = capture(Blocks(), "auto").aliases  # label -> label of the same tensor


def _independent_ranking(
    order: List[str], scalars: Dict[str, Dict[int, float]], step: int
) -> List[Tuple[str, str, float]]:
    rows = []
    for label in order:  # ties keep execution order; one row per tensor
        if ALIASES.get(label) in order:
            continue
        for d in ("fwd", "bwd"):
            if f"scale/{d}/{label}" in scalars:
                std, absmax = scalars[f"scale/{d}/{label}"][step], scalars[f"absmax/{d}/{label}"][step]
                rows.append((label, d, min(math.log2(std / FP16_MIN), math.log2(FP16_MAX / absmax))))
    return sorted(rows, key=lambda r: r[2])


def test_worst_nodes_ranking_matches_the_logged_numbers(
    server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]
) -> None:
    _, frame, errors = page
    acc, scalars = logged(server[1])
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    frame.click("button[data-view=worst]")
    frame.wait_for_selector("table.worst tr.worst-row")
    step = int(frame.inner_text("#step-value"))
    shown = frame.eval_on_selector_all(
        "tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.dataset.dir, +r.dataset.headroom])"
    )
    want = _independent_ranking(order, scalars, step)
    assert [(l, d) for l, d, _ in shown] == [(l, d) for l, d, _ in want]
    assert [h for _, _, h in shown] == pytest.approx([h for _, _, h in want], abs=1e-5)
    # a tensor's aliases are listed in its row
    for label, aliases in frame.eval_on_selector_all(
        "tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.querySelector('.aliases')?.textContent ?? ''])"
    ):
        assert aliases == (
            "= " + ", ".join(a for a in order if ALIASES.get(a) == label)
            if any(ALIASES.get(a) == label for a in order)
            else ""
        )
    assert any(
        a
        for _, a in frame.eval_on_selector_all(
            "tr.worst-row", "rs => rs.map(r => [0, r.querySelector('.aliases')?.textContent ?? ''])"
        )
    )
    # since when: the first tracked step outside FP16's range and for how many, as the scalars say
    for label, d, first, k, m in frame.eval_on_selector_all(
        "tr.worst-row",
        "rs => rs.map(r => [r.dataset.label, r.dataset.dir, r.dataset.first, +r.dataset.outSteps, +r.dataset.tracked])",
    ):
        out = [
            s
            for s in range(STEPS)
            if scalars[f"scale/{d}/{label}"][s] < FP16_MIN or scalars[f"absmax/{d}/{label}"][s] > FP16_MAX
        ]
        assert (first, k, m) == (str(out[0]) if out else "", len(out), STEPS)
    assert "below normal fp16" in frame.inner_text("table.worst tr")  # the run logged below_normal_fp16: its column
    frame.select_option("#by", "e4m3")
    frame.wait_for_selector("p.hint")
    assert "'underflow_e4m3', 'below_normal_e4m3', 'overflow_e4m3'" in frame.inner_text("p.hint")  # not logged: how to
    frame.select_option("#by", "fp16")
    frame.fill("#regex", r"blocks\.1")
    frame.wait_for_function(
        "[...document.querySelectorAll('tr.worst-row')].every(r => r.dataset.label.includes('blocks.1'))"
    )
    assert frame.eval_on_selector_all("tr.worst-row", "rs => rs.length") == len([w for w in want if "blocks.1" in w[0]])
    assert not errors


def test_a_user_statistic_is_shown_on_its_axis_and_ranks_nodes(
    server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]
) -> None:
    """``peak_abs`` (a user statistic, ``maxes``, declared log2 and worse high): in the Statistic
    menu with its docs line, drawn on the log2 axis with the format edges, and the Worst nodes
    view ranks by it, largest first, with the logged values."""
    _, frame, errors = page
    _, scalars = logged(server[1])
    frame.click("button[data-view=profile]")
    frame.wait_for_selector("#stat option", state="attached")
    options = frame.eval_on_selector_all("#stat option", "os => os.map(o => [o.textContent, o.title])")
    assert ["peak_abs", "max |x|, ours"] in [list(o) for o in options]
    frame.select_option("#stat", "peak_abs")
    frame.wait_for_function("document.querySelector('.legend').textContent.includes('log2 peak_abs')")
    assert frame.eval_on_selector_all("line.edge", "ls => ls.length") > 0  # (a magnitude: the format edges)
    frame.click("button[data-view=worst]")
    frame.wait_for_function("[...document.querySelectorAll('#by option')].some(o => o.textContent === 'peak_abs')")
    assert "peak_abs" in frame.eval_on_selector_all("#by option", "os => os.map(o => o.textContent)")
    frame.select_option("#by", "peak_abs")
    frame.wait_for_function("document.querySelector('table.worst tr').textContent.includes('peak_abs')")
    step = int(frame.inner_text("#step-value"))
    shown = frame.eval_on_selector_all(
        "tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.dataset.dir, +r.dataset.value])"
    )
    values = [v for _, _, v in shown]
    assert values == sorted(values, reverse=True) and len(values) > 5
    for label, d, v in shown:
        assert v == pytest.approx(scalars[f"peak_abs/{d}/{label}"][step], rel=1e-6), (label, d)
    assert not errors


def test_code_and_validation_views(server: Tuple[str, Path], page: Tuple[Any, Any, List[str]]) -> None:
    _, frame, errors = page
    _, scalars = logged(server[1])
    frame.click("button[data-view=code]")
    frame.wait_for_selector("pre.code")
    assert "def forward" in frame.inner_text("pre.code")
    assert frame.eval_on_selector("pre.code", "p => p.scrollWidth <= p.clientWidth")  # long lines wrap
    frame.select_option("#prefix", "val_")
    frame.click("button[data-view=profile]")
    frame.wait_for_function(
        "document.querySelector('#prefix').value === 'val_' && document.querySelectorAll('svg.profile "
        "g.node').length > 0"
    )
    frame.wait_for_function(
        f"document.querySelectorAll('svg.profile g.node').length === {len(logged_labels(scalars, 'val_'))}"
    )
    assert {r["label"] for r in _profile(frame)} == set(logged_labels(scalars, "val_"))
    assert not errors
