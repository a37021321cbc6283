"""Cost of the precision advisor (``ScaleMonitor(advise=True)``) in a real Trainer fit (CPU).

On a tracked step the advisor runs, for every linear layer, its three GEMMs again in each of
three recipes (casts, then a float32 GEMM) plus the three float32 references: 12 extra GEMMs
per layer, and one small ``all_reduce``. Untracked steps run the user's module untouched.

Each round fits the benchmark GPT three times in a rotating order: plain, with
``ScaleMonitor(every_n_steps=2)`` and with ``ScaleMonitor(every_n_steps=2, advise=True)``;
the first ``skip`` steps (capture, the fidelity probe) are dropped; even steps are tracked, odd
ones untracked. Figures: median CPU step periods (Lightning's loop, every hook) of each kind,
over the plain fit's median step.

Usage: ``python benchmarks/advise_cost.py [--rounds 3] [--steps 16]`` (``make bench`` runs
``measure`` and puts ``section`` on the page).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from fit_loop import _fit, _rounds  # noqa: PLC2701 - the fit loop's own helpers
from timing import load_average
from workload import MAIN, Size

from lightning_scale import ScaleMonitor

KINDS = ("plain", "tracked", "advise")


@dataclass
class AdviseCost:
    """CPU step periods (s) by fit kind and step kind (``"tracked"`` / ``"untracked"``)."""

    size: Size
    rounds: int = 0
    steps: int = 0
    skip: int = 0
    load: str = ""
    periods: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)

    def ratio(self, kind: str, step: str) -> float:
        """Median ``step`` period of fit ``kind`` over the plain fit's median step."""
        plain = self.periods["plain"]["tracked"] + self.periods["plain"]["untracked"]
        return statistics.median(self.periods[kind][step]) / statistics.median(plain)

    def plain_ms(self) -> float:
        return 1e3 * statistics.median(self.periods["plain"]["tracked"] + self.periods["plain"]["untracked"])


def _monitor(kind: str) -> Optional[ScaleMonitor]:
    return None if kind == "plain" else ScaleMonitor(every_n_steps=2, advise=kind == "advise")


def measure(size: Size = MAIN, rounds: int = 3, steps: int = 16, skip: int = 4, quick: bool = False) -> AdviseCost:
    """Every figure of the module docstring (``quick``: two short rounds, to check the code)."""
    rounds, steps = (2, 8) if quick else (rounds, steps)
    out = AdviseCost(size, steps=steps, skip=skip)
    out.periods = {k: {"tracked": [], "untracked": []} for k in KINDS}
    with _rounds(rounds, None if quick else 240.0) as (root, numbers):
        for r in numbers:
            for kind in KINDS[r % 3 :] + KINDS[: r % 3]:
                gc.collect()
                timer = _fit(size, steps, _monitor(kind), root)
                for i, (a, b) in enumerate(zip(timer.cpu_starts, timer.cpu_starts[1:])):
                    if i >= skip:
                        out.periods[kind]["tracked" if timer.global_steps[i] % 2 == 0 else "untracked"].append(b - a)
            out.rounds = r + 1
    out.load = load_average()
    return out


def section(cost: AdviseCost) -> str:
    """The benchmark page's section on the precision advisor."""
    return "\n".join(
        [
            "## The precision advisor (`ScaleMonitor(advise=True)`)",
            "",
            f"GPT {cost.size.name}, batch {cost.size.batch}, one thread, median CPU step periods in Trainer fits "
            f"tracking every 2nd step ({cost.rounds} rounds x {cost.steps} steps, first {cost.skip} dropped; load "
            f"average {cost.load}). A tracked step with the advisor re-runs each linear layer's three GEMMs in "
            "three recipes, plus their float32 references: 12 extra GEMMs per layer, on tracked steps only.",
            "",
            "| step | / plain step |",
            "|---|---|",
            f"| plain step | 1.00x ({cost.plain_ms():.1f} ms) |",
            f"| tracked step, `ScaleMonitor(every_n_steps=2)` | {cost.ratio('tracked', 'tracked'):.2f}x |",
            f"| tracked step, `ScaleMonitor(every_n_steps=2, advise=True)` | {cost.ratio('advise', 'tracked'):.2f}x |",
            f"| untracked step, without advise / with advise | {cost.ratio('tracked', 'untracked'):.2f}x / "
            f"{cost.ratio('advise', 'untracked'):.2f}x |",
        ]
    )


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="two short rounds (checks the code, not the cost)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(section(measure(rounds=args.rounds, steps=args.steps, quick=args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
