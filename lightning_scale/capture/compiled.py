"""The compiled route: statistics compiled into the user's own compiled graphs.

For a module the user compiled (``torch.compile(model)``, ``model.compile()``, or
``torch.compile(block)`` per block), a tracked step runs a second compiled version of it,
compiled by the same backend with the same options. Its dynamo backend
(``InstrumentingBackend``) rewrites each graph dynamo hands over before it calls the user's
backend on it:

* after each recorded node, the node's statistics as graph ops (``packed_record``: the
  partial sums of its rows, the optional groups' fields and, with ``channels``, its channel
  row, packed); the packed vectors of all nodes are concatenated into one extra graph
  output, taken off before dynamo sees it, and finished into records and channel rows
  (``PackedLayout``, a few vectorised ops for the whole graph) after it ran; for a tensor
  on the CPU, one opaque op instead (``host_op.host_packed_record``: the host kernel's one
  read, the same layout with the whole tensor as one row; ``LIGHTNING_SCALE_COMPILED_STATS``);
* each recorded node that requires a gradient goes through ``Probe``, an identity whose
  backward returns the gradient unchanged and, as the gradient of a probe tensor passed
  in as one extra input (one per such node, fresh on every call), the gradient's packed
  statistics.

So the statistics compile, and fuse where the compiler can, with the model's own kernels;
nothing runs in Python per node. The gradients and outputs the model computes are the
ones the user's compiled version computes, bit for bit (the test checks it on a GPT).
A tracked run hands its rows to the active ``Recorder``: forward rows as they come, the
probes' gradients when the recorder is read, after backward. Labels are the uncompiled
dynamo route's (``compiled_labels``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn

from lightning_scale.capture import frames
from lightning_scale.capture.compiled_labels import CompiledLabels
from lightning_scale.capture.forward_swap import CompiledCallSwap, ForwardSwap
from lightning_scale.record import recorder as recording
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.record.stats import host_op
from lightning_scale.record.stats.host_op import host_packed_record, uses_host_op
from lightning_scale.record.stats.traceable import PackedLayout, packed_record, packed_size

__all__ = ["CompiledRoute", "InstrumentingBackend", "Probe", "UserCompile", "compiled_modules", "probe", "user_compile"]

_Optimized = torch._dynamo.eval_frame.OptimizedModule


@dataclass(frozen=True)
class UserCompile:
    """How the user compiled a module: the backend dynamo calls, and dynamo's options."""

    backend: Callable[..., Any]
    dynamic: Optional[bool]
    fullgraph: bool


def user_compile(module: nn.Module) -> Optional[UserCompile]:
    """The compile of ``module``: an ``OptimizedModule``'s, or ``module.compile()``'s in place;
    None for a module that is not compiled itself."""
    if isinstance(module, _Optimized):
        context = module.dynamo_ctx
    else:
        impl = module.__dict__.get("_compiled_call_impl")  # what ``nn.Module.compile`` sets
        if impl is None:
            return None
        context = inspect.getclosurevars(impl).nonlocals.get("self")
    callback = getattr(context, "callback", None)
    if callback is None:
        return None
    backend = torch._dynamo.eval_frame.innermost_backend(callback)
    return UserCompile(backend, getattr(backend, "dynamic", None), bool(getattr(context, "fullgraph", False)))


