"""The Custom Scalars layout: one chart per node (forward and backward), grouped by module.

TensorBoard matches a layout entry's tags as regexes from the start of the tag, so each
tag is escaped and anchored (``add`` must not also draw ``add_1``), and only tags that
were written are listed. Nodes are grouped by module path (``model.blocks.0.attn/view`` ->
``model.blocks.0``) into categories of at most ``per_category`` charts, so no category
fires hundreds of requests at once.
"""

from __future__ import annotations

import re
from typing import Collection, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["custom_scalar_layout", "module_group"]


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


def _chunks(groups: Dict[str, List[str]], per_category: int) -> List[Tuple[str, List[str]]]:
    out: List[Tuple[str, List[str]]] = []
    for name, labels in groups.items():
        pieces = [labels[i : i + per_category] for i in range(0, len(labels), per_category)]
        for k, piece in enumerate(pieces):
            out.append((name if len(pieces) == 1 else f"{name} ({k + 1}/{len(pieces)})", piece))
    return out


def custom_scalar_layout(
    prefix: str, labels: Sequence[str], written: Mapping[str, Sequence[str]], stat: str = "scale_log2", per_category: int = 24, parameters: Optional[Collection[str]] = None
) -> Dict[str, Dict[str, list]]:
    """``{category: {chart title: ["Multiline", [anchored regex, ...]]}}`` for ``add_custom_scalars``.

    Args:
        prefix: tag prefix (``""`` or ``"val_"``).
        labels: nodes in execution order.
        written: ``{"fwd": labels with a forward tag, "bwd": ...}``; only those are charted.
        stat: the tag's statistic part (``scale_log2`` or ``scale``).
        per_category: most charts in one category.
        parameters: the labels that are parameters or buffers, if known (see ``module_group``).
    """
    sets = {d: set(v) for d, v in written.items()}
    groups: Dict[str, List[str]] = {}
    for label in labels:
        if any(label in s for s in sets.values()):
            groups.setdefault(module_group(label, None if parameters is None else label in parameters), []).append(label)
    out: Dict[str, Dict[str, list]] = {}
    for category, members in _chunks(groups, per_category):
        charts = {}
        for label in members:
            tags = [f"{prefix}{stat}/{d}/{label}" for d in ("fwd", "bwd") if label in sets.get(d, ())]
            charts[label] = ["Multiline", [f"^{re.escape(t)}$" for t in tags]]
        out[f"{prefix}{stat} · {category}"] = charts
    return out
