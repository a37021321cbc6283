"""Kurtosis (record/stats/outliers.py) against float64 computations of the same tensors, and its
per-node rows merged across micro-batches and ranks against the whole (channels: test_channels.py)."""

from __future__ import annotations

import math
from typing import List, Tuple

import pytest
import torch
from torch import Tensor

from lightning_scale.record.stats.outliers import kurtosis, merge_moments, moment_deviations, moments_row


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_moments(x: Tensor) -> Tuple[float, float, float, float, float]:
    """(count, mean, m2, m3, m4) of the finite elements in float64, two passes with fsum."""
    v = x.double().flatten()
    v = v[v.isfinite()].tolist()
    n = len(v)
    mean = math.fsum(v) / n
    d = [e - mean for e in v]
    return float(n), mean, math.fsum(e**2 for e in d), math.fsum(e**3 for e in d), math.fsum(e**4 for e in d)


def assert_moments_close(got: Tensor, want: Tuple[float, ...], rel: float) -> None:
    """Rows equal up to ``rel`` of each moment's scale (``|m_k| + n sigma^k``; the mean's: |mean| + sigma)."""
    n, mean, m2, m3, m4 = want
    sigma = math.sqrt(m2 / n)
    g = got.tolist()
    assert g[0] == n
    assert g[1] == pytest.approx(mean, rel=0, abs=rel * (abs(mean) + sigma))
    for k, (a, b) in enumerate(zip(g[2:], (m2, m3, m4)), 2):
        assert a == pytest.approx(b, rel=0, abs=rel * (abs(b) + n * sigma**k)), k


#: Rounding of the float32 path (float32 row sums, float64 across rows), far under the 1e-4 asked.
F32 = 1e-6


def reference_kurtosis(x: Tensor) -> float:
    n, _, m2, _, m4 = reference_moments(x)
    return n * m4 / (m2 * m2)


