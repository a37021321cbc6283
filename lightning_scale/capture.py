"""Capture: a module's computation as torch.fx graphs, with readable node labels.

Three modes:

* ``fx``: a deep symbolic trace through every submodule. A submodule that fx cannot
  trace (control flow on tensors: BatchNorm, MultiheadAttention, ...) stays a leaf
  ``call_module`` node, recorded at its output, instead of failing the model.
* ``dynamo``: TorchDynamo with a custom ``torch.compile`` backend that hands each captured
  graph (one per graph break) to the instrumentation. No C compiler is involved. Covers
  models fx cannot trace at all (Hugging Face transformers, data-dependent control flow).
* ``auto``: fx when it traces the model without unexpected fallbacks and without writing
  module attributes in ``forward``, dynamo otherwise (the reason is in ``Capture.reason``).

Compiled submodules (``OptimizedModule``) are leaves in fx and opaque in dynamo: they run
their own compiled code. ``Capture.coverage`` measures what a tracked step recorded.

A ``Capture`` gives ``tracked(module)``: a function with ``module.forward``'s signature
that runs the captured graphs, recording into the active ``Recorder``.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Set, Tuple, Type, Union

import torch
from torch import fx, nn

from lightning_scale import coverage, frames
from lightning_scale.dynamo_backend import MODULE_KEY, WeakBackend, tracked_forward
from lightning_scale.interpreter import instrument
from lightning_scale.module_state import guarded

__all__ = ["CAPTURE_MODES", "Capture", "CaptureError", "DeepTracer", "capture", "label_graph"]

CaptureMode = Literal["auto", "fx", "dynamo"]
CAPTURE_MODES: Tuple[str, ...] = ("auto", "fx", "dynamo")

#: Modules kept as leaves by default: fx cannot trace them (control flow on proxies),
#: or tracing would drop their buffer updates (BatchNorm's ``num_batches_tracked``).
DEFAULT_LEAF_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    # A compiled submodule runs as its user compiled it: a leaf, recorded at its output.
    torch._dynamo.eval_frame.OptimizedModule,
)


class CaptureError(RuntimeError):
    """No capture mode could capture the module."""


class DeepTracer(fx.Tracer):
    """An fx tracer that recurses into every submodule, with a per-submodule fallback.

    Args:
        autowrap_modules: Python modules whose functions are recorded as calls, not traced.
        autowrap_functions: functions recorded as calls, not traced.
        leaf_modules: module types or qualified names kept as ``call_module`` leaves.
        fallback: on a submodule that fails to trace, keep it as a leaf and go on
            (recorded in ``fallbacks``) instead of failing the whole trace.

    Function arguments become placeholders named ``function_placeholder__<name>``,
    resolved through ``graph._tracer_extras["target_to_function"]``.
    """

    # Buffers read as get_attr nodes: otherwise an op on buffers alone (``torch.where(
    # self.flag, ...)``) runs at trace time and its result is frozen into the graph.
    proxy_buffer_attributes = True

    def __init__(
        self,
        autowrap_modules: Tuple[ModuleType, ...] = (math,),
        autowrap_functions: Tuple[Callable[..., Any], ...] = (),
        leaf_modules: Sequence[Union[str, Type[nn.Module]]] = DEFAULT_LEAF_TYPES,
        fallback: bool = True,
    ) -> None:
        super().__init__(autowrap_modules=autowrap_modules, autowrap_functions=autowrap_functions)  # type: ignore[arg-type]
        self.leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
        self.leaf_names = {t for t in leaf_modules if isinstance(t, str)}
        self.fallback = fallback
        self.fallbacks: Dict[str, str] = {}
        self.leaves: List[str] = []
        self.target_to_function: Dict[str, FunctionType] = {}
        self.function_to_node: Dict[FunctionType, fx.Node] = {}
        self._modes: Optional[Tuple[Any, ...]] = None
        if id(FunctionType) in self._autowrap_function_ids:
            self._autowrap_function_ids.remove(id(FunctionType))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.fallbacks or module_qualified_name in self.leaf_names:
            return True
        return isinstance(m, self.leaf_types)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            if name not in self.leaves:
                self.leaves.append(name)
            return super().call_module(m, forward, args, kwargs)
        if not self.fallback:
            try:
                return super().call_module(m, forward, args, kwargs)
            except Exception as err:
                if not hasattr(err, "_lightning_scale_module"):
                    err._lightning_scale_module = name  # type: ignore[attr-defined]  # innermost module, for the message
                raise
        before = list(self.graph.nodes)[-1] if len(self.graph.nodes) else None
        stack = dict(self.module_stack)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as err:  # noqa: BLE001 - any trace failure means "keep as leaf"
            self._rollback(before)
            self.module_stack.clear()
            self.module_stack.update(stack)
            self.fallbacks[name] = failure_reason(err)
            self.leaves.append(name)
            return self.create_proxy("call_module", name, args, kwargs)

    def _rollback(self, last_kept: Optional[fx.Node]) -> None:
        nodes = list(self.graph.nodes)
        start = nodes.index(last_kept) + 1 if last_kept is not None else 0
        for node in reversed(nodes[start:]):
            if node.op != "placeholder":
                self.graph.erase_node(node)

    def create_arg(self, a: Any) -> fx.node.Argument:
        if isinstance(a, FunctionType):
            node = self.function_to_node.get(a)
            if node is None:
                target = f"function_placeholder__{a.__name__}"
                node = self.create_node("placeholder", target, (), {}, a.__name__)
                self.target_to_function[target] = a
                self.function_to_node[a] = node
            return node
        return super().create_arg(a)

    def create_node(self, kind: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        if self._modes is not None and _grad_modes() != self._modes:
            raise RuntimeError(
                f"{kind} {getattr(target, '__name__', target)} runs under a grad or autocast mode switched "
                "inside forward (torch.no_grad, autocast, ...), which a graph does not record"
            )
        return super().create_node(kind, target, *args, **kwargs)

    def trace(self, root: Union[nn.Module, Callable[..., Any]], concrete_args: Optional[Dict[str, Any]] = None) -> fx.Graph:
        self._modes = _grad_modes()
        graph = super().trace(root, concrete_args)
        if getattr(graph, "_tracer_extras", None) is None:
            graph._tracer_extras = {}
        graph._tracer_extras["target_to_function"] = self.target_to_function
        return graph


def _grad_modes() -> Tuple[Any, ...]:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
    )


# ---------------------------------------------------------------------------------------
# Labels


def _op_name(node: fx.Node, root: Optional[nn.Module]) -> str:
    if node.op == "call_module" and root is not None:
        return _module_type(root.get_submodule(str(node.target))).__name__.lower()
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    return getattr(target, "__name__", str(target)).strip("_") or "op"


def _module_type(m: nn.Module) -> type:
    """The user's class: FSDP2's ``fully_shard`` swaps in a subclass ``FSDP<name>``;
    ``torch.compile`` wraps the module in an ``OptimizedModule``."""
    m = getattr(m, "_orig_mod", m) if isinstance(m, torch._dynamo.eval_frame.OptimizedModule) else m
    cls = type(m)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        return cls.__bases__[1]
    return cls


_DYNAMO_PATH = re.compile(r"^L\['[^']+'\]\.?(__self__\.?)?")  # L['self'].x, or L['fn'].__self__.x for a bound method


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = _DYNAMO_PATH.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\._(modules|parameters|buffers)\.", ".", path)
    return path.strip(".")


_DYNAMO_ATTR = re.compile(r"_(modules|parameters|buffers)_")


def _placeholder_name(target: str) -> str:
    """``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``; ``L_x_`` -> ``x``."""
    m = _DYNAMO_ATTR.search(target)
    if target.startswith("L_") and m:
        rest = target[m.start() + 1 :]
        parts = [p for p in _DYNAMO_ATTR.split("_" + rest) if p and p not in ("modules", "parameters", "buffers")]
        return ".".join(p.strip("_") for p in parts)
    if target.startswith("L_") and target.endswith("_"):
        return target[2:-1]
    return target


def _base_label(node: fx.Node, root: Optional[nn.Module], scope: str) -> str:
    """``path/op`` for ops, the attribute path for parameters, the name for inputs;
    ``scope`` is the path of the module the graph belongs to inside the captured one."""
    def under(path: str) -> str:
        return ".".join(p for p in (scope, path) if p)

    if node.op == "get_attr":
        return under(str(node.target))
    if node.op == "placeholder":
        name = _placeholder_name(str(node.target))
        return f"{scope}/{name}" if scope else name
    if node.op == "call_module":
        return f"{under(str(node.target))}/{_op_name(node, root)}"
    path = under(_module_path(node))
    return f"{path}/{_op_name(node, root)}" if path else _op_name(node, root)


def label_graph(
    gm: fx.GraphModule,
    root: Optional[nn.Module] = None,
    taken: Optional[Dict[str, int]] = None,
    scope: str = "",
    only: Optional[Set[str]] = None,
) -> Dict[str, str]:
    """Readable, unique labels for a graph's nodes: ``blocks.0.mlp.fc1/linear``.

    Args:
        gm: the graph module.
        root: the module the graph was traced from (names leaf modules' types).
        taken: labels already used (by other graphs of the same capture); updated.
        scope: path of the graph's module inside the captured module (for submodules
            captured separately, such as FSDP units).
        only: label only these node names (default: all).

    Returns:
        node name -> label, for every node but the output and function placeholders.
    """
    taken = {} if taken is None else taken
    labels: Dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "output" or str(node.target).startswith("function_placeholder__"):
            continue
        if only is not None and node.name not in only:
            continue
        base = _base_label(node, root, scope)
        count = taken.get(base, 0)
        taken[base] = count + 1
        labels[node.name] = base if count == 0 else f"{base}_{count}"
    return labels


_VIEW_METHODS = {
    "view", "reshape", "transpose", "permute", "contiguous", "flatten", "unflatten",
    "squeeze", "unsqueeze", "t", "view_as", "reshape_as", "swapaxes", "mT",
}  # fmt: skip
_VIEW_FUNCTIONS = {
    torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.squeeze,
    torch.unsqueeze, torch.t, torch.swapaxes, torch.unflatten,
}  # fmt: skip


def view_aliases(gm: fx.GraphModule, labels: Dict[str, str]) -> Dict[str, str]:
    """Labels whose statistics equal another node's, forward and backward, exactly.

    A reshape-like op (view, transpose, permute, ...) holds the same values as its input;
    when it is the input's only user, its gradient holds the same values as the input's
    gradient too. Such nodes need no computation of their own: label -> source label.
    """
    aliases: Dict[str, str] = {}
    for node in gm.graph.nodes:
        src = _view_source(node)
        if src is None or len(src.users) != 1 or src.name not in labels or node.name not in labels:
            continue
        root = labels[src.name]
        aliases[labels[node.name]] = aliases.get(root, root)
    return aliases


def _view_source(node: fx.Node) -> Optional[fx.Node]:
    is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    )
    if is_view and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


# ---------------------------------------------------------------------------------------
# Captures


@dataclass
class Capture:
    """A captured module: its graphs, node labels and how to run it tracked.

    Attributes:
        mode: "fx" or "dynamo" (what was used; "auto" resolves to one of them).
        graphs: the captured graph modules (dynamo adds one per graph as they compile).
        labels: node label per (graph index, node name), in graph order.
        leaves: module paths run as leaf ``call_module`` nodes (recorded at their output).
        fallbacks: module path -> why fx could not trace it (kept as a leaf).
        aliases: label -> label of a node with provably identical statistics (views of a
            single-use tensor); these are not computed twice.
        reason: why auto chose this mode.
    """

    mode: str
    module: nn.Module
    graphs: List[fx.GraphModule] = field(default_factory=list)
    labels: List[Dict[str, str]] = field(default_factory=list)
    leaves: List[str] = field(default_factory=list)
    fallbacks: Dict[str, str] = field(default_factory=dict)
    aliases: Dict[str, str] = field(default_factory=dict)
    reason: str = ""
    _taken: Dict[str, int] = field(default_factory=dict)
    _fns: List[Callable[..., Any]] = field(default_factory=list)
    _unit_fns: List[Tuple[str, Callable[..., Any]]] = field(default_factory=list)
    _compiled: Optional[Callable[..., Any]] = None
    _labeller: frames.Labeller = field(default_factory=frames.Labeller)
    _tables: Dict[Tuple[int, Tuple[str, ...]], Dict[str, str]] = field(default_factory=dict)
    _module_paths: Optional[Dict[int, str]] = None
    _tensor_names: Optional[Dict[int, List[str]]] = None
    _breaks: List[str] = field(default_factory=list)

    def _tensor_paths(self) -> Dict[int, List[str]]:
        if self._tensor_names is None:
            named = [*self.module.named_parameters(remove_duplicate=False), *self.module.named_buffers(remove_duplicate=False)]
            self._tensor_names = {}
            for name, t in named:
                self._tensor_names.setdefault(id(t), []).append(frames.strip_compiled(name))
        return self._tensor_names

    def _paths(self) -> Dict[int, str]:
        if self._module_paths is None:
            self._module_paths = frames.module_paths(self.module)
        return self._module_paths

    @property
    def node_labels(self) -> List[str]:
        """Every node label, graph by graph, in execution order (module outputs left out)."""
        return [label for labels in self.labels for key, label in labels.items() if not key.startswith(MODULE_KEY)]

    @property
    def tags(self) -> List[str]:
        """``node_labels`` and, after each module's last node, the module's path: its
        output (an alias, no extra cost), so ``model.fc1`` finds the layer's output."""
        return [label for labels in self.labels for label in labels.values()]

    @property
    def module_outputs(self) -> Set[str]:
        """The tags of ``tags`` that name a module's output (not a graph node of their own)."""
        return {label for labels in self.labels for key, label in labels.items() if key.startswith(MODULE_KEY)}

    def parts(self) -> List[Tuple[str, Callable[..., Any]]]:
        """(submodule path, tracked forward) pairs to install: ``""`` is the captured
        module itself; separately captured units (FSDP) follow."""
        return [("", self.tracked()), *self._unit_fns]

    def tracked(self) -> Callable[..., Any]:
        """A function with the module's forward signature that runs the captured graphs.

        It records into the active recorder (``recorder.recording``); untracked calls
        should use the module's own forward instead.
        """
        if self.mode == "fx":
            return self._fns[0]
        if self._compiled is None:
            forward = type(self.module).forward.__get__(self.module)
            compiled = torch.compile(forward, backend=WeakBackend(self), dynamic=None, **_ISOLATED)
            self._compiled = tracked_forward(self, compiled)
        return self._compiled

    def coverage(self, recorded: Sequence[str]) -> coverage.CoverageReport:
        """How much of the module the labels ``recorded`` (those with a record on a
        tracked step) cover; ``.line()`` for the log, ``.warning()`` below 90%."""
        opaque = [frames.strip_compiled(p) for p in self.leaves] + self._opaque_compiled()
        return coverage.measure(self.module, recorded, opaque, self._why_missing)

    def _opaque_compiled(self) -> List[str]:
        compiled = torch._dynamo.eval_frame.OptimizedModule
        return [frames.strip_compiled(n) for n, m in self.module.named_modules() if n and isinstance(m, compiled)]

    def _why_missing(self, path: str) -> str:
        for where, why in self.fallbacks.items():
            if path == where or path.startswith(where + "."):
                return f"fx could not trace `{where}`: {why}"
        if self.mode == "dynamo" and self._breaks:
            return "ran outside the captured graphs; dynamo graph breaks: " + " | ".join(self._breaks[:3])
        return "no op of it recorded (not called on the tracked step, or run outside the captured graphs)"

    def describe(self) -> str:
        """One line for a person: mode, graphs, nodes, leaves and fallbacks."""
        parts = [f"capture={self.mode}", f"graphs={len(self.graphs)}", f"nodes={len(self.node_labels)}"]
        if self.leaves:
            parts.append(f"leaf modules={len(self.leaves)}")
        if self.fallbacks:
            parts.append("fx fallbacks: " + ", ".join(f"{k} ({v})" for k, v in self.fallbacks.items()))
        if self.reason:
            parts.append(self.reason)
        return "; ".join(parts)