class Probe(torch.autograd.Function):
    """Identity on ``x``; backward: ``x``'s gradient unchanged, and its packed statistics
    (``packed_record``; with ``host``, ``host_packed_record``'s one-row form) as the gradient
    of ``probe`` (float64, ``packed_size`` elements). ``copy`` returns a copy of ``x``
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


def _statistics(host: bool) -> Callable[..., Tensor]:
    """The packed statistics of a node: the host op's one row, or the traceable ops' rows."""
    return host_packed_record if host else packed_record


@dataclass
class _Instrumented:
    """A rewritten graph, its recorded nodes (in row order), their element counts and
    whether each is recorded by the host op (one row), the nodes with a probe input
    (indices, in input order), and its outputs' container."""

    gm: fx.GraphModule
    names: List[str]
    numels: List[int]
    whole: List[bool]
    probed: List[int]
    output_type: Optional[type]  # tuple or list; None: a single output


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
) -> Optional[_Instrumented]:
    """A copy of ``gm`` with the packed statistics of each node of ``names`` (floating,
    nonempty), concatenated into one extra output, and ``Probe`` on each node with a
    gradient, its probe an extra input. A node of ``stand_ins`` (node -> the input it
    returns itself) is recorded at that input."""
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
    values = [_example(a, inputs) for a in at]
    probed = [i for i, v in enumerate(values) if v.requires_grad]
    whole = [uses_host_op(v.device) for v in values]  # (decided once, from the example value's device)
    probes, last = {}, placeholders[-1]
    for i in probed:
        with graph.inserting_after(last):
            probes[i] = last = graph.placeholder(f"statistics_probe_{i}")
    packed = [
        _instrument_node(graph, a, last, probes.get(i), (a in returned, whole[i]), groups) for i, a in enumerate(at)
    ]
    with graph.inserting_before(output):
        joined = graph.call_function(torch.cat, (packed,))
    output.args = ((*output.args[0], joined),)
    graph.lint()
    kind = type(result) if isinstance(result, (tuple, list)) else None
    numels = [v.numel() for v in values]
    return _Instrumented(fx.GraphModule(gm, graph), [n.name for n in nodes], numels, whole, probed, kind)


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


class InstrumentingBackend:
    """A dynamo backend: each graph gets its statistics as ops, then the user's backend.

    Args:
        route: the ``CompiledRoute`` whose labels and pending rows the calls feed.
        backend: the user's backend (``UserCompile.backend``; Inductor's by default).
    """

    def __init__(self, route: "CompiledRoute", backend: Callable[..., Any]) -> None:
        self._route = weakref.ref(route)  # dynamo keeps every backend for the life of the process
        self.backend = backend

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        route = self._route()
        if route is None:
            return self.backend(gm, example_inputs)
        try:
            return self._instrumented(route, gm, example_inputs)
        except Exception as err:  # noqa: BLE001 - never fail the step: the user's compile of the plain graph
            return _failing(self.backend(gm, example_inputs), err)

    def _instrumented(
        self, route: "CompiledRoute", gm: fx.GraphModule, example_inputs: List[Any]
    ) -> Callable[..., Any]:
        started = time.perf_counter()
        graph = route.labels.frame_graph(gm)
        names = [s.name for s in graph.sites if s.name not in graph.views and s.name not in graph.copies]
        rewritten = instrument_graph(gm, names, example_inputs, route.groups, graph.stand_ins)
        if rewritten is None:
            return self.backend(gm, example_inputs)
        device = next((t.device for t in example_inputs if isinstance(t, Tensor)), torch.device("cpu"))
        packing = _Packing(rewritten, route.groups, device)
        compiled = self.backend(rewritten.gm, [*example_inputs, *packing.probes()])
        route.compile_seconds += time.perf_counter() - started
        weak, kind = self._route, rewritten.output_type

        def run(*args: Any) -> Any:
            probes = packing.probes()
            out = compiled(*args, *probes)
            owner = weak()
            if owner is not None:
                owner.called(graph, packing, args, out[-1], probes)
            return kind(out[:-1]) if kind is not None else out[0]

        return run


