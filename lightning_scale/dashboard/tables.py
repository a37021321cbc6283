"""Per-step tables the dashboard's views draw: computed here, on the server, from ``RunData``.

Every function returns plain JSON-ready structures; missing values are ``None``.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional

from lightning_scale.dashboard import headroom
from lightning_scale.dashboard.data import DIRS, RunData
from lightning_scale.dashboard.layout import module_group
from lightning_scale.record.stats import FORMATS

__all__ = ["FP8_RECIPE", "LOG2_STATS", "code", "heatmap", "nearest_step", "profile", "series", "worst"]

RANKINGS = (*FORMATS, "drift", "fp8")
#: Magnitudes, drawn and coloured as log2; every other statistic (fractions, dB, counts) as logged.
LOG2_STATS = ("std", "absmax", "rms", "min_nonzero")
#: The FP8 format each direction would be cast to in the usual recipe: the ``fp8`` ranking's SNR.
FP8_RECIPE = {"fwd": "e4m3", "bwd": "e5m2"}


def _clean(v: float) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else v


def nearest_step(data: RunData, step: Optional[int]) -> Optional[int]:
    """The tracked step at or before ``step`` (the last one if None; the first if before all)."""
    if not data.steps:
        return None
    if step is None:
        return data.steps[-1]
    before = [s for s in data.steps if s <= step]
    return before[-1] if before else data.steps[0]


def profile(data: RunData, step: Optional[int]) -> Dict[str, Any]:
    """Every node at ``step`` in execution order with every logged statistic, forward and backward."""
    step = nearest_step(data, step)
    nodes = []
    for label in data.labels:
        row: Dict[str, Any] = {"label": label, "param": label in data.parameters, "group": module_group(label, label in data.parameters)}
        for d in DIRS:
            row[d] = {stat: _clean(data.value(stat, d, label, step)) for stat in data.values if step is not None}
            row[d] = {k: v for k, v in row[d].items() if v is not None}
        nodes.append(row)
    ratios = {p: _clean(s.get(step, math.nan)) for p, s in data.ratios.items()}
    return {"step": step, "steps": data.steps, "stats": sorted(data.values), "nodes": nodes, "ratios": ratios}


def heatmap(data: RunData, stat: str = "std") -> Dict[str, Any]:
    """``stat`` of every node (rows, execution order) at every tracked step (columns), both
    directions: log2 for the magnitudes of ``LOG2_STATS``, as logged for the others.

    Raises:
        ValueError: ``stat`` is not a statistic the run logged.
    """
    if stat != "std" and stat not in data.values:
        raise ValueError(f"`stat` must be one of the logged statistics {sorted(data.values)}, got {stat!r}")
    log = stat in LOG2_STATS
    out: Dict[str, Any] = {"labels": data.labels, "steps": data.steps, "params": sorted(data.parameters), "stat": stat, "log2": log, "stats": sorted(data.values)}
    for d in DIRS:
        out[d] = [[_clean(_scaled(data.value(stat, d, label, s), log)) for s in data.steps] for label in data.labels]
    return out


def _scaled(v: float, log: bool) -> float:
    return headroom.log2(v) if log else v


def series(data: RunData, label: str) -> Dict[str, Any]:
    """Every statistic of one node over the tracked steps: ``{"<stat>/<dir>": [value per step]}``."""
    out: Dict[str, List[Optional[float]]] = {}
    for stat in sorted(data.values):
        for d in DIRS:
            if label in data.values[stat].get(d, {}):
                out[f"{stat}/{d}"] = [_clean(data.value(stat, d, label, s)) for s in data.steps]
    return {"label": label, "steps": data.steps, "series": out}


def worst(data: RunData, step: Optional[int], by: str = "fp16", pattern: str = "", limit: int = 100) -> Dict[str, Any]:
    """Node directions ranked by headroom to format ``by`` (least first), by ``|drift|`` of log2 std
    since the first tracked step (``by="drift"``, largest first) or by the FP8 what-if's SNR
    (``by="fp8"``, lowest first: E4M3 forward, E5M2 backward, ``FP8_RECIPE``), filtered by
    regex ``pattern``.

    Raises:
        ValueError: ``by`` is not a format, ``"drift"`` or ``"fp8"`` (or ``"fp8"`` and the run
            logged no FP8 SNR), or ``pattern`` is not a regex.
    """
    if by not in RANKINGS:
        raise ValueError(f"`by` must be one of {list(RANKINGS)}, got {by!r}")
    if by == "fp8" and not any(f"fp8_{fmt}_snr_db" in data.values for fmt in FP8_RECIPE.values()):
        raise ValueError("`by=fp8` needs the FP8 what-if logged: ScaleMonitor(statistics=[..., 'fp8_e4m3_snr_db', 'fp8_e5m2_snr_db'])")
    try:
        match = re.compile(pattern).search
    except re.error as e:
        raise ValueError(f"`regex` is not a valid regular expression: {e}") from e
    step = nearest_step(data, step)
    first = data.steps[0] if data.steps else None
    fmt = by if by in FORMATS else "fp16"
    rows = []
    for label in data.labels:
        if not match(label):
            continue
        for d in DIRS:
            std = data.value("std", d, label, step) if step is not None else math.nan
            if math.isnan(std):
                continue
            absmax = data.value("absmax", d, label, step)
            room = headroom.headroom(std, absmax, fmt)
            drift = headroom.log2(std) - headroom.log2(data.value("std", d, label, first))
            fractions = {k: data.value(f"{k}_{fmt}", d, label, step) for k in ("underflow", "below_normal", "overflow")}
            fp8 = {f"fp8_{k}": data.value(f"fp8_{FP8_RECIPE[d]}_{k}", d, label, step) for k in ("snr_db", "flushed")}
            row = {"label": label, "dir": d, "param": label in data.parameters, "log2_std": headroom.log2(std), "log2_absmax": headroom.log2(absmax), **room}
            rows.append({**row, "drift": drift, "abs_drift": abs(drift), **fractions, "fp8_format": FP8_RECIPE[d], **fp8})
    ranked = _ranked(rows, by)
    clean = [{k: (_clean(v) if isinstance(v, float) else v) for k, v in r.items()} for r in ranked[:limit]]
    return {"step": step, "steps": data.steps, "by": by, "format": fmt, "total": len(rows), "rows": clean}


def _ranked(rows: List[Dict[str, Any]], by: str) -> List[Dict[str, Any]]:
    if by == "drift":
        return headroom.rank(rows, "abs_drift", descending=True)
    return headroom.rank(rows, "fp8_snr_db" if by == "fp8" else "headroom")


def code(data: RunData, step: Optional[int]) -> Dict[str, Any]:
    """The annotated code logged at ``step``: lines, each with its FP16 out-of-range flag (``!<``, ``!>`` or "")."""
    steps = sorted(data.code)
    if not steps:
        return {"steps": [], "step": None, "lines": []}
    step = max([s for s in steps if step is None or s <= step] or steps[:1])
    lines = []
    for line in data.code[step].split("\n"):
        text = line[4:] if line.startswith("    ") else line  # written as a markdown code block
        lines.append({"text": text, "flag": _flag(text)})
    return {"steps": steps, "step": step, "lines": lines}


_PAIR = re.compile(r"\(-> ([^,]+), <- ([^)]+)\)")


def _flag(text: str) -> str:
    """``!<`` if a std on the line is below FP16's smallest normal, ``!>`` above its max, else ""."""
    values = [float(v) for pair in _PAIR.findall(text) for v in pair if v != "n/a"]
    if any(0 < v < FORMATS["fp16"].min_normal for v in values):
        return "!<"
    return "!>" if any(v > FORMATS["fp16"].max for v in values) else ""
