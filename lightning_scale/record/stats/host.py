"""The host kernel as an acceleration of the reference: what ``native`` covers of a host tensor.

``accelerate(x, groups, out)`` fills, from the native kernel's reads of a CPU tensor, the
groups it covers and returns those it left (``reference.fill`` computes them):

* ``moments`` (with ``range``, and with ``formats`` in the same read): one read's float64-added
  sums (without the kernel, for moments and range: torch's own sums, ``torch_sums``), where they
  can be trusted: finite, a mean square above ~2^-100 (no square lost bits)
  and a sum of squares at most 4x m2 (the one-pass formula's ~1e-7 error amplified at most
  that much). Where they cannot (a mean-dominated or tiny tensor, its sums finite), a second
  native read about the first one's mean (``native.moments``, float64 central sums) gives them;
  tensors with non-finite values, or that the kernel cannot read in place, are left to the
  reference.
* ``fp8`` (``native.fp8``), ``blocks`` (``native.blocks``), ``kurtosis`` (``native.moments``,
  about the first read's mean, or the second read's moments where there was one), where the
  kernel reads the tensor in place.

``fast_host_record`` is the recorder's short path for long tensors (the fewest Python steps).
The kernel covers float32 and bfloat16 tensors it can read in place; it is absent where there
is no C compiler or ``LIGHTNING_SCALE_NATIVE=0`` (``native.status()``): the reference then
computes everything.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, List, Optional, Set, Tuple

import torch
from torch import Tensor

from lightning_scale.record import native
from lightning_scale.record.stats.fields import BLOCKS_SPAN, FORMAT_COUNTS_SPAN, FP8_SPAN, Col, Entry, nan_row
from lightning_scale.record.stats.formats import NATIVE_BOUNDS, format_fields_of_row
from lightning_scale.record.stats.layout import dense_view

__all__ = ["GROUPS", "accelerate", "centred_moments", "fast_host_record", "one_read_moments", "torch_sums"]

#: The groups the host kernel accelerates.
GROUPS = frozenset({"moments", "range", "formats", "fp8", "blocks", "kurtosis"})
# Squares of values below ~sqrt(smallest normal) lose bits: below this mean square the
# one-read moments are not trusted.
_TINY = 2.0**-100
# The one-pass formula m2 = sumsq - sum * mean amplifies the sums' ~1e-7 relative error
# by sumsq / m2 = 1 + mean**2 / var: above 4 (|mean| > 1.7 std) a second read takes it.
_CONDITION = 4.0


def _one_pass_m2(total: float, sumsq: float, n: int) -> Optional[float]:
    """``m2 = sumsq - total * mean`` where the one-pass sums can be trusted (see the module
    docstring); else None. (The kernel squares in float32, bfloat16 too.)"""
    if not (math.isfinite(total) and math.isfinite(sumsq)):
        return None
    m2 = sumsq - total * (total / n)
    return m2 if sumsq >= n * _TINY and _CONDITION * m2 >= sumsq else None


def one_read_moments(x: Tensor, with_max: bool) -> Optional[Tuple[float, float, float]]:
    """(mean, m2, max |x|; -1 without ``with_max``) of ``x`` from one read of the native
    kernel, where its sums can be trusted; None where they cannot or it declines ``x``.
    The compiled route's host op calls it for every recorded tensor: the fewest steps."""
    got = native.sums(x, with_max)
    if got is None:
        return None
    total, sumsq, top = got
    m2 = _one_pass_m2(total, sumsq, x.numel())
    if m2 is not None:
        return total / x.numel(), m2, top
    centred = centred_moments(x, total, sumsq)
    return None if centred is None else (centred[0], centred[1], top)


def centred_moments(x: Tensor, total: float, sumsq: float) -> Optional[Tuple[float, float, float, float]]:
    """(mean, m2, m3, m4) of ``x`` by a second native read about the first read's mean (float64
    central sums, ``native.moments``), where that read's sums are finite but its one-pass m2 is
    not trusted (mean-dominated or tiny values); None where the sums are not finite or the kernel
    does not read ``x`` in place."""
    n = x.numel()
    if not (math.isfinite(total) and math.isfinite(sumsq)) or n == 0:
        return None
    row = native.moments(x, total / n)
    if row is None or row[0] != n:
        return None
    return float(row[1]), float(row[2]), float(row[3]), float(row[4])


