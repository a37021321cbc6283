"""The host C kernel's read speed: ``python benchmarks/native_read.py``.

Collects the tensors a std-tracked step hands the native kernel (d=128, 4 layers: forward
values and gradients above 4096 elements), then times, on one thread, over all of them:
the kernel's sums (``native.sums``), its sums with max |x|, every group in one read
(``native.every_group``), the block what-ifs (``native.blocks``), the central moments
(``native.moments``), the per-tensor fp8 what-if (``native.fp8``, its own amax read first), the
channel maxima (``native.channel_maxima``) and, as the floor of one
read, ``torch._foreach_norm`` of the same tensors. Medians over interleaved repeats of the
thread's CPU time (on a shared machine wall time counts other jobs), in ms and GB/s.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import List

import torch
from torch import Tensor

import workload  # noqa: F401 - first: puts the checkout's package on sys.path
from lightning_scale.record import native
from lightning_scale.record.stats.formats import NATIVE_BOUNDS
from workload import MAIN, Workload


def measure(tensors: List[Tensor], repeats: int = 30) -> List[tuple]:
    """(name, ms, GB/s) of each way of reading ``tensors`` once."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    ways = {
        "torch._foreach_norm (one read, the floor)": lambda: torch._foreach_norm(tensors),
        "native.sums": lambda: [native.sums(t) for t in tensors],
        "native.sums with max |x|": lambda: [native.sums(t, True) for t in tensors],
        "native.every_group (moments, range, formats)": lambda: [native.every_group(t, NATIVE_BOUNDS) for t in tensors],
    }
    ways["native.blocks (MXFP8 E4M3 and E5M2, MXFP4, NVFP4)"] = lambda: [native.blocks(t) for t in tensors]
    ways["native.moments (kurtosis)"] = lambda: [native.moments(t) for t in tensors]
    ways["native.fp8 (per-tensor E4M3 and E5M2, amax read first)"] = lambda: [native.fp8(t) for t in tensors]
    ways["native.channel_maxima (channels)"] = lambda: [native.channel_maxima(t) for t in tensors]
    times: dict = {name: [] for name in ways}
    for _ in range(repeats):  # (interleaved: the machine's load drifts alike for each)
        for name, fn in ways.items():
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    out = []
    for name, ts in times.items():
        ms = statistics.median(ts) * 1e3
        out.append((name, ms, nbytes / ms / 1e6))
    return out


def main(argv: List[str]) -> int:
    torch.set_num_threads(1)
    native.load()
    print(native.status())
    tensors = Workload(MAIN).tracked_tensors(("moments",))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"{len(tensors)} tensors, {nbytes / 1e6:.1f} MB, one thread")
    print("| read | ms | GB/s |\n|---|---|---|")
    for name, ms, gbs in measure(tensors, 10 if "--quick" in argv else 30):
        print(f"| {name} | {ms:.2f} | {gbs:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
