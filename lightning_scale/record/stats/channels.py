"""Channel outliers: how far a tensor's worst channel sticks out, and how many stick out.

A tensor's channels are the entries of its last dimension (features, the same on every
data-parallel rank); a channel's maximum is its max |x| over every other dimension, of the
finite elements (NaN and ±Inf count as 0: the ``nan``/``inf`` counts report them).

* ``channel_max_ratio``: the largest channel maximum over the median one (the mean of the
  two middle ones for an even count); +inf where the median is 0 and the largest not, NaN
  where every channel maximum is 0.
* ``outlier_channels``: the fraction of channels whose maximum exceeds ``OUTLIER`` (6,
  LLM.int8's threshold).

**Kept per node and direction**: a float64 *channel row* of ``CHANNEL_WIDTH`` (4,097)
numbers, 32 KB: the channel count ``C`` and ``CHANNEL_CAP`` (4,096) slots. Up to the cap,
slot ``j`` is channel ``j``'s maximum (0 in unused slots). Above the cap channels are
*folded*: slot ``k`` holds the largest maximum of channels ``k, k + CAP, k + 2 CAP, ...``
and the statistics are those of the ``CAP`` slots. So the largest maximum is always exact;
above the cap the median is that of the slots (each the max of up to ``g = ceil(C / CAP)``
channels: for channels of similar size, above the channels' median, so a lower ratio) and
``outlier_channels`` the fraction of slots holding an outlier channel (``k`` outlier
channels fill between ``ceil(k / g)`` and ``k`` slots).

Every entry merges by a max: the row of a step's tensors over micro-batches and ranks is
the element-wise max of their rows, exactly the row of their concatenation along any
leading dimension (the same channel count everywhere). So the pool needs one ``MAX``
reduction of ``[nodes, 2, CHANNEL_WIDTH]`` whatever the world size. A node whose channel
count differs between micro-batches or ranks (a last dimension that is a sequence length)
is merged slot by slot under the largest count.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch
from torch import Tensor

from lightning_scale.record import native
from lightning_scale.record.stats.blocks import row_pieces

__all__ = [
    "CHANNEL_CAP",
    "CHANNEL_STATISTICS",
    "CHANNEL_WIDTH",
    "OUTLIER",
    "channel_max_ratio",
    "channel_maxima",
    "channel_row",
    "channel_slots",
    "channel_statistics",
    "merge_channel_rows",
    "outlier_channels",
]

#: A channel maximum above this is an outlier (LLM.int8).
OUTLIER = 6.0
#: Slots of a channel row: up to this many channels are kept one by one, more are folded.
CHANNEL_CAP = 4096
#: Entries of a channel row: the channel count, then the slots.
CHANNEL_WIDTH = 1 + CHANNEL_CAP
#: The statistics of channel rows, by name -> their (opt-in) group.
CHANNEL_STATISTICS: Dict[str, str] = {"channel_max_ratio": "channels", "outlier_channels": "channels"}
#: Elements read at a time (whole rows where they fit): |x| and its float32 copy as temporaries.
CHUNK = 1 << 20


def channel_maxima(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """float64 ``[C]``: each last-dimension channel's max |x| over the finite elements (0 where none).

    A 0-dim tensor is one channel. A float32, bfloat16 or float16 host tensor of evenly strided
    rows is read once by the native kernel (``native.channel_maxima``). Else in host memory a
    max and a min over the leading dimensions (any layout, no temporary) serve where every
    channel is finite (a free check there); otherwise, and off the host (no host read), ``x``
    is read ``chunk`` elements at a time as |x| with NaN and Inf set to 0.

    Example:
        >>> channel_maxima(torch.tensor([[1.0, -7.0], [-2.0, float("nan")]])).tolist()
        [2.0, 7.0]
    """
    x = x.detach()
    c = x.shape[-1] if x.dim() else 1
    fast = native.channel_maxima(x) if x.is_cpu else None
    if fast is not None:
        return fast
    if x.is_cpu and x.numel():
        lead = tuple(range(x.dim() - 1))
        a = torch.maximum(x.amax(lead), -x.amin(lead)) if lead else x.abs().reshape(c)
        if bool(a.isfinite().all()):
            return a.double()
    out = torch.zeros(c, dtype=torch.float64, device=x.device)
    for part, j in row_pieces(x, chunk):
        a = torch.nan_to_num(part.abs(), nan=0.0, posinf=0.0).amax(0).double()
        out[j : j + a.numel()] = torch.maximum(out[j : j + a.numel()], a)
    return out


def channel_slots(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """float64 ``[min(C, CHANNEL_CAP)]``: the slots of ``x``'s channel row (the channel maxima,
    folded above the cap), on its device."""
    maxima = channel_maxima(x, chunk)
    c = maxima.numel()
    if c <= CHANNEL_CAP:
        return maxima
    # fold: channel j into slot j mod CAP (zeros pad: no maximum is below 0)
    return torch.nn.functional.pad(maxima, (0, -c % CHANNEL_CAP)).view(-1, CHANNEL_CAP).amax(0)


def channel_row(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """The float64 ``[CHANNEL_WIDTH]`` channel row of ``x`` on its device (nothing read back).

    Example:
        >>> row = channel_row(torch.tensor([[1.0, 8.0, 2.0], [0.5, -3.0, 4.0]]))
        >>> row[:4].tolist(), float(channel_max_ratio(row)), float(outlier_channels(row))
        ([3.0, 1.0, 8.0, 4.0], 2.0, 0.3333333333333333)
    """
    slots = channel_slots(x, chunk)
    row = torch.zeros(CHANNEL_WIDTH, dtype=torch.float64, device=slots.device)
    row[0] = x.shape[-1] if x.dim() else 1
    row[1 : 1 + slots.numel()] = slots
    return row


def merge_channel_rows(rows: Tensor, dim: int = 0) -> Tensor:
    """Merge channel rows along ``dim`` (an element-wise max) as if their tensors were concatenated."""
    return rows.amax(dim)


def _slots(rows: Tensor) -> Tensor:
    """The number of used slots of each row, at least 1 (as a long tensor)."""
    return rows[..., 0].clamp(1, CHANNEL_CAP).long()


def _used(rows: Tensor) -> Tensor:
    """The slots ``[..., w]`` of ``rows`` up to the most any row uses (one read of the counts)."""
    w = int(rows[..., 0].max().clamp(1, CHANNEL_CAP)) if rows.numel() else 1
    return rows[..., 1 : 1 + w]


def channel_max_ratio(rows: Tensor) -> Tensor:
    """Largest channel maximum over the median one, of channel rows ``[..., CHANNEL_WIDTH]``;
    NaN for a row without channels (count 0: not recorded)."""
    s = _used(rows).sort(-1).values  # the used slots are the last ``c`` (unused ones hold 0)
    c = _slots(rows)
    start = s.shape[-1] - c
    lo = s.gather(-1, (start + (c - 1) // 2).unsqueeze(-1)).squeeze(-1)
    hi = s.gather(-1, (start + c // 2).unsqueeze(-1)).squeeze(-1)
    median, top = lo / 2 + hi / 2, s[..., -1]
    ratio = torch.where(median > 0, top / median, torch.where(top > 0, math.inf, math.nan))
    return torch.where(rows[..., 0] >= 1, ratio, math.nan)


def outlier_channels(rows: Tensor) -> Tensor:
    """The fraction of channels (of slots, above the cap) whose maximum exceeds ``OUTLIER``, of
    channel rows ``[..., CHANNEL_WIDTH]``; NaN for a row without channels."""
    fraction = (_used(rows) > OUTLIER).sum(-1).double() / _slots(rows)
    return torch.where(rows[..., 0] >= 1, fraction, math.nan)


def channel_statistics(rows: Tensor, names: Sequence[str] = tuple(CHANNEL_STATISTICS)) -> Dict[str, Tensor]:
    """``{name: [...]}`` of each of ``names`` (``CHANNEL_STATISTICS``) from channel rows ``[..., CHANNEL_WIDTH]``.

    Raises:
        ValueError: a name that is not a channel statistic.
    """
    known = {"channel_max_ratio": channel_max_ratio, "outlier_channels": outlier_channels}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"`names` must be channel statistics {sorted(known)}, got {bad}")
    return {n: known[n](rows) for n in names}
