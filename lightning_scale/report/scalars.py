"""The scalar tags of a tracked step, their values at once, and their wire encoding.

Tags, for each direction ``<dir>`` (``fwd``, ``bwd``) and node ``<label>``:

- ``scale/<dir>/<label>``: the std; any other statistic ``<name>/<dir>/<label>``;
- ``scale_log2/<dir>/<label>``: log2 of the std (gradients of ~1e-5 read as -17, not 0);
- ``scale_summary/<dir>/below_normal_<fmt>`` and ``above_max_<fmt>``: how many nodes have
  their std below the format's smallest normal, their absmax (or std) above its max
  (``dashboard.headroom``'s definitions, on arrays).

A run writes the same few thousand tags step after step: the tags are built once and
cached, the values computed for every node at once, and a step's scalars encoded as one
``Summary`` straight from its wire bytes (``summary_bytes``).
"""

from __future__ import annotations

import functools
from typing import Dict, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.dashboard import headroom
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.report.event_file import varint
from lightning_scale.report.values import StepValues

__all__ = [
    "DIRECTIONS",
    "mask_key",
    "scalar_metrics",
    "scalar_tags",
    "scalar_values",
    "summary_bytes",
    "summary_metrics",
]

DIRECTIONS = (("fwd", FORWARD), ("bwd", BACKWARD))

#: ``(shape, bytes)`` of a boolean mask: hashable, so the tags it selects can be cached.
MaskKey = Tuple[Tuple[int, ...], bytes]


def _tag_stat(name: str) -> str:
    return "scale" if name == "std" else name


def scalar_metrics(
    labels: Sequence[str], values: StepValues, names: Sequence[str], log2: bool = False
) -> Dict[str, float]:
    """``{"scale/fwd/<label>": std, "<stat>/bwd/<label>": ...}`` for present records
    (and ``scale_log2/<dir>/<label>`` for positive finite stds if ``log2``)."""
    out, keep = scalar_values(values, names, log2)
    return dict(zip(scalar_tags(tuple(labels), tuple(names), log2, mask_key(keep)), out[keep].tolist()))


def scalar_values(values: StepValues, names: Sequence[str], log2: bool) -> Tuple[Tensor, Tensor]:
    """Every scalar at once: values ``[statistics (+ log2), nodes, 2]`` and which to write
    (present records; the channel statistics where known: not NaN, e.g. a compiled graph's
    node has no channel row; for log2 also a positive finite std)."""
    rows = [values(name) for name in names]
    keep = values.present.expand(len(rows) + log2, -1, -1).clone()
    for k, name in enumerate(names):
        if values.layout.statistic(name).group == "channels":
            keep[k] &= ~rows[k].isnan()
    if log2:
        std = values("std")
        ok = (std > 0) & torch.isfinite(std)
        rows.append(torch.where(ok, std, torch.ones_like(std)).log2())
        keep[-1] &= ok
    return torch.stack(rows), keep


def mask_key(keep: Tensor) -> MaskKey:
    """A boolean tensor as a hashable key."""
    return tuple(keep.shape), keep.numpy().tobytes()


@functools.lru_cache(maxsize=8)
def scalar_tags(labels: Tuple[str, ...], names: Tuple[str, ...], log2: bool, mask: MaskKey) -> Tuple[str, ...]:
    """The tags of ``scalar_values``'s kept entries, in their order (cached: a run
    writes the same tags step after step, ~6000 strings with every statistic)."""
    keep = torch.frombuffer(bytearray(mask[1]), dtype=torch.bool).view(mask[0]).tolist()
    stat_names = [_tag_stat(n) for n in names] + (["scale_log2"] if log2 else [])
    return tuple(
        f"{stat}/{tag}/{label}"
        for k, stat in enumerate(stat_names)
        for i, label in enumerate(labels)
        for tag, d in DIRECTIONS
        if keep[k][i][d]
    )


def summary_metrics(values: StepValues) -> Dict[str, float]:
    """``{"scale_summary/<dir>/below_normal_<fmt>": count, ".../above_max_<fmt>": count}`` over nodes."""
    std, absmax = values("std").numpy(), values("absmax").numpy()
    present = values.present.numpy()  # (nodes, 2)
    out: Dict[str, float] = {}
    counts = {}
    for fmt in headroom.FORMAT_NAMES:
        under, over, _ = headroom.rooms(std, absmax, fmt)
        counts[fmt] = (((under < 0) & present).sum(0).tolist(), ((over < 0) & present).sum(0).tolist())
    for tag, d in DIRECTIONS:
        for fmt in headroom.FORMAT_NAMES:
            out[f"scale_summary/{tag}/below_normal_{fmt}"] = float(counts[fmt][0][d])
            out[f"scale_summary/{tag}/above_max_{fmt}"] = float(counts[fmt][1][d])
    return out


def summary_bytes(tags: Sequence[str], values: Sequence[float]) -> bytes:
    """The wire encoding of ``Summary(value=[Value(tag=t, simple_value=v), ...])``.

    One ``Summary.Value`` object per tag costs ~10 us; the tags' encodings are cached.
    """
    with np.errstate(over="ignore"):  # as protobuf: beyond float32 is +-inf
        raw = np.asarray(values, dtype=np.float64).astype("<f4").tobytes()
    floats = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    return b"".join(map(bytes.__add__, map(_value_head, tags), floats))


@functools.lru_cache(maxsize=1 << 16)
def _value_head(tag: str) -> bytes:
    """``Summary.value`` entry up to its float: field 1 (Value, length-delimited), its
    field 1 (tag, a string) and field 2's key (simple_value, fixed32)."""
    t = tag.encode()
    body = b"\x0a" + varint(len(t)) + t + b"\x15"
    return b"\x0a" + varint(len(body) + 4) + body
