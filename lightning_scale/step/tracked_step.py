"""One tracked step: the recording forwards it swaps into the model, and how to put the
user's own back.

Untracked steps run the user's module untouched; a tracked step replaces ``forward`` of
each captured part (the target module, or its FSDP units) by the captured graph running
under a :class:`~lightning_scale.record.recorder.Recorder`, and ``uninstall`` restores exactly
what was there (an instance attribute, or none so the class's ``forward`` shows through).
On a capture's first tracked step the first call checks the capture first
(``lightning_scale.capture.fidelity``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import Tensor, nn

from lightning_scale.capture import Capture
from lightning_scale.record.recorder import Recorder, recording

__all__ = ["TrackedStep", "Verify", "fsdp_units", "replicated_labels"]

_MISSING = object()

#: (capture, the user's forward, args, kwargs) -> the capture to track with, or None
Verify = Callable[[Capture, Callable[..., Any], Tuple[Any, ...], Dict[str, Any]], Optional[Capture]]


class TrackedStep:
    """What one tracked step swapped in, and how to put it back."""

    def __init__(self, step: int, prefix: str, cap: Capture, recorder: Recorder) -> None:
        self.step, self.prefix, self.capture, self.recorder = step, prefix, cap, recorder
        self.loss_scale: Optional[Tensor] = None
        self.untracked = False  # the fidelity probe found no route that keeps training as it is
        self._saved: List[Tuple[nn.Module, Any]] = []

    def install(self, target: nn.Module, verify: Optional[Verify] = None) -> None:
        """Swap the recording forwards in. With ``verify``, the first call of the target's
        forward first asks it which capture reproduces the eager forward (``capture.fidelity``),
        and runs that one, or the user's own forward if none does."""
        parts = self.capture.parts()
        for path, fn in parts:
            module = target.get_submodule(path) if path else target
            self._saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = _recording(fn, self.recorder)  # type: ignore[method-assign]
        if verify is not None and len(parts) == 1:  # (FSDP units run inside the target's forward: not probed)
            target.forward = self._verifying(target, verify)  # type: ignore[method-assign]

    def _verifying(self, target: nn.Module, verify: Verify) -> Callable[..., Any]:
        previous = self._saved[0][1]
        eager = previous if previous is not _MISSING else type(target).forward.__get__(target)

        def first_call(*args: Any, **kwargs: Any) -> Any:
            chosen = verify(self.capture, eager, args, kwargs)
            if chosen is None:
                self.untracked = True
                target.forward = eager  # type: ignore[method-assign]
                return eager(*args, **kwargs)
            self.capture = chosen
            target.forward = _recording(chosen.tracked(), self.recorder)  # type: ignore[method-assign]
            return target.forward(*args, **kwargs)

        return first_call

    def uninstall(self) -> None:
        for module, previous in reversed(self._saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._saved.clear()


def _recording(fn: Any, rec: Recorder) -> Any:
    def tracked_forward(*args: Any, **kwargs: Any) -> Any:
        with recording(rec):
            return fn(*args, **kwargs)

    return tracked_forward


def replicated_labels(target: nn.Module) -> "set[str]":
    """Parameter and buffer paths: under data parallelism every rank holds them whole."""
    return {n for n, _ in target.named_parameters()} | {n for n, _ in target.named_buffers()}


def fsdp_units(target: nn.Module) -> List[str]:
    """Paths of the FSDP2-wrapped submodules of ``target`` (each is captured as its own part)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [name for name, m in target.named_modules() if name and isinstance(m, FSDPModule)]
