"""Recorder: a node that returns its input tensor itself reuses its record, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_scale.record import stats
from lightning_scale.capture import capture
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording
from lightning_scale.record.short_records import ShortRecords


class Identityish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)  # returns its input tensor itself

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.fc(x)).contiguous()
        y = h + 1.0
        y.mul_(2.0)  # same object, new version: a different value, recorded afresh
        return y.sum() + (h * h).sum()


def _run(model: nn.Module, x: torch.Tensor) -> tuple:
    cap = capture(model, "fx")
    rec = Recorder()
    with recording(rec):
        loss = cap.tracked()(x)
    loss.backward()
    labels = cap.node_labels
    records = rec.records(labels, cap.aliases).cpu()
    rec.clear()
    return labels, records, rec


def test_same_tensor_reuses_record_and_gradient() -> None:
    torch.manual_seed(0)
    model, x = Identityish(), torch.randn(32, 8)
    labels, records, _ = _run(model, x)
    index = {l: i for i, l in enumerate(labels)}
    lin, drop = index["fc/linear"], index["drop/dropout"]
    torch.testing.assert_close(records[drop], records[lin], rtol=0, atol=0, equal_nan=True)
    # Independent float64 reference of the linear output and its gradient.
    w, b = model.fc.weight.detach().double(), model.fc.bias.detach().double()
    h = (x.double() @ w.T + b).requires_grad_()
    ((h + 1) * 2).sum().add((h * h).sum()).backward()
    std = stats.statistic(records, "std")
    assert abs(float(std[lin, FORWARD]) / float(h.detach().std()) - 1) < 1e-6
    assert abs(float(std[lin, BACKWARD]) / float(h.grad.std()) - 1) < 1e-6


def test_in_place_result_is_recorded_afresh() -> None:
    torch.manual_seed(0)
    model, x = Identityish(), torch.randn(32, 8)
    labels, records, _ = _run(model, x)
    index = {l: i for i, l in enumerate(labels)}
    add, mul = records[index["add"]], records[index["mul_"]]
    std = stats.statistic(torch.stack([add, mul]), "std")
    assert abs(float(std[1, FORWARD]) / float(std[0, FORWARD]) - 2) < 1e-6


def _count_records(monkeypatch) -> list:  # type: ignore[no-untyped-def]
    """Shapes of the tensors whose records are computed (one by one, or batched when short)."""
    calls: list = []
    original, add = stats.record_of, ShortRecords.add
    monkeypatch.setattr(stats, "record_of", lambda x, *a, **k: calls.append(x.shape) or original(x, *a, **k))
    monkeypatch.setattr(ShortRecords, "add", lambda self, x: calls.append(x.shape) or add(self, x))
    return calls


def test_same_tensor_is_not_computed_twice(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = _count_records(monkeypatch)
    torch.manual_seed(0)
    labels, records, _ = _run(Identityish(), torch.randn(32, 8))
    present = int((records[..., 0] > 0).sum())
    # dropout(p=0) and .contiguous() return the linear output itself: 2 nodes x 2 directions;
    # the final add hands its gradient tensor itself to both sums: 2 more
    assert len(calls) == present - 6


class Residual(nn.Module):
    """A residual stream: autograd hands ``x + f(x)``'s gradient tensor itself to ``f(x)``,
    then adds into it in place for ``x`` (a new version: a different value)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        r = h + self.fc2(h)
        return (r * r).sum()


