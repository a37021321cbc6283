"""Records: the built-in record layout, derived from the statistic table, and record arithmetic.

A *record* is a float64 vector that summarises one tensor: the fields of ``table.TABLE``
(count, mean, m2, extremes, counts of special values, what-if sums) and then the fields of
the run's user statistics (``run_table.Layout``). Records merge exactly:
``merge(record(a), record(b))`` and ``merge_rows(stack of records)`` equal
``record(cat(a, b, ...))`` up to rounding, which is what pooling across micro-batches and
ranks relies on. ``merge_rows`` merges by a max, a sum and a second sum, so that the same
arithmetic runs as reductions across ranks. Fields that were not computed hold NaN and stay
NaN through merges. Every merge follows from the fields' declared merges (``Field.merge``):
nothing here names a statistic.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Collection, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats import run_table, table
from lightning_scale.record.stats.channels import CHANNEL_STATISTICS
from lightning_scale.record.stats.layout import DEVICE_SCRATCH_FLOOR, SCRATCH_FLOOR, piece_size, pieces
from lightning_scale.record.stats.outliers import merge_higher, moved_moments
from lightning_scale.record.stats.run_table import Layout
from lightning_scale.record.stats.table import TABLE, Field

FloatFormat, FORMATS = table.FloatFormat, table.FORMATS  # (where the record code has read them)

#: The FP8 dtypes of the ``fp8`` what-if group: E4M3 for forward values, E5M2 for gradients.
FP8_DTYPES: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
assert tuple(FP8_DTYPES) == table.FP8_NAMES
#: The format counts, FORMATS order, three per format.
FORMAT_FIELDS: Tuple[str, ...] = table.FORMAT_COUNTS
#: The fp8 what-if sums, FP8_DTYPES order, three per format.
FP8_FIELDS: Tuple[str, ...] = tuple(f.name for f in TABLE if f.group == "fp8")
#: How a field may merge (``Field.merge``).
MERGES = table.MERGES
#: The built-in fields' names, in record order.
FIELDS: Tuple[str, ...] = tuple(f.name for f in TABLE)
#: Field name -> its column in a record.
IX: Dict[str, int] = {name: i for i, name in enumerate(FIELDS)}
#: The layout of the built-in groups alone (no user statistic).
BASE: Layout = run_table.layout(())


class Col:
    """Columns of the fields the code reads by name (``IX``, from ``TABLE``)."""

    COUNT = IX["count"]
    MEAN = IX["mean"]
    M2 = IX["m2"]
    ABSMAX = IX["absmax"]
    NAN = IX["nan"]
    INF = IX["inf"]
    ZEROS = IX["zeros"]
    MIN_NONZERO = IX["min_nonzero"]
    M3, M4 = IX["m3"], IX["m4"]


#: Which record fields each built-in computation group fills (``channels`` none: rows beside the records).
GROUPS: Dict[str, Tuple[str, ...]] = {g: tuple(f.name for f in TABLE if f.group == g) for g in table.GROUPS}


def span(names: Sequence[str]) -> slice:
    """The columns of ``names``, which lie side by side in record order, as a slice."""
    start = IX[names[0]]
    if tuple(FIELDS[start : start + len(names)]) != tuple(names):
        raise ValueError(f"`names` must be neighbouring fields in record order; got {names}")
    return slice(start, start + len(names))


#: Columns of the formats group (zeros, min_nonzero, the format counts), of the format
#: counts alone, of the fp8 group and of the block what-ifs.
FORMATS_SPAN, FORMAT_COUNTS_SPAN, FP8_SPAN = span(GROUPS["formats"]), span(FORMAT_FIELDS), span(FP8_FIELDS)
BLOCKS_SPAN = span(GROUPS["blocks"])
#: The central moments m2, m3, m4, by power: merged about the merged mean (``deviations``).
CENTRAL: Tuple[str, ...] = tuple(f.name for f in TABLE if f.merge == "moment" and f.name != "mean")
CENTRAL_COLS = tuple(IX[name] for name in CENTRAL)

#: Statistic name -> the group that computes it. ``statistic`` derives each from a record.
STATISTICS: Dict[str, str] = {name: s.group for name, s in table.BUILTIN.items()}
#: Every built-in statistic a run may log -> its group: ``STATISTICS`` and those of the channel rows.
ALL_STATISTICS: Dict[str, str] = {**STATISTICS, **CHANNEL_STATISTICS}
assert set(CHANNEL_STATISTICS) == set(table.CHANNEL)

Entry = Union[float, Tensor]
#: A function summing a tensor into a float64 0-dim tensor.
SumFn = Callable[[Tensor], Tensor]
#: The dtypes statistics are accumulated in as they are (others are widened to float32).
WIDE_DTYPES = (torch.float32, torch.float64)


def nan_row(width: int = len(FIELDS)) -> List[Entry]:
    """A fresh entry list of ``width`` fields, every one NaN (not computed)."""
    return [math.nan] * width


def acc_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``x``'s statistics accumulate in: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def sum64(t: Tensor) -> Tensor:
    """Float64 sum of ``t`` whatever the backend (CUDA reduces float32 in float32)."""
    return t.sum(dtype=torch.float64)


def host_sum(t: Tensor) -> Tensor:
    """``t``'s sum as float64: on the CPU torch's cascade sum in ``t``'s dtype (~1e-7
    relative error at any size, 5x faster than float64), elsewhere ``sum64``."""
    return t.sum().double() if t.device.type == "cpu" else sum64(t)


def index_tensor(values: Sequence[int], device: torch.device) -> Tensor:
    """An int64 index tensor on ``device``, copied without a blocking host sync."""
    return torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------
# Assembly, merging and derived statistics on float64 record tensors.


def assemble(
    rows: Sequence[Union[Sequence[Entry], Tensor]],
    device: Optional[torch.device] = None,
    host_only: bool = False,
    width: int = len(FIELDS),
) -> Tensor:
    """Stack per-tensor entry lists into one float64 ``[N, width]`` tensor.

    A row may also be a float64 tensor of ``width`` elements (a record a kernel or the
    reference computation wrote whole): those are stacked at once.

    Host-known floats are placed first; device entries are stacked (a handful of kernel
    launches in total, whatever N) and scattered in. Nothing is read back to the host.
    ``host_only`` says every entry is a float (records taken with host reads): one copy.
    """
    if host_only:  # (numpy builds it from Python floats ~3x faster than torch.tensor)
        out = torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), width))
        return out if device is None else out.to(device)
    whole = [r for r, row in enumerate(rows) if isinstance(row, Tensor)]
    if whole:  # whole rows: one stack
        stacked = torch.stack([rows[r] for r in whole])  # type: ignore[misc]
        dev = stacked.device if device is None else torch.device(device)
        stacked = stacked if stacked.device == dev else stacked.to(dev)  # (the same device: no move at all)
        if len(whole) == len(rows):
            return stacked
        keep = [r for r, row in enumerate(rows) if not isinstance(row, Tensor)]
        rest = assemble([rows[r] for r in keep], dev, width=width)  # type: ignore[misc]
        full = torch.empty(len(rows), width, dtype=torch.float64, device=dev)
        full[index_tensor(whole, dev)] = stacked
        full[index_tensor(keep, dev)] = rest
        return full
    template = torch.tensor(
        [[v if isinstance(v, float) else 0.0 for v in row] for row in rows], dtype=torch.float64
    ).reshape(len(rows), width)
    by_dtype: Dict[torch.dtype, Tuple[List[int], List[Tensor]]] = {}
    for r, row in enumerate(rows):
        for c, v in enumerate(row):
            if isinstance(v, Tensor):
                positions, values = by_dtype.setdefault(v.dtype, ([], []))
                positions.append(r * width + c)
                values.append(v.reshape(()))
    if not by_dtype:
        return template if device is None else template.to(device)
    dev = next(iter(by_dtype.values()))[1][0].device if device is None else device
    out = template.to(dev, non_blocking=True)
    for positions, values in by_dtype.values():  # one stack and one cast per dtype
        out.view(-1)[index_tensor(positions, dev)] = torch.stack(values).to(torch.float64)
    return out


class Merging:
    """How records of a layout merge, from its fields' declared merges: the columns each
    kind of merge takes, and the columns of the reductions that merge across ranks.

    ``extremes``: the columns of ``merge_extremes``, merged by a max: each ``max``/``min``
    field's value (a ``min`` sent negated, ``neg_<name>``: one max for all), each one's NaN
    flag (``<name>_nan``), the largest finite mean and minus the least. ``sums``: the columns
    of ``merge_sums``, merged by a sum: the ``sum`` fields, then count x (mean - c).
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.width = layout.width
        self.extreme_fields: Tuple[Field, ...] = tuple(f for f in layout.fields if f.merge in ("max", "min"))
        self.extreme_cols = tuple(layout.ix[f.name] for f in self.extreme_fields)
        self.extreme_max = tuple(f.merge == "max" for f in self.extreme_fields)
        self.extremes: Tuple[str, ...] = (
            *(f.name if f.merge == "max" else f"neg_{f.name}" for f in self.extreme_fields),
            *(f"{f.name}_nan" for f in self.extreme_fields),
            "mean_hi",
            "neg_mean_lo",
        )
        self.extreme_ix: Dict[str, int] = {name: i for i, name in enumerate(self.extremes)}
        #: the NaN flag columns of ``merge_extremes`` (1 where a field was not computed)
        self.nan_flags: Tuple[int, ...] = tuple(self.extreme_ix[f"{f.name}_nan"] for f in self.extreme_fields)
        self.sums: Tuple[str, ...] = (*(f.name for f in layout.fields if f.merge == "sum"), "shifted_total")
        self.sum_ix: Dict[str, int] = {name: i for i, name in enumerate(self.sums)}
        self.additive: List[int] = [layout.ix[name] for name in self.sums[:-1]]
        self.sum_only = [f.merge == "sum" for f in layout.fields]

    def extreme_columns(self, names: Collection[str]) -> Tuple[int, ...]:
        """The columns of ``merge_extremes`` that carry information where only the fields
        ``names`` were computed (the means' always), in order."""
        cols = [self.extreme_ix["mean_hi"], self.extreme_ix["neg_mean_lo"]]
        for f in self.extreme_fields:
            if f.name in names:
                cols += [
                    self.extreme_ix[f.name if f.merge == "max" else f"neg_{f.name}"],
                    self.extreme_ix[f"{f.name}_nan"],
                ]
        return tuple(sorted(cols))

    def sum_columns(self, names: Collection[str]) -> Tuple[int, ...]:
        """The columns of ``merge_sums`` that carry information where only the fields
        ``names`` were computed (count x shifted mean always), in order."""
        return tuple(self.sum_ix[s] for s in self.sums[:-1] if s in names) + (self.sum_ix["shifted_total"],)


