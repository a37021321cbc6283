"""Workload: the GPT sizes, their data, and one training step per benchmarked variant.

A training step is always zero_grad, forward, cross-entropy loss, backward, AdamW step;
variants differ only in how the forward runs and what is recorded on the way.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as `python benchmarks/x.py`: import the checkout's package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, fx, nn  # noqa: E402

from lightning_scale import Recorder, ScaleTrackingInterpreter, Statistic, capture, recording  # noqa: E402
from lightning_scale.record import native  # noqa: E402
from lightning_scale.record.stats import run_table  # noqa: E402
from lightning_scale.tools.models import GPT, GPTConfig, synthetic_tokens  # noqa: E402

Step = Callable[[], None]


@dataclass(frozen=True)
class Size:
    """One model size of the cost curve."""

    dim: int
    layers: int
    heads: int = 4
    batch: int = 16
    seq: int = 64
    vocab: int = 256

    @property
    def name(self) -> str:
        return f"d={self.dim}, {self.layers} layers"


SIZES: Tuple[Size, ...] = (Size(64, 2), Size(128, 4), Size(256, 6))
MAIN = SIZES[1]  # the size the targets are judged on

#: Variant key -> row label, in the order they run within a round.
VARIANTS: Dict[str, str] = {
    "plain": "plain step",
    "tracked": 'tracked, fx fast path, groups ("moments",)',
    "floor": (
        "floor of the row above: plain step + one `torch._foreach_norm` read of the tensors it records "
        "(`benchmarks/native_read.py`)"
    ),
    "tracked_range": 'tracked, fx fast path, groups ("moments", "range")',
    "tracked_formats": 'tracked, fx fast path, groups ("moments", "range", "formats")',
    "tracked_every": 'tracked, fx fast path, every statistic but fp8 (+ "blocks", "kurtosis", "channels")',
    "tracked_fp8": 'tracked, fx fast path, groups ("moments", "fp8"): the per-tensor fp8 what-if',
    "tracked_user": "tracked, fx fast path, std and a user statistic of one sum (`mean_abs`: sums={'abs': torch.abs})",
    "reference": "reference: unit_scaling.utils.ScaleTrackingInterpreter",
    "interpreter": 'ours: lightning_scale.ScaleTrackingInterpreter, groups ("moments",)',
}
#: Variants measured apart (``memory.py``): not rows of the step-time table.
SHADOW = "shadow"  # a plain step, then its shadow pass (the fx capture again from the saved state)
GROUPS = {
    "tracked": ("moments",),
    "tracked_range": ("moments", "range"),
    "tracked_formats": ("moments", "range", "formats"),
    "tracked_every": ("moments", "range", "formats", "blocks", "kurtosis", "channels"),
    "tracked_fp8": ("moments", "fp8"),
}
#: A user statistic of one sum, the mean |x|, logged beside std: ``tracked_user``.
MEAN_ABS = Statistic("mean_abs", sums={"abs": torch.abs}, value=lambda s: s["abs"] / s["count"])
GROUPS["tracked_user"] = ("moments", run_table.register(MEAN_ABS))


class Workload:
    """A GPT of one size in train mode, its AdamW optimizer and one fixed batch."""

    def __init__(self, size: Size, seed: int = 0, device: str = "cpu") -> None:
        torch.manual_seed(seed)
        cfg = GPTConfig(vocab=size.vocab, seq=size.seq, layers=size.layers, dim=size.dim, heads=size.heads)
        self.size = size
        self.model = GPT(cfg).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        x, y = synthetic_tokens(size.batch, size.seq, size.vocab, seed=seed)
        self.x, self.y = x.to(device), y.to(device)

    def loss(self, logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), self.y.reshape(-1))

    def step(self, variant: str) -> Step:
        """A no-argument function that runs one training step of ``variant``."""
        if variant == "plain":
            return self._plain_step()
        if variant in GROUPS:
            return self._tracked_step(GROUPS[variant])
        if variant == "floor":
            return self._floor_step()
        if variant == "reference":
            return self._reference_step()
        if variant == "interpreter":
            return self._interpreter_step()
        if variant == SHADOW:
            return self._shadow_step()
        raise ValueError(f"`variant` must be one of {sorted([*VARIANTS, SHADOW])}, got {variant!r}")

    def _plain_step(self) -> Step:
        def step() -> None:
            self.opt.zero_grad()
            self.loss(self.model(self.x)).backward()
            self.opt.step()

        return step

    def _tracked_step(self, groups: Tuple[str, ...]) -> Step:
        cap = capture(self.model, "fx")
        fn = cap.tracked()
        rec = Recorder(groups=groups)

        def step() -> None:
            self.opt.zero_grad()
            with recording(rec):
                self.loss(fn(self.x)).backward()
            rec.records(cap.node_labels, cap.aliases).cpu()  # the one read per tracked step
            rec.clear()
            self.opt.step()

        return step

    def _shadow_step(self) -> Step:
        """A plain step whose forward a shadow pass watches; after backward, before the
        optimizer step, the shadow runs the fx capture's tracked forward and backward again
        from the saved state (``lightning_scale.step.shadow``), as ``ScaleMonitor`` does."""
        from lightning_scale.step.shadow import Shadow

        cap = capture(self.model, "fx")
        rec = Recorder(groups=GROUPS["tracked"])

        def step() -> None:
            self.opt.zero_grad()
            shadow = Shadow(self.model, cap, rec)
            self.loss(shadow.watching(self.model)(self.x)).backward()
            shadow.run()
            rec.records(cap.node_labels, cap.aliases).cpu()
            rec.clear()
            self.opt.step()

        return step

    def _floor_step(self) -> Step:
        """A plain step, then ``torch._foreach_norm`` of copies of the tensors a ``("moments",)``
        tracked step reads with the native kernel (taken from one such step): one read of the
        same bytes, the least a tracked step can add, by torch's fastest multi-tensor kernel."""
        tensors = self.tracked_tensors(GROUPS["tracked"])
        plain = self._plain_step()

        def step() -> None:
            plain()
            if tensors:  # (none without the native kernel)
                torch._foreach_norm(tensors)

        return step

    def tracked_tensors(self, groups: Tuple[str, ...]) -> List[Tensor]:
        """Copies of the tensors one tracked step with ``groups`` reads with the native
        kernel's sums (``native.sums``; none where it is not in use); the step runs twice."""
        seen: List[Tensor] = []
        original = native.sums

        def keep(x: Tensor, with_max: bool = False) -> Optional[Tuple[float, float, float]]:
            got = original(x, with_max)
            if got is not None:
                seen.append(x.detach().clone())
            return got

        step = self._tracked_step(groups)
        step()  # (the first step builds what later ones reuse)
        native.sums = keep  # type: ignore[assignment]
        try:
            step()
        finally:
            native.sums = original  # type: ignore[assignment]
        return seen

    def _reference_step(self) -> Step:
        from unit_scaling.utils import ScaleTrackingInterpreter as Reference
        from unit_scaling.utils import _DeepTracer

        gm = _deep_trace(self.model, _DeepTracer(recurse_modules=True))

        def step() -> None:
            self.opt.zero_grad()
            self.loss(Reference(gm).run(self.x)).backward()  # reads float(t.std()) per tensor
            self.opt.step()

        return step

    def _interpreter_step(self) -> Step:
        from unit_scaling.utils import _DeepTracer

        gm = _deep_trace(self.model, _DeepTracer(recurse_modules=True))

        def step() -> None:
            self.opt.zero_grad()
            interp = ScaleTrackingInterpreter(gm, groups=("moments",))
            self.loss(interp.run(self.x)).backward()
            interp.records().cpu()
            self.opt.step()

        return step


def _deep_trace(model: nn.Module, tracer: fx.Tracer) -> fx.GraphModule:
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph)  # shares the model's parameters
