"""Per-tensor statistics: computed on the tensor's device, merged exactly.

``record_of`` gives a tensor's record (see ``fields`` for what a record holds and how
records merge: one table names each field, its group and its reduction); ``host`` is the
path for tensors in host memory, ``device`` the one that reads nothing back, ``formats``,
``fp8``, ``blocks`` and ``outliers`` the optional groups (the last two computed by torch
code after the host kernel and torch's device kernels, ``torch_groups``; inside the fused
Triton kernel's read otherwise), ``channels`` the channel rows kept beside the records (their
own group, pooled as their own segment), ``traceable`` and ``traceable_channels`` the record
and the channel row as graph ops (for the compiled route), ``host_op`` the host path as one
graph op (the compiled route's statistics on the CPU), ``layout`` how a tensor is read in
place (dense views, strided grids) and in bounded pieces (a large tensor's temporaries stay
within ``layout.scratch_bytes``).

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Collection, List, Optional

import torch
from torch import Tensor

from lightning_scale.record import kernels
from lightning_scale.record.stats.device import device_moments
from lightning_scale.record.stats.channels import CHANNEL_STATISTICS, channel_statistics
from lightning_scale.record.stats.fields import (
    ALL_STATISTICS,
    CENTRAL,
    EXTREME_NAN_FLAGS,
    EXTREMES,
    FIELDS,
    FORMAT_FIELDS,
    FORMATS,
    FORMATS_SPAN,
    FP8_DTYPES,
    FP8_FIELDS,
    FP8_SPAN,
    GROUPS,
    IX,
    LOG2_HI,
    LOG2_LO,
    STATISTICS,
    SUMS,
    TABLE,
    Col,
    Entry,
    Field,
    FloatFormat,
    additive_fields,
    assemble,
    deviations,
    extreme_columns,
    index_tensor,
    log2_histogram,
    merge,
    merge_extremes,
    merge_rows,
    merge_sums,
    merge_widths,
    merged_record,
    nan_row,
    statistic,
    sum64,
    sum_columns,
    summarise,
)
from lightning_scale.record.stats.formats import format_counts_device, format_counts_host
from lightning_scale.record.stats.fp8 import fp8_fields, host_fp8_fields
from lightning_scale.record.stats.layout import DEVICE_SCRATCH_FLOOR, piece_size, pieces
from lightning_scale.record.stats import torch_groups
from lightning_scale.record.stats.host import (
    DOT_MAX,
    host_absmax,
    host_moments,
    native_every_group,
    fast_host_record,
)

__all__ = [
    "ALL_STATISTICS",
    "CENTRAL",
    "CHANNEL_STATISTICS",
    "EXTREME_NAN_FLAGS",
    "EXTREMES",
    "FIELDS",
    "FORMAT_FIELDS",
    "FORMATS",
    "FP8_DTYPES",
    "FP8_FIELDS",
    "GROUPS",
    "IX",
    "LOG2_HI",
    "LOG2_LO",
    "STATISTICS",
    "SUMS",
    "TABLE",
    "Col",
    "Entry",
    "Field",
    "FloatFormat",
    "additive_fields",
    "assemble",
    "channel_statistics",
    "extreme_columns",
    "fast_host_record",
    "index_tensor",
    "log2_histogram",
    "deviations",
    "merge",
    "merge_extremes",
    "merge_rows",
    "merge_sums",
    "merge_widths",
    "merged_record",
    "record_of",
    "statistic",
    "sum_columns",
    "summarise",
]


def record_of(
    x: Tensor, groups: Collection[str] = ("moments",), host_reads: Optional[bool] = None, kernel: Optional[str] = None
) -> List[Entry]:
    """Statistics of ``x`` as a list of ``len(FIELDS)`` entries (floats or 0-dim tensors).

    Args:
        x: a floating-point tensor. Half types are reduced in float32, float64 in float64.
        groups: which of ``GROUPS`` to compute; the others are NaN. "moments" is always
            computed.
        host_reads: whether the computation may read intermediate results on the host to
            skip work (cheap only where the tensor lives in host memory). Defaults to
            ``x.device.type == "cpu"``. With host reads every entry is a float; without,
            every entry stays a 0-dim tensor on the device and nothing is read back.
        kernel: without host reads, which kernel (``kernels.CHOICES``; default: the
            ``LIGHTNING_SCALE_KERNEL`` environment variable, ``auto``): the fused Triton
            kernel writes the whole record in one read (two with fp8).

    Example:
        >>> rec = assemble([record_of(torch.tensor([1.0, 2.0, 3.0]))])
        >>> float(statistic(rec, "std")[0])
        1.0
    """
    if host_reads is None:
        host_reads = x.device.type == "cpu"
    x = x.detach()
    out: List[Entry] = nan_row()
    n = x.numel()
    out[Col.COUNT] = float(n)
    if n == 0:
        out[Col.MEAN], out[Col.M2] = 0.0, 0.0
        return out
    if not host_reads and kernels.uses_triton(x, kernel):
        row = torch.empty(len(FIELDS), dtype=torch.float64, device=x.device)
        left = kernels.record_into(x, groups, row)
        torch_groups.fill(x, left, row)  # (groups the kernel left: blocks of a strided last dim)
        return list(row.unbind(0))
    if host_reads:
        _host_fields(x, groups, out)
    else:
        _device_fields_bounded(x, groups, out)
    if "fp8" in groups and host_reads:
        out[FP8_SPAN] = host_fp8_fields(x, _finite_amax(out))
    elif "fp8" in groups:
        out[FP8_SPAN] = fp8_fields(x, sum64, DEVICE_SCRATCH_FLOOR)
    torch_groups.fill(x, groups, out, host_reads)
    return out


def _finite_amax(out: List[Entry]) -> Optional[float]:
    """The largest finite |x|, where the host path's record already holds it (the range group
    computed, no NaN or Inf), else None."""
    absmax, nan, inf = out[Col.ABSMAX], out[Col.NAN], out[Col.INF]
    if isinstance(absmax, float) and math.isfinite(absmax) and nan == 0 and inf == 0:
        return absmax
    return None


def _host_fields(x: Tensor, groups: Collection[str], out: List[Entry]) -> None:
    """The moments, range and formats groups of ``x`` with host reads, into ``out``."""
    if "formats" in groups and x.numel() > DOT_MAX and native_every_group(x, out):
        if "range" not in groups:
            out[Col.ABSMAX] = math.nan
        return
    top = host_moments(x, out, with_max="range" in groups and "formats" not in groups)
    if "formats" in groups:
        out[FORMATS_SPAN], absmax = format_counts_host(x, out[Col.NAN])  # type: ignore[arg-type]
    if "range" in groups:  # (without NaN, the formats' max |x| is the absmax)
        if top is not None:
            out[Col.ABSMAX] = top
        else:
            out[Col.ABSMAX] = absmax if "formats" in groups and not out[Col.NAN] else host_absmax(x)


#: Bytes of temporaries per element the device path's torch kernels take at most: a
#: float32 (float64) copy for the moments; |x|, bucket indices, their float32 copy for
#: ``histc`` and a mask for the format counts.
_DEVICE_SCRATCH = {"moments": 8, "formats": 24}


def _device_fields_bounded(x: Tensor, groups: Collection[str], out: List[Entry]) -> None:
    """``_device_fields``, of pieces merged exactly (``merge_rows``, on the device: no
    host read) where ``x``'s temporaries would exceed ``layout.scratch_bytes`` (with the
    device path's floor)."""
    per_element = _DEVICE_SCRATCH["formats" if "formats" in groups else "moments"]
    size = piece_size(x, per_element, DEVICE_SCRATCH_FLOOR)
    if x.numel() <= size:
        _device_fields(x, groups, out)
        return
    rows = []
    for piece in pieces(x, size):
        row = nan_row()
        row[Col.COUNT] = float(piece.numel())
        _device_fields(piece, groups, row)
        rows.append(row)
    merged = merge_rows(assemble(rows)).unbind(0)
    for name in (f for g in ("moments", "range", "formats") if g in groups or g == "moments" for f in GROUPS[g]):
        if name != "count":  # (host-known: kept a float)
            out[IX[name]] = merged[IX[name]]


def _device_fields(x: Tensor, groups: Collection[str], out: List[Entry]) -> None:
    """The moments, range and formats groups of ``x`` by torch's kernels, nothing read back."""
    absmax = device_moments(x, out)
    if "range" in groups:
        out[Col.ABSMAX] = absmax
    if "formats" in groups:
        out[FORMATS_SPAN] = format_counts_device(x, out[Col.NAN])  # type: ignore[arg-type]
