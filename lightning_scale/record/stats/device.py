"""The device path: statistics computed where the tensor lives, nothing read back.

Every entry stays a 0-dim tensor on the device until the step's records are assembled
and read back once.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.fields import _INF, _M2, _MEAN, _NAN, Entry, _acc_dtype, _Sum, _sum64


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