@functools.lru_cache(maxsize=None)
def merging(layout: Layout = BASE) -> Merging:
    """The ``Merging`` of ``layout`` (cached: layouts are)."""
    return Merging(layout)


def layout_of(records: Tensor, layout: Optional[Layout] = None) -> Layout:
    """``layout``, or the built-in one where ``records`` is of its width.

    Raises:
        ValueError: no layout given and ``records`` has user fields (wider than ``FIELDS``).
    """
    if layout is not None:
        return layout
    if records.shape[-1] != len(FIELDS):
        raise ValueError(f"records of {records.shape[-1]} fields need their `layout` (the built-in has {len(FIELDS)})")
    return BASE


def merge(a: Tensor, b: Tensor, layout: Optional[Layout] = None) -> Tensor:
    """Merge two record tensors ``[..., width]`` as if their tensors were concatenated."""
    m = merging(layout_of(a, layout))
    na, nb = a[..., Col.COUNT], b[..., Col.COUNT]
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = b[..., Col.MEAN] - a[..., Col.MEAN]
    out = a + b  # the ``sum`` fields add
    out[..., Col.MEAN] = torch.where(n > 0, a[..., Col.MEAN] + delta * nb / safe, torch.zeros_like(n))
    out[..., Col.M2] = a[..., Col.M2] + b[..., Col.M2] + delta * delta * na * nb / safe
    higher = merge_higher(na, nb, delta, *(x[..., c] for x in (a, b) for c in CENTRAL_COLS))
    out[..., Col.M3 : Col.M4 + 1] = torch.stack(higher, -1)
    for i, is_max in zip(m.extreme_cols, m.extreme_max):
        out[..., i] = (torch.maximum if is_max else torch.minimum)(a[..., i], b[..., i])
    # An empty record is the identity, bit for bit: the fields it never computed (NaN) must
    # not spread, and ``delta * nb / nb`` need not round back to ``delta``.
    return torch.where((na == 0).unsqueeze(-1), b, torch.where((nb == 0).unsqueeze(-1), a, out))