# Compiles of the same forward (a new model of the same class) share dynamo's recompile
# limit unless isolated: after 8 fits in one process, tracking would stop.
_ISOLATED = {"isolate_recompiles": True} if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {}


def capture(
    module: nn.Module,
    mode: str = "auto",
    leaf_modules: Sequence[Union[str, Type[nn.Module]]] = (),
    autowrap_modules: Tuple[ModuleType, ...] = (math,),
    autowrap_functions: Tuple[Callable[..., Any], ...] = (),
    units: Sequence[str] = (),
) -> Capture:
    """Capture ``module``'s forward.

    Args:
        module: the module; the capture shares its parameters and buffers.
        mode: "auto", "fx" or "dynamo".
        leaf_modules: extra module types or qualified names to keep as leaves (fx).
        autowrap_modules, autowrap_functions: passed to the fx tracer.
        units: paths of submodules captured as graphs of their own and run through their
            own ``__call__`` (so their hooks run: FSDP units). Implies fx.

    Raises:
        ValueError: unknown ``mode``.
        CaptureError: ``mode="fx"`` and the module cannot be traced.
    """
    if mode not in CAPTURE_MODES:
        raise ValueError(f"`mode` must be one of {list(CAPTURE_MODES)}, got {mode!r}")
    if mode == "dynamo":
        return Capture("dynamo", module, reason="dynamo requested")
    leaves = tuple(DEFAULT_LEAF_TYPES) + tuple(leaf_modules)
    if units:
        cap = _fx_capture(module, leaves + tuple(units), autowrap_modules, autowrap_functions)
        _add_units(cap, module, units, leaves, autowrap_modules, autowrap_functions)
        cap.reason = f"fx per unit: {len(units)} separately captured units"
        return cap
    try:
        cap = _fx_capture(module, leaves, autowrap_modules, autowrap_functions)
    except Exception as err:  # noqa: BLE001 - any failure of the trace itself
        why = failure_reason(err)
        if mode == "fx":
            raise CaptureError(f"torch.fx could not trace {type(module).__name__}: {why}") from err
        return Capture("dynamo", module, reason=f"auto: fx failed ({why})")
    if mode == "auto" and cap.fallbacks:
        reason = "auto: fx needed fallbacks for " + ", ".join(cap.fallbacks)
        return Capture("dynamo", module, fallbacks=cap.fallbacks, reason=reason)
    cap.reason = "fx requested" if mode == "fx" else "auto: fx traced the whole model"
    return cap


