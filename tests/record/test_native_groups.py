"""The native kernel's block what-ifs (``native.blocks``, ``native.block_casts``) against the
reference (record/stats/blocks.py, itself tested equal to torchao's casts): the casts bit for
bit, the flushed counts exactly, the sums of squares to float32 rounding, on the reference
tests' cases; its central moments (``native.moments``, the kurtosis group) against float64;
the layouts the kernel declines; ``record_of`` taking both on the host path; and its channel
maxima (``native.channel_maxima``, the channels group) equal to the torch code's."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_scale.record import native, stats
from lightning_scale.record.stats.channels import channel_maxima
from lightning_scale.record.stats.blocks import BLOCK_FIELDS, BLOCK_FORMATS, block_fields, dequantized
from lightning_scale.record.stats.fields import BLOCKS_SPAN, Col
from lightning_scale.record.stats.outliers import moments_row

from test_blocks import CASES, _gen

#: The kernel adds exact float32 errors' squares in float64, the reference in float32.
F32 = 1e-6
SHAPES = [(8, 64), (2, 3, 96), (5, 70), (4, 17), (5, 1)]  # 70, 17, 1: the last block zero-padded


@pytest.fixture(autouse=True)
def kernels():
    k = native.load()
    if k is None:
        pytest.skip(native.status())
    return k


def _reference_casts(x: Tensor) -> Tensor:
    """``dequantized`` of the finite values, padded to whole 32-blocks, in ``block_casts``'s layout."""
    finite = torch.nan_to_num(x.float(), 0.0, 0.0, 0.0)
    k = x.shape[-1]
    per_format = []
    for fmt in BLOCK_FORMATS:
        q = torch.nn.functional.pad(dequantized(finite, fmt).reshape(-1, k), (0, -k % 32))
        per_format.append(q.view(q.shape[0], -1, 32))
    return torch.stack(per_format, dim=2)  # (rows, blocks, 4, 32)


def assert_sums_match(got, x: Tensor) -> None:
    want = torch.stack(block_fields(x)).tolist()
    for name, g, w in zip(BLOCK_FIELDS, list(got), want):
        if name.endswith("flushed"):
            assert g == w, name
        else:
            assert g == pytest.approx(w, rel=F32, abs=0), name


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", SHAPES)
def test_the_casts_equal_the_reference_bit_for_bit(shape: tuple, case: str) -> None:
    x = CASES[case](shape)
    got, want = native.block_casts(x), _reference_casts(x)
    assert got is not None
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # (-0.0 and 0.0 apart too)
    assert_sums_match(native.blocks(x), x)


def test_bfloat16_and_strided_rows() -> None:
    x = torch.randn(6, 200, generator=_gen(8)) * 50
    for t in (x.bfloat16(), x[:, 3:131], x[::2, :96]):  # (q of a fused projection: rows in wider rows)
        assert torch.equal(native.block_casts(t).view(torch.int32), _reference_casts(t).view(torch.int32))
        assert_sums_match(native.blocks(t), t)


def test_every_e4m3_e5m2_and_e2m1_rounding_tie_and_saturation() -> None:
    # One block per row whose max fixes the scale at 2^0 for E4M3 (max 256 -> exponent 8 - 8),
    # the rest of the row sweeping float32 values densely across the grid, ties included.
    sweep = torch.linspace(-300.0, 300.0, 31 * 2001)
    halves = torch.arange(-2400, 2401, dtype=torch.float32) / 8  # every E4M3 tie in [-300, 300]
    body = torch.cat([sweep, halves, halves / 64, halves / 4096])
    body = torch.nn.functional.pad(body, (0, -body.numel() % 31)).view(-1, 31)
    x = torch.cat([torch.full((body.shape[0], 1), 256.0), body], dim=1)
    assert torch.equal(native.block_casts(x).view(torch.int32), _reference_casts(x).view(torch.int32))
    assert_sums_match(native.blocks(x), x)


def test_layouts_and_dtypes_it_declines_fall_back_to_the_reference() -> None:
    x = torch.randn(64, 96, generator=_gen(9))
    assert native.blocks(x.t()) is None  # (blocks run along the last dimension: not contiguous there)
    assert native.blocks(x.double()) is None and native.blocks(x.half()) is None
    assert native.blocks(torch.empty(0, 32)) is None
    assert native.blocks(x.view(-1)[::2]) is None
    for t in (x.t(), x.double(), x.half()):
        rec = stats.record_of(t, ("moments", "blocks"))
        assert rec[BLOCKS_SPAN] == [float(v) for v in block_fields(t)]


