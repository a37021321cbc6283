"""The `scales` dashboard shows the low-precision statistics: the heatmap's statistic picker, every
statistic in the profile, and the worst-nodes ranking by FP8 SNR and by the block what-ifs,
kurtosis and channel outliers, against the event file of a real Trainer run with the ``fp8``,
``blocks``, ``kurtosis`` and ``channels`` groups read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from _dashboard_logs import Blocks, logged
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from torch.utils.data import DataLoader, TensorDataset
from werkzeug.test import Client

from lightning_scale import ScaleMonitor
from lightning_scale.dashboard import metadata, tables
from lightning_scale.capture import capture
from lightning_scale.dashboard.data import of_series
from lightning_scale.dashboard.plugin import ScalesPlugin

STEPS = 3
FP8_STATS = [f"fp8_{f}_{k}" for f in ("e4m3", "e5m2") for k in ("snr_db", "flushed")]
#: Statistics the worst nodes rank by (``tables.STAT_RANKINGS``): True, the largest first.
RANKED = {"mxfp4_snr_db": False, "nvfp4_flushed": True, "kurtosis": True, "channel_max_ratio": True}
OUTLIER_STATS = [*RANKED, "outlier_channels"]
Scalars = Dict[str, Dict[int, float]]


def write_fp8_logs(root: Path) -> Path:
    """``Blocks`` for ``STEPS`` steps, every step tracked with std, absmax, the FP8 what-if and
    ``OUTLIER_STATS`` (block what-ifs, kurtosis, channel outliers)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(48, 8), torch.randn(48, 2))
    monitor = ScaleMonitor(
        every_n_steps=1,
        statistics=["std", "absmax", *FP8_STATS, *OUTLIER_STATS],
        figure=False,
        histograms=False,
        code=False,
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="fp8"),
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=16))
    return Path(trainer.logger.log_dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, List[str], Scalars, ScalesPlugin]:
    log_dir = write_fp8_logs(tmp_path_factory.mktemp("logs"))
    acc, scalars = logged(log_dir)
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    root = log_dir.parent.parent
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    plugin = ScalesPlugin(
        base_plugin.TBContext(data_provider=data_provider.MultiplexerDataProvider(mux, str(root)), logdir=str(root))
    )
    return str(log_dir.relative_to(root)), order, scalars, plugin


def get(plugin: ScalesPlugin, route: str, status: int = 200, **params: Any) -> Any:
    response = Client(plugin.get_plugin_apps()[route]).get(route, query_string=params)
    assert response.status_code == status, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))


def shown(v: float) -> Any:
    """What the JSON carries for a logged value: non-finite values (SNR +inf: exact) as null."""
    return v if math.isfinite(v) else None


def test_heatmap_draws_any_logged_statistic(run: Tuple[str, List[str], Scalars, ScalesPlugin]) -> None:
    name, _, scalars, plugin = run
    for stat in FP8_STATS:
        body = get(plugin, "/heatmap", run=name, stat=stat)
        assert body["stat"] == stat and body["log2"] is False and set(FP8_STATS) <= set(body["stats"])
        for d in ("fwd", "bwd"):
            for i, label in enumerate(body["labels"]):
                want = [
                    shown(scalars[f"{stat}/{d}/{label}"][s]) if f"{stat}/{d}/{label}" in scalars else None
                    for s in body["steps"]
                ]
                assert body[d][i] == pytest.approx(want), (stat, d, label)
    assert sum(v is not None for row in body["fwd"] for v in row) > 10  # not all missing
    absmax = get(plugin, "/heatmap", run=name, stat="absmax")
    label = absmax["labels"][2]
    assert absmax["log2"] is True and absmax["fwd"][2][0] == pytest.approx(
        math.log2(scalars[f"absmax/fwd/{label}"][0]), abs=1e-4
    )  # log2: 4 decimals
    error = get(plugin, "/heatmap", 400, run=name, stat="fp8_e4m3_snr")["error"]
    assert "`stat` must be one of the logged statistics" in error and "fp8_e4m3_snr_db" in error


