"""The deep fx tracer: through every submodule, with per-submodule fallback leaves.

``DeepTracer`` traces into every ``nn.Module`` (``torch.fx.symbolic_trace`` stops at each
one), so parameters and the ops inside layers are graph nodes. A submodule whose trace
raises is rolled back and kept as a ``call_module`` leaf, with the reason. ``trace_module``
runs a trace under ``module_state.guarded`` and ``forked_rng``: nothing of it stays on the
user's modules or random number generators,
and attribute writes in ``forward`` raise ``SideEffectError``. ``failure_reason`` turns a
trace error into what failed, in which module, at which source line.
"""

from __future__ import annotations

import linecache
import math
import operator
import os
import sys
import traceback
from collections import OrderedDict
import warnings
from types import FunctionType, ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import fx, nn

from lightning_scale.capture.labels import SOURCE_LINE
from lightning_scale.capture.module_state import forked_rng, guarded

__all__ = ["DEFAULT_LEAF_TYPES", "DeepTracer", "SideEffectError", "failure_reason", "trace_module"]

_SKIPPED = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Modules kept as leaves by default: fx cannot trace them (control flow on proxies),
#: tracing would drop their buffer updates (BatchNorm's ``num_batches_tracked``), or their
#: forward writes module state (RNN, GRU and LSTM refresh ``_flat_weights``).
DEFAULT_LEAF_TYPES: Tuple[Type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    # A compiled submodule runs as its user compiled it: a leaf, recorded at its output.
    torch._dynamo.eval_frame.OptimizedModule,
)


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
        super().__init__(
            autowrap_modules=autowrap_modules,  # type: ignore[arg-type]
            autowrap_functions=autowrap_functions,
        )
        self.leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
        self.leaf_names = {t for t in leaf_modules if isinstance(t, str)}
        self.fallback = fallback
        self.fallbacks: Dict[str, str] = {}
        self.leaves: List[str] = []
        self.passthrough: Dict[str, str] = {}  # module path -> node it returned unchanged (nn.Identity)
        self.target_to_function: Dict[str, FunctionType] = {}
        self.function_to_node: Dict[FunctionType, fx.Node] = {}
        self._modes: Optional[Tuple[Any, ...]] = None
        if id(FunctionType) in self._autowrap_function_ids:
            self._autowrap_function_ids.remove(id(FunctionType))

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.fallbacks or module_qualified_name in self.leaf_names:
            return True
        return isinstance(m, self.leaf_types)

    def call_module(
        self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> Any:
        name = self.path_of_module(m)
        if self.is_leaf_module(m, name):
            if name not in self.leaves:
                self.leaves.append(name)
            return super().call_module(m, forward, args, kwargs)
        if not self.fallback:
            try:
                return super().call_module(m, forward, args, kwargs)
            except Exception as err:
                _remember_module(err, name)  # the innermost module, for the message
                raise
        before = list(self.graph.nodes)[-1] if len(self.graph.nodes) else None
        stack = dict(self.module_stack)
        try:
            out = super().call_module(m, forward, args, kwargs)
            if isinstance(out, fx.Proxy) and any(out is a for a in args) and name not in self.passthrough:
                self.passthrough[name] = out.node.name  # its output is its input: no node of its own
            return out
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
        node = super().create_node(kind, target, *args, **kwargs)
        if kind == "call_function" and target is operator.getitem:
            node.meta[SOURCE_LINE] = _user_line()  # (a slice is named as written: ``labels.line_subscript``)
        return node

    def trace(
        self, root: Union[nn.Module, Callable[..., Any]], concrete_args: Optional[Dict[str, Any]] = None
    ) -> fx.Graph:
        self._modes = _grad_modes()
        graph = super().trace(root, concrete_args)
        if getattr(graph, "_tracer_extras", None) is None:
            graph._tracer_extras = {}
        graph._tracer_extras["target_to_function"] = self.target_to_function
        return graph


def _user_line() -> str:
    """The line of the user's code (outside torch and this package) that is being traced."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() if frame is not None else ""


def _grad_modes() -> Tuple[Any, ...]:
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        *((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")),
    )


class SideEffectError(RuntimeError):
    """``forward`` writes attributes of modules: an fx graph would not repeat the write."""


def trace_module(module: nn.Module, tracer: DeepTracer) -> fx.GraphModule:
    """``tracer``'s graph of ``module`` as a GraphModule; nothing of the trace stays on ``module``."""
    # Nothing of the trace may stay on the user's modules (fx runs forward on proxies), nor
    # on the random number generators (ops without proxy inputs, numpy, run for real).
    with warnings.catch_warnings(), forked_rng() as drawn, guarded(module) as writes:
        warnings.simplefilter("ignore")
        graph = tracer.trace(module)
        gm = fx.GraphModule(module, graph)
    if drawn:  # ops on concrete values ran while tracing: the graph holds their one result
        raise SideEffectError(
            f"forward draws from {' and '.join(drawn)} outside the traced ops; a graph would repeat one draw on "
            f"every step"
        )
    if writes:
        where = ", ".join(str(w) for w in writes[:3])
        raise SideEffectError(f"forward writes module state ({where}), which a graph does not replay")
    return gm


#: id of a trace failure -> (the failure, the innermost module it was raised in); the last
#: few only (an exception takes no attributes of ours, nor weak references)
_FAILED_IN: "OrderedDict[int, Tuple[BaseException, str]]" = OrderedDict()


def _remember_module(err: BaseException, name: str) -> None:
    if _module_of(err) is None:
        _FAILED_IN[id(err)] = (err, name)
        while len(_FAILED_IN) > 8:
            _FAILED_IN.popitem(last=False)


def _module_of(err: BaseException) -> Optional[str]:
    hit = _FAILED_IN.get(id(err))
    return hit[1] if hit is not None and hit[0] is err else None


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package


def failure_reason(err: BaseException) -> str:
    """What failed, where: ``TypeError: ... in `blocks.0.attn` at model.py:42 (code)``."""
    text = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"
    module = _module_of(err)
    if module:
        text += f" in `{module}`"
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if not frame.filename.startswith((_TORCH_DIR, _OWN_DIR)) and "/contextlib.py" not in frame.filename:
            return f"{text} at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return text
