"""One tracked step: the recording forwards it swaps into the model, and how to put the
user's own back.

Untracked steps run the user's module untouched; a tracked step replaces ``forward`` of
each captured part (the target module, or its FSDP units) by the captured graph running
under a :class:`~lightning_scale.record.recorder.Recorder`, and ``uninstall`` restores exactly
what was there (an instance attribute, or none so the class's ``forward`` shows through).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from torch import Tensor, nn

from lightning_scale.capture import Capture
from lightning_scale.record.recorder import Recorder, recording

__all__ = ["TrackedStep", "fsdp_units", "replicated_labels"]

_MISSING = object()


class TrackedStep:
    """What one tracked step swapped in, and how to put it back."""

    def __init__(self, step: int, prefix: str, cap: Capture, recorder: Recorder) -> None:
        self.step, self.prefix, self.capture, self.recorder = step, prefix, cap, recorder
        self.loss_scale: Optional[Tensor] = None
        self._saved: List[Tuple[nn.Module, Any]] = []

    def install(self, target: nn.Module) -> None:
        for path, fn in self.capture.parts():
            module = target.get_submodule(path) if path else target
            self._saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = _recording(fn, self.recorder)  # type: ignore[method-assign]

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
