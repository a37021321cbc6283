"""The compiled route reads to the host once per tracked step, and never on untracked steps.

``test_syncs.py``'s counter (``.cpu()``, ``.tolist()``, ``.numpy()``, ``.to(device)``, and
``aten._local_scalar_dense`` with the data-dependent ops) on a fit whose model holds a
compiled submodule, with the device path forced: the compiled graphs' rows stay on the
device until the step's one pooled copy; the user's own reads are subtracted step by step.
The counter's dispatch mode declares ``ignore_compile_internals`` (dynamo refuses to compile
under other dispatch modes and would run both versions eagerly): it is off while dynamo and
the backend compile, and on while the compiled graphs run, so a read inside them counts too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from test_syncs import _HOST, StepMarker, SyncCounter

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
    ),
    pytest.mark.timeout(900),
]


class CompiledNet(pl.LightningModule):
    """Two linears and a GELU, compiled (``self.body = torch.compile(...)``; AOTAutograd
    without Inductor's C++ compile, so the test stays fast), then an eager head."""

    def __init__(self) -> None:
        super().__init__()
        body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16))
        self.body = torch.compile(body, backend="aot_eager")
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("loss", loss)  # the user's own read, in both runs
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def compiled_counter() -> SyncCounter:
    """``test_syncs.SyncCounter`` whose dispatch mode lets dynamo compile (see above)."""
    counter = SyncCounter()

    class Dispatch(counter.dispatch):  # type: ignore[name-defined,misc]
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

    counter.dispatch = Dispatch
    return counter


def _fit(root: Path, monitor: bool, steps: int) -> Tuple[SyncCounter, CompiledNet]:
    pl.seed_everything(11, verbose=False)
    torch._dynamo.reset()
    model, counter = CompiledNet(), compiled_counter()
    callbacks: List[Callback] = [StepMarker(counter)]
    if monitor:
        statistics = ["std", "absmax", "underflow_e4m3", "fp8_e4m3_snr_db"]
        callbacks.append(ScaleMonitor(every_n_steps=2, statistics=statistics, histograms=False, figure=False))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 8, generator=g), torch.randn(48, 4, generator=g)
    for t in (x, y, *model.parameters()):  # host data until Lightning moves it (see test_syncs.py)
        setattr(t, _HOST, True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        logger=TensorBoardLogger(str(root), name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    with counter:
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return counter, model


def test_compiled_route_reads_once_per_tracked_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_SCALE_HOST_READS", "0")
    steps, expected = 5, [0, 2, 4]
    plain, plain_model = _fit(tmp_path / "plain", False, steps)
    tracked, model = _fit(tmp_path / "tracked", True, steps)
    for (name, p), q in zip(plain_model.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name  # the callback changed nothing
    probe = {s: int(s == 0) for s in range(steps)}  # the fidelity probe's verdict, read once
    ours = {step: tracked.counts[step] - plain.counts[step] for step in range(steps)}
    assert ours == {s: int(s in expected) + probe[s] for s in range(steps)}, (ours, tracked.ops)
    for step in range(steps):  # the one blocking read is the pooled copy
        ours_ops = ["cpu"] * (step in expected) + ["aten._local_scalar_dense.default"] * probe[step]
        assert sorted(tracked.ops.get(step, [])) == sorted(plain.ops.get(step, []) + ours_ops), step
    acc = EventAccumulator(str(tmp_path / "tracked"), size_guidance={"scalars": 0})
    acc.Reload()
    # recorded inside the compiled graphs, every group among them
    for tag in ("scale/fwd/body.1/gelu", "fp8_e4m3_snr_db/bwd/body.0/linear", "underflow_e4m3/fwd/body.2.weight"):
        assert [e.step for e in acc.Scalars(tag)] == expected, (tag, sorted(acc.Tags()["scalars"])[:40])
