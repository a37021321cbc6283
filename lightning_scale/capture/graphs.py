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
that runs the captured graphs, recording into the active ``Recorder``. The tracer is in
``tracer.py``, labels and view aliases in ``labels.py``, the dynamo backend in
``dynamo.py`` and ``frames.py``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    Iterable,
    List,
    Literal,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
    Type,
    Union,
)

import torch
from torch import fx, nn

from lightning_scale.capture import coverage, frames, summary, tensor_parallel
from lightning_scale.capture.compiled import CompiledRoute, compiled_modules
from lightning_scale.capture.compiled_labels import CompiledLabels
from lightning_scale.capture.dynamo import MODULE_KEY, WeakBackend, opaque_module_paths, tracked_forward
from lightning_scale.capture.interpreter import instrument
from lightning_scale.capture.labels import label_graph, view_aliases
from lightning_scale.capture.module_outputs import with_module_outputs
from lightning_scale.capture.tracer import DEFAULT_LEAF_TYPES, DeepTracer, failure_reason, trace_module
from lightning_scale.record.settings import Settings
from lightning_scale.record.recorder import BACKWARD

__all__ = ["CAPTURE_MODES", "Capture", "CaptureError", "DeepTracer", "capture", "label_graph"]

OptimizedModule = torch._dynamo.eval_frame.OptimizedModule

CaptureMode = Literal["auto", "fx", "dynamo"]

#: What a capture line says of a capture tracked by a shadow pass (the model's own step runs untouched).
SHADOW_NOTE = (
    "tracked by a shadow pass: the statistics are those of a second, instrumented forward and backward "
    "from the step's state (the same tensors; rounding may differ from the model's own step)"
)
CAPTURE_MODES: Tuple[str, ...] = ("auto", "fx", "dynamo")


