"""Records: what the fields of a statistics record mean, and how records combine.

A *record* is a float64 vector of ``len(FIELDS)`` numbers that summarises one tensor:
its element count, mean and sum of squared deviations (``m2``), extremes, and counts of
special values. Records merge exactly: ``merge(record(a), record(b))`` and
``merge_rows(stack of records)`` equal ``record(cat(a, b, ...))`` up to rounding, which is
what pooling across micro-batches and ranks relies on. ``merge_rows`` merges by a max, a
sum and a second sum, so that the same arithmetic runs as reductions across ranks. Fields
that were not computed hold NaN and stay NaN through merges.

``TABLE`` names every field once, with the group that computes it and how it merges;
``FIELDS``, ``GROUPS``, ``IX``/``Col``, the merges' columns (``EXTREMES``, ``SUMS``), the
pool and the kernels' finishing steps read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Collection, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats.blocks import BLOCK_FIELDS, BLOCK_FORMATS
from lightning_scale.record.stats.channels import CHANNEL_STATISTICS
from lightning_scale.record.stats.layout import DEVICE_SCRATCH_FLOOR, SCRATCH_FLOOR, piece_size, pieces
from lightning_scale.record.stats.outliers import merge_higher, moved_moments


@dataclass(frozen=True)
class FloatFormat:
    """Range of a floating-point format: smallest subnormal, smallest normal, largest."""

    min_subnormal: float
    min_normal: float
    max: float


FORMATS: Dict[str, FloatFormat] = {
    "fp16": FloatFormat(2.0**-24, 2.0**-14, 65504.0),
    "bf16": FloatFormat(2.0**-133, 2.0**-126, (2 - 2.0**-7) * 2.0**127),
    "e4m3": FloatFormat(2.0**-9, 2.0**-6, 448.0),
    "e5m2": FloatFormat(2.0**-16, 2.0**-14, 57344.0),
}

#: The FP8 dtypes of the ``fp8`` what-if group: E4M3 for forward values, E5M2 for gradients.
FP8_DTYPES: Dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

#: The format counts, FORMATS order, three per format.
FORMAT_FIELDS: Tuple[str, ...] = tuple(
    f"{kind}_{fmt}" for fmt in FORMATS for kind in ("underflow", "below_normal", "overflow")
)
#: The fp8 what-if sums, FP8_DTYPES order, three per format.
FP8_FIELDS: Tuple[str, ...] = tuple(f"fp8_{fmt}_{kind}" for fmt in FP8_DTYPES for kind in ("sq_err", "sq", "flushed"))


class Field(NamedTuple):
    """One record field: its name, the group that computes it, and how records merge it:
    ``sum`` (adds over tensors), ``max``, ``min`` (extremes: an empty record carries
    none), ``moment`` (mean, m2, m3, m4: Chan's and Pébay's merge, see ``merge_rows``)."""

    name: str
    group: str
    merge: str


#: Every record field once, in record order: a new field is one line here (plus its computation).
TABLE: Tuple[Field, ...] = (
    Field("count", "moments", "sum"),
    Field("mean", "moments", "moment"),
    Field("m2", "moments", "moment"),
    Field("absmax", "range", "max"),
    Field("nan", "moments", "sum"),
    Field("inf", "moments", "sum"),
    Field("zeros", "formats", "sum"),
    Field("min_nonzero", "formats", "min"),
    *(Field(name, "formats", "sum") for name in FORMAT_FIELDS),
    *(Field(name, "fp8", "sum") for name in FP8_FIELDS),
    *(Field(name, "blocks", "sum") for name in BLOCK_FIELDS),
    Field("m3", "kurtosis", "moment"),
    Field("m4", "kurtosis", "moment"),
)
#: How a field may merge (``Field.merge``).
MERGES = ("sum", "max", "min", "moment")
assert all(f.merge in MERGES for f in TABLE) and len({f.name for f in TABLE}) == len(TABLE)
FIELDS: Tuple[str, ...] = tuple(f.name for f in TABLE)
#: Field name -> its column in a record.
IX: Dict[str, int] = {name: i for i, name in enumerate(FIELDS)}


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


#: Which record fields each computation group fills (``channels`` none: rows beside the records).
GROUPS: Dict[str, Tuple[str, ...]] = {f.group: tuple(g.name for g in TABLE if g.group == f.group) for f in TABLE}
GROUPS["channels"] = ()


def span(names: Sequence[str]) -> slice:
    """The columns of ``names``, which lie side by side in record order, as a slice."""
    start = IX[names[0]]
    if tuple(FIELDS[start : start + len(names)]) != tuple(names):
        raise ValueError(f"`names` must be neighbouring fields in record order; got {names}")
    return slice(start, start + len(names))


#: Columns of the formats group (zeros, min_nonzero, the format counts), of the format
#: counts alone, and of the fp8 group.
FORMATS_SPAN, FORMAT_COUNTS_SPAN, FP8_SPAN = span(GROUPS["formats"]), span(FORMAT_FIELDS), span(FP8_FIELDS)
BLOCKS_SPAN = span(BLOCK_FIELDS)  # (the block what-ifs)
#: The central moments m2, m3, m4, by power: merged about the merged mean (``deviations``).
CENTRAL: Tuple[str, ...] = tuple(f.name for f in TABLE if f.merge == "moment" and f.name != "mean")
CENTRAL_COLS = tuple(IX[name] for name in CENTRAL)

#: Statistic name -> the group that computes it. ``summarise`` derives each from a record.
STATISTICS: Dict[str, str] = {
    "std": "moments",
    "mean": "moments",
    "rms": "moments",
    "count": "moments",
    "nan": "moments",
    "inf": "moments",
    "absmax": "range",
    "zeros": "formats",
    "min_nonzero": "formats",
    **{name: "formats" for name in FORMAT_FIELDS},
    **{f"fp8_{fmt}_{kind}": "fp8" for fmt in FP8_DTYPES for kind in ("snr_db", "flushed")},
    **{f"{fmt}_{kind}": "blocks" for fmt in BLOCK_FORMATS for kind in ("snr_db", "flushed")},
    "kurtosis": "kurtosis",
}
#: Every statistic a run may log -> its group: ``STATISTICS`` and those of the channel rows.
ALL_STATISTICS: Dict[str, str] = {**STATISTICS, **CHANNEL_STATISTICS}

Entry = Union[float, Tensor]
#: A function summing a tensor into a float64 0-dim tensor.
SumFn = Callable[[Tensor], Tensor]
#: The dtypes statistics are accumulated in as they are (others are widened to float32).
WIDE_DTYPES = (torch.float32, torch.float64)
_NAN_ROW: List[Entry] = [math.nan] * len(FIELDS)


def nan_row() -> List[Entry]:
    """A fresh entry list with every field NaN (not computed)."""
    return _NAN_ROW.copy()


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
    rows: Sequence[Union[Sequence[Entry], Tensor]], device: Optional[torch.device] = None, host_only: bool = False
) -> Tensor:
    """Stack per-tensor entry lists into one float64 ``[N, len(FIELDS)]`` tensor.

    A row may also be a float64 tensor of ``len(FIELDS)`` elements (a record the fused
    kernel wrote into the step's buffer): those are stacked at once.

    Host-known floats are placed first; device entries are stacked (a handful of kernel
    launches in total, whatever N) and scattered in. Nothing is read back to the host.
    ``host_only`` says every entry is a float (records taken with host reads): one copy.
    """
    if host_only:  # (numpy builds it from Python floats ~3x faster than torch.tensor)
        out = torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), len(FIELDS)))
        return out if device is None else out.to(device)
    whole = [r for r, row in enumerate(rows) if isinstance(row, Tensor)]
    if whole:  # rows the fused kernel wrote: one stack
        stacked = torch.stack([rows[r] for r in whole])  # type: ignore[misc]
        dev = stacked.device if device is None else torch.device(device)
        stacked = stacked if stacked.device == dev else stacked.to(dev)  # (the same device: no move at all)
        if len(whole) == len(rows):
            return stacked
        keep = [r for r, row in enumerate(rows) if not isinstance(row, Tensor)]
        rest = assemble([rows[r] for r in keep], dev)  # type: ignore[misc]
        full = torch.empty(len(rows), len(FIELDS), dtype=torch.float64, device=dev)
        full[index_tensor(whole, dev)] = stacked
        full[index_tensor(keep, dev)] = rest
        return full
    template = torch.tensor(
        [[v if isinstance(v, float) else 0.0 for v in row] for row in rows], dtype=torch.float64
    ).reshape(len(rows), len(FIELDS))
    by_dtype: Dict[torch.dtype, Tuple[List[int], List[Tensor]]] = {}
    for r, row in enumerate(rows):
        for c, v in enumerate(row):
            if isinstance(v, Tensor):
                positions, values = by_dtype.setdefault(v.dtype, ([], []))
                positions.append(r * len(FIELDS) + c)
                values.append(v.reshape(()))
    if not by_dtype:
        return template if device is None else template.to(device)
    dev = next(iter(by_dtype.values()))[1][0].device if device is None else device
    out = template.to(dev, non_blocking=True)
    for positions, values in by_dtype.values():  # one stack and one cast per dtype
        out.view(-1)[index_tensor(positions, dev)] = torch.stack(values).to(torch.float64)
    return out


def merge(a: Tensor, b: Tensor) -> Tensor:
    """Merge two record tensors ``[..., len(FIELDS)]`` as if their tensors were concatenated."""
    na, nb = a[..., Col.COUNT], b[..., Col.COUNT]
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = b[..., Col.MEAN] - a[..., Col.MEAN]
    out = a + b  # the ``sum`` fields add
    out[..., Col.MEAN] = torch.where(n > 0, a[..., Col.MEAN] + delta * nb / safe, torch.zeros_like(n))
    out[..., Col.M2] = a[..., Col.M2] + b[..., Col.M2] + delta * delta * na * nb / safe
    higher = merge_higher(na, nb, delta, *(x[..., c] for x in (a, b) for c in CENTRAL_COLS))
    out[..., Col.M3 : Col.M4 + 1] = torch.stack(higher, -1)
    for f in _EXTREME_FIELDS:
        i = IX[f.name]
        out[..., i] = (torch.maximum if f.merge == "max" else torch.minimum)(a[..., i], b[..., i])
    # An empty record is the identity, bit for bit: the fields it never computed (NaN) must
    # not spread, and ``delta * nb / nb`` need not round back to ``delta``.
    return torch.where((na == 0).unsqueeze(-1), b, torch.where((nb == 0).unsqueeze(-1), a, out))


# Merging by reductions: what a sum and a max over records (over ranks: all_reduce) give.
# Stage 1, a max: the extremes and the least and largest finite mean, whose midpoint c
# shifts the means of stage 2, a sum: the counts and sums, and count x (mean - c), so that
# rounding in the sum is relative to the means' spread, not to their size. Stage 3, a sum:
# each record's m2 plus its count x its squared distance to the merged mean.

_EXTREME_FIELDS = tuple(f for f in TABLE if f.merge in ("max", "min"))


def _extreme_value(f: Field) -> str:
    return f.name if f.merge == "max" else f"neg_{f.name}"  # (a min is sent negated: one max for all)


#: Columns of ``merge_extremes``, merged by a max: each ``max``/``min`` field's value (a
#: ``min`` negated), each one's NaN flag, the largest finite mean and minus the least.
EXTREMES: Tuple[str, ...] = (
    *(_extreme_value(f) for f in _EXTREME_FIELDS),
    *(f"{f.name}_nan" for f in _EXTREME_FIELDS),
    "mean_hi",
    "neg_mean_lo",
)
EXTREME_IX: Dict[str, int] = {name: i for i, name in enumerate(EXTREMES)}
#: The NaN flag columns of ``merge_extremes`` (1 where a field was not computed).
EXTREME_NAN_FLAGS: Tuple[int, ...] = tuple(EXTREME_IX[f"{f.name}_nan"] for f in _EXTREME_FIELDS)
#: Columns of ``merge_sums``, merged by a sum: the ``sum`` fields, then count x (mean - c).
SUMS: Tuple[str, ...] = (*(f.name for f in TABLE if f.merge == "sum"), "shifted_total")
SUM_IX: Dict[str, int] = {name: i for i, name in enumerate(SUMS)}
_ADDITIVE = [IX[name] for name in SUMS[:-1]]


def additive_fields() -> List[int]:
    """The record fields of ``merge_sums``' columns, in order (count x shifted mean last, not listed)."""
    return list(_ADDITIVE)


def merge_widths() -> Tuple[int, int]:
    """(entries of ``merge_sums``, of ``merge_extremes``) per record."""
    return len(SUMS), len(EXTREMES)


def extreme_columns(names: Collection[str]) -> Tuple[int, ...]:
    """The columns of ``merge_extremes`` that carry information where only the fields
    ``names`` were computed (the means' always), in order."""
    cols = [EXTREME_IX["mean_hi"], EXTREME_IX["neg_mean_lo"]]
    for f in _EXTREME_FIELDS:
        if f.name in names:
            cols += [EXTREME_IX[_extreme_value(f)], EXTREME_IX[f"{f.name}_nan"]]
    return tuple(sorted(cols))


def sum_columns(names: Collection[str]) -> Tuple[int, ...]:
    """The columns of ``merge_sums`` that carry information where only the fields
    ``names`` were computed (count x shifted mean always), in order."""
    return tuple(SUM_IX[s] for s in SUMS[:-1] if s in names) + (SUM_IX["shifted_total"],)


def merge_extremes(records: Tensor) -> Tensor:
    """``[..., len(EXTREMES)]``, merged by a max: absmax, minus min_nonzero (-inf where
    empty or NaN), their NaN flags (0/1: no NaN enters a max, whose NaN handling depends
    on the backend), the largest finite mean and minus the least (-inf where none)."""
    n = records[..., Col.COUNT]
    has = n > 0
    none = torch.full_like(n, -math.inf)
    values, flags = [], []
    for f in _EXTREME_FIELDS:
        v = records[..., IX[f.name]]
        values.append(torch.where(has & ~v.isnan(), v if f.merge == "max" else -v, none))
        flags.append((has & v.isnan()).double())
    mean = records[..., Col.MEAN]
    finite = has & mean.isfinite()
    return torch.stack([*values, *flags, torch.where(finite, mean, none), torch.where(finite, -mean, none)], -1)


def _center(ext: Tensor) -> Tensor:
    """The midpoint of the least and largest finite mean from maxed extremes; 0 where none."""
    hi, lo = ext[..., EXTREME_IX["mean_hi"]], -ext[..., EXTREME_IX["neg_mean_lo"]]
    return torch.where(hi.isfinite(), hi / 2 + lo / 2, 0.0)


def merge_sums(records: Tensor, ext: Tensor) -> Tensor:
    """``[..., len(SUMS)]``, merged by a sum: the ``sum`` fields, then count x (mean - c)
    with c the center of the maxed extremes ``ext`` (broadcast against ``records``). An
    empty record adds zeros, whatever it holds."""
    n = records[..., Col.COUNT]
    shifted = n * (records[..., Col.MEAN] - _center(ext))
    add = torch.cat([records[..., _ADDITIVE], shifted.unsqueeze(-1)], -1)
    return torch.where((n > 0).unsqueeze(-1), add, 0.0)


def _shift(add: Tensor) -> Tensor:
    """The merged mean minus the center, from summed ``merge_sums``."""
    count = add[..., SUM_IX["count"]]
    return torch.where(count > 0, add[..., SUM_IX["shifted_total"]] / count.clamp(min=1), 0.0)


def deviations(records: Tensor, ext: Tensor, add: Tensor) -> Tensor:
    """``[..., 3]``, merged by a sum into the merged ``CENTRAL`` moments: each record's m2, m3,
    m4 moved to the merged mean (``outliers.moved_moments``), the mean from
    the maxed extremes ``ext`` and summed ``add`` (broadcast against ``records``); 0 where
    empty (NaN where a moment was not computed)."""
    n = records[..., Col.COUNT]
    d = (records[..., Col.MEAN] - _center(ext)) - _shift(add)
    central = moved_moments(n, d, records[..., Col.M2], records[..., Col.M3], records[..., Col.M4])
    return torch.where((n > 0).unsqueeze(-1), central, 0.0)


def merged_record(add: Tensor, ext: Tensor, central: Tensor) -> Tensor:
    """The merged records ``[..., FIELDS]`` from summed ``merge_sums``, maxed
    ``merge_extremes`` and summed ``deviations`` (``central``). A record empty everywhere
    is all zeros (as the recorder's record of a key it never saw)."""
    count = add[..., SUM_IX["count"]]
    out = torch.zeros(*count.shape, len(FIELDS), dtype=torch.float64, device=add.device)
    out[..., _ADDITIVE] = add[..., : SUM_IX["shifted_total"]]
    out[..., Col.MEAN] = _center(ext) + _shift(add)
    out[..., list(CENTRAL_COLS)] = central
    for f in _EXTREME_FIELDS:
        v = ext[..., EXTREME_IX[_extreme_value(f)]]
        out[..., IX[f.name]] = torch.where(
            ext[..., EXTREME_IX[f"{f.name}_nan"]] > 0, math.nan, v if f.merge == "max" else -v
        )
    return torch.where((count > 0).unsqueeze(-1), out, 0.0)


def merge_rows(records: Tensor, dim: int = 0) -> Tensor:
    """Merge records along ``dim``: a max, a sum and a second sum (``merge_extremes``,
    ``merge_sums``, ``deviations``, then ``merged_record``); across ranks ``report.pool``
    runs the same as reductions. More accurate than ``k - 1`` pairwise merges: the sums
    are of values shifted by the means' midpoint, and the mean's rounding enters m2 only
    squared."""
    ext = merge_extremes(records).amax(dim)
    add = merge_sums(records, ext.unsqueeze(dim)).sum(dim)
    return merged_record(add, ext, deviations(records, ext.unsqueeze(dim), add.unsqueeze(dim)).sum(dim))


def statistic(records: Tensor, name: str) -> Tensor:
    """Derive a named statistic (see ``STATISTICS``) from record(s) ``[..., len(FIELDS)]``."""
    if name not in STATISTICS:
        if name in CHANNEL_STATISTICS:
            raise ValueError(f"{name!r} is not derived from a record: `channels.channel_statistics` gives it")
        raise ValueError(f"Unknown statistic {name!r}; choose from {sorted(STATISTICS)}")
    n = records[..., Col.COUNT]
    if name == "std":
        # Bessel's correction as torch.std; a single element has spread 0, not NaN.
        return (records[..., Col.M2] / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
    if name == "rms":
        return ((records[..., Col.M2] + n * records[..., Col.MEAN] ** 2) / n.clamp(min=1)).sqrt()
    if name in ("count", "mean", "absmax", "nan", "inf", "min_nonzero"):
        return records[..., IX[name]]
    if name == "kurtosis":  # population moments: n m4 / m2^2; NaN without spread
        return torch.where(records[..., Col.M2] > 0, n * records[..., Col.M4] / records[..., Col.M2] ** 2, math.nan)
    if name.endswith("_snr_db"):
        return _snr_db(records, name[: -len("_snr_db")])
    # zeros, format counts and fp8 flushed counts are reported as fractions of the count
    return records[..., IX[name]] / n.clamp(min=1)


def _snr_db(records: Tensor, prefix: str) -> Tensor:
    # 10 log10(sum x^2 / sum err^2); no error at all (an exact or all-zero tensor): +inf.
    err, sq = records[..., IX[f"{prefix}_sq_err"]], records[..., IX[f"{prefix}_sq"]]
    return torch.where(err == 0, torch.full_like(err, math.inf), 10 * torch.log10(sq / err))


def summarise(record: Tensor, names: Iterable[str] = STATISTICS) -> Dict[str, float]:
    """A dict of named statistics from one record (host tensor)."""
    return {name: float(statistic(record, name)) for name in names}


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
