"""``pool.pool_step`` in 2 and 8 gloo processes without Lightning
(``dist_scripts/run_pool.py``): exact pooling of a 2,000-node record, replicated tensors,
histograms, update statistics and the loss scale, bytes per rank, label mismatches and
failures raised on every rank without a hang, ranks sharing part of their labels; and
the same arithmetic in one process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

from lightning_scale.record import stats, updates
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.report import pool
from lightning_scale.report.update_pool import merge_updates
from tests.gloo import Ranks, load_script, start_ranks

SCRIPTS = Path(__file__).resolve().parents[1] / "dist_scripts"


# ---- pool_step in 2 and 8 gloo processes without Lightning -------------------------------

POOL_SCRIPT = SCRIPTS / "run_pool.py"
NODES = 2000


def _pool_script() -> Any:
    return load_script(POOL_SCRIPT)


def _start_pool(out: Path, world: int) -> Ranks:
    # (large buffers come from mmap: the peak RSS sees them)
    return start_ranks(POOL_SCRIPT, out, world, [str(NODES)], {"MALLOC_MMAP_THRESHOLD_": "131072"}, timeout=240)


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, List[Dict[str, Any]]]:
    """Each rank's saved results at 2 and 8 ranks: the two worlds run at once (independent
    process groups on their own ports; much of a rank's time is start-up)."""
    started = {world: _start_pool(tmp_path_factory.mktemp(f"pool{world}"), world) for world in (2, 8)}
    try:
        return {world: ranks.wait() for world, ranks in started.items()}
    finally:
        for ranks in started.values():
            ranks.stop()


def _expected_pool(world: int, ranks: List[Dict[str, Any]]) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """The records of the concatenation of every rank's tensors (a parameter's value once),
    the histograms of the same, and (from each rank's own records) each node's least and
    largest std over ranks."""
    script = _pool_script()
    rows, hists = [], []
    histogram_nodes = set(script.histogram_nodes(NODES))
    for i in range(NODES):
        per_rank = [script.tensors(i, r) for r in range(world)]
        for d in (FORWARD, BACKWARD):
            parts = [p[d] for p in per_rank]
            whole = parts[0] if d == FORWARD and script.is_parameter(i) else torch.cat(parts)
            rows.append(stats.record_of(whole, script.GROUPS))
            if i in histogram_nodes:
                hists.append(stats.log2_histogram(whole))
    want = stats.assemble(rows).view(NODES, 2, -1)
    own = torch.stack([saved["records"] for saved in ranks])  # (world, n, 2, F)
    # FP8 errors are of per-tensor-scaled casts: each rank's tensor is cast with its own scale
    fp8 = [stats.FIELDS.index(f) for f in stats.FIELDS if f.startswith("fp8_")]
    want[..., fp8] = torch.where((own[..., :1] > 0), own[..., fp8], 0.0).sum(0)
    params = torch.tensor([i for i in range(NODES) if script.is_parameter(i)]).unsqueeze(1)
    want[params, FORWARD, torch.tensor(fp8)] = own[
        0, params, FORWARD, torch.tensor(fp8)
    ]  # a parameter: rank 0's tensor
    std = stats.statistic(own, "std")
    nan = std.isnan().any(0)
    spread = {
        "present": (own[..., 0] > 0).all(0),
        "low": torch.where(nan, math.nan, std.amin(0)),
        "high": torch.where(nan, math.nan, std.amax(0)),
    }
    return want, torch.stack(hists).view(-1, 2, stats.LOG2_HI - stats.LOG2_LO), spread


