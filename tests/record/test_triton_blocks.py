"""The block what-ifs and kurtosis' moments in the fused Triton kernel, under Triton's interpreter.

The kernel's ``blocks`` sums (MXFP8 E4M3/E5M2, MXFP4, NVFP4: squared error, squares,
flushed count) are compared with the torch code's (``stats.blocks.block_fields``, itself
equal to torchao's emulated casts element for element, tests/record/test_blocks.py):
flushed counts exactly, sums to float32 rounding. m3 and m4 are compared with float64
central moments, kurtosis within 1e-6. Tensors stay small: each
interpreted tile costs a few hundred numpy calls.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_scale import Recorder, stats
from lightning_scale.record import kernels
from lightning_scale.record.stats.blocks import BLOCK_FIELDS, BLOCK_FORMATS, block_fields
from lightning_scale.tools.op_count import OpCounter

triton = pytest.importorskip("triton", reason='the fused kernel needs triton (`pip install "lightning-scale[test]"`)')
from lightning_scale.record import triton_stats  # noqa: E402 - after the skip

pytestmark = [
    pytest.mark.skipif(
        not triton_stats.interpreted(), reason="TRITON_INTERPRET=1 was not set before triton was imported"
    ),
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),  # numpy in the interpreter: inf/NaN lanes
]

EVERY = ("moments", "range", "formats", "fp8", "blocks", "kurtosis")
BLOCK_COLS = [stats.IX[f] for f in BLOCK_FIELDS]
FLUSHED = [stats.IX[f] for f in BLOCK_FIELDS if f.endswith("_flushed")]
SUMS = [stats.IX[f] for f in BLOCK_FIELDS if not f.endswith("_flushed")]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _non_finite(shape: tuple) -> Tensor:
    x = torch.randn(shape, generator=_gen(5)) * 3
    flat = x.view(-1)
    n = flat.numel()
    flat[3], flat[40 % n], flat[57 % n], flat[100 % n] = math.nan, math.inf, -math.inf, math.nan
    return x


def _subnormal_heavy(shape: tuple) -> Tensor:
    x = torch.randn(shape, generator=_gen(3)) * 2.0**-130  # float32 subnormals ...
    x.view(-1)[::7] *= 2.0**12  # ... beside small normal ones in the same blocks
    return x


CASES: Dict[str, Callable[[tuple], Tensor]] = {
    "gaussian": lambda s: torch.randn(s, generator=_gen(0)) * 3,
    "heavy_tailed": lambda s: torch.exp(torch.randn(s, generator=_gen(1)) * 4) * torch.randn(s, generator=_gen(2)),
    "subnormal_heavy": _subnormal_heavy,
    "tiny": lambda s: torch.randn(s, generator=_gen(4)) * 2.0**-121,  # E8M0 scale 0 (2^-127)
    "huge": lambda s: torch.randn(s, generator=_gen(7)) * 1e38,  # near float32's max: saturated NVFP4 scales
    "non_finite": _non_finite,
}
SHAPES = [(6, 64), (2, 3, 70), (9, 17), (45,)]  # 70, 17 and 45: not whole blocks, zero-padded
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fused(x: Tensor, groups: Tuple[str, ...] = ("moments", "blocks", "kurtosis"), block: int = 65536) -> Tensor:
    row = torch.full((len(stats.FIELDS),), -7.0, dtype=torch.float64)
    left = triton_stats.record_into(x, groups, row, block=block)
    assert not left, left
    return row


def assert_blocks(got: Tensor, x: Tensor) -> None:
    """The kernel's block sums equal the torch code's: counts exactly, sums to float32 rounding."""
    want = torch.stack(block_fields(x))
    by_name = dict(zip(BLOCK_FIELDS, want.tolist()))
    assert got[FLUSHED].tolist() == [by_name[f] for f in BLOCK_FIELDS if f.endswith("_flushed")]
    sums = want[[i for i, f in enumerate(BLOCK_FIELDS) if not f.endswith("_flushed")]]
    # Within float32 rounding of the tensor's energy: where the torch code's float32 squares of
    # values below ~1e-23 underflow to 0, the kernel's (scaled by the tile's power of two) do not.
    energy = float(torch.nan_to_num(sums[1::2], nan=0.0, posinf=0.0).max())
    torch.testing.assert_close(got[SUMS], sums, rtol=2e-6, atol=1e-12 * energy)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("shape", SHAPES)
def test_block_sums_equal_the_torch_code(case: str, shape: tuple) -> None:
    x = CASES[case](shape)
    assert_blocks(fused(x), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tensors(dtype: torch.dtype) -> None:
    for case in ("gaussian", "heavy_tailed", "non_finite"):
        x = CASES[case]((5, 70)).clamp(-6e4, 6e4).to(dtype)
        assert_blocks(fused(x), x)


def test_ties_round_to_nearest_even_in_every_format() -> None:
    """Rows whose amax makes the block scale 1 (448, 57344, 6; NVFP4: 6 gives E4M3 scale 1),
    then midpoints of neighbouring element values: every one a tie."""

    def grid_ties(dtype: torch.dtype) -> Tensor:
        grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
        return (grid[1:] + grid[:-1]) / 2

    fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    rows = []
    for top, ties, block in (
        (448.0, grid_ties(torch.float8_e4m3fn), 32),
        (57344.0, grid_ties(torch.float8_e5m2), 32),
        (6.0, (fp4[1:] + fp4[:-1]) / 2, 16),
    ):
        ties = torch.cat([ties, -ties])
        for start in range(0, ties.numel(), block - 1):
            chunk = ties[start : start + block - 1]
            rows.append(
                torch.nn.functional.pad(torch.cat([torch.tensor([top]), chunk]), (0, block - 1 - chunk.numel()))
            )
    x = torch.stack([torch.nn.functional.pad(r, (0, 32 - r.numel())) for r in rows])
    got = fused(x)
    assert_blocks(got, x)
    assert got[stats.IX["mxfp4_flushed"]] > 0 and got[stats.IX["nvfp4_flushed"]] > 0  # 0.25 ties to 0


@pytest.mark.parametrize("shape", [(40, 100), (48, 96)])
def test_tiles_and_programs_merge(shape: tuple) -> None:
    """Tiles of 256 elements, more than the 16 programs (the grid-stride merge and the
    finishing merge both run): two 100-element rows a tile (128 columns, the last 28 masked;
    20 tiles), or 96-element rows read flat (whole blocks, rows across tiles; 18 tiles)."""
    x = torch.distributions.StudentT(torch.tensor(3.0)).sample(shape)
    got = fused(x, block=256)
    assert_blocks(got, x)
    assert_moments(got, x)


@pytest.mark.parametrize("layout", ["row_slice", "permuted_dense", "permuted_rows", "bf16_slice", "copied"])
def test_layouts_read_in_place_give_the_sums_of_the_contiguous_copy(layout: str) -> None:
    """Rows of a wider matrix (row stride 100, not 70), leading dimensions permuted (dense and
    a multiple of 32: read flat; 40 columns: rows of the last dimension, leading dimensions
    collapsed by stride), a bfloat16 slice, leading dimensions that collapse in no order (read
    from a contiguous copy, the blocks too): the same sums as the contiguous copy's."""
    g = _gen(12)
    if layout == "row_slice":
        x = torch.randn(9, 100, generator=g)[:, :70]
    elif layout == "permuted_dense":
        x = torch.randn(4, 6, 64, generator=g).permute(1, 0, 2)
    elif layout == "permuted_rows":
        x = torch.randn(3, 5, 40, generator=g).permute(1, 0, 2)
    elif layout == "bf16_slice":
        x = torch.randn(7, 48, generator=g).bfloat16()[:, 5:38]
    else:
        x = torch.randn(4, 6, 5, 40, generator=g)[:, :3, :4]  # (three strided dimensions)
    assert not x.is_contiguous()
    assert_blocks(fused(x), x.contiguous())


