"""The compiled route: statistics compiled into the user's own compiled graphs.

For a module the user compiled (``torch.compile(model)``, ``model.compile()``, or
``torch.compile(block)`` per block), a tracked step runs a second compiled version of it,
compiled by the same backend with the same options. Its dynamo backend
(``InstrumentingBackend``) rewrites each graph dynamo hands over before it calls the user's
backend on it:

* after each recorded node, the node's row as graph ops (``traceable_row``: its record and,
  with the ``channels`` group, its channel row); the rows of all nodes are stacked into one
  extra graph output, taken off before dynamo sees it;
* each recorded node that requires a gradient goes through ``Probe``, an identity whose
  backward returns the gradient unchanged and, as the gradient of a row of a probe tensor
  passed in as one extra input (fresh on every call), the gradient's row.

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
import operator
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx, nn

from lightning_scale.capture import frames
from lightning_scale.capture.compiled_labels import CompiledLabels
from lightning_scale.capture.forward_swap import ForwardSwap
from lightning_scale.record import recorder as recording
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.record.stats.traceable_channels import row_width, split_row, traceable_row

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
    """Identity on ``x``; backward: ``x``'s gradient unchanged, and its row (``traceable_row``)
    as the gradient of ``probe`` (a ``[row_width(groups)]`` row). ``copy`` returns a copy of ``x``
    (for a graph output: an output that aliases an intermediate is rebuilt outside the
    compiled graph, and its gradient would bypass this backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, probe: Tensor, groups: Tuple[str, ...], copy: bool) -> Tensor:
        ctx.groups = groups
        ctx.set_materialize_grads(False)  # (an unused output: no gradient, no record)
        return x.clone() if copy else x

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        if grad is None:
            return None, None, None, None
        return grad, traceable_row(grad, ctx.groups), None, None


def probe(x: Tensor, probe: Tensor, groups: Tuple[str, ...], copy: bool) -> Tensor:
    """``Probe.apply`` as a graph node's target (fx writes code that imports it by name)."""
    return Probe.apply(x, probe, groups, copy)


@dataclass
class _Instrumented:
    """A rewritten graph, its recorded nodes (in row order), and its outputs' container."""

    gm: fx.GraphModule
    names: List[str]
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
    """A copy of ``gm`` with a record row after each node of ``names`` (floating, nonempty)
    stacked into one extra output, a probe input, and ``Probe`` on each node with a gradient.
    A node of ``stand_ins`` (node -> the input it returns itself) is recorded at that input."""
    graph = fx.Graph()
    copied: Dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(gm.graph, copied)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = {n.name: v for n, v in zip(placeholders, example_inputs)}
    wanted = set(names)
    nodes = [n for n in graph.nodes if n.name in wanted and _floating(_example(n, inputs))]
    if not nodes:
        return None
    with graph.inserting_after(placeholders[-1]):
        probes = graph.placeholder("statistics_probes")
    returned = set(result) if isinstance(result, (tuple, list)) else {result}
    outputs = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    output = graph.output(outputs)  # (first: a probe replaces the node in it too)
    by_name = {n.name: n for n in placeholders}
    at = [n if n in returned else by_name.get((stand_ins or {}).get(n.name, ""), n) for n in nodes]
    rows = [_instrument_node(graph, a, i, probes, _example(a, inputs), a in returned, groups) for i, a in enumerate(at)]
    with graph.inserting_before(output):
        stacked = graph.call_function(torch.stack, (rows,))
    output.args = ((*output.args[0], stacked),)
    graph.lint()
    kind = type(result) if isinstance(result, (tuple, list)) else None
    return _Instrumented(fx.GraphModule(gm, graph), [n.name for n in nodes], kind)


