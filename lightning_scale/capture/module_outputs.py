"""Module outputs as aliases: after each module's last node, the module's path names that node."""

from __future__ import annotations

import operator
from typing import Dict, List, Optional

from torch import fx

from lightning_scale.capture import frames
from lightning_scale.capture.dynamo import MODULE_KEY

__all__ = ["first_item", "with_module_outputs"]


def with_module_outputs(
    gm: fx.GraphModule,
    labels: Dict[str, str],
    aliases: Dict[str, str],
    passthrough: Optional[Dict[str, str]] = None,
    scope: str = "",
) -> Dict[str, str]:
    """``labels`` plus, after each module's last node, the module's path as an alias of
    that node (``fc1`` -> ``fc1/linear``): a layer's output is found by its name. A leaf
    with a tuple output (an LSTM's) is its first item; a module that returns its input
    (``nn.Identity``) is that input."""
    ends: Dict[str, List[str]] = {}
    outputs = [(None, str(n.target), first_item(n)) for n in gm.graph.nodes if n.op == "call_module"]
    outputs += [(None, path, node) for path, node in (passthrough or {}).items()]
    outputs += frames.module_outputs(gm, parse=lambda p: (None, p))
    for _, path, node in outputs:
        full = frames.strip_compiled(".".join(p for p in (scope, path) if p))
        source = labels.get(node)
        if source is None or not full or full in labels.values() or full in aliases:
            continue
        aliases[full] = aliases.get(source, source)
        ends.setdefault(node, []).append(full)
    out: Dict[str, str] = {}
    for name, label in labels.items():
        out[name] = label
        for full in ends.get(name, []):
            out[MODULE_KEY + full] = full
    return out


def first_item(node: fx.Node) -> str:
    """A leaf's output node, or the ``[0]`` item of it where the graph unpacks a tuple."""
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
            return user.name
    return node.name
