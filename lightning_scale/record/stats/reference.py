"""The reference computation: every record field of a tensor in torch, one definition each.

Runs on every device without a host read, and traces into a compiled graph (no data-dependent
branches or in-place writes on the traced values: its Python branches are on shapes). The
kernels (``native`` on the host, ``triton_stats`` on accelerators, ``short_records`` for many
short host tensors) are accelerations of it: each says which groups it covers, and this fills
the rest (``fill``); the conformance test holds every one of them to it and to float64.

* ``moments`` and ``range``: ``moment_rows`` (per row of at most 256 elements, along memory:
  a scaled shift, the scale, the sums of the shifted values and of their squares, NaN and
  non-finite counts, max |x|) finished by ``finish_moments`` (Chan's merge of the rows, in
  float64). Each row's values are scaled by the power of two that brings its max |x| to
  [1, 2) and shifted by their own float32 mean: no overflow, no cancellation (|mean| / std
  of 1e3 and more costs nothing), within ~1e-7 of float64.
* ``formats``: comparisons of |x| with each format's bounds, counted.
* ``fp8``, ``blocks``, ``kurtosis``: the casts and moments of ``fp8``, ``blocks``, ``outliers``.
* user statistics (``table.Statistic``): each ``sums`` function's values summed in float32 rows
  (float64 for float64 tensors), the rows added in float64; each ``maxes`` function's max.

``record(x, groups, layout)`` gives the whole record; a large tensor is read in ``pieces``
so that eager temporaries stay within ``layout.scratch_bytes`` (a compiler fuses them away).
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats import run_table, table
from lightning_scale.record.stats.blocks import block_fields
from lightning_scale.record.stats.fields import BASE, FIELDS, FORMATS, FP8_FIELDS, GROUPS, Col, sum64
from lightning_scale.record.stats.fp8 import fp8_fields_in_pieces
from lightning_scale.record.stats.layout import DEVICE_SCRATCH_FLOOR, SCRATCH_FLOOR, piece_size, pieces
from lightning_scale.record.stats.outliers import moments_row

__all__ = [
    "GROUP_FIELDS",
    "ROW_FIELDS",
    "extra_fields",
    "extra_values",
    "fill",
    "finish_moments",
    "moment_rows",
    "record",
    "row_lengths",
    "user_values",
]

#: The partial sums of one row (``moment_rows``), in order.
ROW_FIELDS = ("scaled_shift", "scale", "sum", "sum_sq", "nan", "non_finite", "absmax")
#: Elements a row at most: float32 sums of a row stay within ~1e-7 of exact.
_ROW = 256
#: The shortest row ``row_lengths`` takes to divide a tensor into rows without a tail.
_SHORTEST = 64
#: The record's moments and range fields, side by side in record order.
BASE_FIELDS = ("count", "mean", "m2", "absmax", "nan", "inf")
assert FIELDS[: len(BASE_FIELDS)] == BASE_FIELDS
#: Bytes of temporaries per element the eager reference takes at most (a float32 copy, |x|
#: and scaled values, masks; float64 tensors about twice): above ``layout.scratch_bytes`` a
#: tensor is read in pieces.
_SCRATCH = 24


def row_lengths(n: int) -> Tuple[int, int, int]:
    """(row length, full rows, tail) of ``n`` elements: one row up to ``_ROW``, else the
    longest row from ``_SHORTEST`` to ``_ROW`` elements that divides ``n`` (no tail row:
    one copy of the row ops per tensor in a compiled graph), else rows of ``_ROW`` and a
    shorter tail row."""
    if n <= _ROW:
        return n, 1, 0
    length = next((k for k in range(_ROW, _SHORTEST - 1, -1) if n % k == 0), _ROW)
    return length, n // length, n % length


def row_count(n: int) -> int:
    """Rows of ``moment_rows`` of ``n`` elements."""
    _, rows, tail = row_lengths(n)
    return rows + (tail > 0)


def _memory_order(x: Tensor) -> Tensor:
    """``x`` with its dimensions in the order of its strides, largest first: the fields do not
    depend on the order of the elements, and a view such as attention's q, k and v (``split``,
    then ``transpose``) is then read in rows along memory, where Inductor's loops over its
    logical order divide indices per element and do not vectorize (5x slower)."""
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return x if order == list(range(x.dim())) else x.permute(order)


def _rows_of(x: Tensor) -> List[Tensor]:
    """``x``'s elements along memory as 2-D rows (``row_lengths``): the full rows, then the tail."""
    flat = _memory_order(x).reshape(-1)
    length, rows, tail = row_lengths(flat.numel())
    if not tail:
        return [flat.reshape(rows, length)]
    return [flat[: rows * length].reshape(rows, length), flat[rows * length :].reshape(1, tail)]


