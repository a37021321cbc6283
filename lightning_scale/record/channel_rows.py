"""ChannelRows: a step's channel rows (``stats.channels``) per recorded key and direction.

The ``Recorder`` hands every tensor it records to ``add`` when the ``channels`` group is
on; rows stay on the tensor's device and merge by an element-wise max (a key recorded
more than once in a step: micro-batches, a module called twice). ``tensor`` places them
for the labels asked, as ``Recorder.records`` places records (aliases and nodes that
returned the same tensor get their source's row).
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.channels import CHANNEL_WIDTH, channel_row
from lightning_scale.record.stats.fields import index_tensor

__all__ = ["ChannelRows"]


class ChannelRows:
    """Channel rows by (slot, direction), each the max of the rows of the tensors added there."""

    def __init__(self) -> None:
        self._rows: Dict[Tuple[int, int], Tensor] = {}
        self._last: Optional[Tuple[Any, int, Tensor]] = None  # (weakref, version, row) of the last tensor

    def add(self, slot: int, direction: int, x: Tensor) -> None:
        """Merge ``x``'s channel row into (``slot``, ``direction``). The very tensor added last,
        unchanged since (a gradient autograd hands to several nodes), is not read again."""
        last = self._last
        version = -1 if x.is_inference() else x._version
        if last is not None and last[0]() is x and last[1] == version >= 0:
            row = last[2]
        else:
            row = channel_row(x)
            self._last = (weakref.ref(x), version, row)
        prev = self._rows.get((slot, direction))
        self._rows[(slot, direction)] = row if prev is None else torch.maximum(prev, row)

    def tensor(self, placement: Dict[int, List[int]], n: int, device: Optional[torch.device]) -> Tensor:
        """``[n, 2, CHANNEL_WIDTH]`` float64 on ``device``: row ``[i, d]`` the max of the rows of
        every slot placed at ``i`` (``placement``: slot -> indices); zeros (no channel) elsewhere."""
        out = torch.zeros(n, 2, CHANNEL_WIDTH, dtype=torch.float64, device=device)
        dst: List[int] = []  # flat output row (index * 2 + direction) of each placed row
        rows: List[Tensor] = []
        for (slot, d), row in self._rows.items():
            for i in placement.get(slot, ()):
                dst.append(i * 2 + d)
                rows.append(row)
        if rows:  # one stack and one max-scatter, whatever the node count
            index = index_tensor(dst, out.device).unsqueeze(1).expand(-1, CHANNEL_WIDTH)
            out.view(-1, CHANNEL_WIDTH).scatter_reduce_(0, index, torch.stack(rows).to(out.device), "amax")
        return out

    def clear(self) -> None:
        """Forget this step's rows."""
        self._rows.clear()
        self._last = None
