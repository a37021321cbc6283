"""Block-scaled what-ifs: MXFP8, MXFP4 and NVFP4 casts of a tensor, and the error they make.

The casts are emulated exactly, element for element as torchao 0.18's emulated casts
(``MXTensor.to_mx(x, dtype, 32).dequantize(torch.float32)``, ``NVFP4Tensor.to_nvfp4(x)
.dequantize(torch.float32)``), in float32, with blocks along the last dimension (a last
dimension that is not a multiple of the block is zero-padded; zeros change no block max):

* MX (OCP MX v1.0, 32 elements a block): an E8M0 scale ``2^e``, ``e = floor(log2(block
  amax)) - emax`` (emax 8 for E4M3, 15 for E5M2, 2 for E2M1; torchao's default FLOOR
  mode), clamped to E8M0's ``[-127, 127]``, 255 (NaN) for a block with a NaN. Elements are
  ``x / 2^e`` in float32 (a block whose scale would be 2^-127 is divided by 2^-126, as
  torchao does, and multiplied back by 2^-127), saturated to the element format's largest
  value and rounded to nearest-even (E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6). So the block's
  largest elements may saturate (FLOOR keeps amax / 2^e in [2^emax, 2^(emax+1))).
* NVFP4 (16 elements a block, no per-tensor scale): the scale ``s = e4m3(clamp(amax / 6,
  2^-6, 448))``, elements ``e2m1(clamp(x * (1 / s), -6, 6))``, dequantized ``q * s``.

A NaN anywhere in a block makes the whole dequantized block NaN; an Inf makes the
block's scale huge (its other elements flush) and itself Inf or the largest value.

The record sums (``BLOCK_FIELDS``), per format ``<fmt>_sq_err``, ``<fmt>_sq``,
``<fmt>_flushed``, are defined as the per-tensor ``fp8_*`` ones: non-finite elements are
zeroed before the cast (so that one NaN does not poison its block: the ``nan``/``inf``
counts report them) and left out of the sums (zero error, zero square, not flushed);
``sq`` is the sum of ``x^2``, ``sq_err`` of ``(q(x) - x)^2`` against ``x`` itself (float64
tensors are cast from float32, their values beyond float32's range taken as its largest,
and their sums taken in float64; other tensors' errors are exact in float32 and summed in
float32 per chunk, ~1e-7 relative), and ``flushed`` counts the elements nonzero in ``x`` and zero in
``q(x)``. They add over tensors, so they merge exactly by sums across micro-batches and
ranks; ``<fmt>_snr_db`` is ``10 log10(sq / sq_err)`` (+inf without error) and
``<fmt>_flushed`` is ``flushed / count``.

Temporaries are bounded: the tensor is read ``CHUNK`` elements (whole rows, at least one)
at a time, about 32 bytes of temporaries an element (32 MB a chunk; twice that for
float64), whatever the tensor's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: elements, block size and how the block scale is chosen."""

    block: int
    #: the largest element value
    max: float
    #: MX: the exponent of the element's largest power of two (its scale is amax's less this);
    #: None for NVFP4's E4M3 scale
    emax: Optional[int]
    #: the element dtype torch casts to; None for E2M1 (rounded here)
    dtype: Optional[torch.dtype]


#: The block formats of the ``blocks`` what-if group, by statistic prefix.
BLOCK_FORMATS: Dict[str, BlockFormat] = {
    "mxfp8_e4m3": BlockFormat(32, 448.0, 8, torch.float8_e4m3fn),
    "mxfp8_e5m2": BlockFormat(32, 57344.0, 15, torch.float8_e5m2),
    "mxfp4": BlockFormat(32, 6.0, 2, None),
    "nvfp4": BlockFormat(16, 6.0, None, None),
}

#: The record sums of the group, in order: per format its squared error, squares, flushed count.
BLOCK_FIELDS: Tuple[str, ...] = tuple(f"{fmt}_{kind}" for fmt in BLOCK_FORMATS for kind in ("sq_err", "sq", "flushed"))

#: Elements read at a time (whole rows, at least one): about 32 bytes of temporaries each.
CHUNK = 1 << 20

_F32_MAX = torch.finfo(torch.float32).max
_E4M3_TINY = 2.0**-6  # NVFP4's least block scale (E4M3's least normal, as torchao clamps)


