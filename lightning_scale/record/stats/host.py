"""The host path: statistics of tensors in host memory, read back as they are computed.

Moments from one read where the native kernel takes the tensor (``native``), else from
torch's kernels: one-pass sums where they can be trusted, a shifted or scaled two-pass
otherwise. ``fast_host_record`` is the recorder's short path for long tensors.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record import native
from lightning_scale.record.stats.device import scaled_moments
from lightning_scale.record.stats.fields import (
    FORMAT_COUNTS_SPAN,
    WIDE_DTYPES,
    Col,
    Entry,
    assemble,
    host_sum,
    merge_rows,
    nan_row,
)
from lightning_scale.record.stats.layout import dense_view, piece_size, pieces
from lightning_scale.record.stats.formats import NATIVE_BOUNDS, format_fields_of_row


def fast_host_record(groups: Collection[str]) -> Optional[Callable[[Tensor], Optional[List[Entry]]]]:
    """For groups within moments, range and formats: a function giving
    ``record_of(x, groups, True)`` of a tensor (the recorder's use: above 4096 elements; the
    compiled route's host op: any size, within ~1e-7 of ``record_of``'s short path) from one read of the
    native kernel (``lightning_scale.record.native``), with fewer steps than ``record_of`` takes
    (a tracked step calls it for every recorded tensor), or None where that does not apply
    (the kernel declines the tensor; without formats, also where its values are not
    finite, tiny or mean-dominated: the cases ``record_of`` hands to its other passes).
    None for other groups (fp8)."""
    if set(groups) == {"moments", "formats"} or set(groups) == {"moments", "range", "formats"}:
        keep_max = "range" in groups

        def record(x: Tensor) -> Optional[List[Entry]]:  # (the name the benchmarks profile)
            out = nan_row()
            if not native_every_group(x, out):
                return None
            out[Col.COUNT] = float(x.numel())
            if not keep_max:
                out[Col.ABSMAX] = math.nan
            return out

        return record
    if not set(groups) <= {"moments", "range"}:
        return None
    with_max = "range" in groups

    def record(x: Tensor) -> Optional[List[Entry]]:  # (the name the benchmarks profile)
        out = nan_row()
        taken, top = _native_moments(x, out, with_max)
        if not taken:
            return None
        out[Col.COUNT] = float(x.numel())
        if with_max:
            out[Col.ABSMAX] = top if top is not None else host_absmax(x)
        return out

    return record


def native_every_group(x: Tensor, out: List[Entry]) -> bool:
    """Fills the moments, absmax and the formats group of ``x`` from one read of the
    native kernel (``native.every_group``); False, with nothing filled, where it declines
    ``x``. Moments the one-pass sums cannot give (non-finite, tiny or mean-dominated
    values) come from ``host_moments``'s other passes."""
    got = native.every_group(x, NATIVE_BOUNDS)
    if got is None:
        return False
    (total, sumsq, top, least, nan), counts = got
    n = x.numel()
    m2 = _one_pass_m2(total, sumsq, n, _TINY[torch.float32])
    if m2 is not None:
        out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = total / n, m2, 0.0, 0.0
    else:
        host_moments(x, out, one_read=False)
    # counts[k] = #{|x| < bound k} without NaN; the non-NaN count last, as cumulative counts end
    cum = counts.tolist()
    cum.append(n - int(nan))
    out[Col.ZEROS], out[Col.MIN_NONZERO], out[Col.ABSMAX] = float(cum[0]), float(least), float(top)
    out[FORMAT_COUNTS_SPAN] = format_fields_of_row(cum, torch.float32)
    return True


# ---------------------------------------------------------------------------------------
# Moments: count, mean, m2, nan, inf.

_ROW = 512  # row norms this short stay within ~1e-7 (measured; 4096-element rows: 2e-6)
# Squares of values below ~sqrt(smallest normal) lose bits: below this mean square the
# fast path hands over to the scaled one.
_TINY = {torch.float32: 2.0**-100, torch.float64: 2.0**-900}
# The one-pass formula m2 = sumsq - sum * mean amplifies the sums' ~1e-7 relative error
# by sumsq / m2 = 1 + mean**2 / var: above 4 (|mean| > 1.7 std) take the scaled two-pass.
_CONDITION = 4.0


def host_moments(x: Tensor, out: List[Entry], with_max: bool = False, one_read: bool = True) -> Optional[float]:
    """Fills mean, m2, nan and inf of ``x`` on the host. Returns max |x| where it came
    with the sums (``with_max`` and the native kernel, ``one_read``), else None."""
    x = x.detach()  # (the fast path hands it the graph's tensor: no autograd, no warning on float())
    n = x.numel()
    if one_read and n > DOT_MAX:
        taken, top = _native_moments(x, out, with_max)
        if taken:
            return top
    size = piece_size(x, _MOMENT_SCRATCH)
    if n <= size:
        _torch_moments(x, out)
    else:
        _pieced_moments(x, out, size)
    return None