@given(
    st.sampled_from(DTYPES),
    st.integers(1, 40),
    st.integers(1, 130),
    st.integers(0, 2**31),
    st.sampled_from([1.0, 2.0**-140, 1e-42, 1e30, 0.7e38]),
    st.lists(st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e-45, 3e38, 6.0, 448.0]), max_size=5),
)
@settings(max_examples=25, deadline=None, derandomize=True)
def test_hard_tensors(dtype: torch.dtype, rows: int, cols: int, seed: int, scale: float, specials: list) -> None:
    """Any last dimension (1 to 130), scales from float32 subnormals to near its largest,
    NaN, ±Inf and values at the formats' edges dropped in: the torch code's sums."""
    big = float(torch.finfo(dtype).max)
    x = (torch.randn(rows, cols, generator=_gen(seed), dtype=torch.float64) * scale).clamp(-big, big)
    for i, v in enumerate(specials):
        x.view(-1)[(seed + 7919 * i) % x.numel()] = min(v, big)
    x = x.to(dtype)
    assert_blocks(fused(x), x)


def reference_moments(x: Tensor) -> Tuple[float, float, float, float]:
    d = x.detach().reshape(-1).double()
    d = d[d.isfinite()]
    c = d - d.mean()
    return float(d.numel()), float((c**2).sum()), float((c**3).sum()), float((c**4).sum())


