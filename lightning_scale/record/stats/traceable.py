"""A tensor's record as plain tensor operations, for a compiler to trace into a graph.

``traceable_record(x, groups)`` gives the same ``len(FIELDS)`` float64 vector as
``record_of`` on the device path, written without host reads, data-dependent branches or
in-place writes, so that TorchDynamo/AOTAutograd can trace it into a model's own graph and
Inductor can fuse its reductions (float32 vector sums over rows of 256 elements, merged in
float64, read from the tensor's own buffer) with the kernels that produce the tensor.

Moments take each row about its own mean estimate, scaled by a power of two, so a mean far
above the spread (|mean| / std of 1e3 and more) costs no accuracy (``_moments`` says why):
within ~1e-7 of float64, the device path's standard.

Every group is traceable. The optional ones reuse the device path's own functions, which are
torch ops on tensors throughout (their only Python branches are on shapes), called with the
whole tensor as one piece: ``fp8`` (``fp8.fp8_fields_in_pieces``: the per-tensor amax,
then the casts), ``blocks`` (``blocks.block_fields``: MXFP8/MXFP4/NVFP4 casts, bit tricks on
float32 and float16 views) and ``kurtosis`` (``outliers.moments_row``: central moments
about each row's own mean, merged in float64). The device path reads large tensors in
pieces to bound its temporaries; in a compiled graph the compiler fuses the pointwise work
into the reductions instead (Inductor keeps few whole-size temporaries: ``blocks`` and
``fp8`` still hold some, see docs/limitations.md).
"""

from __future__ import annotations

import math
from typing import Collection, Dict, List

import torch
from torch import Tensor

from lightning_scale.record.stats.blocks import BLOCK_FIELDS, block_fields
from lightning_scale.record.stats.fields import FIELDS, FORMATS, FP8_FIELDS, GROUPS, sum64
from lightning_scale.record.stats.fp8 import fp8_fields_in_pieces
from lightning_scale.record.stats.outliers import moments_row

__all__ = ["TRACEABLE_GROUPS", "traceable_record"]

#: The groups ``traceable_record`` computes; fields of other groups are NaN.
TRACEABLE_GROUPS = ("moments", "range", "formats", "fp8", "blocks", "kurtosis")


def traceable_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s record as a float64 ``[len(FIELDS)]`` tensor on ``x``'s device, from ops only.

    Args:
        x: a floating-point tensor with at least one element.
        groups: which of ``GROUPS`` to compute ("moments" always is); fields of the other
            groups are NaN.

    Example:
        >>> row = traceable_record(torch.tensor([1.0, 2.0, 3.0]))
        >>> [float(row[FIELDS.index(name)]) for name in ("count", "mean", "m2", "absmax")]
        [3.0, 2.0, 2.0, 3.0]
    """
    x = x.detach()
    values: Dict[str, Tensor] = _moments(x)  # (its absmax: NaN with a NaN, as the device path)
    if "range" not in groups:
        del values["absmax"]
    if "formats" in groups:
        values.update(_formats(x, values["nan"]))
    values.update(_what_ifs(x, groups))
    nan = torch.full((), math.nan, dtype=torch.float64, device=x.device)
    return torch.stack([values.get(name, nan) for name in FIELDS])


#: Elements a row of ``_row_sums``: float32 sums of a row stay within ~1e-7 of exact.
_ROW = 256


def _moments(x: Tensor) -> Dict[str, Tensor]:
    """count, mean, m2, nan and inf counts and absmax: sums over rows of ``_ROW`` elements
    (the tail one shorter row) in float32 (float64 for float64 ``x``), merged in float64.

    Each row is scaled by the power of two ``s`` that brings its max |x| to [1, 2) and
    shifted by ``c``, its mean in float32 (a first, cheap pass over the row, with its max):
    the sums of ``d = x s - c s`` and ``d**2`` neither overflow nor underflow, and a mean
    far above the spread cancels in ``d``, exactly near ``c``. The cancellation left in a
    row's ``m2 = sum(d**2) - sum(d)**2 / n`` is about ``(mean - c)**2 / var`` float32
    roundings: none to speak of, ``c`` being the row's mean up to rounding. One read of
    ``x`` from memory in float32 vector arithmetic and no whole-size temporary, where
    Inductor's float64 sum of every element cost several times more."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = _memory_order(x).reshape(-1)
    n = flat.numel()
    whole = n // _ROW * _ROW
    parts = [_row_sums(flat[:whole].reshape(-1, _ROW), acc)] if whole else []
    if whole < n:
        parts.append(_row_sums(flat[whole:].reshape(1, -1), acc))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return _merged(rows, n)


