"""Per-tensor statistics: computed on the tensor's device, merged exactly.

A *record* is a float64 vector of ``len(FIELDS)`` numbers that summarises one tensor:
its element count, mean and sum of squared deviations (``m2``), extremes, and counts of
special values. Records merge exactly: ``merge(record(a), record(b))`` equals
``record(cat(a, b))`` up to rounding, which is what pooling across micro-batches and
ranks relies on. Fields that were not computed hold NaN and stay NaN through merges.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from lightning_scale import native

__all__ = [
    "FIELDS",
    "FORMATS",
    "FP8_DTYPES",
    "GROUPS",
    "STATISTICS",
    "assemble",
    "FloatFormat",
    "merge",
    "merge_rows",
    "fast_host_record",
    "record_of",
    "statistic",
    "summarise",
]


@dataclass(frozen=True)
class FloatFormat:
    """Range of a floating-point format: smallest subnormal, smallest normal, largest."""

    min_subnormal: float
    min_normal: float
    max: float


FORMATS: Dict[str, FloatFormat] = {
    "fp16": FloatFormat(2.0**-24, 2.0**-14, 65504.0),
    "bf16": FloatFormat(2.0**-133, 2.0**-126, (2 - 2.0**-7) * 2.0**127),
    "e4m3": FloatFormat(2.0**-9, 2.0**-6, 448.0),
    "e5m2": FloatFormat(2.0**-16, 2.0**-14, 57344.0),
}

#: The FP8 dtypes of the ``fp8`` what-if group: E4M3 for forward values, E5M2 for gradients.
FP8_DTYPES: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

_FORMAT_FIELDS = [f"{kind}_{fmt}" for fmt in FORMATS for kind in ("underflow", "below_normal", "overflow")]
_FP8_FIELDS = [f"fp8_{fmt}_{kind}" for fmt in FP8_DTYPES for kind in ("sq_err", "sq", "flushed")]
FIELDS: Tuple[str, ...] = (
    "count", "mean", "m2", "absmax", "nan", "inf", "zeros", "min_nonzero", *_FORMAT_FIELDS, *_FP8_FIELDS,
)  # fmt: skip
_IX = {name: i for i, name in enumerate(FIELDS)}
_COUNT, _MEAN, _M2, _ABSMAX, _NAN, _INF, _ZEROS, _MINNZ = range(8)
_FMT0 = 8
_FP80 = _FMT0 + len(_FORMAT_FIELDS)

#: Which record fields each computation group fills.
GROUPS: Dict[str, Tuple[str, ...]] = {
    "moments": ("count", "mean", "m2", "nan", "inf"),
    "range": ("absmax",),
    "formats": ("zeros", "min_nonzero", *_FORMAT_FIELDS),
    "fp8": tuple(_FP8_FIELDS),
}

#: Statistic name -> the group that computes it. ``summarise`` derives each from a record.
STATISTICS: Dict[str, str] = {
    "std": "moments",
    "mean": "moments",
    "rms": "moments",
    "count": "moments",
    "nan": "moments",
    "inf": "moments",
    "absmax": "range",
    "zeros": "formats",
    "min_nonzero": "formats",
    **{name: "formats" for name in _FORMAT_FIELDS},
    **{f"fp8_{fmt}_{kind}": "fp8" for fmt in FP8_DTYPES for kind in ("snr_db", "flushed")},
}

Entry = Union[float, Tensor]
_NAN_ROW: List[Entry] = [math.nan] * len(FIELDS)
_Sum = Callable[[Tensor], Tensor]


def record_of(x: Tensor, groups: Collection[str] = ("moments",), host_reads: Optional[bool] = None) -> List[Entry]:
    """Statistics of ``x`` as a list of ``len(FIELDS)`` entries (floats or 0-dim tensors).

    Args:
        x: a floating-point tensor. Half types are reduced in float32, float64 in float64.
        groups: which of ``GROUPS`` to compute; the others are NaN. "moments" is always
            computed.
        host_reads: whether the computation may read intermediate results on the host to
            skip work (cheap only where the tensor lives in host memory). Defaults to
            ``x.device.type == "cpu"``. With host reads every entry is a float; without,
            every entry stays a 0-dim tensor on the device and nothing is read back.

    Example:
        >>> rec = assemble([record_of(torch.tensor([1.0, 2.0, 3.0]))])
        >>> float(statistic(rec, "std")[0])
        1.0
    """
    if host_reads is None:
        host_reads = x.device.type == "cpu"
    x = x.detach()
    out: List[Entry] = _NAN_ROW.copy()
    n = x.numel()
    out[_COUNT] = float(n)
    if n == 0:
        out[_MEAN], out[_M2] = 0.0, 0.0
        return out
    if host_reads:
        if "formats" in groups and n > _DOT_MAX and _native_every_group(x, out):
            if "range" not in groups:
                out[_ABSMAX] = math.nan
            if "fp8" in groups:
                out[_FP80:] = [float(v) for v in _fp8_fields(x, _host_sum)]
            return out
        top = _host_moments(x, out, with_max="range" in groups and "formats" not in groups)
        if "formats" in groups:
            out[_ZEROS:_FP80], absmax = _format_counts_host(x, out[_NAN])  # type: ignore[arg-type]
        if "range" in groups:  # (without NaN, the formats' max |x| is the absmax)
            if top is not None:
                out[_ABSMAX] = top
            else:
                out[_ABSMAX] = absmax if "formats" in groups and not out[_NAN] else _host_absmax(x)
    else:
        absmax = _device_moments(x, out)
        if "range" in groups:
            out[_ABSMAX] = absmax
        if "formats" in groups:
            out[_ZEROS:_FP80] = _format_counts_device(x, out[_NAN])  # type: ignore[arg-type]
    if "fp8" in groups:
        fp8 = _fp8_fields(x, _host_sum if host_reads else _sum64)
        out[_FP80:] = [float(v) for v in fp8] if host_reads else fp8
    return out


def fast_host_record(groups: Collection[str]) -> Optional[Callable[[Tensor], Optional[List[Entry]]]]:
    """For groups within moments, range and formats: a function giving
    ``record_of(x, groups, True)`` of a tensor above 4096 elements from one read of the
    native kernel (``lightning_scale.native``), with fewer steps than ``record_of`` takes
    (a tracked step calls it for every recorded tensor), or None where that does not apply
    (the kernel declines the tensor; without formats, also where its values are not
    finite, tiny or mean-dominated: the cases ``record_of`` hands to its other passes).
    None for other groups (fp8)."""
    if set(groups) == {"moments", "formats"} or set(groups) == {"moments", "range", "formats"}:
        keep_max = "range" in groups

        def record(x: Tensor) -> Optional[List[Entry]]:  # (the name the benchmarks profile)
            out = _NAN_ROW.copy()
            if not _native_every_group(x, out):
                return None
            out[_COUNT] = float(x.numel())
            if not keep_max:
                out[_ABSMAX] = math.nan
            return out

        return record
    if not set(groups) <= {"moments", "range"}:
        return None
    with_max = "range" in groups

    def record(x: Tensor) -> Optional[List[Entry]]:  # (the name the benchmarks profile)
        out = _NAN_ROW.copy()
        taken, top = _native_moments(x, out, with_max)
        if not taken:
            return None
        out[_COUNT] = float(x.numel())
        if with_max:
            out[_ABSMAX] = top if top is not None else _host_absmax(x)
        return out

    return record


def _native_every_group(x: Tensor, out: List[Entry]) -> bool:
    """Fills the moments, absmax and the formats group of ``x`` from one read of the
    native kernel (``native.every_group``); False, with nothing filled, where it declines
    ``x``. Moments the one-pass sums cannot give (non-finite, tiny or mean-dominated
    values) come from ``_host_moments``'s other passes."""
    got = native.every_group(x, _NATIVE_BOUNDS)
    if got is None:
        return False
    (total, sumsq, top, least, nan), counts = got
    n = x.numel()
    m2 = _one_pass_m2(total, sumsq, n, _TINY[torch.float32])
    if m2 is not None:
        out[_MEAN], out[_M2], out[_NAN], out[_INF] = total / n, m2, 0.0, 0.0
    else:
        _host_moments(x, out, one_read=False)
    # counts[k] = #{|x| < bound k} without NaN; the non-NaN count last, as cumulative counts end
    cum = counts.tolist()
    cum.append(n - int(nan))
    out[_ZEROS], out[_MINNZ], out[_ABSMAX] = float(cum[0]), float(least), float(top)
    out[_FMT0:_FP80] = _format_fields_of_row(cum, torch.float32)
    return True


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sum64(t: Tensor) -> Tensor:
    # float64 accumulation whatever the backend (CUDA reduces float32 in float32).
    return t.sum(dtype=torch.float64)


