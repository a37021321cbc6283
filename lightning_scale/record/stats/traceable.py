"""A tensor's record as plain tensor operations, for a compiler to trace into a graph.

``packed_record(x, groups)`` is the reference computation (``reference``) in the form a
compiler traces into a model's own graph: each row's partial sums (``reference.moment_rows``:
float32 sums over rows of up to 256 elements, read from the tensor's own buffer, which
Inductor fuses with the kernels that produce the tensor), then the other groups' fields
(``reference.extra_values``, with the whole tensor as one piece: user statistics included),
then, with ``channels``, the channel row, packed into one float64 vector.
``PackedLayout.records`` is the part that runs after the graph, on the packed vectors of all
of a graph's tensors at once: the float64 merge of the rows (``reference.finish_moments``)
in a few vectorised ops over a ``[rows, len(ROW_FIELDS)]`` tensor, where the merge in the
graph cost dozens of scalar ops per tensor. ``traceable_record`` is both for one tensor.

The device path reads large tensors in pieces to bound its temporaries; in a compiled graph
the compiler fuses the pointwise work into the reductions instead (Inductor keeps few
whole-size temporaries: ``blocks`` and ``fp8`` still hold some, see docs/limitations.md).
"""

from __future__ import annotations

import functools
import math
from typing import Collection, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats import run_table
from lightning_scale.record.stats.channels import CHANNEL_WIDTH
from lightning_scale.record.stats.reference import (
    ROW_FIELDS,
    extra_fields,
    extra_values,
    finish_moments,
    moment_rows,
    row_lengths,
)
from lightning_scale.record.stats.traceable_channels import traceable_channel_row

__all__ = [
    "PackedLayout",
    "ROW_FIELDS",
    "TRACEABLE_GROUPS",
    "extra_fields",
    "packed_record",
    "packed_size",
    "row_lengths",
    "traceable_record",
]

#: The groups ``traceable_record`` computes; fields of other groups are NaN.
TRACEABLE_GROUPS = ("moments", "range", "formats", "fp8", "blocks", "kurtosis")


def traceable_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s record as a float64 ``[width]`` tensor on ``x``'s device, from ops only:
    ``packed_record`` finished by ``PackedLayout.records``.

    Args:
        x: a floating-point tensor with at least one element.
        groups: which groups to compute ("moments" always is); fields of the other groups
            are NaN.

    Example:
        >>> from lightning_scale.record.stats.fields import FIELDS
        >>> row = traceable_record(torch.tensor([1.0, 2.0, 3.0]))
        >>> [float(row[FIELDS.index(name)]) for name in ("count", "mean", "m2", "absmax")]
        [3.0, 2.0, 2.0, 3.0]
    """
    return PackedLayout((x.numel(),), groups, x.device).records(packed_record(x, groups))[0]


def packed_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s statistics as graph ops, packed into one float64 vector of ``packed_size``
    elements: the partial sums of each row of ``x`` (``ROW_FIELDS``, ``[rows, len(ROW_FIELDS)]``
    flattened), then the fields of ``groups`` other than moments and range (``extra_fields``,
    user statistics' included), then, with the ``channels`` group, its channel row
    (``traceable_channel_row``, ``CHANNEL_WIDTH`` elements).

    ``PackedLayout.records`` finishes the packed vectors of many tensors into records at
    once, outside the compiled graph (the rows' float64 merge): in the graph each tensor
    costs its row loops and a few reshapes, not dozens of scalar ops."""
    x = x.detach()
    lay = run_table.layout(groups)
    parts = [moment_rows(x).reshape(-1).double()]
    if extra_fields(groups, lay):
        parts.append(torch.stack(extra_values(x, groups, lay, x.numel())))
    if "channels" in groups:
        parts.append(traceable_channel_row(x))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


_K = len(ROW_FIELDS)
#: The record's moments and range fields, side by side in record order.
_BASE = slice(0, 6)


def packed_size(n: int, groups: Collection[str]) -> int:
    """Elements of ``packed_record`` of a tensor of ``n`` elements."""
    _, rows, tail = row_lengths(n)
    return (rows + (tail > 0)) * _K + len(extra_fields(groups, run_table.layout(groups))) + _channel_width(groups)


def _channel_width(groups: Collection[str]) -> int:
    return CHANNEL_WIDTH if "channels" in groups else 0


