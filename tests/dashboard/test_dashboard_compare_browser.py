"""The Compare view in a real browser: headless Chromium against a real `tensorboard` serving
two real runs of a tiny GPT (one with a layer's weights scaled at initialisation) and a
synthetic run of other nodes. What the view draws is compared with the logged numbers."""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Tuple

import pytest
from _dashboard_logs import logged
from test_dashboard_browser import _plugin_frame, browser_page, heatmap_cell, tensorboard

from lightning_scale.tools import synthetic
from tests.compare_runs import SCALED_LAYER, STEPS, fit

pytestmark = pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
Scalars = Dict[str, Dict[int, float]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Any, Any, List[str], Scalars, Scalars]]:
    """The page, the plugin's frame in the Compare view with run B ``scaled`` at step 0, the
    page's errors, and both runs' logged scalars."""
    root = tmp_path_factory.mktemp("logs")
    a, b = fit(root, "a"), fit(root, "scaled", scaled=8.0)
    synthetic.main(["--nodes", "6", "--steps", "2", "--logdir", str(root / "synthetic")])
    with tensorboard(root, tmp_path_factory) as url, browser_page(f"{url}/#scales") as (pg, errors):
        frame = _plugin_frame(pg)
        frame.wait_for_selector("svg.profile g.node", timeout=30_000)
        frame.select_option("#run", "a")
        frame.wait_for_selector("svg.profile g.node")
        frame.click("button[data-view=compare]")
        frame.wait_for_selector("svg.compare g.cmp-node", timeout=30_000)
        frame.select_option("#other", "scaled")
        frame.eval_on_selector("#step", "s => { s.value = 0; s.dispatchEvent(new Event('input')); }")
        frame.wait_for_function(
            "document.querySelector('.compare-legend')?.textContent.includes('scaled at step 0')", timeout=30_000
        )
        yield pg, frame, errors, logged(a)[1], logged(b)[1]


def _log2_std(scalars: Scalars, d: str, label: str, step: int = 0) -> float:
    return math.log2(scalars[f"scale/{d}/{label}"][step])


def test_the_perturbed_layer_is_first_in_the_table_and_marked_as_the_first_divergence(
    served: Tuple[Any, Any, List[str], Scalars, Scalars],
) -> None:
    _, frame, errors, scalars_a, scalars_b = served
    rows = frame.eval_on_selector_all(
        "tr.ranked-row",
        "rs => rs.map(r => ({label: r.dataset.label, dir: r.dataset.dir, diff: +r.dataset.difference, "
        "first: r.classList.contains('first')}))",
    )
    weight = f"{SCALED_LAYER}.weight"
    assert rows[0] == {"label": weight, "dir": "fwd", "diff": pytest.approx(3.0, abs=1e-3), "first": True}
    assert [r for r in rows if r["first"]] == rows[:1]
    assert [abs(r["diff"]) for r in rows] == sorted((abs(r["diff"]) for r in rows), reverse=True)
    for r in rows[:10]:  # the ranked differences are those of the logged stds
        logged_diff = _log2_std(scalars_b, r["dir"], r["label"]) - _log2_std(scalars_a, r["dir"], r["label"])
        assert r["diff"] == pytest.approx(logged_diff, abs=2e-4), r
    legend = frame.inner_text(".compare-legend")
    assert "87 nodes matched, 0 only in A, 0 only in B" in legend
    assert f"first divergence: {weight} forward, Δ log2 std +3.00" in legend
    assert not errors


def test_the_profile_draws_both_runs_per_node_with_the_format_edges(
    served: Tuple[Any, Any, List[str], Scalars, Scalars],
) -> None:
    _, frame, errors, scalars_a, scalars_b = served
    nodes = frame.eval_on_selector_all(
        "svg.compare g.cmp-node",
        "gs => gs.map(g => ({label: g.dataset.label, ...g.dataset, first: g.classList.contains('first'), "
        "rings: g.querySelectorAll('circle.run-a').length, dots: g.querySelectorAll('circle.run-b').length}))",
    )
    assert len(nodes) == 87 and [n["label"] for n in nodes if n["first"]] == [f"{SCALED_LAYER}.weight"]
    for n in nodes:
        for d in ("fwd", "bwd"):
            for run, scalars in (("a", scalars_a), ("b", scalars_b)):
                drawn, value = n[f"{d}A" if run == "a" else f"{d}B"], scalars.get(f"scale/{d}/{n['label']}", {}).get(0)
                if value is None or value == 0:
                    assert drawn == "", (n, d, run)
                else:
                    assert float(drawn) == pytest.approx(math.log2(value), abs=1e-4), (n, d, run)
    first = next(n for n in nodes if n["first"])
    assert (first["rings"], first["dots"]) == (2, 2)  # A and B, forward and backward
    edge_labels = frame.eval_on_selector_all("svg.profile-axis text.edge-label", "ts => ts.map(t => t.textContent)")
    assert "fp16 · e5m2 min◂" in edge_labels
    assert frame.eval_on_selector_all("svg.compare line.edge", "ls => ls.length") >= 3
    assert not errors


def test_the_heatmap_shows_the_difference_over_steps(
    served: Tuple[Any, Any, List[str], Scalars, Scalars],
) -> None:
    pg, frame, errors, scalars_a, scalars_b = served
    frame.select_option("#compare-show", "difference over steps")
    frame.wait_for_selector("canvas.hm-canvas")
    assert frame.is_hidden("#step-control") and "run B − run A" in frame.inner_text(".legend")
    labels = frame.eval_on_selector_all(".row-label", "ls => ls.map(l => l.title)")
    row = labels.index(f"{SCALED_LAYER}/linear")
    for col in range(STEPS):
        tip = heatmap_cell(pg, frame, "fwd", row, col)
        expected = _log2_std(scalars_b, "fwd", labels[row], col) - _log2_std(scalars_a, "fwd", labels[row], col)
        assert tip.startswith(f"{labels[row]} · fwd · step {col} · Δ log2 std ")
        assert float(tip.rsplit(" ", 1)[1]) == pytest.approx(expected, rel=5e-3), tip  # shown to 3 digits
    heatmap_cell(pg, frame, "fwd", row, STEPS - 1, click=True)
    frame.wait_for_selector(".series-box polyline", state="attached")
    assert "Δ log2 std/fwd" in frame.inner_text(".series-box table")
    frame.select_option("#compare-show", "profile and ranking")
    frame.wait_for_selector("svg.compare g.cmp-node")
    assert not errors


def test_runs_without_a_common_node_are_one_message_in_the_page(
    served: Tuple[Any, Any, List[str], Scalars, Scalars],
) -> None:
    _, frame, errors, _, _ = served
    for show in ("difference over steps", "profile and ranking"):
        frame.select_option("#compare-show", show)
        frame.select_option("#other", "synthetic")
        frame.wait_for_selector("#view p.error")
        message = frame.inner_text("#view p.error")
        assert message.startswith("runs a and synthetic have no node in common (a logged 87 nodes"), message
        frame.select_option("#other", "scaled")
        frame.wait_for_selector("#view p.error", state="detached")
    frame.select_option("#other", "scaled")
    frame.wait_for_selector("svg.compare g.cmp-node")
    assert not [e for e in errors if "status of 400" not in e]  # the route's 400 answer is the message shown
