"""The fused statistics kernel for accelerator tensors, in Triton: one read per tensor.

``record_into(x, groups, row)`` writes the record of ``x`` (every field of the asked
groups, ``FIELDS`` order, float64) into ``row``, a slice of the step's record buffer on
``x``'s device, without a host read:

1. ``_tiles_kernel`` reads each element once. Each program walks tiles of ``BR x BC``
   elements (grid-stride) and keeps per tile: the finite values' count, mean, m2 (and m3,
   m4 with ``kurtosis``), NaN, +Inf and -Inf counts, max |x| of the finite values, least
   nonzero |x|, zeros and format counts (compares of |x|'s bits with each bound's bits:
   exact, whatever the hardware does with subnormals), and with ``blocks`` the MXFP8,
   MXFP4 and NVFP4 what-if sums (``triton_blocks``: a block's amax is local to the tile).
   Tiles merge into the program's running moments in float64 (Chan's formula; Pébay's
   for m3, m4); each program writes one partial row.
2. ``_finish_kernel``, one program, merges the partial rows (float64, the vector form:
   mean = sum(n_i mean_i) / n, m2 = sum(m2_i) + sum(n_i d_i^2), d_i = mean_i - mean, m3
   and m4 moved likewise) and writes the record row.
3. With ``fp8``, ``_fp8_kernel`` reads ``x`` a second time (the per-tensor amax must be
   known first), quantises as ``torch``'s cast, and ``_fp8_finish_kernel`` adds its partials.

The moments of one tile: ``s = 2**-e`` with ``e`` the exponent of the tile's max |x|
(from its bits; clamped to normal powers), ``y = x * s`` (exact, |y| < 2: powers neither
overflow nor underflow, values near float32's largest included), ``c`` = float32 of the
tile's float64 mean of ``y``, ``d = y - c`` (exact near ``c``); the central moments follow
from the sums of powers of ``d`` (``r = sum(d) / k``: ``m2 = sum(d^2) - k r^2`` and so
on), divided by powers of ``s``. Sums run in float32 along the tile's rows of ``BC`` (<=
256) elements and in float64 across rows: a large |mean| next to a small std costs nothing.

Layouts: contiguous and densely permuted tensors are read as one flat array, a tensor
whose dimensions collapse to two strided ones (q, k, v slices) in place by its strides;
anything else is copied once. With ``blocks``, a tensor contiguous along its last
dimension is read as rows of it (``layout.row_grid``; ``BC`` >= 32, a multiple of the
blocks; a last dimension short of a block costs masked lanes); a tensor read in place
whose last dimension is strided (a transpose) or whose rows lie at no single stride (a
slice of a middle dimension) leaves ``blocks`` to torch code, and the kernel says so
(``record_into``'s return).

``BLOCK`` (elements per tile): 4096 on a GPU (16 x 256), 65536 under Triton's interpreter
(``TRITON_INTERPRET=1``, how the kernel is tested on CPU), where each tile costs a few
numpy calls. Each variant (dtype, groups, strides) is compiled on first use. Import this
module only where Triton is importable (``lightning_scale.record.kernels`` decides).
"""

from __future__ import annotations

import functools
import math
from typing import Collection, Dict, FrozenSet, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_scale.record.stats.fields import (
    BLOCKS_SPAN,
    FIELDS,
    FORMAT_FIELDS,
    FORMATS,
    FP8_DTYPES,
    FP8_SPAN,
    IX,
    Col,
)
from lightning_scale.record.stats.layout import Grid, dense_order, row_grid, strided_grid
from lightning_scale.record.triton_blocks import block_sums, round_to_grid
from lightning_scale.record.triton_moments import merge_higher, tile_moments, unit_scale

__all__ = ["GPU_BLOCK", "GROUPS", "INTERPRETER_BLOCK", "interpreted", "record_into", "tile_index"]

#: The groups the kernel covers; ``record_into`` returns the others asked for (the reference's).
GROUPS = frozenset({"moments", "range", "formats", "fp8", "blocks", "kurtosis"})
GPU_BLOCK = 4096
INTERPRETER_BLOCK = 65536
_BC = 256  # row length of a tile: float32 sums along it, float64 across rows
_PW = 64  # width of a partial row of _tiles_kernel: the whole record
_PW8 = 8  # ... of _fp8_kernel
_CH = 64  # partial rows the finishing kernels take at a time
_F = len(FIELDS)
_FP80 = FP8_SPAN.start

