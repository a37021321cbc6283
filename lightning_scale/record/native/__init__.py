"""A one-pass kernel for host tensors: sum, sum of squares and max |x|, read once; the
block what-ifs (MXFP8, MXFP4, NVFP4 casts and their error), element for element as
``stats.blocks`` defines them; central moments up to the fourth (kurtosis); and the
per-tensor FP8 what-if (E4M3 and E5M2 casts after amax scaling), as ``stats.fp8`` defines it;
and each channel's max |x| (the channels group).

torch has no CPU kernel that gives a tensor's sum and sum of squares in one read (its
``var_mean`` is ~40x slower than a sum here), so on the host path the statistics read
every recorded tensor twice, and a tracked step's tensors do not fit in cache: about half
of a tracked step's extra time on a CPU. ``sums.c`` reads a float32 or bfloat16 tensor
once (float32 vector lanes, 256-element chunks added in float64: within ~1e-7 of float64
at any size, see its header).

It is compiled with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) the
first time it is asked for, into a per-user cache (``$LIGHTNING_SCALE_CACHE``, else
``$XDG_CACHE_HOME/lightning_scale`` or ``~/.cache/lightning_scale``), and loaded with
ctypes after a self-check against float64. Where there is no compiler, the build, the
load or the self-check fails, or ``LIGHTNING_SCALE_NATIVE=0``, ``sums`` returns None and
the statistics take torch's kernels: the same numbers, two reads. ``status()`` says
which, and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.native import self_check
from lightning_scale.record.native.bindings import Kernels
from lightning_scale.record.stats.layout import dense_order

__all__ = [
    "ENV",
    "SERIAL_MAX",
    "SERIAL_THREADS",
    "SOURCE",
    "block_casts",
    "blocks",
    "channel_maxima",
    "compiler",
    "configure",
    "every_group",
    "fp8",
    "load",
    "moments",
    "status",
    "sums",
    "switched_off",
]

#: Environment switch: ``0`` never builds nor uses the native kernel.
ENV = "LIGHTNING_SCALE_NATIVE"
#: Where torch runs more than ``SERIAL_THREADS`` threads, tensors above ``SERIAL_MAX``
#: elements (its reductions' grain size) are left to its kernels, which it splits over
#: threads; ours is serial. (Measured on a 2-core machine, over a tracked step's tensors:
#: torch's two reads take 10.3 ms on one thread, 8.2 ms on two; ours 5.2 ms.)
SERIAL_MAX = 32768
SERIAL_THREADS = 2
_ABI = 7
#: The kernel's C source, compiled on first use.
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sums.c")
#: (no fused multiply-adds but where sums.c allows them: the casts repeat the reference's float32 operations)
_FLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]

_lock = threading.Lock()
_loaded: Optional[Kernels] = None
_reason: Optional[str] = None  # why there is no kernel, once tried


def sums(x: Tensor, with_max: bool = False) -> Optional[Tuple[float, float, float]]:
    """(sum, sum of squares, max |x|) of a float32 or bfloat16 CPU tensor in one read, or
    None where the kernel is not available or does not fit (see ``_layout``). Squares are
    float32's: an element above ~1.8e19 in magnitude makes the sum of squares inf, and
    max |x| is meaningful only where both sums are finite. Without ``with_max`` the third
    number is -1.

    Runs once per recorded tensor of a tracked step: kept to a few attribute reads."""
    kernels = _loaded if _loaded is not None else _try_load()
    layout = _layout(x, kernels.fns.get((x.dtype, with_max))) if kernels is not None else None
    if layout is None:
        return None
    out = (ctypes.c_double * 3)()  # (as Kernels.call, without its second lookup)
    kernels.fns[(x.dtype, with_max)](x.data_ptr(), *layout, out)  # type: ignore[union-attr]
    return out[0], out[1], out[2]


def every_group(x: Tensor, bounds: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Every statistic group of a float32 or bfloat16 CPU tensor in one read (twice per
    256-element chunk where a format bound falls inside the chunk's range, the second
    time from cache), or None as for ``sums``. ``bounds``: at most 16 positive float32
    thresholds as an int32 numpy array of their bits. Returns ``(out, counts)``: out =
    [sum, sum of squares, max |x| (NaN with a NaN), least nonzero |x| (inf if none; NaN
    left out), NaN count]; ``counts[k]`` = #{|x| < bound k} among the non-NaN elements."""
    kernels = _loaded if _loaded is not None else _try_load()
    layout = _layout(x, kernels.all_fns.get(x.dtype)) if kernels is not None and len(bounds) <= 16 else None
    if layout is None:
        return None
    return kernels.call_all(x.dtype, x.data_ptr(), *layout, bounds)  # type: ignore[union-attr]