# Merging by reductions: what a sum and a max over records (over ranks: all_reduce) give.
# Stage 1, a max: the extremes and the least and largest finite mean, whose midpoint c
# shifts the means of stage 2, a sum: the counts and sums, and count x (mean - c), so that
# rounding in the sum is relative to the means' spread, not to their size. Stage 3, a sum:
# each record's m2 plus its count x its squared distance to the merged mean.

_BASE_MERGING = merging(BASE)
#: The built-in layout's ``Merging.extremes`` and ``Merging.sums`` (see there).
EXTREMES, SUMS = _BASE_MERGING.extremes, _BASE_MERGING.sums
EXTREME_IX, SUM_IX, EXTREME_NAN_FLAGS = _BASE_MERGING.extreme_ix, _BASE_MERGING.sum_ix, _BASE_MERGING.nan_flags


def additive_fields(layout: Layout = BASE) -> List[int]:
    """The record fields of ``merge_sums``' columns, in order (count x shifted mean last, not listed)."""
    return list(merging(layout).additive)


def merge_widths(layout: Layout = BASE) -> Tuple[int, int]:
    """(entries of ``merge_sums``, of ``merge_extremes``) per record."""
    m = merging(layout)
    return len(m.sums), len(m.extremes)


def extreme_columns(names: Collection[str], layout: Layout = BASE) -> Tuple[int, ...]:
    """``Merging.extreme_columns`` of ``layout``."""
    return merging(layout).extreme_columns(names)