def moment_rows(x: Tensor) -> Tensor:
    """``[rows, len(ROW_FIELDS)]`` partial sums of the rows of ``row_lengths(x.numel())``, in
    float32 (float64 for float64 ``x``), read along memory."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    parts = [_row_sums(r, acc) for r in _rows_of(x)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


def row_lengths_tensor(numels: Sequence[int], device: torch.device) -> Tensor:
    """float64 ``[rows]``: the length of every row of ``moment_rows`` of tensors of ``numels``
    elements, concatenated."""
    out: List[float] = []
    for n in numels:
        length, rows, tail = row_lengths(n)
        out += [float(length)] * rows + ([float(tail)] if tail else [])
    return torch.tensor(out, dtype=torch.float64).to(device, non_blocking=True)


SegmentFn = Callable[[Tensor], Tensor]


def finish_moments(
    rows: Tensor,
    length: Tensor,
    count: Tensor,
    first: Tensor,
    spread: SegmentFn,
    seg_sum: SegmentFn,
    seg_max: SegmentFn,
    with_range: bool,
) -> Tensor:
    """``[tensors, 6]``: count, mean, m2, absmax (NaN without ``with_range``), nan, inf of
    tensors whose ``moment_rows`` are ``rows`` (float64, concatenated; ``length``: each row's
    length), merged per tensor by Chan's formula about its first row's mean (``first``: the
    index of each tensor's first row; ``spread``: a per-tensor value to each of its rows;
    ``seg_sum``/``seg_max``: a sum/max of rows per tensor). NaN and ±Inf propagate as
    ``torch.mean`` and ``torch.var`` in float64 do (a NaN, or both infinities: mean and m2
    NaN; one infinity: mean ±Inf, m2 NaN)."""
    cs, s, s1, s2, nan, bad, top = rows.unbind(1)
    r = s1 / length  # (the row's mean of d)
    mean_i = (cs + r) / s  # (exact scaling)
    m2_i = (s2 - s1 * r).clamp(min=0) / s / s  # (s * s can overflow in float64)
    shift = torch.nan_to_num(mean_i[first], nan=0.0, posinf=0.0, neginf=0.0)
    sums = seg_sum(torch.stack([length * (mean_i - spread(shift)), nan, bad], 1))
    mean = shift + sums[:, 0] / count
    m2 = seg_sum(m2_i + length * (mean_i - spread(mean)).square())
    nans = sums[:, 1]
    if with_range:  # (NaN with a NaN, as amax gives it)
        absmax = torch.where(nans > 0, math.nan, seg_max(top))
    else:
        absmax = torch.full_like(nans, math.nan)
    return torch.stack([count, mean, m2, absmax, nans, sums[:, 2] - nans], 1)


def _one_tensor_moments(rows: Tensor, length: Tensor, n: int, with_range: bool) -> Tensor:
    """``finish_moments`` of one tensor's rows: ``[6]``."""
    count = torch.full((1,), float(n), dtype=torch.float64, device=rows.device)
    first = torch.zeros(1, dtype=torch.long, device=rows.device)
    out = finish_moments(
        rows,
        length,
        count,
        first,
        lambda v: v,
        lambda v: v.sum(0, keepdim=True),
        lambda v: v.amax(0, keepdim=True),
        with_range,
    )
    return out[0]