# Slots of a partial row of _tiles_kernel: the record's own columns, the finite values'
# count, mean, m2 and max |x| in those of count, mean, m2 and absmax, and the +Inf count
# in the first column the kernel leaves free (fp8's: _fp8_kernel's sums go elsewhere).
_COUNT, _MEAN, _M2, _ABSMAX = (tl.constexpr(c) for c in (Col.COUNT, Col.MEAN, Col.M2, Col.ABSMAX))
_NAN, _INF, _ZEROS, _MINNZ = (tl.constexpr(c) for c in (Col.NAN, Col.INF, Col.ZEROS, Col.MIN_NONZERO))
_M3, _M4 = tl.constexpr(Col.M3), tl.constexpr(Col.M4)
_BLK0 = tl.constexpr(BLOCKS_SPAN.start)  # the block what-ifs' sums, BLOCK_FIELDS order
_PINF = tl.constexpr(FP8_SPAN.start)
_FMT0 = tl.constexpr(IX[FORMAT_FIELDS[0]])  # per format, three slots: underflow, below_normal, overflow
_NFMT = tl.constexpr(len(FORMATS))
# Partial rows hold the record's columns (fp8's excepted: _fp8_kernel's), at their own places.
assert (
    _F <= _PW
    and BLOCKS_SPAN.stop - BLOCKS_SPAN.start == 12
    and FORMAT_FIELDS == tuple(f"{k}_{f}" for f in FORMATS for k in ("underflow", "below_normal", "overflow"))
)
# Slots of a partial row of _fp8_kernel: FP8_FIELDS order (per format: sq_err, sq, flushed).
_E4, _E5 = (tl.constexpr(IX[f"fp8_{fmt}_sq_err"] - _FP80) for fmt in ("e4m3", "e5m2"))
_E4_MAX, _E5_MAX = (tl.constexpr(FORMATS[fmt].max) for fmt in ("e4m3", "e5m2"))
# least normal exponent and mantissa bits of each: 2**EMIN the least normal, 2**-MBITS of it the least subnormal
_E4_EMIN, _E5_EMIN = (tl.constexpr(int(math.log2(FORMATS[fmt].min_normal))) for fmt in ("e4m3", "e5m2"))
_E4_MBITS, _E5_MBITS = (
    tl.constexpr(int(math.log2(FORMATS[fmt].min_normal / FORMATS[fmt].min_subnormal))) for fmt in ("e4m3", "e5m2")
)
_NFP8 = tl.constexpr(FP8_SPAN.stop - FP8_SPAN.start)
assert tuple(FP8_DTYPES) == ("e4m3", "e5m2") and _NFP8 <= _PW8


