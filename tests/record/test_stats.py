"""stats: every statistic against an independent float64 reference, on both code paths."""

from __future__ import annotations

import math
import warnings
from typing import Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_scale.record import stats

ALL_GROUPS = ("moments", "range", "formats", "fp8", "blocks", "kurtosis")
# fp8 records merge as separately scaled parts (test_stats_property.py); these do not
MERGEABLE = ("moments", "range", "formats")
HOST_READS = pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])

# Format ranges derived from torch.finfo, independently of stats.FORMATS:
# smallest subnormal = smallest normal * machine epsilon (2**-mantissa_bits).
FINFO = {
    "fp16": torch.finfo(torch.float16),
    "bf16": torch.finfo(torch.bfloat16),
    "e4m3": torch.finfo(torch.float8_e4m3fn),
    "e5m2": torch.finfo(torch.float8_e5m2),
}
THRESHOLDS = {name: (f.smallest_normal * f.eps, f.smallest_normal, f.max) for name, f in FINFO.items()}


def reference(x: Tensor) -> Dict[str, float]:
    """Every statistic of ``x`` in float64, written out directly."""
    v = x.detach().to(torch.float64).flatten()
    n = v.numel()
    a = v.abs()
    nonzero = a[(a > 0) & ~torch.isnan(a)]
    out = {
        "count": float(n),
        "nan": float(torch.isnan(v).sum()),
        "inf": float(torch.isinf(v).sum()),
        "zeros": float((a == 0).sum()) / n,
        "min_nonzero": float(nonzero.min()) if nonzero.numel() else math.inf,
        "absmax": float(a.max()) if n else math.nan,
    }
    finite = bool(torch.isfinite(v).all())
    if finite:
        mean = float(v.sum()) / n
        out["mean"] = mean
        out["std"] = math.sqrt(float(((v - mean) ** 2).sum()) / max(n - 1, 1))
        out["rms"] = math.sqrt(float((v * v).sum()) / n)
    for name, (subnormal, normal, largest) in THRESHOLDS.items():
        out[f"underflow_{name}"] = float(((a > 0) & (a < subnormal)).sum()) / n
        out[f"below_normal_{name}"] = float(((a > 0) & (a < normal)).sum()) / n
        out[f"overflow_{name}"] = float((a > largest).sum()) / n  # inf > max: included
    return out


def record(x: Tensor, host_reads: bool, groups=ALL_GROUPS) -> Tensor:
    return stats.assemble([stats.record_of(x, groups, host_reads)])[0]


def measured(x: Tensor, host_reads: bool) -> Dict[str, float]:
    return stats.summarise(record(x, host_reads))


EXACT = ["count", "nan", "inf", "zeros", "min_nonzero"] + [
    f"{k}_{f}" for f in THRESHOLDS for k in ("underflow", "below_normal", "overflow")
]


def assert_matches(got: Dict[str, float], want: Dict[str, float], rel: float, names: List[str]) -> None:
    for name in names:
        if name in EXACT or name == "absmax":  # counts and extremes are exact
            assert got[name] == want[name], (name, got[name], want[name])
        else:
            assert got[name] == pytest.approx(want[name], rel=rel), name


def threshold_data(dtype: torch.dtype) -> Tensor:
    """Values on, just below and just above every format threshold, zeros, float32
    subnormals, and a spread of magnitudes from 2**-140 to 2**100, with both signs."""
    g = torch.Generator().manual_seed(0)
    edges = []
    for subnormal, normal, largest in THRESHOLDS.values():
        for t in (subnormal, normal, largest):
            t32 = torch.tensor(t, dtype=torch.float32)
            edges += [t32, torch.nextafter(t32, torch.tensor(0.0)), torch.nextafter(t32, torch.tensor(math.inf))]
    edges_t = torch.stack(edges)
    spread = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-140, 100, (2000,), generator=g).float())
    specials = torch.tensor([0.0, -0.0, 0.0, 1e-40, -1e-45, 2.0**-149, 3e-39])
    x = torch.cat([edges_t, -edges_t, spread, specials])
    x = x[torch.randperm(x.numel(), generator=g)]
    return x.to(dtype)


