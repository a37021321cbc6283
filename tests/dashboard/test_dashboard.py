"""The `scales` dashboard's server side and what the writer stores for it, against the
event files of a real Trainer run read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from _dashboard_logs import STEPS, Blocks, logged, logged_labels, write_logs
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.plugins import base_plugin
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util
from werkzeug.test import Client

from lightning_scale.capture import capture
from lightning_scale.dashboard import headroom, metadata
from lightning_scale.dashboard.layout import PER_CHART, custom_scalar_layout, module_group
from lightning_scale.report.tables import WORST_COLUMNS
from lightning_scale.dashboard.plugin import ScalesPlugin

FP16_MIN, FP16_MAX = 2.0**-14, 65504.0
# smallest normal and largest finite value, written out independently of the package
EDGES = {
    "fp16": (2.0**-14, 65504.0),
    "bf16": (2.0**-126, 3.3895313892515355e38),
    "e4m3": (2.0**-6, 448.0),
    "e5m2": (2.0**-14, 57344.0),
}


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
    return ScalesPlugin(
        base_plugin.TBContext(data_provider=data_provider.MultiplexerDataProvider(mux, str(root)), logdir=str(root))
    )


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
                assert scalars[f"scale_log2/{d}/{label}"][step] == pytest.approx(
                    math.log2(std), abs=1e-5
                )  # both stored as float32
            below = sum(1 for s in stds.values() if s < FP16_MIN)
            above = sum(1 for l in stds if scalars[f"absmax/{d}/{l}"][step] > FP16_MAX)
            assert scalars[f"scale_summary/{d}/below_normal_fp16"][step] == below
            assert scalars[f"scale_summary/{d}/above_max_fp16"][step] == above
    assert any(scalars["scale_summary/bwd/below_normal_fp16"][s] > 0 for s in range(STEPS))  # the test sees some


def test_custom_scalars_one_category_per_block_forward_and_backward_apart(run: Tuple[Path, Any, Any]) -> None:
    _, acc, scalars = run
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    charted = []
    for category in layout.category:
        block = category.title.split(" · ", 1)[1]
        for chart in category.chart:
            direction = "fwd" if chart.title.endswith("forward") else "bwd"
            assert chart.title.startswith(block) and len(chart.multiline.tag) <= PER_CHART
            for regex in chart.multiline.tag:
                matches = [t for t in scalars if re.match(regex, t)]
                assert len(matches) == 1 and f"/{direction}/" in matches[0], (regex, matches)  # one direction a chart
                assert module_group(matches[0].split("/", 2)[2], matches[0].split("/", 2)[2] in PARAMS) == block
                charted.append(matches[0])
    written = [t for t in scalars if t.startswith(("scale_log2/", "val_scale_log2/"))]
    assert sorted(charted) == sorted(written)
    titles = [c.title for c in layout.category]
    assert any(t.startswith("val_") for t in titles) and any(not t.startswith("val_") for t in titles)
    # TensorBoard stamps the charts of open categories only: the first is open, the rest closed
    assert [c.closed for c in layout.category] == [False] + [True] * (len(layout.category) - 1)


def test_custom_scalar_layout_has_a_hard_limit_on_charts() -> None:
    labels = [f"blocks.{b}.fc/op_{k}" for b in range(3) for k in range(5)]
    written = {"fwd": labels, "bwd": labels[:7]}
    layout = custom_scalar_layout("", labels, written, per_chart=2, max_charts=100)
    assert [t for t, _ in layout] == [f"scale_log2 · blocks.{b}" for b in range(3)]
    first = layout[0][1]  # block 0: 5 forward nodes in 3 charts of at most 2, 5 backward ones likewise
    assert [c for c, _ in first] == [f"blocks.0 · forward ({k}/3)" for k in (1, 2, 3)] + [
        f"blocks.0 · backward ({k}/3)" for k in (1, 2, 3)
    ]
    assert [len(tags) for _, tags in first] == [2, 2, 1, 2, 2, 1]
    assert [c for c, _ in layout[1][1]] == [
        "blocks.1 · forward (1/3)",
        "blocks.1 · forward (2/3)",
        "blocks.1 · forward (3/3)",
        "blocks.1 · backward",
    ]
    charts = sum(len(c) for _, c in layout)
    assert custom_scalar_layout("", labels, written, per_chart=2, max_charts=charts) == layout
    assert custom_scalar_layout("", labels, written, per_chart=2, max_charts=charts - 1) == []


def test_records_hold_every_node_whatever_max_tags(tmp_path: Path) -> None:
    from lightning_scale.record import stats
    from lightning_scale.report.event_file import EventFile
    from lightning_scale.report.tensorboard import ScaleWriter
    from lightning_scale.report.values import StepValues

    labels = [f"blocks.{i // 4}.fc/op_{i % 4}" for i in range(30)]
    file = EventFile(str(tmp_path), warn=pytest.fail)
    writer = ScaleWriter([file], statistics=["std", "absmax"], histograms=False, figure=False, max_tags=10)
    written = {}
    for step in range(12):
        records = torch.zeros(30, 2, len(stats.FIELDS), dtype=torch.float64)
        records[..., stats.FIELDS.index("count")] = 8.0
        records[..., stats.FIELDS.index("m2")] = torch.rand(30, 2, dtype=torch.float64) * 7
        records[..., stats.FIELDS.index("absmax")] = torch.rand(30, 2, dtype=torch.float64) * 3
        records[5, 1, 0] = 0.0  # node 5 has no gradient
        writer.write(step, labels, StepValues(records), aliases={labels[1]: labels[0]})
        writer.flush()
        written[step] = records
    file.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert {t.split("/", 2)[2] for t in acc.Tags()["scalars"] if t.startswith("scale/")} == set(labels[:10])  # the cap
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    assert (
        doc["labels"] == labels and doc["statistics"] == ["std", "absmax"] and doc["aliases"] == {labels[1]: labels[0]}
    )
    chunks = sorted(t for t in acc.Tags()["tensors"] if t.startswith(metadata.RECORDS))
    assert chunks == [metadata.chunk_tag("", 0), metadata.chunk_tag("", 10)]  # at most CHUNK steps a tag
    assert [len(acc.Tensors(t)) for t in chunks] == [metadata.CHUNK, 2]
    for event in acc.Tensors(chunks[0]) + acc.Tensors(chunks[1]):
        got = tensor_util.make_ndarray(event.tensor_proto)
        want = torch.stack(
            [stats.statistic(written[event.step], "std"), stats.statistic(written[event.step], "absmax")], -1
        )
        assert got.shape == (30, 2, 2)
        assert np.isnan(got[5, 1]).all() and not np.isnan(np.delete(got.reshape(60, 2), 11, 0)).any()
        ok = ~np.isnan(got)
        assert got[ok] == pytest.approx(want.numpy().astype(np.float32)[ok])


def test_lightnings_scalars_and_ours_are_read_from_one_run_dir(run: Tuple[Path, Any, Any]) -> None:
    """ScaleMonitor writes its own event file beside the logger's; TensorBoard reads both as one run."""
    from lightning_scale.report.event_file import SUFFIX

    log_dir, acc, scalars = run
    files = sorted(p.name for p in log_dir.glob("events.out.tfevents.*"))
    assert len(files) == 2 and sum(name.endswith(SUFFIX) for name in files) == 1
    assert set(scalars["val_loss"]) == {1, 3}  # logged by Lightning (validation every 2 batches)
    assert sorted(scalars["update_ratio/blocks.0.0.weight"]) == [0, 1, 2, 3]  # through the logger's SummaryWriter
    assert sorted(scalars["scale/fwd/head/linear"]) == list(range(STEPS))  # ours
    assert metadata.TAG in acc.Tags()["tensors"]


