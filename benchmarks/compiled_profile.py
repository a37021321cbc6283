"""Where a tracked compiled step's time goes (``compiled_cost.py``'s GPT, Inductor on the CPU).

Two views, in one process:

* **phases**: forward, backward, the recorder's read and the optimizer step of the compiled
  plain step and of the tracked one, each the median process CPU time over interleaved
  rounds: the tracked step's extra time, phase by phase;
* **functions**: cProfile over tracked steps, the cumulative time of the route's Python after
  the graph (``called``, ``PackedLayout.records``, ``gradient_rows``, the labels table), of the
  host op (``host_record``'s implementation, forward and backward) and of the compiled
  graphs' calls, as shares of the profiled steps (cProfile slows Python calls, not kernels:
  the Python shares read high).

``LIGHTNING_SCALE_COMPILED_STATS=ops`` profiles the traceable ops instead of the host op.
``python benchmarks/compiled_profile.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

from compiled_cost import GROUPS, Holder
from timing import load_average
from workload import MAIN, Workload

from lightning_scale import Recorder, capture, recording

#: Function names whose cumulative time the profile reports (file fragment, function name).
WATCHED = (
    ("compiled.py", "called"),
    ("compiled.py", "gradient_rows"),
    ("traceable.py", "records"),
    ("compiled_labels.py", "table"),
    ("recorder.py", "records"),
    ("host_op.py", "_packed"),
    ("output_code.py", "__call__"),
)


def phase_steps(work: Workload, holder: Holder) -> Dict[str, Callable[[Dict[str, float]], None]]:
    """The plain and tracked steps, each adding its phases' CPU seconds to a dict."""
    cap = capture(holder, "auto", groups=GROUPS)
    fn, rec = cap.tracked(), Recorder(groups=GROUPS)

    def step(tracked: bool, times: Dict[str, float]) -> None:
        work.opt.zero_grad()
        t0 = time.process_time()
        if tracked:
            with recording(rec):
                out = fn(work.x)
        else:
            out = holder(work.x)
        t1 = time.process_time()
        work.loss(out).backward()
        t2 = time.process_time()
        if tracked:
            rec.records(cap.tags, cap.aliases).cpu()
            rec.clear()
        t3 = time.process_time()
        work.opt.step()
        t4 = time.process_time()
        for name, dt in zip(("forward", "backward", "read", "optimizer"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name] = times.get(name, 0.0) + dt

    return {"plain": lambda t: step(False, t), "tracked": lambda t: step(True, t)}


def phases(steps: Dict[str, Callable[[Dict[str, float]], None]], rounds: int) -> Dict[str, Dict[str, float]]:
    """Median CPU seconds of each phase of each step over interleaved rounds."""
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times: Dict[str, float] = {}
            step(times)
            samples[name].append(times)
    return {
        name: {phase: statistics.median(t[phase] for t in runs) for phase in runs[0]} for name, runs in samples.items()
    }


def functions(step: Callable[[Dict[str, float]], None], steps: int) -> Dict[str, Tuple[float, int]]:
    """(cumulative seconds, calls) per watched function over ``steps`` profiled steps, and the total."""
    profile = cProfile.Profile(time.process_time)
    started = time.process_time()
    profile.enable()
    for _ in range(steps):
        step({})
    profile.disable()
    total = time.process_time() - started
    out = {"total": (total, 0)}
    for (file, _, name), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        for fragment, watched in WATCHED:
            if name == watched and file.endswith(fragment):
                seconds, calls = out.get(f"{fragment}:{name}", (0.0, 0))
                out[f"{fragment}:{name}"] = (seconds + row[3], calls + row[1])
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.reset()
    work = Workload(MAIN)
    holder = Holder(torch.compile(work.model))
    steps = phase_steps(work, holder)
    warm: Dict[str, float] = {}
    for step in steps.values():  # (compiles each version)
        step(warm)
    medians = phases(steps, args.rounds)
    mode = os.environ.get("LIGHTNING_SCALE_COMPILED_STATS", "") or "auto"
    print(f"statistics ops: {mode}; load {load_average()}; {args.rounds} rounds; median CPU ms per phase")
    plain, tracked = medians["plain"], medians["tracked"]
    for phase in plain:
        print(f"  {phase:10s} plain {1e3 * plain[phase]:7.2f}  tracked {1e3 * tracked[phase]:7.2f}")
    print(f"  step       plain {1e3 * sum(plain.values()):7.2f}  tracked {1e3 * sum(tracked.values()):7.2f}")
    profiled = functions(steps["tracked"], max(3, args.rounds // 2))
    total = profiled.pop("total")[0]
    print(f"cProfile, {max(3, args.rounds // 2)} tracked steps, {1e3 * total:.1f} CPU ms in all:")
    for name, (seconds, calls) in sorted(profiled.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:32s} {1e3 * seconds:8.1f} ms  {100 * seconds / total:5.1f}%  {calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
