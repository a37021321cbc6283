"""The fused statistics kernel for accelerator tensors, in Triton: one read per tensor.

``record_into(x, groups, row)`` writes the record of ``x`` (every field of the asked
groups, ``FIELDS`` order, float64) into ``row``, a slice of the step's record buffer on
``x``'s device, without a host read:

1. ``_tiles_kernel`` reads each element once. Each program walks tiles of ``BR x BC``
   elements (grid-stride) and keeps, in registers, per tile: the count of finite values,
   their mean and sum of squared deviations (below), NaN, +Inf and -Inf counts, max |x|
   over the finite values, least nonzero |x|, the zeros and every format count
   (compares of |x|'s bits with each bound's bits: exact, whatever the hardware does
   with subnormals). Tiles merge into the program's running moments in float64 by
   Chan's formula; each program writes one partial row.
2. ``_finish_kernel``, one program, merges the partial rows (float64, Chan's formula in
   its vector form: mean = sum(n_i mean_i) / n, m2 = sum(m2_i) + sum(n_i (mean_i - mean)^2))
   and writes the record row.
3. With the ``fp8`` group, ``_fp8_kernel`` reads ``x`` a second time (the amax must be
   known first) and quantises each element as ``torch``'s cast would, and
   ``_fp8_finish_kernel`` adds its partials into the row.

The moments of one tile: ``s = 2**-e`` with ``e`` the exponent of the tile's max |x|
(from its bits; clamped to normal powers), ``y = x * s`` (exact, |y| < 2: squares neither
overflow nor underflow, values near float32's largest included), ``c`` = float32 of the
tile's float64 mean of ``y``, ``d = y - c`` (exact near ``c``), then ``mean = (c + sum(d)
/ k) / s`` and ``m2 = (sum(d^2) - sum(d)^2 / k) / s^2``. Sums run in float32 along the
tile's rows of ``BC`` (<= 256) elements and in float64 across rows, so a large |mean|
next to a small std costs nothing: no cancellation anywhere.

Layouts: contiguous and densely permuted tensors (transposes) are read as one flat
array, a tensor whose dimensions collapse to two strided ones (q, k, v slices of a
fused projection) in place by its strides; anything else is copied once.

``BLOCK`` (elements per tile) is a parameter: 4096 on a GPU (16 x 256: a few registers
a thread), 65536 under Triton's interpreter (``TRITON_INTERPRET=1``, how the kernel is
tested on CPU), where each tile costs a few numpy calls and larger tiles are faster
(1M elements: ~5 s at 1024, ~0.1 s at 64K).

Each variant (input dtype, groups, stride specialisations) is compiled by Triton the
first time it runs (a second or so, cached on disk after that). Import this module only
where Triton is importable (``lightning_scale.record.kernels`` decides).
"""

from __future__ import annotations

import functools
import math
from typing import Collection, Dict, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_scale.record.stats.fields import FIELDS, FORMAT_FIELDS, FORMATS, FP8_DTYPES, FP8_SPAN, IX, Col
from lightning_scale.record.stats.layout import strided_grid

__all__ = ["GPU_BLOCK", "INTERPRETER_BLOCK", "interpreted", "record_into", "tile_index"]

GPU_BLOCK = 4096
INTERPRETER_BLOCK = 65536
_BC = 256  # row length of a tile: float32 sums along it, float64 across rows
_PW = 32  # width of a partial row of _tiles_kernel
_PW8 = 8  # ... of _fp8_kernel
_CH = 64  # partial rows the finishing kernels take at a time
_F = len(FIELDS)
_FP80 = FP8_SPAN.start

