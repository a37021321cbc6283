"""stats, property-based: random tensors with special values on both paths against numpy
float64, big sizes as explicit cases, the fp8 what-if against a float64 quantisation."""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats import fp8, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
TOL = 1e-6  # the accuracy goal for mean and std, relative to float64
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Format edges from torch.finfo (not from stats.FORMATS): subnormal = normal * eps.
EDGES = {n: torch.finfo(d) for n, d in [("fp16", torch.float16), ("bf16", torch.bfloat16), *FP8.items()]}


def numpy_reference(x: Tensor) -> Dict[str, float]:
    """Every exact count and the float64 moments of ``x``, in numpy."""
    v = x.detach().double().numpy().ravel()
    a = np.abs(v)
    nonzero = a[(a > 0) & ~np.isnan(a)]
    ref = {
        "count": float(v.size),
        "nan": float(np.isnan(v).sum()),
        "inf": float(np.isinf(v).sum()),
        "zeros": float((a == 0).sum()),
        "min_nonzero": float(nonzero.min()) if nonzero.size else math.inf,
        "absmax": float(a.max()),
    }
    for name, f in EDGES.items():
        sub = f.smallest_normal * f.eps
        ref[f"underflow_{name}"] = float(((a > 0) & (a < sub)).sum())
        ref[f"below_normal_{name}"] = float(((a > 0) & (a < f.smallest_normal)).sum())
        ref[f"overflow_{name}"] = float((a > f.max).sum())
    if np.isfinite(v).all():
        ref["mean"] = math.fsum(v) / v.size
        ref["std"] = math.sqrt(math.fsum((v - ref["mean"]) ** 2) / max(v.size - 1, 1))
    return ref


def fields(x: Tensor, host_reads: bool, groups=("moments", "range", "formats")) -> Dict[str, float]:
    rec = stats.assemble([stats.record_of(x, groups, host_reads)])[0]
    return {name: float(rec[i]) for i, name in enumerate(stats.FIELDS)}


def check_against_reference(x: Tensor, host_reads: bool) -> None:
    got, want = fields(x, host_reads), numpy_reference(x)
    for name in want:
        if name not in ("mean", "std"):
            same = got[name] == want[name] or (math.isnan(got[name]) and math.isnan(want[name]))
            assert same, (name, got[name], want[name])  # absmax is NaN with a NaN, as np.max
    std = float(stats.statistic(torch.tensor(list(got.values()), dtype=torch.float64), "std"))
    if "std" in want:  # finite: finite and within TOL, whatever the magnitudes
        assert abs(got["mean"] - want["mean"]) <= TOL * (abs(want["mean"]) + want["std"]), (got["mean"], want["mean"])
        assert abs(std - want["std"]) <= TOL * want["std"], (std, want["std"])
    else:  # as torch.mean in float64: inf for [inf, 1, 2], NaN with NaN or both infinities
        torch.testing.assert_close(got["mean"], float(x.double().mean()), equal_nan=True)
        assert math.isnan(std)


def sample(dtype: torch.dtype, n: int, offset: float, log2_std: int, specials: List[str], seed: int) -> Tensor:
    """``n`` values ``std * (randn + offset)`` in ``dtype`` with ``specials`` at random places."""
    g = torch.Generator().manual_seed(seed)
    x = ((torch.randn(n, generator=g, dtype=torch.float64) + offset) * 2.0**log2_std).to(dtype)
    info = torch.finfo(dtype)
    # float64: m2, a float64 itself, overflows for values above ~2**511 / sqrt(n)
    top = 2.0**500 if dtype == torch.float64 else info.max
    values = {
        "zero": 0.0,
        "subnormal": info.smallest_normal * info.eps * float(torch.randint(1, 64, (), generator=g)),
        "huge": top * (0.5 + 0.5 * float(torch.rand((), generator=g, dtype=torch.float64))),
        "inf": math.inf,
        "nan": math.nan,
    }
    for i, kind in enumerate(specials):
        sign = -1.0 if i % 2 else 1.0
        x[int(torch.randint(0, n, (), generator=g))] = sign * values[kind]
    return x


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 3000))
    offset = draw(st.sampled_from([0.0, 0.5, 3.0, 10.0, 1e2, 1e3, 1e4]))
    if dtype == torch.float16:  # keep std * (|offset| + 5) inside fp16's range
        log2_std = draw(st.integers(-10, 1))
    else:
        log2_std = draw(st.integers(-60, 60))
    specials = draw(st.lists(st.sampled_from(["zero", "subnormal", "huge", "inf", "nan"]), max_size=4))
    return sample(dtype, n, offset, log2_std, specials, draw(st.integers(0, 2**16)))


@settings(max_examples=150, deadline=None)
@given(tensors(), st.booleans())
def test_random_tensors_match_numpy_float64(x: Tensor, host_reads: bool) -> None:
    check_against_reference(x, host_reads)


