"""The native kernel's self-check, run once after it is built and loaded: each kernel on a
few values against numpy float64 (no torch op runs here: their first use would page in code,
counted as memory by whoever measures the first tracked step)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

__all__ = ["failure"]


class _Failed(Exception):
    pass


def failure(kernels: Any) -> Optional[str]:
    """Why the loaded ``kernels`` (``native``'s, with their ``call*`` methods) cannot be
    trusted, as a message starting "self-check failed", or None where every check passes."""
    try:
        _sums(kernels)
        _blocks(kernels)
        _block_groups(kernels)
        _moments(kernels)
        _fp8(kernels)
        _channels(kernels)
    except _Failed as why:
        return str(why)
    return None


def _sums(kernels: Any) -> None:
    """Every kernel against float64 on values that exercise the vector body, the chunk
    boundaries and the scalar tail, contiguous and in strided rows. In numpy, on numpy
    arrays: no torch op runs here (their first use would page in code, counted as memory
    by whoever measures the first tracked step)."""
    values = (np.arange(-1300, 1301, dtype=np.float64) / 7.0) ** 3 / 1e4
    values[5] = 0.0  # (with the middle one, two zeros)
    f32 = values.astype(np.float32)
    data = {torch.float32: f32, torch.bfloat16: (f32.view(np.uint32) >> 16).astype(np.uint16)}  # bf16: truncated
    exact = {
        torch.float32: f32.astype(np.float64),
        torch.bfloat16: ((data[torch.bfloat16].astype(np.uint32) << 16).view(np.float32)).astype(np.float64),
    }
    bounds = np.array(
        [1, 0x3A800000, 0x3F800000, 0x42C80000, 0x7F000000], dtype=np.int32
    )  # tiny, 2**-10, 1, 100, 2**127
    for dtype in kernels.dtypes:
        flat, ref = data[dtype], exact[dtype]
        wide = np.zeros((3, 1000), dtype=flat.dtype)  # rows of 867 in rows of 1000
        wide[:, :867] = flat[: 3 * 867].reshape(3, 867)
        for array, layout, want in ((flat, (1, flat.size, flat.size), ref), (wide, (3, 867, 1000), ref[: 3 * 867])):
            mags = np.abs(want)
            for with_max in (False, True):
                got = kernels.call(dtype, array.ctypes.data, *layout, with_max)
                if not (_sums_close(got, want) and got[2] == (mags.max() if with_max else -1.0)):
                    expected = (want.sum(), (want * want).sum(), mags.max())
                    raise _Failed(f"self-check failed for {dtype} (max: {with_max}): got {got}, expected {expected}")
            out, counts = kernels.call_all(dtype, array.ctypes.data, *layout, bounds)
            expect_counts = [(mags < b).sum() for b in bounds.view(np.float32).astype(np.float64)]
            if not (
                _sums_close(out, want)
                and list(counts) == expect_counts
                and out[2] == mags.max()
                and out[3] == mags[mags > 0].min()
                and out[4] == 0
            ):
                raise _Failed(
                    f"self-check failed for {dtype} (every group): got {list(out)}, {list(counts)}, "
                    f"expected counts {expect_counts}"
                )


def _blocks(kernels: Any) -> None:
    """The block kernel on one padded block whose MXFP4 cast is known: scale 2^0, q = 1, 3,
    -0, 6, 0 (0.2 and 0.001 flush), the sums of squares within float32 rounding (added in
    float32 per block)."""
    x = np.array([1.0, 3.3, -0.2, 7.9, 0.001], dtype=np.float32)
    for dtype in kernels.dtypes:
        data = x if dtype == torch.float32 else (x.view(np.uint32) >> 16).astype(np.uint16)
        ref = x.astype(np.float64) if dtype == torch.float32 else (data.astype(np.uint32) << 16).view(np.float32)
        ref = ref.astype(np.float64)
        err = ((np.array([1.0, 3.0, 0.0, 6.0, 0.0]) - ref) ** 2).sum()
        got = kernels.call_blocks(dtype, data.ctypes.data, 1, 5, 5)
        sq = (ref * ref).sum()
        if not (abs(got[7] - sq) <= 1e-6 * sq and got[8] == 2 and abs(got[6] - err) <= 1e-6 * err):
            raise _Failed(f"self-check failed for {dtype} (blocks): got {list(got)}")


def _block_groups(kernels: Any) -> None:
    """The block kernel on 6 blocks of scales 2^-3 to 2^5 (a group of 4, then 2: each block's
    scales in their own vector lane, each NVFP4 half its own), small values that flush, against
    an independent numpy quantiser (a grid step from the exponent, ``np.rint``'s ties to even):
    the flushed counts exact, the sums within float32 rounding."""
    i = np.arange(6 * 32, dtype=np.float64)
    x = np.sin(i * 0.37) * np.exp2(np.repeat([-3.0, 5, 0, 2, -1, 4], 32)) * (1 + (i % 7) / 3)
    x[[3, 40, 100]] = 1e-4, -2e-3, 3e-6
    x = x.astype(np.float32)
    got, want = kernels.call_blocks(torch.float32, x.ctypes.data, 1, x.size, x.size), _numpy_blocks(x)
    for f in range(4):
        ok = got[3 * f + 2] == want[3 * f + 2]
        if not (ok and all(abs(got[3 * f + k] - want[3 * f + k]) <= 1e-6 * want[3 * f + k] for k in (0, 1))):
            raise _Failed(f"self-check failed (blocks, format {f}): got {list(got)}, expected {list(want)}")


def _grid(y: np.ndarray, m: int, lo: int) -> np.ndarray:
    """``y`` rounded to nearest-even on the grid of ``m`` mantissa bits, least normal exponent ``lo``."""
    a = np.abs(y)
    step = np.exp2(np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), lo) - m)
    return np.sign(y) * np.rint(a / step) * step


def _numpy_blocks(x: np.ndarray) -> np.ndarray:
    """The block kernel's 12 sums of float32 ``x`` (whole 32-blocks, normal values), in float64."""
    rows = x.astype(np.float64).reshape(-1, 32)
    casts = []
    for emax, m, lo, top in ((8, 3, -6, 448.0), (15, 2, -14, 57344.0), (2, 1, 0, 6.0)):  # MX: E8M0 scales, FLOOR
        scale = np.exp2(np.floor(np.log2(np.abs(rows).max(1, keepdims=True))) - emax)
        casts.append(_grid(np.clip(rows / scale, -top, top), m, lo) * scale)
    halves = rows.reshape(-1, 16)  # NVFP4: E4M3 scales of amax / 6, a float32 reciprocal
    s = _grid(np.clip((np.abs(halves).max(1, keepdims=True) / 6).astype(np.float32), 2.0**-6, 448.0), 3, -6)
    y = (halves * (np.float32(1) / s.astype(np.float32))).astype(np.float32)
    casts.append((_grid(np.clip(y, -6, 6), 1, 0) * s).reshape(rows.shape))
    sums = []
    for q in casts:
        sums += [((q - rows) ** 2).sum(), (rows**2).sum(), float(((rows != 0) & (q == 0)).sum())]
    return np.array(sums)


def _moments(kernels: Any) -> None:
    """The moments kernel against numpy float64 on values far from 0 (a mean 1e4 standard
    deviations away), over chunk boundaries and a tail, a NaN and an Inf left out; about each
    chunk's mean and about a given centre."""
    x = (1e4 + np.sin(np.arange(2500)) + (np.arange(2500) % 7) ** 2 / 10.0).astype(np.float32)
    x[10], x[2000] = np.nan, np.inf
    v = x[np.isfinite(x)].astype(np.float64)
    d = v - v.mean()
    want = [v.size, v.mean(), (d**2).sum(), (d**3).sum(), (d**4).sum()]
    scale = [1, v.mean(), want[2], np.abs(d**3).sum(), want[4]]
    for centre in (np.nan, 1e4 + 3.0):  # (each chunk's own mean; one centre for all)
        got = kernels.call_moments(torch.float32, x.ctypes.data, 1, x.size, x.size, centre)
        if not all(abs(g - w) <= 1e-9 * s for g, w, s in zip(got, want, scale)):
            raise _Failed(f"self-check failed (moments, centre {centre}): got {list(got)}, expected {want}")


def _fp8(kernels: Any) -> None:
    """The per-tensor FP8 kernel against an independent numpy quantisation (a grid step from
    the exponent, ``np.rint``'s ties to even), with ties, subnormals of both formats, flushed
    values, a NaN and an Inf left out and a scalar tail; its own amax and a given one."""
    x = np.concatenate([np.linspace(-3.0, 5.0, 1001), [2.0**-10, 2.0**-11 * 3, 1e-4, 1e-7, 0.0, 0.0]])
    x = x.astype(np.float32)  # 1007 values: 125 vectors of 8 and a tail of 7
    x[[3, 700]] = np.nan, -np.inf
    finite = np.where(np.isfinite(x), np.abs(x), 0).astype(np.float32)
    amax = finite.max()
    for f, (top, m, lo) in enumerate(((448.0, 3, -6), (57344.0, 2, -14))):
        scale = np.float32(top) / amax
        y = (finite * scale).astype(np.float64)  # (float32 products, as the kernel's)
        step = np.exp2(np.maximum(np.floor(np.log2(np.where(y > 0, y, 1.0))), lo) - m)
        q = np.rint(y / step) * step
        want = [(((q - finite.astype(np.float64) * float(scale)) / float(scale)) ** 2).sum()]
        want += [(finite.astype(np.float64) ** 2).sum(), float(((finite > 0) & (q == 0)).sum())]
        for given in (-1, int(amax.view(np.int32))):
            got = kernels.call_fp8(torch.float32, x.ctypes.data, 1, x.size, x.size, given)[3 * f : 3 * f + 3]
            if not (got[2] == want[2] and all(abs(g - w) <= 1e-12 * w for g, w in zip(got[:2], want[:2]))):
                raise _Failed(f"self-check failed (fp8, format {f}): got {list(got)}, expected {want}")


def _channels(kernels: Any) -> None:
    """The channel maxima of rows of 19 channels (two vectors and a tail) in rows of 24, a NaN
    and an Inf left out, against numpy."""
    x = ((np.arange(5 * 24) * 37 % 101) - 50.0).astype(np.float32).reshape(5, 24)
    x[1, 2], x[3, 17] = np.nan, -np.inf
    want = np.where(np.isfinite(x), np.abs(x), 0)[:, :19].max(0)
    got = kernels.call_channels(torch.float32, x.ctypes.data, 5, 19, 24)
    if not np.array_equal(got, want):
        raise _Failed(f"self-check failed (channels): got {list(got)}, expected {list(want)}")


def _sums_close(got: Any, want: np.ndarray) -> bool:
    """A kernel's sum within 1e-6 of the sum of magnitudes (these values cancel) and its
    sum of squares within 1e-6 of float64's."""
    squares = (want * want).sum()
    return bool(abs(got[0] - want.sum()) <= 1e-6 * np.abs(want).sum() and abs(got[1] - squares) <= 1e-6 * squares)
