"""``capture/tensor_parallel.py`` in one process (a 1-rank gloo mesh): a model with
tensor-parallel layers is refused by fx, captured by dynamo under ``auto`` (the capture
line names the mesh), its DTensor conversions are aliases, the row-parallel matmul's
partial sums are recorded through their reduction, and every node's record equals the
unparallelized model's, forward and backward. Several ranks: ``tests/report/test_tensor_parallel.py``."""

from __future__ import annotations

import copy
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from lightning_scale.capture.graphs import CaptureError, capture
from lightning_scale.capture.tensor_parallel import UNKNOWN, distributed_modules, parallel_mesh
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording
from tests.gloo import one_rank_mesh


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_mesh("tp") as m:
        try:
            yield m
        finally:
            torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _parallel(mesh: DeviceMesh) -> "tuple[nn.Module, nn.Module]":
    torch.manual_seed(0)
    model = MLP()
    plain = copy.deepcopy(model)
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model, plain


def test_fx_refuses_tensor_parallel_layers_and_auto_chooses_dynamo(mesh: DeviceMesh) -> None:
    model, plain = _parallel(mesh)
    assert distributed_modules(model) == ["fc1", "fc2"] and distributed_modules(plain) == []
    with pytest.raises(CaptureError, match=r"fx cannot see the placements of tensor-parallel layers fc1, fc2"):
        capture(model, "fx")
    cap = capture(model, "auto")
    assert cap.mode == "dynamo"
    assert cap.describe().endswith(
        "auto: fx cannot see the placements of tensor-parallel layers fc1, fc2; DTensor mesh dims: tp=1"
    )


def test_every_node_is_recorded_as_in_the_unparallelized_model(mesh: DeviceMesh) -> None:
    model, plain = _parallel(mesh)
    cap = capture(model, "dynamo")
    x = torch.randn(3, 8)
    rec = Recorder()
    with recording(rec):
        out = cap.tracked()(x)
    out.square().sum().backward()
    labels = cap.node_labels
    records = rec.records(labels, cap.aliases)
    assert rec.skipped == {}
    assert not [
        label
        for label in labels
        if label.split("/")[-1] in ("from_local", "to_local", "redistribute") and label not in cap.aliases
    ]

    h = plain.fc1(x)
    a = F.gelu(h)
    o = plain.fc2(a)
    for t in (h, a, o):
        t.retain_grad()
    o.square().sum().backward()
    expected = {"fc1/linear": h, "act/gelu": a, "fc2/linear": o}
    expected.update({f"{n}.{p}": getattr(getattr(plain, n), p) for n in ("fc1", "fc2") for p in ("weight", "bias")})
    for label, t in expected.items():
        row = records[labels.index(label)]
        for d, value in enumerate((t.detach(), t.grad)):
            got = stats.summarise(row[d], ["count", "std"])
            assert got["count"] == value.numel(), (label, d)
            assert got["std"] == pytest.approx(float(value.double().std()), rel=1e-5), (label, d)


class Broken(MLP):
    """The MLP with a dynamo graph break after ``fc1`` or after ``fc2``, and a head."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.after, self.head, self.side = after, nn.Linear(8, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.after == "fc1":
            torch._dynamo.graph_break()
        if self.after == "fc1, eagerly":
            return self.side(torch.relu(_eagerly_doubled(h)))
        h = self.fc2(self.act(h))
        if self.after == "fc2":
            torch._dynamo.graph_break()
        return self.head(h)


@torch.compiler.disable
def _eagerly_doubled(h: torch.Tensor) -> torch.Tensor:
    return 2 * h  # (eager code at a graph break: a value no graph returned)


@pytest.mark.parametrize("after, skipped", [("fc1", []), ("fc2", []), ("fc1, eagerly", ["relu", "side/linear"])])
def test_inputs_from_before_a_graph_break_take_the_declared_placement_or_are_skipped(
    mesh: DeviceMesh, after: str, skipped: "list[str]"
) -> None:
    """After the break that follows fc1, fc2's input hook declares the GELU's input a shard:
    the GELU is recorded. After the one that follows fc2, nothing in the head's graph (no
    DTensor at all: it takes the parallel layers' mesh) declares its input, which left fc2's
    graph a replica: the head is recorded (once per tensor-parallel group). A value made by
    eager code after fc1's local shard left its graph may be that shard's: what is computed
    from it is recorded on no rank, and ``skipped`` says why, forward and backward."""
    torch.manual_seed(0)
    model = Broken(after)
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    assert parallel_mesh(model) is mesh and parallel_mesh(MLP()) is None
    cap = capture(model, "auto")
    rec = Recorder()
    with recording(rec):
        out = cap.tracked()(torch.randn(3, 8))
    out.square().sum().backward()
    why = {(label, d): UNKNOWN for label in skipped for d in (FORWARD, BACKWARD)}
    assert rec.skipped == why
    records = rec.records(cap.node_labels, cap.aliases)
    counts = {label: stats.summarise(row[0], ["count"])["count"] for label, row in zip(cap.node_labels, records)}
    if skipped:
        assert counts["relu"] == counts["side/linear"] == 0 and counts["fc1/linear"] == 3 * 16
        return
    assert counts["act/gelu"] == 3 * 16 and counts["fc2/linear"] == 3 * 8 and counts["head.weight"] == 4 * 8
    assert counts["head/linear"] == 3 * 4
