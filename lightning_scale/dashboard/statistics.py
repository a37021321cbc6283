"""What the dashboard knows of statistics and formats: the package's table and a run's own.

The statistic table (``record.table``) declares every built-in statistic (its axis:
log2 magnitude or linear; whether a high or a low value is worse when ranking; its docs
line) and the float formats. A run's node list stores the same declaration of each statistic
it logged (``metadata``: ``meta``), user statistics included: the run's entry wins. The
``/table`` route sends both to the browser, which keeps no list of statistics or formats of
its own; the tables here read them as the views do.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

from lightning_scale.record.table import ALL, FORMATS

__all__ = ["FORMAT_COLOURS", "FP8_RECIPE", "RANKINGS", "is_log2", "rankable", "table", "worse"]

#: Each format's colour and edge dash in the views (FP16 and E5M2 share their smallest normal:
#: different dashes keep both visible).
FORMAT_COLOURS: Dict[str, str] = {"fp16": "#2e7d32", "bf16": "#616161", "e4m3": "#c62828", "e5m2": "#6a1b9a"}
FORMAT_DASHES: Dict[str, str] = {"fp16": "5,3", "bf16": "5,3", "e4m3": "5,3", "e5m2": "2,3"}
assert set(FORMAT_COLOURS) == set(FORMATS) == set(FORMAT_DASHES)
#: The FP8 format each direction would be cast to in the usual recipe: the ``fp8`` ranking's SNR.
FP8_RECIPE = {"fwd": "e4m3", "bwd": "e5m2"}
#: Rankings of the worst nodes that are not one statistic: headroom to each format, drift, FP8.
RANKINGS = (*FORMATS, "drift", "fp8")

Meta = Mapping[str, Mapping[str, Any]]


def _bands() -> List[List[Any]]:
    """The heatmap's colour scale for magnitudes (log2): hue bands split at the edges that matter,
    FP16/E5M2's smallest normal, E4M3's smallest normal and largest value, FP16's largest value;
    each [low, high (None: unbounded), colour at low, colour at high]."""
    fp16, e4m3 = (math.log2(FORMATS[f].min_normal) for f in ("fp16", "e4m3"))
    top8, top16 = (math.log2(FORMATS[f].max) for f in ("e4m3", "fp16"))
    return [
        [None, fp16, [183, 28, 28], [255, 138, 128]],
        [fp16, e4m3, [255, 193, 7], [255, 236, 179]],
        [e4m3, top8, [13, 71, 161], [144, 202, 249]],
        [top8, top16, [106, 27, 154], [206, 147, 216]],
        [top16, None, [62, 39, 35], [141, 110, 99]],
    ]


def _meta(name: str, run: Optional[Meta]) -> Mapping[str, Any]:
    if run and name in run:
        return run[name]
    found = ALL.get(name)
    return found.meta() if found is not None else {}


def is_log2(name: str, run: Optional[Meta] = None) -> bool:
    """Whether statistic ``name`` is a magnitude, drawn and compared as log2."""
    return _meta(name, run).get("axis") == "log2"


def worse(name: str, run: Optional[Meta] = None) -> Any:
    """``"high"`` or ``"low"``: which end of statistic ``name`` is worse; None: not ranked."""
    return _meta(name, run).get("worse")


def rankable(stats: List[str], run: Optional[Meta] = None) -> List[str]:
    """The statistics of ``stats`` that rank nodes (those that declare which end is worse)."""
    return [s for s in stats if worse(s, run) in ("high", "low")]


def table(run_stats: List[str], run: Optional[Meta] = None) -> Dict[str, Any]:
    """The ``/table`` route's body: the formats (log2 of the smallest normal and the largest
    value, colour), every statistic the package declares and the run logged (axis, worse,
    unscale, docs line), and the worst nodes' rankings."""
    formats = {
        name: {
            "min": math.log2(f.min_normal),
            "max": math.log2(f.max),
            "colour": FORMAT_COLOURS[name],
            "dash": FORMAT_DASHES[name],
        }
        for name, f in FORMATS.items()
    }
    names = list(dict.fromkeys([*ALL, *run_stats]))
    statistics = {name: dict(_meta(name, run)) for name in names}
    return {"formats": formats, "statistics": statistics, "rank_by": list(RANKINGS), "bands": _bands()}