class CaptureError(RuntimeError):
    """No capture mode could capture the module."""


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
        eager_branches: dynamo traces ``torch.compiler.is_compiling()`` as False, as the user's
            eager forward sees it; set by the fidelity probe where plain dynamo changes it.
        shadowed: tracked steps run a shadow pass with it (``step.shadow``, ``SHADOW_NOTE``).
    """

    mode: str
    module: nn.Module
    graphs: List[fx.GraphModule] = field(default_factory=list)
    labels: List[Dict[str, str]] = field(default_factory=list)
    leaves: List[str] = field(default_factory=list)
    fallbacks: Dict[str, str] = field(default_factory=dict)
    aliases: Dict[str, str] = field(default_factory=dict)
    reason: str = ""
    eager_branches: bool = False
    shadowed: bool = False
    _taken: Dict[str, int] = field(default_factory=dict)
    _fns: List[Callable[..., Any]] = field(default_factory=list)
    _unit_fns: List[Tuple[str, Callable[..., Any]]] = field(default_factory=list)
    _compiled: Optional[Callable[..., Any]] = None
    _labeller: frames.Labeller = field(default_factory=frames.Labeller)
    _tables: Dict[Tuple[int, Tuple[str, ...], bool], Dict[str, str]] = field(default_factory=dict)
    _module_paths: Optional[Dict[int, str]] = None
    _tensor_names: Optional[Dict[int, List[str]]] = None
    _breaks: List[str] = field(default_factory=list)
    _skipped: Dict[str, str] = field(default_factory=dict)  # "label" / "label grad" -> why not recorded
    #: the compiled submodules' route: they run instrumented compiled versions on tracked calls
    compiled: Optional[CompiledRoute] = None
    _wrapped: Optional[Callable[..., Any]] = None

    def tensor_paths(self) -> Dict[int, List[str]]:
        """``id`` of each parameter and buffer -> its paths in the module (tied ones have several)."""
        if self._tensor_names is None:
            named = [
                *self.module.named_parameters(remove_duplicate=False),
                *self.module.named_buffers(remove_duplicate=False),
            ]
            self._tensor_names = {}
            for name, t in named:
                self._tensor_names.setdefault(id(t), []).append(frames.strip_compiled(name))
        return self._tensor_names

    def module_paths(self) -> Dict[int, str]:
        """``id`` of each submodule -> its path (compiled wrappers' ``_orig_mod`` left out)."""
        if self._module_paths is None:
            self._module_paths = frames.module_paths(self.module)
        return self._module_paths

    # ---- what the dynamo backend adds as graphs compile (``dynamo.py``)

    @property
    def labeller(self) -> frames.Labeller:
        """The labels given so far to dynamo nodes (unique across graphs and frames)."""
        return self._labeller

    def frame_table(self, key: Tuple[int, Tuple[str, ...], bool]) -> Optional[Dict[str, str]]:
        """The node -> label table of (a frame graph's id, the scope that runs it, whether it
        runs the owner's call itself), if made."""
        return self._tables.get(key)

    def add_frame_table(self, key: Tuple[int, Tuple[str, ...], bool], table: Dict[str, str]) -> None:
        self._tables[key] = table

    def add_graph(self, gm: fx.GraphModule, labels: Dict[str, str]) -> None:
        """A graph and its new labels (node key -> label), after those captured so far."""
        self.graphs.append(gm)
        self.labels.append(labels)

    def add_aliases(self, aliases: Dict[str, str]) -> None:
        """Label -> the label whose records it shares; a label already aliased keeps its source."""
        for alias, source in aliases.items():
            self.aliases.setdefault(alias, source)

    def has_label(self, label: str) -> bool:
        """Whether ``label`` names a node or module output of a graph captured so far."""
        return any(label in labels.values() for labels in self.labels)

    def add_skipped(self, skipped: Mapping[Tuple[Hashable, int], str]) -> Dict[str, str]:
        """Tensors a tracked step saw but did not record (``Recorder.skipped``: (label,
        direction) -> why), for the coverage report; returns them by name (``emb.weight grad``)."""
        named = {f"{label}{' grad' if d == BACKWARD else ''}": why for (label, d), why in skipped.items()}
        self._skipped.update(named)
        return named

    def add_graph_breaks(self, reasons: Iterable[str]) -> None:
        """Dynamo's graph-break reasons seen on a tracked call, for the coverage report."""
        self._breaks.extend(reasons)

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

    # ---- what the fx route builds (``capture``)

    def set_forward(self, fn: Callable[..., Any]) -> None:
        """The instrumented forward of the whole module (fx): what ``tracked()`` returns."""
        self._fns[:] = [fn]

    def add_unit(
        self,
        path: str,
        unit: nn.Module,
        gm: fx.GraphModule,
        fallbacks: Dict[str, str],
        passthrough: Optional[Dict[str, str]] = None,
    ) -> None:
        """A separately captured unit (FSDP) at ``path``: its graph, labelled within this
        capture with its modules' outputs (``blocks.0.mlp.fc1``), and its instrumented
        forward (run through the unit's own ``__call__``)."""
        labels = label_graph(gm, unit, self._taken, scope=path)
        aliases = {**self.aliases, **view_aliases(gm, labels)}  # (an output tagged before keeps its tag)
        labels = with_module_outputs(gm, labels, aliases, passthrough, scope=path)
        self.add_graph(gm, labels)
        self.aliases.update(aliases)
        self.fallbacks.update({f"{path}.{k}": v for k, v in fallbacks.items()})
        self._unit_fns.append((path, instrument(gm, _observed(labels, aliases), live=unit)))

    def tracked(self) -> Callable[..., Any]:
        """A function with the module's forward signature that runs the captured graphs.

        It records into the active recorder (``recorder.recording``); untracked calls
        should use the module's own forward instead.
        """
        if self.mode == "fx":
            fn = self._fns[0]
        else:
            if self._compiled is None:
                forward = type(self.module).forward.__get__(self.module)
                compiled = torch.compile(forward, backend=WeakBackend(self), dynamic=None, **_ISOLATED)
                self._compiled = tracked_forward(self, compiled)
            fn = self._compiled
        if self.compiled is None:
            return fn
        if self._wrapped is None:
            self._wrapped = _through_compiled(fn, self.compiled)
        return self._wrapped

    def add_compiled_route(self, groups: Sequence[str], compiled_stats: str = "auto") -> None:
        """Run the compiled submodules (``torch.compile(m)``, ``m.compile()``) on tracked calls
        as instrumented compiled versions (``compiled.CompiledRoute``), labelled in this capture
        (``compiled_stats``: ``Settings.compiled_stats``)."""
        if any(path for path, _ in compiled_modules(self.module)):
            labels = CompiledLabels(self.module, self.graphs, self.labels, self.aliases)
            self.compiled = CompiledRoute(self.module, groups, labels, compiled_stats)

    def coverage(self, recorded: Sequence[str]) -> coverage.CoverageReport:
        """How much of the module the labels ``recorded`` (those with a record on a
        tracked step) cover; ``.line()`` for the log, ``.warning()`` below 90%."""
        # compiled submodules are opaque, unless the compiled route records inside them
        routed = {path for path, _ in self.compiled.targets} if self.compiled is not None else set()
        compiled = [p for p in self._opaque_compiled() if p not in routed]
        leaves = [p for p in (frames.strip_compiled(p) for p in self.leaves) if p not in routed]
        report = coverage.measure(
            self.module,
            recorded,
            leaves + compiled + self._opaque_rnns(),
            self._why_missing,
            compiled=compiled,
            skipped=self._skipped,
        )
        notes = [SHADOW_NOTE] if self.shadowed else []
        report.note = "; ".join(notes + ([self.compiled.describe()] if self.compiled is not None else []))
        return report

    def _opaque_rnns(self) -> List[str]:
        """RNN modules dynamo runs eagerly and ``opaque_modules`` records at their output."""
        return (
            [p for p in opaque_module_paths(self) if p not in self._opaque_compiled()] if self.mode == "dynamo" else []
        )

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
            parts.append(summary.fallback_line(self.fallbacks))
        converted = summary.converted_line(self.module)
        if converted:
            parts.append(converted)
        if self.eager_branches:
            parts.append("torch.compiler.is_compiling() traced as False")
        if self.reason:
            parts.append(self.reason)
        meshes = tensor_parallel.meshes_of(self.module)
        if meshes:
            parts.append(tensor_parallel.mesh_line(meshes))
        if self.compiled is not None:
            parts.append(self.compiled.describe())
        if self.shadowed:
            parts.append(SHADOW_NOTE)
        return "; ".join(parts)


def _through_compiled(fn: Callable[..., Any], route: CompiledRoute) -> Callable[..., Any]:
    def tracked(*args: Any, **kwargs: Any) -> Any:
        with route.swapped():
            return fn(*args, **kwargs)

    return tracked


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
    groups: Sequence[str] = ("moments", "range"),
    settings: Optional[Settings] = None,
) -> Capture:
    """Capture ``module``'s forward.

    Args:
        module: the module; the capture shares its parameters and buffers.
        mode: "auto", "fx" or "dynamo".
        leaf_modules: extra module types or qualified names to keep as leaves (fx).
        autowrap_modules, autowrap_functions: passed to the fx tracer.
        units: paths of submodules captured as graphs of their own and run through their
            own ``__call__`` (so their hooks run: FSDP units). Implies fx.
        groups: statistic groups the compiled submodules' graphs compute (the recorder's).
        settings: the environment switches (``record.settings.Settings``); None: read from the
            environment now (a capture made outside ``ScaleMonitor``).

    Raises:
        ValueError: unknown ``mode``.
        CaptureError: ``mode="fx"`` and the module cannot be traced.
    """
    if mode not in CAPTURE_MODES:
        raise ValueError(f"`mode` must be one of {list(CAPTURE_MODES)}, got {mode!r}")
    units = _outside_compiled(module, units)
    cap = _capture(module, mode, leaf_modules, autowrap_modules, autowrap_functions, units)
    cap.add_compiled_route(groups, (Settings.from_env() if settings is None else settings).compiled_stats)
    return cap