def blocks(x: Tensor) -> Optional[np.ndarray]:
    """``stats.blocks.BLOCK_FIELDS`` of a float32 or bfloat16 CPU tensor (non-empty, blocks
    along its last dimension) in one read, as 12 float64 numbers, or None where the kernel is
    not available or ``x``'s rows along its last dimension are not evenly strided (then
    ``stats.blocks.block_fields``). The casts are the reference's bit for bit (so are the
    flushed counts); the squares are added in float64 (the reference: float32, ~1e-7 apart)."""
    kernels = _loaded if _loaded is not None else _try_load()
    layout = _block_rows(x) if kernels is not None and x.dtype in kernels.block_fns else None
    if layout is None:
        return None
    return kernels.call_blocks(x.dtype, x.data_ptr(), *layout)  # type: ignore[union-attr]


def moments(x: Tensor, centre: Optional[float] = None) -> Optional[np.ndarray]:
    """[count, mean, M2, M3, M4] of the finite elements of a float32 or bfloat16 CPU tensor
    (``Mk`` the sum of ``(x - mean)^k``) in float64, as ``stats.outliers.moments_row``, in one
    read, or None where the kernel is not available or does not read ``x`` in place (then
    ``moments_row``). Without ``centre`` (a finite value near the mean, such as the first
    read's) each 1024 elements are read twice, the second time from cache, about their own mean."""
    kernels = _loaded if _loaded is not None else _try_load()
    if kernels is None or x.dtype not in kernels.moment_fns or x.numel() == 0:
        return None
    layout = _in_place(x)
    c = centre if centre is not None and math.isfinite(centre) else math.nan
    return None if layout is None else kernels.call_moments(x.dtype, x.data_ptr(), *layout, c)


def fp8(x: Tensor, amax: Optional[float] = None) -> Optional[np.ndarray]:
    """``stats.fields.FP8_FIELDS`` of a float32, bfloat16 or float16 CPU tensor (non-empty):
    per format (E4M3, E5M2) the sum of squared error, the sum of squares and the nonzeros
    flushed to zero, as ``stats.fp8.fp8_fields`` defines them, in one read (two without
    ``amax``, the largest finite |x|, where the caller knows it), as 6 float64 numbers; or None
    where the kernel is not available or does not read ``x`` in place (then ``fp8_fields``).
    The casts and the flushed counts are the reference's exactly; the sums are added in float64
    as the reference's, in another order (a few float64 roundings apart)."""
    kernels = _loaded if _loaded is not None else _try_load()
    if kernels is None or x.dtype not in kernels.fp8_fns or x.numel() == 0:
        return None
    layout = _in_place(x)
    if layout is None:
        return None
    bits = -1 if amax is None else int(np.float32(amax).view(np.int32))
    return kernels.call_fp8(x.dtype, x.data_ptr(), *layout, bits)  # type: ignore[union-attr]


def channel_maxima(x: Tensor) -> Optional[Tensor]:
    """Each last-dimension channel's max |x| over the finite elements (0 where none) of a float32,
    bfloat16 or float16 CPU tensor of at least 2 dimensions, as ``stats.channels.channel_maxima``
    (float64 ``[C]``, the same values), in one read; or None where the kernel is not available or
    the leading dimensions do not form at most two levels of evenly strided rows of contiguous
    channels (the heads of a fused projection's slice do)."""
    kernels = _loaded if _loaded is not None else _try_load()
    if kernels is None or x.dtype not in kernels.channel_fns or x.dim() < 2 or x.numel() == 0:
        return None
    layout = _channel_rows(x)
    if layout is None:
        return None
    (rows, stride), outer = layout
    got = kernels.call_channels(x.dtype, x.data_ptr(), rows, x.shape[-1], stride, outer)  # type: ignore[union-attr]
    return torch.from_numpy(got).double()


def _channel_rows(x: Tensor) -> Optional[Tuple[Tuple[int, int], Tuple[int, int]]]:
    """((rows, row stride), (groups, group stride)) of ``x``'s contiguous last dimension's rows:
    its leading dimensions by decreasing stride, merged where one continues the next (checked on
    the strides, no view made), at most two levels; or None."""
    if type(x) is not Tensor or not x.is_cpu or x.layout is not torch.strided or x.is_neg() or x.stride(-1) != 1:
        return None
    dims = sorted(((size, st) for size, st in zip(x.shape[:-1], x.stride()[:-1]) if size != 1), key=lambda d: d[1])
    levels: List[List[int]] = []  # [size, stride], innermost first
    for size, st in dims:
        if levels and levels[-1][0] * levels[-1][1] == st:
            levels[-1][0] *= size
        else:
            levels.append([size, st])
    if len(levels) > 2:
        return None
    levels += [[1, 0]] * (2 - len(levels))
    return (levels[0][0], levels[0][1]), (levels[1][0], levels[1][1])


