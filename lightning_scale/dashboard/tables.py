"""Per-step tables the dashboard's views draw: computed here, on the server, from ``RunData``.

Every function returns plain JSON-ready structures; missing values are ``None``. The
arithmetic runs on ``RunData.values`` (numpy), so a 2,000-node run answers in milliseconds.
"""

from __future__ import annotations

import math
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from lightning_scale.dashboard import headroom
from lightning_scale.dashboard.data import DIRS, RunData
from lightning_scale.dashboard.layout import module_group
from lightning_scale.dashboard.statistics import FP8_RECIPE, RANKINGS, is_log2, rankable, worse
from lightning_scale.record.stats import FORMATS

__all__ = [
    "code",
    "heatmap",
    "nearest_step",
    "outside",
    "profile",
    "series",
    "worst",
]


def _clean(v: Optional[float]) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else v


def _listed(a: np.ndarray, digits: Optional[int] = None) -> Any:
    """``a.tolist()`` with NaN and infinities as None (rounded to ``digits`` if given)."""
    a = np.asarray(a, dtype=np.float64)
    if digits is not None:
        a = np.round(a, digits)
    out = np.where(np.isfinite(a), a, np.nan).astype(object)
    out[~np.isfinite(a)] = None
    return out.tolist()


def _log2(a: np.ndarray) -> np.ndarray:
    """log2 where positive and finite, else NaN (``headroom.log2`` on arrays)."""
    ok = (a > 0) & np.isfinite(a)
    return np.where(ok, np.log2(np.where(ok, a, 1.0)), np.nan)


