"""torchao's float8 training layers: the casts inside them recorded as nodes of their own.

``convert_to_float8_training`` swaps ``nn.Linear`` for ``Float8Linear``, whose forward calls
one ``torch.autograd.Function`` (``matmul_with_hp_or_float8_args``). Dynamo calls it as one
node (``fc1/matmul_with_hp_or_float8_args``); the casts to float8 happen inside it, forward
and backward, through one function of its module, ``hp_tensor_to_float8_dynamic``, told by
``gemm_input_role`` what it casts. On a tracked call, that node runs with the function
swapped for one that also records what torchao cast (the float8 tensor taken back to high
precision: what the matmul multiplies), under the layer's path and the name of the cast in
torchao's ``Float8LinearConfig`` (``cast_config_<name>``):

========================================  =========================================  ==========
label                                     torchao's cast                             direction
========================================  =========================================  ==========
``fc1/cast_input``                        input, forward (e4m3)                      forward
``fc1/cast_weight``                       weight, forward (e4m3)                     forward
``fc1/cast_grad_output``                  output gradient, for the input gradient    backward
``fc1/cast_weight_for_grad_input``        weight, for the input gradient             forward
``fc1/cast_grad_output_for_grad_weight``  output gradient, for the weight gradient   backward
``fc1/cast_input_for_grad_weight``        input, for the weight gradient             forward
========================================  =========================================  ==========

The backward casts are recorded around the Function's backward node (a pre-hook swaps the
function in, a hook puts it back). A cast torchao skips (scaling disabled, an input already
in float8) has no record. torchao is found by duck typing (the Function's module has that
function), never imported; torchao's values are returned as they are, so training does not
change.
"""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import fx

from lightning_scale.capture import frames
from lightning_scale.record import recorder

__all__ = ["CASTS", "cast_module", "with_cast_sites"]

CAST_FUNCTION = "hp_tensor_to_float8_dynamic"
#: (pass, gemm input role, how many of that role before it in the pass) -> the cast's name
CASTS: Dict[Tuple[str, str, int], str] = {
    ("forward", "INPUT", 0): "cast_input",
    ("forward", "WEIGHT", 0): "cast_weight",
    ("backward", "GRAD_OUTPUT", 0): "cast_grad_output",
    ("backward", "WEIGHT", 0): "cast_weight_for_grad_input",
    ("backward", "GRAD_OUTPUT", 1): "cast_grad_output_for_grad_weight",
    ("backward", "INPUT", 0): "cast_input_for_grad_weight",
}


def cast_module(target: object) -> Optional[ModuleType]:
    """The module of the autograd Function behind dynamo's trampoline call ``target`` when it
    casts through ``hp_tensor_to_float8_dynamic`` (torchao's float8 matmul); else None."""
    code = getattr(target, "__code__", None)
    cells = dict(zip(code.co_freevars, getattr(target, "__closure__", None) or ())) if code is not None else {}
    fn_cls = cells["fn_cls"].cell_contents if "fn_cls" in cells else None
    module = sys.modules.get(getattr(fn_cls, "__module__", "")) if isinstance(fn_cls, type) else None
    return module if callable(getattr(module, CAST_FUNCTION, None)) else None


def with_cast_sites(gm: fx.GraphModule, sites: List[frames.NodeSite]) -> List[frames.NodeSite]:
    """``sites`` with, after each float8 matmul node's, its casts' sites (``<node>.<cast>``,
    at the node's module); the node's target swapped for one that records them as it runs."""
    out: List[frames.NodeSite] = []
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in sites:
        out.append(site)
        node = nodes.get(site.name)
        module = cast_module(node.target) if node is not None and node.op == "call_function" else None
        if node is None or module is None:
            continue
        names = {cast: f"{node.name}.{cast}" for cast in CASTS.values()}
        out += [frames.NodeSite(key, site.root, site.path, cast, site.source) for cast, key in names.items()]
        node.target = _recording(node.target, module, names)
    if len(out) > len(sites):
        gm.recompile()
    return out


def _recording(fn: Callable[..., Any], module: ModuleType, names: Dict[str, str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        rec = recorder.active()
        labels = {cast: frames.label_of(key) for cast, key in names.items()}
        if rec is None or not any(labels.values()):
            return fn(*args, **kwargs)
        with _casting(module, rec, labels, "forward"):
            out = fn(*args, **kwargs)
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is not None and torch.is_grad_enabled():
            _around_backward(node, lambda: _casting(module, rec, labels, "backward"))
        return out

    return call


def _around_backward(node: Any, context: Callable[[], Any]) -> None:
    """Run the autograd ``node``'s backward inside ``context()``: entered by a pre-hook,
    left by a hook (both return None: the gradients stay torchao's)."""
    open_: List[contextlib.ExitStack] = []

    def enter(grad_outputs: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(context())
        open_.append(stack)

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        while open_:
            open_.pop().close()

    node.register_prehook(enter)
    node.register_hook(leave)


@contextlib.contextmanager
def _casting(
    module: ModuleType, rec: recorder.Recorder, labels: Dict[str, Optional[str]], phase: str
) -> Iterator[None]:
    """``module``'s cast function records each cast it makes in this block (``phase``: the pass)."""
    original = getattr(module, CAST_FUNCTION)
    seen: Dict[str, int] = {}

    def cast(x: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(x, *args, **kwargs)
        role = str(getattr(kwargs.get("gemm_input_role"), "name", ""))
        label = labels.get(CASTS.get((phase, role, seen.get(role, 0)), ""))
        seen[role] = seen.get(role, 0) + 1
        if label is not None:
            _record(rec, label, out, gradient=role == "GRAD_OUTPUT")
        return out

    setattr(module, CAST_FUNCTION, cast)
    try:
        yield
    finally:
        setattr(module, CAST_FUNCTION, original)


def _record(rec: recorder.Recorder, label: str, cast: Any, gradient: bool) -> None:
    """Record torchao's float8 tensor as the matmul sees it (in high precision); a failure
    marks the step's recorder, never torchao's call."""
    to_high = getattr(cast, "to_original_precision", None)
    if to_high is None or rec.error is not None:
        return
    try:
        with torch.no_grad():
            value = to_high()
        if gradient:
            rec.observe_gradient(label, value)
        else:
            rec.observe(label, value.detach())
    except Exception as err:  # noqa: BLE001 - never break the user's step
        rec.error = err