def _outside_compiled(module: nn.Module, units: Sequence[str]) -> List[str]:
    """The units not inside a compiled submodule: an FSDP unit compiled after ``fully_shard``
    (``torch.compile(block)``) runs, on tracked calls, the compiled route's instrumented version
    of it, with its FSDP hooks, as the user's compiled version does."""
    compiled = [path for path, _ in compiled_modules(module) if path]
    inside = lambda unit: any(unit == c or unit.startswith(c + ".") for c in compiled)  # noqa: E731
    return [u for u in units if not inside(frames.strip_compiled(u))]


def _capture(
    module: nn.Module,
    mode: str,
    leaf_modules: Sequence[Union[str, Type[nn.Module]]],
    autowrap_modules: Tuple[ModuleType, ...],
    autowrap_functions: Tuple[Callable[..., Any], ...],
    units: Sequence[str],
) -> Capture:
    if mode == "dynamo":
        return Capture("dynamo", module, reason="dynamo requested")
    # a module compiled in place runs its compiled code: a leaf, as an OptimizedModule
    in_place = [path for path, m in compiled_modules(module) if path and not isinstance(m, OptimizedModule)]
    leaves = tuple(DEFAULT_LEAF_TYPES) + tuple(leaf_modules) + tuple(in_place)
    parallel = tensor_parallel.distributed_modules(module)
    if parallel:  # (tensor parallelism: fx would keep the layers as leaves, placements unknown)
        why = "fx cannot see the placements of tensor-parallel layers " + ", ".join(parallel[:3])
        if mode == "fx":
            raise CaptureError(f"{why}; capture them with dynamo")
        return Capture("dynamo", module, reason=f"auto: {why}")
    if units:
        try:
            cap = _fx_capture(module, leaves + tuple(units), autowrap_modules, autowrap_functions)
            _add_units(cap, module, units, leaves, autowrap_modules, autowrap_functions)
        except Exception as err:  # noqa: BLE001 - a Hugging Face model in FSDP units: dynamo traces it whole
            if mode == "fx":
                raise
            return Capture("dynamo", module, reason=f"auto: fx failed on the FSDP units ({failure_reason(err)})")
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
        reason = "auto: fx needed fallbacks for " + summary.names(list(cap.fallbacks))
        return Capture("dynamo", module, fallbacks=cap.fallbacks, reason=reason)
    cap.reason = "fx requested" if mode == "fx" else "auto: fx traced the whole model"
    return cap


def _fx_capture(
    module: nn.Module,
    leaf_modules: Sequence[Union[str, Type[nn.Module]]],
    autowrap_modules: Tuple[ModuleType, ...],
    autowrap_functions: Tuple[Callable[..., Any], ...],
) -> Capture:
    tracer = DeepTracer(autowrap_modules, autowrap_functions, leaf_modules)
    gm = trace_module(module, tracer)
    taken: Dict[str, int] = {}
    labels = label_graph(gm, module, taken)
    aliases = view_aliases(gm, labels)
    labels = with_module_outputs(gm, labels, aliases, tracer.passthrough)
    cap = Capture("fx", module, [gm], [labels], list(tracer.leaves), dict(tracer.fallbacks), aliases, _taken=taken)
    cap.set_forward(instrument(gm, _observed(labels, aliases), live=module))
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
        cap.add_unit(path, unit, trace_module(unit, tracer), tracer.fallbacks, tracer.passthrough)


def _observed(labels: Dict[str, str], aliases: Dict[str, str]) -> Dict[str, str]:
    return {name: label for name, label in labels.items() if label not in aliases}
