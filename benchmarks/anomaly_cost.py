"""Cost of anomaly detection on untracked steps, in a real Trainer fit (CPU).

Each round fits the benchmark GPT three times, in a rotating order: plain, with
``ScaleMonitor(every_n_steps=10**9)`` (detection off) and with the same plus
``anomaly_steps=8`` (on). Step 0 is tracked; every later step is untracked, which is what
is timed (``fit_loop``'s step periods: every hook, data loading, Lightning's loop). No
anomaly happens in these fits (checked), so the detector runs its per-step work only:
a 3-number payload at batch end, a read of the one two batches back at batch start.

Two figures: the ratio of median step periods (monitor on / plain; noisy on a shared
machine), and the direct one: ``1 + median hook time per step / median plain step``
(the time spent inside ScaleMonitor's hooks, which holds all the detector's work).

``--direct`` measures without a Trainer, on the process CPU clock (robust on a loaded
machine): the detector's whole per-step work (``poll`` + ``observe`` of a real loss
tensor), averaged over many steps, against the median plain step of the same GPT.

Usage: ``python benchmarks/anomaly_cost.py [--rounds 4] [--steps 40] [--direct]``
"""

from __future__ import annotations

import argparse
import gc
import statistics
from typing import Dict, List

import time

import torch
from fit_loop import _fit, _rounds  # noqa: PLC2701 - the fit loop's own helpers
from workload import MAIN, Workload

from lightning_scale import ScaleMonitor
from lightning_scale.anomaly import AnomalyDetector


def _monitor(anomaly_steps: int) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=10**9, anomaly_steps=anomaly_steps)


def main(rounds: int, steps: int, skip: int = 5) -> None:
    periods: Dict[str, List[float]] = {"plain": [], "off": [], "on": []}
    hooks: Dict[str, List[float]] = {"off": [], "on": []}
    with _rounds(rounds, None) as (root, numbers):
        for r in numbers:
            order = ["plain", "off", "on"]
            order = order[r % 3 :] + order[: r % 3]
            for name in order:
                gc.collect()
                monitor = None if name == "plain" else _monitor(8 if name == "on" else 0)
                timer = _fit(MAIN, steps, monitor, root)
                periods[name] += timer.periods(skip).wall
                if monitor is not None:
                    hooks[name] += timer.hook_times()[skip:]
                if name == "on":
                    detector = monitor._detector  # noqa: SLF001 - the benchmark checks no anomaly fired
                    assert detector is not None and not detector.anomalies, "an anomaly fired: the steps timed were not all untracked"
    plain = statistics.median(periods["plain"])
    print(f"model {MAIN.name}; {rounds} rounds x {steps} steps, first {skip} of each fit dropped")
    print(f"plain step (median): {plain * 1e3:.2f} ms")
    for name in ("off", "on"):
        ratio = statistics.median(periods[name]) / plain
        hook = statistics.median(hooks[name])
        print(f"anomaly {name:3}: step {ratio:.4f}x plain; ScaleMonitor hooks {hook * 1e6:.1f} us/step -> {1 + hook / plain:.4f}x")


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
    print(f"direct, CPU clock: plain step {median * 1e3:.2f} ms (median of {plain_steps}); detector {per_step * 1e6:.1f} us/step -> {1 + per_step / median:.4f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--direct", action="store_true", help="only the Trainer-free CPU-clock measure")
    args = parser.parse_args()
    if args.direct:
        torch.set_num_threads(1)  # one core: CPU time of one thread, the machine is shared
        direct()
    else:
        main(args.rounds, args.steps)
