"""The device path: statistics computed where the tensor lives, nothing read back.

Every entry stays a 0-dim tensor on the device until the step's records are assembled
and read back once.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.fields import _INF, _M2, _MEAN, _NAN, Entry, _acc_dtype, _Sum, _sum64


def _device_moments(x: Tensor, out: List[Entry]) -> Tensor:
    """Mean, m2, nan and inf of ``x`` by torch's kernels (no Triton), nothing read back;
    returns absmax. The scaled two-pass of ``_scaled_moments`` without its hidden copies:
    max |x| by one ``vector_norm``, sums as float32 partial sums of rows (``_ROW``)
    added in float64, squares in place, counts by ``count_nonzero`` of a mask (no int64
    copy). Temporaries: ``x * s`` in float32 (float64 for float64 ``x``), the row sums
    (1/16 byte an element) and a one-byte mask."""
    n = x.numel()
    acc = _acc_dtype(x)
    absmax = torch.linalg.vector_norm(x, ord=math.inf).to(acc)  # NaN with a NaN, inf with an inf
    s = _inverse_power_of_two(absmax)
    # one contiguous temporary; exact (a power of two, in acc: half types would underflow)
    if x.dtype == acc:
        y = torch.mul(x, s, out=torch.empty(x.shape, dtype=acc, device=x.device))
    else:
        y = x.to(dtype=acc, memory_format=torch.contiguous_format).mul_(s)
    total = _rows_sum64(y)  # float64: the scaled sum, inf/NaN with non-finite values
    shift = (total / n).to(acc)
    y.sub_(shift)
    s1 = _rows_sum64(y)  # (total - n * shift would carry the float32 partial sums' error)
    s2 = _rows_sum64(y.square_())
    m2 = (s2 - s1 * s1 / n).clamp(min=0)
    s64 = s.double()
    out[_MEAN], out[_M2] = total / n / s64, m2 / s64 / s64  # (s64 * s64 can underflow)
    out[_NAN], out[_INF] = torch.count_nonzero(torch.isnan(x)).double(), torch.count_nonzero(torch.isinf(x)).double()
    return absmax.double()


# Float32 partial sums of this many elements, added in float64. Short: a row holding one
# value far above the others (an outlier among deviations) adds the small ones to a
# large running sum in each vector lane, 4-8 times per lane here, not 64-128 times (rows of
# 1024: 4e-6 off on such a tensor; tests/test_stats_property.py).
_ROW = 64


def _rows_sum64(y: Tensor) -> Tensor:
    """Float64 sum of a contiguous ``y``: float32 sums of rows of ``_ROW``, added in float64
    (``sum(dtype=float64)`` would copy the whole of ``y`` to float64 first)."""
    if y.dtype == torch.float64:
        return y.sum()
    flat = y.view(-1)
    m = flat.numel() // _ROW * _ROW
    total = flat[:m].view(-1, _ROW).sum(1).double().sum()
    return total + flat[m:].double().sum() if m < flat.numel() else total


def _scaled_moments(x: Tensor, total_of: _Sum, own: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(mean, m2, absmax) as float64 0-dim tensors, accurate for any finite ``x``.

    Two passes on ``x * s``, with ``s`` the power of two that brings absmax to [1, 2)
    (exact; squares neither overflow nor underflow), about the float64 mean of the first
    pass (so no cancellation). Reads nothing to the host. ``own``: ``x`` may be
    overwritten.
    """
    n = x.numel()
    acc = _acc_dtype(x)
    lo, hi = torch.aminmax(x)
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
