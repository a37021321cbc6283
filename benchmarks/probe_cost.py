"""The fidelity probe's one-off cost, on a capture's first tracked step.

``ScaleMonitor(verify_capture=True)`` (the default) runs, once per capture, the model's
eager forward and backward and the captured ones from the same saved state, and compares
them bit for bit (``lightning_scale.capture.fidelity``). Measured on:

* the demo GPT (``lightning_scale.tools.demo.GPTModule`` defaults: d=128, 4 layers,
  batch 16 x 64 tokens; captured with fx);
* GPT-2 small (transformers' default ``GPT2Config``: 12 layers, d=768, 124M parameters,
  random weights, batch 1 x 128 tokens; captured with dynamo, which compiles on the first
  call, inside the probe when there is one).

Each repeat starts from ``torch._dynamo.reset()`` and times, on the wall clock, the
capture and the first tracked forward and backward, with and without the probe
(interleaved); the one-off cost is their difference (the compile moves into the probe, it
is not paid twice). Also the probe alone and a plain forward and backward.

Usage: ``python benchmarks/probe_cost.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import workload  # noqa: F401 - puts the checkout's package on sys.path

from lightning_scale.capture import capture, fidelity  # noqa: E402
from lightning_scale.record.recorder import Recorder, recording  # noqa: E402


class _Loss(nn.Module):
    """The module ScaleMonitor captures: tokens in, next-token loss out."""

    def __init__(self, model: nn.Module, logits: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.model, self.logits = model, logits

    def forward(self, ids: Tensor) -> Tensor:
        out = self.logits(self.model, ids[:, :-1])
        return F.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())


def demo_gpt() -> Tuple[nn.Module, Tensor]:
    from lightning_scale.tools.demo import GPTModule

    module = GPTModule()
    return _Loss(module.model, lambda m, ids: m(ids)), torch.randint(0, 256, (16, 65))


def gpt2_small() -> Tuple[nn.Module, Tensor]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config())
    return _Loss(model, lambda m, ids: m(input_ids=ids).logits), torch.randint(0, 50257, (1, 129))


@dataclass
class ProbeCost:
    name: str
    mode: str
    params: int
    plain_s: float
    without: List[float]
    with_probe: List[float]
    probe: List[float]

    @property
    def one_off_s(self) -> float:
        return statistics.median(self.with_probe) - statistics.median(self.without)


def _first_tracked_step(task: nn.Module, ids: Tensor, probe: bool) -> Tuple[float, float, str]:
    """(capture + [probe] + first tracked forward and backward, the probe alone, mode)."""
    torch._dynamo.reset()
    gc.collect()
    start = time.perf_counter()
    cap = capture(task, "auto")
    probe_s = 0.0
    if probe:
        other = "fx" if cap.mode == "dynamo" else "dynamo"
        t0 = time.perf_counter()
        first = cap
        outcome = fidelity.verify(
            task, task.forward, [(first.mode, lambda: first), (other, lambda: capture(task, other))], (ids,), {}
        )
        probe_s = time.perf_counter() - t0
        assert outcome.capture is not None, outcome.describe()
        cap = outcome.capture
    rec = Recorder()
    with recording(rec):
        loss = cap.tracked()(ids)
    loss.backward()
    rec.records(cap.tags, cap.aliases).cpu()
    total = time.perf_counter() - start
    task.zero_grad(set_to_none=True)
    return total, probe_s, cap.mode


def _plain(task: nn.Module, ids: Tensor) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        task(ids).backward()
        times.append(time.perf_counter() - t0)
        task.zero_grad(set_to_none=True)
    return statistics.median(times)


def measure(name: str, make: Callable[[], Tuple[nn.Module, Tensor]], repeats: int) -> ProbeCost:
    torch.manual_seed(0)
    task, ids = make()
    task.train()
    plain = _plain(task, ids)
    without: List[float] = []
    with_probe: List[float] = []
    probes: List[float] = []
    mode = ""
    for i in range(repeats):
        for probe in (False, True) if i % 2 == 0 else (True, False):
            total, probe_s, mode = _first_tracked_step(task, ids, probe)
            (with_probe if probe else without).append(total)
            if probe:
                probes.append(probe_s)
    return ProbeCost(name, mode, sum(p.numel() for p in task.parameters()), plain, without, with_probe, probes)


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Tensor]]] = {"demo GPT": demo_gpt, "GPT-2 small": gpt2_small}


def render(rows: List[ProbeCost]) -> List[str]:
    lines = [
        "## The fidelity probe at a capture's first tracked step",
        "",
        "`ScaleMonitor(verify_capture=True)`, the default, runs once per capture the model's eager forward and "
        "backward and the "
        "captured ones from the same saved state and compares outputs, buffers and gradients bit for bit. Wall clock "
        "(`benchmarks/probe_cost.py`, also alone: `python benchmarks/probe_cost.py`); each repeat starts from "
        "`torch._dynamo.reset()` (so dynamo compiles in each); "
        "the with/without runs alternate. *One-off cost* is the median with the probe minus the median without: the "
        "compile "
        "moves into the probe, it is not paid twice.",
        "",
        "| model | capture | parameters | plain forward + backward | capture + first tracked step, without probe | "
        "with probe | the probe alone | one-off cost |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = ", ".join
        lines.append(
            f"| {r.name} | {r.mode} | {r.params / 1e6:.1f}M | {r.plain_s:.3f} s | {statistics.median(r.without):.2f} "
            f"s ({fmt(f'{t:.2f}' for t in r.without)}) "
            f"| {statistics.median(r.with_probe):.2f} s ({fmt(f'{t:.2f}' for t in r.with_probe)}) | "
            f"{statistics.median(r.probe):.2f} s "
            f"| {r.one_off_s:.2f} s ({r.one_off_s / r.plain_s:.1f} plain steps) |"
        )
    return lines + [""]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(name, MODELS[name], args.repeats) for name in (args.only or list(MODELS))]
    print("\n".join(render(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
