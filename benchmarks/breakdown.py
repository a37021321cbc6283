"""Where a tracked step's CPU time goes, on thread clocks, without a profiler.

A Trainer fit tracks every step from step 2 on; the monitor's parts are wrapped with
``time.thread_time`` accumulators (each thread's own CPU time, so the writer thread and
the training thread are told apart and no profiler inflates Python): recording in the
forward (``Recorder.observe``, its statistics included), recording gradients
(``Recorder._on_grad``), the start and the end of a tracked step (``ScaleMonitor._begin``,
``ScaleMonitor._finish``: assembling, pooling, checks, queueing) on the training thread,
and the writer's jobs on its thread. Medians per tracked step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Tuple

from workload import Size

from lightning_scale import ScaleMonitor
from lightning_scale.report import worker
from lightning_scale.callback import ScaleMonitor as _Monitor
from lightning_scale.record.recorder import Recorder

#: (row, class, method) of each part timed; the writer's jobs are ``worker.Worker._call``.
PARTS: Tuple[Tuple[str, Any, str], ...] = (
    ("recording in the forward (`Recorder.observe`)", Recorder, "observe"),
    ("recording gradients (`Recorder._on_grad`)", Recorder, "_on_grad"),
    ("start of the step (`ScaleMonitor._begin`)", _Monitor, "_begin"),
    ("end of the step: assemble, pool, check, queue (`ScaleMonitor._finish`)", _Monitor, "_finish"),
    ("writing, on the writer thread (`Worker._call`)", worker.Worker, "_call"),
)


@dataclass
class Breakdown:
    """CPU ms per tracked step of each ``PARTS`` row (medians over the tracked steps)."""

    statistics: List[str]
    ms: Dict[str, float] = field(default_factory=dict)


def measure(size: Size, statistics_: List[str], steps: int = 14) -> Breakdown:
    """A fit of ``steps`` steps tracking every step from step 2; see the module docstring."""
    import fit_loop

    spent: Dict[str, Dict[int, float]] = {row: {} for row, _, _ in PARTS}
    step = [0]
    originals = [(cls, name, getattr(cls, name)) for _, cls, name in PARTS]
    for (row, cls, name), (_, _, original) in zip(PARTS, originals):
        setattr(cls, name, _timed(original, spent[row], step))
    try:
        with fit_loop._rounds(1, None) as (root, _):
            monitor = ScaleMonitor(every_n_steps=1, start_step=2, statistics=list(statistics_), figure=False)
            original_start = monitor.on_train_batch_start

            def counting(trainer: Any, *args: Any) -> None:
                step[0] = trainer.global_step
                original_start(trainer, *args)

            monitor.on_train_batch_start = counting  # type: ignore[method-assign]
            fit_loop._fit(size, steps, monitor, root)
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
    out = Breakdown(list(statistics_))
    for row, per_step in spent.items():
        kept = [v for s, v in per_step.items() if s >= 4]  # (steps 2-3: first-use imports, the coverage report)
        out.ms[row] = statistics.median(kept) * 1e3 if kept else 0.0
    return out


def _timed(original: Callable[..., Any], into: Dict[int, float], step: List[int]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            into[step[0]] = into.get(step[0], 0.0) + time.thread_time() - t0

    return timed