class _Packing:
    """The packed statistics of an instrumented graph: fresh probe inputs for a call, and
    the layouts that finish the forward output and the probes' gradients into records."""

    def __init__(self, rewritten: _Instrumented, groups: Tuple[str, ...], device: torch.device) -> None:
        self.rewritten, self.groups, self.device = rewritten, groups, device
        self.layout = PackedLayout(rewritten.numels, groups, device, rewritten.whole)
        self._sizes = [packed_size(rewritten.numels[i], groups, rewritten.whole[i]) for i in rewritten.probed]
        self._layouts: Dict[Tuple[int, ...], Tuple[PackedLayout, Tensor]] = {}
        self._selections: Dict[int, Tuple[Dict[str, str], List[str], Tensor]] = {}

    def selection(self, graph: Any, table: Dict[str, str]) -> Tuple[List[str], Tensor]:
        """The labels of the rows that ``table`` (node -> label, the same object for the same
        graph and scope) keeps, and those rows' indices (on the device): worked out on the
        first call with ``table``, then reused."""
        known = self._selections.get(id(table))
        if known is not None and known[0] is table:
            return known[1], known[2]
        names = self.rewritten.names
        kept = [i for i, name in enumerate(names) if name in table]
        keys = [table[names[i]] for i in kept]
        row = {name: i for i, name in enumerate(names)}
        copies = [(n, row[s]) for n, s in graph.copies.items() if n in table and s in row and s in table]
        kept += [i for _, i in copies]  # (a node that returned a recorded tensor itself: its row again)
        keys += [table[n] for n, _ in copies]
        index = torch.tensor(kept, dtype=torch.long).to(self.device, non_blocking=True)
        self._selections[id(table)] = (table, keys, index)
        return keys, index

    def probes(self) -> List[Tensor]:
        """One zero probe per node with a gradient (requiring grad where grad mode is on)."""
        grad = torch.is_grad_enabled()
        return [torch.zeros(n, dtype=torch.float64, device=self.device).requires_grad_(grad) for n in self._sizes]

    def gradient_rows(self, probes: List[Tensor], index: Tensor, channels: bool = False) -> Optional[Tensor]:
        """The records (or, with ``channels``, the channel rows) of the probes' gradients, of
        the nodes at ``index``: zeros for a node whose gradient backward did not reach; None:
        it reached none."""
        reached = tuple(i for i, p in enumerate(probes) if p.grad is not None)
        if not reached:
            return None
        if reached not in self._layouts:
            nodes = [self.rewritten.probed[i] for i in reached]
            numels, whole = [self.rewritten.numels[i] for i in nodes], [self.rewritten.whole[i] for i in nodes]
            layout = PackedLayout(numels, self.groups, self.device, whole)
            self._layouts[reached] = layout, torch.tensor(nodes, dtype=torch.long).to(self.device, non_blocking=True)
        layout, nodes = self._layouts[reached]
        error = host_op.take_error()
        if error is not None:  # (the recorder keeps it as the step's error when it reads these rows)
            raise RuntimeError(f"statistics op failed in backward ({type(error).__name__}: {error})")
        packed = torch.cat([probes[i].grad for i in reached])
        rows = layout.channel_rows(packed) if channels else layout.records(packed)
        if rows is None:
            return None
        out = torch.zeros(len(self.rewritten.numels), rows.shape[1], dtype=torch.float64, device=self.device)
        out.index_copy_(0, nodes, rows)
        return out.index_select(0, index)


def _failing(compiled: Callable[..., Any], error: Exception) -> Callable[..., Any]:
    """``compiled`` (the graph as the user's backend compiles it), marking the step's recorder
    failed: the callback then logs nothing for the step and says why."""
    why = RuntimeError(f"compiled graph not instrumented ({type(error).__name__}: {error})")

    def run(*args: Any) -> Any:
        rec = recording.active()
        if rec is not None and rec.error is None:
            rec.error = why
        return compiled(*args)

    return run