def dequantized(x: Tensor, fmt: str) -> Tensor:
    """``x`` cast to the block format ``fmt`` and back, in float32, in ``x``'s shape.

    Args:
        x: a floating-point tensor with at least one dimension (half types and float32 as
            they are; float64 rounded to float32 first, beyond its range saturated).
        fmt: one of ``BLOCK_FORMATS``.

    Raises:
        ValueError: for an unknown ``fmt`` or a 0-dim ``x``.

    Example (amax 7.9: scale 2^(2 - 2), so 7.9 saturates at E2M1's 6):
        >>> dequantized(torch.tensor([1.0, 3.3, -0.2, 7.9]), "mxfp4").tolist()
        [1.0, 3.0, -0.0, 6.0]
    """
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"`fmt` must be one of {sorted(BLOCK_FORMATS)}, got {fmt!r}")
    if x.dim() == 0:
        raise ValueError("`x` must have at least one dimension (blocks run along the last), got a 0-dim tensor")
    spec = BLOCK_FORMATS[fmt]
    k = x.shape[-1]
    blocks = _padded_blocks(_as_float32(x.detach().reshape(-1, k)), spec.block)
    q = _cast_blocks(blocks, spec, blocks.abs().amax(-1, keepdim=True))  # amax: NaN with a NaN
    return q.view(-1, blocks.shape[1] * spec.block)[:, :k].reshape(x.shape)


def block_fields(x: Tensor, chunk: int = CHUNK) -> List[Tensor]:
    """``BLOCK_FIELDS`` of ``x`` as float64 0-dim tensors on ``x``'s device (nothing read back).

    ``chunk``: elements read at a time (``row_pieces``; at least one block row).
    0-dim tensors count as one row of one element.
    """
    x = x.detach()
    sums = torch.zeros(len(BLOCK_FIELDS), dtype=torch.float64, device=x.device)
    for part, _ in row_pieces(x, chunk):
        sums += _chunk_sums(part)
    return list(sums.unbind())


#: Pieces split the last dimension at multiples of this (MX's and NVFP4's blocks both end there).
ALIGN = 32


