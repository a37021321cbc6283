"""Labels a reader can find: items of tuple outputs named after their source and index
(``chunk[0]``) on the fx and dynamo routes, in the Code view, in TensorBoard's event files and
in the dashboard; module outputs tagged across graph breaks and inside FSDP units."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins import base_plugin
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from werkzeug.test import Client

from lightning_scale import ScaleMonitor
from lightning_scale.capture import Capture, capture
from lightning_scale.capture.interpreter import ScalePair
from lightning_scale.dashboard.plugin import ScalesPlugin
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording
from lightning_scale.report.code import annotate_code
from lightning_scale.tools.models import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings(
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
)


class Mixer(nn.Module):
    """Two ``chunk`` calls in one module, an ``unbind`` item, and a tensor slice (not an item)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a, b = self.proj(v).chunk(2, dim=-1)
        first = torch.unbind(q, dim=1)[0]  # (B, 8)
        return torch.cat([a * k[..., :4], b], -1) + first.unsqueeze(1)


class Mixers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Mixer(), Mixer()])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def tracked(cap: Capture, x: Tensor) -> Dict[str, Tensor]:
    """One tracked forward and backward: label -> its record (both directions)."""
    rec = Recorder()
    with recording(rec):
        cap.tracked()(x).square().sum().backward()
    records = rec.records(cap.tags, cap.aliases)
    return {t: records[i] for i, t in enumerate(cap.tags) if bool((records[i][:, 0] > 0).any())}


def std(t: Tensor) -> float:
    return float(t.detach().double().std())


@pytest.fixture(scope="module")
def mixers() -> Tuple[Mixers, Tensor, Dict[str, Dict[str, Tensor]]]:
    torch.manual_seed(0)
    model, x = Mixers(), torch.randn(4, 3, 8)
    got = {mode: tracked(capture(model, mode), x) for mode in ("fx", "dynamo")}
    torch._dynamo.reset()
    return model, x, got


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
def test_items_of_tuple_outputs_are_named_after_source_and_index(mixers: Any, mode: str) -> None:
    model, x, got = mixers
    records = got[mode]
    for path in ("blocks.0", "blocks.1"):
        for name in ("chunk[0]", "chunk[1]", "chunk[2]", "chunk_1[0]", "chunk_1[1]", "unbind[0]"):
            assert f"{path}/{name}" in records, (path, name, sorted(records))
        assert f"{path}/k[..., :4]" in records  # (a slice: named after its source and index, as written)
    assert not [t for t in records if "getitem" in t]
    # the records are those of the tensors the names say (q of blocks.0, the second chunk's b)
    q, k, v = model.blocks[0].qkv(x).chunk(3, dim=-1)
    b = model.blocks[0].proj(v).chunk(2, dim=-1)[1]
    for label, value in (("blocks.0/chunk[0]", q), ("blocks.0/chunk_1[1]", b), ("blocks.0/unbind[0]", q[:, 0])):
        assert float(stats.statistic(records[label], "std")[FORWARD]) == pytest.approx(std(value), rel=1e-6)
        assert float(records[label][BACKWARD, 0]) == value.numel()  # its gradient is recorded too


def test_fx_and_dynamo_record_the_same_labels(mixers: Any) -> None:
    _, _, got = mixers
    assert sorted(got["fx"]) == sorted(got["dynamo"])


def test_the_code_view_shows_the_label_on_the_line_of_the_item() -> None:
    torch.manual_seed(0)
    cap = capture(Mixers(), "fx")
    (gm,), (labels,) = cap.graphs, cap.labels
    scales = {name: ScalePair(1.0, 1.0) for name in labels}
    lines = annotate_code(gm.code, scales, labels=labels).splitlines()
    shown = [line for line in lines if "blocks.0/chunk[1] " in line]
    assert len(shown) == 1 and re.search(r"\bgetitem_\d+ = chunk\[1\]$", shown[0]), shown
    second = [line for line in lines if "blocks.0/chunk_1[0] " in line]
    assert len(second) == 1 and re.search(r"= chunk_1\[0\]$", second[0]), second