def sum_columns(names: Collection[str], layout: Layout = BASE) -> Tuple[int, ...]:
    """``Merging.sum_columns`` of ``layout``."""
    return merging(layout).sum_columns(names)


def merge_extremes(records: Tensor, layout: Optional[Layout] = None) -> Tensor:
    """``[..., len(extremes)]``, merged by a max: each max field, minus each min field (-inf
    where empty or NaN), their NaN flags (0/1: no NaN enters a max, whose NaN handling depends
    on the backend), the largest finite mean and minus the least (-inf where none)."""
    m = merging(layout_of(records, layout))
    n = records[..., Col.COUNT]
    has = n > 0
    none = torch.full_like(n, -math.inf)
    values, flags = [], []
    for i, is_max in zip(m.extreme_cols, m.extreme_max):
        v = records[..., i]
        values.append(torch.where(has & ~v.isnan(), v if is_max else -v, none))
        flags.append((has & v.isnan()).double())
    mean = records[..., Col.MEAN]
    finite = has & mean.isfinite()
    return torch.stack([*values, *flags, torch.where(finite, mean, none), torch.where(finite, -mean, none)], -1)


def _center(ext: Tensor, m: Merging) -> Tensor:
    """The midpoint of the least and largest finite mean from maxed extremes; 0 where none."""
    hi, lo = ext[..., m.extreme_ix["mean_hi"]], -ext[..., m.extreme_ix["neg_mean_lo"]]
    return torch.where(hi.isfinite(), hi / 2 + lo / 2, 0.0)


def merge_sums(records: Tensor, ext: Tensor, layout: Optional[Layout] = None) -> Tensor:
    """``[..., len(sums)]``, merged by a sum: the ``sum`` fields, then count x (mean - c)
    with c the center of the maxed extremes ``ext`` (broadcast against ``records``). An
    empty record adds zeros, whatever it holds."""
    m = merging(layout_of(records, layout))
    n = records[..., Col.COUNT]
    shifted = n * (records[..., Col.MEAN] - _center(ext, m))
    add = torch.cat([records[..., m.additive], shifted.unsqueeze(-1)], -1)
    return torch.where((n > 0).unsqueeze(-1), add, 0.0)


def _shift(add: Tensor, m: Merging) -> Tensor:
    """The merged mean minus the center, from summed ``merge_sums``."""
    count = add[..., m.sum_ix["count"]]
    return torch.where(count > 0, add[..., m.sum_ix["shifted_total"]] / count.clamp(min=1), 0.0)


def deviations(records: Tensor, ext: Tensor, add: Tensor, layout: Optional[Layout] = None) -> Tensor:
    """``[..., 3]``, merged by a sum into the merged ``CENTRAL`` moments: each record's m2, m3,
    m4 moved to the merged mean (``outliers.moved_moments``), the mean from
    the maxed extremes ``ext`` and summed ``add`` (broadcast against ``records``); 0 where
    empty (NaN where a moment was not computed)."""
    m = merging(layout_of(records, layout))
    n = records[..., Col.COUNT]
    d = (records[..., Col.MEAN] - _center(ext, m)) - _shift(add, m)
    central = moved_moments(n, d, records[..., Col.M2], records[..., Col.M3], records[..., Col.M4])
    return torch.where((n > 0).unsqueeze(-1), central, 0.0)