@pytest.mark.parametrize(
    "dtype, n, offset, std",
    [
        (torch.float32, 16_000_000, 1e4, 1.0),
        (torch.bfloat16, 4 << 20, 9.5, 1.0),
        (torch.float16, 1 << 20, 0.0, 2.0**-12),
        # fp16 spacing at 1e4 is 8: nearly all values equal, the std rests on a few
        (torch.float16, 100_000, 1e4, 1.0),
        (torch.float64, 1 << 20, 1e3, 1.0),
    ],
)
def test_big_tensors_match_float64(dtype: torch.dtype, n: int, offset: float, std: float) -> None:
    g = torch.Generator().manual_seed(n)
    x = ((torch.randn(n, generator=g) + offset) * std).to(dtype)
    v = x.double()  # float64 pairwise sums: ~1e-15 here, a reference for 1e-6 (fsum is slow)
    mean = float(v.mean())
    want_std = math.sqrt(float((v - mean).square().sum()) / (n - 1))
    for host_reads in (True, False):
        got = fields(x, host_reads, ("moments",))
        std_got = float(stats.statistic(torch.tensor(list(got.values()), dtype=torch.float64), "std"))
        assert abs(got["mean"] - mean) <= TOL * (abs(mean) + want_std), host_reads
        assert abs(std_got - want_std) <= TOL * want_std, (host_reads, std_got, want_std)


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_finite_tensors_get_finite_accurate_std(dtype: torch.dtype, host_reads: bool) -> None:
    info = torch.finfo(dtype)
    top = info.max if dtype != torch.float64 else 2.0**500  # float64 m2 itself overflows above
    cases = {
        "near max": torch.tensor([top, -top, top / 2, top / 3], dtype=dtype),
        # float64: m2, a float64 itself, underflows below ~2**-511, so tiny rather than subnormal
        "all subnormal": (
            torch.arange(1, 101, dtype=torch.float64)
            * (2.0**-500 if dtype == torch.float64 else info.smallest_normal * info.eps)
        ).to(dtype),
    }
    for name, x in cases.items():
        std = float(stats.statistic(stats.assemble([stats.record_of(x, ("moments",), host_reads)]), "std")[0])
        assert math.isfinite(std) and std > 0, name
        check_against_reference(x, host_reads)


# ---------------------------------------------------------------------------------------
# FP8 what-if


