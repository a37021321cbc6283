"""GEMM sites: the graph nodes that may be a linear layer's GEMM, for the precision advisor.

``F.linear(x, w, b)`` (an ``nn.Linear``'s forward, traced through, or a bare call), and
``x @ w`` / ``torch.matmul`` / ``torch.mm`` / ``torch.addmm(b, x, w)`` (GPT-2's ``Conv1D``).
Whether ``w`` is a weight parameter is known only at run time (by identity,
``record.gemm_recorder``), so ``instrument`` (``interpreter.py``) adds an
``observe_gemm(out, x, w, how)`` call after every such node: on tracked steps without
``advise=True`` it returns at once.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from lightning_scale.record.gemm_recorder import observe_gemm

__all__ = ["add_gemm_observer", "gemm_operands"]

# target -> (position of x, position of w, how w is used)
_FUNCTIONS: Dict[Any, Tuple[int, int, str]] = {
    torch._C._nn.linear: (0, 1, "linear"),
    F.linear: (0, 1, "linear"),
    torch.matmul: (0, 1, "matmul"),
    operator.matmul: (0, 1, "matmul"),
    torch.mm: (0, 1, "matmul"),
    torch.addmm: (1, 2, "matmul"),
}
_METHODS: Dict[str, Tuple[int, int, str]] = {"matmul": (0, 1, "matmul"), "mm": (0, 1, "matmul")}


def gemm_operands(node: fx.Node) -> Optional[Tuple[Any, Any, str]]:
    """``(x, w, how)`` of a node that may be a linear layer's GEMM (``how``: ``"linear"``, ``w``
    is ``[N, K]``; ``"matmul"``, ``w`` is ``[K, N]``); None for any other node."""
    if node.op == "call_function":
        where = _FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        where = _METHODS.get(str(node.target))
    else:
        return None
    if where is None or len(node.args) <= where[1] or (node.target is torch.addmm and node.kwargs):
        return None  # (addmm with beta/alpha: not a plain GEMM plus bias)
    return node.args[where[0]], node.args[where[1]], where[2]


def add_gemm_observer(graph: fx.Graph, node: fx.Node, copy: fx.Node, env: Callable[[fx.Node], fx.Node]) -> None:
    """After ``copy`` (``node``'s copy in ``graph``, its arguments mapped by ``env``), an
    ``observe_gemm`` call if ``node`` may be a GEMM."""
    site = gemm_operands(node)
    if site is not None:
        x, w = fx.map_arg(site[:2], env)
        graph.call_function(observe_gemm, (copy, x, w, site[2]))