def rooms(std: np.ndarray, absmax: np.ndarray, fmt: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``headroom.headroom`` on arrays: (above min normal, below max, headroom), NaN where unknown."""
    f = FORMATS[fmt]
    log_std, top = _log2(std), _log2(absmax)
    top = np.where(np.isnan(top), log_std, top)
    under, over = log_std - math.log2(f.min_normal), math.log2(f.max) - top
    return under, over, np.minimum(under, over)  # NaN where either is


def outside(data: RunData, t: int) -> Dict[str, np.ndarray]:
    """``{format: [nodes, 2] bool}``: which node directions are outside each format's normal
    range at step index ``t`` (std below the smallest normal, or absmax above the max)."""
    std, absmax = data.column("std")[t], data.column("absmax")[t]
    out = {}
    for fmt in FORMATS:
        under, over, _ = rooms(std, absmax, fmt)
        out[fmt] = (under < 0) | (over < 0)
    return out


def nearest_step(data: RunData, step: Optional[int]) -> Optional[int]:
    """The tracked step at or before ``step`` (the last one if None; the first if before all)."""
    if not data.steps:
        return None
    if step is None:
        return data.steps[-1]
    before = [s for s in data.steps if s <= step]
    return before[-1] if before else data.steps[0]


def profile(data: RunData, step: Optional[int]) -> Dict[str, Any]:
    """Every node at ``step`` in execution order with every logged statistic, forward and
    backward, and the formats whose normal range each direction is outside of."""
    step = nearest_step(data, step)
    nodes = []
    if step is not None:
        t = data.steps.index(step)
        at = _listed(data.values[t])  # [nodes][2][stats]
        out = {fmt: flags.tolist() for fmt, flags in outside(data, t).items()}
    for i, label in enumerate(data.labels):
        param = label in data.parameters
        row: Dict[str, Any] = {"label": label, "param": param, "group": module_group(label, param)}
        if label in data.aliases:
            row["alias_of"] = data.aliases[label]
        for d, name in enumerate(DIRS):
            row[name] = {} if step is None else {stat: v for stat, v in zip(data.stats, at[i][d]) if v is not None}
            row[f"{name}_out"] = [] if step is None else [fmt for fmt in FORMATS if out[fmt][i][d]]
        nodes.append(row)
    ratios = {p: _clean(s.get(step, math.nan)) if step is not None else None for p, s in data.ratios.items()}
    return {"step": step, "steps": data.steps, "stats": sorted(data.stats), "nodes": nodes, "ratios": ratios}


def heatmap(data: RunData, stat: str = "std") -> Dict[str, Any]:
    """``stat`` of every node (rows, execution order) at every tracked step (columns), both
    directions: log2 for the magnitudes (``statistics.is_log2``: rounded to 4 decimals: the view
    shows 2), as logged for the others.

    Raises:
        ValueError: ``stat`` is not a statistic the run logged.
    """
    if stat != "std" and stat not in data.stats:
        raise ValueError(f"`stat` must be one of the logged statistics {sorted(data.stats)}, got {stat!r}")
    log = is_log2(stat, data.meta)
    column = data.column(stat)  # [steps, nodes, 2]
    shown = _log2(column) if log else column
    groups = [module_group(label, label in data.parameters) for label in data.labels]
    out: Dict[str, Any] = {
        "labels": data.labels,
        "groups": groups,
        "steps": data.steps,
        "params": sorted(data.parameters),
        "stat": stat,
        "log2": log,
        "stats": sorted(data.stats),
    }
    for d, name in enumerate(DIRS):
        out[name] = _listed(shown[:, :, d].T, 4 if log else None)  # [nodes][steps]
    return out


def series(data: RunData, label: str) -> Dict[str, Any]:
    """Every statistic of one node over the tracked steps: ``{"<stat>/<dir>": [value per step]}``."""
    out: Dict[str, Any] = {}
    if label in data.labels:
        i = data.labels.index(label)
        for stat in sorted(data.stats):
            for d, name in enumerate(DIRS):
                points = data.values[:, i, d, data.stats.index(stat)]
                if not np.isnan(points).all():
                    out[f"{stat}/{name}"] = _listed(points)
    return {"label": label, "steps": data.steps, "series": out}


def _fraction_hint(fmt: str) -> str:
    """What to log to get the per-format fraction columns."""
    return f"ScaleMonitor(statistics=[..., 'underflow_{fmt}', 'below_normal_{fmt}', 'overflow_{fmt}'])"


def worst(data: RunData, step: Optional[int], by: str = "fp16", pattern: str = "", limit: int = 100) -> Dict[str, Any]:
    """One row per tensor and direction, ranked by headroom to format ``by`` (least first), by
    ``|drift|`` of log2 std since the first tracked step (``by="drift"``, largest first) or by
    the FP8 what-if's SNR (``by="fp8"``, lowest first: E4M3 forward, E5M2 backward,
    ``FP8_RECIPE``) or by a logged statistic that declares which end is worse
    (``statistics.rankable``: ``by="kurtosis"``, a user statistic; its value in the row's
    ``value``), filtered by regex ``pattern`` (on the label or any of its aliases).
    ``rankable``: those statistics the run logged.

    A label that is an alias of another (``RunData.aliases``: a view, a module's output)
    is listed in its source's row. Each row also says at which tracked step the node first
    was outside the format's range and at how many of the tracked steps it was.

    Raises:
        ValueError: ``by`` is not a format, ``"drift"``, ``"fp8"`` or a statistic of
            those the run logged (or ``"fp8"`` and the run logged no FP8 SNR), or
            ``pattern`` is not a regex.
    """
    ranked = rankable(data.stats, data.meta)
    if by not in RANKINGS and by not in ranked:
        hint = f" (log it: ScaleMonitor(statistics=[..., {by!r}]))" if worse(by) else ""
        raise ValueError(f"`by` must be one of {[*RANKINGS, *ranked]}, got {by!r}{hint}")
    if by == "fp8" and not any(f"fp8_{fmt}_snr_db" in data.stats for fmt in FP8_RECIPE.values()):
        raise ValueError(
            "`by=fp8` needs the FP8 what-if logged: ScaleMonitor(statistics=[..., 'fp8_e4m3_snr_db', "
            "'fp8_e5m2_snr_db'])"
        )
    try:
        match = re.compile(pattern).search
    except re.error as e:
        raise ValueError(f"`regex` is not a valid regular expression: {e}") from e
    step = nearest_step(data, step)
    fmt = by if by in FORMATS else "fp16"
    fractions = [k for k in ("underflow", "below_normal", "overflow") if f"{k}_{fmt}" in data.stats]
    head = {
        "step": step,
        "steps": data.steps,
        "by": by,
        "format": fmt,
        "fractions": fractions,
        "fraction_hint": None if fractions else _fraction_hint(fmt),
        "rankable": ranked,
        "stat": by if by in ranked else None,
    }
    if step is None:
        return {**head, "total": 0, "rows": []}
    rows = _worst_rows(data, data.steps.index(step), fmt, fractions, match)
    if by in ranked:
        value, where = data.column(by)[data.steps.index(step)], {l: i for i, l in enumerate(data.labels)}
        for r in rows:
            r["value"] = float(value[where[r["label"]], DIRS.index(r["dir"])])
    order = _ranked(rows, by, worse(by, data.meta) if by in ranked else None)
    clean = [{k: (_clean(v) if isinstance(v, float) else v) for k, v in r.items()} for r in order[:limit]]
    return {**head, "total": len(rows), "rows": clean}


def _worst_rows(data: RunData, t: int, fmt: str, fractions: List[str], match: Any) -> List[Dict[str, Any]]:
    std, absmax = data.column("std"), data.column("absmax")  # [steps, nodes, 2]
    under, over, room = rooms(std, absmax, fmt)
    logged = ~np.isnan(room)
    out_at = logged & (room < 0)
    first = np.where(out_at.any(0), out_at.argmax(0), -1)  # [nodes, 2]: step index, -1: never
    log_std, log_absmax = _log2(std), _log2(absmax)
    also: Dict[str, List[str]] = {}
    for alias, source in data.aliases.items():
        if source in data.labels and alias in data.labels:
            also.setdefault(source, []).append(alias)
    at = {
        k: data.column(k)[t]
        for k in [f"{k}_{fmt}" for k in fractions]
        + [f"fp8_{f}_{k}" for f in FP8_RECIPE.values() for k in ("snr_db", "flushed")]
    }
    rows = []
    for i, label in enumerate(data.labels):
        if data.aliases.get(label) in also or not any(match(l) for l in [label, *also.get(label, [])]):
            continue
        for d, name in enumerate(DIRS):
            if math.isnan(std[t, i, d]):
                continue
            drift = log_std[t, i, d] - log_std[0, i, d]
            row: Dict[str, Any] = {
                "label": label,
                "aliases": also.get(label, []),
                "dir": name,
                "param": label in data.parameters,
            }
            row.update(
                log2_std=float(log_std[t, i, d]),
                log2_absmax=float(log_absmax[t, i, d]),
                under=float(under[t, i, d]),
                over=float(over[t, i, d]),
                headroom=float(room[t, i, d]),
            )
            row.update(
                drift=float(drift),
                abs_drift=float(abs(drift)),
                first_out=data.steps[first[i, d]] if first[i, d] >= 0 else None,
            )
            row.update(out_steps=int(out_at[:, i, d].sum()), tracked_steps=int(logged[:, i, d].sum()))
            row.update({k: float(at[f"{k}_{fmt}"][i, d]) for k in fractions})
            fp8 = FP8_RECIPE[name]
            row.update(
                fp8_format=fp8,
                fp8_snr_db=float(at[f"fp8_{fp8}_snr_db"][i, d]),
                fp8_flushed=float(at[f"fp8_{fp8}_flushed"][i, d]),
            )
            rows.append(row)
    return rows


def _ranked(rows: List[Dict[str, Any]], by: str, bad: Optional[str]) -> List[Dict[str, Any]]:
    if by == "drift":
        return headroom.rank(rows, "abs_drift", descending=True)
    if bad is not None:  # a statistic: its worse end first
        return headroom.rank(rows, "value", descending=bad == "high")
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
