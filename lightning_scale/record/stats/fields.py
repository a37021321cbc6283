"""Records: what the fields of a statistics record mean, and how records combine.

A *record* is a float64 vector of ``len(FIELDS)`` numbers that summarises one tensor:
its element count, mean and sum of squared deviations (``m2``), extremes, and counts of
special values. Records merge exactly: ``merge(record(a), record(b))`` and
``merge_rows(stack of records)`` equal ``record(cat(a, b, ...))`` up to rounding, which is
what pooling across micro-batches and ranks relies on. ``merge_rows`` merges by a max, a
sum and a second sum, so that the same arithmetic runs as reductions across ranks. Fields that were not computed hold NaN and stay NaN
through merges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor


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

_FORMAT_FIELDS = [f"{kind}_{fmt}" for fmt in FORMATS for kind in ("underflow", "below_normal", "overflow")]
_FP8_FIELDS = [f"fp8_{fmt}_{kind}" for fmt in FP8_DTYPES for kind in ("sq_err", "sq", "flushed")]
FIELDS: Tuple[str, ...] = (
    "count",
    "mean",
    "m2",
    "absmax",
    "nan",
    "inf",
    "zeros",
    "min_nonzero",
    *_FORMAT_FIELDS,
    *_FP8_FIELDS,
)
_IX = {name: i for i, name in enumerate(FIELDS)}
_COUNT, _MEAN, _M2, _ABSMAX, _NAN, _INF, _ZEROS, _MINNZ = range(8)
_FMT0 = 8
_FP80 = _FMT0 + len(_FORMAT_FIELDS)

#: Which record fields each computation group fills.
GROUPS: Dict[str, Tuple[str, ...]] = {
    "moments": ("count", "mean", "m2", "nan", "inf"),
    "range": ("absmax",),
    "formats": ("zeros", "min_nonzero", *_FORMAT_FIELDS),
    "fp8": tuple(_FP8_FIELDS),
}

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
    **{name: "formats" for name in _FORMAT_FIELDS},
    **{f"fp8_{fmt}_{kind}": "fp8" for fmt in FP8_DTYPES for kind in ("snr_db", "flushed")},
}

Entry = Union[float, Tensor]
_NAN_ROW: List[Entry] = [math.nan] * len(FIELDS)
_Sum = Callable[[Tensor], Tensor]


_WIDE = (torch.float32, torch.float64)


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sum64(t: Tensor) -> Tensor:
    # float64 accumulation whatever the backend (CUDA reduces float32 in float32).
    return t.sum(dtype=torch.float64)


def _host_sum(t: Tensor) -> Tensor:
    # torch's CPU cascade sum keeps ~1e-7 relative error at any size; 5x faster than float64.
    return t.sum().double() if t.device.type == "cpu" else _sum64(t)


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
    na, nb = a[..., _COUNT], b[..., _COUNT]
    n = na + nb
    safe = torch.where(n > 0, n, torch.ones_like(n))
    delta = b[..., _MEAN] - a[..., _MEAN]
    out = a + b  # counts add
    # An empty record is the identity: the fields it never computed (NaN) must not spread.
    out = torch.where((na == 0).unsqueeze(-1), b, torch.where((nb == 0).unsqueeze(-1), a, out))
    out[..., _MEAN] = torch.where(n > 0, a[..., _MEAN] + delta * nb / safe, torch.zeros_like(n))
    out[..., _M2] = a[..., _M2] + b[..., _M2] + delta * delta * na * nb / safe
    # Empty records carry no information about extremes.
    out[..., _ABSMAX] = _pick(na, nb, a[..., _ABSMAX], b[..., _ABSMAX], torch.maximum)
    out[..., _MINNZ] = _pick(na, nb, a[..., _MINNZ], b[..., _MINNZ], torch.minimum)
    return out


def _pick(na: Tensor, nb: Tensor, x: Tensor, y: Tensor, op) -> Tensor:  # type: ignore[no-untyped-def]
    both = op(x, y)
    return torch.where(na == 0, y, torch.where(nb == 0, x, both))


# Merging by reductions: what a sum and a max over records (over ranks: all_reduce) give.
# Stage 1, a max: the extremes and the least and largest finite mean, whose midpoint c
# shifts the means of stage 2, a sum: the counts and sums, and count x (mean - c), so that
# rounding in the sum is relative to the means' spread, not to their size. Stage 3, a sum:
# each record's m2 plus its count x its squared distance to the merged mean.

#: Fields that add over tensors: every field but mean, m2 and the extremes.
_ADDITIVE = [i for i in range(len(FIELDS)) if i not in (_MEAN, _M2, _ABSMAX, _MINNZ)]
_EXTREMES = 6  # absmax, -min_nonzero, their NaN flags, largest finite mean, -least finite mean


def additive_fields() -> List[int]:
    """The record fields of ``merge_sums``' columns, in order (count x shifted mean last, not listed)."""
    return list(_ADDITIVE)


def merge_widths() -> Tuple[int, int]:
    """(entries of ``merge_sums``, of ``merge_extremes``) per record."""
    return len(_ADDITIVE) + 1, _EXTREMES


