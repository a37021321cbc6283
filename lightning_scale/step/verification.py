"""Which captures the fidelity probe checks, and the outcome it hands the callback.

The probe itself (``capture.fidelity``) compares a captured forward with the eager one.
``Verification`` decides when it runs (once per capture, on the first tracked step that
uses it, not under strategies whose backward hooks expect one backward per forward);
``check_capture`` runs it and returns a ``CaptureCheck``: verified, switched to the other
route, shadowed (no route reproduces the forward, but one runs: a shadow pass tracks with
it, ``step.shadow``), failed (tracking would change training, or the check itself broke), or
interrupted (the model's own forward raised, or another rank failed, during the check:
nothing is concluded). The callback acts on it, as Lightning's ``ModelSummary`` is
computed by a utility and used by its callback. Nothing here imports Lightning: the
callback passes how ranks agree and how a capture of another route is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

from torch import nn

from lightning_scale.capture import Capture, fidelity

__all__ = [
    "EAGER_BRANCHES",
    "ONE_BACKWARD_STRATEGIES",
    "CaptureCheck",
    "Verification",
    "Verify",
    "agree_over_ranks",
    "check_capture",
]

#: Strategies whose backward hooks expect one backward per forward (the probe runs two).
ONE_BACKWARD_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")

CheckKind = Literal["verified", "switched", "shadowed", "failed", "interrupted"]
#: The dynamo route as the user's eager forward branches (``Capture.eager_branches``).
EAGER_BRANCHES = "dynamo with is_compiling() false"


@dataclass(frozen=True)
class CaptureCheck:
    """What the fidelity probe concluded about one capture.

    Attributes:
        kind: ``"verified"``: ``checked`` reproduces the model's forward; ``"switched"``:
            the other route does, track with ``capture``; ``"shadowed"``: no route does, but
            ``capture`` runs (it rounds differently): track by a shadow pass with it; ``"failed"``: no route does, or
            the check itself broke (tracking off, ``why`` says why); ``"interrupted"``:
            the model's own forward raised, or the ranks could not compare verdicts
            (another rank failed), so nothing is concluded and the step runs the model's
            own forward.
        checked: the capture the step was going to track with.
        capture: the capture to track with (``verified``, ``switched``, ``shadowed``), else None.
        why: the line to log (``verified``, ``switched``, ``shadowed``), or the reason (``failed``,
            ``interrupted``).
    """

    kind: CheckKind
    checked: Capture
    capture: Optional[Capture]
    why: str


#: (capture, the user's forward, args, kwargs) -> what the probe concluded
Verify = Callable[[Capture, Callable[..., Any], Tuple[Any, ...], Dict[str, Any]], CaptureCheck]


def check_capture(
    target: nn.Module,
    cap: Capture,
    eager: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    *,
    build: Callable[[str], Capture],
    agree: Callable[[bool], bool],
    shadow: bool = False,
) -> CaptureCheck:
    """Run the fidelity probe on ``target``'s capture ``cap``: its route first, then the
    other (a capture of it from ``build(route)``). ``eager``, ``args``, ``kwargs``: the
    user's forward and the step's inputs; ``agree`` turns this rank's verdict into every
    rank's; ``shadow``: where no route reproduces the forward but one runs, track by a
    shadow pass with it (``ScaleMonitor(shadow="auto")``). Never raises: every failure is an outcome."""
    routes = _routes(cap, build)
    name = type(target).__name__
    try:
        outcome = fidelity.verify(target, eager, routes, args, kwargs, agree)
    except fidelity.ProbeInterrupted as err:
        return CaptureCheck("interrupted", cap, None, f"the check of the capture of {name} was interrupted ({err})")
    except Exception as err:  # noqa: BLE001 - the state is put back: the step runs the user's forward
        why = f"checking the capture of {name} failed ({type(err).__name__}: {err})"
        return CaptureCheck("failed", cap, None, why)
    if outcome.capture is None and shadow and outcome.differing is not None:
        line = (
            f"ScaleMonitor: the captured forward of {name} does not reproduce its own forward bit for bit "
            f"({outcome.describe()}); tracking by a shadow pass with {outcome.differing.mode}: each tracked step runs "
            "the model's own forward and backward untouched, then the instrumented ones again from the same state, "
            "whose statistics describe the same tensors up to the rounding of the instrumented version"
        )
        return CaptureCheck("shadowed", cap, outcome.differing, line)
    if outcome.capture is None:
        why = (
            f"the captured forward of {name} does not reproduce its own forward bit for bit, so tracking "
            f"would change training ({outcome.describe()}); pass `verify_capture=False` to track it anyway"
        )
        return CaptureCheck("failed", cap, None, why)
    route = outcome.verdicts[-1].route
    line = f"ScaleMonitor: capture of {name} verified ({outcome.describe()}); tracking with {route}"
    return CaptureCheck("switched" if outcome.switched else "verified", cap, outcome.capture, line)


def _routes(cap: Capture, build: Callable[[str], Capture]) -> List[Tuple[str, Callable[[], Capture]]]:
    """The routes the probe tries, ``cap``'s first: fx, and dynamo, then dynamo with
    ``is_compiling()`` traced as False (``EAGER_BRANCHES``: only where dynamo changes the
    forward, as a model that branches on it does: it may cost graph breaks elsewhere)."""

    def made(mode: str) -> Callable[[], Capture]:
        return (lambda: cap) if cap.mode == mode else (lambda: build(mode))

    def eager_branches() -> Capture:
        variant = build("dynamo")
        variant.eager_branches = True
        return variant

    dynamo = [("dynamo", made("dynamo")), (EAGER_BRANCHES, eager_branches)]
    return dynamo + [("fx", made("fx"))] if cap.mode == "dynamo" else [("fx", made("fx")), *dynamo]


class Verification:
    """Which captures the fidelity probe has checked, for one callback.

    Args:
        enabled: ``ScaleMonitor(verify_capture=...)``.

    Raises:
        ValueError: ``enabled`` is not a bool.
    """

    def __init__(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise ValueError(f"`verify_capture` must be True or False, got {enabled!r}")
        self.enabled = enabled
        self.verified: "set[int]" = set()  # ids of the captures a settled check covers

    def clear(self) -> None:
        self.verified.clear()

    def probes(self, cap: Capture, strategy: str) -> bool:
        """Whether this step checks ``cap`` first (``strategy``: the strategy's class name)."""
        return self.enabled and id(cap) not in self.verified and strategy not in ONE_BACKWARD_STRATEGIES

    def verifier(
        self, target: nn.Module, build: Callable[[str], Capture], agree: Callable[[bool], bool], shadow: bool = False
    ) -> Verify:
        """``check_capture`` for ``target``, to be called with the step's forward and inputs
        (``shadow``: a refused capture that runs is tracked by a shadow pass)."""
        return functools.partial(check_capture, target, build=build, agree=agree, shadow=shadow)

    def settle(self, check: CaptureCheck) -> None:
        """The callback acted on ``check``: its captures are not probed again. An
        interrupted check (or one whose step raised before it was acted on) is not settled,
        so the capture is probed again on its next tracked step."""
        if check.kind == "interrupted":
            return
        self.verified.add(id(check.checked))
        if check.capture is not None:
            self.verified.add(id(check.capture))


def agree_over_ranks(trainer: Any, ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (``trainer``: Lightning's, its strategy reduces)."""
    return ok if trainer.world_size == 1 else bool(trainer.strategy.reduce_boolean_decision(ok, all=True))