def _moments(x: Tensor, groups: Collection[str], out: List[Entry]) -> Set[str]:
    """The moments (and range, and formats) groups by one read; returns those it left."""
    n = x.numel()
    if "formats" in groups:
        got = native.every_group(x, NATIVE_BOUNDS)
        if got is None:
            return {"moments", "range", "formats"} & set(groups)
        (total, sumsq, top, least, nan), counts = got
        cum = counts.tolist()  # cum[k] = #{|x| < bound k} without NaN; the non-NaN count last
        cum.append(n - int(nan))
        out[Col.ZEROS], out[Col.MIN_NONZERO] = float(cum[0]), float(least)
        out[FORMAT_COUNTS_SPAN] = format_fields_of_row(cum, torch.float32)
        if "range" in groups:
            out[Col.ABSMAX] = float(top)  # (NaN with a NaN: exact whatever the sums)
        left = set()
    else:
        got3 = native.sums(x, "range" in groups)
        if got3 is None:  # (the native kernel absent or declining: torch's own sums, two reads)
            got3 = torch_sums(x, "range" in groups)
        total, sumsq, top = got3
        left = set()
        if "range" in groups:
            if math.isfinite(total) and math.isfinite(sumsq):
                out[Col.ABSMAX] = top
            else:  # (the kernel's max is meaningful only where both sums are finite)
                left.add("range")
    m2 = _one_pass_m2(total, sumsq, n)
    mean = total / n
    if m2 is None:
        centred = centred_moments(x, total, sumsq)
        if centred is None:
            return left | {"moments"}
        mean, m2 = centred[:2]
        if "kurtosis" in groups:  # (the same read's central moments: ``accelerate`` reads no more)
            out[Col.M3], out[Col.M4] = centred[2:]
    out[Col.MEAN], out[Col.M2], out[Col.NAN], out[Col.INF] = mean, m2, 0.0, 0.0
    return left


#: Rows of ``torch_sums``' sum of squares: norms of rows this short stay within ~1e-7 (a BLAS dot
#: of a long tensor with itself adds in a few lanes: 2.8e-6 at 512K elements).
_ROW = 512


def torch_sums(x: Tensor, with_max: bool) -> Tuple[float, float, float]:
    """(sum, sum of squares, max |x|; -1 without ``with_max``) of a host tensor by torch's CPU
    kernels: its cascade sum (~1e-7 relative at any size), the squared norms of rows of ``_ROW``
    added in float64, ``aminmax``. Where the native kernel does not run (no C compiler, a dtype or
    layout it declines, tensors it leaves to torch's threads): the same trust test follows, and
    the reference takes what it fails. ``make bench`` measures it ("without the native kernel")."""
    y = dense_view(x if x.dtype in (torch.float32, torch.float64) else x.float())
    flat = y.reshape(-1)  # (a copy only where no dense view exists: a slice of a wider tensor)
    n = flat.numel()
    m = n // _ROW * _ROW
    sumsq = 0.0
    if m:
        norms = torch.linalg.vector_norm(flat[:m].view(-1, _ROW), dim=1).double()
        sumsq = float(torch.dot(norms, norms))
    if m < n:
        tail = flat[m:].double()
        sumsq += float(torch.dot(tail, tail))
    top = -1.0
    if with_max:
        lo, hi = torch.aminmax(flat)
        top = max(abs(float(lo)), abs(float(hi)))
    return float(flat.sum()), sumsq, top


def accelerate(x: Tensor, groups: Collection[str], out: List[Entry]) -> Set[str]:
    """Fill the groups of ``groups`` the native kernel covers for the CPU tensor ``x`` (non-empty)
    into ``out`` (floats); returns the groups it left."""
    left = set(groups) - GROUPS
    if "moments" in groups:
        left |= _moments(x, groups, out)
    mean, finite = out[Col.MEAN], out[Col.NAN] == 0 and out[Col.INF] == 0
    if "fp8" in groups:
        amax = out[Col.ABSMAX] if finite and isinstance(out[Col.ABSMAX], float) else None
        fast = native.fp8(x, amax if amax is not None and math.isfinite(amax) else None)
        if fast is None:
            left.add("fp8")
        else:
            out[FP8_SPAN] = fast.tolist()
    if "blocks" in groups:
        fast = native.blocks(x)
        if fast is None:
            left.add("blocks")
        else:
            out[BLOCKS_SPAN] = fast.tolist()
    if "kurtosis" in groups and not _filled(out[Col.M3]):
        fast = native.moments(x, mean if isinstance(mean, float) else None)
        if fast is None:
            left.add("kurtosis")
        else:
            out[Col.M3], out[Col.M4] = float(fast[3]), float(fast[4])
    return left


def _filled(entry: Entry) -> bool:
    """Whether a field of ``out`` was computed (``nan_row`` starts every one NaN)."""
    return not (isinstance(entry, float) and math.isnan(entry))


def fast_host_record(groups: Collection[str]) -> Optional[Callable[[Tensor], Optional[List[Entry]]]]:
    """For built-in groups within moments, range and formats: a function giving ``x``'s record
    from one read of the native kernel (the recorder's path for long host tensors, with fewer
    steps than ``record_of``), or None from it where that does not apply (the kernel declines
    ``x``, or its sums cannot be trusted: ``record_of`` then). None for other groups."""
    chosen = set(groups)
    if not chosen <= {"moments", "range", "formats"}:
        return None

    def record(x: Tensor) -> Optional[List[Entry]]:  # (the name the benchmarks profile)
        out = nan_row()
        if _moments(x, chosen, out):
            return None
        out[Col.COUNT] = float(x.numel())
        return out

    return record
