"""Timing: interleaved rounds of step functions, on two clocks, and their summaries.

On a small, noisy machine two variants timed one after the other see different
background load. Running them in rounds (a, b, c, a, b, c, ...) spreads that load over
all of them; medians then ignore the rounds a burst of load hit.

Each step is timed on two clocks: wall time (``perf_counter``), what a user waits, and
the process's CPU time (``process_time``). With torch on one thread all of a CPU step's
work runs in this process, so on an idle machine the two agree; when other jobs preempt
the benchmark, wall time grows with their load and CPU time does not.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

CLOCKS = ("wall", "cpu")


@dataclass(frozen=True)
class Summary:
    """Median and quartiles of one variant's step times, in seconds."""

    median: float
    p25: float
    p75: float
    n: int

    @classmethod
    def of(cls, times: List[float]) -> "Summary":
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        return cls(statistics.median(times), q[0], q[2], len(times))


@dataclass
class Samples:
    """Per-step times of one variant on both clocks, in seconds."""

    wall: List[float] = field(default_factory=list)
    cpu: List[float] = field(default_factory=list)

    def clock(self, name: str) -> List[float]:
        return self.wall if name == "wall" else self.cpu


class Stopwatch:
    """Both clocks at once: ``lap()`` returns (wall, cpu) seconds since the last lap."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self) -> "tuple[float, float]":
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self._wall, cpu - self._cpu)
        self._wall, self._cpu = wall, cpu
        return out


def interleaved(
    steps: Mapping[str, Callable[[], None]],
    rounds: int,
    warmup: int = 2,
    budget_s: Optional[float] = None,
    min_rounds: int = 6,
) -> Dict[str, Samples]:
    """Per variant, the times of one step per round, for ``rounds`` rounds.

    With ``budget_s``, stops early (after at least ``min_rounds``) once the rounds have
    taken that much wall time, so a loaded machine cannot stretch the suite unboundedly.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    out: Dict[str, Samples] = {name: Samples() for name in steps}
    start = time.perf_counter()
    for r in range(rounds):
        if budget_s is not None and r >= min_rounds and time.perf_counter() - start > budget_s:
            break
        gc.collect()  # outside the timed region: no variant pays for another's garbage
        for name, step in steps.items():
            watch = Stopwatch()
            step()
            wall, cpu = watch.lap()
            out[name].wall.append(wall)
            out[name].cpu.append(cpu)
    return out


def noise_floor(times: List[float]) -> float:
    """|1 - median(odd samples) / median(even samples)|: the ratio an A/A comparison gives."""
    if len(times) < 4:
        return float("nan")
    return abs(1.0 - statistics.median(times[1::2]) / statistics.median(times[0::2]))


def between_noise_floor(groups: List[List[float]]) -> float:
    """As ``noise_floor``, but splitting whole groups (one fit each): even vs odd groups."""
    even = [t for g in groups[0::2] for t in g]
    odd = [t for g in groups[1::2] for t in g]
    if not even or not odd:
        return float("nan")
    return abs(1.0 - statistics.median(odd) / statistics.median(even))


def load_average() -> str:
    """The 1-minute load average, from /proc/loadavg."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "unknown"
