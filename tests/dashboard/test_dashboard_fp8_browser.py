"""The low-precision statistics in the `scales` dashboard, in a real browser: headless Chromium
against a real `tensorboard` server serving a real Trainer run with the ``fp8``, ``blocks``,
``kurtosis`` and ``channels`` groups. The statistic picker redraws the profile and the heatmap
with the FP8 SNR (and the profile with kurtosis and the channel ratio), and the worst-nodes view
ranks by the FP8 SNR and by each ranking statistic the run logged; what each shows is compared
with the logged numbers."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from _dashboard_logs import Blocks, logged
from test_dashboard_browser import (
    CHROMIUM,
    ROOT,
    _entry_point_path,
    _free_port,
    _plugin_frame,
    _wait_for_plugin,
    heatmap_cell,
    sync_api,
)
from test_dashboard_fp8 import RANKED, write_fp8_logs

from lightning_scale.capture import capture
from lightning_scale.dashboard import metadata

Scalars = Dict[str, Dict[int, float]]
ALIASES = capture(Blocks(), "auto").aliases  # one row per tensor: an alias is listed in its source's row


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Any, Any, List[str], Scalars, List[str]]]:
    """The page, the plugin's frame at the profile, the node order, the logged scalars, the page's errors."""
    log_dir = write_fp8_logs(tmp_path_factory.mktemp("logs"))
    acc, scalars = logged(log_dir)
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
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
        str(log_dir.parent.parent),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load_fast=false",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    errors: List[str] = []
    try:
        _wait_for_plugin(f"http://127.0.0.1:{port}", proc)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
            )
            pg = browser.new_page(viewport={"width": 1500, "height": 1000})
            pg.on("pageerror", lambda e: errors.append(str(e)))
            pg.goto(f"http://127.0.0.1:{port}/#scales")
            frame = _plugin_frame(pg)
            frame.wait_for_selector("svg.profile g.node", timeout=30_000)
            yield pg, frame, order, scalars, errors
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _value(scalars: Scalars, tag: str, step: int) -> Any:
    """The logged value as a view draws it: None where missing or not finite (SNR +inf)."""
    v = scalars.get(tag, {}).get(step)
    return v if v is not None and math.isfinite(v) else None


def test_profile_and_heatmap_draw_the_picked_fp8_statistic(
    served: Tuple[Any, Any, List[str], Scalars, List[str]],
) -> None:
    pg, frame, order, scalars, errors = served
    options = frame.eval_on_selector_all("#stat option", "os => os.map(o => o.value)")
    assert options[0] == "std" and {"fp8_e4m3_snr_db", "fp8_e5m2_flushed"} <= set(options)
    frame.select_option("#stat", "fp8_e4m3_snr_db")
    frame.wait_for_selector("svg.profile[data-stat=fp8_e4m3_snr_db]")
    step = int(frame.inner_text("#step-value"))
    rows = frame.eval_on_selector_all(
        "svg.profile g.node", "gs => gs.map(g => [g.dataset.label, g.dataset.fwd, g.dataset.bwd])"
    )
    assert [r[0] for r in rows] == order
    for label, fwd, bwd in rows:
        for d, drawn in (("fwd", fwd), ("bwd", bwd)):
            want = _value(scalars, f"fp8_e4m3_snr_db/{d}/{label}", step)
            assert (drawn == "" and want is None) or float(drawn) == pytest.approx(want, abs=1e-4), (label, d)
    assert "x: fp8_e4m3_snr_db" in frame.inner_text(".legend")
    frame.click("button[data-view=heatmap]")  # the picked statistic carries over
    frame.wait_for_selector("canvas.hm-canvas")
    labels = [order[int(i)] for i in frame.eval_on_selector_all(".row-label", "ls => ls.map(l => l.dataset.row)")]
    assert labels == order
    steps = sorted({s for tag, series in scalars.items() if tag.startswith("scale/") for s in series})
    shown = 0
    for i, label in enumerate(labels):  # every row's first and last step, as the tooltip shows them
        for j in (0, len(steps) - 1):
            tip = heatmap_cell(pg, frame, "bwd", i, j)
            assert tip.startswith(f"{label} · bwd · step {steps[j]} · fp8_e4m3_snr_db "), tip
            want, drawn = _value(scalars, f"fp8_e4m3_snr_db/bwd/{label}", steps[j]), tip.rsplit(" ", 1)[1]
            assert (drawn == "–" and want is None) or float(drawn) == pytest.approx(
                want, rel=5e-3
            )  # three significant digits, (label, j)
            shown += drawn != "–"
    assert shown > 10
    assert "fp8_e4m3_snr_db" in frame.inner_text(".legend")
    # a cell's series: the picked statistic over the steps, one point per finite value
    i = next(
        i for i, label in enumerate(labels) if _value(scalars, f"fp8_e4m3_snr_db/bwd/{label}", steps[0]) is not None
    )
    heatmap_cell(pg, frame, "bwd", i, 0, click=True)
    frame.wait_for_selector(".series-box polyline.bwd", state="attached")
    assert labels[i] in frame.inner_text(".series-box h4") and "fp8_e4m3_snr_db" in frame.inner_text(".series-box h4")
    points = frame.get_attribute(".series-box polyline.bwd", "points").split()
    assert len(points) == sum(_value(scalars, f"fp8_e4m3_snr_db/bwd/{labels[i]}", s) is not None for s in steps)
    assert not errors


def test_worst_view_ranks_by_fp8_snr(served: Tuple[Any, Any, List[str], Scalars, List[str]]) -> None:
    _, frame, order, scalars, errors = served
    frame.click("button[data-view=worst]")
    frame.select_option("#by", "fp8")
    frame.wait_for_function(
        "document.querySelector('p.note') && document.querySelector('p.note').textContent.includes('FP8 what-if')"
    )
    step = int(frame.inner_text("#step-value"))
    shown = frame.eval_on_selector_all(
        "tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.dataset.dir, r.dataset.snr])"
    )
    recipe = (("fwd", "e4m3"), ("bwd", "e5m2"))
    want = sorted(
        (
            (scalars[f"fp8_{fmt}_snr_db/{d}/{label}"][step], label, d)
            for label in order
            for d, fmt in recipe
            if f"scale/{d}/{label}" in scalars and ALIASES.get(label) not in order
        ),
        key=lambda r: r[0],
    )  # stable: ties in execution order
    assert [(l, d) for l, d, _ in shown] == [(l, d) for _, l, d in want]
    for (_, _, snr), (v, _, _) in zip(shown, want):
        assert (snr == "" and v == math.inf) or float(snr) == pytest.approx(v, abs=1e-4)
    assert not errors


def _profile_values(frame: Any, stat: str) -> List[Tuple[str, str, str]]:
    frame.select_option("#stat", stat)
    frame.wait_for_selector(f"svg.profile[data-stat={stat}]")
    return frame.eval_on_selector_all(
        "svg.profile g.node", "gs => gs.map(g => [g.dataset.label, g.dataset.fwd, g.dataset.bwd])"
    )


def test_profile_draws_kurtosis_and_the_channel_ratio(served: Tuple[Any, Any, List[str], Scalars, List[str]]) -> None:
    _, frame, order, scalars, errors = served
    frame.click("button[data-view=profile]")
    frame.wait_for_selector("svg.profile g.node")
    options = frame.eval_on_selector_all("#stat option", "os => os.map(o => o.value)")
    assert {"kurtosis", "mxfp4_snr_db", "nvfp4_flushed", "channel_max_ratio", "outlier_channels"} <= set(options)
    for stat in ("kurtosis", "channel_max_ratio"):
        rows = _profile_values(frame, stat)
        step = int(frame.inner_text("#step-value"))
        assert [r[0] for r in rows] == order
        drawn = 0
        for label, fwd, bwd in rows:
            for d, value in (("fwd", fwd), ("bwd", bwd)):
                want = _value(scalars, f"{stat}/{d}/{label}", step)
                assert (value == "" and want is None) or float(value) == pytest.approx(want, rel=1e-6), (stat, label)
                drawn += value != ""
        assert drawn > 10, stat
    assert not errors


@pytest.mark.parametrize("stat", list(RANKED))
def test_worst_view_ranks_by_the_logged_statistics(
    stat: str, served: Tuple[Any, Any, List[str], Scalars, List[str]]
) -> None:
    _, frame, order, scalars, errors = served
    frame.click("button[data-view=worst]")
    frame.wait_for_selector("tr.worst-row")
    assert stat in frame.eval_on_selector_all("#by option", "os => os.map(o => o.value)")
    frame.select_option("#by", stat)
    frame.wait_for_function(
        f"document.querySelector('p.note') && document.querySelector('p.note').textContent.includes('{stat} (')"
    )
    step = int(frame.inner_text("#step-value"))
    shown = frame.eval_on_selector_all(
        "tr.worst-row", "rs => rs.map(r => [r.dataset.label, r.dataset.dir, r.dataset.value])"
    )
    rows = [
        (scalars.get(f"{stat}/{d}/{label}", {}).get(step, math.nan), label, d)
        for label in order
        for d in ("fwd", "bwd")
        if f"scale/{d}/{label}" in scalars and ALIASES.get(label) not in order
    ]
    key = (lambda r: -r[0]) if RANKED[stat] else (lambda r: r[0])
    want = sorted((r for r in rows if not math.isnan(r[0])), key=key) + [r for r in rows if math.isnan(r[0])]
    assert [(l, d) for l, d, _ in shown] == [(l, d) for _, l, d in want]
    for (_, _, value), (v, _, _) in zip(shown, want):
        assert (value == "" and not math.isfinite(v)) or float(value) == pytest.approx(v, rel=1e-6)
    header = frame.eval_on_selector_all("table.worst th", "hs => hs.map(h => h.textContent)")
    assert header[-1] == stat
    assert not errors
