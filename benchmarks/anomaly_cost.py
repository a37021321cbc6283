"""Cost of anomaly detection and update ratios on untracked steps, in a real Trainer fit (CPU).

The goal: with ``anomaly_steps`` and ``update_ratios`` on, an untracked step costs
<= 1.01x a plain one. Each round fits the benchmark GPT three times, in a rotating order:
plain, with ``ScaleMonitor(every_n_steps=10**9)`` (both off) and with the same plus
``anomaly_steps=8, update_ratios=True`` (both on). Step 0 is tracked; every later step is
untracked, which is what is timed (``fit_loop``'s step periods: every hook, data loading,
Lightning's loop, on both clocks). No anomaly happens in these fits (checked), so the
detector runs its per-step work only: a 3-number payload at batch end, a read of the one
two batches back at batch start; update ratios cost an untracked step one comparison.

Two figures: the ratio of median step periods (monitor on / plain; noisy on a shared
machine), and the direct one: ``1 + median hook time per step / median plain step``
(the time spent inside ScaleMonitor's hooks, which holds all the detector's work).

``--direct`` measures without a Trainer, on the process CPU clock (robust on a loaded
machine): the detector's whole per-step work (``poll`` + ``observe`` of a real loss
tensor), averaged over many steps, against the median plain step of the same GPT.

Usage: ``python benchmarks/anomaly_cost.py [--rounds 3] [--steps 30] [--direct]``
(``make bench`` runs ``measure`` and puts it on the page).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fit_loop import _fit, _rounds  # noqa: PLC2701 - the fit loop's own helpers
from timing import Samples, between_noise_floor
from workload import MAIN, Workload

from lightning_scale import ScaleMonitor
from lightning_scale.step.anomaly import AnomalyDetector

#: The monitors compared, by name: both features off, both on.
MONITORS = {"off": {}, "on": {"anomaly_steps": 8, "update_ratios": True}}


@dataclass
class AnomalyCost:
    """Untracked step periods of each fit kind (all rounds) and the monitor's hook time per step."""

    rounds: int = 0
    steps: int = 0
    skip: int = 0
    periods: Dict[str, Samples] = field(default_factory=dict)  # "plain" / "off" / "on"
    plain_by_round: List[Samples] = field(default_factory=list)
    hooks: Dict[str, List[float]] = field(default_factory=dict)  # "off" / "on": wall s per step

    def ratio(self, name: str, clock: str = "cpu") -> float:
        """Median step period of ``name`` over the plain one's."""
        return statistics.median(self.periods[name].clock(clock)) / statistics.median(
            self.periods["plain"].clock(clock)
        )

    def hook_ratio(self, name: str) -> float:
        """``1 + median hook time per step / median plain step`` (wall clock)."""
        return 1 + statistics.median(self.hooks[name]) / statistics.median(self.periods["plain"].wall)

    def noise(self, clock: str = "cpu") -> float:
        """A/A noise floor of the plain step between rounds (``timing.between_noise_floor``)."""
        return between_noise_floor([r.clock(clock) for r in self.plain_by_round])


def _monitor(name: str) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=10**9, **MONITORS[name])  # type: ignore[arg-type]


def measure(rounds: int = 3, steps: int = 30, skip: int = 5, budget_s: Optional[float] = None) -> AnomalyCost:
    """Fits of ``steps`` steps, plain / off / on per round (order rotating); see the module
    docstring. With ``budget_s``, stops after the round (at least two) that passes it."""
    out = AnomalyCost(steps=steps, skip=skip)
    out.periods = {k: Samples() for k in ("plain", *MONITORS)}
    out.hooks = {k: [] for k in MONITORS}
    with _rounds(rounds, budget_s) as (root, numbers):
        for r in numbers:
            order = ["plain", *MONITORS]
            for name in order[r % 3 :] + order[: r % 3]:
                gc.collect()
                monitor = None if name == "plain" else _monitor(name)
                timer = _fit(MAIN, steps, monitor, root)
                kept = timer.periods(skip)
                out.periods[name].wall.extend(kept.wall)
                out.periods[name].cpu.extend(kept.cpu)
                if monitor is None:
                    out.plain_by_round.append(kept)
                    continue
                out.hooks[name] += timer.hook_times()[skip:]
                detector = monitor._anomaly.detector  # noqa: SLF001 - the benchmark checks no anomaly fired
                assert detector is None or not detector.anomalies, (
                    "an anomaly fired: the steps timed were not all untracked"
                )
            out.rounds = r + 1
    return out


def main(rounds: int, steps: int, skip: int = 5) -> None:
    cost = measure(rounds, steps, skip)
    plain = statistics.median(cost.periods["plain"].cpu)
    print(
        f"model {MAIN.name}; {cost.rounds} rounds x {steps} steps, first {skip} of each fit dropped; A/A noise CPU "
        f"{cost.noise():.3f}"
    )
    print(f"plain step (median, CPU): {plain * 1e3:.2f} ms")
    for name in MONITORS:
        hook = statistics.median(cost.hooks[name])
        print(
            f"{name:3} {MONITORS[name]}: step {cost.ratio(name):.4f}x plain CPU, {cost.ratio(name, 'wall'):.4f}x wall; "
            f"ScaleMonitor hooks {hook * 1e6:.1f} us/step -> {cost.hook_ratio(name):.4f}x"
        )


def direct(plain_steps: int = 30, detector_steps: int = 5000) -> None:
    work = Workload(MAIN)
    step = work.step("plain")
    for _ in range(3):
        step()
    plain = []
    for _ in range(plain_steps):
        t0 = time.process_time()
        step()
        plain.append(time.process_time() - t0)
    loss = work.loss(work.model(work.x)).detach()
    detector = AnomalyDetector(steps=8)
    t0 = time.process_time()
    for i in range(detector_steps):
        detector.poll(i)
        detector.tracks(i)
        detector.observe(i, loss)
    per_step = (time.process_time() - t0) / detector_steps
    median = statistics.median(plain)
    print(
        f"direct, CPU clock: plain step {median * 1e3:.2f} ms (median of {plain_steps}); detector "
        f"{per_step * 1e6:.1f} us/step -> {1 + per_step / median:.4f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--direct", action="store_true", help="only the Trainer-free CPU-clock measure")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: CPU time of one thread, the machine is shared
    if args.direct:
        direct()
    else:
        main(args.rounds, args.steps)