def _host_sum(t: Tensor) -> Tensor:
    # torch's CPU cascade sum keeps ~1e-7 relative error at any size; 5x faster than float64.
    return t.sum().double() if t.device.type == "cpu" else _sum64(t)


# ---------------------------------------------------------------------------------------
# Moments: count, mean, m2, nan, inf.

_WIDE = (torch.float32, torch.float64)
_ROW = 512  # row norms this short stay within ~1e-7 (measured; 4096-element rows: 2e-6)
# Squares of values below ~sqrt(smallest normal) lose bits: below this mean square the
# fast path hands over to the scaled one.
_TINY = {torch.float32: 2.0**-100, torch.float64: 2.0**-900}
# The one-pass formula m2 = sumsq - sum * mean amplifies the sums' ~1e-7 relative error
# by sumsq / m2 = 1 + mean**2 / var: above 4 (|mean| > 1.7 std) take the scaled two-pass.
_CONDITION = 4.0


def _host_moments(x: Tensor, out: List[Entry], with_max: bool = False, one_read: bool = True) -> Optional[float]:
    """Fills mean, m2, nan and inf of ``x`` on the host. Returns max |x| where it came
    with the sums (``with_max`` and the native kernel, ``one_read``), else None."""
    x = x.detach()  # (the fast path hands it the graph's tensor: no autograd, no warning on float())
    n = x.numel()
    if one_read and n > _DOT_MAX:
        taken, top = _native_moments(x, out, with_max)
        if taken:
            return top
    own = x.dtype not in _WIDE
    if not own and n > _DOT_MAX and n % _ROW == 0 and x.is_contiguous():
        # The common case, straight to the kernels `_sum_of_squares` would pick (the same
        # values) without its checks: ~150 tensors a tracked step pay them. Row norms
        # first: the sum then finds x in cache (~1% of a tracked step).
        y = x
        sumsq = _norms_sum_of_squares(x.view(-1, _ROW))
        total = float(x.sum())
    else:
        y = _dense(x.float() if own else x)  # half types: one float32 copy (ours), then fast
        total = float(y.sum())
        sumsq = _sum_of_squares(y)
    if math.isfinite(total) and math.isfinite(sumsq):
        m2 = _one_pass_m2(total, sumsq, n, _TINY[y.dtype])
        if m2 is not None:
            out[_MEAN], out[_M2], out[_NAN], out[_INF] = total / n, m2, 0.0, 0.0
            return None
        shifted = _shifted_moments(y, total / n, sumsq)
        if shifted is not None:
            out[_MEAN], out[_M2], out[_NAN], out[_INF] = *shifted, 0.0, 0.0
            return None
    else:
        nan, inf = float(torch.isnan(x).sum()), float(torch.isinf(x).sum())
        if nan or inf:  # as torch.mean in float64: inf for [inf, 1, 2], NaN with a NaN or both infinities
            # (float64: finite values whose float32 sum overflows must not turn -inf into NaN)
            out[_MEAN], out[_M2], out[_NAN], out[_INF] = float(x.sum(dtype=torch.float64)) / n, math.nan, nan, inf
            return None
    mean, m2, _ = _scaled_moments(y, _host_sum, own=own)
    out[_MEAN], out[_M2], out[_NAN], out[_INF] = float(mean), float(m2), 0.0, 0.0
    return None


