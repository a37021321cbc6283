"""Format counts from sorted bounds: the buckets the accelerations count |x| in.

The ``formats`` group (zeros, the least nonzero |x|, and for each of ``FORMATS`` the values
below its subnormal and normal ranges and above its maximum) is defined by the reference
(``reference.formats``: comparisons). The native kernel and ``short_records`` count |x|
between sorted boundaries instead (``BOUNDS``) and turn the cumulative counts into the
fields here (``format_fields_of_row``, ``format_fields_of_cumulative``).
"""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
import torch

from lightning_scale.record.stats.fields import FORMATS


def _format_bounds(dtype: torch.dtype) -> Tuple[List[float], List[int], List[int]]:
    """Sorted boundaries for ``bucketize(|x|, right=True)``, and for each format field the
    boundary index whose cumulative count answers it (underflow/below_normal: ``x < b``;
    overflow: ``x >= next float above max``). The first boundary, the smallest positive
    number of ``dtype``, puts exactly the zeros in bucket 0."""
    if dtype == torch.float64:
        tiny, above = 2.0**-1074, (lambda v: math.nextafter(v, math.inf))
    else:
        tiny = 2.0**-149
        above = lambda v: float(torch.nextafter(torch.tensor(v), torch.tensor(math.inf)))  # noqa: E731
    wanted = [tiny]
    for f in FORMATS.values():
        wanted += [f.min_subnormal, f.min_normal, above(f.max)]
    bounds = sorted(wanted)
    low = [bounds.index(t) for f in FORMATS.values() for t in (f.min_subnormal, f.min_normal)]
    high = [bounds.index(above(f.max)) for f in FORMATS.values()]
    return bounds, low, high


BOUNDS = {dt: _format_bounds(dt) for dt in (torch.float32, torch.float64)}
#: The float32 format bounds as the bits the native kernel compares |x|'s bits with.
NATIVE_BOUNDS = np.array(BOUNDS[torch.float32][0], dtype=np.float32).view(np.int32)


def _format_pairs(dtype: torch.dtype) -> Tuple[List[int], List[int]]:
    """Column pairs (plus, minus) of cumulative bucket counts among ``BOUNDS[dtype]``, one
    per format field in FIELDS order: field = cum[plus] - cum[minus], with ``cum[k]`` =
    #{|x| < bounds[k]} and the last column the count of all (NaN counted in bucket 0, or
    left out of every column): the nonzero values under each format's two lower thresholds
    (minus the zeros, column 0) and those at or above the next float after its max."""
    _, low, high = BOUNDS[dtype]
    last = len(BOUNDS[dtype][0])
    plus: List[int] = []
    minus: List[int] = []
    for k in range(len(FORMATS)):
        plus += [low[2 * k], low[2 * k + 1], last]
        minus += [0, 0, high[k]]
    return plus, minus


_FORMAT_PAIRS = {dt: _format_pairs(dt) for dt in (torch.float32, torch.float64)}


def format_fields_of_cumulative(cum: "np.ndarray", dtype: torch.dtype) -> "np.ndarray":
    """The format counts (FIELDS order, float64) of each row of ``cum`` (see
    ``_format_pairs``). Shared by the host paths, one tensor or many (``short_records``)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return (cum[:, plus] - cum[:, minus]).astype(np.float64)


def format_fields_of_row(cum: List[int], dtype: torch.dtype) -> List[float]:
    """``format_fields_of_cumulative`` of one row as a list (in Python: on 14 numbers it
    costs ~10 us less than numpy, and it runs once per recorded tensor)."""
    plus, minus = _FORMAT_PAIRS[dtype]
    return [float(cum[p] - cum[m]) for p, m in zip(plus, minus)]
