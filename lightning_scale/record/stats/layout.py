"""Layouts: whether a tensor's elements can be read in place as one dense array, and views
that split a tensor of any layout into bounded pieces.

One answer for every reader: the host path (``host``), the native kernel
(``lightning_scale.record.native``) and the Triton kernel (``triton_stats``). Statistics do
not depend on the order of the elements, so a transposed or permuted dense tensor reads as
a flat array like a contiguous one. Nothing here reads a tensor's data.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

from torch import Tensor

__all__ = [
    "DEVICE_SCRATCH_FLOOR",
    "SCRATCH_FLOOR",
    "SCRATCH_MAX",
    "Grid",
    "dense_order",
    "dense_view",
    "piece_size",
    "pieces",
    "row_grid",
    "scratch_bytes",
    "strided_grid",
]

#: Temporaries while one tensor is recorded stay within a quarter of its bytes, at most
#: ``SCRATCH_MAX``, plus a fixed floor (below it, splitting would cost more calls than it
#: saves): paths that make temporaries read a larger tensor in ``pieces``. The floor is
#: ``SCRATCH_FLOOR`` on the host path; on the device path (torch's kernels, where each
#: piece costs a dozen launches) ``DEVICE_SCRATCH_FLOOR``: a few tens of MB of an
#: accelerator's memory, a tensor of a million elements recorded without pieces.
SCRATCH_MAX = 64 << 20
SCRATCH_FLOOR = 4 << 20
DEVICE_SCRATCH_FLOOR = 64 << 20


def scratch_bytes(x: Tensor, floor: int = SCRATCH_FLOOR) -> int:
    """The bytes of temporaries recording ``x`` may take: ``min(SCRATCH_MAX, x's bytes / 4)
    + floor``."""
    return min(SCRATCH_MAX, x.numel() * x.element_size() // 4) + floor


def piece_size(x: Tensor, per_element: int, floor: int = SCRATCH_FLOOR) -> int:
    """Elements of ``x`` one piece may hold where a computation takes ``per_element`` bytes
    of temporaries per element it reads: ``scratch_bytes(x, floor) // per_element``."""
    return max(1, scratch_bytes(x, floor) // per_element)


def dense_order(x: Tensor) -> Optional[Tuple[int, ...]]:
    """The order of ``x``'s dimensions (by decreasing stride) in which its elements lie
    densely in memory, one after another: ``x.permute(order)`` is contiguous. The identity
    for a contiguous tensor, a permutation for a transposed one, None where there is none
    (a slice of a wider tensor, an expanded one). Arithmetic on the strides: no view made.

    Example:
        >>> import torch
        >>> dense_order(torch.zeros(3, 4).t()), dense_order(torch.zeros(3, 4)[:, :2])
        ((1, 0), None)
    """
    order = tuple(range(x.dim()))
    if x.is_contiguous():
        return order
    order = tuple(sorted(order, key=lambda i: -x.stride(i)))  # (stable: ties keep their order)
    span = 1
    for i in reversed(order):
        if x.size(i) == 1:  # (any stride: never stepped over)
            continue
        if x.stride(i) != span:
            return None
        span *= x.size(i)
    return order


def dense_view(x: Tensor) -> Tensor:
    """``x`` as a contiguous view (permuted) where ``dense_order`` finds one, else ``x``."""
    order = dense_order(x)
    if order is None or order == tuple(range(x.dim())):
        return x
    return x.permute(order)


def pieces(x: Tensor, size: int) -> Iterator[Tensor]:
    """Views of ``x`` whose elements together are ``x``'s, each at most ``size`` elements
    (``size >= 1``): slices of its flat view where it is dense, else slices along its
    outer dimensions (recursing into a dimension whose slices are still too large). No
    copy, whatever the layout."""
    if x.numel() <= size:
        yield x
        return
    if x.size(0) == 1:
        yield from pieces(x[0], size)
        return
    dense = dense_view(x)
    if dense.is_contiguous():
        yield from dense.view(-1).split(size)
        return
    inner = x[0].numel()
    if inner <= size:
        step = size // inner
        for start in range(0, x.size(0), step):
            yield x[start : start + step]
        return
    for i in range(x.size(0)):
        yield from pieces(x[i], size)


#: (tensor to read, n, M, N, s0, s1): see ``strided_grid``.
Grid = Tuple[Tensor, int, int, int, int, int]


def strided_grid(x: Tensor, bc: int) -> Optional[Grid]:
    """How a kernel (``triton_stats``) reads ``x`` in place: element (i, j) of an ``M x N`` grid at
    ``i * s0 + j * s1`` from ``x``'s first element, for ``i * N + j < n``. A flat array
    (contiguous, or dense in some order of its dimensions: a transpose) as rows of
    ``bc``; else dimensions that collapse to at most two strided ones. None otherwise."""
    n = x.numel()
    if dense_order(x) is not None:  # (its lowest address first: data_ptr)
        return x, n, -(-n // bc), bc, bc, 1
    dims = _collapsed(x)
    if dims is None:
        return None
    if len(dims) == 1:
        ((size, stride),) = dims
        return x, n, -(-n // bc), bc, bc * stride, stride
    (m, a), (k, b) = dims
    if abs(a) < abs(b):  # the faster-moving dimension inside a tile's rows
        (m, a), (k, b) = (k, b), (m, a)
    return x, n, m, k, a, b


def row_grid(x: Tensor) -> Optional[Grid]:
    """How a kernel reads ``x`` along its last dimension (where block-scaled formats' blocks
    run): element (i, j) of ``M`` rows of the last dimension's ``N`` elements at ``i * s0 +
    j``, the leading dimensions collapsed into one strided dimension (in any order: the
    blocks do not depend on it). None where the last dimension is not contiguous (stride
    1) or the leading dimensions do not collapse into one. A 0-dim ``x`` is one row of one.

    Example:
        >>> import torch
        >>> row_grid(torch.zeros(6, 16)[:, :10])[1:], row_grid(torch.zeros(4, 6).t())
        ((60, 6, 10, 16, 1), None)
    """
    n = x.numel()
    k = x.shape[-1] if x.dim() else 1
    if x.dim() and k != 1 and x.stride(-1) != 1:
        return None
    lead = sorted(((s, st) for s, st in zip(x.shape[:-1], x.stride()[:-1]) if s != 1), key=lambda d: -d[1])
    rows, s0 = 1, k
    for size, stride in reversed(lead):  # innermost first: each must step over the ones inside it
        if rows > 1 and stride != s0 * rows:
            return None
        s0 = stride if rows == 1 else s0
        rows *= size
    return x, n, rows, k, s0, 1


def _collapsed(x: Tensor) -> Optional[List[Tuple[int, int]]]:
    """(size, stride) of ``x``'s dimensions with size-1 ones dropped and neighbours that
    address like one dimension merged; None if more than two remain."""
    dims = [(s, st) for s, st in zip(x.shape, x.stride()) if s != 1]
    out: List[Tuple[int, int]] = []
    for size, stride in dims:
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out if 1 <= len(out) <= 2 else None