@pytest.mark.parametrize("world", [2, 8])
def test_pool_step_is_the_record_of_every_ranks_tensors_together(
    world: int, pools: Dict[int, List[Dict[str, Any]]]
) -> None:
    got = pools[world][0]["result"]
    want, hists, spread = _expected_pool(world, pools[world])
    count = want[..., 0]
    assert torch.equal(got.records[..., 0], count)
    assert (count == 0).any() and torch.equal(got.records[count == 0], torch.zeros_like(got.records[count == 0]))
    seen = count > 0
    exact = [stats.FIELDS.index(f) for f in stats.FIELDS if f not in ("mean", "m2") and not f.startswith("fp8_")]
    torch.testing.assert_close(got.records[seen][:, exact], want[seen][:, exact], rtol=0, atol=0, equal_nan=True)
    g, w = got.records[seen], want[seen]
    finite = w[:, 1].isfinite()
    torch.testing.assert_close(g[~finite, 1], w[~finite, 1], rtol=0, atol=0, equal_nan=True)  # NaN or Inf alike
    rms = stats.statistic(w[finite], "rms")  # a mean near 0 is exact to the values' size, not its own
    assert bool(((g[finite, 1] - w[finite, 1]).abs() <= 1e-13 * rms).all())
    torch.testing.assert_close(g[:, 2], w[:, 2], rtol=1e-12, atol=0, equal_nan=True)  # m2
    fp8 = [stats.FIELDS.index(f) for f in stats.FIELDS if f.startswith("fp8_")]
    torch.testing.assert_close(g[:, fp8], w[:, fp8], rtol=1e-12, atol=0, equal_nan=True)  # per-tensor sums
    assert bool(got.records[..., 4].sum() > 0) and bool(got.records[..., 5].sum() > 0), (
        "NaN and Inf nodes are in the test"
    )
    assert torch.equal(got.histograms, hists)
    assert torch.equal(got.spread.present, spread["present"])
    p = spread["present"]
    torch.testing.assert_close(got.spread.low[p], spread["low"][p], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.spread.high[p], spread["high"][p], rtol=0, atol=0, equal_nan=True)
    script = _pool_script()
    rows = torch.stack([saved["update_rows"] for saved in pools[world]])  # (world, 3, 2, F)
    assert got.updates.shape == (3, 2, len(stats.FIELDS))
    torch.testing.assert_close(got.updates, merge_updates(rows, script.SHARDED), rtol=1e-12, atol=0)
    sharded = [k for k, s in enumerate(script.SHARDED) if s]
    added = rows[:, sharded, 0, :3].sum(0)  # weight sums (the reduction may add in another order)
    torch.testing.assert_close(got.updates[sharded, 0, :3], added, rtol=1e-13, atol=0)
    assert torch.equal(got.updates[1], rows[0, 1]) and not torch.equal(rows[0, 1], rows[1, 1])  # whole: rank 0's
    assert got.loss_scale == 1024.0  # rank 0's


def test_pool_step_sends_only_the_fields_of_the_groups_computed(pools: Dict[int, List[Dict[str, Any]]]) -> None:
    full, partial = pools[8][0]["result"].records, pools[8][0]["partial"].records
    sent = [i for i, f in enumerate(stats.FIELDS) if f in stats.GROUPS["moments"] + stats.GROUPS["range"]]
    seen = full[..., 0] > 0
    mean = sent.index(stats.FIELDS.index("mean"))  # (sums of other sizes: the reduction may add in another order)
    rest = [i for k, i in enumerate(sent) if k != mean]
    torch.testing.assert_close(partial[..., rest], full[..., rest], rtol=1e-12, atol=0, equal_nan=True)
    finite = full[..., 1].isfinite()
    rms = stats.statistic(full[finite], "rms")
    assert bool(((partial[..., 1][finite] - full[..., 1][finite]).abs() <= 1e-13 * rms).all())
    others = [i for i in range(len(stats.FIELDS)) if i not in sent]
    assert bool(partial[seen][:, others].isnan().all())  # not computed: NaN, as record_of leaves them
    moments_only = sum(pool.collective_bytes(NODES, replicated=200, groups=("moments",)).values())
    assert moments_only < sum(pool.collective_bytes(NODES, replicated=200).values()) / 4


