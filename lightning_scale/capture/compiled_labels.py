"""Labels of the graphs an instrumented compile hands over, resolved per calling module.

The compiled route labels its nodes as the uncompiled dynamo route does (``frames``): each
graph's node sites are found once, when the backend receives it; each call maps the
graph's frame locals to module paths in the captured module (by the parameters passed in,
then by the calling Python frame), so one graph compiled for ``blocks.0`` and run again for
``blocks.1`` records under each block's own paths. A module's output is its path (an alias
of its last node), and a view of a single-use tensor is an alias of its source.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, fx, nn

from lightning_scale.capture import breaks, frames
from lightning_scale.capture.labels import function_name, view_aliases

__all__ = ["MODULE_OUTPUT", "CompiledLabels", "graph_op", "own_output", "same_tensor"]

#: Key prefix of a module output in ``CompiledLabels.labels`` (no graph node of its own).
MODULE_OUTPUT = "<module>"


def graph_op(node: fx.Node) -> str:
    """The op part of a node's label: a method's or function's name (``linear``)."""
    if node.op == "call_method":
        return str(node.target)
    return function_name(node.target) or getattr(node.target, "__name__", str(node.target)).strip("_") or "op"


class CompiledLabels:
    """Node labels of dynamo graphs for the modules that run them, by call.

    Args:
        module: the captured module (labels are paths in it).
        graphs, labels, aliases: the lists and map to add to (a capture's own); new ones
            by default.

    Attributes:
        graphs: each graph that recorded something new, in the order first run.
        labels: per graph, node name (or ``MODULE_OUTPUT + path``) -> label, in graph order.
        aliases: label -> label with the same record (views, module outputs).
    """

    def __init__(
        self,
        module: nn.Module,
        graphs: Optional[List[fx.GraphModule]] = None,
        labels: Optional[List[Dict[str, str]]] = None,
        aliases: Optional[Dict[str, str]] = None,
    ) -> None:
        # (a capture passes its own lists: the compiled graphs' labels join its labels)
        self.module = module
        self.graphs: List[fx.GraphModule] = [] if graphs is None else graphs
        self.labels: List[Dict[str, str]] = [] if labels is None else labels
        self.aliases: Dict[str, str] = {} if aliases is None else aliases
        self._labeller = frames.Labeller()
        self._tables: Dict[Tuple[int, Tuple[str, ...]], Dict[str, str]] = {}
        self._paths = frames.module_paths(module)
        self._tensors: Dict[int, List[str]] = {}
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, t in named:
            self._tensors.setdefault(id(t), []).append(frames.strip_compiled(name))

    @property
    def tags(self) -> List[str]:
        """Every label, graph by graph, with each module's output right after its last node."""
        return [label for labels in self.labels for label in labels.values()]

    @property
    def node_labels(self) -> List[str]:
        """The labels of graph nodes (module outputs left out)."""
        return [v for labels in self.labels for k, v in labels.items() if not k.startswith(MODULE_OUTPUT)]

    @property
    def module_outputs(self) -> Set[str]:
        """The tags that name a module's output."""
        return {v for labels in self.labels for k, v in labels.items() if k.startswith(MODULE_OUTPUT)}

    def frame_graph(self, gm: fx.GraphModule) -> frames.FrameGraph:
        """The sites, module outputs and view aliases of a graph dynamo hands over (call this
        from the backend: whether the graph resumes after a graph break is read then)."""
        inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
        sites = frames.node_sites(gm, graph_op, resume=breaks.compiling_resume_frame())
        # inputs other than parameters and buffers were produced outside the graph, and are
        # recorded there (by the capture around the compiled module)
        sites = [s for s in sites if s.is_attr or s.name not in inputs]
        reason = getattr(gm, "compile_subgraph_reason", None)
        outputs = frames.module_outputs(gm, complete=not getattr(reason, "graph_break", True))
        same, stand_ins, shared = same_tensor(gm, {s.name for s in sites})
        views = {v: s for v, s in view_aliases(gm, {s.name: s.name for s in sites}).items() if s not in shared}
        # (the eager recorder logs such a node under its own label, a copy of its source's record)
        copies = {n: s for n, s in same.items() if s not in views}
        views.update({n: s for n, s in same.items() if s in views})
        own = own_output(gm, reason) + outputs
        code = breaks.code_key(breaks.compiling_code())
        return frames.FrameGraph(gm, sites, own, views, stand_ins, copies, code=code)

    def scope(self, graph: frames.FrameGraph, args: Tuple[Any, ...], depth: int = 1) -> Tuple[str, ...]:
        """(owner path, path per root local) of the modules running ``graph`` now, from the
        tensors in ``args`` and the user frame ``depth`` frames above the caller."""
        known = frames.anchored_roots(graph.anchors(), args, self._tensors)
        start = sys._getframe(depth + 1)
        caller = breaks.running_frame(start, graph.code) or frames.calling_frame(start)
        return frames.scope_of(caller, graph.roots(), self._paths, known)

    def table(self, graph: frames.FrameGraph, scope: Tuple[str, ...]) -> Dict[str, str]:
        """Recorded node -> label for ``graph`` run by ``scope``; new labels are registered."""
        key = (id(graph), scope)
        known = self._tables.get(key)
        if known is not None:
            return known
        table = frames.table_for(graph, scope, self._labeller)
        aliases = {table[v]: table[s] for v, s in graph.views.items() if v in table and s in table}
        listed = dict(table)
        replaced = set()
        for full, node in self._module_outputs(graph, scope):
            source = table.get(node)
            if source is None or not full:
                continue
            if self._leaf_output(full):  # the compiled module's own output: the graph names its tensor
                replaced.add(full)
            elif self._taken(full):
                continue
            aliases[full] = aliases.get(source, source)
            listed[MODULE_OUTPUT + full] = full
        new = {k: v for k, v in listed.items() if not any(v in t.values() for t in self.labels)}
        if new:
            self.graphs.append(graph.gm)
            self.labels.append(new)
        for alias, source in aliases.items():
            if alias in replaced:
                self.aliases[alias] = source
            self.aliases.setdefault(alias, source)
        observed = {k: v for k, v in table.items() if v not in self.aliases}
        self._tables[key] = observed
        return observed

    def _module_outputs(self, graph: frames.FrameGraph, scope: Tuple[str, ...]) -> List[Tuple[str, str]]:
        where = dict(zip(graph.roots(), scope[1:]))
        out = []
        for root, path, node in graph.outputs:
            base: Optional[str] = where.get(root, scope[0]) if root else scope[0]
            out.append((".".join(p for p in (base, path) if p), node))
        return out

    def _leaf_output(self, label: str) -> bool:
        """Whether the capture around the compiled module made ``label`` (its path) an alias of
        its leaf call (``model`` -> ``model/llamaforcausallm``), whose value may be no tensor
        (a model output object): the compiled graph's own output replaces it."""
        target = self.aliases.get(label, "")
        return target.startswith(label + "/") and "/" not in target[len(label) + 1 :] and target not in self._labeller

    def _taken(self, label: str) -> bool:
        return label in self._labeller or label in self.aliases or any(label in t.values() for t in self.labels)


