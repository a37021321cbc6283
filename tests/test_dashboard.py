"""The `scales` dashboard's server side and what the writer stores for it, against the
event files of a real Trainer run read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from _dashboard_logs import STEPS, logged, logged_labels, write_logs
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar import layout_pb2
from werkzeug.test import Client

from lightning_scale.capture import capture
from lightning_scale.dashboard import headroom, metadata
from lightning_scale.dashboard.layout import module_group
from lightning_scale.dashboard.plugin import ScalesPlugin

FP16_MIN, FP16_MAX = 2.0**-14, 65504.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Any, Dict[str, Dict[int, float]]]:
    log_dir = write_logs(tmp_path_factory.mktemp("logs"))
    acc, scalars = logged(log_dir)
    return log_dir, acc, scalars


@pytest.fixture(scope="module")
def plugin(run: Tuple[Path, Any, Any]) -> ScalesPlugin:
    root = run[0].parent.parent
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    return ScalesPlugin(base_plugin.TBContext(data_provider=data_provider.MultiplexerDataProvider(mux, str(root)), logdir=str(root)))


def get(plugin: ScalesPlugin, route: str, status: int = 200, **params: Any) -> Any:
    response = Client(plugin.get_plugin_apps()[route]).get(route, query_string=params)
    assert response.status_code == status, response.get_data(as_text=True)
    return json.loads(response.get_data(as_text=True))


def run_name(run: Tuple[Path, Any, Any]) -> str:
    return str(run[0].relative_to(run[0].parent.parent))


# ---- what the writer stores ------------------------------------------------------------------


def test_node_list_is_in_execution_order(run: Tuple[Path, Any, Any]) -> None:
    _, acc, scalars = run
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    from _dashboard_logs import Blocks

    executed = [label for label in capture(Blocks(), "auto").tags if label in set(logged_labels(scalars))]
    assert doc["labels"] == executed
    # the callback tells the writer which labels are parameters and buffers
    named = {n for n, _ in Blocks().named_parameters()} | {n for n, _ in Blocks().named_buffers()}
    assert doc["parameters"] == [l for l in executed if l in named] and doc["parameters"]
    assert len(acc.Tensors(metadata.TAG)) == 1  # the node list did not change: written once


def test_log2_and_summary_scalars_match_the_logged_stds(run: Tuple[Path, Any, Any]) -> None:
    _, _, scalars = run
    labels = logged_labels(scalars)
    for step in range(STEPS):
        for d in ("fwd", "bwd"):
            stds = {l: scalars[f"scale/{d}/{l}"][step] for l in labels if f"scale/{d}/{l}" in scalars}
            for label, std in stds.items():
                assert scalars[f"scale_log2/{d}/{label}"][step] == pytest.approx(math.log2(std), abs=1e-5)  # both stored as float32
            below = sum(1 for s in stds.values() if s < FP16_MIN)
            above = sum(1 for l in stds if scalars[f"absmax/{d}/{l}"][step] > FP16_MAX)
            assert scalars[f"scale_summary/{d}/below_normal_fp16"][step] == below
            assert scalars[f"scale_summary/{d}/above_max_fp16"][step] == above
    assert any(scalars["scale_summary/bwd/below_normal_fp16"][s] > 0 for s in range(STEPS))  # the test sees some


def test_custom_scalar_regexes_match_exactly_one_written_tag(run: Tuple[Path, Any, Any]) -> None:
    _, acc, scalars = run
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    charted = []
    for category in layout.category:
        assert len(category.chart) <= 24
        for chart in category.chart:
            for regex in chart.multiline.tag:
                matches = [t for t in scalars if re.match(regex, t)]
                assert len(matches) == 1, (regex, matches)
                charted.append(matches[0])
    written = [t for t in scalars if t.startswith(("scale_log2/", "val_scale_log2/"))]
    assert sorted(charted) == sorted(written)
    titles = [c.title for c in layout.category]
    assert any(t.startswith("val_") for t in titles) and any(not t.startswith("val_") for t in titles)


def test_worst_table_text_lists_the_least_headroom_first(run: Tuple[Path, Any, Any]) -> None:
    _, acc, scalars = run
    text = acc.Tensors("scale_worst/text_summary")[-1]
    rows = [line.split("|") for line in text.tensor_proto.string_val[0].decode().splitlines() if line.startswith("| 1 ")]
    label, d = rows[0][2].strip().strip("`"), rows[0][3].strip()
    step = text.step
    rooms = {(l, dd): headroom.headroom(scalars[f"scale/{dd}/{l}"][step], scalars[f"absmax/{dd}/{l}"][step], "fp16")["headroom"] for l in logged_labels(scalars) for dd in ("fwd", "bwd") if f"scale/{dd}/{l}" in scalars}
    assert rooms[(label, d)] == pytest.approx(min(rooms.values()), abs=1e-9)


def test_headroom_closed_forms() -> None:
    room = headroom.headroom(2.0**-16, 2.0**-10, "fp16")
    assert room["under"] == pytest.approx(-2.0) and room["over"] == pytest.approx(math.log2(65504.0) + 10)
    assert room["headroom"] == pytest.approx(-2.0)
    assert headroom.headroom(1.0, None, "e4m3") == pytest.approx({"under": 6.0, "over": math.log2(448.0), "headroom": 6.0})  # std stands in for absmax
    with pytest.raises(ValueError, match="`fmt` must be one of"):
        headroom.headroom(1.0, 1.0, "fp8")


def test_writer_rejects_a_bad_top_k() -> None:
    from lightning_scale.report.tensorboard import ScaleWriter

    with pytest.raises(ValueError, match="`top_k` must be a positive integer, got 0"):
        ScaleWriter([], ["std"], top_k=0)


def test_module_groups() -> None:
    assert [module_group(l) for l in ["x", "model.blocks.3.attn/view", "head.weight", "head/linear"]] == ["(top)", "model.blocks.3", "head", "head"]
    # a module's output is its own module: grouped with the ops inside it, not with its parent
    assert module_group("model.blocks.0", False) == "model.blocks.0" and module_group("model.tok", False) == "model.tok"
    assert module_group("model.blocks.0.attn", False) == "model.blocks.0"
    # the same labels as parameters or buffers belong to the module that holds them
    assert module_group("model.tok.weight", True) == "model.tok" and module_group("model.tok", True) == "model"


# ---- the routes ---------------------------------------------------------------------------------


def test_runs_route_lists_training_and_validation(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    assert get(plugin, "/runs") == {run_name(run): ["", "val_"]}
    assert plugin.is_active()


def test_profile_route_returns_the_logged_values_in_execution_order(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, acc, scalars = run
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    body = get(plugin, "/profile", run=run_name(run), step=2)
    assert body["step"] == 2 and body["steps"] == list(range(STEPS))
    assert [n["label"] for n in body["nodes"]] == doc["labels"]
    for node in body["nodes"]:
        for d in ("fwd", "bwd"):
            for stat, tag in (("std", "scale"), ("absmax", "absmax"), ("below_normal_fp16", "below_normal_fp16")):
                want = scalars.get(f"{tag}/{d}/{node['label']}", {}).get(2)
                assert node[d].get(stat) == (pytest.approx(want) if want is not None else None)
    assert body["ratios"] == {"blocks.0.0.weight": pytest.approx(scalars["update_ratio/blocks.0.0.weight"][2])}
    assert get(plugin, "/profile", run=run_name(run), step=99)["step"] == STEPS - 1  # nearest tracked step before
    assert "must be an integer" in get(plugin, "/profile", 400, run=run_name(run), step="x")["error"]


def test_heatmap_and_series(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, _, scalars = run
    body = get(plugin, "/heatmap", run=run_name(run))
    assert len(body["fwd"]) == len(body["labels"]) and all(len(r) == STEPS for r in body["fwd"] + body["bwd"])
    i = 3
    label = body["labels"][i]
    for j, step in enumerate(body["steps"]):
        assert body["fwd"][i][j] == pytest.approx(math.log2(scalars[f"scale/fwd/{label}"][step]))
    series = get(plugin, "/series", run=run_name(run), label=label)
    assert series["series"]["std/fwd"] == pytest.approx([scalars[f"scale/fwd/{label}"][s] for s in range(STEPS)])


def _independent_ranking(order: List[str], scalars: Dict[str, Dict[int, float]], step: int, pattern: str) -> List[Tuple[str, str]]:
    rows = []
    for label in order:  # ties keep execution order
        for d in ("fwd", "bwd"):
            if f"scale/{d}/{label}" in scalars and re.search(pattern, label):
                std, absmax = scalars[f"scale/{d}/{label}"][step], scalars[f"absmax/{d}/{label}"][step]
                rows.append((min(math.log2(std / FP16_MIN), math.log2(FP16_MAX / absmax)), label, d))
    return [(l, d) for _, l, d in sorted(rows, key=lambda r: r[0])]  # stable: ties in execution order


def test_worst_route_ranks_by_headroom_and_drift(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, acc, scalars = run
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    body = get(plugin, "/worst", run=run_name(run), step=3, by="fp16", regex=r"blocks\.1")
    assert [(r["label"], r["dir"]) for r in body["rows"]] == _independent_ranking(order, scalars, 3, r"blocks\.1")
    drift = get(plugin, "/worst", run=run_name(run), step=3, by="drift")["rows"]
    want = [abs(math.log2(scalars[f"scale/{r['dir']}/{r['label']}"][3] / scalars[f"scale/{r['dir']}/{r['label']}"][0])) for r in drift]
    assert [r["abs_drift"] for r in drift] == pytest.approx(want) and want == sorted(want, reverse=True)
    assert "`regex` is not a valid" in get(plugin, "/worst", 400, run=run_name(run), regex="(")["error"]
    assert "`by` must be one of" in get(plugin, "/worst", 400, run=run_name(run), by="fp7")["error"]


def test_validation_and_code_routes(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, _, scalars = run
    val = get(plugin, "/profile", run=run_name(run), prefix="val_")
    assert val["steps"] == sorted({s for t, v in scalars.items() if t.startswith("val_scale/") for s in v})
    assert {n["label"] for n in val["nodes"]} == set(logged_labels(scalars, "val_"))
    assert all(not n["bwd"] for n in val["nodes"])  # validation: forward only
    code = get(plugin, "/code", run=run_name(run), step=1)
    assert code["step"] == 1 and any("def forward" in line["text"] for line in code["lines"])
    for line in code["lines"]:
        grads = [float(v) for v in re.findall(r"<- ([0-9.e+-]+)\)", line["text"])]
        assert (line["flag"] == "!<") == any(0 < g < FP16_MIN for g in grads), line  # forward stds here are ~1
    assert any(line["flag"] for line in code["lines"])
