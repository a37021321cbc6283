"""The groups the host kernel's first read leaves out: ``blocks`` (the MXFP8, MXFP4 and
NVFP4 what-ifs, ``blocks.py``) and ``kurtosis`` (the third and fourth central moments,
``outliers.py``).

The fused Triton kernel computes both in its one read (``triton_stats``), except
``blocks`` of a tensor whose last dimension is not contiguous: it says so, and ``fill`` is
given what it left. Elsewhere ``fill`` reads the tensor once more per group: for ``blocks``
of a float32 or bfloat16 host tensor with evenly strided rows, with the native kernel's
block casts (``native.blocks``), for ``kurtosis`` of such a tensor read in place with its
moments kernel (``native.moments``, about the mean the first read gave), no temporaries;
otherwise with torch code, in pieces
whose temporaries stay within ``layout.scratch_bytes``.
"""

from __future__ import annotations

from typing import Collection, List, Optional, Tuple, Union

import torch
from torch import Tensor

from lightning_scale.record import native
from lightning_scale.record.stats.blocks import block_fields
from lightning_scale.record.stats.fields import BLOCKS_SPAN, Col, Entry
from lightning_scale.record.stats.layout import DEVICE_SCRATCH_FLOOR, SCRATCH_FLOOR, piece_size
from lightning_scale.record.stats.outliers import moments_row

__all__ = ["TORCH_GROUPS", "fill"]

#: The groups ``fill`` computes.
TORCH_GROUPS = frozenset({"blocks", "kurtosis"})
#: Bytes of temporaries per element each group takes at most (float32 work; float64 tensors twice).
_SCRATCH = {"blocks": 32, "kurtosis": 20}
_MOMENTS = slice(Col.M3, Col.M4 + 1)
assert Col.M4 == Col.M3 + 1


def _columns(x: Tensor, groups: Collection[str], centre: Optional[float] = None) -> List[Tuple[slice, Tensor]]:
    """(columns, float64 values on ``x``'s device) of each of ``TORCH_GROUPS`` in ``groups``;
    ``centre``: the mean where the host path's first read gave it (the moments kernel's centre)."""
    floor = SCRATCH_FLOOR if x.device.type == "cpu" else DEVICE_SCRATCH_FLOOR
    wide = 2 if x.dtype == torch.float64 else 1
    out: List[Tuple[slice, Tensor]] = []
    if "blocks" in groups:
        fast = native.blocks(x) if x.device.type == "cpu" else None
        if fast is not None:
            out.append((BLOCKS_SPAN, torch.from_numpy(fast)))
        else:
            out.append((BLOCKS_SPAN, torch.stack(block_fields(x, piece_size(x, _SCRATCH["blocks"] * wide, floor)))))
    if "kurtosis" in groups:
        fast = native.moments(x, centre) if x.device.type == "cpu" else None
        if fast is not None:
            out.append((_MOMENTS, torch.from_numpy(fast[3:5])))
        else:
            out.append((_MOMENTS, moments_row(x, piece_size(x, _SCRATCH["kurtosis"] * wide, floor))[3:5]))
    return out


def fill(x: Tensor, groups: Collection[str], out: Union[List[Entry], Tensor], host_reads: bool = False) -> None:
    """Write the fields of ``groups`` ∩ ``TORCH_GROUPS`` of ``x`` (non-empty) into ``out``: an
    entry list (floats with ``host_reads``, else 0-dim tensors) or a float64 record row
    tensor on ``x``'s device (written in place, nothing read back)."""
    if TORCH_GROUPS.isdisjoint(groups):  # (the kernels' paths: no op at all)
        return
    mean = out[Col.MEAN] if isinstance(out, list) else None
    for cols, values in _columns(x.detach(), groups, mean if isinstance(mean, float) else None):
        if isinstance(out, Tensor):
            out[cols] = values
        elif host_reads:
            out[cols] = values.tolist()
        else:
            out[cols] = list(values.unbind())
