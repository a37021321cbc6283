"""Each node's std over ranks (``rank_spread``): the least and largest of the ranks' own
stds, pooled with MAX in ``pool.pool_step``'s extremes stage."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["SPREAD", "RankSpread", "spread_of", "spread_part"]

SPREAD = 4  # sent per node and direction: std, -std, NaN std (0/1), -count


class RankSpread(NamedTuple):
    """Each node's std over ranks (host): ``low`` and ``high`` ``[n, 2]`` are the least and
    the largest of the ranks' own stds (NaN where a rank's is NaN), ``present`` ``[n, 2]``
    whether every rank recorded the node in that direction."""

    present: Tensor
    low: Tensor
    high: Tensor


def spread_part(records: Tensor) -> Tensor:
    """``[n, 2, SPREAD]``: this rank's std (-inf where absent or NaN), its negation, a NaN
    flag and minus the count (MAX gives minus the least count: present on every rank?)."""
    count = records[..., 0]
    std = stats.statistic(records, "std")
    ok = (count > 0) & ~std.isnan()
    low = torch.full_like(std, -math.inf)
    return torch.stack(
        [torch.where(ok, std, low), torch.where(ok, -std, low), ((count > 0) & std.isnan()).double(), -count], -1
    )


def spread_of(top: Tensor) -> Tensor:
    """``[n, 2, 3]``: present (0/1), least std, largest std, from MAX of ``spread_part``."""
    nan = top[..., 2] > 0
    present = top[..., 3] < 0
    low = torch.where(nan, math.nan, -top[..., 1])
    high = torch.where(nan, math.nan, top[..., 0])
    return torch.stack([present.double(), low, high], -1)