def compiled_modules(root: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(path, module) of the outermost compiled submodules of ``root``:
    ``OptimizedModule``s and modules compiled in place (``module.compile()``)."""
    found: List[Tuple[str, nn.Module]] = []

    def walk(path: str, m: nn.Module) -> None:
        if path and user_compile(m) is not None:  # (a compiled root: not supported)
            found.append((frames.strip_compiled(path), m))
            return
        for name, child in m.named_children():
            walk(f"{path}.{name}" if path else name, child)

    walk("", root)
    return found


class CompiledRoute:
    """Statistics of the compiled modules in a captured module, compiled with them.

    ``forward_for(compiled)`` is the instrumented version of one compiled module (compiled
    on its first call, once, by the user's backend); ``swapped()`` runs each compiled module
    through its instrumented version for a while. Runs under ``recorder.recording(rec)``
    hand their rows to ``rec``: forward rows at once, gradient rows when ``rec`` is read.

    Args:
        module: the captured module (labels are paths in it).
        groups: statistic groups of each row (``Recorder.groups``: every group is traceable).
        labels: where the labels go (a capture's ``CompiledLabels``; new by default).
    """

    def __init__(
        self, module: nn.Module, groups: Sequence[str] = ("moments", "range"), labels: Optional[CompiledLabels] = None
    ) -> None:
        self.module = module
        self.groups = tuple(groups)
        self.labels = CompiledLabels(module) if labels is None else labels
        self.compile_seconds = 0.0  # spent compiling the instrumented graphs (the user's backend included)
        self.targets = compiled_modules(module)
        self._forwards: Dict[int, Callable[..., Any]] = {}
        self._backends: List[InstrumentingBackend] = []

    def forward_for(self, compiled: nn.Module) -> Callable[..., Any]:
        """The instrumented version of ``compiled`` (an ``OptimizedModule``, or a module
        compiled in place): same backend, options and signature as the user's call.

        Raises:
            ValueError: ``compiled`` is not compiled.
        """
        known = self._forwards.get(id(compiled))
        if known is not None:
            return known
        how = user_compile(compiled)
        if how is None:
            raise ValueError(
                f"`compiled` must be an OptimizedModule or compiled in place, got {type(compiled).__name__}"
            )
        backend = self._backend_for(how.backend)
        if isinstance(compiled, _Optimized):  # (a new wrapper of the same module: its hooks run as the user's)
            target: Any = compiled._orig_mod
        else:  # as ``nn.Module.compile`` does
            target = compiled._call_impl
        forward = torch.compile(target, backend=backend, dynamic=how.dynamic, fullgraph=how.fullgraph)
        self._forwards[id(compiled)] = forward
        return forward

    def _backend_for(self, user: Callable[..., Any]) -> "InstrumentingBackend":
        """One instrumenting backend per distinct user backend (Inductor's compare by their
        options): blocks compiled one by one share compiled graphs where dynamo's guards allow."""
        for known in self._backends:
            if known.backend == user:
                return known
        self._backends.append(InstrumentingBackend(self, user))
        return self._backends[-1]

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """Each compiled module runs its instrumented version in this block."""
        with ForwardSwap() as swap, CompiledCallSwap() as in_place:
            for _, m in self.targets:
                if isinstance(m, _Optimized):
                    swap.replace(m, self.forward_for(m))
                else:
                    in_place.replace(m, self.forward_for(m))
            yield

    def called(
        self, graph: Any, packing: "_Packing", args: Tuple[Any, ...], packed: Tensor, probes: List[Tensor]
    ) -> None:
        """A run of an instrumented graph: its records and channel rows (``packed``, finished)
        go to the active recorder, if any, and its probes' gradients' when the recorder is read."""
        rec = recording.active()
        error = host_op.take_error()
        if rec is None:
            return
        if error is not None and rec.error is None:  # (the step logs nothing and says why)
            rec.error = RuntimeError(f"statistics op failed ({type(error).__name__}: {error})")
        rows = packing.layout.records(packed)
        table = self.labels.table(graph, self.labels.scope(graph, args, depth=2))
        keys, index = packing.selection(graph, table)
        rec.add_rows(keys, FORWARD, rows.index_select(0, index))
        channels = packing.layout.channel_rows(packed) if rec.channels is not None else None
        slots = [rec.slot(key) for key in keys] if channels is not None else []
        if channels is not None:
            rec.channels.add_rows(slots, FORWARD, channels.index_select(0, index))
        if any(p.requires_grad for p in probes):
            rec.add_rows_later(keys, BACKWARD, functools.partial(packing.gradient_rows, probes, index))
            if channels is not None:
                later = functools.partial(packing.gradient_rows, probes, index, channels=True)
                rec.channels.add_rows_later(slots, BACKWARD, later)

    def describe(self) -> str:
        """``compiled=<paths>`` and the tracked version's compile time so far."""
        paths = ", ".join(p or "<root>" for p, _ in self.targets)
        return f"compiled modules: {paths} (tracked version compiled in {self.compile_seconds:.1f} s so far)"
