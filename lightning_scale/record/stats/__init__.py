"""Per-tensor statistics: computed on the tensor's device, merged exactly.

``record_of`` gives a tensor's record (see ``fields`` for what a record holds and how
records merge); ``host`` is the path for tensors in host memory, ``device`` the one that
reads nothing back, ``formats`` and ``fp8`` the optional groups.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Collection, List, Optional

import torch
from torch import Tensor

from lightning_scale.record import kernels
from lightning_scale.record.stats.device import _device_moments
from lightning_scale.record.stats.fields import (
    _ABSMAX,
    _COUNT,
    _FP80,
    _M2,
    _MEAN,
    _NAN,
    _NAN_ROW,
    _ZEROS,
    FIELDS,
    FORMATS,
    FP8_DTYPES,
    GROUPS,
    LOG2_HI,
    LOG2_LO,
    STATISTICS,
    Entry,
    FloatFormat,
    _host_sum,
    _sum64,
    assemble,
    index_tensor,
    log2_histogram,
    additive_fields,
    deviations,
    merge,
    merge_extremes,
    merge_rows,
    merge_sums,
    merge_widths,
    merged_record,
    statistic,
    summarise,
)
from lightning_scale.record.stats.formats import _format_counts_device, _format_counts_host
from lightning_scale.record.stats.fp8 import CHUNK, _fp8_fields
from lightning_scale.record.stats.host import (
    _DOT_MAX,
    _host_absmax,
    _host_moments,
    _native_every_group,
    fast_host_record,
)

__all__ = [
    "FIELDS",
    "FORMATS",
    "FP8_DTYPES",
    "GROUPS",
    "LOG2_HI",
    "LOG2_LO",
    "STATISTICS",
    "Entry",
    "FloatFormat",
    "additive_fields",
    "assemble",
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
    out: List[Entry] = _NAN_ROW.copy()
    n = x.numel()
    out[_COUNT] = float(n)
    if n == 0:
        out[_MEAN], out[_M2] = 0.0, 0.0
        return out
    if not host_reads and kernels.uses_triton(x, kernel):
        row = torch.empty(len(FIELDS), dtype=torch.float64, device=x.device)
        kernels.record_into(x, groups, row)
        return list(row.unbind(0))
    if host_reads:
        if "formats" in groups and n > _DOT_MAX and _native_every_group(x, out):
            if "range" not in groups:
                out[_ABSMAX] = math.nan
            if "fp8" in groups:
                out[_FP80:] = [float(v) for v in _fp8_fields(x, _host_sum)]
            return out
        top = _host_moments(x, out, with_max="range" in groups and "formats" not in groups)
        if "formats" in groups:
            out[_ZEROS:_FP80], absmax = _format_counts_host(x, out[_NAN])  # type: ignore[arg-type]
        if "range" in groups:  # (without NaN, the formats' max |x| is the absmax)
            if top is not None:
                out[_ABSMAX] = top
            else:
                out[_ABSMAX] = absmax if "formats" in groups and not out[_NAN] else _host_absmax(x)
    else:
        absmax = _device_moments(x, out)
        if "range" in groups:
            out[_ABSMAX] = absmax
        if "formats" in groups:
            out[_ZEROS:_FP80] = _format_counts_device(x, out[_NAN])  # type: ignore[arg-type]
    if "fp8" in groups:
        fp8 = _fp8_fields(x, _host_sum) if host_reads else _fp8_fields(x, _sum64, CHUNK)
        out[_FP80:] = [float(v) for v in fp8] if host_reads else fp8
    return out
