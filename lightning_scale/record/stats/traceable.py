"""A tensor's record as plain tensor operations, for a compiler to trace into a graph.

``traceable_record(x, groups)`` gives the same ``len(FIELDS)`` float64 vector as
``record_of`` on the device path, written without host reads, data-dependent branches or
in-place writes, so that TorchDynamo/AOTAutograd can trace it into a model's own graph and
Inductor can fuse its reductions (a float64 accumulation of every element, read from the
tensor's own buffer) with the kernels that produce the tensor.

Moments take one pass, in float64, about the tensor's first element, so a mean far above
the spread (|mean| / std of 1e3 and more) costs no accuracy (``_moments`` says why).

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
    values: Dict[str, Tensor] = _moments(x)
    if "range" in groups:
        values["absmax"] = x.abs().amax().double()  # (NaN with a NaN, as the device path)
    if "formats" in groups:
        values.update(_formats(x, values["nan"]))
    values.update(_what_ifs(x, groups))
    nan = torch.full((), math.nan, dtype=torch.float64, device=x.device)
    return torch.stack([values.get(name, nan) for name in FIELDS])


def _moments(x: Tensor) -> Dict[str, Tensor]:
    """count, mean, m2, nan and inf counts: one pass over ``x`` (one fused loop).

    Sums of ``d = x - c`` in float64 with ``c`` the first element (0 if not finite), then
    ``m2 = sum(d**2) - sum(d)**2 / n``. The cancellation in that difference is at most
    ``n * (mean - c)**2 / m2`` float64 roundings, and ``(mean - c)**2 <= m2`` since ``c`` is
    one of the values: relative error below ``n * 2**-52`` whatever |mean| / std is."""
    wide = x.double()  # (fused into the reduction's loop: no float64 copy is kept)
    c = torch.nan_to_num(wide.reshape(-1)[0], nan=0.0, posinf=0.0, neginf=0.0)
    d = wide - c
    n = torch.full((), x.numel(), dtype=torch.float64, device=x.device)
    s1, s2 = d.sum(), d.square().sum()
    m2 = (s2 - s1 * s1 / n).clamp(min=0)  # NaN when x holds ±Inf or NaN, as the device path's
    nan = x.isnan().sum().double()
    inf = x.isinf().sum().double()
    return {"count": n, "mean": c + s1 / n, "m2": m2, "nan": nan, "inf": inf}


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
