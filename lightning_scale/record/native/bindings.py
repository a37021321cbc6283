"""The ctypes bindings of ``sums.c`` (``native``'s kernels): each function's signature, bound
per dtype, and a method per kernel that calls it on an address and a layout and returns its
numbers. No torch op runs here."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

__all__ = ["Kernels"]


class Kernels:
    """The loaded library's functions, by dtype, with the ctypes signatures of ``sums.c``, and a
    ``call*`` method per kernel (numpy or float results; one output buffer per call: thread-safe)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        sums_args = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_double)]
        all_args = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        blocks_args = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        #: (dtype, with max |x|) -> the sums kernel; dtype -> the kernel of every group, of the block what-ifs
        self.fns: Dict[Tuple[torch.dtype, bool], Any] = {}
        self.all_fns: Dict[torch.dtype, Any] = {}
        self.block_fns: Dict[torch.dtype, Any] = {}
        self.moment_fns: Dict[torch.dtype, Any] = {}
        moment_args = [*blocks_args[:4], ctypes.c_double, ctypes.c_void_p]
        for dtype, suffix in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            self.fns[(dtype, False)] = _bind(lib, f"ls_sums_{suffix}", sums_args)
            self.fns[(dtype, True)] = _bind(lib, f"ls_sums_max_{suffix}", sums_args)
            self.all_fns[dtype] = _bind(lib, f"ls_all_{suffix}", all_args)
            self.block_fns[dtype] = _bind(lib, f"ls_blocks_{suffix}", blocks_args)
            self.moment_fns[dtype] = _bind(lib, f"ls_moments_{suffix}", moment_args)
        fp8_args = [*blocks_args[:4], ctypes.c_int32, ctypes.c_void_p]
        wide = ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16"))
        self.fp8_fns = {dtype: _bind(lib, f"ls_fp8_{suffix}", fp8_args) for dtype, suffix in wide}
        channel_args = [ctypes.c_void_p, *[ctypes.c_int64] * 5, ctypes.c_void_p]
        self.channel_fns = {dtype: _bind(lib, f"ls_channels_{suffix}", channel_args) for dtype, suffix in wide}
        self.dtypes = list(self.all_fns)

    def call(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, with_max: bool
    ) -> Tuple[float, float, float]:
        out = (ctypes.c_double * 3)()  # (one per call: thread-safe)
        self.fns[(dtype, with_max)](address, rows, cols, stride, out)
        return out[0], out[1], out[2]

    def call_all(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, bounds: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray]:
        out, counts = np.empty(5), np.empty(len(bounds), dtype=np.int64)
        self.all_fns[dtype](
            address, rows, cols, stride, bounds.ctypes.data, len(bounds), counts.ctypes.data, out.ctypes.data
        )
        return out, counts

    def call_blocks(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, casts: int = 0
    ) -> np.ndarray:
        out = np.empty(12)
        self.block_fns[dtype](address, rows, cols, stride, out.ctypes.data, casts or None)
        return out

    def call_moments(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, centre: float = math.nan
    ) -> np.ndarray:
        out = np.empty(5)
        self.moment_fns[dtype](address, rows, cols, stride, centre, out.ctypes.data)
        return out

    def call_fp8(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, amax: int = -1
    ) -> np.ndarray:
        out = np.empty(6)
        self.fp8_fns[dtype](address, rows, cols, stride, amax, out.ctypes.data)
        return out

    def call_channels(
        self, dtype: torch.dtype, address: int, rows: int, cols: int, stride: int, outer: Tuple[int, int] = (1, 0)
    ) -> np.ndarray:
        out = np.zeros(cols, dtype=np.int32)
        self.channel_fns[dtype](address, outer[0], outer[1], rows, cols, stride, out.ctypes.data)
        return out.view(np.float32)


def _bind(lib: ctypes.CDLL, name: str, args: List[Any]) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = args, None
    return fn