def _one_pass_m2(total: float, sumsq: float, n: int, tiny: float) -> Optional[float]:
    """``m2 = sumsq - total * mean`` where the one-pass sums can be trusted: finite, a mean
    square above ``tiny`` (no square lost bits) and ``sumsq <= _CONDITION * m2`` (the
    sums' error amplified at most that much); else None."""
    if not (math.isfinite(total) and math.isfinite(sumsq)):
        return None
    m2 = sumsq - total * (total / n)
    return m2 if sumsq >= n * tiny and _CONDITION * m2 >= sumsq else None


def _native_moments(x: Tensor, out: List[Entry], with_max: bool) -> Tuple[bool, Optional[float]]:
    """Mean, m2, nan and inf of ``x`` from one read of the native kernel, torch's other
    passes where its sums cannot be trusted (non-finite, tiny or mean-dominated values).
    Returns (whether the kernel took ``x``; nothing is filled where not, and max |x|
    where ``with_max`` and the sums are finite, so that it is exact, else None)."""
    got = native.sums(x, with_max)
    if got is None:
        return False, None
    total, sumsq, top = got
    n = x.numel()
    m2 = _one_pass_m2(total, sumsq, n, _TINY[torch.float32])  # (the kernel squares in float32, bfloat16 too)
    if m2 is not None:
        out[_MEAN], out[_M2], out[_NAN], out[_INF] = total / n, m2, 0.0, 0.0
    else:
        _host_moments(x, out, one_read=False)  # (its own reads: rare)
    exact = with_max and math.isfinite(total) and math.isfinite(sumsq)
    return True, top if exact else None


def _dense(y: Tensor) -> Tensor:
    """``y``'s elements in a contiguous layout without a copy where one exists: a
    transposed or permuted tensor (the sums do not depend on the order). Else ``y``."""
    if y.is_contiguous() or y.dim() < 2:
        return y
    order = sorted(range(y.dim()), key=lambda i: -y.stride(i))
    p = y.permute(order)
    return p if p.is_contiguous() else y


