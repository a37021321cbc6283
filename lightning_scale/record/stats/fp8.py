"""The FP8 what-if group: per-tensor amax scaling, the cast, and the error it makes.

``fp8_fields`` defines it in torch code (the reference); the native kernel's one read
(``native.fp8``, through ``host.accelerate``) gives the same casts and flushed counts for a
host tensor it reads in place, sums within float64 rounding.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from lightning_scale.record.stats.fields import FORMATS, FP8_DTYPES, SumFn, acc_dtype
from lightning_scale.record.stats.layout import SCRATCH_FLOOR, piece_size, pieces

# ---------------------------------------------------------------------------------------
# FP8 what-if: per-tensor amax scaling, cast, and the error it makes.


#: Bytes of temporaries per element the quantisation takes at most (float64 copies of the
#: values, of each quantised format and of its error): above ``layout.scratch_bytes`` a
#: tensor is read in pieces.
FP8_SCRATCH = 64


def fp8_fields(x: Tensor, total_of: SumFn, floor: int = SCRATCH_FLOOR) -> List[Tensor]:
    """For E4M3 then E5M2: sum of squared error, sum of squares, nonzeros flushed to 0.

    Quantisation as a per-tensor-scaled FP8 recipe does it: ``scale = max / amax`` (in
    float32, float64 for float64 tensors; capped at the largest finite number),
    ``q = fp8(x * scale)``. The error is what dequantising loses, ``q / scale - x``, taken
    in float64 as ``(q - x * scale) / scale``. Non-finite elements are left out (zero
    error, zero square, not flushed): the ``nan``/``inf`` counts report them.

    A tensor whose temporaries would exceed ``layout.scratch_bytes(x, floor)`` is read in
    pieces (any layout, no copy of the whole): the amax first, then the sums, added in
    float64.
    """
    return fp8_fields_in_pieces(x, total_of, piece_size(x, FP8_SCRATCH, floor))


def fp8_fields_in_pieces(x: Tensor, total_of: SumFn, size: int) -> List[Tensor]:
    """``fp8_fields`` of ``x`` read in pieces of at most ``size`` elements (one where it is no larger)."""
    if x.numel() <= size:
        return _fp8_sums(_finite(x), None, total_of)
    parts = list(pieces(x, size))
    amax = torch.stack([_amax(_finite(p)) for p in parts]).amax()
    sums = [_fp8_sums(_finite(p), amax, total_of) for p in parts]
    return [torch.stack(column).sum() for column in zip(*sums)]


def _finite(x: Tensor) -> Tensor:
    return torch.nan_to_num(x.to(acc_dtype(x)), nan=0.0, posinf=0.0, neginf=0.0)


def _amax(xf: Tensor) -> Tensor:
    lo, hi = torch.aminmax(xf)
    return torch.maximum(lo.abs(), hi.abs())


def _fp8_sums(xf: Tensor, amax: Optional[Tensor], total_of: SumFn) -> List[Tensor]:
    """``fp8_fields`` of the finite values ``xf`` (in their accumulation dtype), with the
    tensor's ``amax`` (None: ``xf``'s own)."""
    acc = xf.dtype
    amax = _amax(xf) if amax is None else amax
    nonzero = torch.count_nonzero(xf)
    x64 = xf.double()
    sq = total_of(x64.square())  # the same for both formats
    out: List[Tensor] = []
    for name, dtype in FP8_DTYPES.items():
        # (a Python number / tensor would multiply by a rounded reciprocal)
        scale = torch.nan_to_num(torch.full_like(amax, FORMATS[name].max) / amax, posinf=torch.finfo(acc).max)
        q = widen((xf * scale).to(dtype))
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


def widen(q: Tensor) -> Tensor:
    """``q.double()``; on CPU for E4M3 by a 256-entry table (torch's CPU kernel widens E4M3
    element by element: 3.3 ms for 512K elements, the table 1.3 ms; the same values)."""
    if q.device.type != "cpu" or q.dtype != torch.float8_e4m3fn:
        return q.double()
    table = torch.arange(256, dtype=torch.uint8).view(q.dtype).double()
    return torch.take(table, q.view(torch.uint8).long())
