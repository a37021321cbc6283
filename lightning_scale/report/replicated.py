"""Tensors every rank holds whole (parameters, buffers): a forward record counted once.

In ``pool.pool_step``'s extremes stage (MAX) each rank also sends, per replicated row, its
forward record and its negation (NaN fields as a bit mask, with its negation): where every
rank sent the same record (``MAX(x) == -MAX(-x)``) the tensor is one tensor, so its pooled
forward record is that record, not the merge of ``world`` copies, and its forward value
histogram is the sum over ranks / world.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["count_once", "replicated_part"]

FORWARD = (
    0  # a record tensor's row [i, 0] is the forward record (``recorder.FORWARD``; not imported: it imports dynamo)
)


def replicated_part(records: Tensor, index: Optional[Tensor]) -> Tensor:
    """``[r, 2 F + 2]``: the forward records (``F`` fields) of replicated rows without NaN,
    their negation, and the NaN fields as a bit mask, with its negation."""
    if index is None:
        return records.new_zeros(0)
    fwd = records[index, FORWARD]  # (r, F)
    nan = fwd.isnan()
    value = torch.where(nan, 0.0, fwd)
    bits = 2.0 ** torch.arange(fwd.shape[-1], dtype=torch.float64, device=fwd.device)
    mask = (nan.double() * bits).sum(-1, keepdim=True)  # exact: F < 53
    return torch.cat([value, -value, mask, -mask], -1)


def _replicated_of(top: Tensor) -> Tuple[Tensor, Tensor]:
    """(every rank sent the same record ``[r]``, that record ``[r, F]``) from MAX of
    ``replicated_part``."""
    f = (top.shape[-1] - 2) // 2
    value, neg, mask, neg_mask = top[:, :f], top[:, f : 2 * f], top[:, 2 * f], top[:, 2 * f + 1]
    same = (value == -neg).all(-1) & (mask == -neg_mask)
    bits = (mask.long().unsqueeze(-1) >> torch.arange(f, device=top.device)) & 1
    return same, torch.where(bits.bool(), math.nan, value)


def count_once(
    merged: Tensor, hist_sum: Tensor, top: Tensor, index: Tensor, hist_rep: List[Tuple[int, int]], fields: Tensor
) -> None:
    """Where every rank sent the same forward record of a replicated row (``top``: MAX of
    ``replicated_part`` of the rows ``index``, of the record ``fields``), that record
    replaces the merged one in ``merged`` and its forward histogram (``hist_rep``:
    (histogram row, replicated row)) in ``hist_sum`` is divided by the world size."""
    device = merged.device
    same, value = _replicated_of(top.view(index.numel(), -1))
    value = torch.full((index.numel(), merged.shape[-1]), math.nan, dtype=torch.float64, device=device).index_copy_(
        1, fields, value
    )
    merged[index, FORWARD] = torch.where(same.unsqueeze(-1), value, merged[index, FORWARD])
    if hist_rep:
        rows = stats.index_tensor([j for j, _ in hist_rep], device)
        agree = same[stats.index_tensor([k for _, k in hist_rep], device)]
        counted = hist_sum[rows, FORWARD]
        world = torch.distributed.get_world_size()
        hist_sum[rows, FORWARD] = torch.where(agree.unsqueeze(-1), counted / world, counted)