class SideEffectError(RuntimeError):
    """``forward`` writes attributes of modules: an fx graph would not repeat the write."""


def _trace(module: nn.Module, tracer: DeepTracer) -> fx.GraphModule:
    # Nothing of the trace may stay on the user's modules (fx runs forward on proxies).
    with warnings.catch_warnings(), guarded(module) as writes:
        warnings.simplefilter("ignore")
        graph = tracer.trace(module)
        gm = fx.GraphModule(module, graph)
    if writes:
        where = ", ".join(str(w) for w in writes[:3])
        raise SideEffectError(f"forward writes module state ({where}), which a graph does not replay")
    return gm


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))


def failure_reason(err: BaseException) -> str:
    """What failed, where: ``TypeError: ... in `blocks.0.attn` at model.py:42 (code)``."""
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    module = getattr(err, "_lightning_scale_module", None)
    if module:
        text += f" in `{module}`"
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not frame.filename.startswith((_TORCH_DIR, _OWN_DIR)) and "/contextlib.py" not in frame.filename:
            return f"{text} at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return text


def _fx_capture(
    module: nn.Module,
    leaf_modules: Sequence[Union[str, Type[nn.Module]]],
    autowrap_modules: Tuple[ModuleType, ...],
    autowrap_functions: Tuple[Callable[..., Any], ...],
) -> Capture:
    tracer = DeepTracer(autowrap_modules, autowrap_functions, leaf_modules)
    gm = _trace(module, tracer)
    taken: Dict[str, int] = {}
    labels = label_graph(gm, module, taken)
    aliases = view_aliases(gm, labels)
    labels = _with_module_outputs(gm, labels, aliases)
    cap = Capture("fx", module, [gm], [labels], list(tracer.leaves), dict(tracer.fallbacks), aliases, _taken=taken)
    cap._fns.append(instrument(gm, _observed(labels, aliases), live=module))
    return cap