class PackedLayout:
    """The packed vectors (``packed_record``) of ``len(numels)`` tensors, concatenated, and
    how they finish into records: each row's mean and m2, merged per tensor by Chan's
    formula about its first row's mean, in float64, in a few vectorised ops over every row
    of every tensor (segment sums). NaN and ±Inf propagate as on the device path (a NaN,
    or both infinities: mean and m2 NaN; one infinity: mean ±Inf, m2 NaN).

    Args:
        numels: each tensor's element count, in packing order.
        groups: the groups ``packed_record`` was given.
        device: where the packed vectors lie.
    """

    def __init__(self, numels: Sequence[int], groups: Collection[str], device: torch.device) -> None:
        self.numels = tuple(int(n) for n in numels)
        self.layout = run_table.layout(groups)
        self.extras = extra_fields(groups, self.layout)
        self.with_range = "range" in groups
        self.sizes = tuple(packed_size(n, groups) for n in self.numels)
        shape = [row_lengths(n) for n in self.numels]  # (numpy on the host: one upload each)
        rows = np.array([r + (t > 0) for _, r, t in shape], dtype=np.int64)
        first = np.cumsum(rows) - rows
        length = np.repeat(np.array([k for k, _, _ in shape], dtype=np.float64), rows)
        tailed = np.array([t > 0 for _, _, t in shape], dtype=bool)
        length[(first + rows - 1)[tailed]] = [t for _, _, t in shape if t]
        up = functools.partial(_upload, device=device)
        self._rows, self._first, self._length = up(rows), up(first), up(length)
        self._count = up(np.array(self.numels, dtype=np.float64))
        self._segment = up(np.repeat(np.arange(len(self.numels)), rows))
        self._columns = up(np.array([self.layout.ix[name] for name in self.extras], dtype=np.int64))
        self.channel_width = _channel_width(groups)
        at = self._positions(rows)
        self._rows_at, self._extras_at, self._channels_at = (None if i is None else up(i) for i in at)

    def _positions(self, rows: np.ndarray) -> Tuple[Optional[np.ndarray], ...]:
        """Where the rows', the other fields' and the channel rows' elements lie in the
        concatenated vectors (None: none of that part; rows None: the vectors are rows only)."""
        after = len(self.extras) + self.channel_width  # (each tensor's elements after its rows)
        if not after:
            return None, None, None
        sizes = np.array(self.sizes, dtype=np.int64)
        starts = np.cumsum(sizes) - sizes + rows * _K  # (each tensor's first element after its rows)
        extras = (starts[:, None] + np.arange(len(self.extras))).reshape(-1)
        channels = (starts[:, None] + len(self.extras) + np.arange(self.channel_width)).reshape(-1)
        is_row = np.ones(int(sizes.sum()), dtype=bool)
        is_row[extras] = is_row[channels] = False
        return np.flatnonzero(is_row), (extras if len(extras) else None), (channels if len(channels) else None)

    def records(self, packed: Tensor) -> Tensor:
        """``[len(numels), width]`` float64 records from the concatenated packed vectors.

        Raises:
            ValueError: ``packed`` does not have ``sum(sizes)`` elements.
        """
        if packed.shape != (sum(self.sizes),):
            raise ValueError(f"`packed` must have shape [{sum(self.sizes)}], got {list(packed.shape)}")
        rows = packed if self._rows_at is None else packed[self._rows_at]
        width = self.layout.width
        out = torch.full((len(self.numels), width), math.nan, dtype=torch.float64, device=packed.device)
        out[:, _BASE] = self._merged(rows.reshape(-1, _K))
        if self._extras_at is not None:
            out[:, self._columns] = packed[self._extras_at].reshape(len(self.numels), -1)
        return out

    def channel_rows(self, packed: Tensor) -> Optional[Tensor]:
        """``[len(numels), CHANNEL_WIDTH]`` channel rows from the concatenated packed vectors
        (None without the ``channels`` group)."""
        if self._channels_at is None:
            return None
        return packed[self._channels_at].reshape(len(self.numels), self.channel_width)

    def _merged(self, rows: Tensor) -> Tensor:
        """``[tensors, 6]``: count, mean, m2, absmax (NaN without ``range``), nan, inf."""
        return finish_moments(
            rows,
            self._length,
            self._count,
            self._first,
            lambda per_tensor: per_tensor[self._segment],
            lambda v: torch.segment_reduce(v, "sum", lengths=self._rows, unsafe=True),
            lambda v: torch.segment_reduce(v, "max", lengths=self._rows, unsafe=True),
            self.with_range,
        )


def _upload(values: np.ndarray, device: torch.device) -> Tensor:
    return torch.tensor(values).to(device, non_blocking=True)
