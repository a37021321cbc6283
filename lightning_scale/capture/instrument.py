"""A dynamo graph rewritten with its statistics as graph ops (the compiled route's graphs).

``instrument_graph`` copies a graph dynamo hands over and adds, after each recorded node,
its statistics (``traceable.packed_record``'s row sums, or in a graph whose tensors are all
on the CPU ``host_op.host_record``'s record, by one opaque op), concatenated into one extra
graph output; and, on each recorded node with a gradient, ``Probe``, an identity whose
backward returns the gradient unchanged and its statistics as the gradient of a probe tensor
passed in as an extra input. With the host op, the recorded graph inputs (the parameters)
are taken together (one ``host_records`` call and one ``ProbeInputs`` for all of them), and
the graph has one probe input, a slice of it per probe: the records of every gradient come
back as its one gradient, ready to read. The caller (``compiled.InstrumentingBackend``)
hands the rewritten graph to the user's backend.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, fx

from lightning_scale.capture.compiled_labels import returned_input
from lightning_scale.record.settings import Settings
from lightning_scale.record.stats.host_op import host_record, host_records, record_size, uses_host_op
from lightning_scale.record.stats.traceable import packed_record

__all__ = ["Instrumented", "Probe", "ProbeInputs", "instrument_graph", "probe", "probe_inputs"]


class Probe(torch.autograd.Function):
    """Identity on ``x``; backward: ``x``'s gradient unchanged, and its packed statistics
    (``packed_record``; with ``host``, ``host_record``) as the gradient of ``probe``
    (float64, ``packed_size`` or ``record_size`` elements). ``copy`` returns a copy of ``x``
    (for a graph output: an output that aliases an intermediate is rebuilt outside the
    compiled graph, and its gradient would bypass this backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, probe: Tensor, groups: Tuple[str, ...], copy: bool, host: bool) -> Tensor:
        ctx.groups, ctx.host = groups, host
        ctx.set_materialize_grads(False)  # (an unused output: no gradient, no record)
        return x.clone() if copy else x

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if grad is None:
            return None, None, None, None, None
        return grad, _statistics(ctx.host)(grad, ctx.groups), None, None, None


def probe(x: Tensor, probe: Tensor, groups: Tuple[str, ...], copy: bool, host: bool = False) -> Tensor:
    """``Probe.apply`` as a graph node's target (fx writes code that imports it by name)."""
    return Probe.apply(x, probe, groups, copy, host)


class ProbeInputs(torch.autograd.Function):
    """Identity on each of ``xs`` (graph inputs: the parameters); backward: their gradients
    unchanged, and their records (``host_records``, one call: zeros where a gradient is None)
    as the gradient of ``probe`` (float64, ``len(xs) * record_size`` elements). Its backward
    runs once every input's gradient is known: a graph's parameter gradients are its backward's
    outputs anyway, so taking them together keeps nothing alive longer."""

    @staticmethod
    def forward(ctx: Any, probe: Tensor, groups: Tuple[str, ...], *xs: Tensor) -> Tuple[Tensor, ...]:
        ctx.groups = groups
        ctx.set_materialize_grads(False)
        return xs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if all(g is None for g in grads):  # (backward reached none: no records)
            return (None, None, *grads)
        return (host_records(list(grads), ctx.groups), None, *grads)


def probe_inputs(probe: Tensor, groups: Tuple[str, ...], *xs: Tensor) -> Tuple[Tensor, ...]:
    """``ProbeInputs.apply`` as a graph node's target."""
    return ProbeInputs.apply(probe, groups, *xs)


def _statistics(host: bool) -> Callable[..., Tensor]:
    """The packed statistics of a node: the host op's record, or the traceable ops' rows."""
    return host_record if host else packed_record


@dataclass
class Instrumented:
    """A rewritten graph, its recorded nodes (in row order), their element counts, whether
    the host op records them (all on the CPU), the nodes of each probe input (indices, in
    input order: one node each, or the graph inputs taken together), its outputs' container,
    and the nodes without a probe whose gradient is another node's (``_same_gradients``)."""

    gm: fx.GraphModule
    names: List[str]
    numels: List[int]
    host: bool
    probed: List[List[int]]
    output_type: Optional[type]  # tuple or list; None: a single output
    gradient_of: Dict[int, int] = field(default_factory=dict)  # node -> node with the very same gradient


def _floating(value: Any) -> bool:
    return (
        isinstance(value, Tensor)
        and value.is_floating_point()
        and all(isinstance(s, int) and s > 0 for s in value.shape)  # (static, nonempty)
    )