# Shifting by the mean squares y - c, down to ~2**-48 c: above this mean square that
# stays a float32 (float64) normal number.
_SHIFT_MIN = {torch.float32: 2.0**-40, torch.float64: 2.0**-800}


def _shifted_moments(y: Tensor, mean: float, sumsq: float) -> Optional[Tuple[float, float]]:
    """(mean, m2) of a mean-dominated ``y`` from ``z = y - c``, ``c`` the rough mean rounded
    to ``y``'s dtype: ``c + sum(z) / n`` and ``sum(z**2) - sum(z)**2 / n``. Near c,
    ``y - c`` is exact (Sterbenz), and the sum of squares is about m2 itself, so its
    ~1e-7 relative error stays ~1e-7. Two passes and a copy instead of the scaled path's
    seven. None where that does not hold (tiny values, or still ill-conditioned)."""
    n = y.numel()
    if not sumsq >= n * _SHIFT_MIN[y.dtype]:
        return None
    c = float(np.float32(mean)) if y.dtype == torch.float32 else mean  # (rounded to y's dtype)
    z = y - c  # (a copy: the scaled path may still need y)
    s1, s2 = float(z.sum()), _sum_of_squares(z)
    m2 = s2 - s1 * (s1 / n)
    return (c + s1 / n, m2) if math.isfinite(s2) and _CONDITION * m2 >= s2 else None


_DOT_MAX = 4096  # up to here a sum of squares is one float64 dot (above: vectorised float32 row norms)


def _sum_of_squares(y: Tensor) -> float:
    n = y.numel()
    if n <= _DOT_MAX and y.is_contiguous():  # small tensors are overhead-bound: one copy, one dot
        # (in float64: a float32 dot adds every square into one of a few running sums,
        # ~1e-6 off where one square dominates, such as an outlier among values near it)
        flat = y.view(-1).double()
        return float(torch.dot(flat, flat))
    if n % _ROW == 0 and y.is_contiguous():  # the common case: no copy, no tail
        rows = y.view(-1, _ROW)
    elif (strided := _strided_rows(y)) is not None:  # a slice of a wider tensor (q, k, v of a fused projection)
        rows = strided
    elif n < _ROW:
        return float(torch.linalg.vector_norm(y)) ** 2
    else:
        flat = y.reshape(-1)
        m = n // _ROW * _ROW
        tail = float(torch.linalg.vector_norm(flat[m:])) ** 2 if m < n else 0.0
        return _sum_of_squares(flat[:m]) + tail
    return _norms_sum_of_squares(rows)


def _norms_sum_of_squares(rows: Tensor) -> float:
    """The sum of squares of a 2-D tensor of short rows: their norms (vectorised,
    accurate), added by a dot of the norms."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    if norms.numel() > 4096:  # a float32 dot stays within ~1e-7 up to here
        norms = norms.double()
    return float(torch.dot(norms, norms))


_MIN_ROW = 64  # shorter strided rows: a copy and rows of 512 are faster


def _strided_rows(y: Tensor) -> Optional[Tensor]:
    """``y`` as 2-D rows of its contiguous last dimension without a copy, if there is
    such a view and the rows are long enough to be worth it."""
    if y.is_contiguous() or y.dim() < 2 or y.stride(-1) != 1 or y.size(-1) < _MIN_ROW:
        return None
    try:
        return y.view(-1, y.size(-1))
    except RuntimeError:  # the outer dimensions do not merge
        return None


def _device_moments(x: Tensor, out: List[Entry]) -> Tensor:
    out[_MEAN], out[_M2], absmax = _scaled_moments(x, _sum64, own=False)
    out[_NAN], out[_INF] = torch.isnan(x).sum(), torch.isinf(x).sum()
    return absmax


def _scaled_moments(x: Tensor, total_of: _Sum, own: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(mean, m2, absmax) as float64 0-dim tensors, accurate for any finite ``x``.

    Two passes on ``x * s``, with ``s`` the power of two that brings absmax to [1, 2)
    (exact; squares neither overflow nor underflow), about the float64 mean of the first
    pass (so no cancellation). Reads nothing to the host. ``own``: ``x`` may be
    overwritten.
    """
    n = x.numel()
    acc = _acc_dtype(x)
    lo, hi = torch.aminmax(x.detach())
    absmax = torch.maximum(lo.abs(), hi.abs()).to(acc)
    s = _inverse_power_of_two(absmax)
    y = x.mul_(s) if own else x.to(acc) * s if x.dtype == acc else x.to(acc).mul_(s)
    total = total_of(y)  # float64: the scaled sum, inf/NaN with non-finite values
    shift = (total / n).to(acc)
    y.sub_(shift)
    if total_of is _sum64:  # float64 total: sum(y - shift) follows, up to y - shift's rounding
        s1 = total - n * shift.double()
    else:  # a float32 total is too coarse for that: one more (cheap) pass
        s1 = total_of(y)
    s2 = total_of(y.square_())
    m2 = (s2 - s1 * s1 / n).clamp(min=0)
    s64 = s.double()
    return total / n / s64, m2 / s64 / s64, absmax.double()  # (s64 * s64 can underflow)