def block_casts(x: Tensor) -> Optional[Tensor]:
    """What ``blocks`` casts ``x`` to, for tests: float32 ``(rows, ceil(k / 32), 4, 32)``, the
    dequantized blocks of MXFP8 E4M3, MXFP8 E5M2, MXFP4 and NVFP4 (two 16-element blocks) of
    each 32-element block of ``x``'s rows of ``k`` (non-finite elements taken as 0), or None as
    for ``blocks``."""
    kernels = _loaded if _loaded is not None else _try_load()
    layout = _block_rows(x) if kernels is not None and x.dtype in kernels.block_fns else None
    if layout is None:
        return None
    rows, cols, _ = layout
    casts = torch.empty(rows, -(-cols // 32), 4, 32)
    kernels.call_blocks(x.dtype, x.data_ptr(), *layout, casts.data_ptr())  # type: ignore[union-attr]
    return casts


def _block_rows(x: Tensor) -> Optional[Tuple[int, int, int]]:
    """(rows, cols, row stride) of ``x``'s rows along its last dimension (a 0-dim tensor: one
    of one element), or None (another device, a subclass, a negated view, an empty tensor,
    rows that are not contiguous or not evenly strided)."""
    if type(x) is not Tensor or not x.is_cpu or x.layout is not torch.strided or x.is_neg() or x.numel() == 0:
        return None
    k = x.shape[-1] if x.dim() else 1
    if x.is_contiguous():
        return x.numel() // k, k, k
    return _last_dim_rows(x, 32)


def _layout(x: Tensor, fn: Any) -> Optional[Tuple[int, int, int]]:
    """(rows, cols, row stride) for kernel ``fn`` (None: none for ``x``'s dtype) to read
    ``x`` with, or None where it may not: as ``_in_place``, and a large tensor that torch
    would split over its threads."""
    if fn is None or (x.numel() > SERIAL_MAX and torch.get_num_threads() > SERIAL_THREADS):
        return None
    return _in_place(x)


#: Tensor types whose data the kernels read directly: plain tensors, and parameters (a
#: compiled graph hands its statistics op the parameters themselves).
_PLAIN = (Tensor, torch.nn.Parameter)


def _in_place(x: Tensor) -> Optional[Tuple[int, int, int]]:
    """(rows, cols, row stride) to read ``x`` with in some order, or None: another device, a
    tensor subclass (DTensor), a sparse layout or a negated view, a layout that is not rows
    of contiguous elements."""
    if type(x) not in _PLAIN or not x.is_cpu or x.layout is not torch.strided or x.is_neg():
        return None
    n = x.numel()
    return (1, n, n) if x.is_contiguous() else _rows(x)


def _try_load() -> Optional[Kernels]:
    """The kernels, built and loaded on first use; None once that failed (not retried)."""
    return None if _reason is not None else load()


def _rows(x: Tensor) -> Optional[Tuple[int, int, int]]:
    """(rows, cols, row stride) describing exactly ``x``'s elements from ``x.data_ptr()``,
    in some order (sums do not depend on it), or None. Rows of the last dimension where
    the outer dimensions merge into one (checked on the strides: no view made, no
    exception raised), else one row if a permutation of ``x`` is dense."""
    rows = _last_dim_rows(x)
    if rows is not None:
        return rows
    if dense_order(x) is not None:  # (data_ptr() is then its lowest address)
        return 1, x.numel(), x.numel()
    return None


def _last_dim_rows(x: Tensor, block: int = 1) -> Optional[Tuple[int, int, int]]:
    """``x``'s elements as evenly strided rows of contiguous elements, (rows, cols, row
    stride), or None; checked on the strides, no view made. The dimensions are taken by
    decreasing stride (neither the sums nor the block what-ifs depend on the order of the
    rows: the heads of a (B, T, H, D) tensor viewed (B, H, T, D) are rows); the last dimension,
    contiguous, is widened by the next ones that continue it while its width is a multiple of
    ``block`` (blocks then stay whole: rows of ``D`` in contiguous rows of ``H D``)."""
    shape, strides = x.shape, x.stride()
    if len(shape) < 2 or strides[-1] != 1 or shape[-1] == 0:
        return None
    dims = sorted(((size, st) for size, st in zip(shape[:-1], strides[:-1]) if size != 1), key=lambda d: -d[1])
    cols = shape[-1]
    while dims and dims[-1][1] == cols and cols % block == 0:
        cols *= dims.pop()[0]
    if all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1)):
        return x.numel() // cols, cols, (dims[-1][1] if dims else cols)
    return None


