"""The compiled route's cost: a GPT the user compiled (``torch.compile``, Inductor on the CPU).

* **tracked / plain**: a tracked step (the capture's tracked forward, whose compiled
  submodule runs its instrumented compiled version, the backward, the one read of the
  records, AdamW) against the same compiled GPT's plain step, interleaved; beside it the
  eager route's ratio (the uncompiled GPT, fx capture, against its plain step), the bar
  the compiled route should not exceed; and an A/A ratio (the plain step timed twice a
  round, as two variants), the noise floor of the rounds, with the load average.
* **shadow / plain**: a step tracked by a shadow pass (``lightning_scale.step.shadow``: the
  plain compiled step, watched; after its backward the instrumented forward and backward
  again from the saved state, the one read; then AdamW), in the same rounds.
* **scheduled but idle**: untracked steps of a Trainer fit of the compiled GPT with
  ``ScaleMonitor(every_n_steps=10**9)`` installed (step 0 tracked, later steps idle)
  against the same fit without it.
* **compile time**: the tracked version's compile (``CompiledRoute.compile_seconds``, the
  user's backend included), and the user's own compile of the plain version beside it.

``python benchmarks/compiled_cost.py [--quick]`` prints the figures; ``run.py`` puts them
on the benchmark page.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from timing import Samples, Stopwatch, interleaved, load_average
from workload import MAIN, Size, Workload  # puts the repository root on sys.path

from lightning_scale import Recorder, ScaleMonitor, capture, recording
from lightning_scale.step.shadow import Shadow

#: The statistics of a tracked step (as the eager route's ``tracked`` row: ``("moments",)``).
GROUPS = ("moments",)
#: Interleaved rounds of the six steps (~0.5 s a round): the two ratios compared differ by
#: ~0.02, and the medians of 20 rounds moved by about that much from run to run.
ROUNDS = 60


class Holder(nn.Module):
    """The captured module around the user's compiled GPT (``self.model = torch.compile(gpt)``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


@dataclass
class CompiledCost:
    """Median CPU-time ratios and compile seconds (see the module docstring)."""

    size: Size
    rounds: int
    tracked_ratio: float  # tracked compiled step / plain compiled step
    shadow_ratio: float  # shadow-tracked compiled step / plain compiled step
    aa_ratio: float  # the plain compiled step against itself, in the same rounds (the noise floor)
    load: str  # the 1-minute load average when the steps were timed
    eager_ratio: float  # tracked eager (fx) step / plain eager step
    idle_ratio: float  # untracked step with the monitor scheduled / without, in a Trainer fit
    idle_rounds: int
    compile_s: float  # the tracked version's compile
    user_compile_s: float  # the user's compile of the plain version
    plain_ms: float  # the compiled plain step, median CPU ms

    def line(self) -> str:
        return (
            f"compiled GPT {self.size.name}: tracked {self.tracked_ratio:.2f}x a compiled plain step "
            f"(by a shadow pass {self.shadow_ratio:.2f}x) "
            f"(A/A {self.aa_ratio:.3f}x, load {self.load}; eager route {self.eager_ratio:.2f}x), "
            f"scheduled but idle {self.idle_ratio:.3f}x, tracked version "
            f"compiled in {self.compile_s:.1f} s (the user's: {self.user_compile_s:.1f} s); {self.rounds} rounds"
        )


def _steps(work: Workload, holder: Holder) -> Tuple[Dict[str, Any], float, float]:
    """The plain and tracked step functions of the compiled ``holder``, after a first call of
    each (which compiles it): (steps, the user's compile s, the tracked version's compile s)."""
    cap = capture(holder, "auto", groups=GROUPS)
    if cap.compiled is None:
        raise RuntimeError("the capture found no compiled submodule")
    fn, rec = cap.tracked(), Recorder(groups=GROUPS)

    def plain() -> None:
        work.opt.zero_grad()
        work.loss(holder(work.x)).backward()
        work.opt.step()

    def tracked() -> None:
        work.opt.zero_grad()
        with recording(rec):
            work.loss(fn(work.x)).backward()
        rec.records(cap.tags, cap.aliases).cpu()  # the one read per tracked step
        rec.clear()
        work.opt.step()

    def shadowed() -> None:
        work.opt.zero_grad()
        shadow = Shadow(holder, cap, rec)
        work.loss(shadow.watching(holder)(work.x)).backward()
        shadow.run()  # (after backward, before the optimizer step, as ScaleMonitor runs it)
        rec.records(cap.tags, cap.aliases).cpu()
        rec.clear()
        work.opt.step()

    watch = Stopwatch()
    plain()
    user = watch.lap()[0]
    tracked()
    shadowed()
    return {"plain": plain, "tracked": tracked, "shadow": shadowed}, user, cap.compiled.compile_seconds


def step_ratios(size: Size, rounds: int, budget_s: Optional[float]) -> Tuple[Dict[str, Samples], float, float]:
    """Interleaved CPU times of the compiled plain and tracked steps and of the eager ones."""
    torch._dynamo.reset()
    work = Workload(size)
    holder = Holder(torch.compile(work.model))
    compiled, user_s, tracked_s = _steps(work, holder)
    eager = Workload(size)
    steps = {**compiled, "plain_again": compiled["plain"]}  # (A/A: the same step, timed as another variant)
    steps.update(eager_plain=eager.step("plain"), eager_tracked=eager.step("tracked"))
    return interleaved(steps, rounds, budget_s=budget_s, min_rounds=min(4, rounds)), user_s, tracked_s


