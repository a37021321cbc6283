"""The TorchDynamo side of a capture: the backend that instruments each graph, and the
tracked forward that runs the model through it.

Each graph dynamo hands over is instrumented once, with node names as keys; every call
resolves them to full labels for the module instances that run it (``frames``). On a
tracked call, compiled submodules (``OptimizedModule``) are opaque to this compile: they
run their own compiled code and are recorded at their output under their path. Graph
breaks inside library code resume inside it (``nested_graph_breaks``) instead of running
the rest of the call unrecorded; numpy runs eagerly, as in the user's forward; hooks a
forward registers are registered eagerly.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

import torch
from torch import fx, nn

from lightning_scale.capture import breaks, eager, float8, frames
from lightning_scale.capture.compiled_labels import own_output
from lightning_scale.capture.forward_swap import ForwardSwap
from lightning_scale.capture.interpreter import instrument
from lightning_scale.capture.labels import function_name, view_aliases
from lightning_scale.capture.tensor_parallel import TensorParallelGraph, new_forward, parallel_mesh
from lightning_scale.record import recorder

# The backend reads and extends the state of a ``graphs.Capture`` (which imports this
# module): typed as ``Any`` here so that imports go one way.
Capture = Any

__all__ = ["WeakBackend", "opaque_compiled", "opaque_module_paths", "tracked_forward"]

# nested_graph_breaks: a graph break inside library code resumes inside it instead of
# running the rest of the call unrecorded. trace_numpy off: dynamo would turn numpy calls
# into torch ops, drawing random numbers from torch's generator instead of numpy's
# (Wav2Vec2's SpecAugment masks differ); off, numpy runs eagerly, as in the user's forward.
# allow_rnn: without it dynamo skips every frame that holds an RNN, GRU or LSTM (nothing of
# a recurrent LM is recorded); with it, the RNN call itself still runs eagerly, recorded
# at its output (``opaque_compiled``).
_CONFIG = {
    k: v
    for k, v in (("nested_graph_breaks", True), ("trace_numpy", False), ("allow_rnn", True))
    if hasattr(torch._dynamo.config, k)
}
_TORCH_DIR = os.path.dirname(torch.__file__)
MODULE_KEY = "<module>"  # label-dict key prefix of module outputs (no graph node of their own)
COMPILED_KEY = "<compiled>"  # key prefix of compiled submodules' outputs (recorded, not a node)
EAGER_KEY = "<eager>"  # key prefix of parameters recorded by a module call outside the graphs (``eager``)


class WeakBackend:
    """A capture's dynamo backend that holds it weakly: dynamo keeps every backend for the
    life of the process (``eval_frame.cached_backends``), and a capture holds its model."""

    def __init__(self, cap: "Capture") -> None:
        self._cap = weakref.ref(cap)

    def __call__(self, gm: fx.GraphModule, example_inputs: List[Any]) -> Callable[..., Any]:
        cap = self._cap()
        if cap is None:
            return gm.forward
        try:
            return _instrumented(cap, gm)
        except Exception as err:  # noqa: BLE001 - never fail the user's forward: run it untracked
            return _failing_step(gm, RuntimeError(f"dynamo graph not instrumented ({type(err).__name__}: {err})"))


def _failing_step(gm: fx.GraphModule, error: Exception) -> Callable[..., Any]:
    """Runs ``gm`` as compiled, and marks the step's recorder failed (the callback warns)."""

    def run(*args: Any) -> Any:
        rec = recorder.active()
        if rec is not None and rec.error is None:
            rec.error = error
        return gm.forward(*args)

    return run