#: How the kernel may be built: ``configure`` sets it from ``Settings`` where the core is entered.
_config: Dict[str, Any] = {"enabled": True, "cache": None}


def configure(enabled: bool = True, cache: Optional[str] = None) -> None:
    """Whether the kernel may be built and used (``LIGHTNING_SCALE_NATIVE``) and where it is
    built (``LIGHTNING_SCALE_CACHE``; None: the default folder), from ``Settings``; takes effect
    for this process. Switching it off drops a loaded kernel; switching it on again lets the
    next use load it."""
    global _loaded, _reason
    with _lock:
        changed = _config["enabled"] != enabled or _config["cache"] != cache
        _config.update(enabled=enabled, cache=cache)
        if not enabled:
            _loaded, _reason = None, f"{ENV}=0"
        elif changed and _reason == f"{ENV}=0":
            _reason = None


def load() -> Optional[Kernels]:
    """Build (once per machine) and load the kernel; None, with ``status()`` saying why,
    where that is not possible. Safe to call from several threads and processes."""
    global _loaded, _reason
    with _lock:
        if _loaded is not None or _reason is not None:
            return _loaded
        try:
            _loaded = _build_and_load()
        except _Unavailable as why:
            _reason = str(why)
        except Exception as err:  # noqa: BLE001 - a missing fast path must never break training
            _reason = f"{type(err).__name__}: {err}"
        return _loaded


def status() -> str:
    """Whether the native kernel is in use, and if not, why (after ``load()``)."""
    if _loaded is not None:
        return f"native one-pass kernel in use ({_loaded.path})"
    if _reason is not None:
        return f"native kernel not in use ({_reason}): statistics take torch's kernels (two reads per tensor)"
    return "native kernel not loaded yet"


@contextmanager
def switched_off() -> Iterator[None]:
    """Within this block (in this process) ``sums`` returns None: torch's kernels, for
    comparisons. Not thread-safe against concurrent ``load()``."""
    global _loaded, _reason
    saved = _loaded, _reason
    _loaded, _reason = None, "switched off by native.switched_off()"
    try:
        yield
    finally:
        _loaded, _reason = saved


class _Unavailable(Exception):
    pass


def _build_and_load() -> Kernels:
    if not _config["enabled"]:
        raise _Unavailable(f"{ENV}=0")
    with open(SOURCE, "rb") as f:
        source = f.read()
    cc = compiler()
    if cc is None:
        raise _Unavailable("no C compiler found: set CC, or install cc, gcc or clang")
    folder = _cache_dir()
    errors = []
    # (without AVX-512 variants where the compiler has no x86-64-v4, GCC < 11; without per-CPU
    # variants where the toolchain has no ifunc support, e.g. musl)
    for extra in ([], ["-DLS_NO_V4"], ["-DLS_NO_CLONES"]):
        flags = _FLAGS + extra
        key = hashlib.sha256(
            b"\0".join([source, " ".join(cc + flags).encode(), platform.machine().encode(), sys.platform.encode()])
        ).hexdigest()[:16]
        path = os.path.join(folder, f"sums-{key}.so")
        if os.path.exists(path) or _compile(cc, flags, folder, path, errors):
            break
    else:
        raise _Unavailable(f"{' '.join(cc)} failed: {errors[0]}")
    lib = ctypes.CDLL(path)
    lib.ls_abi.restype = ctypes.c_int
    if lib.ls_abi() != _ABI:
        raise _Unavailable(f"{path} has ABI {lib.ls_abi()}, expected {_ABI}")
    kernels = Kernels(lib, path)
    failed = self_check.failure(kernels)
    if failed is not None:
        raise _Unavailable(failed)
    return kernels


def _compile(compiler: List[str], flags: List[str], folder: str, path: str, errors: List[str]) -> bool:
    """Compile ``SOURCE`` to ``path`` (atomically: another process loads the old file or
    the new one); False, with the compiler's message in ``errors``, where it fails."""
    fd, tmp = tempfile.mkstemp(prefix=".sums-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *flags, "-o", tmp, SOURCE], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            errors.append(done.stderr.strip()[-500:] or f"exit status {done.returncode}")
            return False
        os.replace(tmp, path)
        return True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def compiler() -> Optional[List[str]]:
    """The C compiler command: ``$CC``, Python's own, else ``cc``, ``gcc`` or ``clang``; None if none is found."""
    candidates = [os.environ.get("CC", ""), sysconfig.get_config_var("CC") or "", "cc", "gcc", "clang"]
    for cand in candidates:
        words = shlex.split(cand)
        if words and shutil.which(words[0]):
            return words
    return None


def _cache_dir() -> str:
    folder = _config["cache"] or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lightning_scale"
    )
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return folder
