"""A tensor's record as plain tensor operations, for a compiler to trace into a graph.

``traceable_record(x, groups)`` gives the same ``len(FIELDS)`` float64 vector as
``record_of`` on the device path, in two parts. ``packed_record(x, groups)`` is the part a
compiler traces into a model's own graph: no host reads, data-dependent branches or
in-place writes, so that TorchDynamo/AOTAutograd can trace it and Inductor can fuse its
reductions (float32 vector sums over rows of up to 256 elements, read from the tensor's own
buffer) with the kernels that produce the tensor. It returns each row's partial sums, and
the fields of the optional groups, packed into one float64 vector. ``PackedLayout.records``
is the part that runs after the graph, on the packed vectors of all of a graph's tensors at
once: the float64 merge of the rows (Chan's formula) in a few vectorised ops over a
``[rows, len(ROW_FIELDS)]`` tensor, where the merge in the graph cost dozens of scalar ops
per tensor, compiled into kernels with hundreds of scalar outputs.

Moments take each row about its own mean estimate, scaled by a power of two, so a mean far
above the spread (|mean| / std of 1e3 and more) costs no accuracy (``_row_sums`` says why):
within ~1e-7 of float64, the device path's standard.

Every group is traceable. The optional ones reuse the device path's own functions, which are
torch ops on tensors throughout (their only Python branches are on shapes), called with the
whole tensor as one piece: ``fp8`` (``fp8.fp8_fields_in_pieces``: the per-tensor amax,
then the casts), ``blocks`` (``blocks.block_fields``: MXFP8/MXFP4/NVFP4 casts, bit tricks on
float32 and float16 views) and ``kurtosis`` (``outliers.moments_row``: central moments
about each row's own mean, merged in float64). The device path reads large tensors in
pieces to bound its temporaries; in a compiled graph the compiler fuses the pointwise work
into the reductions instead (Inductor keeps few whole-size temporaries: ``blocks`` and
``fp8`` still hold some, see docs/limitations.md).
"""

from __future__ import annotations

import functools
import math
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats.blocks import BLOCK_FIELDS, block_fields
from lightning_scale.record.stats.channels import CHANNEL_WIDTH
from lightning_scale.record.stats.fields import FIELDS, FORMATS, FP8_FIELDS, GROUPS, IX, TABLE, span, sum64
from lightning_scale.record.stats.fp8 import fp8_fields_in_pieces
from lightning_scale.record.stats.outliers import moments_row
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
    """``x``'s record as a float64 ``[len(FIELDS)]`` tensor on ``x``'s device, from ops only:
    ``packed_record`` finished by ``PackedLayout.records``.

    Args:
        x: a floating-point tensor with at least one element.
        groups: which of ``GROUPS`` to compute ("moments" always is); fields of the other
            groups are NaN.

    Example:
        >>> row = traceable_record(torch.tensor([1.0, 2.0, 3.0]))
        >>> [float(row[FIELDS.index(name)]) for name in ("count", "mean", "m2", "absmax")]
        [3.0, 2.0, 2.0, 3.0]
    """
    return PackedLayout((x.numel(),), groups, x.device).records(packed_record(x, groups))[0]


