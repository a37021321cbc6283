"""GPU benchmark: tracked vs plain training steps of a 1B-class GPT in bf16, per kernel.

``python benchmarks/gpu.py`` (part of ``make gpu-check``); prints that it skipped when no
CUDA device is present. GPT d=2048, 24 layers, 16 heads (about 1.3B parameters with a
32768-token vocabulary), batch 8 x 2048 tokens; forward and loss under
``torch.autocast("cuda", torch.bfloat16)``, backward outside it (as Lightning's
``bf16-mixed``), AdamW.

For each statistic set (std: ``("moments",)``; every group: ``("moments", "range",
"formats")``; fp8: ``("moments", "fp8")``) and each device-path kernel
(``LIGHTNING_SCALE_KERNEL=triton``, the fused kernel, and ``torch``):

1. step time, plain and tracked (fx fast path, one ``records(...).cpu()`` per step),
   interleaved rounds, each step bracketed by ``torch.cuda.synchronize()``; the ratio;
2. peak allocated memory of one step against a plain step's (``max_memory_allocated``);
3. CUDA kernels per record: ``torch.profiler`` over one tracked and one plain step, the
   difference in kernel launches divided by the records of the step.

Targets: tracked <= 1.15x plain with std, <= 1.3x with every group, <= 2x
with fp8; peak memory + <= 2%. A variant that runs out of memory is reported as such.
Then the host-sync check: the tracked forward and backward run under
``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing call raises); exit status
1 if they sync.

The compiled GPT: the same GPT held as ``self.model = torch.compile(gpt)``
(Inductor), std: its tracked step (the compiled route: statistics compiled into its own
graphs) against its plain compiled step, the tracked version's compile time, peak memory,
and the same host-sync check (``compiled_row``; target <= 1.15x as the eager route's std).

``--smoke`` runs a tiny model on the CPU (torch's kernels; no memory, profiler or sync
checks) to test this script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import workload  # noqa: F401 - first: puts the checkout's package on sys.path
from timing import interleaved
from workload import Size, Workload

from lightning_scale import Recorder, capture, recording
from lightning_scale.record import kernels

GPU_SIZE = Size(dim=2048, layers=24, heads=16, batch=8, seq=2048, vocab=32768)
SMOKE_SIZE = Size(dim=64, layers=2, heads=4, batch=4, seq=32)
STATISTICS = {"std": ("moments",), "every group": ("moments", "range", "formats"), "fp8": ("moments", "fp8")}
TARGETS = {"std": 1.15, "every group": 1.3, "fp8": 2.0}
MEMORY_TARGET = 1.02
KERNELS = ("triton", "torch")


class Steps:
    """Plain and tracked forward+backward, and full steps, of one workload."""

    def __init__(self, work: Workload, device: str) -> None:
        self.work, self.device = work, device
        self.cap = capture(work.model, "fx")
        self.fn = self.cap.tracked()
        self.rec = Recorder(groups=("moments",))
        self.records = 0  # rows of the last tracked step

    def use(self, groups: Tuple[str, ...], kernel: str) -> None:
        os.environ[kernels.ENV] = kernel  # (read when a Recorder is created)
        self.rec = Recorder(groups=groups, host_reads=False)  # the device path (on the CPU too, for --smoke)

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
        self.records = len(self.rec._rows)  # noqa: SLF001 - records computed this step
        out = self.rec.records(self.cap.node_labels, self.cap.aliases).cpu()
        self.rec.clear()
        return out

    def plain(self) -> None:
        self.work.opt.zero_grad(set_to_none=True)
        self.plain_fwd_bwd()
        self.work.opt.step()

    def tracked(self) -> None:
        self.work.opt.zero_grad(set_to_none=True)
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
    times = interleaved(fns, rounds, warmup=2)
    return {name: statistics.median(t.wall) for name, t in times.items()}  # synced: wall is GPU time


def peak_memory(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def cuda_kernels(step: Callable[[], None]) -> int:
    """CUDA kernel launches of one step (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


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


def sync_check(steps: Steps) -> str:
    steps.work.opt.zero_grad(set_to_none=True)
    steps.rec.clear()
    result = no_sync(steps.tracked_fwd_bwd, after=lambda: _raise_caught(steps.rec))
    steps.rec.clear()
    steps.work.opt.zero_grad(set_to_none=True)
    return result


def _raise_caught(rec: Recorder) -> None:
    if rec.error is not None:  # the recorder keeps errors from hooks instead of raising them
        raise RuntimeError(f"in the statistics: {rec.error}")


def measure(steps: Steps, rounds: int) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    plain_peak = peak_memory(steps.plain) if steps.device == "cuda" else None
    plain_kernels = cuda_kernels(steps.plain) if steps.device == "cuda" else None
    for kernel in KERNELS if steps.device == "cuda" else ("torch",):
        for name, groups in STATISTICS.items():
            row: Dict[str, Any] = {"statistics": name, "kernel": kernel}
            try:
                steps.use(groups, kernel)
                times = step_times(steps, rounds)
                row["ratio"] = times["tracked"] / times["plain"]
                row["plain_ms"], row["tracked_ms"] = times["plain"] * 1e3, times["tracked"] * 1e3
                if steps.device == "cuda":
                    row["memory"] = peak_memory(steps.tracked) / plain_peak
                    row["kernels"] = (cuda_kernels(steps.tracked) - plain_kernels) / max(steps.records, 1)
                    row["sync"] = sync_check(steps)
                row["records"] = steps.records
            except torch.OutOfMemoryError as err:
                row["error"] = f"out of memory: {str(err).splitlines()[0][:120]}"
                steps.rec.clear()
                steps.work.opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    return rows


class Holder(torch.nn.Module):
    """The captured module around the user's compiled GPT (``self.model = torch.compile(gpt)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


class CompiledSteps(Steps):
    """``Steps`` of the compiled GPT: plain runs the user's compiled module, tracked the capture's
    tracked forward, whose compiled submodule runs its instrumented compiled version."""

    def __init__(self, work: Workload, device: str, groups: Tuple[str, ...] = ("moments",)) -> None:
        work.model = Holder(torch.compile(work.model))  # type: ignore[assignment]
        self.work, self.device = work, device
        self.cap = capture(work.model, "auto", groups=groups)
        if self.cap.compiled is None:
            raise RuntimeError("the capture found no compiled submodule")
        self.fn = self.cap.tracked()
        self.rec = Recorder(groups=groups, host_reads=False)
        self.records = 0

    def read(self) -> torch.Tensor:
        if self.rec.error is not None:
            raise RuntimeError(f"statistics failed: {self.rec.error!r}") from self.rec.error
        out = self.rec.records(self.cap.tags, self.cap.aliases)
        self.records = out.shape[0]
        out = out.cpu()
        self.rec.clear()
        return out


def compiled_row(size: Size, device: str, rounds: int) -> Dict[str, Any]:
    """The compiled GPT's row: step ratio, compile seconds, memory and the sync check."""
    row: Dict[str, Any] = {"statistics": "std", "kernel": "compiled (Inductor)"}
    try:
        steps = CompiledSteps(Workload(size, device=device), device)
        watch = time.perf_counter()
        _synced(steps.plain, device)()
        row["user_compile_s"] = time.perf_counter() - watch
        _synced(steps.tracked, device)()  # compiles the tracked version
        row["compile_s"] = steps.cap.compiled.compile_seconds  # type: ignore[union-attr]
        times = step_times(steps, rounds)
        row["ratio"] = times["tracked"] / times["plain"]
        row["plain_ms"], row["tracked_ms"] = times["plain"] * 1e3, times["tracked"] * 1e3
        if device == "cuda":
            row["memory"] = peak_memory(steps.tracked) / peak_memory(steps.plain)
            row["sync"] = sync_check(steps)
        row["records"] = steps.records
    except torch.OutOfMemoryError as err:
        row["error"] = f"out of memory: {str(err).splitlines()[0][:120]}"
    print(row, file=sys.stderr, flush=True)
    return row


def table(size: Size, device: str, rows: List[Dict[str, Any]]) -> str:
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke test)"
    lines = [
        f"GPU benchmark on {name}, torch {torch.__version__}: GPT {size.name}, {size.heads} heads, vocab {size.vocab}, "
        f"batch {size.batch} x {size.seq}, {'bf16 autocast' if device == 'cuda' else 'float32'}",
        "",
        "| statistics | kernel | records / step | plain ms | tracked ms | x plain (target) | peak memory x plain | "
        "CUDA kernels / record | host sync in the tracked fwd+bwd |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['statistics']} | {r['kernel']} | | | | {r['error']} | | | |")
            continue
        mem = f"{r['memory']:.3f}x (<= {MEMORY_TARGET})" if "memory" in r else "-"
        kern = f"{r['kernels']:.1f}" if "kernels" in r else "-"
        sync = ("none" if not r["sync"] else "SYNC: " + r["sync"]) if "sync" in r else "-"
        if "compile_s" in r:
            kern = f"- (tracked version compiled in {r['compile_s']:.1f} s; the user's {r['user_compile_s']:.1f} s)"
        lines.append(
            f"| {r['statistics']} | {r['kernel']} | {r['records']} | {r['plain_ms']:.1f} | {r['tracked_ms']:.1f} | "
            f"{r['ratio']:.3f}x (<= {TARGETS[r['statistics']]}) | {mem} | {kern} | {sync} |"
        )
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--smoke", action="store_true", help="tiny model on CPU, torch's kernels, no memory/profiler/sync checks"
    )
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: skipped: no CUDA device (torch {torch.__version__}).")
        return 0
    device = "cpu" if args.smoke else "cuda"
    size = SMOKE_SIZE if args.smoke else GPU_SIZE
    start = time.perf_counter()
    steps = Steps(Workload(size, device=device), device)
    if device == "cuda":
        print(f"device statistics: {kernels.status(torch.device('cuda'))}", file=sys.stderr)
    rows = measure(steps, args.rounds)
    rows.append(compiled_row(size, device, args.rounds))
    print(table(size, device, rows))
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 1 if any(r.get("sync") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