def test_worst_table_text_lists_the_least_headroom_first(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, acc, scalars = run
    text = acc.Tensors("scale_worst/text_summary")[-1]
    lines = text.tensor_proto.string_val[0].decode().splitlines()
    head = [c.strip() for c in next(l for l in lines if l.startswith("| # ")).split("|")[1:-1]]
    assert head == ["#", "node", "dir", *WORST_COLUMNS]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if re.match(r"\| \d+ ", line)]
    label, d = re.findall(r"`([^`]+)`", rows[0][1])[0], rows[0][2]
    step = text.step
    rooms = {
        (l, dd): headroom.headroom(scalars[f"scale/{dd}/{l}"][step], scalars[f"absmax/{dd}/{l}"][step], "fp16")[
            "headroom"
        ]
        for l in logged_labels(scalars)
        for dd in ("fwd", "bwd")
        if f"scale/{dd}/{l}" in scalars
    }
    assert rooms[(label, d)] == pytest.approx(min(rooms.values()), abs=1e-9)
    # the same rows, names and signs as the Worst-nodes view (one row per tensor, aliases in it)
    view = get(plugin, "/worst", run=run_name(run), step=step)["rows"]
    for row, shown in zip(rows, view):
        assert re.findall(r"`([^`]+)`", row[1]) == [shown["label"], *shown["aliases"]] and row[2] == shown["dir"]
        numbers = [float(v) for v in row[3:]]
        assert numbers == pytest.approx(
            [shown[k] for k in ("log2_std", "log2_absmax", "under", "over", "headroom")], abs=0.006
        )


