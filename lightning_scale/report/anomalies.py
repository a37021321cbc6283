"""Anomaly warnings: where NaN or a harmful Inf first appears, per node, from pooled records.

A NaN anywhere, or an Inf in a gradient or in the model's output, is an anomaly. A forward
Inf whose consumers stay finite is not: a causal mask filled with ``-inf`` feeds a softmax
that is finite again. Such an Inf is counted in the ``inf`` statistic but not warned.
Consumers come from the captured graphs (an fx node's ``users``, mapped to labels through
the capture's node-name -> label maps; the graph's ``output`` node marks the model's
outputs). Each node warns the first time an anomaly appears at it, in either direction,
so a later anomaly elsewhere is warned again. Everything here reads the pooled host copy:
no device entry is read.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from torch import Tensor, fx

from lightning_scale.capture import Capture
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD

__all__ = ["AnomalyWatch", "consumers_of"]

_OUTPUT = "\x00output"  # marks a node whose value leaves the captured module
_NAN, _INF = stats.FIELDS.index("nan"), stats.FIELDS.index("inf")


def consumers_of(cap: Capture) -> Dict[str, Set[str]]:
    """Label -> labels of the nodes that use its value (through unlabelled nodes such as
    tuple ``getitem``); ``_OUTPUT`` among them where the value is a graph output."""
    out: Dict[str, Set[str]] = {}
    for gm, names in zip(list(cap.graphs), list(cap.labels)):
        # A dynamo graph cut by a graph break hands its outputs to the code that resumes
        # after the break, whose own graphs judge them: they are not the model's output.
        reason = getattr(gm, "compile_subgraph_reason", None)
        cut = bool(getattr(reason, "graph_break", False))
        for node in gm.graph.nodes:
            label = names.get(node.name)
            if label is not None:
                users = _users(node, names, set())
                out.setdefault(label, set()).update(users - {_OUTPUT} if cut else users)
    return out


def _users(node: fx.Node, names: Dict[str, str], seen: Set[str]) -> Set[str]:
    found: Set[str] = set()
    for user in node.users:
        if user.op == "output":
            found.add(_OUTPUT)
        elif user.name in names:
            found.add(names[user.name])
        elif user.name not in seen:
            seen.add(user.name)
            found |= _users(user, names, seen)
    return found


class AnomalyWatch:
    """Remembers which nodes have warned and writes the warning for new ones.

    ``check`` returns the messages for one step (empty when nothing new), so the caller
    decides how to warn (on rank zero, through Lightning).
    """

    def __init__(self) -> None:
        self._warned: Set[Tuple[str, int]] = set()
        self._consumers: Dict[str, Set[str]] = {}
        self._graphs: Tuple[int, int] = (0, 0)  # (id of the capture, graph count) cached

    def check(self, cap: Capture, labels: Sequence[str], records: Tensor, step: int, prefix: str = "") -> List[str]:
        """Messages for anomalies that appear at a node for the first time at ``step``."""
        if not bool((records[..., [_NAN, _INF]] > 0).any()):
            return []
        nan = (records[..., _NAN] > 0).tolist()  # (n, 2)
        inf = (records[..., _INF] > 0).tolist()
        consumers = self._consumers_of(cap)
        index = {label: i for i, label in enumerate(labels)}
        # A module's output is its last op's tensor, recorded again under the module's path:
        # the op is the node that gets the warning.
        outputs = cap.module_outputs
        nodes = [i for i, label in enumerate(labels) if label not in outputs]
        messages = []
        for name, d in (("forward", FORWARD), ("backward", BACKWARD)):
            bad = [
                i
                for i in nodes
                if nan[i][d]
                or (inf[i][d] and (d == BACKWARD or not _benign(labels[i], consumers, index, nan, inf, {})))
            ]
            new = [i for i in bad if (labels[i], d) not in self._warned]
            self._warned.update((labels[i], d) for i in new)
            if new:
                messages.append(_message(name, d, new, labels, nan, step, prefix))
        return messages

    def _consumers_of(self, cap: Capture) -> Dict[str, Set[str]]:
        key = (id(cap), len(cap.graphs))
        if key != self._graphs:  # dynamo adds graphs as it compiles
            self._consumers, self._graphs = consumers_of(cap), key
        return self._consumers


def _benign(
    label: str,
    consumers: Dict[str, Set[str]],
    index: Dict[str, int],
    nan: List[List[bool]],
    inf: List[List[bool]],
    memo: Dict[str, bool],
) -> bool:
    """A forward Inf at ``label`` is benign when it never reaches the output and every
    consumer is finite or itself a benign Inf (nodes without a record are looked through)."""
    if label in memo:
        return memo[label]
    memo[label] = False  # graphs are acyclic; this only guards against label collisions
    ok = _OUTPUT not in consumers.get(label, ())
    for user in consumers.get(label, ()):
        if not ok:
            break
        j: Optional[int] = index.get(user)
        if j is not None and nan[j][FORWARD]:
            ok = False
        elif j is None or inf[j][FORWARD]:
            ok = _benign(user, consumers, index, nan, inf, memo)
    memo[label] = ok
    return ok


def _message(
    name: str, d: int, new: List[int], labels: Sequence[str], nan: List[List[bool]], step: int, prefix: str
) -> str:
    # Gradients flow from the last node to the first: the origin is the last in graph order.
    first = new[0] if d == FORWARD else new[-1]
    kind = "NaN" if nan[first][d] else "Inf"
    where = f"step {step}" + (" (validation)" if prefix else "")
    more = f"; also new at {len(new) - 1} more node(s)" if len(new) > 1 else ""
    return f"ScaleMonitor: {kind} in the {name} pass at {where}, first at `{labels[first]}`{more}"