def _example(node: fx.Node, inputs: Dict[str, Any]) -> Any:
    return inputs.get(node.name, node.meta.get("example_value"))


def instrument_graph(
    gm: fx.GraphModule,
    names: Sequence[str],
    example_inputs: Sequence[Any],
    groups: Tuple[str, ...],
    stand_ins: Optional[Dict[str, str]] = None,
    compiled_stats: Optional[str] = None,
) -> Optional[Instrumented]:
    """A copy of ``gm`` with the packed statistics of each node of ``names`` (floating,
    nonempty), concatenated into one extra output, and ``Probe`` on each node with a
    gradient, its probe an extra input. A node of ``stand_ins`` (node -> the input it
    returns itself) is recorded at that input. With the host op, the graph inputs recorded
    (parameters, stand-ins' inputs) come first, recorded by one call and probed by one
    ``ProbeInputs``: one op and one probe for all of them instead of one each."""
    graph = fx.Graph()
    copied: Dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(gm.graph, copied)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = {n.name: v for n, v in zip(placeholders, example_inputs)}
    wanted = set(names)
    nodes = [n for n in graph.nodes if n.name in wanted and _floating(_example(n, inputs))]
    if not nodes:
        return None
    returned = set(result) if isinstance(result, (tuple, list)) else {result}
    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    output = graph.output(outputs)  # (first: a probe replaces the node in it too)
    by_name = {n.name: n for n in placeholders}
    at = [n if n in returned else by_name.get((stand_ins or {}).get(n.name, ""), n) for n in nodes]
    choice = Settings.from_env().compiled_stats if compiled_stats is None else compiled_stats  # (None: a direct call)
    host = all(uses_host_op(_example(a, inputs).device, choice) for a in at)  # (decided once, from the examples)
    batch = _graph_inputs(at, returned) if host else []
    rest = set(range(len(at))) - set(batch)
    order = batch + sorted(rest)  # (rows: the graph inputs first)
    nodes, at = [nodes[i] for i in order], [at[i] for i in order]
    values = [_example(a, inputs) for a in at]
    same = _same_gradients(at, values, returned)
    together = [i for i in range(len(batch)) if values[i].requires_grad and i not in same]
    single = [
        [i] for i in range(len(batch), len(at)) if values[i].requires_grad and i not in same and not _mutated(at[i])
    ]
    probed = ([together] if together else []) + single
    probes, last = _probe_inputs(graph, placeholders[-1], probed, record_size(groups) if host else 0)
    if host and probed:
        probed = [[i for group in probed for i in group]]
    packed = []
    if batch:
        probe_input = probes.get(together[0]) if together else None
        ins = ([at[i] for i in range(len(batch))], [at[i] for i in together])
        packed.append(_instrument_inputs(graph, ins, last, probe_input, groups))
    for i in range(len(batch), len(at)):
        packed.append(_instrument_node(graph, at[i], last, probes.get(i), (at[i] in returned, host), groups))
    with graph.inserting_before(output):
        joined = graph.call_function(torch.cat, (packed,))
    output.args = ((*output.args[0], joined),)
    graph.lint()
    kind = type(result) if isinstance(result, (tuple, list)) else None
    numels = [v.numel() for v in values]
    return Instrumented(fx.GraphModule(gm, graph), [n.name for n in nodes], numels, host, probed, kind, same)


def _same_gradients(at: List[fx.Node], values: List[Any], returned: Set[fx.Node]) -> Dict[int, int]:
    """Recorded nodes whose gradient is another recorded node's, the very same tensor: an
    input of an add (``a + b``, no ``alpha``) used by that add alone (or through dropouts
    that do nothing, ``returned_input``), of the add's shape and dtype, as the residual
    branch of a transformer block is. The add hands its output's gradient to it unchanged,
    so it takes that gradient's record (the eager recorder sees one gradient tensor there
    and reuses its record) instead of a probe and a second read. Indices into ``at``."""
    index = {a: i for i, a in enumerate(at)}
    found: Dict[int, int] = {}
    for i, n in enumerate(at):
        if not _plain_add(n) or not values[i].requires_grad:
            continue
        for a in n.args:
            src = a
            while isinstance(src, fx.Node) and src not in index and len(src.users) == 1 and src not in returned:
                src = returned_input(src)  # (None where it is no pass-through)
            j = index.get(src) if isinstance(src, fx.Node) else None
            chain_ok = j is not None and n.args.count(a) == 1 and len(src.users) == 1 and src not in returned
            if chain_ok and values[j].shape == values[i].shape and values[j].dtype == values[i].dtype:
                found[j] = i
    for j in list(found):  # (an add's output that is itself such an input: to the end of the chain)
        while found[j] in found:
            found[j] = found[found[j]]
    return found