def _inverse_power_of_two(a: Tensor) -> Tensor:
    """2**-e with e the exponent of ``a`` (float32/float64 0-dim), from its bits: exact."""
    if a.dtype == torch.float64:
        itype, mant, bias = torch.int64, 52, 1023
    else:
        itype, mant, bias = torch.int32, 23, 127
    e = ((a.view(itype) >> mant) & (2 * bias + 1)) - bias  # subnormal: -bias; inf/NaN: bias+1
    e = e.clamp(1 - bias, bias - 1)  # keep 2**-e a normal number
    return ((bias - e) << mant).view(a.dtype)


# ---------------------------------------------------------------------------------------
# Range and format counts.


def _host_absmax(x: Tensor) -> float:
    lo, hi = torch.aminmax(x.detach())
    return max(abs(float(lo)), abs(float(hi)))


def _format_bounds(dtype: torch.dtype) -> Tuple[List[float], List[int], List[int]]:
    """Sorted boundaries for ``bucketize(|x|, right=True)``, and for each format field the
    boundary index whose cumulative count answers it (underflow/below_normal: ``x < b``;
    overflow: ``x >= next float above max``). The first boundary, the smallest positive
    number of ``dtype``, puts exactly the zeros in bucket 0."""
    if dtype == torch.float64:
        tiny, above = 2.0**-1074, (lambda v: math.nextafter(v, math.inf))
    else:
        tiny = 2.0**-149
        above = lambda v: float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf)))  # noqa: E731
    wanted = [tiny]
    for f in FORMATS.values():
        wanted += [f.min_subnormal, f.min_normal, above(f.max)]
    bounds = sorted(wanted)
    low = [bounds.index(t) for f in FORMATS.values() for t in (f.min_subnormal, f.min_normal)]
    high = [bounds.index(above(f.max)) for f in FORMATS.values()]
    return bounds, low, high


_BOUNDS = {dt: _format_bounds(dt) for dt in (torch.float32, torch.float64)}
_DEVICE_BOUNDS: Dict[Tuple[torch.dtype, torch.device], Tuple[Tensor, Tensor, Tensor]] = {}
#: The float32 format bounds as the bits the native kernel compares |x|'s bits with.
_NATIVE_BOUNDS = np.array(_BOUNDS[torch.float32][0], dtype=np.float32).view(np.int32)