def assert_moments(got: Tensor, x: Tensor) -> None:
    n, m2, m3, m4 = reference_moments(x)
    spread = math.sqrt(m2 / n)
    assert abs(float(got[stats.Col.M3]) - m3) <= 1e-5 * n * spread**3, (float(got[stats.Col.M3]), m3)
    assert abs(float(got[stats.Col.M4]) - m4) <= 1e-6 * m4, (float(got[stats.Col.M4]), m4)
    kurt = n * float(got[stats.Col.M4]) / (m2 * m2)
    assert abs(kurt - n * m4 / (m2 * m2)) <= 1e-6 * n * m4 / (m2 * m2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_kurtosis_moments_equal_float64(dtype: torch.dtype, offset: float) -> None:
    """Heavy tails, a mean 1000 standard deviations away from 0, 12 tiles merged by the finishing kernel."""
    g = _gen(11)
    x = (torch.randn(24, 128, generator=g, dtype=torch.float64) ** 3 + offset).to(dtype)
    if dtype == torch.float32:
        x[3, 5], x[7, 0] = math.nan, -math.inf  # left out, as stats.outliers leaves them out
    assert_moments(fused(x, ("moments", "kurtosis"), block=256), x)


def test_a_strided_last_dimension_leaves_blocks_to_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transposed tensor (last dimension strided) or a slice of a middle dimension (rows at no
    single stride): the kernel says it left ``blocks`` NaN, and ``record_of`` and the recorder
    fill them with torch code; a contiguous one: nothing left."""
    x = torch.randn(70, 48, generator=_gen(9)).t()
    row = torch.full((len(stats.FIELDS),), -7.0, dtype=torch.float64)
    assert triton_stats.record_into(x, EVERY, row) == frozenset({"blocks"})
    assert row[BLOCK_COLS].isnan().all() and not row[[stats.Col.M3, stats.Col.M4]].isnan().any()
    assert triton_stats.record_into(x.contiguous(), EVERY, row) == frozenset()
    middle = torch.randn(4, 6, 40, generator=_gen(10))[:, :3]  # two strided dimensions read in place, rows not one
    assert triton_stats.record_into(middle, EVERY, row) == frozenset({"blocks"})
    want = stats.assemble([stats.record_of(x, EVERY, host_reads=False, kernel="torch")])[0]
    monkeypatch.setenv(kernels.ENV, "triton")
    rec = Recorder(EVERY, host_reads=False)
    rec.observe("x", x)
    for got in (rec.records(["x"])[0, 0], stats.assemble([stats.record_of(x, EVERY, host_reads=False)])[0]):
        assert got[FLUSHED].tolist() == want[FLUSHED].tolist()
        torch.testing.assert_close(got[SUMS], want[SUMS], rtol=2e-6, atol=0)
        for name in ("kurtosis", *(f"{fmt}_snr_db" for fmt in BLOCK_FORMATS)):
            torch.testing.assert_close(stats.statistic(got, name), stats.statistic(want, name), rtol=1e-6, atol=0)


#: Aten ops that launch no kernel: an allocation, views.
NO_KERNEL = {"empty", "slice", "select", "view", "permute", "detach"}


def test_every_group_costs_no_torch_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every group on, a record of a tensor contiguous along its last dimension takes no
    torch kernel: the block what-ifs and kurtosis come from the fused read."""
    monkeypatch.setenv(kernels.ENV, "triton")
    rec = Recorder(EVERY, host_reads=False)
    rec.observe("warm", torch.randn(300))  # the format bounds' one upload
    for x in (torch.randn(16, 300)[:, :256], torch.randn(1000).to(torch.bfloat16)):
        counter = OpCounter(x.numel())
        with counter:
            rec.observe(x.shape, x)
        assert set(counter.names()) <= NO_KERNEL, counter.ops
        assert not counter.full, counter.full


def test_float64_quotients_round_to_the_float32_quotients_nvfp4_takes() -> None:
    """The kernel takes NVFP4's ``amax / 6`` and ``1 / scale`` in float64 rounded to float32 (a
    GPU's float32 division is approximate): the correctly rounded float32 quotient, for every
    float32 mantissa over 6 and every E4M3 scale (the exponent only shifts the quotient)."""
    mantissas = torch.arange(1 << 23, 1 << 24, dtype=torch.float64)
    assert torch.equal((mantissas / 6.0).float(), mantissas.float() / torch.tensor(6.0))
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = scales[torch.isfinite(scales) & (scales >= 2.0**-6)].unique()
    assert torch.equal((1.0 / scales.double()).float(), torch.tensor(1.0) / scales)