def row_pieces(x: Tensor, size: int) -> Iterator[Tuple[Tensor, int]]:
    """2-D views ``(rows, columns)`` of ``x`` (rows over its leading dimensions, columns its
    last) that together hold its elements, each at most ``size`` elements (at least ``ALIGN``
    columns or the whole last dimension), with the first column each starts at. Columns are
    split at multiples of ``ALIGN``, so no block is cut. No copy, whatever ``x``'s layout:
    where the leading dimensions cannot be merged into one, one leading index at a time.
    An empty ``x`` has no piece; a 0-dim one is one of one element."""
    if x.numel() == 0:
        return
    if x.dim() <= 1:
        x = x.reshape(1, -1)
    k = x.shape[-1]
    cols = k if k <= size else max(ALIGN, size // ALIGN * ALIGN)
    rows = max(1, size // cols)
    try:
        x2 = x.view(-1, k)
    except RuntimeError:  # (leading dimensions that do not merge: one slice at a time)
        for inner in x.unbind(0):
            yield from row_pieces(inner, size)
        return
    for i in range(0, x2.shape[0], rows):
        for j in range(0, k, cols):
            yield x2[i : i + rows, j : j + cols], j


def _chunk_sums(part: Tensor) -> Tensor:
    """``BLOCK_FIELDS`` of rows ``part`` ``(r, k)``: the finite values' casts, summed in float64.

    The error ``q - x`` is exact in float32 (``q`` lies within a factor 2 of ``x``, or is 0),
    so float32 and half tensors take it and its square in float32, scaled by the power of
    two ``s`` that brings the chunk's max |x| near 1 (squares neither overflow nor vanish):
    ~1e-7 relative rounding in the float32 sums. float64 tensors take it in float64.
    """
    wide = part.dtype == torch.float64
    finite = torch.nan_to_num(part.to(torch.float64 if wide else torch.float32), 0.0, 0.0, 0.0)
    ref = _padded_blocks(finite, _MX_BLOCK)  # (r, nb, 32); zero-padded: pads add nothing
    blocks = _padded_blocks(_as_float32(finite), _MX_BLOCK) if wide else ref
    r = blocks.shape[0]
    amax16 = blocks.view(r, -1, 16).abs().amax(-1, keepdim=True)  # NVFP4's blocks: halves of MX's
    amax32 = amax16.view(r, -1, 2).amax(-1, keepdim=True)
    s = _unit_scale(amax32.amax()).to(ref.dtype)
    nonzero = torch.count_nonzero(ref)
    sq = _sum_sq(ref * s)
    out: List[Tensor] = []
    for spec in BLOCK_FORMATS.values():
        amax = amax32 if spec.block == _MX_BLOCK else amax16
        q = _cast_blocks(blocks.view(r, -1, spec.block), spec, amax)
        flushed = (nonzero - torch.count_nonzero(q)).double()
        err = q.sub_(blocks.view_as(q)) if not wide else q.double().sub_(ref.view(q.shape))
        out += [_sum_sq(err.mul_(s)), sq, flushed]
    s64 = s.double()
    return torch.stack(out) / torch.stack([s64 * s64, s64 * s64, torch.ones_like(s64)]).repeat(len(BLOCK_FORMATS))


_MX_BLOCK = 32


def _unit_scale(top: Tensor) -> Tensor:
    """The float32 power of two that brings ``top`` into [1, 2) (within 2^±126; 1 for 0)."""
    e = torch.floor(torch.log2(top.float().clamp(min=2.0**-149))).clamp(-126, 126)
    return torch.where(top > 0, torch.exp2(-e), 1.0)


def _sum_sq(y: Tensor) -> Tensor:
    return y.square_().sum().double() if y.dtype != torch.float64 else y.square_().sum()


def _as_float32(x: Tensor) -> Tensor:
    if x.dtype == torch.float64:  # (finite values beyond float32's range saturate, not turn Inf)
        return torch.where(x.isfinite(), x.clamp(-_F32_MAX, _F32_MAX), x).float()
    return x.float()


def _padded_blocks(x2: Tensor, block: int) -> Tensor:
    """``(r, k)`` float32 rows as ``(r, ceil(k / block), block)`` blocks, the last zero-padded."""
    r, k = x2.shape
    pad = -k % block
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(r, (k + pad) // block, block)


def _cast_blocks(blocks: Tensor, spec: BlockFormat, amax: Tensor) -> Tensor:
    """The dequantized float32 blocks ``(r, nb, block)`` of ``spec``'s cast, given each block's
    max |x| ``amax`` ``(r, nb, 1)``: a new tensor."""
    if spec.emax is None:
        return _nvfp4_blocks(blocks, amax)
    return _mx_blocks(blocks, amax, spec)


def _mx_blocks(blocks: Tensor, amax: Tensor, spec: BlockFormat) -> Tensor:
    """MX: E8M0 scales from amax's float32 exponent (FLOOR), elements cast, scaled back."""
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2 amax); -127 for 0 or subnormal
    biased = (exponent - spec.emax).clamp(-127, 128) + 127
    biased = torch.where(amax.isnan(), 255, biased)  # E8M0's NaN
    divisor = (biased << 23).view(torch.float32).clamp(min=2.0**-126)  # (255: Inf; 0: torchao's 2^-126)
    scaled = blocks / divisor
    if spec.dtype is None:
        elements = _round_e2m1_(scaled)
    else:
        elements = _widen(scaled.clamp_(-spec.max, spec.max).to(spec.dtype))
    tiny = torch.full_like(amax, 2.0**-127)  # E8M0 0 decodes to 2^-127 (a float32 subnormal)
    scale = torch.where(biased == 0, tiny, (biased << 23).view(torch.float32))
    scale = torch.where(biased == 255, torch.full_like(amax, float("nan")), scale)
    return elements.mul_(scale)


def _nvfp4_blocks(blocks: Tensor, amax: Tensor) -> Tensor:
    """NVFP4 without a per-tensor scale: E4M3 block scales, E2M1 elements."""
    scale = (amax / 6.0).clamp(_E4M3_TINY, 448.0).to(torch.float8_e4m3fn).float()
    elements = _round_e2m1_((blocks * (1.0 / scale)).clamp_(-6.0, 6.0))  # (a reciprocal, as torchao)
    return elements.mul_(scale)


def _widen(q: Tensor) -> Tensor:
    """FP8 ``q`` as float32 through float16's bits (torch's CPU E4M3 widening is ~25x slower).

    E5M2 is float16's top byte. E4M3's 7 low bits shifted by 7 are a float16 of the same
    mantissa and an exponent 8 lower (subnormals included): times 256. E4M3's NaN turns 480;
    it only arises in blocks whose NaN scale makes them NaN anyway.
    """
    b = q.view(torch.uint8).to(torch.int16)
    if q.dtype == torch.float8_e5m2:
        return b.mul_(256).view(torch.float16).float()
    bits = (b & 0x7F).mul_(128).bitwise_or_((b & 0x80).mul_(256))
    return bits.view(torch.float16).float().mul_(256.0)


def _round_e2m1_(y: Tensor) -> Tensor:
    """float32 ``y`` rounded in place to nearest-even E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6), saturated at 6.

    Between two powers of two E2M1 values are evenly spaced, by half the lower power (0.5
    below 1 too), so rounding ``|y| / step`` half to even rounds to the even code; the
    step is the power of two from ``|y|``'s exponent bits, and dividing by it is exact.
    """
    a = y.abs()
    step = ((a.view(torch.int32) & 0x7F800000) - (1 << 23)).view(torch.float32).clamp_(min=0.5)
    return a.div_(step).round_().mul_(step).clamp_(max=6.0).copysign_(y)