def _bounds_on(dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
    key = (dtype, device)
    if key not in _DEVICE_BOUNDS:
        bounds, low, high = _BOUNDS[dtype]
        _DEVICE_BOUNDS[key] = (
            torch.tensor(bounds, dtype=dtype).to(device, non_blocking=True),
            index_tensor(low, device),
            index_tensor(high, device),
        )
    return _DEVICE_BOUNDS[key]


def _format_counts_device(x: Tensor, nan: Tensor) -> List[Entry]:
    """zeros, min_nonzero and the 12 format counts from one bucketize and one histogram.

    Temporaries per element: |x| (4 bytes, 8 for float64), bucket indices (int32, 4) and,
    off the CPU, the same as float32 for ``histc`` (4); a zero mask (1).
    """
    acc = _acc_dtype(x)
    if x.dtype == acc and x.is_contiguous():
        a = x.abs()
    else:  # one contiguous copy (bucketize would copy a strided input once more)
        a = torch.empty_like(x, dtype=acc, memory_format=torch.contiguous_format).copy_(x).abs_()
    a.nan_to_num_(nan=0.0, posinf=math.inf)  # NaN joins the zeros' bucket; subtracted below
    bounds, low, high = _bounds_on(acc, a.device)
    idx = torch.bucketize(a, bounds, right=True, out_int32=True).view(-1)
    cum = _histogram(idx, bounds.numel() + 1).cumsum(0)  # cum[k] = #{|x| < bounds[k]}
    del idx
    min_nonzero = a.masked_fill_(a == 0, math.inf).amin()
    below = cum[low] - cum[0]  # (2 * formats,) nonzero values under each threshold
    over = cum[-1] - cum[high]  # (formats,)
    k = len(FORMATS)
    fields = torch.cat([below.view(k, 2), over.view(k, 1)], dim=1).view(-1)  # FIELDS order
    return [cum[0] - nan, min_nonzero, *fields.unbind()]


def _histogram(idx: Tensor, bins: int) -> Tensor:
    """Float64 counts of int32 bucket indices, without a host read."""
    if idx.device.type == "cpu":  # CPU histc is slow (~20x index_add_)
        ones = torch.ones((), dtype=torch.float64).expand(idx.numel())
        return torch.zeros(bins, dtype=torch.float64).index_add_(0, idx, ones)
    # histc keeps shared-memory bins on GPUs; its float32 counts are exact below 2**24.
    parts = [torch.histc(chunk.float(), bins, 0, bins).double() for chunk in idx.split(1 << 24)]
    return torch.stack(parts).sum(0)


def _format_counts_host(x: Tensor, nan: float) -> Tuple[List[Entry], float]:
    """As ``_format_counts_device``, for a tensor in host memory, and max |x| (NaN with NaN).

    numpy's vectorised compare-and-count (~0.15 ns an element) per threshold is ~8x
    cheaper than a histogram (``bincount``, ~1 ns an element). The extremes of |x| answer
    most thresholds without a pass: none of |x| is below min |x|, all of it is below a
    bound above max |x|. (Counting the smaller thresholds among the values below a larger
    one only, after a boolean-index copy, was slower at 64K-256K elements; ``np.compress``
    too on the gradients and activations of a GPT step.)
    """
    at = (x if x.dtype in _WIDE else x.float()).abs()
    a = at.numpy().reshape(-1)  # (a view: abs returned a dense tensor)
    if a.size <= _SMALL and not nan:
        return _format_counts_small(a)
    wide, mask = a.dtype.type, np.empty(a.shape, dtype=bool)  # one scratch buffer for every comparison
    lo, hi = (math.nan, math.nan) if nan else map(float, torch.aminmax(at))  # one pass
    zeros = float(np.count_nonzero(np.equal(a, 0, out=mask))) if not lo > 0 else 0.0  # NaN lo: count
    if nan or zeros:  # NaN never wins, zeros are left out; inf where nothing else
        min_nonzero = float(np.min(a, where=np.greater(a, 0, out=mask), initial=math.inf))
    else:
        min_nonzero = lo
    below: Dict[float, float] = {}
    for t in _LOW_BOUNDS:  # nonzero values below t
        if t <= lo or t > hi:
            below[t] = 0.0 if t <= lo else a.size - zeros
        else:
            below[t] = float(np.count_nonzero(np.less(a, wide(t), out=mask))) - zeros
    res: List[Entry] = [zeros, min_nonzero]
    for fmt in FORMATS.values():
        over = 0.0 if hi <= fmt.max else float(np.count_nonzero(np.greater(a, wide(fmt.max), out=mask)))
        res += [below[fmt.min_subnormal], below[fmt.min_normal], over]
    return res, hi


#: The distinct lower thresholds of the format counts (smallest subnormals and normals).
_LOW_BOUNDS = sorted({t for f in FORMATS.values() for t in (f.min_subnormal, f.min_normal)})
#: Up to this many elements one sorted search over every boundary costs less than a pass
#: per threshold (small tensors are call-bound: biases, norms' weights).
_SMALL = 1024
_NUMPY_BOUNDS = {np.dtype(np.float32): np.array(_BOUNDS[torch.float32][0], dtype=np.float32), np.dtype(np.float64): np.array(_BOUNDS[torch.float64][0])}


def _format_counts_small(a: "np.ndarray") -> Tuple[List[Entry], float]:
    """``_format_counts_host`` of a short |x| without NaN: the bucket of each element
    among the sorted boundaries (as ``_format_counts_device``), counted in one call."""
    bounds = _NUMPY_BOUNDS[a.dtype]
    cum = np.bincount(np.searchsorted(bounds, a, side="right"), minlength=bounds.size + 1).cumsum().tolist()
    zeros = cum[0]  # cum[k] = #{|x| < bounds[k]}; bounds[0], the smallest positive number: zeros
    positive = a[a > 0] if zeros else a
    fields = _format_fields_of_row(cum, torch.float64 if a.dtype == np.float64 else torch.float32)
    return [float(zeros), float(positive.min()) if positive.size else math.inf, *fields], float(a.max())


def _format_pairs(dtype: torch.dtype) -> Tuple[List[int], List[int]]:
    """Column pairs (plus, minus) of cumulative bucket counts among ``_BOUNDS[dtype]``, one
    per format field in FIELDS order: field = cum[plus] - cum[minus], with ``cum[k]`` =
    #{|x| < bounds[k]} and the last column the count of all (NaN counted in bucket 0, or
    left out of every column): the nonzero values under each format's two lower thresholds
    (minus the zeros, column 0) and those at or above the next float after its max."""
    _, low, high = _BOUNDS[dtype]
    last = len(_BOUNDS[dtype][0])
    plus: List[int] = []
    minus: List[int] = []
    for k in range(len(FORMATS)):
        plus += [low[2 * k], low[2 * k + 1], last]
        minus += [0, 0, high[k]]
    return plus, minus


_FORMAT_PAIRS = {dt: _format_pairs(dt) for dt in (torch.float32, torch.float64)}


def _format_fields_of_cumulative(cum: "np.ndarray", dtype: torch.dtype) -> "np.ndarray":
    """The format counts (FIELDS order, float64) of each row of ``cum`` (see
    ``_format_pairs``). Shared by the host paths, one tensor or many (``short_records``)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return (cum[:, plus] - cum[:, minus]).astype(np.float64)


def _format_fields_of_row(cum: List[int], dtype: torch.dtype) -> List[float]:
    """``_format_fields_of_cumulative`` of one row as a list (in Python: on 14 numbers it
    costs ~10 us less than numpy, and it runs once per recorded tensor)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return [float(cum[p] - cum[m]) for p, m in zip(plus, minus)]


# ---------------------------------------------------------------------------------------
# FP8 what-if: per-tensor amax scaling, cast, and the error it makes.


def _fp8_fields(x: Tensor, total_of: _Sum) -> List[Tensor]:
    """For E4M3 then E5M2: sum of squared error, sum of squares, nonzeros flushed to 0.

    Quantisation as a per-tensor-scaled FP8 recipe does it: ``scale = max / amax`` (in
    float32, float64 for float64 tensors; capped at the largest finite number),
    ``q = fp8(x * scale)``. The error is what dequantising loses, ``q / scale - x``, taken
    in float64 as ``(q - x * scale) / scale``. Non-finite elements are left out (zero
    error, zero square, not flushed): the ``nan``/``inf`` counts report them.
    """
    acc = _acc_dtype(x)
    xf = torch.nan_to_num(x.to(acc), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = torch.aminmax(xf)
    amax = torch.maximum(lo.abs(), hi.abs())
    nonzero = torch.count_nonzero(xf)
    x64 = xf.double()
    sq = total_of(x64.square())  # the same for both formats
    out: List[Tensor] = []
    for name, dtype in FP8_DTYPES.items():
        # (a Python number / tensor would multiply by a rounded reciprocal)
        scale = torch.nan_to_num(torch.full_like(amax, FORMATS[name].max) / amax, posinf=torch.finfo(acc).max)
        q = _widen((xf * scale).to(dtype))
        flushed = nonzero - torch.count_nonzero(q)
        # Against x itself: near-exact tensors (SNR ~100 dB) have errors close to the
        # float32 rounding of x * scale. In float64, x * scale is exact for float32 and
        # half x and so is q - x * scale (no fused multiply-add: y as the cast saw it).
        # Back in x's units before squaring: for float64 x with a wide range, squares of
        # tiny scaled errors would be float64 subnormals.
        s64 = scale.double()
        sq_err = total_of(q.sub_(x64 * s64).div_(s64).square_())
        out += [sq_err, sq, flushed.double()]
    return out


def _widen(q: Tensor) -> Tensor:
    """``q.double()``; on CPU for E4M3 by a 256-entry table (torch's CPU kernel widens E4M3
    element by element: 3.3 ms for 512K elements, the table 1.3 ms; the same values)."""
    if q.device.type != "cpu" or q.dtype != torch.float8_e4m3fn:
        return q.double()
    table = torch.arange(256, dtype=torch.uint8).view(q.dtype).double()
    return torch.take(table, q.view(torch.uint8).long())


# ---------------------------------------------------------------------------------------
# Assembly, merging and derived statistics on float64 record tensors.


def assemble(rows: Sequence[Sequence[Entry]], device: Optional[torch.device] = None, host_only: bool = False) -> Tensor:
    """Stack per-tensor entry lists into one float64 ``[N, len(FIELDS)]`` tensor.

    Host-known floats are placed first; device entries are stacked (a handful of kernel
    launches in total, whatever N) and scattered in. Nothing is read back to the host.
    ``host_only`` says every entry is a float (records taken with host reads): one copy.
    """
    if host_only:  # (numpy builds it from Python floats ~3x faster than torch.tensor)
        out = torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), len(FIELDS)))
        return out if device is None else out.to(device)
    template = torch.tensor([[v if isinstance(v, float) else 0.0 for v in row] for row in rows], dtype=torch.float64).reshape(len(rows), len(FIELDS))
    by_dtype: Dict[torch.dtype, Tuple[List[int], List[Tensor]]] = {}
    for r, row in enumerate(rows):
        for c, v in enumerate(row):
            if isinstance(v, Tensor):
                positions, values = by_dtype.setdefault(v.dtype, ([], []))
                positions.append(r * len(FIELDS) + c)
                values.append(v.reshape(()))
    if not by_dtype:
        return template if device is None else template.to(device)
    dev = next(iter(by_dtype.values()))[1][0].device if device is None else device
    out = template.to(dev, non_blocking=True)
    for positions, values in by_dtype.values():  # one stack and one cast per dtype
        out.view(-1)[index_tensor(positions, dev)] = torch.stack(values).to(torch.float64)
    return out