class Sliced(nn.Module):
    """Slices of a parameter, of an input, of a module's output, twice at one place, and in a loop."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, 8))
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        h = x + self.pos[:T]
        qkv = self.qkv(h)
        q, k = qkv[..., :8], qkv[..., 8:16]
        out = (q * k).sum() + h[:, -1].sum() + x[0].sum()
        for i in range(2):
            out = out + h[i].square().sum()
        return out


SLICES = ["pos[:T]", "qkv[..., :8]", "qkv[..., 8:16]", "h[:, -1]", "x[0]", "h[i]", "h[i]_1"]


def _sliced_records(mode: str, model: nn.Module, sizes: Tuple[int, ...]) -> Tuple[Capture, List[Dict[str, Tensor]]]:
    cap = capture(model, mode)
    steps = []
    for t in sizes:
        rec = Recorder()
        with recording(rec):
            cap.tracked()(torch.randn(2, t, 8)).backward()
        records = rec.records(cap.tags, cap.aliases)
        steps.append({label: records[i] for i, label in enumerate(cap.tags)})
    return cap, steps


@pytest.mark.parametrize("mode", ["fx", "dynamo", "compiled"])
def test_slices_are_named_after_source_and_index_stable_across_steps(mode: str) -> None:
    """``pos[:T]`` (as written, on every route), two slices of ``qkv`` at one place apart, a
    slice in a loop ``h[i]`` then ``h[i]_1``; no ``getitem`` label; a new sequence length (a
    dynamo recompile) keeps every name, and each records the slice it names."""
    torch.manual_seed(0)
    model: nn.Module = Sliced()
    if mode == "compiled":
        model = nn.Sequential(torch.compile(model, backend="aot_eager"))
    # (the compiled route records no tensor of a dynamic shape after a recompile: limitations.md)
    sizes = (5, 5) if mode == "compiled" else (5, 7)
    cap, steps = _sliced_records("dynamo" if mode == "compiled" else mode, model, sizes)
    prefix = "0/" if mode == "compiled" else ""
    assert {prefix + s for s in SLICES} <= set(cap.tags), sorted(cap.tags)
    assert not [t for t in cap.tags if "getitem" in t]
    for t, records in zip(sizes, steps):
        assert int(records[prefix + "pos[:T]"][FORWARD, 0]) == t * 8  # (this step's T)
        assert int(records[prefix + "qkv[..., 8:16]"][FORWARD, 0]) == 2 * t * 8
    torch._dynamo.reset()


def test_the_code_view_shows_a_slice_by_its_name() -> None:
    torch.manual_seed(0)
    cap = capture(Sliced(), "fx")
    (gm,), (labels,) = cap.graphs, cap.labels
    lines = annotate_code(gm.code, {name: ScalePair(1.0, 1.0) for name in labels}, labels=labels).splitlines()
    shown = [line for line in lines if "pos[:T] " in line]
    assert len(shown) == 1 and re.search(r"= pos\[slice\(None, getitem_1, None\)\]$", shown[0]), shown
    assert not [line for line in lines if re.search(r"\(1, 1\)\s+\S*getitem", line)]  # (no label column names one)


class Inner(nn.Module):
    """A deliberate graph break after a submodule call: ``fc1``'s output ends a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        torch._dynamo.graph_break()
        return self.fc2(torch.relu(h))