def _op(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    if target is frames.exact_checkpoint:
        return "checkpoint"
    return function_name(target) or getattr(target, "__name__", str(target)).strip("_") or "op"


def _instrumented(cap: "Capture", gm: fx.GraphModule) -> Callable[..., Any]:
    def body_fn(body: fx.GraphModule, prefix: str) -> Callable[..., Any]:
        names = {n.name: prefix + n.name for n in body.graph.nodes if n.op not in ("output", "placeholder")}
        return instrument(body, names, observer=frames.observe_node)

    bodies = frames.exact_checkpoints(gm, body_fn)
    sites = frames.node_sites(gm, _op, resume=breaks.compiling_resume_frame())
    sites = float8.with_cast_sites(gm, sites)  # (torchao's float8 casts: nodes of their own)
    reason = getattr(gm, "compile_subgraph_reason", None)
    outputs = own_output(gm, reason) + frames.module_outputs(gm, complete=not getattr(reason, "graph_break", True))
    for prefix, body in bodies:
        sites += frames.node_sites(body, _op, prefix)
        outputs += frames.module_outputs(body, prefix)
    tp = TensorParallelGraph(gm, parallel_mesh(cap.module), _foreign_inputs(cap, gm, sites))
    sites = [s for s in sites if s.name not in tp.hidden]  # (DTensors: conversions are aliases, replicas once)
    names = {s.name: s.name for s in sites}
    views = view_aliases(gm, {k: v for k, v in names.items() if "." not in k})
    graph = frames.FrameGraph(
        gm, sites, outputs, {**tp.aliases, **views}, code=breaks.code_key(breaks.compiling_code())
    )
    fn = instrument(
        gm, {k: k for k in names if "." not in k}, observer=tp.observer(frames.observe_node, frames.skip_node)
    )
    roots, anchors = graph.roots(), graph.anchors()
    weak = weakref.ref(cap)  # dynamo's code cache keeps this function for the process

    def run(*args: Any) -> Any:
        cap = weak()
        if cap is None or recorder.active() is None:
            return fn(*args)
        known = frames.anchored_roots(anchors, args, cap.tensor_paths())
        start = sys._getframe(1)
        caller = breaks.running_frame(start, graph.code) or frames.calling_frame(start)
        scope = frames.scope_of(caller, roots, cap.module_paths(), known)
        own = bool(scope[0]) and breaks.module_called(caller, cap.module_paths()) == scope[0]
        tp.begin(args)
        with frames.running(_table(cap, graph, scope, own)):
            out = fn(*args)
        tp.left(out)
        return out

    return run


def _foreign_inputs(cap: "Capture", gm: fx.GraphModule, sites: List[frames.NodeSite]) -> Set[str]:
    """Placeholders of ``gm`` that are neither module attributes nor the captured module's
    own inputs: values of a frame resumed after a graph break, or of a frame called from one."""
    code = breaks.compiling_code()
    forward = getattr(inspect.unwrap(type(cap.module).forward), "__code__", None)
    if code is None or code is forward:
        return set()
    attrs = {s.name for s in sites if s.is_attr}
    return {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name not in attrs}


def _table(cap: "Capture", graph: frames.FrameGraph, scope: Tuple[str, ...], own: bool) -> Dict[str, str]:
    """Observed node -> label for ``graph`` run by ``scope``; registers new labels in ``cap``.
    ``own``: the graph runs the call of the module ``scope[0]`` itself, so its own output
    (``compiled_labels.own_output``: a graph compiled per block after its caller broke) is
    that module's."""
    key = (id(graph), scope, own)
    known = cap.frame_table(key)
    if known is not None:
        return known
    table = frames.table_for(graph, scope, cap.labeller)
    aliases = {table[v]: table[s] for v, s in graph.views.items() if v in table and s in table}
    listed = dict(table)
    where = dict(zip(graph.roots(), scope[1:]))
    for root, path, node in graph.outputs:
        full = ".".join(p for p in (where.get(root, scope[0]) if root else scope[0], path) if p)
        source = table.get(node)
        if (
            source is None
            or full == ""
            or (full == scope[0] and not (own and root is None and not path))
            or full in cap.labeller
            or full in cap.aliases
            or cap.has_label(full)
        ):
            continue
        aliases[full] = aliases.get(source, source)
        listed[MODULE_KEY + full] = full
    new = {k: v for k, v in listed.items() if not cap.has_label(v)}
    if new:
        cap.add_graph(graph.gm, new)
    cap.add_aliases(aliases)
    observed = {k: v for k, v in table.items() if v not in cap.aliases}
    cap.add_frame_table(key, observed)
    return observed


def _eagerly_hooked(root: nn.Module) -> List[nn.Module]:
    """The modules hooked on a tracked call (``eager.EagerCalls``): torch's own module classes
    (``nn.LayerNorm``, ``nn.Dropout``, ...) below ``root``, not inside opaque ones (compiled
    modules and RNNs: recorded at their output). Called outside a graph (in a frame dynamo
    skipped), such a module has no frame dynamo compiles, unless it has hooks: then dynamo
    compiles its ``forward`` as a frame of its own (``trace_rules.check_verbose``: "inbuilt
    nn.Module.forward allowed - module has hooks"), whose graph records it and names its
    output (``compiled_labels.own_output``); where even that does not run (a function under
    ``torch.compiler.disable``), the hook records the output itself. A module of the user's
    called outside a graph is compiled as a frame of its own anyway. Hooks only on torch's
    classes: a hook makes dynamo trace a module through ``__call__`` where it would trace its
    ``forward``, which breaks the graph in some user modules (transformers' kernel-hub
    wrappers read a ``ContextVar``)."""
    opaque = _opaque_modules(root)
    out: List[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if any(child is o for o in opaque):
                continue
            if _torch_module(child):
                out.append(child)
            walk(child)

    walk(root)
    return out


def _torch_module(m: nn.Module) -> bool:
    """A module of one of torch's own classes that computes (not a container)."""
    if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return False
    code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
    return code is not None and code.co_filename.startswith(_TORCH_DIR)


def opaque_module_paths(cap: "Capture") -> List[str]:
    """Paths of the modules a tracked dynamo call runs opaque: compiled submodules, and
    RNNs (dynamo refuses to trace RNN, GRU and LSTM) outside compiled ones."""
    return [cap.module_paths()[id(m)] for m in _opaque_modules(cap.module)]


def _opaque_modules(root: nn.Module) -> List[nn.Module]:
    compiled = torch._dynamo.eval_frame.OptimizedModule
    out: List[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, compiled) and "forward" in child.__dict__:
                out.append(child)  # (its inside runs its compiled code)
            elif isinstance(child, nn.RNNBase):
                out.append(child)
            else:
                walk(child)

    walk(root)
    return out


@contextlib.contextmanager
def opaque_compiled(cap: "Capture") -> Iterator[None]:
    """Compiled submodules run their own compiled code, and RNNs run eagerly (as dynamo
    would after a graph break), each recorded at its output under its path."""
    paths = cap.module_paths()
    with ForwardSwap() as swap:
        for m in _opaque_modules(cap.module):
            if not cap.has_label(paths[id(m)]):
                # no graph of its own, a record of its own
                cap.add_graph(fx.GraphModule(nn.Module(), fx.Graph()), {COMPILED_KEY + paths[id(m)]: paths[id(m)]})
            swap.replace(m, _recorded_at_output(swap.original(m), paths[id(m)]))
        yield


def _recorded_at_output(forward: Callable[..., Any], label: str) -> Callable[..., Any]:
    @torch.compiler.disable
    def run(*args: Any, **kwargs: Any) -> Any:
        with eager.as_compiled():  # (a compiled module runs the user's compiled code)
            out = forward(*args, **kwargs)
        recorder.observe(eager.first_tensor(out), label)  # (an RNN's: output, state)
        return out

    return run


# Hook registration in forward (transformers installs its output-capturing hooks on the
# first call that asks for router logits) runs eagerly: after a nested graph break dynamo
# hands it the module's hook tables rebuilt as plain dicts, and registering fails
# ("cannot create weak reference to 'dict' object").
_HOOK_METHODS = [name for name in vars(nn.Module) if name.startswith("register_") and name.endswith("hook")]
_EAGER_HOOK_METHODS = {name: torch.compiler.disable(getattr(nn.Module, name)) for name in _HOOK_METHODS}

# Dynamo's own warnings about how it traces: the user's forward does not compile, so they
# would appear only because of tracking, and the fidelity probe checks what they warn of.
_DYNAMO_WARNINGS = (
    "Dynamo detected a call to a `functools.lru_cache`-wrapped function",  # it traces through the cache
    "To copy construct from a tensor",  # its example values of a `torch.tensor(tensor)`
    "Dynamo does not know how to trace the builtin",  # it runs the builtin eagerly, at a graph break
)


@contextlib.contextmanager
def _dynamo_settings(eager_branches: bool) -> Iterator[None]:
    originals = {name: vars(nn.Module)[name] for name in _HOOK_METHODS}
    branches = eager.eager_branches() if eager_branches else contextlib.nullcontext()
    with warnings.catch_warnings(), torch._dynamo.config.patch(**_CONFIG), branches:
        for message in _DYNAMO_WARNINGS:
            warnings.filterwarnings(
                "ignore", message=re.escape(message), category=UserWarning, module=r"torch\._dynamo"
            )
        for name, fn in _EAGER_HOOK_METHODS.items():
            setattr(nn.Module, name, fn)
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(nn.Module, name, fn)


def tracked_forward(cap: "Capture", compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` under the capture's dynamo settings, compiled submodules opaque, module
    calls outside the graphs recorded at their output (``eager.EagerCalls``)."""

    counted = torch._dynamo.utils.counters["graph_break"]
    calls = eager.EagerCalls(
        cap.module_paths(),
        cap.has_label,
        lambda key, label: cap.add_graph(eager.empty_graph(), {key: label}),
        MODULE_KEY,
        EAGER_KEY,
        record=parallel_mesh(cap.module) is None,  # (tensor parallelism: placements known in graphs only)
    )
    hooked: List[nn.Module] = []

    def run(*args: Any, **kwargs: Any) -> Any:
        before = set(counted)
        hooked[:] = hooked or _eagerly_hooked(cap.module)
        new_forward()
        try:
            with opaque_compiled(cap), calls.hooked(hooked), _dynamo_settings(cap.eager_branches):
                return compiled(*args, **kwargs)
        finally:  # graph-break reasons, for the coverage report
            cap.add_graph_breaks(str(k).splitlines()[0][:160] for k in counted if k not in before)

    return run
