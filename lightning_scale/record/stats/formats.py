"""Format counts: zeros, the least nonzero |x|, and for each of ``FORMATS`` the values
below its subnormal and normal ranges and above its maximum, on the device or the host."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats.fields import FORMATS, GROUPS, WIDE_DTYPES, Entry, acc_dtype, index_tensor
from lightning_scale.record.stats.layout import piece_size, pieces


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


BOUNDS = {dt: _format_bounds(dt) for dt in (torch.float32, torch.float64)}
_DEVICE_BOUNDS: Dict[Tuple[torch.dtype, torch.device], Tuple[Tensor, Tensor, Tensor]] = {}
#: The float32 format bounds as the bits the native kernel compares |x|'s bits with.
NATIVE_BOUNDS = np.array(BOUNDS[torch.float32][0], dtype=np.float32).view(np.int32)


def _bounds_on(dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
    key = (dtype, device)
    if key not in _DEVICE_BOUNDS:
        bounds, low, high = BOUNDS[dtype]
        _DEVICE_BOUNDS[key] = (
            torch.tensor(bounds, dtype=dtype).to(device, non_blocking=True),
            index_tensor(low, device),
            index_tensor(high, device),
        )
    return _DEVICE_BOUNDS[key]


def format_counts_device(x: Tensor, nan: Tensor) -> List[Entry]:
    """zeros, min_nonzero and the 12 format counts from one bucketize and one histogram.

    Temporaries per element: |x| (4 bytes, 8 for float64), bucket indices (int32, 4) and,
    off the CPU, the same as float32 for ``histc`` (4); a zero mask (1).
    """
    acc = acc_dtype(x)
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


#: Bytes of temporaries per element ``format_counts_host`` takes at most: |x| (float32,
#: float64 for float64; a half tensor's float32 copy before it) and a bool mask.
_FORMAT_SCRATCH = 12
_MIN_NONZERO = GROUPS["formats"].index("min_nonzero")  # (the results are the formats group's fields, in order)


def format_counts_host(x: Tensor, nan: float) -> Tuple[List[Entry], float]:
    """As ``format_counts_device``, for a tensor in host memory, and max |x| (NaN with
    NaN). A tensor whose temporaries would exceed ``layout.scratch_bytes`` is counted in
    pieces (the counts add, the extremes are the pieces' extremes)."""
    size = piece_size(x, _FORMAT_SCRATCH)
    if x.numel() <= size:
        return _format_counts_whole(x, nan)
    parts = [_format_counts_whole(piece, nan) for piece in pieces(x, size)]
    fields = [sum(column) for column in zip(*(res for res, _ in parts))]  # (exact: integers below 2**53)
    fields[_MIN_NONZERO] = min(res[_MIN_NONZERO] for res, _ in parts)  # (the least, not a sum)
    return fields, math.nan if nan else max(top for _, top in parts)


def _format_counts_whole(x: Tensor, nan: float) -> Tuple[List[Entry], float]:
    """``format_counts_host`` of ``x`` in one piece.

    numpy's vectorised compare-and-count (~0.15 ns an element) per threshold is ~8x
    cheaper than a histogram (``bincount``, ~1 ns an element). The extremes of |x| answer
    most thresholds without a pass: none of |x| is below min |x|, all of it is below a
    bound above max |x|. (Counting the smaller thresholds among the values below a larger
    one only, after a boolean-index copy, was slower at 64K-256K elements; ``np.compress``
    too on the gradients and activations of a GPT step.)
    """
    at = (x if x.dtype in WIDE_DTYPES else x.float()).abs()
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
_NUMPY_BOUNDS = {
    np.dtype(np.float32): np.array(BOUNDS[torch.float32][0], dtype=np.float32),
    np.dtype(np.float64): np.array(BOUNDS[torch.float64][0]),
}


def _format_counts_small(a: "np.ndarray") -> Tuple[List[Entry], float]:
    """``format_counts_host`` of a short |x| without NaN: the bucket of each element
    among the sorted boundaries (as ``format_counts_device``), counted in one call."""
    bounds = _NUMPY_BOUNDS[a.dtype]
    cum = np.bincount(np.searchsorted(bounds, a, side="right"), minlength=bounds.size + 1).cumsum().tolist()
    zeros = cum[0]  # cum[k] = #{|x| < bounds[k]}; bounds[0], the smallest positive number: zeros
    positive = a[a > 0] if zeros else a
    fields = format_fields_of_row(cum, torch.float64 if a.dtype == np.float64 else torch.float32)
    return [float(zeros), float(positive.min()) if positive.size else math.inf, *fields], float(a.max())


def _format_pairs(dtype: torch.dtype) -> Tuple[List[int], List[int]]:
    """Column pairs (plus, minus) of cumulative bucket counts among ``BOUNDS[dtype]``, one
    per format field in FIELDS order: field = cum[plus] - cum[minus], with ``cum[k]`` =
    #{|x| < bounds[k]} and the last column the count of all (NaN counted in bucket 0, or
    left out of every column): the nonzero values under each format's two lower thresholds
    (minus the zeros, column 0) and those at or above the next float after its max."""
    _, low, high = BOUNDS[dtype]
    last = len(BOUNDS[dtype][0])
    plus: List[int] = []
    minus: List[int] = []
    for k in range(len(FORMATS)):
        plus += [low[2 * k], low[2 * k + 1], last]
        minus += [0, 0, high[k]]
    return plus, minus


_FORMAT_PAIRS = {dt: _format_pairs(dt) for dt in (torch.float32, torch.float64)}


def format_fields_of_cumulative(cum: "np.ndarray", dtype: torch.dtype) -> "np.ndarray":
    """The format counts (FIELDS order, float64) of each row of ``cum`` (see
    ``_format_pairs``). Shared by the host paths, one tensor or many (``short_records``)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return (cum[:, plus] - cum[:, minus]).astype(np.float64)


def format_fields_of_row(cum: List[int], dtype: torch.dtype) -> List[float]:
    """``format_fields_of_cumulative`` of one row as a list (in Python: on 14 numbers it
    costs ~10 us less than numpy, and it runs once per recorded tensor)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return [float(cum[p] - cum[m]) for p, m in zip(plus, minus)]