def test_headroom_closed_forms() -> None:
    room = headroom.headroom(2.0**-16, 2.0**-10, "fp16")
    assert room["under"] == pytest.approx(-2.0) and room["over"] == pytest.approx(math.log2(65504.0) + 10)
    assert room["headroom"] == pytest.approx(-2.0)
    assert headroom.headroom(1.0, None, "e4m3") == pytest.approx(
        {"under": 6.0, "over": math.log2(448.0), "headroom": 6.0}
    )  # std stands in for absmax
    with pytest.raises(ValueError, match="`fmt` must be one of"):
        headroom.headroom(1.0, 1.0, "fp8")


def test_writer_rejects_a_bad_top_k() -> None:
    from lightning_scale.report.tensorboard import ScaleWriter

    with pytest.raises(ValueError, match="`top_k` must be a positive integer, got 0"):
        ScaleWriter([], statistics=["std"], top_k=0)


def test_module_groups() -> None:
    assert [module_group(l) for l in ["x", "model.blocks.3.attn/view", "head.weight", "head/linear"]] == [
        "(top)",
        "model.blocks.3",
        "head",
        "head",
    ]
    # a module's output is its own module: grouped with the ops inside it, not with its parent
    assert module_group("model.blocks.0", False) == "model.blocks.0" and module_group("model.tok", False) == "model.tok"
    assert module_group("model.blocks.0.attn", False) == "model.blocks.0"
    # the same labels as parameters or buffers belong to the module that holds them
    assert module_group("model.tok.weight", True) == "model.tok" and module_group("model.tok", True) == "model"


# ---- the routes ---------------------------------------------------------------------------------


def test_runs_route_lists_training_and_validation(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    assert get(plugin, "/runs") == {run_name(run): ["", "val_"]}
    assert plugin.is_active()


def test_profile_route_returns_the_logged_values_in_execution_order(
    run: Tuple[Path, Any, Any], plugin: ScalesPlugin
) -> None:
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
            std, absmax = (
                scalars.get(f"scale/{d}/{node['label']}", {}).get(2),
                scalars.get(f"absmax/{d}/{node['label']}", {}).get(2),
            )
            want_out = [] if std is None else [f for f, (lo, hi) in EDGES.items() if std < lo or absmax > hi]
            assert node[f"{d}_out"] == want_out, node
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
        assert body["fwd"][i][j] == pytest.approx(
            math.log2(scalars[f"scale/fwd/{label}"][step]), abs=1e-4
        )  # rounded to 4 decimals
    assert body["groups"] == [module_group(l, l in body["params"]) for l in body["labels"]]
    series = get(plugin, "/series", run=run_name(run), label=label)
    assert series["series"]["std/fwd"] == pytest.approx([scalars[f"scale/fwd/{label}"][s] for s in range(STEPS)])


ALIASES = capture(Blocks(), "auto").aliases  # label -> label of the same tensor
PARAMS = {n for n, _ in Blocks().named_parameters()}


def _independent_ranking(
    order: List[str], scalars: Dict[str, Dict[int, float]], step: int, pattern: str
) -> List[Tuple[str, str]]:
    rows = []
    for label in order:  # ties keep execution order; one row per tensor
        if ALIASES.get(label) in order:
            continue
        names = [label, *[a for a, s in ALIASES.items() if s == label and a in order]]
        for d in ("fwd", "bwd"):
            if f"scale/{d}/{label}" in scalars and any(re.search(pattern, n) for n in names):
                std, absmax = scalars[f"scale/{d}/{label}"][step], scalars[f"absmax/{d}/{label}"][step]
                rows.append((min(math.log2(std / FP16_MIN), math.log2(FP16_MAX / absmax)), label, d))
    return [(l, d) for _, l, d in sorted(rows, key=lambda r: r[0])]  # stable: ties in execution order


def test_worst_route_ranks_by_headroom_and_drift(run: Tuple[Path, Any, Any], plugin: ScalesPlugin) -> None:
    _, acc, scalars = run
    order = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])["labels"]
    body = get(plugin, "/worst", run=run_name(run), step=3, by="fp16", regex=r"blocks\.1")
    assert [(r["label"], r["dir"]) for r in body["rows"]] == _independent_ranking(order, scalars, 3, r"blocks\.1")
    drift = get(plugin, "/worst", run=run_name(run), step=3, by="drift")["rows"]
    want = [
        abs(math.log2(scalars[f"scale/{r['dir']}/{r['label']}"][3] / scalars[f"scale/{r['dir']}/{r['label']}"][0]))
        for r in drift
    ]
    assert [r["abs_drift"] for r in drift] == pytest.approx(want) and want == sorted(want, reverse=True)
    assert "`regex` is not a valid" in get(plugin, "/worst", 400, run=run_name(run), regex="(")["error"]
    # since when: the first tracked step out of the FP16 range and how many of them, from the scalars
    for row in get(plugin, "/worst", run=run_name(run), step=3, by="fp16")["rows"]:
        tag = f"{row['dir']}/{row['label']}"
        out = [
            s
            for s in range(STEPS)
            if min(math.log2(scalars[f"scale/{tag}"][s] / FP16_MIN), math.log2(FP16_MAX / scalars[f"absmax/{tag}"][s]))
            < 0
        ]
        assert (
            row["first_out"] == (out[0] if out else None)
            and row["out_steps"] == len(out)
            and row["tracked_steps"] == STEPS
        )
    assert any(r["first_out"] is not None for r in get(plugin, "/worst", run=run_name(run), step=3)["rows"])
    # the run logged below_normal_fp16 only: that column; for bf16 none, and what to log instead
    assert get(plugin, "/worst", run=run_name(run), by="fp16")["fractions"] == ["below_normal"]
    bf16 = get(plugin, "/worst", run=run_name(run), by="bf16")
    assert bf16["fractions"] == [] and "'underflow_bf16', 'below_normal_bf16', 'overflow_bf16'" in bf16["fraction_hint"]
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