def _add_units(
    cap: Capture,
    root: nn.Module,
    units: Sequence[str],
    leaves: Tuple[Any, ...],
    autowrap_modules: Tuple[ModuleType, ...],
    autowrap_functions: Tuple[Callable[..., Any], ...],
) -> None:
    """Capture each unit's own forward, nested units kept as leaves (run via __call__)."""
    for path in units:
        unit = root.get_submodule(path)
        inner = tuple(u[len(path) + 1 :] for u in units if u.startswith(path + "."))
        tracer = DeepTracer(autowrap_modules, autowrap_functions, leaves + inner)
        gm = _trace(unit, tracer)
        labels = label_graph(gm, unit, cap._taken, scope=path)
        aliases = view_aliases(gm, labels)
        cap.graphs.append(gm)
        cap.labels.append(labels)
        cap.aliases.update(aliases)
        cap.fallbacks.update({f"{path}.{k}": v for k, v in tracer.fallbacks.items()})
        cap._unit_fns.append((path, instrument(gm, _observed(labels, aliases), live=unit)))


def _with_module_outputs(gm: fx.GraphModule, labels: Dict[str, str], aliases: Dict[str, str], scope: str = "") -> Dict[str, str]:
    """``labels`` plus, after each module's last node, the module's path as an alias of
    that node (``fc1`` -> ``fc1/linear``): a layer's output is found by its name."""
    ends: Dict[str, List[str]] = {}
    outputs = frames.module_outputs(gm, parse=lambda p: (None, p))
    outputs += [(None, str(n.target), n.name) for n in gm.graph.nodes if n.op == "call_module"]
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


def _observed(labels: Dict[str, str], aliases: Dict[str, str]) -> Dict[str, str]:
    return {name: label for name, label in labels.items() if label not in aliases}
