"""Peak memory of one variant, each measured in its own fresh process.

In-process tools miss torch's allocations (tracemalloc) or carry every earlier
variant's high-water mark (``ru_maxrss``). So each measurement is a child process that
builds one workload and runs a few steps of one variant only. It reports:

* ``training_kb``: the peak resident set while training above the resident set just
  before it: the high-water mark is reset (``/proc/self/clear_refs``) once the model,
  optimizer and batch exist, so this is optimizer state, gradients, activations and,
  for tracked steps, the capture and the statistics;
* ``capture_kb``: the resident set the capture added (tracked: fx graphs and generated
  code, a fixed cost of the model's graph, paid at fit start, none of it on an
  accelerator; plain: nothing to build);
* ``steps_kb``: the peak resident set during the steps above the resident set after the
  capture (the high-water mark reset again): what the steps themselves hold;
* ``process_kb``: the whole process's peak resident set during those steps;
* ``maxrss_kb``: ``ru_maxrss``, the peak over the process's life, imports included.

The children run with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``):
every tensor's memory is then mapped on allocation and unmapped on free, so the resident
set follows the live tensors. With glibc's default, adaptive threshold, freed tensors
stay in the heap or not depending on the order of earlier allocations, which moved
these ratios by several percent between versions that allocate the same tensors.

Run as a script it is the child: ``python benchmarks/memory.py VARIANT DIM LAYERS STEPS``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from typing import Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
MMAP_THRESHOLD = 128 * 1024  # bytes; see the module docstring


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def child(variant: str, dim: int, layers: int, steps: int) -> Dict[str, int]:
    """Build the workload, reset the peak, run ``steps`` steps of ``variant``; sizes in kB."""
    import torch

    from workload import Size, Workload

    torch.set_num_threads(1)
    work = Workload(Size(dim, layers))
    before = _status_kb("VmRSS")
    resettable = _reset_peak()
    step = work.step(variant)  # the capture, for tracked steps
    captured = _status_kb("VmRSS")
    peak_capture = _status_kb("VmHWM") if resettable else -1
    _reset_peak()
    for _ in range(steps):
        step()
    peak_steps = _status_kb("VmHWM") if resettable else -1
    peak = max(peak_capture, peak_steps)
    return {
        "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "process_kb": peak_steps,
        "training_kb": peak - before if resettable else -1,
        "capture_kb": captured - before,
        "steps_kb": peak_steps - captured if resettable else -1,
    }


Job = Tuple[int, int, str]  # (dim, layers, variant)


def measure(jobs: Sequence[Job], steps: int = 4, parallel: int = 10) -> List[Dict[str, int]]:
    """One child measurement per job (in the jobs' order), ``parallel`` children at a time.

    Resident sets are per process, so children running side by side do not disturb each
    other's numbers; running them together only shortens the wall time.
    """
    out: List[Dict[str, int]] = []
    for i in range(0, len(jobs), parallel):
        procs = [(job, _spawn(job, steps)) for job in jobs[i : i + parallel]]
        for job, proc in procs:
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {job} failed:\n{stderr[-2000:]}")
            out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _spawn(job: Job, steps: int) -> "subprocess.Popen[str]":
    dim, layers, variant = job
    cmd = [sys.executable, os.path.join(HERE, "memory.py"), variant, str(dim), str(layers), str(steps)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


if __name__ == "__main__":
    variant, dim, layers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(child(variant, dim, layers, steps)))