def test_shared_gradient_tensor_reuses_record_exactly(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    grads = _count_records(monkeypatch)
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(32, 8)
    labels, records, _ = _run(model, x)
    index = {l: i for i, l in enumerate(labels)}
    add, fc2, fc1 = index["add"], index["fc2/linear"], index["fc1/linear"]
    # float64 reference gradients of each node's output
    w1, b1 = model.fc1.weight.detach().double(), model.fc1.bias.detach().double()
    w2, b2 = model.fc2.weight.detach().double(), model.fc2.bias.detach().double()
    h = (x.double() @ w1.T + b1).requires_grad_()
    f = (h @ w2.T + b2).requires_grad_()
    r = (h + f).requires_grad_()
    for t in (h, f, r):
        t.retain_grad()
    (r * r).sum().backward()
    std = stats.statistic(records, "std")
    for node, ref in ((add, r.grad), (fc2, f.grad), (fc1, h.grad)):
        assert abs(float(std[node, BACKWARD]) / float(ref.std()) - 1) < 1e-6
    torch.testing.assert_close(records[fc2, BACKWARD], records[add, BACKWARD], rtol=0, atol=0, equal_nan=True)
    present = int((records[..., 0] > 0).sum())
    assert len(grads) == present - 1  # fc2's output gradient: add's, reused; fc1's: new values, computed


class SparseEmbedding(nn.Module):
    """A sparse embedding (its weight's gradient is sparse, its output dense) into a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, sparse=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(i)).square().mean()


def test_sparse_tensors_are_skipped_per_node_and_the_rest_recorded() -> None:
    torch.manual_seed(0)
    model, i = SparseEmbedding(), torch.tensor([1, 4, 4, 7])
    labels, records, _ = _run(model, i)
    cap = capture(model, "fx")
    rec = Recorder()
    with recording(rec):
        cap.tracked()(i).backward()
    assert rec.error is None
    assert rec.skipped == {("emb.weight", BACKWARD): "sparse_coo layout"}  # the sparse gradient only
    index = {l: k for k, l in enumerate(labels)}
    count = records[..., stats.FIELDS.index("count")]
    assert float(count[index["emb.weight"], FORWARD]) == 60 and float(count[index["emb.weight"], BACKWARD]) == 0
    # The dense nodes are recorded in both directions; the embedding output against float64.
    emb = model.emb.weight.detach().double()[i]
    std = stats.statistic(records, "std")
    assert abs(float(std[index["emb/embedding"], FORWARD]) / float(emb.std()) - 1) < 1e-6
    assert float(count[index["emb/embedding"], BACKWARD]) == 24 and float(count[index["fc.weight"], BACKWARD]) == 18
    rec.clear()
    assert rec.skipped == {}


def test_a_sparse_value_is_skipped_in_its_direction() -> None:
    rec = Recorder()
    dense = torch.randn(4, 3)
    rec.observe("sparse", dense.to_sparse())
    rec.observe("csr", dense.to_sparse_csr())
    rec.observe("dense", dense)
    assert rec.skipped == {("sparse", FORWARD): "sparse_coo layout", ("csr", FORWARD): "sparse_csr layout"}
    count = rec.records(["sparse", "csr", "dense"])[..., stats.FIELDS.index("count")]
    assert count[:, FORWARD].tolist() == [0, 0, 12]


def test_rows_added_whole_are_placed_and_merged_like_observed_records() -> None:
    # (the compiled route hands whole rows: forward rows at once, gradient rows after backward)
    a, b = torch.randn(50), torch.randn(70) + 2
    row_a = stats.assemble([stats.record_of(a, host_reads=False)])
    row_b = stats.assemble([stats.record_of(b, host_reads=False)])
    rec = Recorder()
    rec.add_rows(["x"], FORWARD, row_a)
    rec.observe("x", b)  # the same key again: merged
    grads: list = []
    rec.add_rows_later(["x", "y"], BACKWARD, lambda: grads[0] if grads else None)
    rec.add_rows_later(["y"], FORWARD, lambda: None)  # (no backward reached it: nothing)
    assert rec.keys == ["x", "y"]
    grads.append(torch.cat([row_b, row_a]))  # known only when the records are read
    out = rec.records(["x", "y"])
    merged = stats.assemble([stats.record_of(torch.cat([a, b]), host_reads=False)])[0]
    torch.testing.assert_close(out[0, FORWARD], merged, rtol=1e-6, atol=0, equal_nan=True)  # (host sums: ~1e-7)
    torch.testing.assert_close(out[0, BACKWARD], row_b[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out[1, BACKWARD], row_a[0], rtol=0, atol=0, equal_nan=True)
    assert float(out[1, FORWARD, 0]) == 0  # never seen forward: an empty record
    with pytest.raises(ValueError, match=r"`rows` must be \[2, \d+\], got \[1, \d+\]"):
        rec.add_rows(["x", "y"], FORWARD, row_a)