@triton.jit
def _load(x_ptr, offsets, valid, BF16: tl.constexpr):
    """Elements as float32. bfloat16 comes as its int16 bits, widened by a shift: exact
    for subnormals too (Triton's interpreter flushes them in its own conversion)."""
    if BF16:
        return (tl.load(x_ptr + offsets, mask=valid, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(x_ptr + offsets, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def tile_index(t, tiles_n, r, c, BR: tl.constexpr, BC: tl.constexpr):
    """Row and column (int64) of the elements of tile ``t`` in a grid of tiles of ``BR x
    BC``, ``tiles_n`` tiles a row: ``r`` (BR, 1) and ``c`` (1, BC) their place in the tile.
    64-bit before any product with the tile index: a row of 2**31 elements or more (a
    slice of a large logits tensor) would wrap in int32."""
    t64 = tl.cast(t, tl.int64)  # (a Python int in the interpreter's loops)
    tm = t64 // tiles_n
    return tm * BR + r.to(tl.int64), (t64 - tm * tiles_n) * BC + c.to(tl.int64)


@triton.jit
def _count(mask):
    return tl.sum(mask.to(tl.int32)).to(tl.float64)


@triton.jit
def _tile_counts(bits, valid, nonzero, bounds_ptr, slot, FORMATS: tl.constexpr):
    """The tile's counts at their partial-row slots: NaN, ±Inf, +Inf, zeros, formats."""
    ab = bits & 0x7FFFFFFF  # |x|'s bits: ordered as |x|, NaN above inf
    inf = valid & (ab == 0x7F800000)
    got = tl.where(slot == _NAN, _count(valid & (ab > 0x7F800000)), 0.0)
    got = tl.where(slot == _INF, _count(inf), got)
    got = tl.where(slot == _PINF, _count(inf & (bits > 0)), got)
    if FORMATS:
        got = tl.where(slot == _ZEROS, _count(valid & (ab == 0)), got)
        for f in tl.static_range(_NFMT):  # per format, FIELDS order: underflow, below_normal, overflow
            u = _count(nonzero & (ab < tl.load(bounds_ptr + 3 * f)))
            b = _count(nonzero & (ab < tl.load(bounds_ptr + 3 * f + 1)))
            o = _count(nonzero & (ab > tl.load(bounds_ptr + 3 * f + 2)))
            at = _FMT0 + 3 * f
            got = tl.where(slot == at, u, tl.where(slot == at + 1, b, tl.where(slot == at + 2, o, got)))
    return got


@triton.jit
def _tiles_kernel(
    x_ptr,
    part_ptr,
    bounds_ptr,
    n,
    M,
    N,
    s0,
    s1,
    tiles_n,
    ntiles,
    BR: tl.constexpr,
    BC: tl.constexpr,
    FORMATS: tl.constexpr,
    PW: tl.constexpr,
    BF16: tl.constexpr,
    BLOCKS: tl.constexpr,
    KURT: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BR)[:, None]
    c = tl.arange(0, BC)[None, :]
    slot = tl.arange(0, PW)
    cnt = tl.cast(0.0, tl.float64)
    mean = tl.cast(0.0, tl.float64)
    m2 = tl.cast(0.0, tl.float64)
    m3 = tl.cast(0.0, tl.float64)
    m4 = tl.cast(0.0, tl.float64)
    top = tl.cast(0, tl.int32)  # bits of max |x| over finite values
    low = tl.cast(0x7F800000, tl.int32)  # bits of least nonzero |x| (NaN left out; inf if none)
    counts = tl.zeros([PW], dtype=tl.float64)
    for t in range(pid, ntiles, tl.num_programs(0)):
        i, j = tile_index(t, tiles_n, r, c, BR, BC)  # (BR, 1), (1, BC)
        valid = (i < M) & (j < N) & (i * N + j < n)
        v = _load(x_ptr, i * s0 + j * s1, valid, BF16)
        bits = v.to(tl.int32, bitcast=True)
        ab = bits & 0x7FFFFFFF
        fin = valid & (ab < 0x7F800000)
        tile_top = tl.max(tl.where(fin, ab, 0))
        s = unit_scale(tile_top)
        k, tile_mean, tile_m2, tile_m3, tile_m4 = tile_moments(v, fin, s, KURT)
        total = cnt + k  # Chan, Golub and LeVeque (Pébay's for m3, m4): merge the tile into the running moments
        delta = tile_mean - mean
        w = k / tl.maximum(total, 1.0)
        if KURT:
            m3, m4 = merge_higher(cnt, k, delta, m2, m3, m4, tile_m2, tile_m3, tile_m4)
        mean = mean + delta * w
        m2 = m2 + tile_m2 + delta * delta * cnt * w
        cnt = total
        top = tl.maximum(top, tile_top)
        nonzero = valid & (ab > 0) & (ab <= 0x7F800000)
        low = tl.minimum(low, tl.min(tl.where(nonzero, ab, 0x7F800000)))
        counts += _tile_counts(bits, valid, nonzero, bounds_ptr, slot, FORMATS)
        if BLOCKS:
            counts += block_sums(tl.where(fin, v, 0.0), fin & (ab > 0), s, slot, _BLK0, BR, BC)
    row = tl.where(slot == _COUNT, cnt, tl.where(slot == _MEAN, mean, tl.where(slot == _M2, m2, counts)))
    row = tl.where(slot == _M3, m3, tl.where(slot == _M4, m4, row))
    row = tl.where(slot == _ABSMAX, top.to(tl.float32, bitcast=True).to(tl.float64), row)
    row = tl.where(slot == _MINNZ, low.to(tl.float32, bitcast=True).to(tl.float64), row)
    tl.store(part_ptr + pid * PW + slot, row)


@triton.jit
def _finish_kernel(
    part_ptr,
    out_ptr,
    scale_ptr,
    P,
    n,
    CH: tl.constexpr,
    PW: tl.constexpr,
    F: tl.constexpr,
    RANGE: tl.constexpr,
    FORMATS: tl.constexpr,
    FP8: tl.constexpr,
    BLOCKS: tl.constexpr,
    KURT: tl.constexpr,
):
    f = tl.arange(0, PW)
    rows = tl.arange(0, CH)
    nan_ = tl.cast(0x7FF8000000000000, tl.int64).to(tl.float64, bitcast=True)
    inf_ = tl.cast(0x7FF0000000000000, tl.int64).to(tl.float64, bitcast=True)
    sums = tl.zeros([PW], dtype=tl.float64)
    weighted = tl.cast(0.0, tl.float64)
    top = tl.cast(0.0, tl.float64)
    least = inf_
    for start in range(0, P, CH):  # partial rows CH at a time: column sums, extremes, sum(n_i mean_i)
        p = start + rows
        part = tl.load(part_ptr + p[:, None] * PW + f[None, :], mask=(p < P)[:, None], other=0.0)
        sums += tl.sum(part, axis=0)
        cnt = tl.load(part_ptr + p * PW + _COUNT, mask=p < P, other=0.0)
        weighted += tl.sum(cnt * tl.load(part_ptr + p * PW + _MEAN, mask=p < P, other=0.0), axis=0)
        top = tl.maximum(top, tl.max(tl.load(part_ptr + p * PW + _ABSMAX, mask=p < P, other=0.0), axis=0))
        least = tl.minimum(least, tl.min(tl.load(part_ptr + p * PW + _MINNZ, mask=p < P, other=inf_), axis=0))
    total = tl.sum(tl.where(f == _COUNT, sums, 0.0), axis=0)
    mean = weighted / tl.maximum(total, 1.0)
    m2 = tl.sum(tl.where(f == _M2, sums, 0.0), axis=0)
    m3 = tl.sum(tl.where(f == _M3, sums, 0.0), axis=0)
    m4 = tl.sum(tl.where(f == _M4, sums, 0.0), axis=0)
    for start in range(0, P, CH):  # Chan, Golub and LeVeque, all parts at once: m2 += sum(n_i (mean_i - mean)^2)
        p = start + rows
        d = tl.load(part_ptr + p * PW + _MEAN, mask=p < P, other=0.0) - mean
        n_d2 = tl.load(part_ptr + p * PW + _COUNT, mask=p < P, other=0.0) * d * d
        m2 += tl.sum(n_d2, axis=0)
        if KURT:  # each part's m3, m4 moved to the mean (stats.outliers.moved_moments)
            m2_i = tl.load(part_ptr + p * PW + _M2, mask=p < P, other=0.0)
            m3_i = tl.load(part_ptr + p * PW + _M3, mask=p < P, other=0.0)
            m3 += tl.sum(d * (3.0 * m2_i + n_d2), axis=0)
            m4 += tl.sum(d * (4.0 * m3_i + d * (6.0 * m2_i + n_d2)), axis=0)
    nans = tl.sum(tl.where(f == _NAN, sums, 0.0), axis=0)
    infs = tl.sum(tl.where(f == _INF, sums, 0.0), axis=0)
    pinf = tl.sum(tl.where(f == _PINF, sums, 0.0), axis=0)
    # as torch.mean of the float64 values: NaN with a NaN or both infinities, else the infinity
    bad = (nans > 0) | ((pinf > 0) & (pinf < infs))
    mean = tl.where(bad, nan_, tl.where(pinf > 0, inf_, tl.where(infs > 0, -inf_, mean)))
    m2 = tl.where(nans + infs > 0, nan_, m2)
    row = tl.where(f == _COUNT, n.to(tl.float64), tl.where(f == _MEAN, mean, tl.where(f == _M2, m2, nan_)))
    row = tl.where((f == _NAN) | (f == _INF), sums, row)
    if RANGE:
        row = tl.where(f == _ABSMAX, tl.where(nans > 0, nan_, tl.where(infs > 0, inf_, top)), row)
    if FORMATS:
        counts = (f == _ZEROS) | ((f >= _FMT0) & (f < _FMT0 + 3 * _NFMT))
        row = tl.where(counts, sums, tl.where(f == _MINNZ, least, row))
    if BLOCKS:
        row = tl.where((f >= _BLK0) & (f < _BLK0 + 12), sums, row)
    if KURT:
        row = tl.where(f == _M3, m3, tl.where(f == _M4, m4, row))
    tl.store(out_ptr + f, row, mask=f < F)
    if FP8:  # per-tensor scale = fmt.max / amax rounded to float32 (from float64: correctly rounded), capped
        for k in tl.static_range(2):
            fmax = _E4_MAX if k == 0 else _E5_MAX
            scale = (fmax / top).to(tl.float32)
            scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
            tl.store(scale_ptr + k, scale.to(tl.float64))


@triton.jit
def _fp8_kernel(
    x_ptr,
    part_ptr,
    scale_ptr,
    n,
    M,
    N,
    s0,
    s1,
    tiles_n,
    ntiles,
    BR: tl.constexpr,
    BC: tl.constexpr,
    PW: tl.constexpr,
    BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    r = tl.arange(0, BR)[:, None]
    c = tl.arange(0, BC)[None, :]
    slot = tl.arange(0, PW)
    s4 = tl.load(scale_ptr).to(tl.float32)
    s5 = tl.load(scale_ptr + 1).to(tl.float32)
    acc = tl.zeros([PW], dtype=tl.float64)
    for t in range(pid, ntiles, tl.num_programs(0)):
        i, j = tile_index(t, tiles_n, r, c, BR, BC)
        valid = (i < M) & (j < N) & (i * N + j < n)
        v = _load(x_ptr, i * s0 + j * s1, valid, BF16)
        ab = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        fin = valid & (ab < 0x7F800000)
        xf = tl.where(fin, v, 0.0)  # non-finite values left out (zero error, not flushed)
        nonzero = fin & (ab > 0)
        x64 = xf.to(tl.float64)
        q4 = round_to_grid(xf * s4, _E4_EMIN, _E4_MBITS)  # E4M3 (float8_e4m3fn)
        q5 = round_to_grid(xf * s5, _E5_EMIN, _E5_MBITS)  # E5M2
        # error in scaled units, exact in float64 (x * s has 48 bits); back in x's units at the end
        e4 = q4.to(tl.float64) - x64 * s4.to(tl.float64)
        e5 = q5.to(tl.float64) - x64 * s5.to(tl.float64)
        sq = tl.sum(x64 * x64)
        got = tl.where(slot == _E4, tl.sum(e4 * e4), tl.where((slot == _E4 + 1) | (slot == _E5 + 1), sq, 0.0))
        got = tl.where(slot == _E4 + 2, _count(nonzero & (q4 == 0)), got)
        got = tl.where(slot == _E5, tl.sum(e5 * e5), got)
        got = tl.where(slot == _E5 + 2, _count(nonzero & (q5 == 0)), got)
        acc += got
    tl.store(part_ptr + pid * PW + slot, acc)


@triton.jit
def _fp8_finish_kernel(part_ptr, out_ptr, scale_ptr, P, CH: tl.constexpr, PW: tl.constexpr):
    f = tl.arange(0, PW)
    rows = tl.arange(0, CH)
    sums = tl.zeros([PW], dtype=tl.float64)
    for start in range(0, P, CH):
        p = start + rows
        sums += tl.sum(tl.load(part_ptr + p[:, None] * PW + f[None, :], mask=(p < P)[:, None], other=0.0), axis=0)
    s4 = tl.load(scale_ptr)
    s5 = tl.load(scale_ptr + 1)
    row = tl.where(f == _E4, sums / s4 / s4, tl.where(f == _E5, sums / s5 / s5, sums))  # errors back in x's units
    tl.store(out_ptr + f, row, mask=f < _NFP8)  # FP8_FIELDS order: e4m3 sq_err, sq, flushed; e5m2 the same


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` when
    triton was imported): on CPU tensors, with numpy."""
    return not isinstance(_tiles_kernel, triton.runtime.JITFunction)


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 16


_BOUNDS: Dict[torch.device, Tensor] = {}


def _bounds(device: torch.device) -> Tensor:
    """Bits of each format's smallest subnormal, smallest normal and largest value (FIELDS
    order), as int32 on ``device``: |x| < bound compares as bits < bound's bits."""
    if device not in _BOUNDS:
        values = [v for fmt in FORMATS.values() for v in (fmt.min_subnormal, fmt.min_normal, fmt.max)]
        _BOUNDS[device] = torch.tensor(values, dtype=torch.float32).view(torch.int32).to(device, non_blocking=True)
    return _BOUNDS[device]


def _grid(x: Tensor, blocks: bool) -> Tuple[Grid, bool]:
    """How ``x`` is read, and whether its tiles' rows hold whole blocks of its last
    dimension (for the block what-ifs): a dense ``x`` whose last dimension is innermost and
    a multiple of 32 as flat rows of ``_BC`` (blocks never straddle them), else along its
    last dimension where it is contiguous there (``row_grid``); otherwise as flat rows or
    two strided dimensions (``strided_grid``), else from a contiguous copy (three or more
    dimensions that no stride order makes dense: rare; blocks then read from the copy)."""
    k = x.shape[-1] if x.dim() else 1
    if blocks and k % 32 == 0 and x.stride(-1) == 1 and dense_order(x) is not None:
        return (x, x.numel(), -(-x.numel() // _BC), _BC, _BC, 1), True
    lay = row_grid(x) if blocks else None
    if lay is not None:
        return lay, True
    lay = strided_grid(x, _BC)
    return (lay, False) if lay is not None else _grid(x.contiguous(), blocks)


def record_into(x: Tensor, groups: Collection[str], row: Tensor, block: Optional[int] = None) -> FrozenSet[str]:
    """Write the record of ``x`` (a non-empty float32, bfloat16 or float16 tensor on a
    device Triton supports, or on the CPU under the interpreter) into ``row``, a float64
    tensor of ``len(FIELDS)`` contiguous elements on ``x``'s device; fields of groups not
    asked for are NaN. Two launches (``fp8``: four, two reads of ``x``); no host read.

    Returns the asked groups it left NaN for the reference (``stats.reference``): those it
    does not cover (``GROUPS``), and ``blocks`` where ``x`` is read in place with a strided last
    dimension (a transpose) or rows at no single stride (a slice of a middle dimension).

    Args:
        block: elements per tile, a power of two >= 256 (default ``GPU_BLOCK``, or
            ``INTERPRETER_BLOCK`` under the interpreter).
    """
    if x.is_cuda and x.device != torch.device("cuda", torch.cuda.current_device()):
        with torch.cuda.device(x.device):  # (Triton launches on the current device)
            return record_into(x, groups, row, block)
    block = block or (INTERPRETER_BLOCK if interpreted() else GPU_BLOCK)
    block = min(block, max(_BC, triton.next_power_of_2(x.numel())))  # (short tensors: no empty lanes)
    (t, n, m, k, s0, s1), blocks = _grid(x, "blocks" in groups)
    bc = min(_BC, triton.next_power_of_2(max(k, 32 if blocks else 1)))  # (blocks: whole blocks a row)
    br = min(block // bc, triton.next_power_of_2(m))  # (few rows: no empty ones)
    tiles_n = -(-k // bc)
    ntiles = -(-m // br) * tiles_n
    programs = min(ntiles, _programs(x.device))
    fp8 = "fp8" in groups
    scratch = torch.empty(programs * (_PW + _PW8) + 2, dtype=torch.float64, device=x.device)
    part, part8, scale = scratch[: programs * _PW], scratch[programs * _PW : -2], scratch[-2:]
    args = (n, m, k, s0, s1, tiles_n, ntiles)
    warps = {"num_warps": 8} if block >= 4096 and not interpreted() else {}
    bf16 = t.dtype == torch.bfloat16
    t = t.view(torch.int16) if bf16 else t  # (see _load)
    on = {"FORMATS": "formats" in groups, "BLOCKS": blocks, "KURT": "kurtosis" in groups}
    _tiles_kernel[(programs,)](t, part, _bounds(x.device), *args, BR=br, BC=bc, PW=_PW, BF16=bf16, **on, **warps)
    _finish_kernel[(1,)](part, row, scale, programs, n, CH=_CH, PW=_PW, F=_F, RANGE="range" in groups, FP8=fp8, **on)
    if fp8:
        _fp8_kernel[(programs,)](t, part8, scale, *args, BR=br, BC=bc, PW=_PW8, BF16=bf16, **warps)
        _fp8_finish_kernel[(1,)](part8, row[_FP80:], scale, programs, CH=_CH, PW=_PW8)
    left = set(groups) - GROUPS  # (groups it does not cover: user statistics, new ones)
    if "blocks" in groups and not blocks:
        left.add("blocks")
    return frozenset(left)