# Slots of a partial row of _tiles_kernel: the record's own columns, the finite values'
# count, mean, m2 and max |x| in those of count, mean, m2 and absmax, and the +Inf count
# in the first column the kernel leaves free (fp8's: _fp8_kernel's sums go elsewhere).
_COUNT, _MEAN, _M2, _ABSMAX = (tl.constexpr(c) for c in (Col.COUNT, Col.MEAN, Col.M2, Col.ABSMAX))
_NAN, _INF, _ZEROS, _MINNZ = (tl.constexpr(c) for c in (Col.NAN, Col.INF, Col.ZEROS, Col.MIN_NONZERO))
_PINF = tl.constexpr(FP8_SPAN.start)
_FMT0 = tl.constexpr(IX[FORMAT_FIELDS[0]])  # per format, three slots: underflow, below_normal, overflow
_NFMT = tl.constexpr(len(FORMATS))
assert _F <= _PW and FORMAT_FIELDS == tuple(
    f"{k}_{f}" for f in FORMATS for k in ("underflow", "below_normal", "overflow")
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
def _tile_moments(v, fin):
    """(count, mean, m2) of the finite values of a tile (float64), and the bits of their
    max |x|: scaled by a power of two, shifted by their float32 mean (module docstring)."""
    ab = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tile_top = tl.max(tl.where(fin, ab, 0))
    # s = 2**-e, e = exponent of the tile's max |x|, kept a normal power of two
    e = tl.minimum(tl.maximum((tile_top >> 23) - 127, -126), 126)
    s = ((127 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.where(fin, v * s, 0.0)
    k = tl.sum(fin.to(tl.int32)).to(tl.float64)
    kk = tl.maximum(k, 1.0)
    shift = (tl.sum(tl.sum(y, axis=1).to(tl.float64), axis=0) / kk).to(tl.float32)
    d = tl.where(fin, y - shift, 0.0)
    sd = tl.sum(tl.sum(d, axis=1).to(tl.float64), axis=0)
    sd2 = tl.sum(tl.sum(d * d, axis=1).to(tl.float64), axis=0)
    s64 = s.to(tl.float64)
    return k, (shift.to(tl.float64) + sd / kk) / s64, tl.maximum(sd2 - sd * (sd / kk), 0.0) / s64 / s64, tile_top


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
):
    pid = tl.program_id(0)
    r = tl.arange(0, BR)[:, None]
    c = tl.arange(0, BC)[None, :]
    slot = tl.arange(0, PW)
    cnt = tl.cast(0.0, tl.float64)
    mean = tl.cast(0.0, tl.float64)
    m2 = tl.cast(0.0, tl.float64)
    top = tl.cast(0, tl.int32)  # bits of max |x| over finite values
    low = tl.cast(0x7F800000, tl.int32)  # bits of least nonzero |x| (NaN left out; inf if none)
    counts = tl.zeros([PW], dtype=tl.float64)
    for t in range(pid, ntiles, tl.num_programs(0)):
        i, j = tile_index(t, tiles_n, r, c, BR, BC)  # (BR, 1), (1, BC)
        valid = (i < M) & (j < N) & (i * N + j < n)
        v = _load(x_ptr, i * s0 + j * s1, valid, BF16)
        bits = v.to(tl.int32, bitcast=True)
        ab = bits & 0x7FFFFFFF
        k, tile_mean, tile_m2, tile_top = _tile_moments(v, valid & (ab < 0x7F800000))
        total = cnt + k  # Chan, Golub and LeVeque: merge the tile into the running moments
        delta = tile_mean - mean
        w = k / tl.maximum(total, 1.0)
        mean = mean + delta * w
        m2 = m2 + tile_m2 + delta * delta * cnt * w
        cnt = total
        top = tl.maximum(top, tile_top)
        nonzero = valid & (ab > 0) & (ab <= 0x7F800000)
        low = tl.minimum(low, tl.min(tl.where(nonzero, ab, 0x7F800000)))
        counts += _tile_counts(bits, valid, nonzero, bounds_ptr, slot, FORMATS)
    row = tl.where(slot == _COUNT, cnt, tl.where(slot == _MEAN, mean, tl.where(slot == _M2, m2, counts)))
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
    for start in range(0, P, CH):  # Chan, Golub and LeVeque, all parts at once: m2 += sum(n_i (mean_i - mean)^2)
        p = start + rows
        dev = tl.load(part_ptr + p * PW + _MEAN, mask=p < P, other=0.0) - mean
        m2 += tl.sum(tl.load(part_ptr + p * PW + _COUNT, mask=p < P, other=0.0) * dev * dev, axis=0)
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
    tl.store(out_ptr + f, row, mask=f < F)
    if FP8:  # per-tensor scale = fmt.max / amax rounded to float32 (from float64: correctly rounded), capped
        for k in tl.static_range(2):
            fmax = _E4_MAX if k == 0 else _E5_MAX
            scale = (fmax / top).to(tl.float32)
            scale = tl.where(scale == float("inf"), 3.4028234663852886e38, scale)
            tl.store(scale_ptr + k, scale.to(tl.float64))


@triton.jit
def _fp8_round(v, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """``v`` (float32, |v| <= the format's max) rounded to the FP8 grid, to nearest, ties
    to even (torch's cast), by exact float32 steps: ``t = |v| / ulp`` is below 2**(MBITS+2)."""
    bits = v.to(tl.int32, bitcast=True)
    ab = bits & 0x7FFFFFFF
    k = tl.maximum((ab >> 23) - 127, EMIN) - MBITS  # ulp = 2**k: the exponent's, or the subnormals'
    t = ab.to(tl.float32, bitcast=True) * ((127 - k) << 23).to(tl.float32, bitcast=True)
    r = tl.floor(t)
    rest = t - r
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((rest > 0.5) | ((rest == 0.5) & odd), r + 1.0, r)
    q = r * ((127 + k) << 23).to(tl.float32, bitcast=True)
    return tl.where(bits < 0, -q, q)


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
        q4 = _fp8_round(xf * s4, _E4_EMIN, _E4_MBITS)  # E4M3 (float8_e4m3fn)
        q5 = _fp8_round(xf * s5, _E5_EMIN, _E5_MBITS)  # E5M2
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


def record_into(x: Tensor, groups: Collection[str], row: Tensor, block: Optional[int] = None) -> None:
    """Write the record of ``x`` (a non-empty float32, bfloat16 or float16 tensor on a
    device Triton supports, or on the CPU under the interpreter) into ``row``, a float64
    tensor of ``len(FIELDS)`` contiguous elements on ``x``'s device; fields of groups not
    asked for are NaN. Two launches (``fp8``: four, two reads of ``x``); no host read.

    Args:
        block: elements per tile, a power of two >= 256 (default ``GPU_BLOCK``, or
            ``INTERPRETER_BLOCK`` under the interpreter).
    """
    if x.is_cuda and x.device != torch.device("cuda", torch.cuda.current_device()):
        with torch.cuda.device(x.device):  # (Triton launches on the current device)
            return record_into(x, groups, row, block)
    block = block or (INTERPRETER_BLOCK if interpreted() else GPU_BLOCK)
    block = min(block, max(_BC, triton.next_power_of_2(x.numel())))  # (short tensors: no empty lanes)
    lay = strided_grid(x, _BC)
    if lay is None:  # (three or more dimensions that no stride order makes dense: rare)
        x = x.contiguous()
        lay = strided_grid(x, _BC)
        assert lay is not None
    t, n, m, k, s0, s1 = lay
    bc = min(_BC, triton.next_power_of_2(k))
    br = block // bc
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
    _tiles_kernel[(programs,)](
        t, part, _bounds(x.device), *args, BR=br, BC=bc, FORMATS="formats" in groups, PW=_PW, BF16=bf16, **warps
    )
    _finish_kernel[(1,)](
        part,
        row,
        scale,
        programs,
        n,
        CH=_CH,
        PW=_PW,
        F=_F,
        RANGE="range" in groups,
        FORMATS="formats" in groups,
        FP8=fp8,
    )
    if fp8:
        _fp8_kernel[(programs,)](t, part8, scale, *args, BR=br, BC=bc, PW=_PW8, BF16=bf16, **warps)
        _fp8_finish_kernel[(1,)](part8, row[_FP80:], scale, programs, CH=_CH, PW=_PW8)