def formats(x: Tensor) -> Dict[str, Tensor]:
    """zeros, min_nonzero and each format's underflow, below_normal and overflow counts.

    NaN counts as neither zero nor nonzero (every comparison with it is false); a value below
    a threshold is nonzero and finite below it (``0 < |x| < bound``: the values below it less
    the zeros); an overflow is ``|x| > max`` (±Inf included). Eager, one mask at a time."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    a = x.to(acc).abs()
    zeros = (a == 0).sum().double()
    out = {"zeros": zeros, "min_nonzero": torch.where(a > 0, a, math.inf).amin().double()}
    for name, fmt in FORMATS.items():
        out[f"underflow_{name}"] = (a < fmt.min_subnormal).sum().double() - zeros
        out[f"below_normal_{name}"] = (a < fmt.min_normal).sum().double() - zeros
        out[f"overflow_{name}"] = (a > fmt.max).sum().double()
    return out


def _fp8(x: Tensor, size: int) -> Dict[str, Tensor]:
    return dict(zip(FP8_FIELDS, fp8_fields_in_pieces(x, sum64, size)))


def _blocks(x: Tensor, size: int) -> Dict[str, Tensor]:
    return dict(zip(GROUPS["blocks"], block_fields(x, size)))


def _kurtosis(x: Tensor, size: int) -> Dict[str, Tensor]:
    row = moments_row(x, size)  # (count, mean, m2, m3, m4) of the finite elements
    return {"m3": row[3], "m4": row[4]}


#: The reference of each built-in group beyond moments and range: its fields of a tensor, read
#: ``size`` elements at a time (in a compiled graph: the whole tensor, one traced copy of the
#: ops). A new group is one entry here (and its fields in ``table.TABLE``).
GROUP_FIELDS: Dict[str, Callable[[Tensor, int], Dict[str, Tensor]]] = {
    "formats": lambda x, size: formats(x),
    "fp8": _fp8,
    "blocks": _blocks,
    "kurtosis": _kurtosis,
}
#: The groups read piece by piece (their fields merge over pieces by their declared merges);
#: the others read a large tensor in pieces of their own.
_PIECEWISE = frozenset({"formats"})


def user_values(x: Tensor, stat: table.Statistic) -> List[Tensor]:
    """A user statistic's fields of ``x`` (its ``fields`` order: sums, then maxes), float64
    0-dim tensors. Each function is applied to the values in float32 (float64 for float64
    ``x``); each sum is of float32 row sums (float64 for float64 ``x``) added in float64,
    each max the function's largest value (NaN with a NaN)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = []
    for fn in stat.sums.values():
        rows = [fn(r.to(acc)).to(acc).sum(1) for r in _rows_of(x)]
        out.append(torch.cat(rows).double().sum() if len(rows) > 1 else rows[0].double().sum())
    for fn in stat.maxes.values():
        out.append(fn(x.to(acc)).amax().double())
    return out


def extra_fields(groups: Collection[str], layout: run_table.Layout = BASE) -> Tuple[str, ...]:
    """The fields of ``groups`` beyond moments and range (``extra_values``' order: record order)."""
    return tuple(f.name for f in layout.fields if f.group in groups and f.group not in ("moments", "range", "channels"))


def extra_values(x: Tensor, groups: Collection[str], layout: run_table.Layout, size: int) -> List[Tensor]:
    """The values of ``extra_fields(groups, layout)`` of ``x``, float64 0-dim tensors."""
    values: Dict[str, Tensor] = {}
    for group in groups:
        if group in GROUP_FIELDS:
            values.update(GROUP_FIELDS[group](x, size))
    for stat in layout.user:
        if stat.group in groups:
            values.update(zip(stat.fields, user_values(x, stat)))
    return [values[name].double() for name in extra_fields(groups, layout)]


