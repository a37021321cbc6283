"""ForwardSwap: replace modules' ``forward`` for a while, and put back exactly what was there
(``CompiledCallSwap``: the same for the compiled call ``module.compile()`` installs).

A module's ``forward`` is either its class's method or an instance attribute someone set
(``torch.compile``'s ``OptimizedModule``, a user's wrapper, another swap). ``restore``
brings back that instance attribute, or removes ours so the class's method shows through
again: after it, ``module.__dict__`` holds what it held before. Writes go straight into
``module.__dict__``: ``OptimizedModule`` forwards ``setattr`` to the module it wraps.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, List, Optional, Tuple, Type

from torch import nn

__all__ = ["CompiledCallSwap", "ForwardSwap"]

_MISSING = object()  # no instance ``forward``: the class's shows through


class ForwardSwap:
    """The forwards swapped into modules, restored in reverse order by ``restore()``.

    Example::

        >>> from torch import nn
        >>> m = nn.Identity()
        >>> with ForwardSwap() as swap:
        ...     _ = swap.replace(m, lambda x: 2 * x)
        ...     m(3)
        6
        >>> "forward" in m.__dict__
        False
    """

    def __init__(self) -> None:
        self._saved: List[Tuple[nn.Module, Any]] = []  # (module, its instance forward or _MISSING)

    def replace(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        """Make ``forward`` the module's forward; returns the forward it had before the
        first swap (its instance attribute, or the class's method bound to it)."""
        if not any(m is module for m, _ in self._saved):
            self._saved.append((module, module.__dict__.get("forward", _MISSING)))
        module.__dict__["forward"] = forward
        return self.original(module)

    def original(self, module: nn.Module) -> Callable[..., Any]:
        """The forward ``module`` had before this swap touched it (its current one if untouched)."""
        previous = next((p for m, p in self._saved if m is module), module.__dict__.get("forward", _MISSING))
        return previous if previous is not _MISSING else type(module).forward.__get__(module)

    def restore(self) -> None:
        """Put every swapped module's forward back; the swap can be used again afterwards."""
        for module, previous in reversed(self._saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
        self._saved.clear()

    def __enter__(self) -> "ForwardSwap":
        return self

    def __exit__(
        self, kind: Optional[Type[BaseException]], error: Optional[BaseException], trace: Optional[TracebackType]
    ) -> None:
        self.restore()


class CompiledCallSwap:
    """Swaps what ``module.compile()`` installed (the compiled ``_call_impl`` that
    ``nn.Module.__call__`` runs) for a while, and puts the user's back: the same entry
    of ``module.__dict__``, as ``ForwardSwap`` does for ``forward``."""

    _KEY = "_compiled_call_impl"

    def __init__(self) -> None:
        self._saved: List[Tuple[nn.Module, Any]] = []

    def replace(self, module: nn.Module, call: Callable[..., Any]) -> None:
        self._saved.append((module, module.__dict__[self._KEY]))
        module.__dict__[self._KEY] = call

    def __enter__(self) -> "CompiledCallSwap":
        return self

    def __exit__(self, *exc: object) -> None:
        for module, call in reversed(self._saved):
            module.__dict__[self._KEY] = call
        self._saved.clear()
