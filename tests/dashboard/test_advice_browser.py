"""The Advice view of the `scales` dashboard: its route's JSON against ``lightning-scale advise``'s
decisions on the same logs, and, in a real browser (headless Chromium against a real
`tensorboard` serving a real Trainer run with ``advise=True``), the table it shows read back and
compared with them, for the default recipe, another recipe and other thresholds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.context import RequestContext
from tensorboard.plugins import base_plugin
from test_dashboard_browser import (
    CHROMIUM,
    ROOT,
    _entry_point_path,
    _free_port,
    _plugin_frame,
    _wait_for_plugin,
    sync_api,
)
from torch.utils.data import DataLoader, TensorDataset
from werkzeug.test import Client

from lightning_scale import ScaleMonitor
from lightning_scale.dashboard import advice, advice_log
from lightning_scale.dashboard.plugin import ScalesPlugin
from lightning_scale.tools.models import synthetic_tokens
from lightning_scale.tools.outlier_model import OutlierLM

OUTLIER = "model.blocks.2.fc2"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    torch.manual_seed(0)
    x, y = synthetic_tokens(64, 32, 64)
    trainer = pl.Trainer(
        max_steps=3,
        logger=pl.loggers.TensorBoardLogger(str(root), name="advised"),
        callbacks=[ScaleMonitor(every_n_steps=2, advise=True)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(OutlierLM(), DataLoader(TensorDataset(x, y), batch_size=16))
    return root


def provider(root: Path) -> Any:
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    return data_provider.MultiplexerDataProvider(mux, str(root))


def expected(root: Path, recipe: str, **limits: float) -> Dict[str, Any]:
    run = advice_log.read(provider(root), RequestContext(), "", "advised/version_0")
    assert run is not None
    return advice.advise(run, recipe, advice.Thresholds(**limits))


def route(root: Path, status: int = 200, **params: Any) -> Any:
    plugin = ScalesPlugin(base_plugin.TBContext(data_provider=provider(root), logdir=str(root)))
    response = Client(plugin.get_plugin_apps()["/advice"]).get("/advice", query_string=params)
    assert response.status_code == status, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))


def test_the_route_sends_the_commands_decisions_and_says_what_is_missing(logs: Path, tmp_path: Path) -> None:
    got = route(logs, run="advised/version_0", recipe="fp8-rowwise", snr_db="12")
    want = json.loads(json.dumps(expected(logs, "fp8-rowwise", snr_db=12.0)))
    assert got == {"available": True, "recipes": ["fp8-tensorwise", "fp8-rowwise", "mxfp8"], **want} | {
        "gemms": ["forward", "input_grad", "weight_grad"],
        "defaults": {"snr_db": 15.0, "flushed": 0.1},
    }
    assert route(logs, 400, run="advised/version_0", recipe="fp4") == {
        "error": "`recipe` must be one of ['fp8-tensorwise', 'fp8-rowwise', 'mxfp8'], got 'fp4'"
    }
    assert route(logs, 400, run="advised/version_0", flushed="x") == {"error": "`flushed` must be a number, got 'x'"}
    assert route(logs, run="nothing")["available"] is False


@pytest.fixture(scope="module")
def frame(logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tuple[Any, List[str]]]:
    port = _free_port()
    path = [str(ROOT), _entry_point_path(tmp_path_factory.mktemp("ep")), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logs), "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--load_fast=false"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
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
            found = _plugin_frame(pg)
            found.wait_for_selector("svg.profile g.node", timeout=30_000)
            found.click("button[data-view=advice]")
            found.wait_for_selector("tr.advice-row")
            yield found, errors
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def shown(frame: Any) -> Dict[str, Dict[str, Any]]:
    rows = frame.eval_on_selector_all(
        "tr.advice-row",
        "rs => rs.map(r => [r.dataset.layer, r.dataset.format,"
        " [...r.querySelectorAll('td.snr')].map(c => c.dataset.snr), r.querySelector('td.reason').textContent])",
    )
    return {name: {"format": fmt, "snr": snr, "reason": reason} for name, fmt, snr, reason in rows}


def check(table: Dict[str, Dict[str, Any]], want: Dict[str, Any]) -> None:
    assert list(table) == list(want["layers"])
    for name, row in table.items():
        layer = want["layers"][name]
        assert row["format"] == layer["format"] and row["reason"] == layer["reason"]
        for drawn, gemm in zip(row["snr"], ("forward", "input_grad", "weight_grad")):
            assert float(drawn) == pytest.approx(layer["gemms"][gemm]["snr_db"], abs=1e-9), (name, gemm)


def test_the_view_shows_each_layers_decision_figures_and_reason(frame: Tuple[Any, List[str]], logs: Path) -> None:
    page, errors = frame
    want = expected(logs, "fp8-tensorwise")
    table = shown(page)
    check(table, want)
    assert table[OUTLIER]["format"] == "keep" and sum(r["format"] == "keep" for r in table.values()) == 1
    summary = page.inner_text(".advice-summary")
    assert (
        summary.startswith("8 of 9 linear layers in fp8-tensorwise") and "--recipe fp8-tensorwise --out DIR" in summary
    )
    assert page.eval_on_selector_all("td.snr.low", "cs => cs.map(c => c.closest('tr').dataset.layer)") == [OUTLIER]
    assert not errors


def test_choosing_a_recipe_and_thresholds_redraws_with_the_servers_decisions(
    frame: Tuple[Any, List[str]], logs: Path
) -> None:
    page, errors = frame
    page.select_option("#advice-recipe", "fp8-rowwise")
    page.wait_for_function("document.querySelector('.advice-summary').textContent.includes('in fp8-rowwise')")
    check(shown(page), expected(logs, "fp8-rowwise"))
    page.fill("#advice-snr", "5")
    page.dispatch_event("#advice-snr", "change")
    page.wait_for_selector("#advice-flushed")
    page.wait_for_function("document.querySelector('.advice-summary').textContent.includes('--snr-db 5')")
    page.fill("#advice-flushed", "1")
    page.dispatch_event("#advice-flushed", "change")
    page.wait_for_function("document.querySelector('.advice-summary').textContent.startsWith('9 of 9')")
    check(shown(page), expected(logs, "fp8-rowwise", snr_db=5.0, flushed=1.0))
    assert not errors