def _ratio(samples: Dict[str, Samples], a: str, b: str) -> float:
    return statistics.median(samples[a].cpu) / statistics.median(samples[b].cpu)


def _module(size: Size) -> Any:
    import lightning as L

    class CompiledGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.work = Workload(size)
            self.gpt = torch.compile(self.work.model)

        def forward(self, x: Tensor) -> Tensor:
            return self.gpt(x)

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self.work.loss(self(batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return CompiledGPT()


def _fit_periods(size: Size, steps: int, monitor: Optional[ScaleMonitor], root: str, skip: int) -> List[float]:
    """CPU seconds between consecutive batch starts of a fit, the first ``skip`` dropped."""
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    starts: List[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            starts.append(time.process_time())

    module = _module(size)
    x = module.work.x
    data = DataLoader(TensorDataset(x.repeat(steps + 1, 1)), batch_size=size.batch)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=TensorBoardLogger(root),  # (ScaleMonitor needs one)
        callbacks=[Timer()] + ([monitor] if monitor is not None else []),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)
    return [b - a for a, b in zip(starts, starts[1:])][skip:]


def idle_ratio(size: Size, rounds: int, steps: int, budget_s: Optional[float]) -> Tuple[float, int]:
    """Median untracked-step CPU time with ``ScaleMonitor(every_n_steps=10**9)`` over without,
    in fits of the compiled GPT (pairs alternate which goes first)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    out: Dict[str, List[float]] = {"plain": [], "idle": []}
    start, done = time.perf_counter(), 0
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(rounds):
            if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
                break
            pair = [("plain", None), ("idle", ScaleMonitor(every_n_steps=10**9, figure=False))]
            for name, monitor in pair if r % 2 == 0 else pair[::-1]:
                gc.collect()
                out[name] += _fit_periods(size, steps, monitor, root, skip=3)
            done += 1
    return statistics.median(out["idle"]) / statistics.median(out["plain"]), done


def measure(size: Size = MAIN, quick: bool = False) -> CompiledCost:
    """Every figure of the module docstring (``quick``: a few rounds, to check the code)."""
    samples, user_s, tracked_s = step_ratios(size, 4 if quick else ROUNDS, None if quick else 90.0)
    load = load_average()
    print(
        f"[compiled_cost] steps: tracked {_ratio(samples, 'tracked', 'plain'):.3f}x, by a shadow pass "
        f"{_ratio(samples, 'shadow', 'plain'):.3f}x, eager route "
        f"{_ratio(samples, 'eager_tracked', 'eager_plain'):.3f}x; compile {tracked_s:.1f} s (user's {user_s:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    idle, idle_rounds = idle_ratio(size, 2 if quick else 4, 10 if quick else 30, None if quick else 120.0)
    return CompiledCost(
        size=size,
        rounds=len(samples["plain"].cpu),
        tracked_ratio=_ratio(samples, "tracked", "plain"),
        shadow_ratio=_ratio(samples, "shadow", "plain"),
        aa_ratio=_ratio(samples, "plain_again", "plain"),
        load=load,
        eager_ratio=_ratio(samples, "eager_tracked", "eager_plain"),
        idle_ratio=idle,
        idle_rounds=idle_rounds,
        compile_s=tracked_s,
        user_compile_s=user_s,
        plain_ms=1e3 * statistics.median(samples["plain"].cpu),
    )


def section(cost: CompiledCost) -> str:
    """The benchmark page's section on the compiled route (ratios to three decimals: the two
    compared differ by a few hundredths; whether each target holds in this run)."""

    def met(ok: bool) -> str:
        return "**yes**" if ok else "MISSED"

    tracked_ok = cost.tracked_ratio <= 1.25 and cost.tracked_ratio <= cost.eager_ratio
    return "\n".join(
        [
            "## The compiled route (a compiled GPT, Inductor on the CPU)",
            "",
            f"GPT {cost.size.name}, batch {cost.size.batch}, one thread, median CPU time of interleaved steps "
            f"({cost.rounds} rounds; idle: {cost.idle_rounds} pairs of Trainer fits; load average {cost.load}).",
            "",
            "| measure | value | target | met |",
            "|---|---|---|---|",
            f"| compiled plain step | {cost.plain_ms:.1f} ms | | |",
            f"| tracked compiled step / compiled plain step | {cost.tracked_ratio:.3f}x | <= 1.25x, and <= the eager "
            f"route's | {met(tracked_ok)} |",
            f"| shadow-tracked compiled step / compiled plain step | {cost.shadow_ratio:.3f}x | <= 2.3x | "
            f"{met(cost.shadow_ratio <= 2.3)} |",
            f"| A/A: compiled plain step / itself, same rounds | {cost.aa_ratio:.3f}x | (noise floor) | |",
            f"| eager route: tracked (fx) / plain, uncompiled | {cost.eager_ratio:.3f}x | | |",
            f"| untracked step, `ScaleMonitor` scheduled but idle / without | {cost.idle_ratio:.3f}x | <= 1.03x | "
            f"{met(cost.idle_ratio <= 1.03)} |",
            f"| the tracked version's compile | {cost.compile_s:.1f} s | (the user's compile: "
            f"{cost.user_compile_s:.1f} s) | |",
        ]
    )


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rounds only (checks the code, not the cost)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cost = measure(quick=args.quick)
    print(cost.line())
    print(section(cost))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
