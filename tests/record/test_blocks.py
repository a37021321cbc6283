"""The block-scaled what-ifs (record/stats/blocks.py) against torchao's emulated casts, element
for element, and their record sums against float64 closed forms of torchao's dequantized tensors."""

from __future__ import annotations

import math
import warnings
from typing import Callable, Dict

import pytest
import torch
from torch import Tensor

from lightning_scale.record.stats.blocks import (
    ALIGN,
    BLOCK_FIELDS,
    BLOCK_FORMATS,
    CHUNK,
    block_fields,
    dequantized,
    row_pieces,
)

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

MX_DTYPES = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp4": torch.float4_e2m1fn_x2}
FORMATS = list(BLOCK_FORMATS)
#: Rounding of float32 sums of squares (exact errors, summed pairwise): SNRs good to ~4e-6 dB.
F32 = 1e-6


def torchao_dequantized(x: Tensor, fmt: str) -> Tensor:
    """torchao's emulated cast and back, of ``x`` zero-padded along its last dimension to whole blocks."""
    block = BLOCK_FORMATS[fmt].block
    k = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -k % block)).contiguous()
    if fmt == "nvfp4":
        out = NVFP4Tensor.to_nvfp4(padded).dequantize(torch.float32)
    else:
        out = MXTensor.to_mx(padded, MX_DTYPES[fmt], block).dequantize(torch.float32)
    return out[..., :k]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _with_specials(shape: tuple) -> Tensor:
    x = torch.randn(shape, generator=_gen(5))
    flat = x.view(-1)
    n = flat.numel()
    flat[3], flat[40 % n], flat[57 % n], flat[100 % n] = math.nan, math.inf, -math.inf, math.nan
    return x


def _zero_blocks(shape: tuple) -> Tensor:
    x = torch.randn(shape, generator=_gen(6))
    x[..., :32] = 0  # whole zero blocks in every format
    x[0] = 0  # and whole zero rows
    return x


CASES: Dict[str, Callable[[tuple], Tensor]] = {
    "gaussian": lambda s: torch.randn(s, generator=_gen(0)) * 3,
    "student_t": lambda s: torch.distributions.StudentT(torch.tensor(1.5)).sample(s),
    "lognormal": lambda s: torch.exp(torch.randn(s, generator=_gen(1)) * 6) * torch.randn(s, generator=_gen(2)).sign(),
    "subnormal": lambda s: torch.randn(s, generator=_gen(3)) * 2.0**-130,  # float32 subnormals
    "tiny": lambda s: torch.randn(s, generator=_gen(4)) * 2.0**-121,  # E8M0 scale 0: torchao's 2^-126 divisor
    "huge": lambda s: torch.randn(s, generator=_gen(7)) * 1e38,  # near float32's max
    "zero_blocks": _zero_blocks,
    "non_finite": _with_specials,
}
SHAPES = [(8, 64), (2, 3, 96), (5, 70), (4, 17)]  # 70 and 17: not whole blocks, zero-padded


def assert_same(got: Tensor, want: Tensor) -> None:
    """Equal element for element: NaN where the other is NaN, the same value (Inf included) elsewhere."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.isnan(), want.isnan())
    keep = ~got.isnan()
    assert torch.equal(got[keep], want[keep]), (got[keep] != want[keep]).sum()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_casts_equal_torchaos_element_for_element(fmt: str, shape: tuple, case: str) -> None:
    torch.manual_seed(0)
    x = CASES[case](shape)
    assert_same(dequantized(x, fmt), torchao_dequantized(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_tensors_cast_as_torchao_casts_them(fmt: str) -> None:
    x = (torch.randn(6, 64, generator=_gen(8)) * 50).bfloat16()
    assert_same(dequantized(x, fmt), torchao_dequantized(x, fmt))


def test_every_nonzero_e2m1_value_and_tie_rounds_to_nearest_even() -> None:
    """In one MXFP4 block with amax 6 (scale 1): the E2M1 grid is exact and each midpoint goes
    to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    values = [6.0, 0.5, 1, 1.5, 2, 3, 4, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 5.5, 0.1]
    x = torch.tensor(values + [0.0] * (32 - len(values))).view(1, 32)
    want = [6.0, 0.5, 1, 1.5, 2, 3, 4, 0, 1, 1, 2, 2, 4, 4, 6, 0] + [0.0] * 16
    assert dequantized(x, "mxfp4").view(-1).tolist() == want
    assert_same(dequantized(x, "mxfp4"), torchao_dequantized(x, "mxfp4"))


