"""The tracked-step part of ``make bench`` alone: ``python benchmarks/tracked_part.py``.

Tracked steps in a Trainer fit (std only, every statistic group, the figure) against plain
fit steps, and the profile of where a tracked step's time goes; prints those sections of
the page (the full suite is ``benchmarks/run.py``).
"""

from __future__ import annotations

import sys
import time

import torch

import workload  # noqa: F401 - first: puts the checkout's package on sys.path
import render
import run
from timing import load_average
from workload import SIZES


def main(argv: list) -> int:
    quick = "--quick" in argv
    torch.set_num_threads(1)
    res = render.Results(run.machine(), "python benchmarks/tracked_part.py", SIZES, run.row_labels())
    load_start, start = load_average(), time.perf_counter()
    run.tracked_fit_times(res, quick)
    run.tracked_profiles(res, quick)
    res.seconds, res.load = time.perf_counter() - start, (load_start, load_average())
    print("\n".join(render.targets(res) + render.tracked_table(res) + render.profile_table(res)))
    print(f"load average (1 min) at start {res.load[0]}, at end {res.load[1]}; {res.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