def _memory_order(x: Tensor) -> Tensor:
    """``x`` with its dimensions in the order of its strides, largest first: these fields do
    not depend on the order of the elements, and a view such as attention's q, k and v
    (``split``, then ``transpose``) is then read in rows along memory, where Inductor's
    loops over its logical order divide indices per element and do not vectorize (5x slower)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return x if order == list(range(x.dim())) else x.permute(order)


def _row_sums(r: Tensor, acc: torch.dtype) -> Tensor:
    """``[8, rows]`` float64, per row of ``r``: its length, shift ``c`` (its float32 mean, 0
    if not finite), scale ``s``, the sums of ``d`` and ``d**2``, NaN count, non-finite count, max |x|."""
    y = r.to(acc)
    top = y.abs().amax(1, keepdim=True)  # (NaN with a NaN)
    bound = 126 if acc == torch.float32 else 1022  # (2**±bound: normal numbers)
    s = torch.exp2((-torch.floor(torch.log2(top))).clamp(-bound, bound))  # (max 0: 2**bound)
    c = torch.nan_to_num((y * 2**-8).mean(1, keepdim=True) * 2**8, nan=0.0, posinf=0.0, neginf=0.0)
    d = y * s - c * s  # (exact scalings: one rounding, in the difference)
    nan = (y != y).sum(1, dtype=acc)  # (comparisons, not isnan/isinf: Inductor vectorizes them)
    bad = (y - y != 0).sum(1, dtype=acc)  # NaN or ±Inf: x - x is NaN
    length = torch.full_like(nan, r.shape[1])
    return torch.stack([length, c[:, 0], s[:, 0], d.sum(1), (d * d).sum(1), nan, bad, top[:, 0]]).double()


def _merged(rows: Tensor, n: int) -> Dict[str, Tensor]:
    """The record's moments fields from ``_row_sums`` rows: each row's mean and m2, merged
    by Chan's formula about the first row's mean. NaN and ±Inf propagate as on the device
    path (a NaN, or both infinities: mean and m2 NaN; one infinity: mean ±Inf, m2 NaN)."""
    length, c, s, s1, s2, nan, bad, top = rows.unbind(0)
    r = s1 / length  # (the row's mean of d)
    mean_i = c + r / s
    m2_i = (s2 - s1 * r).clamp(min=0) / s / s  # (s * s can overflow in float64)
    shift = torch.nan_to_num(mean_i[0], nan=0.0, posinf=0.0, neginf=0.0)
    count = torch.full((), n, dtype=torch.float64, device=rows.device)
    mean = shift + (length * (mean_i - shift)).sum() / count
    m2 = m2_i.sum() + (length * (mean_i - mean).square()).sum()
    nans = nan.sum()
    return {"count": count, "mean": mean, "m2": m2, "nan": nans, "inf": bad.sum() - nans, "absmax": top.amax()}


def _formats(x: Tensor, nan: Tensor) -> Dict[str, Tensor]:
    """zeros, min_nonzero and each format's underflow, below_normal and overflow counts.

    NaN counts as neither zero nor nonzero; a value below a threshold is nonzero and finite
    below it (``0 < |x| < bound``); an overflow is ``|x| > max`` (±Inf included)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = x.to(acc).abs().nan_to_num(nan=0.0, posinf=math.inf)  # NaN joins the zeros, taken out below
    nonzero = a > 0
    out = {
        "zeros": (a == 0).sum().double() - nan,
        "min_nonzero": torch.where(nonzero, a, math.inf).amin().double(),
    }
    for name, fmt in FORMATS.items():
        out[f"underflow_{name}"] = (nonzero & (a < fmt.min_subnormal)).sum().double()
        out[f"below_normal_{name}"] = (nonzero & (a < fmt.min_normal)).sum().double()
        out[f"overflow_{name}"] = (a > fmt.max).sum().double()
    missing: List[str] = [f for f in GROUPS["formats"] if f not in out]
    if missing:  # the field table and this function must name the same fields
        raise ValueError(f"`formats` fields without a traceable formula: {missing}")
    return out


def _what_ifs(x: Tensor, groups: Collection[str]) -> Dict[str, Tensor]:
    """The ``fp8``, ``blocks`` and ``kurtosis`` fields of ``groups``: the device path's
    functions on ``x`` as one piece (so one traced copy of their ops, whatever ``x``'s size)."""
    whole = x.numel()
    out: Dict[str, Tensor] = {}
    if "fp8" in groups:
        out.update(zip(FP8_FIELDS, fp8_fields_in_pieces(x, sum64, whole)))
    if "blocks" in groups:
        out.update(zip(BLOCK_FIELDS, block_fields(x, whole)))
    if "kurtosis" in groups:
        row = moments_row(x, whole)  # (count, mean, m2, m3, m4) of the finite elements
        out["m3"], out["m4"] = row[3], row[4]
    return out
