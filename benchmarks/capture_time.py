"""Capture time at fit start: the deep fx trace, and TorchDynamo's first call.

* fx: the wall time of ``capture(model, "fx")`` (trace, labels, code generation).
* dynamo: ``capture(model, "dynamo")`` is lazy; its cost is paid by the first tracked
  call, which compiles. Reported as that call's time minus a plain forward's, after
  ``torch._dynamo.reset()`` so every repeat compiles from scratch. The first repeat
  of the process also pays dynamo's one-off imports; it is reported apart ("cold").
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import List, Tuple

import torch

from workload import Size, Workload

from lightning_scale import Recorder, capture, recording


@dataclass(frozen=True)
class CaptureTimes:
    size: Size
    fx: List[float]
    nodes: int
    dynamo: List[float]  # first tracked call minus a plain forward, per repeat
    dynamo_graphs: int

    @property
    def fx_median(self) -> float:
        return statistics.median(self.fx)

    @property
    def dynamo_median(self) -> float:
        """Median of the warm repeats (all but the first, when there are several)."""
        return statistics.median(self.dynamo[1:] if len(self.dynamo) > 1 else self.dynamo)


def _timed(fn):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def fx_times(work: Workload, repeats: int) -> List[float]:
    return [_timed(lambda: capture(work.model, "fx"))[0] for _ in range(repeats)]


def dynamo_time(work: Workload) -> Tuple[float, int]:
    """The first tracked call's time minus a plain forward's; and the graphs captured."""
    torch._dynamo.reset()
    gc.collect()
    cap = capture(work.model, "dynamo")
    rec = Recorder(groups=("moments",))
    plain = statistics.median(_timed(lambda: work.model(work.x))[0] for _ in range(3))
    with recording(rec):
        first, _ = _timed(lambda: cap.tracked()(work.x))
    rec.clear()
    return first - plain, len(cap.graphs)


def measure(size: Size, fx_repeats: int = 5, dynamo_repeats: int = 4) -> CaptureTimes:
    work = Workload(size)
    fx = fx_times(work, fx_repeats)
    nodes = len(capture(work.model, "fx").node_labels)
    runs = [dynamo_time(work) for _ in range(dynamo_repeats)]
    torch._dynamo.reset()
    return CaptureTimes(size, fx, nodes, [t for t, _ in runs], runs[-1][1])
