"""Block-scaled what-ifs inside the fused Triton kernel: MXFP8, MXFP4 and NVFP4 casts of a tile.

Device functions (``@triton.jit``) that ``triton_stats._tiles_kernel`` calls on each tile it
reads when the ``blocks`` group is asked and the tile's rows run along the tensor's last
dimension (``stats.layout.row_grid``): a tile of ``BR x BC`` elements, ``BC`` a multiple
of 32, holds ``BR x BC / 32`` whole MX blocks and twice as many NVFP4 blocks, so a block's
amax is a reduction inside the tile (``tl.reshape`` to one block a row). Columns past the
last dimension load as zeros: the zero padding of ``stats.blocks`` (zeros change no amax
and add no error). Each cast is ``stats.blocks``' element for element (the torch code,
itself equal to torchao's emulated casts, is the reference the tests compare with):

* MX: ``b`` = E8M0's biased exponent of ``floor(log2 amax) - emax`` (from amax's float32
  bits: FLOOR), clamped to ``[0, 254]``; elements ``x * 2^(127 - max(b, 1))`` (a power of
  two: exact, as torch's division), saturated to the element's largest value, rounded to
  nearest-even on the element grid (``round_to_grid``), times ``2^(b - 127)`` (``b = 0``:
  ``2^-127`` as ``0.5 * 2^-126``, no subnormal constant).
* NVFP4: ``scale = e4m3(clamp(amax / 6, 2^-6, 448))`` and ``1 / scale`` correctly rounded
  to float32 through float64 (a float32 quotient of these operands is never near a
  float32 tie: the float64 quotient rounds to the same float32; no approximate float32
  division on a GPU), elements ``e2m1(clamp(x * (1 / scale), -6, 6)) * scale``.

The error ``q - x`` is taken in float32 (exact, as in the torch code), scaled by the tile's
power of two ``s`` (the moments' one: squares neither overflow nor vanish), squared and
summed in float32 along the tile's rows and in float64 across them, then divided by ``s^2``.
Non-finite elements enter as zeros (zero error, not flushed), as in ``stats.blocks``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lightning_scale.record.stats.blocks import BLOCK_FIELDS, BLOCK_FORMATS
from lightning_scale.record.triton_moments import sum64

__all__ = ["block_sums", "round_to_grid"]

# Element grids (least normal exponent, mantissa bits) of E4M3, E5M2 and E2M1 (0, 0.5, 1, 1.5,
# 2, 3, 4, 6: least normal 1, one mantissa bit), and each MX format's emax and largest element.
_E4, _E5, _FP4, _NV = (BLOCK_FORMATS[f] for f in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"))
assert tuple(BLOCK_FORMATS) == ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
assert BLOCK_FIELDS[:3] == ("mxfp8_e4m3_sq_err", "mxfp8_e4m3_sq", "mxfp8_e4m3_flushed")
assert (_E4.block, _E5.block, _FP4.block, _NV.block, _FP4.max, _NV.max) == (32, 32, 32, 16, 6.0, 6.0)
_E4_EMAX, _E5_EMAX, _FP4_EMAX = (tl.constexpr(f.emax) for f in (_E4, _E5, _FP4))
_E4_MAX, _E5_MAX = tl.constexpr(_E4.max), tl.constexpr(_E5.max)


@triton.jit
def round_to_grid(v, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """``v`` (float32, |v| at most the format's largest value) rounded to the grid of a
    format with least normal ``2**EMIN`` and ``MBITS`` mantissa bits, to nearest, ties to
    even (torch's FP8 casts), by exact float32 steps: ``t = |v| / ulp`` is below 2**(MBITS+2)."""
    bits = v.to(tl.int32, bitcast=True)
    ab = bits & 0x7FFFFFFF
    k = tl.maximum((ab >> 23) - 127, EMIN) - MBITS  # ulp = 2**k: the exponent's, or the subnormals'
    t = ab.to(tl.float32, bitcast=True) * ((127 - k) << 23).to(tl.float32, bitcast=True)
    r = tl.floor(t)
    rest = t - r
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((rest > 0.5) | ((rest == 0.5) & odd), r + 1.0, r)
    q = r * ((127 + k) << 23).to(tl.float32, bitcast=True)
    return tl.where(bits < 0, -q, q)


@triton.jit
def _spread(m, BR: tl.constexpr, BC: tl.constexpr, B: tl.constexpr):
    """A value per block of ``B`` (``(BR * BC // B,)``, row-major) back to every element ``(BR, BC)``."""
    return tl.reshape(tl.broadcast_to(m[:, None], (BR * BC // B, B)), (BR, BC))


@triton.jit
def _mx(xf, amax, EMAX: tl.constexpr, FMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr):
    """The MX cast of ``xf`` and back, ``amax`` its block's max |x| at every element (finite)."""
    b = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX, -127), 127) + 127
    b1 = tl.maximum(b, 1)  # (E8M0 0 divides by 2^-126, as torchao does)
    y = xf * ((254 - b1) << 23).to(tl.float32, bitcast=True)  # x / 2^(b1 - 127), exact
    q = round_to_grid(tl.minimum(tl.maximum(y, -FMAX), FMAX), EMIN, MBITS)
    q = tl.where(b == 0, q * 0.5, q)
    return q * (b1 << 23).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4(xf, m16, BR: tl.constexpr, BC: tl.constexpr):
    """The NVFP4 cast of ``xf`` and back, ``m16`` the max |x| of each block of 16 (row-major)."""
    scale = (m16.to(tl.float64) / 6.0).to(tl.float32)  # amax / 6 correctly rounded (module docstring)
    scale = round_to_grid(tl.minimum(tl.maximum(scale, 0.015625), 448.0), -6, 3)  # E4M3, normal
    inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    y = tl.minimum(tl.maximum(xf * _spread(inv, BR, BC, 16), -6.0), 6.0)
    return round_to_grid(y, 0, 1) * _spread(scale, BR, BC, 16)


@triton.jit
def _put(got, slot, AT: tl.constexpr, q, xf, nonzero, s, inv_s2):
    """``got`` with the squared error of the cast ``q`` at ``AT`` and its flushed count at ``AT + 2``."""
    d = (q - xf) * s
    got = tl.where(slot == AT, sum64(d * d) * inv_s2, got)
    return tl.where(slot == AT + 2, tl.sum((nonzero & (q == 0)).to(tl.int32)).to(tl.float64), got)


@triton.jit
def block_sums(xf, nonzero, s, slot, AT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """A float64 vector over ``slot``: the tile's ``BLOCK_FIELDS`` at ``AT`` onwards (per format
    squared error, squares, flushed count), 0 elsewhere. ``xf``: the tile, float32, its
    finite values (0 elsewhere); ``nonzero``: where they are not 0; ``s``: a power of two
    that brings the tile's max |x| near 1."""
    m16 = tl.max(tl.reshape(tl.abs(xf), (BR * BC // 16, 16)), axis=1)  # NVFP4's blocks: halves of MX's
    amax = _spread(tl.max(tl.reshape(m16, (BR * BC // 32, 2)), axis=1), BR, BC, 32)
    s64 = s.to(tl.float64)
    inv_s2 = 1.0 / (s64 * s64)
    y = xf * s
    sq = sum64(y * y) * inv_s2
    got = tl.where((slot >= AT) & (slot < AT + 12) & ((slot - AT) % 3 == 1), sq, 0.0)
    got = _put(got, slot, AT, _mx(xf, amax, _E4_EMAX, _E4_MAX, -6, 3), xf, nonzero, s, inv_s2)
    got = _put(got, slot, AT + 3, _mx(xf, amax, _E5_EMAX, _E5_MAX, -14, 2), xf, nonzero, s, inv_s2)
    got = _put(got, slot, AT + 6, _mx(xf, amax, _FP4_EMAX, 6.0, 0, 1), xf, nonzero, s, inv_s2)
    return _put(got, slot, AT + 9, _nvfp4(xf, m16, BR, BC), xf, nonzero, s, inv_s2)