def _mutates(node: fx.Node) -> bool:
    """An in-place op (``add_``, ``x += y``, ``relu(x, inplace=True)``): it returns its input,
    with other values."""
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place_operator = getattr(node.target, "__module__", "") in ("_operator", "operator") and name.startswith("i")
    return (name.endswith("_") and not name.endswith("__")) or bool(node.kwargs.get("inplace")) or in_place_operator


#: Dropout functions as dynamo's graphs call them: (position of ``p``, its default, of
#: ``training``, its default, of ``inplace``; None: not an argument of that function).
_DROPOUTS = {torch.nn.functional.dropout: (1, 0.5, 2, True, 3), torch.dropout: (1, None, 2, None, None)}


def returned_input(node: fx.Node) -> Optional[fx.Node]:
    """The input a node returns itself although dynamo's example value is a new tensor: a
    dropout with ``p`` 0 or not training, not in place (``nn.Dropout(0.0)``, a model's
    ``dropout=0.0`` config, any dropout in eval mode). ATen's ``dropout`` returns its input
    then, on every device, so the eager routes see the very same tensor. None for any other node."""
    if node.op != "call_function" or node.target not in _DROPOUTS:
        return None
    p_at, p_default, train_at, train_default, inplace_at = _DROPOUTS[node.target]
    names = ("input", "p", "training" if node.target is torch.nn.functional.dropout else "train", "inplace")

    def arg(i: Optional[int], default: Any) -> Any:
        if i is None:
            return default
        return node.args[i] if i < len(node.args) else node.kwargs.get(names[i], default)

    x = node.args[0] if node.args else node.kwargs.get("input")
    p, train, inplace = arg(p_at, p_default), arg(train_at, train_default), arg(inplace_at, False)
    if not isinstance(x, fx.Node) or inplace is not False or not isinstance(p, (int, float)) or isinstance(p, bool):
        return None
    return x if (p == 0 or train is False) else None