def test_format_ranges_match_finfo() -> None:
    for name, (subnormal, normal, largest) in THRESHOLDS.items():
        fmt = stats.FORMATS[name]
        assert (fmt.min_subnormal, fmt.min_normal, fmt.max) == (subnormal, normal, largest), name


@HOST_READS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (33, 65), (4, 3, 1000)])
def test_moments_and_range_match_float64_reference(host_reads: bool, dtype: torch.dtype, shape) -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 - 0.5).to(dtype)
    x.view(-1)[::5] = 0.0  # exact zeros for the zero fraction and min nonzero
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    assert_matches(
        measured(x, host_reads), reference(x), rel, ["count", "mean", "std", "rms", "absmax", "min_nonzero", "zeros"]
    )


@HOST_READS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_format_fractions_match_reference(host_reads: bool, dtype: torch.dtype) -> None:
    x = threshold_data(dtype)
    want = reference(x)
    if dtype in (torch.float32, torch.float64):  # the data really exercises each count
        assert all(want[f"underflow_{f}"] > 0 and want[f"overflow_{f}"] > 0 for f in THRESHOLDS)
    names = ["count", "zeros", "min_nonzero", "absmax"] + [n for n in EXACT if "_" in n and n != "min_nonzero"]
    assert_matches(measured(x, host_reads), want, 0.0, names)