def packed_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s statistics as graph ops, packed into one float64 vector of ``packed_size``
    elements: the partial sums of each row of ``x`` (``ROW_FIELDS``, ``[rows, len(ROW_FIELDS)]``
    flattened), then the fields of ``groups`` other than moments and range (``extra_fields``),
    then, with the ``channels`` group, its channel row (``traceable_channel_row``,
    ``CHANNEL_WIDTH`` elements).

    ``PackedLayout.records`` finishes the packed vectors of many tensors into records at
    once, outside the compiled graph (the rows' float64 merge): in the graph each tensor
    costs its row loops and a few reshapes, not dozens of scalar ops."""
    x = x.detach()
    parts = [_moment_rows(x).reshape(-1).double()]
    extras = extra_fields(groups)
    if extras:
        values = {**(_formats(x) if "formats" in groups else {}), **_what_ifs(x, groups)}
        parts.append(torch.stack([values[name] for name in extras]).double())
    if "channels" in groups:
        parts.append(traceable_channel_row(x))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


#: The partial sums of one row (``_row_sums``), in the order ``packed_record`` packs them.
ROW_FIELDS = ("scaled_shift", "scale", "sum", "sum_sq", "nan", "non_finite", "absmax")
_K = len(ROW_FIELDS)
#: Elements a row of ``_row_sums`` at most: float32 sums of a row stay within ~1e-7 of exact.
_ROW = 256
#: The shortest row ``row_lengths`` takes to divide a tensor into rows without a tail.
_SHORTEST = 64
#: The record's moments and range fields, side by side in record order.
_BASE = span(("count", "mean", "m2", "absmax", "nan", "inf"))


def extra_fields(groups: Collection[str]) -> Tuple[str, ...]:
    """The fields of ``groups`` that ``packed_record`` packs after the rows, in record order."""
    return tuple(f.name for f in TABLE if f.group in groups and f.group not in ("moments", "range"))


def row_lengths(n: int) -> Tuple[int, int, int]:
    """(row length, full rows, tail) of ``n`` elements: one row up to ``_ROW``, else the
    longest row from ``_SHORTEST`` to ``_ROW`` elements that divides ``n`` (no tail row:
    one copy of the row ops per tensor), else rows of ``_ROW`` and a shorter tail row."""
    if n <= _ROW:
        return n, 1, 0
    length = next((k for k in range(_ROW, _SHORTEST - 1, -1) if n % k == 0), _ROW)
    return length, n // length, n % length


def packed_size(n: int, groups: Collection[str]) -> int:
    """Elements of ``packed_record`` of a tensor of ``n`` elements."""
    _, rows, tail = row_lengths(n)
    return (rows + (tail > 0)) * _K + len(extra_fields(groups)) + _channel_width(groups)


def _channel_width(groups: Collection[str]) -> int:
    return CHANNEL_WIDTH if "channels" in groups else 0


def _moment_rows(x: Tensor) -> Tensor:
    """``[rows, len(ROW_FIELDS)]`` partial sums of the rows of ``row_lengths(x.numel())``, in
    float32 (float64 for float64 ``x``), read along memory."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    flat = _memory_order(x).reshape(-1)
    length, rows, tail = row_lengths(flat.numel())
    if not tail:
        return _row_sums(flat.reshape(rows, length), acc)
    whole = _row_sums(flat[: rows * length].reshape(rows, length), acc)
    return torch.cat([whole, _row_sums(flat[rows * length :].reshape(1, tail), acc)])


def _memory_order(x: Tensor) -> Tensor:
    """``x`` with its dimensions in the order of its strides, largest first: these fields do
    not depend on the order of the elements, and a view such as attention's q, k and v
    (``split``, then ``transpose``) is then read in rows along memory, where Inductor's
    loops over its logical order divide indices per element and do not vectorize (5x slower)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return x if order == list(range(x.dim())) else x.permute(order)


def _row_sums(r: Tensor, acc: torch.dtype) -> Tensor:
    """``[rows, len(ROW_FIELDS)]`` per row of ``r``: its scaled shift ``c s`` (the float32 mean
    of ``x s``, 0 if not finite), scale ``s``, the sums of ``d = x s - c s`` and ``d**2``, NaN
    count, non-finite count and max |x|.

    ``s`` is the power of two that brings the row's max |x| to [1, 2): the sums neither
    overflow nor underflow, and a mean far above the spread cancels in ``d``, exactly near
    ``c``. The cancellation left in the row's ``m2 = sum(d**2) - sum(d)**2 / n`` is about
    ``(mean - c)**2 / var`` float32 roundings: none to speak of. Few ops: each is a node the
    compiler traces and schedules, once per recorded tensor and direction (concatenated
    ``keepdim`` columns, no stack; no ``nan_to_num``, which decomposes into nine)."""
    y = r.to(acc)
    top = y.abs().amax(1, keepdim=True)  # (NaN with a NaN)
    bound = 126 if acc == torch.float32 else 1022  # (2**±bound: normal numbers)
    s = torch.exp2((-torch.floor(torch.log2(top))).clamp(-bound, bound))  # (max 0: 2**bound)
    ys = y * s  # (exact: a power of two)
    cs = ys.mean(1, keepdim=True)
    cs = torch.where(cs - cs == 0, cs, 0.0)  # (±Inf or NaN: 0, so that one infinity gives a mean of ±Inf)
    d = ys - cs  # (one rounding, in the difference)
    nan = (y != y).sum(1, keepdim=True, dtype=acc)  # (comparisons, not isnan/isinf: Inductor vectorizes them)
    bad = (y - y != 0).sum(1, keepdim=True, dtype=acc)  # NaN or ±Inf: x - x is NaN
    return torch.cat([cs, s, d.sum(1, keepdim=True), (d * d).sum(1, keepdim=True), nan, bad, top], 1)


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
        self.extras = extra_fields(groups)
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
        self._columns = up(np.array([IX[name] for name in self.extras], dtype=np.int64))
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
        """``[len(numels), len(FIELDS)]`` float64 records from the concatenated packed vectors.

        Raises:
            ValueError: ``packed`` does not have ``sum(sizes)`` elements.
        """
        if packed.shape != (sum(self.sizes),):
            raise ValueError(f"`packed` must have shape [{sum(self.sizes)}], got {list(packed.shape)}")
        rows = packed if self._rows_at is None else packed[self._rows_at]
        out = torch.full((len(self.numels), len(FIELDS)), math.nan, dtype=torch.float64, device=packed.device)
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
        cs, s, s1, s2, nan, bad, top = rows.unbind(1)
        r = s1 / self._length  # (the row's mean of d)
        mean_i = (cs + r) / s  # (exact scaling)
        m2_i = (s2 - s1 * r).clamp(min=0) / s / s  # (s * s can overflow in float64)
        shift = torch.nan_to_num(mean_i[self._first], nan=0.0, posinf=0.0, neginf=0.0)
        sums = self._sum(torch.stack([self._length * (mean_i - shift[self._segment]), nan, bad], 1))
        mean = shift + sums[:, 0] / self._count
        m2 = self._sum(m2_i + self._length * (mean_i - mean[self._segment]).square())
        nans = sums[:, 1]
        if self.with_range:  # (NaN with a NaN, as amax gives it)
            absmax = torch.where(nans > 0, math.nan, torch.segment_reduce(top, "max", lengths=self._rows, unsafe=True))
        else:
            absmax = torch.full_like(nans, math.nan)
        return torch.stack([self._count, mean, m2, absmax, nans, sums[:, 2] - nans], 1)

    def _sum(self, values: Tensor) -> Tensor:
        """Each tensor's sum of ``values`` over its rows (dim 0), in row order."""
        return torch.segment_reduce(values, "sum", lengths=self._rows, unsafe=True)


def _formats(x: Tensor) -> Dict[str, Tensor]:
    """zeros, min_nonzero and each format's underflow, below_normal and overflow counts.

    NaN counts as neither zero nor nonzero (every comparison with it is false); a value below
    a threshold is nonzero and finite below it (``0 < |x| < bound``); an overflow is ``|x| >
    max`` (±Inf included)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = x.to(acc).abs()
    nonzero = a > 0
    out = {
        "zeros": (a == 0).sum().double(),
        "min_nonzero": torch.where(nonzero, a, math.inf).amin().double(),
    }
    for name, fmt in FORMATS.items():
        out[f"underflow_{name}"] = (nonzero & (a < fmt.min_subnormal)).sum().double()
        out[f"below_normal_{name}"] = (nonzero & (a < fmt.min_normal)).sum().double()
        out[f"overflow_{name}"] = (a > fmt.max).sum().double()
    missing: List[str] = [f for f in GROUPS["formats"] if f not in out]
    if missing:  # the field table and this function must name the same fields
        raise ValueError(f"`formats` fields without a traceable formula: {missing}")
    return out


def _upload(values: np.ndarray, device: torch.device) -> Tensor:
    return torch.tensor(values).to(device, non_blocking=True)


def _what_ifs(x: Tensor, groups: Collection[str]) -> Dict[str, Tensor]:
    """The ``fp8``, ``blocks`` and ``kurtosis`` fields of ``groups``: the device path's
    functions on ``x`` as one piece (so one traced copy of their ops, whatever ``x``'s size)."""
    whole = x.numel()
    out: Dict[str, Tensor] = {}
    if "fp8" in groups:
        out.update(zip(FP8_FIELDS, fp8_fields_in_pieces(x, sum64, whole)))
    if "blocks" in groups:
        out.update(zip(BLOCK_FIELDS, block_fields(x, whole)))
    if "kurtosis" in groups:
        row = moments_row(x, whole)  # (count, mean, m2, m3, m4) of the finite elements
        out["m3"], out["m4"] = row[3], row[4]
    return out