def columns(x: Tensor, groups: Collection[str], layout: run_table.Layout = BASE) -> Tuple[List[int], Tensor]:
    """(columns, float64 values on ``x``'s device) of the fields of ``groups`` of a non-empty
    ``x``: ``moments`` (count, mean, m2, nan, inf; with ``range`` absmax too), ``range`` alone
    (absmax), and the other groups' fields (``extra_fields``). Eager: a large tensor is read in
    pieces whose temporaries stay within ``layout.scratch_bytes``."""
    x = x.detach()
    floor = SCRATCH_FLOOR if x.device.type == "cpu" else DEVICE_SCRATCH_FLOOR
    size = piece_size(x, _SCRATCH * (2 if x.dtype == torch.float64 else 1), floor)
    parts = [x] if x.numel() <= size else list(pieces(x, size))
    cols: List[int] = []
    values: List[Tensor] = []
    if "moments" in groups or "range" in groups:
        rows = torch.cat([moment_rows(p) for p in parts]).double() if len(parts) > 1 else moment_rows(x).double()
        lengths = row_lengths_tensor([p.numel() for p in parts], x.device)
        base = _one_tensor_moments(rows, lengths, x.numel(), "range" in groups)
        picked = [c for c, name in enumerate(BASE_FIELDS) if _in(name, groups)]
        cols += picked
        values.append(base[picked])
    extras = extra_fields(groups, layout)
    if extras:
        cols += [layout.ix[name] for name in extras]
        values.append(torch.stack(_extras(x, parts, groups, layout, size)))
    return cols, torch.cat(values) if len(values) > 1 else values[0]


def _in(name: str, groups: Collection[str]) -> bool:
    return name == "absmax" and "range" in groups or name != "absmax" and "moments" in groups and name != "count"


def _extras(
    x: Tensor, parts: List[Tensor], groups: Collection[str], layout: run_table.Layout, size: int
) -> List[Tensor]:
    """``extra_values`` of ``x`` from its ``parts``: counts and sums add, extremes are the parts'."""
    if len(parts) == 1:
        return extra_values(x, groups, layout, size)
    values: Dict[str, Tensor] = {}
    for group in groups:
        if group in _PIECEWISE:
            each = [GROUP_FIELDS[group](p, size) for p in parts]
            values.update({k: _merged(k, [e[k] for e in each]) for k in each[0]})
        elif group in GROUP_FIELDS:
            values.update(GROUP_FIELDS[group](x, size))
    for stat in layout.user:
        if stat.group in groups:
            each_user = torch.stack([torch.stack(user_values(p, stat)) for p in parts])  # [parts, fields]
            k = len(stat.sums)
            values.update(zip(stat.fields, [*each_user[:, :k].sum(0).unbind(), *each_user[:, k:].amax(0).unbind()]))
    return [values[name].double() for name in extra_fields(groups, layout)]


_MERGE = {f.name: f.merge for f in table.TABLE}


def _merged(name: str, parts: List[Tensor]) -> Tensor:
    """A field of pieces merged by its declared merge (``table.TABLE``: a sum, a min or a max)."""
    stacked = torch.stack(parts)
    merge = _MERGE[name]
    return stacked.amin() if merge == "min" else stacked.amax() if merge == "max" else stacked.sum()


def record(x: Tensor, groups: Collection[str] = ("moments",), layout: run_table.Layout = BASE) -> Tensor:
    """``x``'s record, float64 ``[layout.width]`` on its device, computed here alone (fields of
    groups not asked for are NaN; "moments" is always computed).

    Example:
        >>> from lightning_scale.record.stats.fields import IX
        >>> row = record(torch.tensor([1.0, 2.0, 3.0]), ("moments", "range"))
        >>> [float(row[IX[name]]) for name in ("count", "mean", "m2", "absmax")]
        [3.0, 2.0, 2.0, 3.0]
    """
    out = torch.full((layout.width,), math.nan, dtype=torch.float64, device=x.device)
    out[Col.COUNT] = x.numel()
    if x.numel() == 0:
        out[Col.MEAN] = out[Col.M2] = 0.0
        return out
    cols, values = columns(x, {"moments", *groups}, layout)
    out[cols] = values
    return out


def fill(x: Tensor, groups: Collection[str], out: List, layout: run_table.Layout = BASE, host: bool = False) -> None:
    """Write the fields of ``groups`` of a non-empty ``x`` into the entry list ``out`` (its
    count already there): floats with ``host`` (one read of them all), else 0-dim tensors."""
    if not groups:
        return
    cols, values = columns(x, groups, layout)
    for c, v in zip(cols, values.tolist() if host else values.unbind()):
        out[c] = v
