"""The ``channels`` group as plain tensor operations, for a compiler to trace into a graph.

``traceable_channel_row(x)`` gives the same float64 ``[CHANNEL_WIDTH]`` channel row as
``channels.channel_row`` (the channel count, then each last-dimension channel's max |x| over
the finite elements, folded into ``CHANNEL_CAP`` slots above the cap), bit for bit: a max is
exact in any order and in the tensor's own dtype. Written without host reads, data-dependent
branches or in-place writes (its only Python branch is on the rank), so that
TorchDynamo/AOTAutograd trace it into a model's graph and Inductor fuses |x|, the NaN/Inf
mask and the max over the leading dimensions into one reduction that reads ``x`` once.

The compiled route (``capture.compiled``) packs a node's channel row after its other
statistics (``traceable.packed_record`` with the ``channels`` group), and
``traceable.PackedLayout.channel_rows`` takes the rows of all of a graph's nodes out again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_scale.record.stats.channels import CHANNEL_CAP

__all__ = ["traceable_channel_row"]


def traceable_channel_row(x: Tensor) -> Tensor:
    """``x``'s channel row (``channels.channel_row``) as a float64 ``[CHANNEL_WIDTH]`` tensor
    on ``x``'s device, from ops only. NaN and ±Inf count as 0, as on the host path.

    Args:
        x: a floating-point tensor with at least one element (a 0-dim one is one channel).

    Example:
        >>> row = traceable_channel_row(torch.tensor([[1.0, 8.0, 2.0], [0.5, -3.0, float("nan")]]))
        >>> row[:4].tolist(), float(row[4:].abs().sum())
        ([3.0, 1.0, 8.0, 2.0], 0.0)
    """
    x = x.detach()
    a = x.abs()
    a = torch.where(a < math.inf, a, 0.0)  # NaN and ±Inf -> 0 (a comparison: Inductor vectorizes it)
    maxima = a.amax(tuple(range(x.dim() - 1))) if x.dim() > 1 else a.reshape(-1)  # [C], x's dtype (exact)
    c = maxima.numel()
    # fold: channel j into slot j mod CAP; zeros pad (no maximum is below 0) up to the cap too
    slots = torch.nn.functional.pad(maxima.double(), (0, -c % CHANNEL_CAP)).view(-1, CHANNEL_CAP).amax(0)
    count = torch.full((1,), c, dtype=torch.float64, device=x.device)
    return torch.cat([count, slots])