def test_nvfp4_scales_by_a_rounded_reciprocal_as_torchao_does() -> None:
    """Blocks whose E4M3 scale ``s`` is exact (amax 6 s) and whose elements sit on E2M1 midpoints
    times ``s``: ``x * (1 / s)`` lands beside a midpoint where ``x / s`` lands on it, and rounds
    the other way for some ``s``."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = e4m3[(e4m3 > 0.02) & (e4m3 < 400)].unique()
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.zeros(len(scales), 16)
    x[:, 0] = 6 * scales
    x[:, 1:8] = mids * scales[:, None]
    got = dequantized(x, "nvfp4")
    assert_same(got, torchao_dequantized(x, "nvfp4"))
    exact_division = (x[:, 1:8] / scales[:, None]).clamp(-6, 6)
    assert not torch.equal(got[:, 1:8], dequantized(exact_division, "mxfp4") * scales[:, None])


def reference_fields(x: Tensor) -> Dict[str, float]:
    """``BLOCK_FIELDS`` in float64 from torchao's casts of ``x`` with non-finite values zeroed."""
    finite = torch.nan_to_num(x.float(), 0.0, 0.0, 0.0)
    x64 = torch.nan_to_num(x.double(), 0.0, 0.0, 0.0)
    out: Dict[str, float] = {}
    for fmt in FORMATS:
        q = torchao_dequantized(finite, fmt).double()
        out[f"{fmt}_sq_err"] = math.fsum(((q - x64) ** 2).flatten().tolist())
        out[f"{fmt}_sq"] = math.fsum((x64**2).flatten().tolist())
        out[f"{fmt}_flushed"] = float(((x64 != 0) & (q == 0)).sum())
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_record_sums_equal_float64_closed_forms_of_torchaos_casts(case: str) -> None:
    x = CASES[case]((12, 70))
    got = dict(zip(BLOCK_FIELDS, (float(v) for v in block_fields(x))))
    want = reference_fields(x)
    assert got.keys() == want.keys()
    for name in BLOCK_FIELDS:  # (float32 sums of exact float32 errors)
        assert got[name] == pytest.approx(want[name], rel=F32, abs=0), name


def test_the_what_if_loses_what_each_format_should_on_gaussians() -> None:
    """On 3 N(0, 1): about 30 dB for MXFP8 E4M3, 25 dB for E5M2, 19-20 dB for the FP4 formats
    (FACTS.md); no Gaussian element flushes in MXFP8, and a few in FP4 (below a quarter of the
    least E2M1 step)."""
    x = torch.randn(256, 256, generator=_gen(9)) * 3
    f = dict(zip(BLOCK_FIELDS, (float(v) for v in block_fields(x))))
    snr = {fmt: 10 * math.log10(f[f"{fmt}_sq"] / f[f"{fmt}_sq_err"]) for fmt in FORMATS}
    assert 29 < snr["mxfp8_e4m3"] < 33 and 23 < snr["mxfp8_e5m2"] < 27
    assert 17 < snr["mxfp4"] < 21 and 18 < snr["nvfp4"] < 22 and snr["nvfp4"] > snr["mxfp4"]
    assert f["mxfp8_e4m3_flushed"] == 0 and f["mxfp8_e5m2_flushed"] == 0
    assert 0 < f["mxfp4_flushed"] / x.numel() < 0.1 and 0 < f["nvfp4_flushed"] / x.numel() < 0.1


def test_non_finite_values_are_left_out_and_do_not_poison_their_block() -> None:
    x = _with_specials((6, 64))
    assert torch.equal(torch.stack(block_fields(x)), torch.stack(block_fields(torch.nan_to_num(x, 0.0, 0.0, 0.0))))
    assert all(math.isfinite(float(v)) for v in block_fields(x))


