"""Which captures the fidelity probe checks, and what its verdict does to tracking.

The probe itself (``capture.fidelity``) compares a captured forward with the eager one.
``Verification`` decides when it runs (once per capture, on the first tracked step that
uses it, not under strategies whose backward hooks expect one backward per forward) and
turns its outcome into the capture to track with, or into tracking switched off with
one message. Nothing here imports Lightning: the callback passes how ranks agree.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch import nn

from lightning_scale.capture import Capture, fidelity
from lightning_scale.step.tracked_step import Verify

__all__ = ["ONE_BACKWARD_STRATEGIES", "Verification"]

#: Strategies whose backward hooks expect one backward per forward (the probe runs two).
ONE_BACKWARD_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")


class Verification:
    """The fidelity probe's bookkeeping for one callback.

    Args:
        enabled: ``ScaleMonitor(verify_capture=...)``.
        new_capture: builds a capture of a module with a given route (``"fx"`` / ``"dynamo"``).
        replace: called with (the capture, the one the probe chose instead) on a switch.
        disable: switches tracking off for the run, with the reason.
        info: logs one line (rank zero).
    """

    def __init__(
        self,
        enabled: bool,
        new_capture: Callable[[nn.Module, str], Capture],
        replace: Callable[[Capture, Capture], None],
        disable: Callable[[str], None],
        info: Callable[[str], None],
    ) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"`verify_capture` must be True or False, got {enabled!r}")
        self.enabled = enabled
        self.new_capture, self.replace, self.disable, self.info = new_capture, replace, disable, info
        self.verified: "set[int]" = set()  # ids of the captures the probe has checked

    def clear(self) -> None:
        self.verified.clear()

    def probes(self, cap: Capture, strategy: str) -> bool:
        """Whether this step checks ``cap`` first (``strategy``: the strategy's class name)."""
        return self.enabled and id(cap) not in self.verified and strategy not in ONE_BACKWARD_STRATEGIES

    def verifier(self, target: nn.Module, agree: Callable[[bool], bool]) -> Verify:
        """The probe for ``target``'s capture: its route first, then the other. ``agree``
        turns this rank's verdict into every rank's."""

        def verify(cap: Capture, eager: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Capture]:
            other = "fx" if cap.mode == "dynamo" else "dynamo"
            routes = [(cap.mode, lambda: cap), (other, lambda: self.new_capture(target, other))]
            name = type(target).__name__
            self.verified.add(id(cap))
            try:
                outcome = fidelity.verify(target, eager, routes, args, kwargs, agree)
            except Exception as err:  # noqa: BLE001 - the state is put back: the step runs the user's forward
                self.disable(f"checking the capture of {name} failed ({type(err).__name__}: {err})")
                return None
            if outcome.capture is None:
                self.disable(
                    f"the captured forward of {name} does not reproduce its own forward bit for bit, so tracking "
                    f"would change training ({outcome.describe()}); pass `verify_capture=False` to track it anyway"
                )
                return None
            if outcome.switched:
                self.replace(cap, outcome.capture)
                self.verified.add(id(outcome.capture))
            self.info(
                f"ScaleMonitor: capture of {name} verified ({outcome.describe()}); tracking with {outcome.capture.mode}"
            )
            return outcome.capture

        return verify
