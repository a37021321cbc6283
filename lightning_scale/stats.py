"""Per-tensor statistics: computed on the tensor's device, merged exactly.

A *record* is a float64 vector of ``len(FIELDS)`` numbers that summarises one tensor:
its element count, mean and sum of squared deviations (``m2``), extremes, and counts of
special values. Records merge exactly: ``merge(record(a), record(b))`` equals
``record(cat(a, b))`` up to rounding, which is what pooling across micro-batches and
ranks relies on. Fields that were not computed hold NaN and stay NaN through merges.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "FIELDS",
    "FORMATS",
    "GROUPS",
    "STATISTICS",
    "assemble",
    "FloatFormat",
    "merge",
    "merge_rows",
    "record_of",
    "statistic",
    "summarise",
]


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

_FORMAT_FIELDS = [
    f"{kind}_{fmt}" for fmt in FORMATS for kind in ("underflow", "below_normal", "overflow")
]
FIELDS: Tuple[str, ...] = (
    "count", "mean", "m2", "absmax", "nan", "inf", "zeros", "min_nonzero", *_FORMAT_FIELDS,
)  # fmt: skip
_IX = {name: i for i, name in enumerate(FIELDS)}
_COUNT, _MEAN, _M2, _ABSMAX, _NAN, _INF, _ZEROS, _MINNZ = range(8)
_FMT0 = 8

#: Which record fields each computation group fills.
GROUPS: Dict[str, Tuple[str, ...]] = {
    "moments": ("count", "mean", "m2", "nan", "inf"),
    "range": ("absmax",),
    "formats": ("zeros", "min_nonzero", *_FORMAT_FIELDS),
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
}

Entry = Union[float, Tensor]
_NAN_ROW: List[Entry] = [math.nan] * len(FIELDS)


def record_of(x: Tensor, groups: Collection[str] = ("moments",), host_reads: Optional[bool] = None) -> List[Entry]:
    """Statistics of ``x`` as a list of ``len(FIELDS)`` entries (floats or 0-dim tensors).

    Args:
        x: a floating-point tensor. Half types are reduced with float32 accumulation.
        groups: which of ``GROUPS`` to compute; the others are NaN.
        host_reads: whether the computation may read intermediate results on the host to
            skip work (cheap only where the tensor lives in host memory). Defaults to
            ``x.device.type == "cpu"``. Without host reads every entry stays on the device.
    """
    if host_reads is None:
        host_reads = x.device.type == "cpu"
    x = x.detach()
    out: List[Entry] = _NAN_ROW.copy()
    n = x.numel()
    out[_COUNT] = float(n)
    if n == 0:
        out[_MEAN], out[_M2] = 0.0, 0.0
        return out
    if host_reads:
        _host_moments(x, out)
    else:
        _device_moments(x, out)
    if "range" in groups:
        (_host_range if host_reads else _device_range)(x, out)
    if "formats" in groups:
        _formats(x, out, host_reads)
    return out


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _host_moments(x: Tensor, out: List[Entry]) -> None:
    # Two cheap passes (sum, sum of squares); recompute about the mean when the one-pass
    # formula would lose digits: it amplifies the ~1e-7 relative error of the sums by
    # sumsq / m2, so recompute once |mean| exceeds about 10 std (m2 <= sumsq / 100).
    n = x.numel()
    if x.dtype not in _WIDE:
        x = x.float()  # half types: accumulate in float32 (one copy, then the fast path)
    total = x.sum().item()
    sumsq = _sum_of_squares(x)
    mean = total / n
    m2 = sumsq - total * mean
    finite = math.isfinite(total) and math.isfinite(sumsq)
    if finite and m2 <= 0.01 * sumsq:
        acc = _acc_dtype(x)
        mean_t = x.mean(dtype=acc)
        m2 = _sum_of_squares(x.to(acc) - mean_t)
        mean = float(mean_t)
    out[_MEAN], out[_M2] = mean, max(m2, 0.0) if finite else math.nan
    out[_NAN], out[_INF] = (0.0, 0.0) if finite else _nonfinite_counts(x)


_WIDE = (torch.float32, torch.float64)
_ROW = 4096
_DOT_MAX = 1 << 22  # BLAS dot keeps ~1e-7 relative error up to here (measured: 2e-6 at 4M)
_NORM_MAX = 1 << 18  # one vector_norm keeps ~4e-6 up to here, then degrades (2e-4 at 4M)


def _sum_of_squares(x: Tensor) -> float:
    if x.dtype in _WIDE and x.is_contiguous() and x.numel() <= _DOT_MAX:
        flat = x.view(-1)
        return torch.dot(flat, flat).item()  # fastest, and accurate (SIMD partial sums)
    acc = _acc_dtype(x)
    if x.numel() <= _NORM_MAX:
        return float(torch.linalg.vector_norm(x, dtype=acc)) ** 2
    # Norms of 4096-element rows summed in float64 stay near 1e-6 at any size.
    flat = x.reshape(-1)
    m = flat.numel() // _ROW * _ROW
    rows = torch.linalg.vector_norm(flat[:m].view(-1, _ROW), dim=1, dtype=acc)
    tail = float(torch.linalg.vector_norm(flat[m:], dtype=acc)) ** 2 if m < flat.numel() else 0.0
    return float(rows.double().square().sum()) + tail


def _device_moments(x: Tensor, out: List[Entry]) -> None:
    # Welford-style single reduction on the device: accurate when |mean| >> std.
    var, mean = torch.var_mean(x if x.dtype == _acc_dtype(x) else x.float(), correction=0)
    out[_MEAN], out[_M2] = mean, var * x.numel()
    out[_NAN], out[_INF] = torch.isnan(x).sum(), torch.isinf(x).sum()


def _host_range(x: Tensor, out: List[Entry]) -> None:
    lo, hi = torch.aminmax(x)
    out[_ABSMAX] = max(abs(float(lo)), abs(float(hi)))


def _nonfinite_counts(x: Tensor) -> Tuple[float, float]:
    return float(torch.isnan(x).sum()), float(torch.isinf(x).sum())


def _device_range(x: Tensor, out: List[Entry]) -> None:
    lo, hi = torch.aminmax(x)
    out[_ABSMAX] = torch.maximum(lo.abs(), hi.abs())


def _formats(x: Tensor, out: List[Entry], host_reads: bool) -> None:
    a = x.abs()
    if a.dtype != torch.float64:
        a = a.float()  # compare half types against the thresholds in float32, exactly
    counts = _format_counts_host(a) if host_reads else _format_counts_device(a)
    out[_ZEROS], out[_MINNZ] = counts[0], counts[1]
    out[_FMT0 : _FMT0 + len(_FORMAT_FIELDS)] = counts[2:]


def _format_counts_device(a: Tensor) -> List[Entry]:
    zeros = a.numel() - torch.count_nonzero(a)
    inf = torch.full((), math.inf, dtype=a.dtype, device=a.device)
    res: List[Entry] = [zeros, torch.where(a > 0, a, inf).amin()]
    for fmt in FORMATS.values():
        for t in (fmt.min_subnormal, fmt.min_normal):
            res.append((a < t).sum() - zeros)
        res.append((a > fmt.max).sum())
    return res


def _format_counts_host(a: Tensor) -> List[Entry]:
    if a.dtype != torch.float32:
        return [float(v) for v in _format_counts_device(a)]
    # float32 |x|: one exponent histogram answers every power-of-two threshold at or
    # above 2**-126; the rare cases below it and the overflow tails are counted only
    # when the histogram or the maximum says they can be nonzero.
    bits = a.view(torch.int32)
    hist = torch.bincount((bits >> 23).flatten(), minlength=256).tolist()
    zeros = float(a.numel() - int(torch.count_nonzero(a)))
    res: List[Entry] = [zeros, _min_nonzero_host(a, zeros)]
    absmax = float(a.amax())
    for fmt in FORMATS.values():
        for t in (fmt.min_subnormal, fmt.min_normal):
            res.append(_count_below_host(bits, hist, t, zeros))
        res.append(0.0 if absmax <= fmt.max else float((a > fmt.max).sum()))
    return res


def _count_below_host(bits: Tensor, hist: List[int], t: float, zeros: float) -> float:
    k = int(math.log2(t))
    if k >= -126:
        return float(sum(hist[: k + 127])) - zeros
    if hist[0] == zeros:  # no float32 subnormals at all
        return 0.0
    tb = int(torch.tensor(t, dtype=torch.float32).view(torch.int32))
    return float(((bits > 0) & (bits < tb)).sum())


def _min_nonzero_host(a: Tensor, zeros: float) -> float:
    if zeros == a.numel():
        return math.inf
    if zeros == 0:
        return float(a.amin())
    return float(torch.where(a > 0, a, math.inf).amin())


# ---------------------------------------------------------------------------------------
# Assembly, merging and derived statistics on float64 record tensors.


def assemble(rows: Sequence[Sequence[Entry]], device: Optional[torch.device] = None, host_only: bool = False) -> Tensor:
    """Stack per-tensor entry lists into one float64 ``[N, len(FIELDS)]`` tensor.

    Host-known floats are placed first; device entries are stacked (a handful of kernel
    launches in total, whatever N) and scattered in. Nothing is read back to the host.
    ``host_only`` says every entry is a float (records taken with host reads): one copy.
    """
    if host_only:
        out = torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(FIELDS))
        return out if device is None else out.to(device)
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


def index_tensor(values: Sequence[int], device: torch.device) -> Tensor:
    """An int64 index tensor on ``device``, copied without a blocking host sync."""
    return torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)


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
    # zeros and format counts are reported as fractions of the element count
    return records[..., _IX[name]] / n.clamp(min=1)


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