@HOST_READS
def test_nan_and_inf_counts(host_reads: bool) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    x[[3, 50, 999]] = math.nan
    x[[10, 11]] = math.inf
    x[500] = -math.inf
    x[[7, 8]] = 0.0
    x[9] = 7e4  # overflows fp16, e4m3, e5m2 but not bf16
    got, want = measured(x, host_reads), reference(x)
    assert (got["nan"], got["inf"]) == (3.0, 3.0)
    assert got["overflow_fp16"] == pytest.approx(4 / 1000, abs=0)  # 3 infinities + 7e4
    assert got["overflow_bf16"] == pytest.approx(3 / 1000, abs=0)  # infinities only
    assert_matches(got, want, 0.0, [n for n in EXACT if n != "min_nonzero"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_paths_give_the_same_record(dtype: torch.dtype) -> None:
    for x in (threshold_data(dtype).float().clamp(-1e6, 1e6).to(dtype), torch.randn(5, 300).to(dtype)):
        host, device = record(x, True), record(x, False)
        assert_same_record(device, host, rel=1e-6)


@HOST_READS
def test_relu_of_standard_normal_matches_closed_form(host_reads: bool) -> None:
    # With n = 2**20 samples the relative standard error of each estimate is about
    # 1/sqrt(n) ~ 1e-3; a 1e-2 tolerance is ten standard errors.
    x = torch.relu(torch.randn(2**20, generator=torch.Generator().manual_seed(3)))
    got = measured(x, host_reads)
    assert got["std"] == pytest.approx(math.sqrt((1 - 1 / math.pi) / 2), rel=1e-2)
    assert got["mean"] == pytest.approx(1 / math.sqrt(2 * math.pi), rel=1e-2)
    assert got["rms"] == pytest.approx(math.sqrt(0.5), rel=1e-2)
    assert got["zeros"] == pytest.approx(0.5, rel=1e-2)


@HOST_READS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noise", [1e-3, 0.032, 0.3])
def test_std_is_accurate_when_mean_dominates(host_reads: bool, dtype: torch.dtype, noise: float) -> None:
    # x = 1 + noise * randn: |mean| / std is about 1000, 30 and 3.
    x = (1 + noise * torch.randn(2**16, generator=torch.Generator().manual_seed(4))).to(dtype)
    exact = float(x.double().std())
    assert measured(x, host_reads)["std"] == pytest.approx(exact, rel=1e-4)


def test_one_pass_float32_formula_would_fail_the_accuracy_test() -> None:
    # The one-pass float32 formula E[x^2] - E[x]^2 loses the digits that matter when
    # |mean| >> std: the tolerance of the test above catches an implementation using it.
    x = 1 + 1e-3 * torch.randn(2**16, generator=torch.Generator().manual_seed(4))
    exact = float(x.double().std())
    n = x.numel()
    naive = math.sqrt(max(float((x * x).mean() - x.mean() ** 2), 0.0) * n / (n - 1))
    assert abs(naive / exact - 1) > 10 * 1e-4


@HOST_READS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_accumulate_in_float32(host_reads: bool, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = (3 + torch.randn(2**16, generator=g)).to(dtype)
    want = reference(x)  # float64 of the very same half values
    assert_matches(measured(x, host_reads), want, 1e-5, ["count", "mean", "std", "rms", "absmax", "min_nonzero"])
    # Accumulating in the half type itself is far off: the tolerance above has teeth.
    half_mean = float(x.sum()) / x.numel()
    assert abs(half_mean / want["mean"] - 1) > 1e-4


@HOST_READS
@pytest.mark.parametrize("value", [0.0, 2.5, -1e-30])
def test_single_element_has_std_zero_without_warning(host_reads: bool, value: float) -> None:
    for x in (torch.tensor(value), torch.tensor([value])):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = measured(x, host_reads)
        assert got["std"] == 0.0
        assert got["count"] == 1.0 and got["mean"] == pytest.approx(value, rel=1e-6)
        assert got["rms"] == pytest.approx(abs(value), rel=1e-6)
        assert not any(math.isnan(v) for name, v in got.items() if name != "kurtosis")
        assert math.isnan(got["kurtosis"])  # (no spread: m4 / m2^2 is 0 / 0)


@HOST_READS
def test_empty_tensor(host_reads: bool) -> None:
    rec = record(torch.empty(0, 4), host_reads)
    assert stats.statistic(rec, "count") == 0
    assert stats.statistic(rec, "std") == 0 and stats.statistic(rec, "rms") == 0


def test_groups_not_computed_stay_nan_through_merges() -> None:
    a, b = torch.randn(10), torch.randn(20)
    ra, rb = record(a, True, ("moments",)), record(b, False, ("moments",))
    merged = stats.merge(ra, rb)
    assert math.isnan(float(stats.statistic(merged, "absmax")))
    assert math.isnan(float(stats.statistic(merged, "underflow_fp16")))
    assert float(stats.statistic(merged, "std")) == pytest.approx(float(torch.cat([a, b]).double().std()), rel=1e-6)


def test_unknown_statistic_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Unknown statistic 'variance'; choose from"):
        stats.statistic(torch.zeros(len(stats.FIELDS), dtype=torch.float64), "variance")


# ---------------------------------------------------------------------------------------
# Merging


def assert_same_record(got: Tensor, want: Tensor, rel: float = 1e-9) -> None:
    """Equal field by field: counts and extremes exactly, moments up to ``rel`` of scale."""
    ix = {name: i for i, name in enumerate(stats.FIELDS)}
    moments = [ix["mean"], ix["m2"]]
    sums = [ix[f"fp8_{f}_{k}"] for f in stats.FP8_DTYPES for k in ("sq_err", "sq")]
    sums += [ix[f] for f in stats.GROUPS["blocks"] if not f.endswith("flushed")]  # (float32 squares, added apart)
    sums += [ix["m4"]]  # (float64 sums about different centres)
    exact = [i for i in range(len(stats.FIELDS)) if i not in moments + sums + [ix["m3"]]]
    torch.testing.assert_close(got[..., exact], want[..., exact], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[..., sums], want[..., sums], rtol=rel, atol=0, equal_nan=True)
    scale = want[..., ix["m2"]].abs() + want[..., ix["count"]] * want[..., ix["mean"]] ** 2 + 1
    for i in moments:
        both_nan = got[..., i].isnan() & want[..., i].isnan()  # non-finite data: NaN on both
        close = (got[..., i] - want[..., i]).abs() <= rel * scale
        assert torch.all(close | both_nan), (stats.FIELDS[i], got[..., i], want[..., i])
    # m3 cancels (a sum of cubes of both signs): within ``rel`` of its scale, n std^3 of the
    # finite values (which the moments m3 and m4 are taken over), n^(1/4) m4^(3/4)
    n, m4 = want[..., ix["count"]], want[..., ix["m4"]]
    m3_scale = n**0.25 * m4.abs() ** 0.75 + 1e-300
    close = (got[..., ix["m3"]] - want[..., ix["m3"]]).abs() <= rel * m3_scale
    both_nan = got[..., ix["m3"]].isnan() & want[..., ix["m3"]].isnan()
    assert torch.all(close | both_nan), ("m3", got[..., ix["m3"]], want[..., ix["m3"]])


values = st.floats(-1e3, 1e3, allow_nan=False, width=64) | st.sampled_from([0.0, 1e-40, 7e4, -1e5])


@settings(max_examples=60, deadline=None)
@given(st.lists(values, max_size=25), st.lists(values, max_size=25), st.booleans())
def test_merge_equals_record_of_concatenation(a: List[float], b: List[float], host_reads: bool) -> None:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    merged = stats.merge(record(ta, host_reads, MERGEABLE), record(tb, not host_reads, MERGEABLE))
    assert_same_record(merged, record(torch.cat([ta, tb]), host_reads, MERGEABLE))


@pytest.mark.parametrize("sizes", [[5, 0, 1, 17, 3], [0, 0], [1], [0, 8, 0], [2, 2, 2, 2, 2, 2, 2]])
def test_merge_rows_equals_record_of_concatenation(sizes: List[int]) -> None:
    g = torch.Generator().manual_seed(6)
    parts = [torch.randn(n, generator=g, dtype=torch.float64) * 10 + 4 for n in sizes]
    rows = stats.assemble([stats.record_of(p, MERGEABLE) for p in parts])
    if not sum(sizes):  # nothing anywhere: zeros, as the recorder's record of a key never seen
        assert torch.equal(stats.merge_rows(rows), torch.zeros(len(stats.FIELDS), dtype=torch.float64))
        return
    assert_same_record(stats.merge_rows(rows), record(torch.cat(parts), True, MERGEABLE))
    # along another dim: [2, len(parts), FIELDS] -> [2, FIELDS]
    both = torch.stack([rows, rows.flip(0)])
    want = record(torch.cat(parts), True, MERGEABLE).expand(2, -1)
    assert_same_record(stats.merge_rows(both, dim=1), want)


# ---------------------------------------------------------------------------------------
# No host reads on the device-only path


@pytest.fixture
def no_host_reads(monkeypatch: pytest.MonkeyPatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a value was read to the host")

    def patch() -> None:
        for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, refuse)

    return patch


def test_device_path_reads_nothing_to_the_host(no_host_reads, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(7)
    # (clamped: float32 sums of values near float32's max overflow on both paths alike)
    xs = [
        torch.randn(64, 8, generator=g),
        threshold_data(torch.float32).clamp(-1e6, 1e6),
        torch.randn(100, generator=g).bfloat16(),
        torch.tensor(3.0),
    ]
    no_host_reads()
    with pytest.raises(AssertionError, match="read to the host"):
        float(xs[0].sum())  # the patch is in force
    rows = [stats.record_of(x, ALL_GROUPS, host_reads=False) for x in xs]
    assembled = stats.assemble(rows)
    merged = stats.merge_rows(assembled)
    monkeypatch.undo()
    for x, row in zip(xs, assembled):
        assert_same_record(row, record(x, True), rel=1e-6)
    assert float(stats.statistic(merged, "count")) == sum(x.numel() for x in xs)


# ---------------------------------------------------------------------------------------
# Host-path shortcuts: each gives exactly what the general path gives


def _format_fields(rec: Tensor) -> Tensor:
    return rec[stats.FIELDS.index("zeros") : stats.FIELDS.index("fp8_e4m3_sq_err")]


@pytest.mark.parametrize("n", [7, 1024, 1025, 70_000])
@pytest.mark.parametrize("kind", ["normal", "gradient", "with_zeros", "with_specials"])
def test_host_format_counts_equal_the_device_path(n: int, kind: str) -> None:
    # (short tensors: one sorted search; long ones: thresholds counted among the values
    # below the larger ones; the device path buckets every element: exact references)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * (1e-5 if kind == "gradient" else 1.0)
    if kind == "with_zeros":
        x[::3] = 0.0
    if kind == "with_specials":
        x[: min(n, 6)] = torch.tensor([7e4, 500.0, 2.0**-140, 1e-30, 6e-8, -3e38])[: min(n, 6)]
    host, device = record(x, True), record(x, False)
    torch.testing.assert_close(_format_fields(host), _format_fields(device), rtol=0, atol=0)
    assert float(host[stats.FIELDS.index("absmax")]) == float(x.abs().max())


@pytest.mark.parametrize("shape", [(64, 96), (3, 1000), (5, 7)])
def test_expanded_host_tensors_such_as_the_gradient_of_a_sum(shape) -> None:
    """A stride-0 tensor (``x.sum()``'s gradient is ``ones.expand(...)``) is read as its
    values: it recursed without end on the host path's sum of squares."""
    row = torch.randn(shape[-1], generator=torch.Generator().manual_seed(3))
    for x in (torch.full((1,), 3.0).expand(*shape), row.expand(*shape)):
        got, v = record(x, True), x.double()
        assert float(got[0]) == v.numel()
        assert float(got[1]) == pytest.approx(float(v.mean()), rel=1e-6, abs=1e-7)  # (abs: of the std, ~1)
        assert float(stats.statistic(got, "std")) == pytest.approx(float(v.std()), rel=1e-6, abs=1e-7)


@pytest.mark.parametrize("view", ["transposed", "permuted", "slice_of_fused", "tiny_values"])
def test_strided_host_tensors_are_read_in_place_without_change(view: str) -> None:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(16, 64, 384, generator=g) + 3.0  # mean-dominated: the shifted path too
    x = {
        "transposed": base[..., :128].transpose(1, 2),
        "permuted": base.view(16, 64, 12, 32).permute(0, 2, 1, 3),
        "slice_of_fused": base[..., 128:256],  # k of a fused qkv projection
        "tiny_values": (base * 1e-30).view(16, 64, 12, 32).transpose(1, 2),  # the scaled path
    }[view]
    before = x.clone()
    got, want = record(x, True), record(x.contiguous(), True)
    assert torch.equal(x, before)  # never written, though not a copy
    v = x.double()
    std = float(stats.statistic(got, "std"))
    assert abs(std / float(v.std()) - 1) < 1e-6 and abs(float(got[1]) / float(v.mean()) - 1) < 1e-6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)


@HOST_READS
def test_mean_with_an_infinity_beside_values_whose_float32_sum_overflows(host_reads: bool) -> None:
    x = torch.randn(162, generator=torch.Generator().manual_seed(1))
    x[[1, -1]], x[26] = 3.3182e38, -math.inf  # float32: 3.3e38 + 3.3e38 = inf, inf - inf = NaN
    got = measured(x, host_reads)
    assert got["mean"] == float(x.double().mean()) == -math.inf and got["inf"] == 1.0


@pytest.mark.parametrize("case", ["centred", "mean_dominated", "tiny", "float64", "with_inf"])
def test_contiguous_shortcut_equals_the_generic_path_bit_for_bit(case: str) -> None:
    # A contiguous tensor of whole 512-element rows takes host_moments' shortcut; the
    # same memory seen through a transpose takes the generic path (_dense lays it back
    # out, _sum_of_squares picks its kernels): the same sums, so the same record, in
    # every regime (fast formula, shifted, scaled, non-finite).
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 1024, generator=g)
    x = {
        "centred": x,
        "mean_dominated": x + 5.0,
        "tiny": x * 1e-30,
        "float64": x.double() + 2.0,
        "with_inf": x.index_fill(1, torch.tensor([3]), math.inf),
    }[case]
    generic = x.t()
    assert x.is_contiguous() and not generic.is_contiguous()
    # (not fp8: its float64 sums of the scaled error follow the memory order)
    torch.testing.assert_close(
        record(x, True, MERGEABLE), record(generic, True, MERGEABLE), rtol=0, atol=0, equal_nan=True
    )


def test_the_field_table_derives_fields_groups_and_merge_columns() -> None:
    """One table names each field, its group and its reduction: the record layout, the
    groups and the merges' columns (the pool's wire layout) follow from it."""
    from lightning_scale.record.stats import fields

    assert stats.FIELDS == tuple(f.name for f in stats.TABLE)
    assert stats.FIELDS[:8] == ("count", "mean", "m2", "absmax", "nan", "inf", "zeros", "min_nonzero")
    assert stats.GROUPS["moments"] == ("count", "mean", "m2", "nan", "inf")
    assert stats.GROUPS["formats"][:2] == ("zeros", "min_nonzero") and stats.GROUPS["fp8"] == stats.FP8_FIELDS
    assert {f.merge for f in stats.TABLE} == {"sum", "max", "min", "moment"}
    assert stats.EXTREMES == ("absmax", "neg_min_nonzero", "absmax_nan", "min_nonzero_nan", "mean_hi", "neg_mean_lo")
    assert stats.SUMS[-1] == "shifted_total" and set(stats.SUMS[:-1]) == {
        f.name for f in stats.TABLE if f.merge == "sum"
    }
    assert [stats.FIELDS[i] for i in stats.additive_fields()] == list(stats.SUMS[:-1])
    assert stats.merge_widths() == (len(stats.SUMS), len(stats.EXTREMES))
    # moments only: the means' extremes and the count, nan, inf sums travel
    moments = stats.GROUPS["moments"]
    assert [stats.EXTREMES[c] for c in stats.extreme_columns(moments)] == ["mean_hi", "neg_mean_lo"]
    assert [stats.SUMS[c] for c in stats.sum_columns(moments)] == ["count", "nan", "inf", "shifted_total"]
    assert stats.FIELDS[fields.FORMAT_COUNTS_SPAN] == stats.FORMAT_FIELDS
    with pytest.raises(ValueError, match="`names` must be neighbouring fields in record order"):
        fields.span(("count", "m2"))


def test_merge_extremes_columns_are_named() -> None:
    rec = torch.zeros(2, len(stats.FIELDS), dtype=torch.float64)
    rec[:, stats.Col.COUNT] = 3.0
    rec[:, stats.Col.MEAN] = torch.tensor([1.5, -2.0], dtype=torch.float64)
    rec[:, stats.Col.ABSMAX] = torch.tensor([4.0, math.nan], dtype=torch.float64)
    rec[:, stats.Col.MIN_NONZERO] = 0.25
    ext = dict(zip(stats.EXTREMES, stats.merge_extremes(rec).amax(0).tolist()))
    assert ext == {
        "absmax": 4.0,
        "neg_min_nonzero": -0.25,
        "absmax_nan": 1.0,
        "min_nonzero_nan": 0.0,
        "mean_hi": 1.5,
        "neg_mean_lo": 2.0,
    }
    merged = stats.merge_rows(rec)
    assert math.isnan(float(merged[stats.Col.ABSMAX])) and float(merged[stats.Col.MIN_NONZERO]) == 0.25
    assert float(merged[stats.Col.MEAN]) == -0.25 and float(merged[stats.Col.COUNT]) == 6.0