def test_profile_rows_carry_the_fp8_statistics(run: Tuple[str, List[str], Scalars, ScalesPlugin]) -> None:
    name, order, scalars, plugin = run
    body = get(plugin, "/profile", run=name, step=1)
    assert set(FP8_STATS) <= set(body["stats"]) and [n["label"] for n in body["nodes"]] == order
    checked = 0
    for node in body["nodes"]:
        for d in ("fwd", "bwd"):
            for stat in FP8_STATS:
                tag = f"{stat}/{d}/{node['label']}"
                if tag in scalars and math.isfinite(scalars[tag][1]):
                    assert node[d][stat] == pytest.approx(scalars[tag][1]), tag
                    checked += 1
    assert checked > 4 * len(order)


def test_worst_ranks_by_fp8_snr_forward_e4m3_backward_e5m2(run: Tuple[str, List[str], Scalars, ScalesPlugin]) -> None:
    name, order, scalars, plugin = run
    body = get(plugin, "/worst", run=name, step=2, by="fp8")
    recipe = (("fwd", "e4m3"), ("bwd", "e5m2"))
    aliases = capture(Blocks(), "auto").aliases  # one row per tensor: an alias is listed in its source's row
    rows = [
        (scalars[f"fp8_{fmt}_snr_db/{d}/{label}"][2], label, d)
        for label in order
        for d, fmt in recipe
        if f"scale/{d}/{label}" in scalars and aliases.get(label) not in order
    ]
    want = [(label, d) for _, label, d in sorted(rows, key=lambda r: r[0])]  # stable: ties in execution order
    assert [(r["label"], r["dir"]) for r in body["rows"]] == want
    for r in body["rows"]:
        fmt = {"fwd": "e4m3", "bwd": "e5m2"}[r["dir"]]
        assert r["fp8_format"] == fmt
        assert r["fp8_snr_db"] == pytest.approx(shown(scalars[f"fp8_{fmt}_snr_db/{r['dir']}/{r['label']}"][2]))
        assert r["fp8_flushed"] == pytest.approx(scalars[f"fp8_{fmt}_flushed/{r['dir']}/{r['label']}"][2])


def test_fp8_ranking_of_a_run_without_the_what_if_says_how_to_log_it() -> None:
    data = of_series(["a"], set(), {"std": {"fwd": {"a": {0: 1.0}}}})
    with pytest.raises(ValueError, match=r"`by=fp8` needs the FP8 what-if logged: ScaleMonitor\(statistics="):
        tables.worst(data, 0, "fp8")
    with pytest.raises(ValueError, match=r"`stat` must be one of the logged statistics \['std'\], got 'absmax'"):
        tables.heatmap(data, "absmax")


@pytest.mark.parametrize("stat", list(RANKED))
def test_worst_ranks_by_block_kurtosis_and_channel_statistics(
    stat: str, run: Tuple[str, List[str], Scalars, ScalesPlugin]
) -> None:
    name, order, scalars, plugin = run
    body = get(plugin, "/worst", run=name, step=2, by=stat)
    assert body["stat"] == stat and set(OUTLIER_STATS) - {"outlier_channels"} <= set(body["rankable"])
    aliases = capture(Blocks(), "auto").aliases
    rows = [
        (scalars.get(f"{stat}/{d}/{label}", {}).get(2, math.nan), label, d)
        for label in order
        for d in ("fwd", "bwd")
        if f"scale/{d}/{label}" in scalars and aliases.get(label) not in order
    ]
    key = (lambda r: -r[0]) if RANKED[stat] else (lambda r: r[0])
    known = sorted((r for r in rows if not math.isnan(r[0])), key=key)  # stable: ties in execution order
    want = [(label, d) for _, label, d in known + [r for r in rows if math.isnan(r[0])]]  # NaN last
    assert [(r["label"], r["dir"]) for r in body["rows"]] == want
    for r in body["rows"]:
        assert r["value"] == pytest.approx(shown(scalars.get(f"{stat}/{r['dir']}/{r['label']}", {}).get(2, math.nan)))
    assert sum(r["value"] is not None for r in body["rows"]) > 10


def test_a_ranking_statistic_the_run_did_not_log_says_how_to_log_it() -> None:
    data = of_series(["a"], set(), {"std": {"fwd": {"a": {0: 1.0}}}})
    with pytest.raises(ValueError, match=r"got 'kurtosis' \(log it: ScaleMonitor\(statistics=\[..., 'kurtosis'\]\)\)"):
        tables.worst(data, 0, "kurtosis")
    assert tables.worst(data, 0, "fp16")["rankable"] == []