def test_record_of_takes_the_kernel_on_the_host_path() -> None:
    x = torch.distributions.StudentT(torch.tensor(2.0)).sample((128, 160))
    x[3, 5] = float("nan")
    rec = stats.record_of(x, ("moments", "blocks"))
    assert_sums_match(rec[BLOCKS_SPAN], x)
    with native.switched_off():
        ref = stats.record_of(x, ("moments", "blocks"))
    assert ref[BLOCKS_SPAN] == [float(v) for v in block_fields(x)]
    assert_sums_match(rec[BLOCKS_SPAN], x)
    one = stats.record_of(torch.tensor(3.0), ("moments", "blocks"))  # (0-dim: one row of one element)
    assert one[BLOCKS_SPAN] == [float(v) for v in block_fields(torch.tensor([3.0]))]


def test_head_views_are_rows_in_another_order() -> None:
    qkv = torch.randn(4, 64, 3 * 128, generator=_gen(10))  # (B, T, 3 C) of a fused projection
    q = qkv[..., :128].view(4, 64, 4, 32).transpose(1, 2)  # (B, H, T, D): outer strides out of order
    assert native.blocks(q) is not None
    assert torch.equal(native.block_casts(q).sum((0, 1)), native.block_casts(q.contiguous()).sum((0, 1)))
    assert_sums_match(native.blocks(q), q.contiguous())
    total, sq, _ = native.sums(q)
    assert total == pytest.approx(float(q.double().sum()), abs=1e-9 * float(q.abs().sum()))
    assert sq == pytest.approx(float(q.double().square().sum()), rel=1e-6)


def _float64_moments(x: Tensor) -> list:
    v = x.double().flatten()
    v = v[v.isfinite()]
    d = v - v.mean()
    return [float(v.numel()), float(v.mean()), *(float((d**k).sum()) for k in (2, 3, 4))]


MOMENT_CASES = {
    "gaussian": lambda: torch.randn(300, 77, generator=_gen(11)),
    "mean_dominated": lambda: torch.randn(5000, generator=_gen(12)) * 0.01 + 1e4,  # |mean| = 1e6 std
    "student_t": lambda: torch.distributions.StudentT(torch.tensor(3.0)).sample((64, 200)),
    "subnormal": lambda: torch.randn(4100, generator=_gen(13)) * 2.0**-135,
    "huge": lambda: torch.randn(3000, generator=_gen(14)) * 1e37,
    "zeros": lambda: torch.zeros(2000),
    "non_finite": lambda: CASES["non_finite"]((40, 70)),
    "bfloat16": lambda: (torch.randn(50, 96, generator=_gen(15)) * 3 + 1).bfloat16(),
    "strided": lambda: torch.randn(96, 64, generator=_gen(16)).t(),
    "tail": lambda: torch.randn(1031, generator=_gen(17)) + 2,  # (a chunk of 1024, then 7)
}


@pytest.mark.parametrize("centre", ["none", "mean", "off"])
@pytest.mark.parametrize("case", list(MOMENT_CASES))
def test_central_moments_equal_float64(case: str, centre: str) -> None:
    x = MOMENT_CASES[case]()
    v = x.double().flatten()
    spread = float((v[v.isfinite()] - v[v.isfinite()].mean()).abs().max()) if v.isfinite().any() else 0.0
    # no centre: each chunk's mean; the float32 mean, as the first read gives it; one off by half the spread
    c = {"none": None, "mean": float(v[v.isfinite()].float().mean()), "off": float(v[v.isfinite()].mean()) + spread / 2}
    got, want = native.moments(x, c[centre]).tolist(), _float64_moments(x)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], rel=1e-12, abs=1e-12 * spread)
    for k, (g, w) in enumerate(zip(got[2:], want[2:]), start=2):  # (M3 cancels: within its scale)
        assert abs(g - w) <= 1e-9 * spread**k * want[0], (k, g, w)
    if want[2] > 0:  # kurtosis within 1e-6
        assert got[4] * got[0] / got[2] ** 2 == pytest.approx(want[4] * want[0] / want[2] ** 2, rel=1e-6)
    ref = moments_row(x).tolist()  # (and the torch code the host path took before)
    assert got[3] == pytest.approx(ref[3], rel=1e-5, abs=1e-5 * spread**3 * want[0])
    assert got[4] == pytest.approx(ref[4], rel=1e-5)


