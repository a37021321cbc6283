"""Cost of one record on the accelerator path, per statistic group and kernel (CPU counts).

For each group set (``every group``: moments, range, formats, fp8, the block what-ifs and
kurtosis) and each kernel (``triton``: the fused kernel, run by Triton's
interpreter on the CPU, the very launches a GPU gets; ``torch``: torch's kernels), one
``Recorder(groups, host_reads=False)`` records a 1M-element float32 tensor and a
bfloat16 one, and this counts per record:

- aten ops outside the Triton launches (a ``TorchDispatchMode``; frames of the triton
  package, the interpreter's argument copies, are left out), and how many of them are
  not views or allocations (each launches a kernel on a GPU);
- full-size ops: ops whose output has at least the tensor's element count and is not a
  view (each reads or writes the whole tensor once more);
- Triton launches;
- bytes allocated per element (``torch.profiler(profile_memory=True)``, every allocation
  counted once, frees ignored: an upper bound of the peak; it sees the copies that
  ``sum(dtype=...)`` makes inside ATen, which a dispatch mode does not).

Runs itself in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before triton
is imported). Usage: ``python benchmarks/kernel_ops.py`` prints a markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List

import workload  # noqa: F401 - puts the checkout's package on sys.path

GROUPS = {
    "std (moments)": ("moments",),
    "moments, range, formats": ("moments", "range", "formats"),
    "std + fp8": ("moments", "fp8"),
    "std + blocks + kurtosis": ("moments", "blocks", "kurtosis"),
    "every group": ("moments", "range", "formats", "fp8", "blocks", "kurtosis"),
}
KERNELS = ("triton", "torch")
NUMEL = 1 << 20
_NO_KERNEL = {
    "empty",
    "slice",
    "select",
    "view",
    "permute",
    "detach",
    "alias",
    "as_strided",
    "unbind",
    "t",
    "transpose",
    "expand",
    "_reshape_alias",
    "unsqueeze",
    "squeeze",
}


def _count(groups: tuple, kernel: str, dtype: str) -> Dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lightning_scale import Recorder
    from lightning_scale.tools.op_count import OpCounter

    os.environ["LIGHTNING_SCALE_KERNEL"] = kernel
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    launches = [0]

    if kernel == "triton":
        from lightning_scale.record import triton_stats

        for name in ("_tiles_kernel", "_finish_kernel", "_fp8_kernel", "_fp8_finish_kernel"):
            launches_of(triton_stats, name, launches)
    rec = Recorder(groups, host_reads=False)
    rec.observe("warm", x.clone())  # first-call work (bounds' upload, compile or interpreter set-up)
    counter = OpCounter(NUMEL)
    with counter:
        rec.observe("x", x)
    ops_n, full_n = len(counter.ops), len(counter.full)
    kernels_n = sum(name not in _NO_KERNEL for name in counter.names())
    launches[0] = 0
    y = x.clone()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        Recorder(groups, host_reads=False).observe("y", y)
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    return {
        "ops": ops_n,
        "torch_kernels": kernels_n,
        "full": full_n,
        "launches": launches[0],
        "bytes": allocated / NUMEL,
    }


def launches_of(module: Any, name: str, counter: List[int]) -> None:
    """Count launches of ``module.name`` (a Triton kernel, launched as ``kernel[grid](...)``)."""
    kernel = getattr(module, name)

    class Counted:
        def __getitem__(self, grid: Any) -> Any:
            counter[0] += 1
            return kernel[grid]

    setattr(module, name, Counted())


def _child() -> None:
    out = {
        f"{label}|{kernel}|{dtype}": _count(groups, kernel, dtype)
        for label, groups in GROUPS.items()
        for kernel in KERNELS
        for dtype in ("float32", "bfloat16")
    }
    print(json.dumps(out))


def measure() -> Dict[str, Dict[str, float]]:
    """{"group|kernel|dtype": counts}, from a subprocess with Triton's interpreter on."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "LIGHTNING_SCALE_HOST_READS": "0"}
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"kernel_ops failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(res: Dict[str, Dict[str, float]]) -> str:
    lines = [
        "| groups | kernel | dtype | aten ops / record | of which launch a torch kernel | full-size ops / record | "
        "Triton launches | bytes allocated / element |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in res.items():
        label, kernel, dtype = key.split("|")
        lines.append(
            f"| {label} | {kernel} | {dtype} | {r['ops']} | {r['torch_kernels']} | {r['full']} | {r['launches']} | "
            f"{r['bytes']:.2f} |"
        )
    return "\n".join(lines)


def section(res: Dict[str, Dict[str, float]]) -> str:
    return "\n".join(
        [
            "## Accelerator path: cost of one record, per kernel",
            "",
            f"One `Recorder(groups, host_reads=False)` record of a {NUMEL:,}-element tensor on the CPU "
            f"(`LIGHTNING_SCALE_HOST_READS=0`: "
            "the ops a GPU runs), `LIGHTNING_SCALE_KERNEL=triton` (the fused kernel under Triton's interpreter: the "
            "same launches) "
            "or `torch`. Aten ops counted by a dispatch mode outside the Triton launches; full-size ops: outputs of "
            "the tensor's "
            "size that are not views; bytes: every allocation under `torch.profiler(profile_memory=True)`, hidden "
            "copies included "
            "(`benchmarks/kernel_ops.py`).",
            "",
            table(res),
        ]
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child()
    else:
        print(section(measure()))
