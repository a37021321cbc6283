"""Headroom of a tensor's scale to the edges of each floating-point format, in octaves.

Pure maths shared by the writer (per-step summary scalars, the top-k text table) and the
dashboard server (the worst-nodes ranking), so both rank the same way.

For a format with smallest normal ``n`` and largest finite value ``M``, a tensor with
standard deviation ``s`` and largest magnitude ``a`` has

- ``under = log2(s) - log2(n)``: octaves its typical value sits above the smallest normal
  (negative: most of it is subnormal or flushed to zero);
- ``over = log2(M) - log2(a)``: octaves between its largest value and overflow (``s``
  stands in for ``a`` when the absmax was not logged);
- ``headroom = min(under, over)``: the nearer edge decides.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from lightning_scale.record.stats import FORMATS

__all__ = ["FORMAT_NAMES", "below_normal_counts", "drift", "headroom", "log2", "rank"]

FORMAT_NAMES = tuple(FORMATS)


def log2(value: Optional[float]) -> float:
    """``log2(value)``; NaN for missing, non-finite, zero or negative values."""
    if value is None or not math.isfinite(value) or value <= 0:
        return math.nan
    return math.log2(value)


def headroom(std: Optional[float], absmax: Optional[float], fmt: str) -> Dict[str, float]:
    """Octaves from ``std`` down to ``fmt``'s smallest normal and from ``absmax`` (or ``std``) up to its max.

    Raises:
        ValueError: ``fmt`` is not one of ``FORMAT_NAMES``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"`fmt` must be one of {list(FORMAT_NAMES)}, got {fmt!r}")
    f = FORMATS[fmt]
    top = log2(absmax)
    if math.isnan(top):
        top = log2(std)
    under = log2(std) - math.log2(f.min_normal)
    over = math.log2(f.max) - top
    room = math.nan if math.isnan(under) or math.isnan(over) else min(under, over)
    return {"under": under, "over": over, "headroom": room}


def drift(series: Mapping[int, float]) -> float:
    """log2 std at the last step minus at the first step of ``{step: std}`` (NaN if < 2 steps)."""
    steps = sorted(s for s, v in series.items() if not math.isnan(log2(v)))
    if len(steps) < 2:
        return math.nan
    return log2(series[steps[-1]]) - log2(series[steps[0]])


def rank(rows: Iterable[Dict[str, float]], key: str, descending: bool = False) -> List[Dict[str, float]]:
    """Rows sorted by ``row[key]`` (NaN last), ties kept in input (execution) order."""
    rows = list(rows)
    ok = [r for r in rows if not math.isnan(r[key])]
    bad = [r for r in rows if math.isnan(r[key])]
    return sorted(ok, key=lambda r: -r[key] if descending else r[key]) + bad


def below_normal_counts(std: Sequence[float], absmax: Sequence[float]) -> Dict[str, int]:
    """How many tensors have their std below each format's smallest normal, and their absmax
    (or std, where no absmax) above its max: ``{"below_normal_fp16": k, "above_max_fp16": k, ...}``."""
    out: Dict[str, int] = {}
    for name in FORMAT_NAMES:
        rooms = [headroom(s, a, name) for s, a in zip(std, absmax)]
        out[f"below_normal_{name}"] = sum(1 for r in rooms if r["under"] < 0)
        out[f"above_max_{name}"] = sum(1 for r in rooms if r["over"] < 0)
    return out
