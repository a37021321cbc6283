"""Moments of a tile in the fused Triton kernel, and their merge: device functions.

``tile_moments`` gives a tile's count, mean and central moments m2 (m3, m4 on request) of
its finite values, scaled by a power of two ``s`` (``unit_scale``) and shifted by their
float32 mean, so that powers neither overflow nor vanish and a large |mean| cancels
nothing; ``merge_higher`` merges m3 and m4 of two sets (Pébay 2008), as
``stats.outliers.merge_higher`` does on the host. ``triton_stats`` calls them per tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["merge_higher", "sum64", "tile_moments", "unit_scale"]


@triton.jit
def unit_scale(top):
    """2**-e, ``e`` the exponent of the float32 bits ``top`` (a max |x|), kept a normal power of two."""
    e = tl.minimum(tl.maximum((top >> 23) - 127, -126), 126)
    return ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def sum64(v):
    """The sum of a 2-D tile: float32 along its rows, float64 across them."""
    return tl.sum(tl.sum(v, axis=1).to(tl.float64), axis=0)


@triton.jit
def tile_moments(v, fin, s, KURT: tl.constexpr):
    """(count, mean, m2, m3, m4) of the finite values of a tile (float64; m3 and m4 0 without
    ``KURT``): scaled by ``s``, shifted by their float32 mean (module docstring)."""
    y = tl.where(fin, v * s, 0.0)
    k = tl.sum(fin.to(tl.int32)).to(tl.float64)
    kk = tl.maximum(k, 1.0)
    shift = (sum64(y) / kk).to(tl.float32)
    d = tl.where(fin, y - shift, 0.0)
    d2 = d * d
    sd = sum64(d)
    sd2 = sum64(d2)
    r = sd / kk  # the mean of d: rounding only
    s64 = s.to(tl.float64)
    s2 = s64 * s64
    m3 = sd * 0.0
    m4 = sd * 0.0
    if KURT:  # central moments about the mean from the sums of powers of d (as stats.outliers)
        sd3 = sum64(d2 * d)
        m3 = (sd3 - r * (3.0 * sd2 - 2.0 * k * r * r)) / s2 / s64
        m4 = (sum64(d2 * d2) - r * (4.0 * sd3 - r * (6.0 * sd2 - 3.0 * k * r * r))) / s2 / s2
    return k, (shift.to(tl.float64) + r) / s64, tl.maximum(sd2 - sd * r, 0.0) / s2, m3, m4


@triton.jit
def merge_higher(na, nb, delta, m2a, m3a, m4a, m2b, m3b, m4b):
    """m3 and m4 of two merged sets (Pébay 2008, as ``stats.outliers.merge_higher``)."""
    d_n = delta / tl.maximum(na + nb, 1.0)
    m3 = m3a + m3b + delta * d_n * d_n * na * nb * (na - nb) + 3.0 * d_n * (na * m2b - nb * m2a)
    m4 = m4a + m4b + delta * d_n * d_n * d_n * na * nb * (na * na - na * nb + nb * nb)
    m4 += 6.0 * d_n * d_n * (na * na * m2b + nb * nb * m2a) + 4.0 * d_n * (na * m3b - nb * m3a)
    return m3, m4
