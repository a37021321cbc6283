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
    returns absmax. Six full-size ops and one temporary (``y``, float32, float64 for
    float64 ``x``), none of the copies ATen makes inside ``sum(dtype=...)`` or a bool
    mask's ``sum()``:

    1. max |x| by ``vector_norm(x, inf)`` (NaN with a NaN, inf with an inf);
    2. ``y = x * s - c``: ``s`` the power of two that brings max |x| to [1, 2) (exact:
       squares neither overflow nor underflow), ``c`` the first element scaled (finite,
       else 0), so that a mean far above the spread cancels here, exactly near ``c``;
    3. ``var_mean`` of rows of ``_ROW`` elements of ``y`` (in float32 on accelerators,
       short rows), merged in float64 by Chan's formula;
    4. the NaN, +Inf and -Inf counts: each a comparison written into ``y`` as 0/1 and
       float32 row sums (exact) added in float64."""
    acc = _acc_dtype(x)
    absmax = torch.linalg.vector_norm(x, ord=math.inf).to(acc)
    s = _inverse_power_of_two(absmax)
    first = x[(0,) * x.dim()].to(acc)  # (a view of one element: no read)
    c = torch.where(torch.isfinite(first), first * s, torch.zeros_like(first))
    if x.dtype == acc:  # one contiguous temporary, one pass
        y = torch.addcmul(-c, x, s, out=torch.empty(x.shape, dtype=acc, device=x.device))
    else:  # (half types: widened first, so that x * s cannot underflow)
        y = x.to(dtype=acc, memory_format=torch.contiguous_format).mul_(s).sub_(c)
    mean_y, m2_y = _rows_moments64(y)
    s64 = s.double()
    mean, m2 = (mean_y + c.double()) / s64, m2_y / s64 / s64  # (s64 * s64 can underflow)
    nan = _rows_sum64(torch.ne(x, x, out=y))
    pos = _rows_sum64(torch.eq(x, math.inf, out=y))
    neg = _rows_sum64(torch.eq(x, -math.inf, out=y))
    # as torch.mean of the float64 values: NaN with a NaN or both infinities, else the infinity
    nan_, inf_ = torch.full_like(mean, math.nan), torch.full_like(mean, math.inf)
    mean = torch.where(pos > 0, inf_, torch.where(neg > 0, -inf_, mean))
    mean = torch.where((nan > 0) | ((pos > 0) & (neg > 0)), nan_, mean)
    out[_MEAN], out[_M2] = mean, torch.where(nan + pos + neg > 0, nan_, m2.clamp(min=0))
    out[_NAN], out[_INF] = nan, pos + neg
    return absmax.double()


_ROW = 256  # rows of this many elements: float32 row results, merged in float64


def _rows_moments64(y: Tensor) -> Tuple[Tensor, Tensor]:
    """(mean, m2) of a contiguous ``y`` as float64 0-dim tensors: ``var_mean`` of its
    rows of ``_ROW`` (and of the tail), merged by Chan's formula in its vector form."""
    flat = y.view(-1)
    n = flat.numel()
    m = n // _ROW * _ROW
    parts = []  # (count, means, variances)
    if m:
        var, mu = torch.var_mean(flat[:m].view(-1, _ROW), dim=1, correction=0)
        parts.append((_ROW, mu.double(), var.double()))
    if m < n:
        var, mu = torch.var_mean(flat[m:], correction=0)
        parts.append((n - m, mu.double().view(1), var.double().view(1)))
    mean = sum(k * mu.sum() for k, mu, _ in parts) / n
    m2 = sum(k * (var.sum() + ((mu - mean) ** 2).sum()) for k, mu, var in parts)
    return mean, m2  # type: ignore[return-value]


def _rows_sum64(y: Tensor) -> Tensor:
    """Float64 sum of a contiguous ``y``: sums of rows of ``_ROW`` in ``y``'s dtype, added
    in float64 (``sum(dtype=float64)`` would copy the whole of ``y`` to float64 first).
    Exact for 0/1 masks."""
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
