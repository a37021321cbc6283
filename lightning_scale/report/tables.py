"""Text tables of a tracked step: the nodes nearest a format's edges (``scale_worst``).

The columns, their signs and the ranking are the dashboard's Worst-nodes view's
(``dashboard.headroom``: ``rooms`` and ``order``), so the two list the same rows.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from lightning_scale.dashboard import headroom
from lightning_scale.report.scalars import DIRECTIONS
from lightning_scale.report.values import StepValues

__all__ = ["WORST_COLUMNS", "worst_table"]

#: The columns the ``scale_worst`` table and the dashboard's Worst-nodes view share.
WORST_COLUMNS = ("log2 std", "log2 absmax", "above min normal", "below max", "headroom")


def worst_table(
    labels: Sequence[str], values: StepValues, k: int = 10, fmt: str = "fp16", aliases: Optional[Dict[str, str]] = None
) -> str:
    """Markdown table of the ``k`` node directions with the least headroom to ``fmt``'s edges.

    The columns and their signs are the Worst-nodes view's (``headroom.headroom``):
    octaves inside the range are positive, outside negative. A label in ``aliases``
    (``{alias: source}``: the same tensor) is listed in its source's row, not ranked again.
    """
    aliases = aliases or {}
    # rows: every forward node, then every backward node
    std = values("std").T.reshape(-1).numpy()
    absmax = values("absmax").T.reshape(-1).numpy()
    present = values.present.T.reshape(-1).numpy()
    if aliases:
        present = present & np.tile([label not in aliases for label in labels], 2)
    ranked = headroom.order(headroom.rooms(std, absmax, fmt)[2])
    top = ranked[present[ranked]][:k].tolist()
    same: Dict[str, List[str]] = {}
    for alias, source in aliases.items():
        same.setdefault(source, []).append(alias)
    lines = [
        f"Nodes nearest the {fmt} range edges (octaves inside the range; negative = outside)",
        "",
        f"| # | node | dir | {' | '.join(WORST_COLUMNS)} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, j in enumerate(top, 1):
        label, tag = labels[j % len(labels)], DIRECTIONS[j // len(labels)][0]
        s, a = float(std[j]), float(absmax[j])
        r = headroom.headroom(s, a, fmt)
        also = f" (= {', '.join(f'`{x}`' for x in same[label])})" if label in same else ""
        numbers = [headroom.log2(s), headroom.log2(a), r["under"], r["over"], r["headroom"]]
        lines.append(f"| {n} | `{label}`{also} | {tag} | " + " | ".join(f"{v:.2f}" for v in numbers) + " |")
    return "\n".join(lines)
