"""The Compare view's tables, computed on the server from two runs' ``RunData`` (``compare``).

``profile``: both runs' values of one statistic per matched node at a pair of steps (log2
for the magnitudes, ``statistics.is_log2``), their difference, the node directions ranked
by it and the first divergence; ``heatmap``: the difference at every step both runs
tracked, in the shape of the Heatmap view's table; ``series``: one node's difference over
those steps. Missing values are None.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from lightning_scale.dashboard import headroom
from lightning_scale.dashboard.compare import THRESHOLD, Comparison, compare, delta, listed, matched
from lightning_scale.dashboard.data import DIRS, RunData
from lightning_scale.dashboard.layout import module_group
from lightning_scale.dashboard.compare import log2_stats

__all__ = ["heatmap", "profile", "series"]

_Names = Tuple[str, str]


def profile(
    a: RunData,
    b: RunData,
    step: Optional[int],
    stat: str = "std",
    names: _Names = ("A", "B"),
    threshold: float = THRESHOLD,
    limit: int = 100,
) -> Dict[str, Any]:
    """Run B against run A at ``step`` (None: the latest step both tracked, else A's latest;
    a step: each run's latest tracked step at or before it): every matched node in A's
    execution order with ``[A, B, B - A]`` of ``stat`` per direction, and the ``limit`` node
    directions with the largest ``|B - A|``.

    Raises:
        ValueError: the steps cannot be aligned, the runs share no node, or ``stat`` is not
            a statistic both runs logged.
    """
    common = sorted(set(a.steps) & set(b.steps))
    if step is None and not common and a.steps:
        step = a.steps[-1]
    cmp = compare(a, b, step=step, threshold=threshold, names=names)
    _check_stat(stat, cmp.stats)
    log = stat in cmp.log2
    k = cmp.stats.index(stat)
    shown_a, shown_b = (_log2(cmp.a[..., k]), _log2(cmp.b[..., k])) if log else (cmp.a[..., k], cmp.b[..., k])
    diff, parameters = cmp.diff(stat), set(cmp.parameters)
    diverges = (np.abs(np.nan_to_num(cmp.diff("std"))) > cmp.threshold).tolist()  # [nodes][2]
    cells = np.stack([shown_a, shown_b, diff], -1)  # [nodes, 2, 3]
    at = listed(cells, 4)
    nodes = []
    for i, label in enumerate(cmp.labels):
        row = {"label": label, "param": label in parameters, "group": module_group(label, label in parameters)}
        row["diverges"] = diverges[i]
        nodes.append({**row, **{name: at[i][d] for d, name in enumerate(DIRS)}})
    return {
        **_head(cmp, names),
        "steps": common or a.steps,
        "stat": stat,
        "log2": log,
        "nodes": nodes,
        **_ranked(cmp, cells, limit),
    }


def _head(cmp: Comparison, names: _Names) -> Dict[str, Any]:
    summary = cmp.summary()
    return {
        "run": names[0],
        "other": names[1],
        "step_a": cmp.step_a,
        "step_b": cmp.step_b,
        "how": cmp.how,
        "step": cmp.step_a,
        **{k: summary[k] for k in ("matched", "only_a", "only_b", "threshold", "first_divergence")},
        "stats": cmp.stats,
        "only_a_stats": cmp.only_a_stats,
        "only_b_stats": cmp.only_b_stats,
    }


def _ranked(cmp: Comparison, cells: np.ndarray, limit: int) -> Dict[str, Any]:
    """The node directions with a difference, largest ``|B - A|`` first (execution order on ties)."""
    where = [(i, d) for i in range(len(cmp.labels)) for d in range(2) if not np.isnan(cells[i, d, 2])]
    keys = np.array([-abs(cells[i, d, 2]) for i, d in where])
    div, std = cmp.first_divergence, np.abs(np.nan_to_num(cmp.diff("std")))
    rows = []
    for k in headroom.order(keys)[:limit]:
        i, d = where[k]
        a_value, b_value, difference = listed(cells[i, d], 4)
        rows.append(
            {
                "label": cmp.labels[i],
                "dir": DIRS[d],
                "a": a_value,
                "b": b_value,
                "difference": difference,
                "diverges": bool(std[i, d] > cmp.threshold),
                "first": div is not None and div.node == cmp.labels[i] and div.direction == DIRS[d],
            }
        )
    return {"ranked": rows, "total": len(where)}


def heatmap(a: RunData, b: RunData, stat: str = "std", names: _Names = ("A", "B")) -> Dict[str, Any]:
    """B minus A of ``stat`` (octaves for magnitudes) for every matched node (rows) at every
    step both runs tracked (columns), in the Heatmap view's shape, marked ``diverging``.

    Raises:
        ValueError: no step in common, no node in common, or ``stat`` not logged by both.
    """
    labels, steps, diff = _over_steps(a, b, stat, names)
    log = stat in log2_stats(a, b)
    parameters = a.parameters | b.parameters
    out: Dict[str, Any] = {
        "labels": labels,
        "groups": [module_group(label, label in parameters) for label in labels],
        "steps": steps,
        "params": sorted(p for p in parameters if p in set(labels)),
        "stat": _what(stat, log),
        "log2": False,
        "diverging": True,
        "limit": _limit(diff, log),
        "stats": sorted(set(a.stats) & set(b.stats)),
    }
    for d, name in enumerate(DIRS):
        out[name] = listed(diff[:, :, d].T, 4)  # [nodes][steps]
    return out


def series(a: RunData, b: RunData, label: str, stat: str = "std", names: _Names = ("A", "B")) -> Dict[str, Any]:
    """One node's B minus A of ``stat`` over the steps both runs tracked, and each run's
    value (log2 for magnitudes): ``{"<difference>/<dir>": [...], "A <stat>/<dir>": [...], ...}``."""
    labels, steps, diff = _over_steps(a, b, stat, names)
    out: Dict[str, Any] = {}
    if label in labels:
        log = stat in log2_stats(a, b)
        i, what = labels.index(label), _what(stat, log)
        for d, name in enumerate(DIRS):
            out[f"{what}/{name}"] = listed(diff[:, i, d], 4)
        for run, tag in ((a, "A"), (b, "B")):
            values = run.column(stat)[[run.steps.index(s) for s in steps], run.labels.index(label)]  # [steps, 2]
            for d, name in enumerate(DIRS):
                shown = _log2(values[:, d]) if log else values[:, d]
                out[f"{tag} {'log2 ' if log else ''}{stat}/{name}"] = listed(shown, 4)
    return {"label": label, "steps": steps, "series": out}


def _over_steps(a: RunData, b: RunData, stat: str, names: _Names) -> Tuple[List[str], List[int], np.ndarray]:
    """Matched labels, common steps and ``[steps, nodes, 2]`` of B minus A."""
    steps = sorted(set(a.steps) & set(b.steps))
    if not steps:
        raise ValueError(
            f"runs {names[0]} and {names[1]} tracked no step in common: the difference over steps needs steps both "
            "tracked"
        )
    labels = matched(a, b, names)
    _check_stat(stat, sorted(set(a.stats) & set(b.stats)))

    def values(run: RunData) -> np.ndarray:
        where = {label: i for i, label in enumerate(run.labels)}
        column = run.column(stat)[[run.steps.index(s) for s in steps]]  # [steps, nodes, 2]
        return column[:, [where[label] for label in labels]]

    return labels, steps, delta(values(a), values(b), stat in log2_stats(a, b))


def _limit(diff: np.ndarray, log: bool) -> float:
    """The colour scale's end: the largest finite ``|difference|``, at least ``THRESHOLD`` octaves
    for magnitudes (so rounding-level differences stay pale)."""
    finite = np.abs(diff[np.isfinite(diff)])
    largest = float(finite.max()) if finite.size else 0.0
    return max(largest, THRESHOLD) if log else (largest or 1.0)


def _check_stat(stat: str, both: List[str]) -> None:
    if stat not in both:
        raise ValueError(f"`stat` must be one of the statistics both runs logged {both}, got {stat!r}")


def _what(stat: str, log: bool) -> str:
    return f"Δ log2 {stat}" if log else f"Δ {stat}"


def _log2(values: np.ndarray) -> np.ndarray:
    """log2 where positive and finite, else NaN (nothing to draw)."""
    return headroom.log2_array(values)
