"""The device path: statistics computed where the tensor lives, nothing read back.

Every entry stays a 0-dim tensor on the device until the step's records are assembled
and read back once.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.fields import Col, Entry, SumFn, acc_dtype, sum64


def device_moments(x: Tensor, out: List[Entry]) -> Tensor:
    """Mean, m2, nan and inf of ``x`` by torch's kernels (no Triton), nothing read back;
    returns absmax. One temporary (``y``: float32, float64 for float64 ``x``) and none of
    the copies ATen makes inside ``sum(dtype=...)`` or a bool mask's ``sum()``:

    1. ``aminmax(x)``: max |x|, and with ±Inf or NaN the mean as ``torch.mean`` gives it
       (``lo + hi``: inf, -inf, NaN with both or a NaN);
    2. ``y = x * s - c``: ``s`` the power of two that brings max |x| to [1, 2) (exact:
       squares neither overflow nor underflow), ``c`` the first element scaled (finite,
       else 0), so that a mean far above the spread cancels here, exactly near ``c``;
    3. ``var_mean`` of rows of ``_ROW`` elements of ``y`` (in float32 on accelerators:
       short rows), merged in float64 by Chan's formula (``var_mean`` of the row means);
    4. NaN and non-finite counts: comparisons written into ``y`` as 0/1, float32 row
       sums (exact) added in float64."""
    acc = acc_dtype(x)
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(lo.abs(), hi.abs()).to(acc)
    s = _inverse_power_of_two(absmax)
    first = x[(0,) * x.dim()].to(acc)  # (a view of one element: no read)
    c = torch.nan_to_num(first * s, nan=0.0, posinf=0.0, neginf=0.0)
    if x.dtype == acc:  # one contiguous temporary, one pass
        y = torch.addcmul(-c, x, s, out=torch.empty(x.shape, dtype=acc, device=x.device))
    else:  # (half types: widened first, so that x * s cannot underflow)
        y = x.to(dtype=acc, memory_format=torch.contiguous_format).mul_(s).sub_(c)
    mean_y, m2_y = _rows_moments64(y)
    s64, ends = s.double(), lo.double() + hi.double()  # ends: finite unless ±Inf or NaN
    zero = ends * 0  # 0, or NaN with ±Inf or NaN
    finite = zero == 0
    out[Col.MEAN] = torch.where(finite, (mean_y + c.double()) / s64, ends)
    out[Col.M2] = torch.where(finite, m2_y / s64 / s64, zero)  # (s64 * s64 can underflow)
    nan = _rows_sum64(torch.ne(x, x, out=y))
    torch.sub(x, x, out=y)  # NaN where x is not finite
    out[Col.NAN], out[Col.INF] = nan, _rows_sum64(y.ne_(y)) - nan
    return absmax.double()


_ROW = 256  # rows of this many elements: float32 row results, merged in float64


def _rows_moments64(y: Tensor) -> Tuple[Tensor, Tensor]:
    """(mean, m2) of a contiguous ``y`` as float64 0-dim tensors: ``var_mean`` of its
    rows of ``_ROW`` elements (and of the tail), merged by Chan's formula."""
    flat = y.view(-1)
    n = flat.numel()
    m = n // _ROW * _ROW
    if m == 0:
        var, mean = torch.var_mean(flat.double(), correction=0)  # (fewer than _ROW elements)
        return mean.double(), var.double() * n
    var, mu = torch.var_mean((flat if m == n else flat[:m]).view(-1, _ROW), dim=1, correction=0)
    spread, mean = torch.var_mean(mu.double(), correction=0)  # of the row means
    m2 = (var.double().sum() + spread * mu.numel()) * _ROW
    if m == n:
        return mean, m2
    tail_var, tail_mean = torch.var_mean(flat[m:].double(), correction=0)  # (< _ROW elements)
    k = n - m
    delta = tail_mean - mean
    return mean + delta * (k / n), m2 + tail_var * k + delta * delta * (m * k / n)


def _rows_sum64(y: Tensor) -> Tensor:
    """Float64 sum of a contiguous ``y``: sums of rows of ``_ROW`` in ``y``'s dtype, added
    in float64 (``sum(dtype=float64)`` would copy the whole of ``y`` to float64 first).
    Exact for 0/1 masks."""
    if y.dtype == torch.float64:
        return y.sum()
    flat = y.view(-1)
    m = flat.numel() // _ROW * _ROW
    total = (flat if m == flat.numel() else flat[:m]).view(-1, _ROW).sum(1).double().sum()
    return total + flat[m:].double().sum() if m < flat.numel() else total


def scaled_moments(x: Tensor, total_of: SumFn, own: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(mean, m2, absmax) as float64 0-dim tensors, accurate for any finite ``x``.

    Two passes on ``x * s``, with ``s`` the power of two that brings absmax to [1, 2)
    (exact; squares neither overflow nor underflow), about the float64 mean of the first
    pass (so no cancellation). Reads nothing to the host. ``own``: ``x`` may be
    overwritten.
    """
    n = x.numel()
    acc = acc_dtype(x)
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(lo.abs(), hi.abs()).to(acc)
    s = _inverse_power_of_two(absmax)
    y = x.mul_(s) if own else x.to(acc) * s if x.dtype == acc else x.to(acc).mul_(s)
    total = total_of(y)  # float64: the scaled sum, inf/NaN with non-finite values
    shift = (total / n).to(acc)
    y.sub_(shift)
    if total_of is sum64:  # float64 total: sum(y - shift) follows, up to y - shift's rounding
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
