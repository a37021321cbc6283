"""``record.placements`` and the recorder on DTensors, in one process (a 1-rank gloo mesh):
a shard and a replica are recorded as their local tensor, a ``Partial`` is not (and the
recorder names why), the gradient of a DTensor follows the same rule, and no DTensor op
(nor its implicit-replication warning) runs inside the statistics. The multi-rank
behaviour is tested over gloo in ``tests/report/test_tensor_parallel.py``."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from lightning_scale.record import placements, stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder
from tests.gloo import one_rank_mesh


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with one_rank_mesh("tensor_parallel") as m:
        yield m


def test_local_part_by_placement(mesh: DeviceMesh) -> None:
    x = torch.randn(4, 6)
    for placement in (Shard(0), Shard(1), Replicate()):
        local, why = placements.local_part(DTensor.from_local(x, mesh, [placement]))
        assert why is None and local is not None and torch.equal(local, x)
        assert not placements.is_distributed(local)
    assert placements.local_part(DTensor.from_local(x, mesh, [Partial()])) == (None, placements.PARTIAL)
    assert placements.is_distributed(DTensor.from_local(x, mesh, [Shard(0)])) and not placements.is_distributed(x)
    assert placements.first_of_replicas(mesh) and placements.first_beyond(mesh)


def test_the_recorder_records_a_dtensor_and_its_gradient_as_the_local_tensor(mesh: DeviceMesh) -> None:
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    d = DTensor.from_local(x, mesh, [Shard(1)])
    rec = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "implicitly creating a replicated DTensor")
        rec.observe("d", d)
        (d * 3).to_local().sum().backward()
        records = rec.records(["d"])
    for direction, t in ((FORWARD, x.detach()), (BACKWARD, torch.full_like(x, 3.0))):
        got = stats.summarise(records[0, direction], ["std", "count", "absmax"])
        assert got["count"] == t.numel()
        assert got["std"] == pytest.approx(float(t.std()), rel=1e-12)
        assert got["absmax"] == float(t.abs().max())


def test_a_partial_gradient_is_summed_over_its_group_at_flush(mesh: DeviceMesh) -> None:
    """A gradient that reaches its hook as a ``Partial`` DTensor (a SequenceParallel norm's
    parameter) is kept and summed over the mesh group when the step is flushed (1 rank:
    the sum is the value itself), then recorded."""
    w = DTensor.from_local(torch.randn(5, dtype=torch.float64), mesh, [Replicate()]).detach().requires_grad_()
    xs = torch.randn(4, 5, dtype=torch.float64)  # (the sequence-sharded activations)
    rec = Recorder()
    rec.observe("w", w)
    seen = []
    w.register_hook(lambda grad: seen.append(tuple(grad.placements)))
    (w * DTensor.from_local(xs, mesh, [Shard(0)])).to_local().sum().backward()
    assert seen == [(Partial(),)] and rec.skipped == {}
    g = xs.sum(0)  # the gradient, summed over the shards
    got = stats.summarise(rec.records(["w"])[0, BACKWARD], ["count", "std"])
    assert got == {"count": 5, "std": pytest.approx(float(g.std()), rel=1e-12)}


def test_a_partial_dtensor_is_not_recorded_and_the_recorder_says_why(mesh: DeviceMesh) -> None:
    rec = Recorder()
    rec.observe("p", DTensor.from_local(torch.randn(3, 2), mesh, [Partial()]))
    assert rec.skipped == {("p", FORWARD): placements.PARTIAL}
    assert rec.records(["p"])[0, FORWARD, stats.IX["count"]] == 0
