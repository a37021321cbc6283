"""Records: what the fields of a statistics record mean, and how records combine.

A *record* is a float64 vector of ``len(FIELDS)`` numbers that summarises one tensor:
its element count, mean and sum of squared deviations (``m2``), extremes, and counts of
special values. Records merge exactly: ``merge(record(a), record(b))`` equals
``record(cat(a, b))`` up to rounding, which is what pooling across micro-batches and
ranks relies on. Fields that were not computed hold NaN and stay NaN through merges.
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
    "count", "mean", "m2", "absmax", "nan", "inf", "zeros", "min_nonzero", *_FORMAT_FIELDS, *_FP8_FIELDS,
)  # fmt: skip
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


def assemble(rows: Sequence[Union[Sequence[Entry], Tensor]], device: Optional[torch.device] = None, host_only: bool = False) -> Tensor:
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
    template = torch.tensor([[v if isinstance(v, float) else 0.0 for v in row] for row in rows], dtype=torch.float64).reshape(len(rows), len(FIELDS))
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


def merge_rows(records: Tensor, dim: int = 0) -> Tensor:
    """Merge records along ``dim`` pairwise (a tree, so rounding stays balanced)."""
    parts = list(records.unbind(dim))
    while len(parts) > 1:
        nxt = [merge(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


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
