"""Per-tensor statistics: declared once, computed on the tensor's device, merged exactly.

``table`` declares every statistic (``Statistic``: its fields and their merges, axis,
ranking, unscaling, docs line) and gives the record layout of a run (``run_table.Layout``);
``fields`` holds the built-in layout and the record arithmetic (assembly, exact merges, the
reductions that pool across ranks) derived from it. ``record_of`` gives a tensor's record:
``reference`` is the one torch computation of every field (any device, traceable), and the
kernels accelerate it where they apply, each saying which groups it covers: ``host`` (the
native kernel on CPU tensors), the Triton kernel on accelerators (``record.kernels``), and
``record.short_records`` for many short host tensors at once. ``traceable`` packs the
reference into compiled graphs, ``host_op`` is the host path as one graph op; ``formats``,
``fp8``, ``blocks``, ``outliers`` and ``channels`` hold each group's maths; ``layout`` how a
tensor is read in place and in bounded pieces.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Collection, List, Optional

import torch
from torch import Tensor

from lightning_scale.record import kernels
from lightning_scale.record.stats import reference, run_table, table
from lightning_scale.record.stats.channels import CHANNEL_STATISTICS, channel_statistics
from lightning_scale.record.stats.fields import (
    ALL_STATISTICS,
    BASE,
    CENTRAL,
    EXTREME_NAN_FLAGS,
    EXTREMES,
    FIELDS,
    FORMAT_FIELDS,
    FORMATS,
    FP8_DTYPES,
    FP8_FIELDS,
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
    Merging,
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
    merging,
    nan_row,
    statistic,
    sum64,
    sum_columns,
    summarise,
)
from lightning_scale.record.stats.host import accelerate, fast_host_record
from lightning_scale.record.stats.run_table import Layout
from lightning_scale.record.stats.table import Statistic

__all__ = [
    "ALL_STATISTICS",
    "BASE",
    "CENTRAL",
    "CHANNEL_STATISTICS",
    "Col",
    "EXTREMES",
    "EXTREME_NAN_FLAGS",
    "Entry",
    "FIELDS",
    "FORMATS",
    "FORMAT_FIELDS",
    "FP8_DTYPES",
    "FP8_FIELDS",
    "Field",
    "FloatFormat",
    "GROUPS",
    "IX",
    "LOG2_HI",
    "LOG2_LO",
    "Layout",
    "Merging",
    "STATISTICS",
    "SUMS",
    "Statistic",
    "TABLE",
    "accelerate",
    "reference",
    "additive_fields",
    "assemble",
    "channel_statistics",
    "deviations",
    "extreme_columns",
    "fast_host_record",
    "index_tensor",
    "log2_histogram",
    "merge",
    "merge_extremes",
    "merge_rows",
    "merge_sums",
    "merge_widths",
    "merged_record",
    "merging",
    "nan_row",
    "record_of",
    "statistic",
    "run_table",
    "sum64",
    "table",
    "sum_columns",
    "summarise",
]


def record_of(
    x: Tensor,
    groups: Collection[str] = ("moments",),
    host_reads: Optional[bool] = None,
    kernel: Optional[str] = None,
    layout: Optional[Layout] = None,
) -> List[Entry]:
    """Statistics of ``x`` as a list of ``layout.width`` entries (floats or 0-dim tensors).

    Args:
        x: a floating-point tensor. Half types are reduced in float32, float64 in float64.
        groups: which groups to compute (built-in ``GROUPS``, user statistics' keys); the
            others' fields are NaN. "moments" is always computed.
        host_reads: whether the computation may read results on the host (cheap only where
            the tensor lives in host memory): the native kernel covers what it can (``host``)
            and every entry is a float. Defaults to ``x.device.type == "cpu"``. Without, every
            entry stays a 0-dim tensor on the device and nothing is read back.
        kernel: without host reads, which kernel (``kernels.CHOICES``; default: the
            ``LIGHTNING_SCALE_KERNEL`` environment variable, ``auto``): the fused Triton
            kernel writes its groups in one read (two with fp8).
        layout: the record layout (default: ``run_table.layout(groups)``).

    Example:
        >>> rec = assemble([record_of(torch.tensor([1.0, 2.0, 3.0]))])
        >>> float(statistic(rec, "std")[0])
        1.0
    """
    if host_reads is None:
        host_reads = x.device.type == "cpu"
    lay = run_table.layout(groups) if layout is None else layout
    x = x.detach()
    out: List[Entry] = nan_row(lay.width)
    n = x.numel()
    out[Col.COUNT] = float(n)
    if n == 0:
        out[Col.MEAN], out[Col.M2] = 0.0, 0.0
        return out
    wanted = {"moments", *groups} - {"channels"}
    if not host_reads and kernels.uses_triton(x, kernel):
        row = torch.full((lay.width,), math.nan, dtype=torch.float64, device=x.device)
        left = kernels.record_into(x, wanted, row[: len(FIELDS)])  # (the groups it does not cover: the reference's)
        if left:  # (groups the kernel left: blocks of a strided last dim, user statistics)
            cols, values = reference.columns(x, left, lay)
            row[cols] = values
        return list(row.unbind(0))
    left = accelerate(x, wanted, out) if host_reads and x.device.type == "cpu" else wanted
    reference.fill(x, left, out, lay, host=host_reads)
    return out