def test_record_of_takes_the_moments_kernel_for_kurtosis(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(200, 130, generator=_gen(18)) * 2 + 5
    reads = []
    counted = native.moments
    monkeypatch.setattr(native, "moments", lambda *a: reads.append(1) or counted(*a))
    rec = stats.record_of(x, ("moments", "kurtosis"))
    monkeypatch.setattr(native, "moments", counted)
    assert len(reads) == 1, "one central-moments read gives m2, m3 and m4"
    want = _float64_moments(x)
    # (|mean| / std = 2.5: the first read's sums are not trusted for m2; a second read about
    # their mean gives the moments, m3 and m4 included: no third read for the kurtosis)
    total, sumsq, _ = native.sums(x)
    second = native.moments(x, total / x.numel()).tolist()
    assert [rec[Col.MEAN], rec[Col.M2], rec[Col.M3], rec[Col.M4]] == second[1:]
    assert rec[Col.M2] == pytest.approx(want[2], rel=1e-12)
    centred = torch.randn(200, 130, generator=_gen(19))  # (trusted: about the first read's mean)
    rec2 = stats.record_of(centred, ("moments", "kurtosis"))
    assert [rec2[Col.M3], rec2[Col.M4]] == native.moments(centred, rec2[Col.MEAN]).tolist()[3:]
    assert float(stats.statistic(stats.assemble([rec]), "kurtosis")[0]) == pytest.approx(
        want[4] * want[0] / want[2] ** 2, rel=1e-6
    )
    assert native.moments(x.double()) is None and native.moments(torch.empty(0)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_channel_maxima_equal_the_torch_code(dtype: torch.dtype) -> None:
    x = (torch.distributions.StudentT(torch.tensor(2.0)).sample((6, 33, 131)) * 50).to(dtype)  # (131: a tail of 3)
    x[1, 2, 3], x[2, 2, 5], x[..., 7] = float("nan"), -float("inf"), float("nan")  # (channel 7: no finite value)
    x[0, 3, 7] = float("inf")
    x[4, 5, 9] = 2.0**-140 if dtype == torch.float32 else 0.0
    heads = x[..., :128].reshape(6, 33, 4, 32).transpose(1, 2)  # (B, H, T, D) of a fused projection's slice
    for t in (x, x[..., 3:20], x[2:5, :, :64], x.view(-1, 131)[::3], heads, x[:, 3:20], x.transpose(0, 1)):
        got = native.channel_maxima(t)
        with native.switched_off():
            want = channel_maxima(t)
        assert got is not None and got.dtype == torch.float64
        assert torch.equal(got, want)
        assert torch.equal(channel_maxima(t), want)  # (and the channels group takes it)
    assert native.channel_maxima(x)[7] == 0 and native.channel_maxima(x)[3] > 0
    for t in (heads[:, :3, 5:], x[..., ::2], x.double(), x[0, 0]):  # (three levels; strided channels; float64; 1-D)
        assert native.channel_maxima(t) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_dominated_and_tiny_tensors_take_a_second_native_read_not_the_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LayerNorm weights near 1, a large offset, values near float32's smallest normal: the
    one-read m2 is not trusted; a second read about its mean gives float64-exact moments."""
    from lightning_scale.record.stats import host, reference

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the reference was asked")

    monkeypatch.setattr(reference, "columns", refused)
    cases = {
        "layer norm weight": 1 + 1e-3 * torch.randn(128, generator=_gen(30)),
        "offset": 1000 + torch.randn(64, 70, generator=_gen(31)),
        "tiny": 1e-25 * torch.randn(1000, generator=_gen(32)),
        "constant": torch.full((300,), 3.0),
    }
    for name, x in cases.items():
        x = x.to(dtype)
        want = _float64_moments(x)
        rec = stats.record_of(x, ("moments",))
        for mean, m2 in (host.one_read_moments(x, True)[:2], (rec[Col.MEAN], rec[Col.M2])):
            assert mean == pytest.approx(want[1], rel=1e-12, abs=1e-300), name
            assert m2 == pytest.approx(want[2], rel=1e-9, abs=1e-300), name
