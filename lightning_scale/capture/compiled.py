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
  (``PackedLayout``, a few vectorised ops for the whole graph) after it ran; in a graph whose
  tensors are all on the CPU, one opaque op instead (``host_op.host_record``: the host
  kernel's one read, the record itself; ``LIGHTNING_SCALE_COMPILED_STATS``);
* each recorded node that requires a gradient goes through ``Probe``, an identity whose
  backward returns the gradient unchanged and, as the gradient of a probe tensor passed
  in as one extra input (one per such node, fresh on every call), the gradient's packed
  statistics; with the host op, the graph's parameters are recorded by one call and go
  through one ``ProbeInputs`` together (the rewrite: ``instrument.instrument_graph``).

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
from lightning_scale.capture.instrument import Instrumented, instrument_graph
from lightning_scale.record import recorder as recording
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.record.settings import Settings
from lightning_scale.record.stats import host_op
from lightning_scale.record.stats.host_op import RecordLayout, record_size
from lightning_scale.record.stats.traceable import PackedLayout, packed_size

__all__ = [
    "CompiledRoute",
    "InstrumentingBackend",
    "UserCompile",
    "caught_gradients",
    "compiled_modules",
    "user_compile",
]

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


def _layout(numels: Sequence[int], groups: Tuple[str, ...], device: torch.device, host: bool) -> Any:
    """How the concatenated vectors of tensors of ``numels`` elements finish into records."""
    return RecordLayout(numels, groups) if host else PackedLayout(numels, groups, device)


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
        rewritten = instrument_graph(gm, names, example_inputs, route.groups, graph.stand_ins, route.compiled_stats)
        if rewritten is None:
            return self.backend(gm, example_inputs)
        device = next((t.device for t in example_inputs if isinstance(t, Tensor)), torch.device("cpu"))
        packing = Packing(rewritten, route.groups, device)
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


class Packing:
    """The packed statistics of an instrumented graph: fresh probe inputs for a call, and
    the layouts that finish the forward output and the probes' gradients into records."""

    def __init__(self, rewritten: Instrumented, groups: Tuple[str, ...], device: torch.device) -> None:
        self.rewritten, self.groups, self.device = rewritten, groups, device
        self.layout = _layout(rewritten.numels, groups, device, rewritten.host)
        width = record_size(groups)
        numels = [[rewritten.numels[i] for i in nodes] for nodes in rewritten.probed]
        self._sizes = [len(ns) * width if rewritten.host else packed_size(ns[0], groups) for ns in numels]
        self._layouts: Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], Tuple[Any, Tensor, bool]] = {}
        self._selections: Dict[int, Tuple[Dict[str, str], List[str], Tensor, Tuple[int, ...]]] = {}

    def selection(self, graph: Any, table: Dict[str, str]) -> Tuple[List[str], Tensor, Tuple[int, ...]]:
        """The labels of the rows that ``table`` (node -> label, the same object for the same
        graph and scope) keeps, and those rows' indices (on the device, and as a tuple):
        worked out on the first call with ``table``, then reused."""
        known = self._selections.get(id(table))
        if known is not None and known[0] is table:
            return known[1], known[2], known[3]
        names = self.rewritten.names
        kept = [i for i, name in enumerate(names) if name in table]
        keys = [table[names[i]] for i in kept]
        row = {name: i for i, name in enumerate(names)}
        copies = [(n, row[s]) for n, s in graph.copies.items() if n in table and s in row and s in table]
        kept += [i for _, i in copies]  # (a node that returned a recorded tensor itself: its row again)
        keys += [table[n] for n, _ in copies]
        index = torch.tensor(kept, dtype=torch.long).to(self.device, non_blocking=True)
        self._selections[id(table)] = (table, keys, index, tuple(kept))
        return keys, index, tuple(kept)

    def probes(self) -> List[Tensor]:
        """One zero probe per node with a gradient (requiring grad where grad mode is on)."""
        grad = torch.is_grad_enabled()
        return [torch.zeros(n, dtype=torch.float64, device=self.device).requires_grad_(grad) for n in self._sizes]

    def gradient_rows(
        self, grads: Sequence[Optional[Tensor]], kept: Tuple[int, ...], channels: bool = False
    ) -> Optional[Tensor]:
        """The records (or, with ``channels``, the channel rows) of the probes' gradients
        (``grads``, one per probe: None where backward did not reach it), of the nodes ``kept``
        (row indices, ``selection``'s): zeros for a node whose gradient backward did not
        reach; None: it reached none."""
        reached = tuple(i for i, g in enumerate(grads) if g is not None)
        if not reached:
            return None
        layout, take, complete = self._gradient_plan(reached, kept)
        error = host_op.take_error()
        if error is not None:  # (the recorder keeps it as the step's error when it reads these rows)
            raise RuntimeError(f"statistics op failed in backward ({type(error).__name__}: {error})")
        packed = torch.cat([grads[i] for i in reached])  # type: ignore[misc]
        rows = layout.channel_rows(packed) if channels else layout.records(packed)
        if rows is None:
            return None
        if not complete:  # (row 0: zeros, for the nodes backward did not reach)
            rows = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])
        return rows.index_select(0, take)

    def _gradient_plan(self, reached: Tuple[int, ...], kept: Tuple[int, ...]) -> Tuple[Any, Tensor, bool]:
        """(the layout of the reached probes' vectors, the index of each kept node's row in
        its rows, whether every kept node has one: else the index counts a row of zeros
        first), worked out once per reached probes and kept nodes."""
        known = self._layouts.get((reached, kept))
        if known is not None:
            return known
        nodes = [n for i in reached for n in self.rewritten.probed[i]]
        layout = _layout([self.rewritten.numels[i] for i in nodes], self.groups, self.device, self.rewritten.host)
        same = self.rewritten.gradient_of  # (a node without a probe: the row of the node with its gradient)
        row = {n: r for r, n in enumerate(nodes)}
        row.update({k: row[j] for k, j in same.items() if j in row})
        complete = all(k in row for k in kept)
        take = [row[k] for k in kept] if complete else [row[k] + 1 if k in row else 0 for k in kept]
        plan = layout, torch.tensor(take, dtype=torch.long).to(self.device, non_blocking=True), complete
        self._layouts[(reached, kept)] = plan
        return plan