def index_tensor(values: Sequence[int], device: torch.device) -> Tensor:
    """An int64 index tensor on ``device``, copied without a blocking host sync."""
    return torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)


def merge(a: Tensor, b: Tensor) -> Tensor:
    """Merge two record tensors ``[..., len(FIELDS)]`` as if their tensors were concatenated."""
    na, nb = a[..., _COUNT], b[..., _COUNT]
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = b[..., _MEAN] - a[..., _MEAN]
    out = a + b  # counts add
    # An empty record is the identity: the fields it never computed (NaN) must not spread.
    out = torch.where((na == 0).unsqueeze(-1), b, torch.where((nb == 0).unsqueeze(-1), a, out))
    out[..., _MEAN] = torch.where(n > 0, a[..., _MEAN] + delta * nb / safe, torch.zeros_like(n))
    out[..., _M2] = a[..., _M2] + b[..., _M2] + delta * delta * na * nb / safe
    # Empty records carry no information about extremes.
    out[..., _ABSMAX] = _pick(na, nb, a[..., _ABSMAX], b[..., _ABSMAX], torch.maximum)
    out[..., _MINNZ] = _pick(na, nb, a[..., _MINNZ], b[..., _MINNZ], torch.minimum)
    return out


def _pick(na: Tensor, nb: Tensor, x: Tensor, y: Tensor, op) -> Tensor:  # type: ignore[no-untyped-def]
    both = op(x, y)
    return torch.where(na == 0, y, torch.where(nb == 0, x, both))


