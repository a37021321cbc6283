"""Headroom of a tensor's scale to the edges of each floating-point format, in octaves.

Pure maths shared by the writer (per-step summary scalars, the top-k text table) and the
dashboard server (the worst-nodes ranking), so both rank the same way: one value at a time
(``headroom``, ``rank``) or on arrays (``rooms``, ``order``), with one ordering (``order``).

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
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from lightning_scale.record.stats import FORMATS

__all__ = ["FORMAT_NAMES", "below_normal_counts", "drift", "headroom", "log2", "log2_array", "order", "rank", "rooms"]

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


def log2_array(values: np.ndarray) -> np.ndarray:
    """``log2`` on an array: NaN where not positive and finite."""
    ok = (values > 0) & np.isfinite(values)
    return np.where(ok, np.log2(np.where(ok, values, 1.0)), np.nan)


def rooms(std: np.ndarray, absmax: np.ndarray, fmt: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``headroom`` on arrays: (under, over, headroom), NaN where unknown.

    Raises:
        ValueError: ``fmt`` is not one of ``FORMAT_NAMES``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"`fmt` must be one of {list(FORMAT_NAMES)}, got {fmt!r}")
    f = FORMATS[fmt]
    log_std, top = log2_array(std), log2_array(absmax)
    top = np.where(np.isnan(top), log_std, top)
    under, over = log_std - math.log2(f.min_normal), math.log2(f.max) - top
    return under, over, np.minimum(under, over)  # NaN where either is


def order(keys: np.ndarray) -> np.ndarray:
    """The indices that sort ``keys`` ascending: NaN last, ties in input (execution) order."""
    return np.argsort(np.asarray(keys, dtype=np.float64), kind="stable")  # numpy sorts NaN last


def rank(rows: Iterable[Dict[str, float]], key: str, descending: bool = False) -> List[Dict[str, float]]:
    """Rows sorted by ``row[key]`` (NaN last), ties kept in input (execution) order (``order``)."""
    rows = list(rows)
    keys = np.array([r[key] for r in rows], dtype=np.float64)
    return [rows[i] for i in order(-keys if descending else keys)]


def below_normal_counts(std: Sequence[float], absmax: Sequence[float]) -> Dict[str, int]:
    """How many tensors have their std below each format's smallest normal, and their absmax
    (or std, where no absmax) above its max: ``{"below_normal_fp16": k, "above_max_fp16": k, ...}``."""
    out: Dict[str, int] = {}
    for name in FORMAT_NAMES:
        rooms = [headroom(s, a, name) for s, a in zip(std, absmax)]
        out[f"below_normal_{name}"] = sum(1 for r in rooms if r["under"] < 0)
        out[f"above_max_{name}"] = sum(1 for r in rooms if r["over"] < 0)
    return out
