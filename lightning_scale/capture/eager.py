"""What the user's eager forward sees, kept under the dynamo route's trace.

The dynamo route compiles the user's forward only to capture it: the user's own forward
is not compiled, so two things dynamo would change are put back.

- **Branches on ``torch.compiler.is_compiling()``** (``torch._utils.is_compiling``,
  ``torch._dynamo.external_utils.is_compiling``) trace as False, as the eager forward
  takes them: transformers' Mamba scans with a loop eagerly and with ``associative_scan``
  when compiling, and the fidelity probe refused the dynamo route on the last bits of the
  gradients. ``torch.compiler.is_dynamo_compiling()`` keeps saying that dynamo traces.
  Compiled submodules (``torch.compile(block)``) run the user's compiled code, where
  ``is_compiling()`` is true: ``as_compiled`` puts dynamo's answer back while they run.
- **Module calls outside the captured graphs.** A frame dynamo skips (a graph break inside
  a loop skips the whole frame: Wav2Vec2's encoder with LayerDrop, a model whose blocks are
  FSDP2 units) runs eagerly. The user's modules it calls are compiled as frames of their
  own (each encoder layer), whose graphs name their output (``compiled_labels.own_output``);
  torch's own modules (``nn.LayerNorm``) are not, unless they have hooks.
  ``EagerCalls`` hooks them for the tracked call: dynamo then compiles their ``forward``
  as a frame of its own, and a hook inside a graph traces to nothing
  (``is_dynamo_compiling()``); where the call still runs eagerly (under
  ``torch.compiler.disable``), the hook records the module's output under its path, and
  its own parameters where no graph recorded them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Set

import torch
from torch import fx, nn

from lightning_scale.record import recorder

__all__ = ["EagerCalls", "as_compiled", "eager_branches", "first_tensor"]

_STATE = {"eager": False}


def _flags() -> List[Callable[[], bool]]:
    import torch._dynamo.external_utils as external
    import torch._utils as utils

    return [torch.compiler.is_compiling, getattr(utils, "is_compiling", None), getattr(external, "is_compiling", None)]


def _patched(original: Callable[[], Dict[Any, Any]]) -> Callable[[], Dict[Any, Any]]:
    flags = [f for f in _flags() if f is not None]

    def tracing_state_functions() -> Dict[Any, Any]:
        table = original()
        if _STATE["eager"]:
            table = {**table, **{f: False for f in flags if f in table}}
        return table

    return tracing_state_functions


@contextlib.contextmanager
def eager_branches() -> Iterator[None]:
    """While dynamo traces in this block, ``torch.compiler.is_compiling()`` is False (where
    this torch's dynamo answers it from ``variables.torch.tracing_state_functions``; else
    dynamo's own answer stays)."""
    from torch._dynamo.variables import torch as variables

    original = getattr(variables, "tracing_state_functions", None)
    if original is None:
        yield
        return
    previous = _STATE["eager"]
    variables.tracing_state_functions = _patched(original)
    _STATE["eager"] = True
    try:
        yield
    finally:
        _STATE["eager"] = previous
        variables.tracing_state_functions = original


@contextlib.contextmanager
def as_compiled() -> Iterator[None]:
    """Dynamo's own answer (``is_compiling()`` true) in this block: compiled submodules."""
    previous, _STATE["eager"] = _STATE["eager"], False
    try:
        yield
    finally:
        _STATE["eager"] = previous


def first_tensor(out: Any) -> Optional[torch.Tensor]:
    """A module's output tensor: itself, or the first item of a tuple, list or mapping
    (``(output, state)`` of an RNN, a transformers ``ModelOutput``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class EagerCalls:
    """Forward hooks, for one tracked call, that record module calls run outside the graphs.

    Args:
        paths: id of each module -> its path in the captured module.
        is_labelled: whether a graph of the capture already names a label.
        register: called once per new label with ``(key, label)``: ``key`` is
            ``module_key + path`` for a module output, ``param_key + name`` for a parameter.
        module_key, param_key: the key prefixes (labels of no graph node).
        record: whether a hook that runs eagerly records (not under tensor parallelism, whose
            placements are known inside the graphs only: the hooks still make dynamo
            compile the modules' frames).
    """

    def __init__(
        self,
        paths: Dict[int, str],
        is_labelled: Callable[[str], bool],
        register: Callable[[str, str], None],
        module_key: str,
        param_key: str,
        record: bool = True,
    ) -> None:
        self._record = record
        self._paths = paths
        self._is_labelled = is_labelled
        self._register = register
        self._keys = (module_key, param_key)
        self._mine: Set[str] = set()  # labels this records
        self._theirs: Set[str] = set()  # labels a graph records
        self._hooks: Dict[int, Callable[..., None]] = {}  # (one function per module: dynamo guards on it)

    @contextlib.contextmanager
    def hooked(self, modules: List[nn.Module]) -> Iterator[None]:
        """``modules`` hooked in this block."""
        handles = [m.register_forward_hook(self._hook(m)) for m in modules if id(m) in self._paths]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, module: nn.Module) -> Callable[..., None]:
        hook = self._hooks.get(id(module))
        if hook is None:
            path = self._paths[id(module)]

            def hook(m: nn.Module, args: Any, out: Any) -> None:
                if torch.compiler.is_dynamo_compiling() or recorder.active() is None or not self._record:
                    return  # (inside a graph: the graph records it, and this traces to nothing)
                self._seen(path, m, out)

            self._hooks[id(module)] = hook
        return hook

    def _seen(self, path: str, module: nn.Module, out: Any) -> None:
        x = first_tensor(out)
        if x is not None and self._take(path, self._keys[0]):
            recorder.observe(x, path)
        for name, p in module.named_parameters(recurse=False):
            label = f"{path}.{name}"
            if self._take(label, self._keys[1]):
                recorder.observe(p, label)

    def _take(self, label: str, key: str) -> bool:
        """Whether this records ``label`` (no graph does): registered on first sight."""
        if label in self._mine:
            return True
        if label in self._theirs or self._is_labelled(label):
            self._theirs.add(label)
            return False
        self._mine.add(label)
        self._register(key + label, label)
        return True


def empty_graph() -> fx.GraphModule:
    """The graph a label without a node belongs to."""
    return fx.GraphModule(nn.Module(), fx.Graph())