class Breaking(nn.Module):
    """``head``'s output ends a graph too: what follows starts with a break (an ``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.head(self.inner(x))
        scale = y.detach().abs().max().item()  # a graph break (a host read)
        return y * (1.0 + 0.0 * scale)


def test_module_outputs_that_end_a_graph_at_a_break_are_tagged() -> None:
    torch.manual_seed(0)
    model, x = Breaking(), torch.randn(2, 4)
    cap = capture(model, "dynamo")
    records = tracked(cap, x)
    torch._dynamo.reset()
    assert {"inner.fc1", "head", "inner.fc2", "inner"} <= cap.module_outputs
    assert all(cap.tags.count(path) == 1 for path in cap.module_outputs)
    assert cap.aliases["head"] == "head/linear" and cap.aliases["inner.fc1"] == "inner.fc1/linear"
    h = model.inner.fc1(x)
    y = model.head(model.inner(x))
    assert float(stats.statistic(records["inner.fc1"], "std")[FORWARD]) == pytest.approx(std(h), rel=1e-6)
    assert float(stats.statistic(records["head"], "std")[FORWARD]) == pytest.approx(std(y), rel=1e-6)
    # `inner` breaks inside: its output is fc2's, in the graph that resumes it, where its
    # own ops (the relu) are under its path too; the modules' labels are the fx route's,
    # which sees no breaks (fx traces `.item()` and the scalar arithmetic after it as ops)
    assert cap.aliases["inner"] == "inner.fc2/linear" and "inner/relu" in records
    assert float(stats.statistic(records["inner"], "std")[FORWARD]) == pytest.approx(std(model.inner(x)), rel=1e-6)
    fx = capture(model, "fx")
    assert cap.module_outputs == fx.module_outputs

    def in_modules(tags: List[str]) -> List[str]:
        return sorted(t for t in tags if t.startswith(("inner", "head")))

    assert in_modules(cap.tags) == in_modules(fx.tags)


def test_fsdp_style_units_tag_the_module_outputs_inside_them() -> None:
    """A unit captured as a graph of its own (as FSDP2 units are) tags ``blocks.0.mlp.fc1``,
    not only ``blocks.0.mlp.fc1/linear``: the module outputs of the capture without units."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32, seq=8, layers=2, dim=16, heads=2))
    whole, units = capture(model, "fx"), capture(model, "fx", units=["blocks.0", "blocks.1"])
    assert "blocks.0.mlp.fc1" in units.module_outputs and "blocks.1.attn" in units.module_outputs
    assert units.module_outputs == whole.module_outputs
    assert units.aliases["blocks.0.mlp.fc1"] == "blocks.0.mlp.fc1/linear"
    assert units.tags.count("blocks.0.mlp.fc1") == 1


# ---------------------------------------------------------------------------------------
# A real Trainer run: the tags in TensorBoard's event files and in the dashboard


class MixerTask(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Mixers()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Tensor]:
    root = tmp_path_factory.mktemp("labels")
    x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="run"),
        callbacks=[ScaleMonitor(every_n_steps=1, histograms=False, statistics=["std"])],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MixerTask(), DataLoader(TensorDataset(x), batch_size=8))
    return Path(trainer.logger.log_dir), x


def test_bracketed_tags_reach_the_event_files_unchanged(logged_run: Tuple[Path, Tensor]) -> None:
    log_dir, x = logged_run
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}
    q = MixerTask().model.blocks[0].qkv(x).chunk(3, dim=-1)[0]  # step 0: the initial parameters
    assert scalars["scale/fwd/model.blocks.0/chunk[0]"][0] == pytest.approx(std(q), rel=1e-5)
    assert "scale/bwd/model.blocks.1/chunk_1[1]" in scalars and "scale/fwd/model.blocks.0/unbind[0]" in scalars
    code = acc.Tensors("scale_code/text_summary")[0].tensor_proto.string_val[0].decode()
    assert re.search(r"model\.blocks\.0/chunk\[0\]\s+getitem(_\d+)? = chunk\[0\]", code), code[:2000]


def test_the_dashboard_serves_bracketed_labels(logged_run: Tuple[Path, Tensor]) -> None:
    log_dir, _ = logged_run
    root = log_dir.parent.parent
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(root))
    mux.Reload()
    plugin = ScalesPlugin(
        base_plugin.TBContext(data_provider=data_provider.MultiplexerDataProvider(mux, str(root)), logdir=str(root))
    )
    run = str(log_dir.relative_to(root))

    def get(route: str, **params: Any) -> Any:
        response = Client(plugin.get_plugin_apps()[route]).get(route, query_string=params)
        assert response.status_code == 200, response.get_data(as_text=True)
        return json.loads(response.get_data(as_text=True))

    label = "model.blocks.0/chunk[0]"
    nodes = [n["label"] for n in get("/profile", run=run, step=1)["nodes"]]
    assert label in nodes and "model.blocks.1/chunk_1[1]" in nodes
    series = get("/series", run=run, label=label)["series"]["std/fwd"]
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    assert series == pytest.approx([e.value for e in acc.Scalars(f"scale/fwd/{label}")])
    rows = get("/worst", run=run, step=1, regex=r"chunk\[0\]")["rows"]
    assert rows and {r["label"] for r in rows} <= {l for l in nodes if l.endswith("chunk[0]")}
    lines: List[str] = [line["text"] for line in get("/code", run=run, step=1)["lines"]]
    assert any(label in line and "= chunk[0]" in line for line in lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