#: Bytes of temporaries per element ``_torch_moments`` takes at most (a float32 copy of a
#: half tensor or a copy of a strided one, then ``y - c``; float64: twice that).
_MOMENT_SCRATCH = 16


def _pieced_moments(x: Tensor, out: List[Entry], size: int) -> None:
    """Mean, m2, nan and inf of ``x`` from ``_torch_moments`` of pieces of at most ``size``
    elements, merged exactly (``merge_rows``): temporaries of a piece's size, not ``x``'s."""
    rows = []
    for piece in pieces(x, size):
        row = nan_row()
        row[Col.COUNT] = float(piece.numel())
        _torch_moments(piece, row)
        rows.append(row)
    merged = merge_rows(assemble(rows, host_only=True)).tolist()
    for c in (Col.MEAN, Col.M2, Col.NAN, Col.INF):
        out[c] = merged[c]


def _torch_moments(x: Tensor, out: List[Entry]) -> None:
    """``host_moments`` by torch's kernels: one-pass sums where they can be trusted, a
    shifted or scaled two-pass otherwise."""
    n = x.numel()
    own = x.dtype not in WIDE_DTYPES
    if not own and n > DOT_MAX and n % _ROW == 0 and x.is_contiguous():
        # The common case, straight to the kernels `_sum_of_squares` would pick (the same
        # values) without its checks: ~150 tensors a tracked step pay them. Row norms
        # first: the sum then finds x in cache (~1% of a tracked step).
        y = x
        sumsq = _norms_sum_of_squares(x.view(-1, _ROW))
        total = float(x.sum())
    else:
        y = dense_view(x.float() if own else x)  # half types: one float32 copy (ours), then fast
        total = float(y.sum())
        sumsq = _sum_of_squares(y)
    if math.isfinite(total) and math.isfinite(sumsq):
        m2 = _one_pass_m2(total, sumsq, n, _TINY[y.dtype])
        if m2 is not None:
            out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = total / n, m2, 0.0, 0.0
            return
        shifted = _shifted_moments(y, total / n, sumsq)
        if shifted is not None:
            out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = *shifted, 0.0, 0.0
            return
    else:
        nan, inf = float(torch.isnan(x).sum()), float(torch.isinf(x).sum())
        if nan or inf:  # as torch.mean in float64: inf for [inf, 1, 2], NaN with a NaN or both infinities
            # (float64: finite values whose float32 sum overflows must not turn -inf into NaN)
            out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = (
                float(x.sum(dtype=torch.float64)) / n,
                math.nan,
                nan,
                inf,
            )
            return
    mean, m2, _ = scaled_moments(y, host_sum, own=own)
    out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = float(mean), float(m2), 0.0, 0.0


def _one_pass_m2(total: float, sumsq: float, n: int, tiny: float) -> Optional[float]:
    """``m2 = sumsq - total * mean`` where the one-pass sums can be trusted: finite, a mean
    square above ``tiny`` (no square lost bits) and ``sumsq <= _CONDITION * m2`` (the
    sums' error amplified at most that much); else None."""
    if not (math.isfinite(total) and math.isfinite(sumsq)):
        return None
    m2 = sumsq - total * (total / n)
    return m2 if sumsq >= n * tiny and _CONDITION * m2 >= sumsq else None


def one_read_moments(x: Tensor, with_max: bool) -> Optional[Tuple[float, float, float]]:
    """(mean, m2, max |x|; -1 without ``with_max``) of ``x`` from one read of the native
    kernel, where its sums can be trusted; None where they cannot (the kernel declines ``x``,
    or its values are non-finite, tiny or mean-dominated: ``record_of``'s other passes).
    The compiled route's host op calls it for every recorded tensor: the fewest steps."""
    got = native.sums(x, with_max)
    if got is None:
        return None
    total, sumsq, top = got
    n = x.numel()
    m2 = _one_pass_m2(total, sumsq, n, _TINY[torch.float32])  # (the kernel squares in float32)
    return None if m2 is None else (total / n, m2, top)


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
        out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = total / n, m2, 0.0, 0.0
    else:
        host_moments(x, out, one_read=False)  # (its own reads: rare)
    exact = with_max and math.isfinite(total) and math.isfinite(sumsq)
    return True, top if exact else None


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


DOT_MAX = 4096  # up to here a sum of squares is one float64 dot (above: vectorised float32 row norms)


def _sum_of_squares(y: Tensor) -> float:
    n = y.numel()
    if n <= DOT_MAX and y.is_contiguous():  # small tensors are overhead-bound: one copy, one dot
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
        flat = y.reshape(-1).contiguous()  # (an expanded tensor flattens to a stride-0 view: copied)
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


def host_absmax(x: Tensor) -> float:
    lo, hi = torch.aminmax(x.detach())
    return max(abs(float(lo)), abs(float(hi)))