def test_chunks_of_rows_add_up_to_the_whole() -> None:
    x = torch.distributions.StudentT(torch.tensor(2.0)).sample((37, 70))
    whole = torch.stack(block_fields(x))
    for chunk in (1, 70, 500):  # a row at a time, one row, several rows and a remainder
        assert torch.allclose(torch.stack(block_fields(x, chunk=chunk)), whole, rtol=F32, atol=0)


def test_sums_add_over_tensors() -> None:
    a, b = torch.randn(8, 64, generator=_gen(10)), torch.randn(3, 64, generator=_gen(11)) * 100
    both = torch.stack(block_fields(torch.cat([a, b])))
    assert torch.allclose(torch.stack(block_fields(a)) + torch.stack(block_fields(b)), both, rtol=F32, atol=0)


def test_float64_and_half_tensors() -> None:
    """float64: cast from float32 (finite values beyond its range taken as its largest), the error
    against the float64 values; float16: exact in float32."""
    x = torch.randn(4, 64, generator=_gen(12), dtype=torch.float64)
    x[0, 0] = 1e300
    want = reference_fields(x.clamp(max=torch.finfo(torch.float32).max).float())
    got = dict(zip(BLOCK_FIELDS, (float(v) for v in block_fields(x))))
    for fmt in FORMATS:  # the float64 values' own squares and errors (x != its float32 rounding)
        q = torchao_dequantized(x.clamp(max=torch.finfo(torch.float32).max).float(), fmt).double()
        assert got[f"{fmt}_sq_err"] == pytest.approx(math.fsum(((q - x) ** 2).flatten().tolist()), rel=1e-12)
        assert got[f"{fmt}_flushed"] == want[f"{fmt}_flushed"]
    h = torch.randn(4, 64, generator=_gen(13)).half()
    assert torch.equal(torch.stack(block_fields(h)), torch.stack(block_fields(h.float())))


def test_scalars_and_empty_tensors() -> None:
    assert [float(v) for v in block_fields(torch.tensor(3.0))] == [float(v) for v in block_fields(torch.tensor([3.0]))]
    assert all(float(v) == 0 for v in block_fields(torch.empty(0, 64)))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"`fmt` must be one of \['mxfp4', .*got 'mxfp6'"):
        dequantized(torch.ones(32), "mxfp6")
    with pytest.raises(ValueError, match="`x` must have at least one dimension"):
        dequantized(torch.tensor(1.0), "nvfp4")


@pytest.mark.parametrize("size", [1, 40, 100, 1000, 10**6])
def test_row_pieces_cover_every_element_once_without_cutting_a_block(size: int) -> None:
    base = torch.arange(6 * 5 * 70, dtype=torch.float32).view(6, 5, 70)
    for x in (base, base.transpose(0, 1), base[:, :, :50], base.permute(2, 0, 1), base[0, 0], torch.tensor(7.0)):
        seen = []
        for part, j in row_pieces(x, size):
            assert part.dim() == 2 and j % ALIGN == 0
            assert part.numel() <= max(size, ALIGN)
            k = x.shape[-1] if x.dim() else 1
            assert part.shape[1] == k or part.shape[1] % ALIGN == 0 or j + part.shape[1] == k
            if x.dim():  # views of x's storage, not copies
                assert part.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            seen.append(part.reshape(-1))
        assert sorted(torch.cat(seen).tolist()) == sorted(x.reshape(-1).tolist())


def test_strided_tensors_and_split_rows_give_the_sums_of_the_contiguous_copy() -> None:
    x = torch.distributions.StudentT(torch.tensor(2.0)).sample((40, 3, 100)).transpose(0, 2)  # (100, 3, 40)
    want = torch.stack(block_fields(x.contiguous()))
    for chunk in (ALIGN, 64, 1000, CHUNK):  # columns split at 32 (blocks kept whole), rows, the whole
        assert torch.allclose(torch.stack(block_fields(x, chunk=chunk)), want, rtol=F32, atol=0)