def merged_record(add: Tensor, ext: Tensor, central: Tensor, layout: Layout = BASE) -> Tensor:
    """The merged records ``[..., width]`` from summed ``merge_sums``, maxed
    ``merge_extremes`` and summed ``deviations`` (``central``). A record empty everywhere
    is all zeros (as the recorder's record of a key it never saw)."""
    m = merging(layout)
    count = add[..., m.sum_ix["count"]]
    out = torch.zeros(*count.shape, m.width, dtype=torch.float64, device=add.device)
    out[..., m.additive] = add[..., : m.sum_ix["shifted_total"]]
    out[..., Col.MEAN] = _center(ext, m) + _shift(add, m)
    out[..., list(CENTRAL_COLS)] = central
    for f, i, is_max in zip(m.extreme_fields, m.extreme_cols, m.extreme_max):
        v = ext[..., m.extreme_ix[f.name if is_max else f"neg_{f.name}"]]
        out[..., i] = torch.where(ext[..., m.extreme_ix[f"{f.name}_nan"]] > 0, math.nan, v if is_max else -v)
    return torch.where((count > 0).unsqueeze(-1), out, 0.0)


def merge_rows(records: Tensor, dim: int = 0, layout: Optional[Layout] = None) -> Tensor:
    """Merge records along ``dim``: a max, a sum and a second sum (``merge_extremes``,
    ``merge_sums``, ``deviations``, then ``merged_record``); across ranks ``report.pool``
    runs the same as reductions. More accurate than ``k - 1`` pairwise merges: the sums
    are of values shifted by the means' midpoint, and the mean's rounding enters m2 only
    squared."""
    lay = layout_of(records, layout)
    ext = merge_extremes(records, lay).amax(dim)
    add = merge_sums(records, ext.unsqueeze(dim), lay).sum(dim)
    central = deviations(records, ext.unsqueeze(dim), add.unsqueeze(dim), lay).sum(dim)
    return merged_record(add, ext, central, lay)


def statistic(records: Tensor, name: str, layout: Optional[Layout] = None) -> Tensor:
    """Derive a named statistic (built in, ``STATISTICS``, or a user statistic of ``layout``)
    from record(s) ``[..., width]`` (``run_table.Layout.value``).

    Raises:
        ValueError: an unknown name, or a channel statistic (the channel rows give it).
    """
    if layout is None and name in table.BUILTIN:  # (built-in fields keep their columns in any layout)
        layout = BASE
    return layout_of(records, layout).value(records, name)


def summarise(record: Tensor, names: Iterable[str] = STATISTICS, layout: Optional[Layout] = None) -> Dict[str, float]:
    """A dict of named statistics from one record (host tensor)."""
    return {name: float(statistic(record, name, layout)) for name in names}


#: Octave bins of ``log2_histogram``: bin i counts values with floor(log2|x|) == LOG2_LO + i.
LOG2_LO, LOG2_HI = -160, 130


def log2_histogram(x: Tensor) -> Tensor:
    """Counts of floor(log2|x|) per octave in ``[LOG2_LO, LOG2_HI)``, on x's device, no sync.

    Zeros and non-finite values are not counted (they have their own statistics). A
    tensor whose temporaries would exceed ``layout.scratch_bytes`` is counted in pieces
    (with the device path's floor off the CPU: fewer launches).
    """
    floor = SCRATCH_FLOOR if x.device.type == "cpu" else DEVICE_SCRATCH_FLOOR
    size = piece_size(x, _HISTOGRAM_SCRATCH, floor)
    if x.numel() <= size:
        return _log2_counts(x)
    return torch.stack([_log2_counts(piece) for piece in pieces(x, size)]).sum(0)


#: Bytes of temporaries per element ``_log2_counts`` takes at most (|x|, a mask, the
#: exponents in float and int64, float64 ones to add).
_HISTOGRAM_SCRATCH = 48


def _log2_counts(x: Tensor) -> Tensor:
    a = x.detach().abs()
    a = a if a.dtype == torch.float64 else a.float()
    valid = (a > 0) & torch.isfinite(a)
    safe = torch.where(valid, a, torch.ones_like(a))
    e = torch.floor(torch.log2(safe)).clamp(LOG2_LO, LOG2_HI - 1) - LOG2_LO
    e = torch.where(valid, e, torch.full_like(e, LOG2_HI - LOG2_LO)).long().flatten()
    counts = torch.zeros(LOG2_HI - LOG2_LO + 1, dtype=torch.float64, device=a.device)
    counts.scatter_add_(0, e, torch.ones_like(e, dtype=torch.float64))
    return counts[:-1]
