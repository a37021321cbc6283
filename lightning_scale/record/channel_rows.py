"""ChannelRows: a step's channel rows (``stats.channels``) per recorded key and direction.

The ``Recorder`` hands every tensor it records to ``add`` when the ``channels`` group is
on; rows stay on the tensor's device and merge by an element-wise max (a key recorded
more than once in a step: micro-batches, a module called twice). Rows computed elsewhere
(a compiled graph's, ``record.stats.traceable_channels``) come whole through ``add_rows``, or
through ``add_rows_later`` when they exist only after backward. ``tensor`` places them all
for the labels asked, as ``Recorder.records`` places records (aliases and nodes that
returned the same tensor get their source's row).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.channels import CHANNEL_WIDTH, channel_slots
from lightning_scale.record.stats.fields import index_tensor

__all__ = ["ChannelRows"]


class ChannelRows:
    """Channel rows by (slot, direction), each the max of the rows of the tensors added there,
    kept as (channel count, slots): the row without its unused slots."""

    def __init__(self) -> None:
        self._rows: Dict[Tuple[int, int], Tuple[int, Tensor]] = {}
        self._last: Optional[Tuple[Any, int, Tensor]] = None  # (weakref, version, slots) of the last tensor
        self._whole: List[Tuple[List[int], int, Tensor]] = []  # (slots, direction, [n, CHANNEL_WIDTH] rows)
        self._later: List[Tuple[List[int], int, Callable[[], Optional[Tensor]]]] = []

    def add(self, slot: int, direction: int, x: Tensor) -> None:
        """Merge ``x``'s channel row into (``slot``, ``direction``). The very tensor added last,
        unchanged since (a gradient autograd hands to several nodes), is not read again."""
        last = self._last
        version = -1 if x.is_inference() else x._version
        if last is not None and last[0]() is x and last[1] == version >= 0:
            slots = last[2]
        else:
            slots = channel_slots(x)
            self._last = (weakref.ref(x), version, slots)
        count = x.shape[-1] if x.dim() else 1
        prev = self._rows.get((slot, direction))
        self._rows[(slot, direction)] = (count, slots) if prev is None else (max(prev[0], count), _max(prev[1], slots))

    def add_rows(self, slots: Sequence[int], direction: int, rows: Tensor) -> None:
        """Merge whole channel rows computed elsewhere: ``rows[i]`` (float64 ``[CHANNEL_WIDTH]``
        on the device, its count included) into (``slots[i]``, ``direction``). Nothing is read."""
        if rows.shape != (len(slots), CHANNEL_WIDTH):
            raise ValueError(f"`rows` must be [{len(slots)}, {CHANNEL_WIDTH}], got {list(rows.shape)}")
        self._whole.append((list(slots), direction, rows))

    def add_rows_later(self, slots: Sequence[int], direction: int, rows: Callable[[], Optional[Tensor]]) -> None:
        """As ``add_rows``, with rows that exist only after backward: ``rows()`` is called by
        ``tensor``; None means no rows (no backward reached them)."""
        self._later.append((list(slots), direction, rows))

    def tensor(self, placement: Dict[int, List[int]], n: int, device: Optional[torch.device]) -> Tensor:
        """``[n, 2, CHANNEL_WIDTH]`` float64 on ``device``: row ``[i, d]`` the max of the rows of
        every slot placed at ``i`` (``placement``: slot -> indices); zeros (no channel) elsewhere."""
        out = torch.zeros(n, 2, CHANNEL_WIDTH, dtype=torch.float64, device=device)
        counts: Dict[int, int] = {}  # flat row (index * 2 + direction) -> its channel count
        for (slot, d), (count, slots) in self._rows.items():
            for i in placement.get(slot, ()):
                counts[i * 2 + d] = max(counts.get(i * 2 + d, 0), count)
                used = out[i, d, 1 : 1 + slots.numel()]
                torch.maximum(used, slots.to(used.device), out=used)
        if counts:  # (one copy of the counts, known on the host)
            values = torch.tensor(list(counts.values()), dtype=torch.float64).to(out.device)
            out.view(-1, CHANNEL_WIDTH)[index_tensor(list(counts), out.device), 0] = values
        self._take_later()
        for slots, d, rows in self._whole:  # (after the counts: merged with them by a max)
            _place(out, placement, slots, d, rows)
        return out

    def _take_later(self) -> None:
        """Keep the later rows that exist now as whole rows (each callable is called once)."""
        later, self._later = self._later, []
        for slots, d, rows in later:
            taken = rows()
            if taken is not None:
                self.add_rows(slots, d, taken)

    def clear(self) -> None:
        """Forget this step's rows."""
        self._rows.clear()
        self._whole.clear()
        self._later.clear()
        self._last = None


def _place(out: Tensor, placement: Dict[int, List[int]], slots: List[int], direction: int, rows: Tensor) -> None:
    """Merge ``rows[j]`` (of ``slots[j]``) into ``out[i, direction]`` for each ``i`` its slot is
    placed at: one scatter by a max (a row placed twice, or two rows at one index, merge)."""
    dst: List[int] = []
    src: List[int] = []
    for j, slot in enumerate(slots):
        for i in placement.get(slot, ()):
            dst.append(i * 2 + direction)
            src.append(j)
    if dst:
        flat = out.view(-1, CHANNEL_WIDTH)
        taken = rows.index_select(0, index_tensor(src, rows.device)).to(out.device)
        index = index_tensor(dst, out.device).unsqueeze(1).expand(-1, CHANNEL_WIDTH)
        flat.scatter_reduce_(0, index, taken, "amax")


def _max(a: Tensor, b: Tensor) -> Tensor:
    """The element-wise max of two slot vectors, the shorter one padded with zeros."""
    if a.numel() < b.numel():
        a, b = b, a
    out = a.clone()
    out[: b.numel()] = torch.maximum(out[: b.numel()], b)
    return out