def test_logs_without_records_are_read_from_their_scalars(tmp_path: Path) -> None:
    """Logs written before the records existed: scalars only (and no node list)."""
    from torch.utils.tensorboard import SummaryWriter

    tb = SummaryWriter(str(tmp_path / "old"))
    for step in (0, 10):
        for label, std in (("blocks.0.fc/linear", 2.0**-16), ("blocks.0.fc.weight", 0.5)):
            tb.add_scalar(f"scale/fwd/{label}", std * (step + 1), step)
            tb.add_scalar(f"scale/bwd/{label}", std / 8, step)
            tb.add_scalar(f"absmax/fwd/{label}", std * 4, step)
    tb.close()
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    plugin = ScalesPlugin(
        base_plugin.TBContext(
            data_provider=data_provider.MultiplexerDataProvider(mux, str(tmp_path)), logdir=str(tmp_path)
        )
    )
    assert get(plugin, "/runs") == {"old": [""]}
    body = get(plugin, "/profile", run="old", step=10)
    nodes = {n["label"]: n for n in body["nodes"]}
    assert body["steps"] == [0, 10] and set(nodes) == {"blocks.0.fc/linear", "blocks.0.fc.weight"}
    assert (
        nodes["blocks.0.fc/linear"]["fwd"]["std"] == pytest.approx(11 * 2.0**-16)
        and nodes["blocks.0.fc.weight"]["param"]
    )
    assert (
        nodes["blocks.0.fc/linear"]["bwd_out"] == ["fp16", "e4m3", "e5m2"]
        and "absmax" not in nodes["blocks.0.fc/linear"]["bwd"]
    )
    worst = get(plugin, "/worst", run="old", step=10)["rows"]
    assert (
        (worst[0]["label"], worst[0]["dir"]) == ("blocks.0.fc/linear", "bwd")
        and worst[0]["first_out"] == 0
        and worst[0]["out_steps"] == 2
    )


def test_a_trainer_run_capped_by_max_tags_shows_every_node(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_scale import ScaleMonitor

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 2))
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(tmp_path), name="cap"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ScaleMonitor(every_n_steps=1, max_tags=4, figure=False)],
    )
    with pytest.warns(UserWarning, match=r"writing the first 4 .* as scalars; the SCALES dashboard shows all \d+"):
        trainer.fit(Blocks(), DataLoader(data, batch_size=16))
    acc, scalars = logged(Path(trainer.logger.log_dir))
    doc = metadata.decode(acc.Tensors(metadata.TAG)[-1].tensor_proto.string_val[0])
    assert len(logged_labels(scalars)) == 4 < len(doc["labels"])
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    plugin = ScalesPlugin(
        base_plugin.TBContext(
            data_provider=data_provider.MultiplexerDataProvider(mux, str(tmp_path)), logdir=str(tmp_path)
        )
    )
    nodes = get(plugin, "/profile", run="cap/version_0", step=1)["nodes"]
    assert [n["label"] for n in nodes] == doc["labels"] and all(
        n["fwd"].get("std") for n in nodes
    )  # every node has its value
    for node in nodes[:4]:  # where both exist, the records and the scalars agree
        assert node["fwd"]["std"] == pytest.approx(scalars[f"scale/fwd/{node['label']}"][1])