def caught_gradients(probes: Sequence[Tensor]) -> List[Optional[Tensor]]:
    """The gradient each of ``probes`` receives in backward (None until it does), kept by a
    tensor hook: read without ``.grad``, so a backward that leaves ``.grad`` alone
    (``torch.autograd.grad``, a shadow pass's) delivers it too."""
    caught: List[Optional[Tensor]] = [None] * len(probes)

    def keep(i: int, grad: Tensor) -> None:
        previous = caught[i]
        caught[i] = grad if previous is None else previous + grad

    for i, p in enumerate(probes):
        p.register_hook(functools.partial(keep, i))
    return caught


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
        compiled_stats: ``Settings.compiled_stats``: which statistics ops the graphs take (None:
            as the environment says now: a route made outside ``capture``).
    """

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[str] = ("moments", "range"),
        labels: Optional[CompiledLabels] = None,
        compiled_stats: Optional[str] = None,
    ) -> None:
        self.module = module
        self.groups = tuple(groups)
        self.compiled_stats = Settings.from_env().compiled_stats if compiled_stats is None else compiled_stats
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
        self, graph: Any, packing: "Packing", args: Tuple[Any, ...], packed: Tensor, probes: List[Tensor]
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
        keys, index, kept = packing.selection(graph, table)
        rec.add_rows(keys, FORWARD, rows.index_select(0, index))
        channels = packing.layout.channel_rows(packed) if rec.channels is not None else None
        slots = [rec.slot(key) for key in keys] if channels is not None else []
        if channels is not None:
            rec.channels.add_rows(slots, FORWARD, channels.index_select(0, index))
        if any(p.requires_grad for p in probes):
            grads = caught_gradients(probes)
            rec.add_rows_later(keys, BACKWARD, functools.partial(packing.gradient_rows, grads, kept))
            if channels is not None:
                later = functools.partial(packing.gradient_rows, grads, kept, channels=True)
                rec.channels.add_rows_later(slots, BACKWARD, later)

    def describe(self) -> str:
        """``compiled=<paths>`` and the tracked version's compile time so far."""
        paths = ", ".join(p or "<root>" for p, _ in self.targets)
        return f"compiled modules: {paths} (tracked version compiled in {self.compile_seconds:.1f} s so far)"