_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ipow}


def _mutated(n: fx.Node) -> bool:
    """Whether a user of ``n`` changes it in place (``x += y``, ``x.mul_(2)``): ``Probe``'s
    output is a view of ``n``, which autograd refuses to change in place (Falcon's
    ``mlp_output += attention_output``), so such a node has no probe and no gradient record."""
    for user in n.users:
        if user.args[:1] != (n,):
            continue
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        if user.target in _IN_PLACE or (name.endswith("_") and not name.startswith("_")):
            return True
    return False


def _plain_add(n: fx.Node) -> bool:
    """``a + b`` of two tensors, not in place, no ``alpha``."""
    function = n.op == "call_function" and n.target in (operator.add, torch.add)
    return (function or (n.op == "call_method" and n.target == "add")) and len(n.args) == 2 and not n.kwargs


def _probe_inputs(
    graph: fx.Graph, last: fx.Node, probed: List[List[int]], width: int
) -> Tuple[Dict[int, fx.Node], fx.Node]:
    """The probe input of each group of ``probed`` nodes (by its first node), inserted after
    ``last``, and the last node inserted: a placeholder per group; with the host op (its
    records ``width`` elements each) one placeholder for all, and a slice of it per group
    (one probe tensor a call, one gradient: no probe tensor, autograd leaf and gradient
    accumulation per node)."""
    probes: Dict[int, fx.Node] = {}
    if not width:
        for k, group in enumerate(probed):
            with graph.inserting_after(last):
                probes[group[0]] = last = graph.placeholder(f"statistics_probe_{k}")
        return probes, last
    if not probed:
        return probes, last
    with graph.inserting_after(last):
        whole = last = graph.placeholder("statistics_probe")
    start = 0
    for group in probed:
        end = start + len(group) * width
        with graph.inserting_after(last):
            probes[group[0]] = last = graph.call_function(operator.getitem, (whole, slice(start, end)))
        start = end
    return probes, last


def _graph_inputs(at: List[fx.Node], returned: Set[fx.Node]) -> List[int]:
    """The positions of the graph inputs ``at`` records (each once; none the graph returns),
    where there are two or more of them: they are recorded and probed together."""
    seen: Set[fx.Node] = set()
    found = []
    for i, a in enumerate(at):
        if a.op == "placeholder" and a not in returned and a not in seen:
            seen.add(a)
            found.append(i)
    return found if len(found) > 1 else []


def _instrument_inputs(
    graph: fx.Graph,
    inputs: Tuple[List[fx.Node], List[fx.Node]],
    last: fx.Node,
    probe_input: Optional[fx.Node],
    groups: Tuple[str, ...],
) -> fx.Node:
    """Insert the records of graph inputs (``inputs``: all of them, those with a gradient) by
    one ``host_records`` call (returned) and, with a probe input, one ``ProbeInputs`` on those
    with a gradient, whose items replace them everywhere else."""
    every, grads = inputs
    with graph.inserting_after(last):
        packed = graph.call_function(host_records, (every,), {"groups": groups})
    if probe_input is None:
        return packed
    with graph.inserting_after(packed):
        through = graph.call_function(probe_inputs, (probe_input, groups, *grads))
    after = through
    for k, x in enumerate(grads):
        with graph.inserting_after(after):
            after = item = graph.call_function(operator.getitem, (through, k))
        x.replace_all_uses_with(item, delete_user_cb=lambda user: user not in (packed, through))
    return packed


def _instrument_node(
    graph: fx.Graph,
    node: fx.Node,
    last: fx.Node,
    probe_input: Optional[fx.Node],
    how: Tuple[bool, bool],
    groups: Tuple[str, ...],
) -> fx.Node:
    """Insert ``node``'s packed statistics (returned) and, with a probe input, its ``Probe``;
    ``how``: (whether the graph returns ``node``, whether the host op records it)."""
    returned, host = how
    anchor = last if node.op == "placeholder" else node
    with graph.inserting_after(anchor):
        packed = graph.call_function(_statistics(host), (node,), {"groups": groups})
    if probe_input is not None:
        with graph.inserting_after(packed):
            through = graph.call_function(probe, (node, probe_input, groups, returned, host))
        node.replace_all_uses_with(through, delete_user_cb=lambda user: user not in (packed, through))
    return packed