def test_pool_step_counts_a_replicated_tensor_once(pools: Dict[int, List[Dict[str, Any]]]) -> None:
    script = _pool_script()
    got = pools[8][0]["result"]
    for i in range(0, NODES, 10):  # parameters: the value once, the 8 gradients merged
        value, _ = script.tensors(i, 0)
        assert got.records[i, FORWARD, 0] == value.numel()
        assert float(stats.statistic(got.records[i, FORWARD], "std")) == pytest.approx(
            float(value.double().std()), rel=1e-12
        )
        assert got.records[i, BACKWARD, 0] == sum(script.tensors(i, r)[1].numel() for r in range(8))


@pytest.mark.parametrize("world", [2, 8])
def test_pool_step_gives_every_rank_the_same_errors_and_the_result_only_to_its_destination(
    world: int, pools: Dict[int, List[Dict[str, Any]]]
) -> None:
    ranks = pools[world]
    for r, saved in enumerate(ranks):
        out = saved["outcomes"]
        assert (
            isinstance(out["failed"], pool.RankFailedError)
            and str(out["failed"]) == f"statistics failed on rank(s) [{world - 1}]"
        )
        for case in ("names", "count"):  # (with strict)
            assert isinstance(out[case], pool.RankMismatchError), (r, case)
            assert str(out[case]).startswith("Ranks captured different graphs ("), out[case]
        assert "node counts 1999 to 2000" in str(out["count"]) and "node counts" not in str(out["names"])
        assert out["after"] == "ok"  # dst=None: every rank gets the pool
        if r:
            assert saved["result_is_none"]
        torch.testing.assert_close(saved["small"].records, ranks[0]["small"].records, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(
        ranks[0]["small"].records, ranks[0]["result"].records[:20], rtol=1e-12, atol=1e-300, equal_nan=True
    )


def test_pool_step_bytes_per_rank_are_the_same_at_2_and_8_ranks(pools: Dict[int, List[Dict[str, Any]]]) -> None:
    calls = {world: [saved["calls"] for saved in ranks] for world, ranks in pools.items()}
    for world, ranks in calls.items():
        assert all(c == ranks[0] for c in ranks), world
        assert len(ranks[0]) == 4 and not any(name.startswith("all_gather") for name, _, _ in ranks[0])
    assert calls[2][0] == calls[8][0]
    script = _pool_script()
    expected = pool.collective_bytes(
        NODES,
        histograms=len(script.histogram_nodes(NODES)),
        replicated=len([i for i in range(NODES) if script.is_parameter(i)]),
        spread=True,
        sharded=sum(script.SHARDED),
        whole=len(script.SHARDED) - sum(script.SHARDED),
        loss_scale=True,
    )
    assert [size for _, _, size in calls[8][0]] == list(expected.values())


@pytest.mark.parametrize("world", [2, 8])
def test_pool_step_pools_the_labels_every_rank_shares(world: int, pools: Dict[int, List[Dict[str, Any]]]) -> None:
    """Rank 1 lacks node 3 (and its histogram) and has a node of its own: every rank pools
    the other 39 nodes, exactly as a pool of those nodes alone, in a fixed number of
    collectives whose bytes per rank do not depend on the world size."""
    script = _pool_script()
    ranks = pools[world]
    got, want = ranks[0]["shared"], ranks[0]["shared_reference"]
    shared = [script.label(i) for i in range(40) if i != 3]
    assert got.labels == want.labels == shared
    torch.testing.assert_close(got.records, want.records, rtol=0, atol=0, equal_nan=True)
    assert bool((got.records[..., 0] > 0).any())
    assert got.histogram_labels == want.histogram_labels == [script.label(0)]  # node 3's and rank 1's own: not shared
    assert torch.equal(got.histograms, want.histograms)
    for a, b in zip(got.spread, want.spread):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert got.unshared == (39, [script.label(3)], 1, [script.label(NODES + 1)])
    assert want.unshared is None and all(saved["shared"] is None for saved in ranks[1:])
    text = got.unshared.describe()
    assert "1 of rank 0's nodes are not on every rank (`n3/op`)" in text and f"(`n{NODES + 1}/op`)" in text
    calls = [saved["shared_calls"] for saved in ranks]
    assert all(c == calls[0] for c in calls)
    assert [(name, op) for name, op, _ in calls[0] if name != "broadcast"] == [
        ("all_reduce", "MAX"),  # the header: the labels differ
        ("all_reduce", "MIN"),  # which of rank 0's labels every rank has
        ("all_reduce", "MAX"),  # the header of the shared nodes
        ("all_reduce", "MAX"),
        ("all_reduce", "SUM"),
        ("reduce", "SUM"),
    ]
    assert [name for name, _, _ in calls[0]].count("broadcast") == 3  # rank 0's labels (size, bytes), examples


def test_pool_step_shared_labels_cost_the_same_at_2_and_8_ranks(pools: Dict[int, List[Dict[str, Any]]]) -> None:
    assert pools[2][0]["shared_calls"] == pools[8][0]["shared_calls"]


def test_pool_step_in_one_process() -> None:
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(4, generator=gen), torch.randn(3, generator=gen)]
    records = stats.assemble([stats.record_of(t, ("moments", "range")) for t in parts for _ in (0, 1)]).view(2, 2, -1)
    rows = torch.stack([updates.row_of(t, t * 1.5, t) for t in parts])
    out = pool.pool_step(
        records,
        ["a", "b"],
        replicated={"a"},
        spread=True,
        updates=updates.UpdateStats(["p", "q"], [True, False], rows),
        loss_scale=torch.tensor(8.0),
    )
    assert out is not None
    torch.testing.assert_close(out.records, records, rtol=0, atol=0, equal_nan=True)
    assert out.labels == ["a", "b"] and out.unshared is None
    std = stats.statistic(records, "std")
    assert torch.equal(out.spread.low, std) and torch.equal(out.spread.high, std) and bool(out.spread.present.all())
    assert torch.equal(out.updates, rows) and out.loss_scale == 8.0
    with pytest.raises(pool.RankFailedError, match=r"statistics failed on rank\(s\) \[0\]"):
        pool.pool(records, ["a", "b"], failed=True)


