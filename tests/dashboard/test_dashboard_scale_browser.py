"""The dashboard at the size of a real model, in a real browser: the demo GPT with 56 narrow
layers (~2,000 nodes, more than the default ``max_tags=1000`` caps the scalars at), default
``ScaleMonitor`` options, served by a real `tensorboard` to headless Chromium. Every node is
shown, fast, with its label; the stock CUSTOM SCALARS tab still draws; what is shown is
compared with the records the writer logged."""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import pytest
from _dashboard_logs import GPT_STEPS, logged, write_gpt_logs
from tensorboard.util import tensor_util
from test_dashboard_browser import _plugin_frame, browser_page, heatmap_cell, tensorboard, visible_texts

from lightning_scale.dashboard import metadata

LAYERS = 56
Logged = Tuple[Dict[str, Any], np.ndarray, Dict[str, Dict[int, float]]]  # node list, std [steps, nodes, 2], scalars


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[str, Logged]]:
    """The server's URL; the node list, every node's std per step (from the records) and the scalars."""
    log_dir = write_gpt_logs(tmp_path_factory.mktemp("gpt"), LAYERS)
    acc, scalars = logged(log_dir)
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    events = sorted(
        (e for t in acc.Tags()["tensors"] if t.startswith(metadata.RECORDS) for e in acc.Tensors(t)),
        key=lambda e: e.step,
    )
    std = np.stack([tensor_util.make_ndarray(e.tensor_proto)[..., doc["statistics"].index("std")] for e in events])
    with tensorboard(log_dir.parent.parent, tmp_path_factory) as url:
        yield url, (doc, std, scalars)


def test_the_log_has_more_nodes_than_max_tags_and_scalars_are_capped(big: Tuple[str, Logged]) -> None:
    doc, std, scalars = big[1]
    assert 1900 <= len(doc["labels"]) <= 2200 and std.shape == (GPT_STEPS, len(doc["labels"]), 2)
    assert len({t.split("/", 2)[2] for t in scalars if t.startswith("scale/")}) == 1000  # the default cap
    assert not np.isnan(std[:, :, 0]).any()  # every node's forward std is in the records


def test_profile_shows_the_last_block_within_8_s(big: Tuple[str, Logged]) -> None:
    url, (doc, std, _) = big
    last = f"model.blocks.{LAYERS - 1}."
    with browser_page(f"{url}/#scales") as (pg, errors):
        t0 = time.perf_counter()
        frame = _plugin_frame(pg)
        frame.wait_for_selector(f"svg.profile g.node[data-label^='{last}']", timeout=60_000, state="attached")
        seconds = time.perf_counter() - t0
        rows = frame.eval_on_selector_all(
            "svg.profile g.node", "gs => gs.map(g => [g.dataset.label, g.dataset.fwd, g.dataset.bwd])"
        )
        assert [r[0] for r in rows] == doc["labels"]  # every node, in execution order
        for i in (0, len(rows) // 2, len(rows) - 1):
            for d, drawn in ((0, rows[i][1]), (1, rows[i][2])):
                want = std[-1, i, d]
                assert (drawn == "" and math.isnan(want)) or float(drawn) == pytest.approx(math.log2(want), abs=1e-5), (
                    rows[i]
                )
        legend = frame.inner_text(".legend")
        assert "absmax" not in legend  # not logged with the default statistics: the legend does not promise it
        assert not errors
    assert seconds < 8, f"the last block took {seconds:.1f} s"


def test_heatmap_rows_carry_visible_labels(big: Tuple[str, Logged]) -> None:
    url, (doc, std, _) = big
    with browser_page(f"{url}/#scales") as (pg, errors):
        frame = _plugin_frame(pg)
        frame.wait_for_selector("svg.profile g.node", timeout=60_000)
        frame.click("button[data-view=heatmap]")
        frame.wait_for_selector("canvas.hm-canvas", timeout=30_000)
        rows = frame.eval_on_selector_all(".row-label", "ls => ls.map(l => [+l.dataset.row, l.textContent])")
        assert [doc["labels"][i] for i, _ in rows] == doc["labels"]  # every row, none virtualised away
        assert all(text.lstrip("◆ ") == doc["labels"][i] for i, text in rows)
        on_screen = visible_texts(frame, ".row-label")
        assert len(on_screen) > 30 and set(on_screen) <= {t for _, t in rows}
        frame.locator(f".row-label[data-row='{len(rows) - 1}']").evaluate("l => l.scrollIntoView({block: 'center'})")
        assert doc["labels"][-1] in [t.lstrip("◆ ") for t in visible_texts(frame, ".row-label")]
        font = frame.eval_on_selector(".row-label", "l => parseFloat(getComputedStyle(l).fontSize)")
        assert font >= 9
        assert (
            frame.evaluate("document.querySelectorAll('*').length") < 3 * len(rows) + 1000
        )  # not one element per cell
        i = len(rows) - 1
        tip = heatmap_cell(pg, frame, "bwd", i, GPT_STEPS - 1)
        assert tip.startswith(f"{doc['labels'][i]} · bwd · step {GPT_STEPS - 1} · log2 std ")
        assert float(tip.rsplit(" ", 1)[1]) == pytest.approx(math.log2(std[-1, i, 1]), abs=0.006)
        assert not errors


def test_worst_nodes_one_row_per_tensor(big: Tuple[str, Logged]) -> None:
    url, (doc, std, _) = big
    aliases = doc["aliases"]
    with browser_page(f"{url}/#scales") as (pg, errors):
        frame = _plugin_frame(pg)
        frame.wait_for_selector("svg.profile g.node", timeout=60_000)
        frame.click("button[data-view=worst]")
        frame.wait_for_selector("tr.worst-row", timeout=30_000)
        shown = frame.eval_on_selector_all(
            "tr.worst-row",
            "rs => rs.map(r => [r.dataset.label, r.dataset.dir, r.querySelector('.aliases')?.textContent ?? ''])",
        )
        assert len({(l, d) for l, d, _ in shown}) == len(shown) and not [l for l, _, _ in shown if l in aliases]
        for label, _, listed in shown:
            same = [a for a in doc["labels"] if aliases.get(a) == label]
            assert listed == (f"= {', '.join(same)}" if same else "")
        assert "'underflow_fp16', 'below_normal_fp16', 'overflow_fp16'" in frame.inner_text(
            "p.hint"
        )  # not logged by default
        assert not errors


def test_custom_scalars_draws_its_first_chart_within_15_s(big: Tuple[str, Logged]) -> None:
    url = big[0]
    with browser_page(f"{url}/#custom_scalars") as (pg, errors):
        t0 = time.perf_counter()
        pg.wait_for_selector("tf-custom-scalar-multi-line-chart-card path.line", timeout=60_000, state="attached")
        seconds = time.perf_counter() - t0
        titles: List[str] = pg.eval_on_selector_all(
            "tf-custom-scalar-multi-line-chart-card", "cs => cs.map(c => c.title)"
        )
    assert titles == ["model.tok · forward", "model.tok · backward"]  # the first block's; the others wait, closed
    assert seconds < 15, f"the first chart took {seconds:.1f} s"