TENSORS = {
    "gaussian": lambda: torch.randn(64, 300, generator=_gen(0)),  # kurtosis 3
    "uniform": lambda: torch.rand(1000, generator=_gen(1)),  # 1.8
    "student_t": lambda: torch.distributions.StudentT(torch.tensor(5.0)).sample((50, 80)),  # heavy: 9
    "lognormal": lambda: torch.exp(torch.randn(4000, generator=_gen(2))),
    "half": lambda: torch.randn(16, 64, generator=_gen(3)).half(),
    "double": lambda: torch.randn(16, 64, generator=_gen(4), dtype=torch.float64) ** 3,
    # fourth powers beyond float32's range either way: scaled by a power of two first
    "tiny": lambda: torch.distributions.StudentT(torch.tensor(6.0)).sample((9000,)) * 1e-30,
    "huge": lambda: torch.distributions.StudentT(torch.tensor(6.0)).sample((9000,)) * 1e30,
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_kurtosis_equals_float64(name: str) -> None:
    x = TENSORS[name]()
    row = moments_row(x)
    rel = 1e-12 if x.dtype == torch.float64 else F32
    assert_moments_close(row, reference_moments(x), rel)
    assert float(kurtosis(row)) == pytest.approx(reference_kurtosis(x), rel=rel)


def test_kurtosis_closed_forms() -> None:
    assert float(kurtosis(moments_row(torch.randn(1 << 20, generator=_gen(5))))) == pytest.approx(3.0, abs=0.02)
    assert float(kurtosis(moments_row(torch.rand(1 << 20, generator=_gen(6))))) == pytest.approx(1.8, abs=0.01)
    assert float(kurtosis(moments_row(torch.tensor([-1.0, 1.0] * 50)))) == pytest.approx(1.0, rel=1e-14)
    assert math.isnan(float(kurtosis(moments_row(torch.full((10,), 3.0)))))  # no spread: undefined
    assert math.isnan(float(kurtosis(moments_row(torch.empty(0)))))


@pytest.mark.parametrize("mean", [1e4, 1e6, -3e7])
def test_a_mean_far_above_the_spread_stays_within_1e_4_of_float64(mean: float) -> None:
    x = (torch.randn(1 << 16, generator=_gen(7), dtype=torch.float64) + mean).float()  # float32 values
    got = float(kurtosis(moments_row(x)))
    assert got == pytest.approx(reference_kurtosis(x), rel=1e-4)
    parts = torch.stack([moments_row(p) for p in x.split(1000)])  # and merged from 66 micro-batches
    assert float(kurtosis(merge_moments(parts))) == pytest.approx(reference_kurtosis(x), rel=1e-4)


def _splits(x: Tensor) -> List[Tensor]:
    return list(x.flatten().split([1, 999, 5000, 3000, 10000 - 9000 + x.numel() - 10000]))


def test_merged_rows_equal_the_whole() -> None:
    x = torch.distributions.StudentT(torch.tensor(3.0)).sample((10000,)) * 2 + 5
    x = torch.cat([x[:1000] + 100, x[1000:]])  # parts with different means
    rows = torch.stack([moments_row(p) for p in _splits(x)] + [moments_row(torch.empty(0))])
    merged = merge_moments(rows)
    assert_moments_close(merged, reference_moments(x), F32)
    assert_moments_close(moments_row(x), reference_moments(x), F32)
    whole64 = moments_row(x.double())  # in float64 the merge is exact up to float64 rounding
    merged64 = merge_moments(torch.stack([moments_row(p.double()) for p in _splits(x)]))
    assert_moments_close(merged64, tuple(whole64.tolist()), 1e-13)
    assert_moments_close(whole64, reference_moments(x), 1e-13)


def test_merge_by_reductions_as_ranks_pool() -> None:
    """Across ranks: a sum of counts and count x (mean - c), then a sum of the deviations about
    the merged mean; equal to merging the rows directly."""
    x = torch.randn(4, 2500, generator=_gen(8)) * torch.tensor([[1.0], [3.0], [0.5], [10.0]]) + 7
    rows = torch.stack([moments_row(r) for r in x])  # one row per rank
    c = (rows[:, 1].max() + rows[:, 1].min()) / 2
    n = rows[:, 0].sum()
    mean = c + (rows[:, 0] * (rows[:, 1] - c)).sum() / n
    central = moment_deviations(rows, mean).sum(0)
    pooled = torch.cat([torch.stack([n, mean]), central])
    assert_moments_close(pooled, tuple(merge_moments(rows).tolist()), 1e-13)
    assert_moments_close(pooled, reference_moments(x), F32)


def test_chunks_and_non_finite_values() -> None:
    x = torch.randn(3000, generator=_gen(9)) ** 3
    assert_moments_close(moments_row(x, chunk=7), reference_moments(x), F32)
    y = x.clone()
    y[[3, 70, 2999]] = torch.tensor([math.nan, math.inf, -math.inf])
    keep = torch.ones(3000, dtype=torch.bool)
    keep[[3, 70, 2999]] = False
    assert_moments_close(moments_row(y), reference_moments(x[keep]), F32)
    assert moments_row(torch.full((4,), math.nan)).tolist() == [0.0] * 5


def test_batched_merge() -> None:
    x = torch.randn(3, 4, 100, generator=_gen(10))
    rows = torch.stack([torch.stack([moments_row(p) for p in node]) for node in x])  # (nodes, parts, 5)
    for merged, node in zip(merge_moments(rows), x):
        assert_moments_close(merged, reference_moments(node), F32)


# ---------------------------------------------------------------------------------------
# The record fields (m3, m4 of the kurtosis group) merge exactly, pairwise and by reductions


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
@pytest.mark.parametrize("shift", [0.0, 1e4])
def test_record_kurtosis_merges_across_micro_batches_and_ranks(host_reads: bool, shift: float) -> None:
    from lightning_scale.record import stats

    x = torch.distributions.StudentT(torch.tensor(4.0)).sample((10000,)) + shift
    x[:500] += 2  # parts with different means
    groups = ("moments", "kurtosis")
    parts = [stats.assemble([stats.record_of(p, groups, host_reads, kernel="torch")]) for p in _splits(x)]
    want = reference_kurtosis(x)
    whole = stats.assemble([stats.record_of(x, groups, host_reads, kernel="torch")])
    assert float(stats.statistic(whole, "kurtosis")[0]) == pytest.approx(want, rel=F32)
    by_reductions = stats.merge_rows(torch.cat(parts))  # the pool's max, sum, sum
    assert float(stats.statistic(by_reductions, "kurtosis")) == pytest.approx(want, rel=F32)
    pairwise = parts[0][0]
    for p in parts[1:]:
        pairwise = stats.merge(pairwise, p[0])
    assert float(stats.statistic(pairwise, "kurtosis")) == pytest.approx(want, rel=F32)
    empty = stats.assemble([stats.record_of(torch.empty(0), groups, host_reads)])[0]
    for merged in (stats.merge(empty, pairwise), stats.merge(pairwise, empty)):  # the empty record is the identity
        torch.testing.assert_close(merged, pairwise, rtol=0, atol=0, equal_nan=True)


def test_record_kurtosis_is_nan_with_non_finite_values_like_std() -> None:
    from lightning_scale.record import stats

    x = torch.randn(100, generator=_gen(20))
    x[7] = math.nan
    rec = stats.assemble([stats.record_of(x, ("moments", "kurtosis"), True)])
    assert math.isnan(float(stats.statistic(rec, "std")[0])) and math.isnan(float(stats.statistic(rec, "kurtosis")[0]))