def merge_rows(records: Tensor, dim: int = 0) -> Tensor:
    """Merge records along ``dim`` pairwise (a tree, so rounding stays balanced)."""
    parts = list(records.unbind(dim))
    while len(parts) > 1:
        nxt = [merge(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def statistic(records: Tensor, name: str) -> Tensor:
    """Derive a named statistic (see ``STATISTICS``) from record(s) ``[..., len(FIELDS)]``."""
    if name not in STATISTICS:
        raise ValueError(f"Unknown statistic {name!r}; choose from {sorted(STATISTICS)}")
    n = records[..., _COUNT]
    if name == "std":
        # Bessel's correction as torch.std; a single element has spread 0, not NaN.
        return (records[..., _M2] / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
    if name == "rms":
        return ((records[..., _M2] + n * records[..., _MEAN] ** 2) / n.clamp(min=1)).sqrt()
    if name in ("count", "mean", "absmax", "nan", "inf", "min_nonzero"):
        return records[..., _IX[name]]
    if name.endswith("_snr_db"):
        return _snr_db(records, name[: -len("_snr_db")])
    # zeros, format counts and fp8 flushed counts are reported as fractions of the count
    return records[..., _IX[name]] / n.clamp(min=1)


def _snr_db(records: Tensor, prefix: str) -> Tensor:
    # 10 log10(sum x^2 / sum err^2); no error at all (an exact or all-zero tensor): +inf.
    err, sq = records[..., _IX[f"{prefix}_sq_err"]], records[..., _IX[f"{prefix}_sq"]]
    return torch.where(err == 0, torch.full_like(err, math.inf), 10 * torch.log10(sq / err))


def summarise(record: Tensor, names: Iterable[str] = STATISTICS) -> Dict[str, float]:
    """A dict of named statistics from one record (host tensor)."""
    return {name: float(statistic(record, name)) for name in names}


#: Octave bins of ``log2_histogram``: bin i counts values with floor(log2|x|) == LOG2_LO + i.
LOG2_LO, LOG2_HI = -160, 130


def log2_histogram(x: Tensor) -> Tensor:
    """Counts of floor(log2|x|) per octave in ``[LOG2_LO, LOG2_HI)``, on x's device, no sync.

    Zeros and non-finite values are not counted (they have their own statistics).
    """
    a = x.detach().abs()
    a = a if a.dtype == torch.float64 else a.float()
    valid = (a > 0) & torch.isfinite(a)
    safe = torch.where(valid, a, torch.ones_like(a))
    e = torch.floor(torch.log2(safe)).clamp(LOG2_LO, LOG2_HI - 1) - LOG2_LO
    e = torch.where(valid, e, torch.full_like(e, LOG2_HI - LOG2_LO)).long().flatten()
    counts = torch.zeros(LOG2_HI - LOG2_LO + 1, dtype=torch.float64, device=a.device)
    counts.scatter_add_(0, e, torch.ones_like(e, dtype=torch.float64))
    return counts[:-1]
