"""The Custom Scalars layout: per block, one chart of its forward and one of its backward log2 stds.

TensorBoard's CUSTOM SCALARS tab stamps every chart of every open category at once
(~880 per-node charts took 99 s to draw the first; ~2,000 never drew), and colours a
chart's lines by run, so forward and backward lines of one run share a colour. So: one
category per block (``model.blocks.3``), holding a forward chart and a backward chart of
at most ``per_chart`` nodes each (a block with more gets more charts), and no layout at
all beyond ``max_charts`` charts (the SCALES dashboard shows every node at any size). The
writer writes every category but the first closed: TensorBoard stamps a category's
charts only when it is opened.

TensorBoard matches a layout entry's tags as regexes from the start of the tag, so each
tag is escaped and anchored (``add`` must not also draw ``add_1``), and only tags that
were written are listed.
"""

from __future__ import annotations

import re
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["MAX_CHARTS", "PER_CHART", "custom_scalar_layout", "module_group"]

#: The most charts a layout holds; beyond it none is written.
MAX_CHARTS = 256
#: The most nodes (lines) in one chart.
PER_CHART = 48

#: ``[(category title, [(chart title, [anchored tag regex, ...]), ...]), ...]``
Layout = List[Tuple[str, List[Tuple[str, List[str]]]]]


def module_group(label: str, parameter: Optional[bool] = None) -> str:
    """The block a node belongs to: its module path up to the first numeric part
    (``model.blocks.0.attn/view`` -> ``model.blocks.0``), else its first two parts;
    ``"(top)"`` for ops and inputs of the top module.

    Labels are ``<module path>/<op>``, a parameter's dotted name, a module's output (its
    dotted path), or a bare op or input name. ``parameter``: whether a label without ``/``
    is a parameter or buffer (its module is the path without the attribute) or a module's
    output (its module is the label); ``None``: not known, treated as a parameter.
    """
    if "/" in label:
        path = label.rsplit("/", 1)[0]
    elif parameter is False and "." in label:
        path = label
    else:
        path = label.rsplit(".", 1)[0] if "." in label else ""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2]) or "(top)"


def custom_scalar_layout(
    prefix: str,
    labels: Sequence[str],
    written: Mapping[str, Sequence[str]],
    stat: str = "scale_log2",
    per_chart: int = PER_CHART,
    max_charts: int = MAX_CHARTS,
    parameters: Optional[Collection[str]] = None,
) -> Layout:
    """One category per block, each with a forward and a backward chart of its written tags;
    ``[]`` when that would take more than ``max_charts`` charts.

    Args:
        prefix: tag prefix (``""`` or ``"val_"``).
        labels: nodes in execution order.
        written: ``{"fwd": labels with a forward tag, "bwd": ...}``; only those are charted.
        stat: the tag's statistic part (``scale_log2`` or ``scale``).
        per_chart: most nodes in one chart.
        max_charts: most charts in the layout.
        parameters: the labels that are parameters or buffers, if known (see ``module_group``).
    """
    sets = {d: set(v) for d, v in written.items()}
    groups: Dict[str, List[str]] = {}
    for label in labels:
        groups.setdefault(module_group(label, None if parameters is None else label in parameters), []).append(label)
    out: Layout = []
    for block, members in groups.items():
        charts = []
        for d, name in (("fwd", "forward"), ("bwd", "backward")):
            tags = [f"^{re.escape(f'{prefix}{stat}/{d}/{label}')}$" for label in members if label in sets.get(d, ())]
            pieces = [tags[i : i + per_chart] for i in range(0, len(tags), per_chart)]
            for k, piece in enumerate(pieces):
                charts.append((f"{block} · {name}" + (f" ({k + 1}/{len(pieces)})" if len(pieces) > 1 else ""), piece))
        if charts:
            out.append((f"{prefix}{stat} · {block}", charts))
    return out if sum(len(c) for _, c in out) <= max_charts else []