def merge_extremes(records: Tensor) -> Tensor:
    """``[..., 6]``, merged by a max: absmax, minus min_nonzero (-inf where empty or NaN),
    their NaN flags (0/1: no NaN enters a max, whose NaN handling depends on the backend),
    the largest finite mean and minus the least (-inf where none)."""
    n = records[..., _COUNT]
    has = n > 0
    top, least, mean = records[..., _ABSMAX], records[..., _MINNZ], records[..., _MEAN]
    none = torch.full_like(top, -math.inf)
    finite = has & mean.isfinite()
    return torch.stack(
        [
            torch.where(has & ~top.isnan(), top, none),
            torch.where(has & ~least.isnan(), -least, none),
            (has & top.isnan()).double(),
            (has & least.isnan()).double(),
            torch.where(finite, mean, none),
            torch.where(finite, -mean, none),
        ],
        -1,
    )


def _center(ext: Tensor) -> Tensor:
    """The midpoint of the least and largest finite mean from maxed extremes; 0 where none."""
    hi, lo = ext[..., 4], -ext[..., 5]
    return torch.where(hi.isfinite(), hi / 2 + lo / 2, 0.0)


def merge_sums(records: Tensor, ext: Tensor) -> Tensor:
    """``[..., A]``, merged by a sum: the fields of ``_ADDITIVE``, then count x (mean - c)
    with c the center of the maxed extremes ``ext`` (broadcast against ``records``). An
    empty record adds zeros, whatever it holds."""
    n = records[..., _COUNT]
    shifted = n * (records[..., _MEAN] - _center(ext))
    add = torch.cat([records[..., _ADDITIVE], shifted.unsqueeze(-1)], -1)
    return torch.where((n > 0).unsqueeze(-1), add, 0.0)


def _shift(add: Tensor) -> Tensor:
    """The merged mean minus the center, from summed ``merge_sums``."""
    count = add[..., 0]
    return torch.where(count > 0, add[..., -1] / count.clamp(min=1), 0.0)


def deviations(records: Tensor, ext: Tensor, add: Tensor) -> Tensor:
    """Merged by a sum into the merged m2: ``m2_i + n_i (mean_i - mean)^2``, the mean from
    the maxed extremes ``ext`` and summed ``add`` (broadcast against ``records``); 0 where
    empty."""
    n = records[..., _COUNT]
    d = records[..., _M2] + n * ((records[..., _MEAN] - _center(ext)) - _shift(add)).square()
    return torch.where(n > 0, d, 0.0)


def merged_record(add: Tensor, ext: Tensor, m2: Tensor) -> Tensor:
    """The merged records ``[..., FIELDS]`` from summed ``merge_sums``, maxed
    ``merge_extremes`` and summed ``deviations``. A record empty everywhere is all zeros
    (as the recorder's record of a key it never saw)."""
    count = add[..., 0]
    out = torch.zeros(*count.shape, len(FIELDS), dtype=torch.float64, device=add.device)
    out[..., _ADDITIVE] = add[..., :-1]
    out[..., _MEAN] = _center(ext) + _shift(add)
    out[..., _M2] = m2
    out[..., _ABSMAX] = torch.where(ext[..., 2] > 0, math.nan, ext[..., 0])
    out[..., _MINNZ] = torch.where(ext[..., 3] > 0, math.nan, -ext[..., 1])
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
        raise ValueError(f"Unknown statistic {name!r}; choose from {sorted(STATISTICS)}")
    n = records[..., _COUNT]
    if name == "std":
        # Bessel's correction as torch.std; a single element has spread 0, not NaN.
        return (records[..., _M2] / (n - 1).clamp(min=1)).clamp(min=0).sqrt()
    if name == "rms":
        return ((records[..., _M2] + n * records[..., _MEAN] ** 2) / n.clamp(min=1)).sqrt()
    if name in ("count", "mean", "absmax", "nan", "inf", "min_nonzero"):
        return records[..., _IX[name]]
    if name.endswith("_snr_db"):
        return _snr_db(records, name[: -len("_snr_db")])
    # zeros, format counts and fp8 flushed counts are reported as fractions of the count
    return records[..., _IX[name]] / n.clamp(min=1)


def _snr_db(records: Tensor, prefix: str) -> Tensor:
    # 10 log10(sum x^2 / sum err^2); no error at all (an exact or all-zero tensor): +inf.
    err, sq = records[..., _IX[f"{prefix}_sq_err"]], records[..., _IX[f"{prefix}_sq"]]
    return torch.where(err == 0, torch.full_like(err, math.inf), 10 * torch.log10(sq / err))


def summarise(record: Tensor, names: Iterable[str] = STATISTICS) -> Dict[str, float]:
    """A dict of named statistics from one record (host tensor)."""
    return {name: float(statistic(record, name)) for name in names}


#: Octave bins of ``log2_histogram``: bin i counts values with floor(log2|x|) == LOG2_LO + i.
LOG2_LO, LOG2_HI = -160, 130


def log2_histogram(x: Tensor) -> Tensor:
    """Counts of floor(log2|x|) per octave in ``[LOG2_LO, LOG2_HI)``, on x's device, no sync.

    Zeros and non-finite values are not counted (they have their own statistics).
    """
    a = x.detach().abs()
    a = a if a.dtype == torch.float64 else a.float()
    valid = (a > 0) & torch.isfinite(a)
    safe = torch.where(valid, a, torch.ones_like(a))
    e = torch.floor(torch.log2(safe)).clamp(LOG2_LO, LOG2_HI - 1) - LOG2_LO
    e = torch.where(valid, e, torch.full_like(e, LOG2_HI - LOG2_LO)).long().flatten()
    counts = torch.zeros(LOG2_HI - LOG2_LO + 1, dtype=torch.float64, device=a.device)
    counts.scatter_add_(0, e, torch.ones_like(e, dtype=torch.float64))
    return counts[:-1]
