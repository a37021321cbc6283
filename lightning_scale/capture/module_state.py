"""Module state: what a trace writes on the user's modules, found and undone.

fx runs ``forward``'s Python on proxies: ``self.aux_loss = ...`` leaves a ``Proxy`` on the
live module, and the traced graph never repeats the write. ``guarded(root)`` records every
attribute write on a module of ``root`` while the trace runs (with the source line that
made it) and afterwards restores each module's attributes, parameters, buffers and
submodules as they were, so nothing of a trace stays on the model.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Set, Tuple

import torch
from torch import nn

__all__ = ["Write", "guarded"]

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
    m: nn.Module, attrs: Dict[str, Any], slots: List[Dict[str, Any]], writes: List[Write], paths: Dict[int, str], ignored: Set[Tuple[str, str]]
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
