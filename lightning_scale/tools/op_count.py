"""Counting what a piece of code costs on the accelerator path, at dispatch level.

``OpCounter`` is a ``TorchDispatchMode`` that lists the aten ops run outside Triton's
own frames (Triton's interpreter copies a kernel's arguments around it; on a GPU that is
one launch), and those whose output has at least a given element count and is not a view:
each reads or writes the whole tensor once more. The tests and ``benchmarks/kernel_ops.py``
count the cost of one record with it. ``largest`` is the size of the largest tensor an op
allocated (a temporary: the tests bound what recording one tensor takes with it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Any, List

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["OpCounter"]


def _triton_dir() -> str:
    """Triton's package folder (found, not imported), with a trailing separator; a path
    no file has where Triton is not installed. (A checkout that lies under a folder named
    ``triton`` must not count as Triton's frames.)"""
    spec = importlib.util.find_spec("triton")
    places = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.join(os.path.realpath(places[0]), "") if places else "\x00"


_TRITON_DIR = _triton_dir()


@functools.lru_cache(maxsize=None)
def _in_triton(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_TRITON_DIR)


class OpCounter(TorchDispatchMode):
    """Aten ops (``aten.empty.memory_format``, ...) run outside Triton's own frames, and
    those with a full-size output (at least ``numel`` elements, not a view), and the bytes
    of the largest output any op allocated (every op's: Triton's own included; neither a
    view nor an input written in place)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel = numel
        self.ops: List[str] = []
        self.full: List[str] = []
        self.largest = 0

    def names(self) -> List[str]:
        """The ops' base names (``empty``), in order."""
        return [op.split(".")[1] for op in self.ops]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._allocated(func, out, args, kwargs)
        frame = sys._getframe(1)
        while frame is not None and not _in_triton(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is None:
            self.ops.append(str(func))
            if isinstance(out, Tensor) and out.numel() >= self.numel and not func.is_view:
                self.full.append(str(func))
        return out

    def _allocated(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        if func.is_view:
            return
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
