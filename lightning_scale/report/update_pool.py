"""Pool update statistics (``record.updates.UpdateStats``) beside a step's node records.

A parameter every rank holds whole (data parallelism: equal on every rank after the
gradient all-reduce) is counted once, from rank 0's row; a sharded one (an FSDP2
``DTensor``) adds up over ranks: its weight sums add, its gradient moments merge like a
node's record. ``split_updates`` cuts a rank's rows into those three parts, which
``pool.pool_step`` carries in its collectives (the gradient moments as extra record rows,
the weight sums in the SUM stage, the whole rows as rank 0's values); ``pooled_updates``
puts the pooled parts back together, ``merge_updates`` does all of it in one process.
"""

from __future__ import annotations

import math

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.updates import GRAD, USED, WEIGHT, UpdateStats

__all__ = ["UpdateParts", "merge_updates", "pooled_updates", "split_updates"]


class UpdateParts(NamedTuple):
    """A step's update rows cut by how each part pools.

    Attributes:
        grads: ``[s, 2, FIELDS]``: the sharded parameters' gradient moments (the weight
            direction 0), pooled as records.
        sums: ``[s, USED]``: the sharded parameters' weight sums, added over ranks.
        whole: ``[w, 2, USED]``: the whole parameters' rows, taken from rank 0.
    """

    grads: Tensor
    sums: Tensor
    whole: Tensor


def _index(sharded: Sequence[bool], device: torch.device) -> "tuple[Tensor, Tensor]":
    """(rows of the sharded parameters, rows of the whole ones)."""
    split = [i for i, shard in enumerate(sharded) if shard]
    whole = [i for i, shard in enumerate(sharded) if not shard]
    return stats.index_tensor(split, device), stats.index_tensor(whole, device)


def split_updates(updates: UpdateStats, device: torch.device) -> UpdateParts:
    """``updates``' rows on ``device``, cut into ``UpdateParts``."""
    rows = updates.rows if updates.rows.device == device else updates.rows.to(device)
    split, whole = _index(updates.sharded, device)
    grads = rows[split].clone()
    grads[:, WEIGHT] = 0.0
    return UpdateParts(grads, rows[split, WEIGHT, :USED], rows[whole, :, :USED])


def pooled_updates(sharded: Sequence[bool], parts: UpdateParts) -> Tensor:
    """The pooled update rows ``[k, 2, FIELDS]`` (host) from ``split_updates``' parts pooled
    (``grads`` merged as records, ``sums`` added, ``whole`` rank 0's)."""
    out = torch.zeros(len(sharded), 2, len(stats.FIELDS), dtype=torch.float64)
    split, whole = _index(sharded, out.device)
    out[whole, :, :USED] = parts.whole.reshape(-1, 2, USED)
    out[split, WEIGHT, :USED] = parts.sums.reshape(-1, USED)
    out[split, GRAD, :USED] = parts.grads[:, GRAD, :USED]  # ([s, 2, width]: records' width)
    return out


def merge_updates(per_rank: Tensor, sharded: Sequence[bool]) -> Tensor:
    """``pool_step``'s pooling of update rows ``[world, k, 2, FIELDS]`` in one process:
    rank 0's row for a whole parameter, sums and merged gradient moments for a sharded one."""
    split, whole = _index(sharded, per_rank.device)
    grads = per_rank[:, split].clone()  # (world, s, 2, FIELDS)
    grads[:, :, WEIGHT] = 0.0
    parts = UpdateParts(stats.merge_rows(grads), per_rank[:, split, WEIGHT, :USED].sum(0), per_rank[0, whole, :, :USED])
    return pooled_updates(sharded, parts)


def widened(rows: Tensor, width: int) -> Tensor:
    """Update rows ``[..., len(FIELDS)]`` widened to ``width`` columns (a layout with user
    statistics' fields, which updates do not compute: NaN), so that they travel with records."""
    if rows.shape[-1] == width:
        return rows
    pad = torch.full((*rows.shape[:-1], width - rows.shape[-1]), math.nan, dtype=rows.dtype, device=rows.device)
    return torch.cat([rows, pad], -1)