def _instrument_node(
    graph: fx.Graph, node: fx.Node, i: int, probes: fx.Node, value: Tensor, returned: bool, groups: Tuple[str, ...]
) -> fx.Node:
    """Insert ``node``'s forward row (returned) and, if it has a gradient, its ``Probe``."""
    anchor = probes if node.op == "placeholder" else node
    with graph.inserting_after(anchor):
        row = graph.call_function(traceable_row, (node,), {"groups": groups})
    if value.requires_grad:
        with graph.inserting_after(row):
            row_probe = graph.call_function(operator.getitem, (probes, i))
        with graph.inserting_after(row_probe):
            through = graph.call_function(probe, (node, row_probe, groups, returned))
        node.replace_all_uses_with(through, delete_user_cb=lambda user: user not in (row, through))
    return row


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
        rows = len(rewritten.names)
        device = next((t.device for t in example_inputs if isinstance(t, Tensor)), torch.device("cpu"))

        def probes() -> Tensor:
            empty = torch.zeros(rows, row_width(route.groups), dtype=torch.float64, device=device)
            return empty.requires_grad_(torch.is_grad_enabled())

        compiled = self.backend(rewritten.gm, [*example_inputs, probes()])
        route.compile_seconds += time.perf_counter() - started
        weak, kind = self._route, rewritten.output_type

        def run(*args: Any) -> Any:
            probe = probes()
            out = compiled(*args, probe)
            owner = weak()
            if owner is not None:
                owner.called(graph, rewritten.names, args, out[-1], probe)
            return kind(out[:-1]) if kind is not None else out[0]

        return run


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
        with ForwardSwap() as swap, _CompiledCallSwap() as in_place:
            for _, m in self.targets:
                if isinstance(m, _Optimized):
                    swap.replace(m, self.forward_for(m))
                else:
                    in_place.replace(m, self.forward_for(m))
            yield

    def called(self, graph: Any, names: List[str], args: Tuple[Any, ...], rows: Tensor, probe: Tensor) -> None:
        """A run of an instrumented graph: its rows go to the active recorder, if any."""
        rec = recording.active()
        if rec is None:
            return
        table = self.labels.table(graph, self.labels.scope(graph, args, depth=2))
        kept = [i for i, name in enumerate(names) if name in table]
        keys = [table[names[i]] for i in kept]
        row = {name: i for i, name in enumerate(names)}
        copies = [(n, row[s]) for n, s in graph.copies.items() if n in table and s in row and s in table]
        kept += [i for _, i in copies]  # (a node that returned a recorded tensor itself: its row again)
        keys += [table[n] for n, _ in copies]
        index = torch.tensor(kept, dtype=torch.long).to(rows.device, non_blocking=True)
        records, channels = split_row(rows.index_select(0, index))
        rec.add_rows(keys, FORWARD, records)
        slots = [rec.slot(key) for key in keys]
        if channels is not None and rec.channels is not None:
            rec.channels.add_rows(slots, FORWARD, channels)
        if probe.requires_grad:
            rec.add_rows_later(keys, BACKWARD, functools.partial(_gradient_rows, probe, index, 0))
            if channels is not None and rec.channels is not None:
                rec.channels.add_rows_later(slots, BACKWARD, functools.partial(_gradient_rows, probe, index, 1))

    def describe(self) -> str:
        """``compiled=<paths>`` and the tracked version's compile time so far."""
        paths = ", ".join(p or "<root>" for p, _ in self.targets)
        return f"compiled modules: {paths} (tracked version compiled in {self.compile_seconds:.1f} s so far)"


def _gradient_rows(probe: Tensor, index: Tensor, part: int) -> Optional[Tensor]:
    """The probe's gradient: its nodes' gradient records (``part`` 0) or channel rows (1)
    (None: no backward reached them)."""
    return None if probe.grad is None else split_row(probe.grad.index_select(0, index))[part]


class _CompiledCallSwap:
    """Swaps what ``module.compile()`` installed (the compiled ``_call_impl`` that
    ``nn.Module.__call__`` runs) for a while, and puts the user's back: the same entry
    of ``module.__dict__``, as ``ForwardSwap`` does for ``forward``."""

    _KEY = "_compiled_call_impl"

    def __init__(self) -> None:
        self._saved: List[Tuple[nn.Module, Any]] = []

    def replace(self, module: nn.Module, call: Callable[..., Any]) -> None:
        self._saved.append((module, module.__dict__[self._KEY]))
        module.__dict__[self._KEY] = call

    def __enter__(self) -> "_CompiledCallSwap":
        return self

    def __exit__(self, *exc: object) -> None:
        for module, call in reversed(self._saved):
            module.__dict__[self._KEY] = call
        self._saved.clear()