def same_tensor(gm: fx.GraphModule, labelled: Set[str]) -> Tuple[Dict[str, str], Dict[str, str], Set[str]]:
    """Nodes that return a tensor of the graph itself, unchanged (``.to()`` to its own dtype,
    ``.float()`` of a float, ``.contiguous()`` of a contiguous tensor: dynamo's example
    values are the very same object; a dropout that does nothing: ``returned_input``):
    (node -> labelled node with the same record, node ->
    graph input it stands in for, the nodes whose tensor has other uses as well: a view of
    them is no alias).

    Such a node's value and gradient are its source's, as the eager recorder takes them (one
    tensor, so its hooks see every use's gradient). Recording it apart would also change the
    training: a probe on it makes its uses' gradients add up apart from the source's other
    uses, in another order (float32 rounding). So it is an alias of its source; where the
    source is a graph input produced outside (not recorded in this graph), the first such
    node records the input itself under its own label (``stand_ins``), the others alias it.
    """
    first: Dict[int, fx.Node] = {}  # id(example value) -> the node that made it
    aliases: Dict[str, str] = {}
    stand_ins: Dict[str, str] = {}
    uses: Dict[int, int] = {}  # id(example value) -> its uses, identities left out
    for node in gm.graph.nodes:
        value = _run_time_value(node)
        if not isinstance(value, Tensor):
            continue
        uses[id(value)] = uses.get(id(value), 0) + len(node.users)
        source = first.setdefault(id(value), node)
        if source is node:
            continue
        uses[id(value)] -= 1
        if _mutates(node):  # (new values: the source of what follows)
            first[id(value)] = node
            continue
        if node.name not in labelled:
            continue
        if source.name in labelled:
            aliases[node.name] = aliases.get(source.name, source.name)
        elif source.op == "placeholder":
            first[id(value)] = node  # (the first stand-in; later nodes alias it)
            stand_ins[node.name] = source.name
    same = {*aliases, *stand_ins}
    value_of = {n.name: id(_run_time_value(n)) for n in gm.graph.nodes}
    return aliases, stand_ins, {n for n in same if uses[value_of[n]] > 1}


def _run_time_value(node: fx.Node) -> Any:
    """The tensor ``node`` returns at run time, by dynamo's example values: its own, or for a
    node that returns its input (``returned_input``) the input's."""
    own = node.meta.get("example_value")
    given = returned_input(node) if isinstance(own, Tensor) else None
    theirs = given.meta.get("example_value") if given is not None else None
    return theirs if isinstance(theirs, Tensor) else own


def own_output(gm: fx.GraphModule, reason: Any) -> List[Tuple[Optional[str], str, str]]:
    """The compiled module's own output (path ``""`` under the module running the graph), when
    the graph is the whole call (no graph break): the tensor it returns, or of several (a
    model's loss and logits) the last it computes, as the uncompiled dynamo route takes it."""
    if getattr(reason, "graph_break", True):
        return []
    returned = [a for a in gm.graph.output_node().args[0] if isinstance(a, fx.Node)]  # (dynamo: a tuple)
    computed = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    last = returned[0] if len(returned) == 1 else (computed[-1] if computed and computed[-1] in returned else None)
    return [(None, "", last.name)] if last is not None and isinstance(last.meta.get("example_value"), Tensor) else []
