"""GPU benchmark: a tracked vs a plain GPT training step in bf16 autocast on CUDA.

``python benchmarks/gpu.py`` (part of ``make gpu-check``); skips with a message when no
CUDA device is present. GPT d=512, 8 layers, 8 heads, batch 32 x 256 tokens; forward and
loss under ``torch.autocast("cuda", torch.bfloat16)``, backward outside it (as Lightning).

1. Step time, plain and tracked (fx fast path, ``Recorder(groups=("moments",))``, one
   ``records(...).cpu()`` per step), interleaved rounds, each step bracketed by
   ``torch.cuda.synchronize()``; medians and the ratio.
2. Peak allocated CUDA memory of one step of each (``max_memory_allocated``).
3. Host syncs: the tracked forward and backward run under
   ``torch.cuda.set_sync_debug_mode("error")``, so any synchronizing call raises; the
   statistics must stay on the device until the single read. The plain forward and
   backward are checked the same way first (a control: a sync there is the model's).
   The assembly of the records (``rec.records(...)``, before ``.cpu()``) is checked too,
   for information: it belongs to the read step.

Exit status 1 when the tracked forward and backward sync. ``--smoke`` runs a tiny model on CPU without the sync
checks, to test this script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional

import torch

import workload  # noqa: F401 - first: puts the checkout's package on sys.path
from timing import interleaved
from workload import Size, Workload

from lightning_scale import Recorder, capture, recording

GPU_SIZE = Size(dim=512, layers=8, heads=8, batch=32, seq=256)
SMOKE_SIZE = Size(dim=64, layers=2, heads=4, batch=4, seq=32)
TRACKED_MAX = 1.2
TRACKED_CHECK = "tracked forward + backward"  # the check that sets the exit status
ASSEMBLY = "records assembly on the device, before the read (info: the read step may sync)"


class Steps:
    """Plain and tracked forward+backward, and full steps, of one workload."""

    def __init__(self, work: Workload, device: str) -> None:
        self.work, self.device = work, device
        self.cap = capture(work.model, "fx")
        self.fn = self.cap.tracked()
        self.rec = Recorder(groups=("moments",))

    def _autocast(self) -> Any:
        return torch.autocast("cuda", torch.bfloat16) if self.device == "cuda" else nullcontext()

    def plain_fwd_bwd(self) -> None:
        with self._autocast():
            loss = self.work.loss(self.work.model(self.work.x))
        loss.backward()

    def tracked_fwd_bwd(self) -> None:
        with recording(self.rec):
            with self._autocast():
                loss = self.work.loss(self.fn(self.work.x))
            loss.backward()

    def read(self) -> torch.Tensor:
        """The one read of a tracked step; raises what the recorder caught on the way."""
        if self.rec.error is not None:
            raise RuntimeError(f"statistics failed: {self.rec.error!r}") from self.rec.error
        out = self.rec.records(self.cap.node_labels, self.cap.aliases).cpu()
        self.rec.clear()
        return out

    def plain(self) -> None:
        self.work.opt.zero_grad()
        self.plain_fwd_bwd()
        self.work.opt.step()

    def tracked(self) -> None:
        self.work.opt.zero_grad()
        self.tracked_fwd_bwd()
        self.read()
        self.work.opt.step()


def _synced(step: Callable[[], None], device: str) -> Callable[[], None]:
    if device != "cuda":
        return step

    def run() -> None:
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()

    return run


def step_times(steps: Steps, rounds: int) -> Dict[str, float]:
    fns = {"plain": _synced(steps.plain, steps.device), "tracked": _synced(steps.tracked, steps.device)}
    times = interleaved(fns, rounds, warmup=3)
    return {name: statistics.median(t.wall) for name, t in times.items()}  # synced: wall is GPU time


def peak_memory(steps: Steps) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for name, step in (("plain", steps.plain), ("tracked", steps.tracked)):
        steps.work.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        out[name] = torch.cuda.max_memory_allocated() / 2**20
    return out


def no_sync(fn: Callable[[], None], after: Optional[Callable[[], None]] = None) -> str:
    """Run ``fn`` with CUDA sync debugging set to "error"; "" if no sync, else the error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        if after is not None:
            after()
        return ""
    except RuntimeError as err:
        return str(err).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def sync_checks(steps: Steps) -> Dict[str, str]:
    """Check name -> "" when no host sync happened, else what synced."""
    out: Dict[str, str] = {}
    steps.work.opt.zero_grad(set_to_none=True)
    out["plain forward + backward (control)"] = no_sync(steps.plain_fwd_bwd)
    steps.work.opt.zero_grad(set_to_none=True)
    steps.rec.clear()
    out[TRACKED_CHECK] = no_sync(steps.tracked_fwd_bwd, after=lambda: _raise_caught(steps.rec))
    keys = (steps.cap.node_labels, steps.cap.aliases)
    out[ASSEMBLY] = no_sync(lambda: steps.rec.records(*keys))
    steps.rec.clear()
    steps.work.opt.zero_grad(set_to_none=True)
    return out


def _raise_caught(rec: Recorder) -> None:
    if rec.error is not None:  # the recorder keeps errors from hooks instead of raising them
        raise RuntimeError(f"in the statistics: {rec.error}")


def table(size: Size, device: str, times: Dict[str, float], memory: Dict[str, float], checks: Dict[str, str]) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke test)"
    ratio = times["tracked"] / times["plain"]
    lines = [
        f"GPU benchmark on {name}, torch {torch.__version__}: GPT {size.name}, {size.heads} heads, "
        f"batch {size.batch} x {size.seq}, {'bf16 autocast' if device == 'cuda' else 'float32'}",
        "",
        "| step | median ms | x plain |",
        "|---|---|---|",
        f"| plain | {times['plain'] * 1e3:.2f} | 1.00x |",
        f'| tracked, fx fast path, groups ("moments",) | {times["tracked"] * 1e3:.2f} | {ratio:.2f}x |',
        "",
        f"The CPU target (tracked <= {TRACKED_MAX}x plain), for reference: {'holds' if ratio <= TRACKED_MAX else 'does not hold'} here.",
    ]
    if memory:
        lines += ["", f"Peak allocated CUDA memory of one step: plain {memory['plain']:.0f} MiB, "
                  f"tracked {memory['tracked']:.0f} MiB ({memory['tracked'] / memory['plain']:.3f}x)."]  # fmt: skip
    if checks:
        lines += ["", "| no host sync in | result |", "|---|---|"]
        lines += [f"| {k} | {'ok' if not v else 'SYNC: ' + v} |" for k, v in checks.items()]
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, no sync checks")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: skipped: no CUDA device (torch {torch.__version__}).")
        return 0
    device = "cpu" if args.smoke else "cuda"
    size = SMOKE_SIZE if args.smoke else GPU_SIZE
    start = time.perf_counter()
    steps = Steps(Workload(size, device=device), device)
    checks = sync_checks(steps) if device == "cuda" else {}
    times = step_times(steps, args.rounds)
    memory = peak_memory(steps) if device == "cuda" else {}
    print(table(size, device, times, memory, checks))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 1 if checks.get(TRACKED_CHECK) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
