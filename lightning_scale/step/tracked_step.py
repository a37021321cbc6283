"""One tracked step: the recording forwards it swaps into the model, and how to put the
user's own back.

Untracked steps run the user's module untouched; a tracked step replaces ``forward`` of
each captured part (the target module, or its FSDP units) by the captured graph running
under a :class:`~lightning_scale.record.recorder.Recorder`, and ``uninstall`` restores exactly
what was there (an instance attribute, or none so the class's ``forward`` shows through).
On a capture's first tracked step the first call checks the capture first
(``lightning_scale.capture.fidelity``); the outcome is kept in ``check`` for the callback. A
step tracked by a shadow pass (``step.shadow``) swaps in the user's own forward, watched, and
``run_shadow`` runs the instrumented one after the user's backward.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from torch import Tensor, nn

from lightning_scale.capture import Capture
from lightning_scale.capture.coverage import skipped_line
from lightning_scale.capture.frames import strip_compiled
from lightning_scale.capture.forward_swap import ForwardSwap
from lightning_scale.record.recorder import Recorder, recording
from lightning_scale.step.shadow import Shadow
from lightning_scale.step.verification import CaptureCheck, Verify

__all__ = ["TrackedStep", "fsdp_units", "replicated_labels"]


class TrackedStep:
    """What one tracked step swapped in, and how to put it back.

    Args:
        step: the optimizer step.
        prefix: ``""`` for a training step, ``"val_"`` for validation.
        cap: the capture to track with (the callback's; a probe may choose another).
        recorder: where the step's statistics go.
    """

    def __init__(self, step: int, prefix: str, cap: Capture, recorder: Recorder) -> None:
        self.step, self.prefix, self.capture, self.recorder = step, prefix, cap, recorder
        self.loss_scale: Optional[Tensor] = None
        self.check: Optional[CaptureCheck] = None  # the fidelity probe's outcome, for the callback to act on
        self.shadow: Optional[Shadow] = None  # the step's shadow pass, if it is tracked by one
        self._swap = ForwardSwap()

    @property
    def untracked(self) -> bool:
        """The step ran the user's own forward: the probe found no capture to track with."""
        return self.check is not None and self.check.capture is None

    def install(self, target: nn.Module, verify: Optional[Verify] = None, shadow: bool = False) -> None:
        """Swap the recording forwards in. With ``verify``, the first call of the target's
        forward first asks it which capture reproduces the eager forward (``capture.fidelity``),
        and runs that one, or, where the probe says to shadow, the user's own forward watched by
        a shadow pass, or the user's own forward if none does. With ``shadow``, the user's
        forward runs watched (``run_shadow`` records)."""
        if shadow:
            self._shadowed(target, self.capture, self._swap.original(target))
            return
        parts = self.capture.parts()
        for path, fn in parts:
            module = target.get_submodule(path) if path else target
            self._swap.replace(module, _recording(fn, self.recorder))
        if verify is not None and len(parts) == 1:  # (FSDP units run inside the target's forward: not probed)
            self._swap.replace(target, self._verifying(target, verify))

    def _verifying(self, target: nn.Module, verify: Verify) -> Callable[..., Any]:
        eager = self._swap.original(target)

        def first_call(*args: Any, **kwargs: Any) -> Any:
            self.check = verify(self.capture, eager, args, kwargs)
            chosen = self.check.capture
            if self.check.kind == "shadowed" and chosen is not None:
                return self._shadowed(target, chosen, eager)(*args, **kwargs)
            if chosen is None:
                self._swap.replace(target, eager)
                return eager(*args, **kwargs)
            self.capture = chosen
            self._swap.replace(target, _recording(chosen.tracked(), self.recorder))
            return target.forward(*args, **kwargs)

        return first_call

    def _shadowed(self, target: nn.Module, cap: Capture, eager: Callable[..., Any]) -> Callable[..., Any]:
        """The user's forward ``eager``, watched for a shadow pass with ``cap``, as the target's."""
        self.capture, self.shadow = cap, Shadow(target, cap, self.recorder)
        watched = self.shadow.watching(eager)
        self._swap.replace(target, watched)
        return watched

    def run_shadow(self) -> None:
        """The step's shadow pass, if it is tracked by one and its forward ran (after the
        user's backward: the parameters are still those the forward read)."""
        if self.shadow is not None:
            self.shadow.run()

    def end_shadow(self) -> None:
        """At the end of the batch: a validation step's shadow pass (the forward only); a
        training step whose shadow did not run (no backward reached its forward's outputs, so
        the parameters may have changed since) records nothing, and its recorder says why."""
        if self.shadow is None:
            return
        if self.prefix:
            self.shadow.run()
        elif self.shadow.watched and not self.shadow.ran and self.recorder.error is None:
            self.recorder.error = RuntimeError(
                "the shadow pass did not run: no backward came after the model's forward in the step (Lightning's "
                "`on_after_backward`: a `training_step` without a loss, or `loss.backward()` under manual optimization)"
            )

    def uninstall(self) -> None:
        self._swap.restore()

    def skipped_warning(self) -> Optional[str]:
        """Tensors the step saw but could not record (sparse layouts), counted in the
        capture's coverage from now on, as one warning; None if there were none."""
        if not self.recorder.skipped:
            return None
        named = self.capture.add_skipped(self.recorder.skipped)
        return (
            f"ScaleMonitor: {skipped_line(named)} at step {self.step}: no statistics of these tensors, for the "
            "reason given; the rest of the step is recorded"
        )


def _recording(fn: Any, rec: Recorder) -> Any:
    def tracked_forward(*args: Any, **kwargs: Any) -> Any:
        with recording(rec):
            return fn(*args, **kwargs)

    return tracked_forward


def replicated_labels(target: nn.Module) -> "set[str]":
    """Parameter and buffer paths, as labels name them (a compiled submodule's ``_orig_mod``
    left out): under data parallelism every rank holds them whole."""
    names = [n for n, _ in target.named_parameters()] + [n for n, _ in target.named_buffers()]
    return {strip_compiled(n) for n in names}


def fsdp_units(target: nn.Module) -> List[str]:
    """Paths of the FSDP2-wrapped submodules of ``target`` (each is captured as its own part)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [name for name, m in target.named_modules() if name and isinstance(m, FSDPModule)]
