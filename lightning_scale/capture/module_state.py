"""Module state: what a trace writes on the user's modules, found and undone.

fx runs ``forward``'s Python on proxies: ``self.aux_loss = ...`` leaves a ``Proxy`` on the
live module, and the traced graph never repeats the write. ``guarded(root)`` records every
attribute write on a module of ``root`` while the trace runs (with the source line that
made it) and afterwards restores each module's attributes, parameters, buffers and
submodules as they were, so nothing of a trace stays on the model.

``Snapshot`` is the same promise for a forward that runs for real but must leave no trace
(the fidelity probe, a trace that draws random numbers): the random number generators
(torch's CPU and CUDA generators, numpy's and Python's ``random``) and every module's
state (buffer values such as BatchNorm's running statistics, attributes, the contents of
dict, list and set attributes such as hook tables) are saved and put back exactly.
Parameter values are not saved: a forward that writes its parameters in place is not
undone.
"""

from __future__ import annotations

import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Set, Tuple

import torch
from torch import nn

__all__ = ["Snapshot", "Write", "forked_rng", "guarded"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_FX_DIR = os.path.join(_TORCH_DIR, "fx")
_SLOTS = ("_parameters", "_buffers", "_modules")


@dataclass
class Write:
    """An attribute write on a module during a trace: module path, attribute, source line."""

    module: str
    attribute: str
    where: str

    def __str__(self) -> str:
        path = f"{self.module}.{self.attribute}" if self.module else self.attribute
        return f"`{path}` assigned in forward at {self.where}"


def _user_line() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back  # type: ignore[assignment]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


@contextmanager
def guarded(root: nn.Module) -> Iterator[List[Write]]:
    """Collect attribute writes on ``root``'s modules in the block, then undo every one."""
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    saved: Dict[int, Any] = {
        id(m): (m, dict(m.__dict__), *(dict(getattr(m, s)) for s in _SLOTS)) for m in root.modules()
    }
    writes: List[Write] = []
    tracer_writes: Set[Tuple[str, str]] = set()
    original = nn.Module.__setattr__

    def recording_setattr(self: nn.Module, name: str, value: Any) -> None:
        if id(self) in paths:
            if sys._getframe(1).f_code.co_filename.startswith(_FX_DIR):
                # fx's own bookkeeping (``_tensor_constant0`` for a tensor built in forward):
                # the graph reads it back, so it is no side effect; it is still undone below.
                tracer_writes.add((paths[id(self)], name))
            else:
                writes.append(Write(paths[id(self)], name, _user_line()))
        original(self, name, value)

    nn.Module.__setattr__ = recording_setattr  # type: ignore[method-assign]
    try:
        yield writes
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]
        for m, attrs, *slots in saved.values():
            _restore(m, attrs, slots, writes, paths, tracer_writes)


def _restore(
    m: nn.Module,
    attrs: Dict[str, Any],
    slots: List[Dict[str, Any]],
    writes: List[Write],
    paths: Dict[int, str],
    ignored: Set[Tuple[str, str]],
) -> None:
    # Identity, not equality: values are tensors and proxies.
    changed = [k for k in set(m.__dict__) | set(attrs) if m.__dict__.get(k, _GONE) is not attrs.get(k, _GONE)]
    for name, content in zip(_SLOTS, slots):
        now = getattr(m, name)
        changed += [k for k in set(now) | set(content) if now.get(k, _GONE) is not content.get(k, _GONE)]
    known = {(w.module, w.attribute) for w in writes} | ignored
    path = paths.get(id(m), "?")
    writes.extend(Write(path, k, "?") for k in changed if (path, k) not in known)
    m.__dict__.clear()
    m.__dict__.update(attrs)
    for name, content in zip(_SLOTS, slots):
        slot = getattr(m, name)
        slot.clear()
        slot.update(content)


_GONE = object()


_CONTAINERS = (dict, list, set)


class Snapshot:
    """The random number generators and ``root``'s module state now; ``restore()`` puts
    them back (as often as needed), keeping every object's identity."""

    def __init__(self, root: nn.Module) -> None:
        self._rng = _rng_state()
        self._modules = [_module_state(m) for m in root.modules()]

    def restore(self) -> None:
        _set_rng_state(self._rng)
        for m, attrs, contents, tensors in self._modules:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for container, saved in contents:
                _refill(container, saved)
            with torch.no_grad():
                for t, value in tensors:
                    t.copy_(value)


def _module_state(
    m: nn.Module,
) -> Tuple[nn.Module, Dict[str, Any], List[Tuple[Any, Any]], List[Tuple[torch.Tensor, torch.Tensor]]]:
    attrs = dict(m.__dict__)
    # containers (``_buffers``, ``_forward_hooks``, user lists) are refilled in place
    contents = [(v, _copy_of(v)) for v in attrs.values() if isinstance(v, _CONTAINERS)]
    values = [*m._buffers.values(), *(v for v in attrs.values() if type(v) is torch.Tensor)]
    tensors = [
        (t, t.detach().clone()) for t in values if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
    ]
    return m, attrs, contents, tensors


def _copy_of(container: Any) -> Any:
    return list(container.items()) if isinstance(container, dict) else list(container)


def _refill(container: Any, saved: Any) -> None:
    container.clear()
    if isinstance(container, dict):
        container.update(saved)
    elif isinstance(container, list):
        container.extend(saved)
    else:
        container.update(saved)


def _rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


_RNG_NAMES = {
    "torch": "torch's CPU generator",
    "cuda": "torch's CUDA generators",
    "numpy": "numpy's generator",
    "random": "Python's `random`",
}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # a numpy array
        return bool((a == b).all())
    return bool(a == b)


@contextmanager
def forked_rng() -> Iterator[List[str]]:
    """Random numbers drawn in the block leave every generator as it was. Yields a list
    that, after the block, names the generators it drew from."""
    state = _rng_state()
    drawn: List[str] = []
    try:
        yield drawn
    finally:
        after = _rng_state()
        drawn.extend(_RNG_NAMES[k] for k in state if k in after and not _same(state[k], after[k]))
        _set_rng_state(state)