def fp8_reference(x: Tensor, name: str) -> Dict[str, float]:
    """The documented quantisation redone element by element, what dequantising loses
    against x itself summed exactly (fsum)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = torch.nan_to_num(x.to(acc), nan=0.0, posinf=0.0, neginf=0.0)
    amax = xf.abs().max()
    # as documented: capped at the largest finite number (amax = 0, or a tiny amax)
    scale = min(
        torch.tensor(torch.finfo(FP8[name]).max, dtype=acc) / amax, torch.tensor(torch.finfo(acc).max, dtype=acc)
    )
    q = (xf * scale).to(FP8[name]).to(acc)
    s = float(scale)
    return {
        # (q - x s) / s: float64 q / s - x would round q / s, then cancel
        "sq_err": math.fsum(((q.double() - xf.double() * s) / s).numpy() ** 2),
        "sq": math.fsum(xf.double().numpy() ** 2),
        "flushed": float(((xf != 0) & (q == 0)).sum()),
    }


def fp8_record(x: Tensor, host_reads: bool) -> Tensor:
    return stats.assemble([stats.record_of(x, ("moments", "fp8"), host_reads)])[0]


@settings(max_examples=40, deadline=None)
@given(tensors(), st.booleans())
@example(
    torch.tensor([1.794e-10, 1.7556e150], dtype=torch.float64), False
)  # squares of scaled errors: float64 subnormals
def test_fp8_fields_match_a_float64_quantisation(x: Tensor, host_reads: bool) -> None:
    rec = fp8_record(x, host_reads)
    for name in FP8:
        want = fp8_reference(x, name)
        got = {k: float(rec[stats.FIELDS.index(f"fp8_{name}_{k}")]) for k in ("sq_err", "sq", "flushed")}
        assert got["flushed"] == want["flushed"]
        assert got["sq_err"] == pytest.approx(want["sq_err"], rel=1e-9, abs=0)
        assert got["sq"] == pytest.approx(want["sq"], rel=1e-9, abs=0)
        assert float(stats.statistic(rec, f"fp8_{name}_flushed")) == want["flushed"] / x.numel()


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
def test_fp8_snr_matches_dequantisation_error(host_reads: bool) -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 3
    rec = fp8_record(x, host_reads)
    for name in FP8:
        want = 10 * math.log10(float(x.double().square().sum()) / fp8_reference(x, name)["sq_err"])
        assert float(stats.statistic(rec, f"fp8_{name}_snr_db")) == pytest.approx(want, abs=1e-9)
    # 3 mantissa bits give ~31 dB on Gaussian data, 2 bits ~25 dB: E4M3 is the finer one
    e4m3, e5m2 = (float(stats.statistic(rec, f"fp8_{n}_snr_db")) for n in FP8)
    assert 28 < e4m3 < 34 and 22 < e5m2 < 28


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
def test_fp8_closed_forms(host_reads: bool) -> None:
    exact = torch.tensor([448.0, -1.0, 0.5, 0.0, 2.0**-6])  # every value an E4M3 number at scale 1
    rec = fp8_record(exact, host_reads)
    assert float(stats.statistic(rec, "fp8_e4m3_snr_db")) == math.inf
    assert float(stats.statistic(rec, "fp8_e4m3_flushed")) == 0.0
    # scale 448: 1e-9 * 448 is below half E4M3's smallest subnormal (2**-10): flushed
    rec = fp8_record(torch.tensor([1.0, 1e-9, 0.0, -1e-9]), host_reads)
    assert float(stats.statistic(rec, "fp8_e4m3_flushed")) == 0.5
    # zeros lose nothing; non-finite values are left out of the fp8 fields
    zeros = fp8_record(torch.zeros(7), host_reads)
    with_bad = fp8_record(torch.tensor([1.0, math.inf, 3.0, math.nan, -math.inf, 0.25]), host_reads)
    clean = fp8_record(torch.tensor([1.0, 0.0, 3.0, 0.0, 0.0, 0.25]), host_reads)
    fp8 = [stats.FIELDS.index(f) for f in stats.GROUPS["fp8"]]
    for name in FP8:
        assert float(stats.statistic(zeros, f"fp8_{name}_snr_db")) == math.inf
    torch.testing.assert_close(with_bad[fp8], clean[fp8], rtol=0, atol=0)


def test_fp8_merge_equals_concatenation_when_the_scale_is_shared() -> None:
    # Parts are quantised with their own amax; with a shared amax, merging their fields
    # gives exactly the fields of the concatenation.
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(n, generator=g) for n in (100, 1, 37)]
    for p in parts:
        p[0] = 5.0
    rows = stats.assemble([stats.record_of(p, ("moments", "fp8"), host_reads=False) for p in parts])
    merged, whole = stats.merge_rows(rows), fp8_record(torch.cat(parts), True)
    fp8 = [stats.FIELDS.index(f) for f in stats.GROUPS["fp8"]]
    torch.testing.assert_close(merged[fp8], whole[fp8], rtol=1e-12, atol=0)
    for name in FP8:
        for stat in ("snr_db", "flushed"):
            key = f"fp8_{name}_{stat}"
            assert float(stats.statistic(merged, key)) == pytest.approx(float(stats.statistic(whole, key)), rel=1e-12)


def test_fp8_widening_by_table_is_torchs_cast() -> None:
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)  # every bit pattern, NaNs included
    for dtype in FP8.values():
        q = codes.view(dtype)
        torch.testing.assert_close(fp8.widen(q), q.double(), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------
# Cost of the formats group on the device path


def test_format_counts_need_at_most_20_bytes_per_element() -> None:
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        reference.formats(x)
    # the peak of what is held: allocations and frees in the order they happened
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    assert 5 <= peak / x.numel() <= 20  # |x| (float32) and a mask at least


# ---------------------------------------------------------------------------------------
# The device path at the dispatcher: no host read, no data-dependent shape

# ops that read a value to the host or size their output by the data
HOST_SYNC_OPS = {
    "_local_scalar_dense",
    "bincount",
    "nonzero",
    "masked_select",
    "unique",
    "_unique2",
    "item",
    "is_nonzero",
    "equal",
    "allclose",
}


def test_device_path_dispatches_no_host_read_or_data_dependent_op() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(4)
    xs = [sample(dt, 600, 3.0, 0, ["zero", "subnormal", "huge", "inf", "nan"], seed=5) for dt in DTYPES]
    xs.append(torch.randn(3, 700, generator=g).t())  # non-contiguous
    with Ops() as ops:
        rows = [stats.record_of(x, ("moments", "range", "formats", "fp8"), host_reads=False) for x in xs]
        stats.merge_rows(stats.assemble(rows))
    assert {"amin", "sum", "lt"} <= ops.names  # the mode saw the work
    assert not ops.names & HOST_SYNC_OPS, ops.names & HOST_SYNC_OPS


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
def test_mean_with_infinities_is_torch_mean(host_reads: bool) -> None:
    for values, mean in (
        ([math.inf, 1.0, 2.0], math.inf),
        ([1.0, -math.inf], -math.inf),
        ([math.inf, -math.inf, 1.0], math.nan),
    ):
        got = fields(torch.tensor(values), host_reads)
        assert got["mean"] == mean or (math.isnan(mean) and math.isnan(got["mean"])), values
        assert math.isnan(got["m2"]) and got["inf"] == sum(math.isinf(v) for v in values)


def test_fp8_fields_by_chunks_equal_the_whole_tensor() -> None:
    """Big tensors are quantised a piece at a time against the whole tensor's amax: the
    same fields, up to float64 rounding, strided and sliced input included."""

    g = torch.Generator().manual_seed(8)
    x = torch.randn(300, 1001, generator=g) * 3
    x[0, 5], x[7, 9], x[299, 1000] = math.inf, math.nan, 1e-30
    for t in (x, x.t(), x.bfloat16(), x[:, 1:], x.t()[::2]):
        whole = torch.stack(fp8.fp8_fields_in_pieces(t, stats.sum64, t.numel()))
        chunked = torch.stack(fp8.fp8_fields_in_pieces(t, stats.sum64, 10_000))
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
