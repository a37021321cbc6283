"""Anomaly detection: decide, without stalling the device, that the next steps are tracked.

A training step is *anomalous* when its loss is non-finite, when its loss jumps above
``factor`` times the running median of recent losses, or when a GradScaler skipped its
optimizer step (non-finite gradients). ``AnomalyDetector`` turns that into "track the next
``steps`` steps".

Reading a device loss on the host is a sync, so the detector reads each loss late:

* batch end of step ``t``: a 3-number payload ``[non-finite, skipped, loss]`` is built on the
  device and, under ``torch.distributed``, an asynchronous ``all_reduce(MAX)`` starts, so
  every rank decides from the same numbers (the worst rank's);
* batch start of step ``t + 1``: the reduction is waited for (on NCCL this only orders
  streams) and the payload is copied to a pinned host buffer with ``non_blocking=True``,
  followed by a CUDA event;
* batch start of step ``t + 2``: the host reads the buffer. A whole step has passed since
  the copy was queued, so the event has completed in practice (``query()``); if not, the
  detector waits for that event (``stalls`` counts it) rather than skip it, because a read
  that depended on timing would let ranks decide differently and then wait forever in the
  tracked step's collective. The wait is for work queued a step earlier: the device keeps
  running the step queued since.

So a spike at step ``s`` triggers tracking of steps ``s + 2 .. s + 1 + steps``: one step of
latency. On CPU the copy is a no-op and the read is free; the timing is kept identical so
that behaviour does not depend on the device.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale import arguments

__all__ = ["Anomaly", "AnomalyDetector", "AnomalyTrigger", "LATENCY", "judge"]

#: Steps between the step whose loss is anomalous and the first step it triggers, minus one.
LATENCY = 1
_NONFINITE, _SKIPPED, _LOSS = range(3)


@dataclass(frozen=True)
class Anomaly:
    """One detected event: the step whose numbers were anomalous and what it triggers.

    Attributes:
        step: the step whose loss (or optimizer step) was anomalous.
        loss: its loss, the maximum over ranks (NaN when some rank's loss was non-finite).
        median: the running median it was compared with (NaN before there was one).
        reason: why, in words.
        first: the first step tracked because of it.
        last: the last step tracked because of it.
    """

    step: int
    loss: float
    median: float
    reason: str
    first: int
    last: int

    def describe(self) -> str:
        """One line for a text log."""
        return (
            f"step {self.step}: loss {self.loss:.6g} (running median {self.median:.6g}); {self.reason}; "
            f"tracking steps {self.first}..{self.last}"
        )


def judge(loss: float, nonfinite: bool, skipped: bool, median: Optional[float], factor: float) -> Optional[str]:
    """Why a step is anomalous, or ``None`` (pure; see the module docstring).

    A spike is only judged against a positive median: a ratio to a median at or below zero
    (losses that are log-likelihoods, say) says nothing about a jump.
    """
    reasons: List[str] = []
    if nonfinite:
        reasons.append("non-finite loss")
    elif median is not None and median > 0 and loss > factor * median:
        reasons.append(f"loss spike: {loss:.6g} > {factor:g} x running median {median:.6g}")
    if skipped:
        reasons.append("GradScaler skipped the optimizer step (non-finite gradients)")
    return "; ".join(reasons) or None


class _LossWindow:
    """The last ``size`` finite losses and their median (``None`` until ``min_count``)."""

    def __init__(self, size: int, min_count: int) -> None:
        self.values: Deque[float] = deque(maxlen=size)
        self.min_count = min_count

    def median(self) -> Optional[float]:
        return statistics.median(self.values) if len(self.values) >= self.min_count else None

    def add(self, loss: float) -> None:
        if math.isfinite(loss):
            self.values.append(loss)


class AnomalyDetector:
    """Watches the loss (and a GradScaler) of every step; see the module docstring.

    Call ``poll(step)`` at the start of every batch, then ``observe(step, loss, ...)`` at its
    end, on every rank in the same order. ``tracks(step)`` says whether an anomaly asks for
    ``step`` to be tracked; ``poll`` returns the anomaly it detected, if any.

    Args:
        steps: how many steps an anomaly tracks (positive).
        factor: a loss above ``factor`` x the running median is a spike (> 1).
        window: how many recent finite losses the median is taken over.
        min_history: no spike is judged before this many losses were seen.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).

    Example::

        detector = AnomalyDetector(steps=4)
        for step, batch in enumerate(batches):
            detector.poll(step)
            loss = train(batch)
            detector.observe(step, loss)
    """

    def __init__(self, steps: int, factor: float = 10.0, window: int = 32, min_history: int = 4) -> None:
        steps, factor = check_arguments(steps, factor)
        if steps == 0:
            raise ValueError(f"`anomaly_steps` must be positive for a detector, got {steps!r}")
        window = arguments.positive_int("window", window)
        if arguments.positive_int("min_history", min_history) > window:
            raise ValueError(f"`min_history` must be in [1, window={window}], got {min_history!r}")
        self.steps, self.factor = steps, factor
        self.losses = _LossWindow(window, min_history)
        self.anomalies: List[Anomaly] = []
        self.stalls = 0  # reads that found their copy unfinished and waited for it
        self._reducing: Optional[Tuple[int, Tensor, Optional[dist.Work]]] = None
        self._copying: Optional[Tuple[int, Tensor, Optional[torch.cuda.Event]]] = None
        self._until = -1

    def tracks(self, step: int) -> bool:
        """Whether an anomaly asks for ``step`` to be tracked."""
        return self.anomalies != [] and self.anomalies[-1].first <= step <= self._until

    def observe(
        self, step: int, loss: Tensor, scale_before: Optional[Tensor] = None, scale_after: Optional[Tensor] = None
    ) -> None:
        """Queue step ``step``'s loss (and whether its GradScaler backed off) for a lagged read.

        ``scale_before``/``scale_after``: the GradScaler's scale tensor before and after its
        ``update()``; the scale shrinks exactly when the step was skipped. Nothing is read.
        """
        payload = _payload(loss, scale_before, scale_after)
        work = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(payload, op=dist.ReduceOp.MAX, async_op=True)
        self._reducing = (step, payload, work)

    def poll(self, step: int) -> Optional[Anomaly]:
        """Advance the pipeline at the start of step ``step``'s batch: read the copy queued one
        batch ago and judge it, then queue the copy of the latest reduction."""
        found = self._read(step) if self._copying is not None else None
        if self._reducing is not None:
            self._copying = _start_copy(*self._reducing)
            self._reducing = None
        return found

    def reset(self) -> None:
        """Drop the losses in flight (a new fit, or an exception): nothing half-read survives."""
        self._reducing = self._copying = None

    def _read(self, step: int) -> Optional[Anomaly]:
        assert self._copying is not None
        seen, host, event = self._copying
        self._copying = None
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()
        nonfinite, skipped, loss = host.tolist()  # a host buffer: no device read
        median = self.losses.median()
        loss = math.nan if nonfinite else loss
        self.losses.add(loss)
        reason = judge(loss, bool(nonfinite), bool(skipped), median, self.factor)
        if reason is None:
            return None
        first = step if not self.tracks(step) else self.anomalies[-1].first
        self._until = step + self.steps - 1
        found = Anomaly(seen, loss, math.nan if median is None else median, reason, first, self._until)
        self.anomalies.append(found)
        return found


class AnomalyTrigger:
    """A fit's anomaly detection as the callback drives it: the detector of the current
    fit, the GradScaler's scale before each optimizer step (it shrinks iff the step is
    skipped), and a detector that fails switched off with ``on_error`` called once (a
    monitor fault must not stop training).

    Args:
        steps: how many steps an anomaly tracks; 0: detection is off.
        factor: the spike threshold (see ``AnomalyDetector``).
        on_error: called with the exception when detection fails; it is then off for the fit.
    """

    def __init__(self, steps: int, factor: float, on_error: Callable[[Exception], None]) -> None:
        self.steps, self.factor = check_arguments(steps, factor)
        self.on_error = on_error
        self.detector: Optional[AnomalyDetector] = None
        self._scale_before: Optional[Tensor] = None
        self._batch_step = -1

    def start_fit(self) -> None:
        self.detector = AnomalyDetector(self.steps, self.factor) if self.steps else None

    def tracks(self, step: int) -> bool:
        return self.detector is not None and self.detector.tracks(step)

    def poll(self, step: int) -> Optional[Anomaly]:
        """At batch start: the anomaly judged from the loss read one batch late, if any."""
        self._batch_step = step
        if self.detector is None:
            return None
        try:
            return self.detector.poll(step)
        except Exception as err:  # noqa: BLE001 - a monitor fault must not stop training
            self._stop(err)
            return None

    def remember_scale(self, scaler: Any) -> None:
        """Before the optimizer step: a device copy of the GradScaler's scale."""
        scale = getattr(scaler, "_scale", None)
        if self.detector is not None and isinstance(scale, Tensor):
            self._scale_before = scale.detach().clone()

    def observe(self, outputs: Any, scaler: Any) -> None:
        """At batch end: the step's loss (``training_step``'s output) and the scale after."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.detector is None or not isinstance(loss, Tensor):
            return
        after = getattr(scaler, "_scale", None) if self._scale_before is not None else None
        try:
            self.detector.observe(self._batch_step, loss, self._scale_before, after)
        except Exception as err:  # noqa: BLE001 - a monitor fault must not stop training
            self._stop(err)
        self._scale_before = None

    def clear(self) -> None:
        self._scale_before = None

    def reset(self) -> None:
        """After an exception in the fit: nothing in flight is waited for."""
        if self.detector is not None:
            self.detector.reset()

    def _stop(self, err: Exception) -> None:
        self.detector = None
        self.on_error(err)


def check_arguments(steps: int, factor: float) -> Tuple[int, float]:
    """``(steps, factor)`` checked, or a ``ValueError`` naming ``anomaly_steps`` or ``anomaly_factor``."""
    checked = arguments.non_negative_int("anomaly_steps", steps, note="0 turns detection off")
    return checked, arguments.number("anomaly_factor", factor, above=1)


def _payload(loss: Tensor, scale_before: Optional[Tensor], scale_after: Optional[Tensor]) -> Tensor:
    value = loss.detach().to(torch.float64).reshape(())
    finite = torch.isfinite(value)
    if scale_before is not None and scale_after is not None:
        skipped = (scale_after.detach().reshape(()) < scale_before.detach().reshape(())).to(torch.float64)
    else:
        skipped = torch.zeros((), dtype=torch.float64, device=value.device)
    # A non-finite loss becomes 0 in the MAX slot: NaN would make the reduction's result
    # depend on the backend's comparison rules.
    return torch.stack([(~finite).to(torch.float64), skipped, torch.where(finite, value, torch.zeros_like(value))])


def _start_copy(
    step: int, payload: Tensor, work: Optional[dist.Work]
) -> Tuple[int, Tensor, Optional[torch.cuda.Event]]:
    if work is not None:
        work.wait()  # NCCL: the current stream waits, the host does not
    if payload.device.type != "cuda":
        return step, payload.to("cpu", non_blocking=True), None
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)
    host.copy_(payload, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return step, host, event