def test_merging_by_sums_and_maxes_equals_the_record_of_the_concatenation() -> None:
    """``stats.merge_rows`` (the pool's arithmetic in one process) against ``record_of`` of the
    concatenation: empty parts, NaN, Inf, fields not computed."""
    gen = torch.Generator().manual_seed(3)
    groups = ("moments", "range", "formats")
    cases = [
        [
            torch.randn(5, generator=gen, dtype=torch.float64),
            torch.zeros(0, dtype=torch.float64),
            torch.randn(7, generator=gen, dtype=torch.float64) * 3 + 2,
            torch.tensor([5.0], dtype=torch.float64),
        ],
        [torch.tensor([1.0, math.nan]), torch.tensor([2.0, 3.0])],
        [torch.tensor([1.0, math.inf]), torch.tensor([0.0, -2.0, 1e-30])],
    ]
    for parts in cases:
        got = stats.merge_rows(stats.assemble([stats.record_of(p, groups) for p in parts]))
        want = torch.tensor(stats.record_of(torch.cat(parts), groups), dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15, equal_nan=True)
    only_moments = stats.assemble([stats.record_of(p) for p in cases[0]])  # absmax etc. not computed: NaN stays
    got = stats.merge_rows(only_moments)
    assert got[stats.FIELDS.index("absmax")].isnan() and got[stats.FIELDS.index("min_nonzero")].isnan()
    empty = torch.zeros(3, len(stats.FIELDS), dtype=torch.float64)
    assert torch.equal(stats.merge_rows(empty), empty[0])
