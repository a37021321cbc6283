"""Train a tiny MLP on 2 CPU processes (gloo) with update ratios and anomaly detection on,
and save a float64 reference of every optimizer step's full parameters and gradients.

Usage: ``python run_updates.py OUT RUN...``, each RUN ``STRATEGY`` or ``STRATEGY:fail``, fitted
in turn in the same two processes, each to ``OUT/RUN`` (``:`` as ``_``), with STRATEGY ``ddp`` or
``fsdp2``; ``fail``: rank 1's update rows fail at step 7 (an injected error). Rank 0 prints
``=== run RUN ===`` before each fit; the ranks meet in a barrier after it. Rank 1
alone reports a loss spike at step 5 (its loss value only: ``+ 1e3 * loss.detach()`` leaves
the gradient as it is). Tracked: step 1 (schedule) and, through the anomaly, 7 and 8.

Writes to each run's folder: ``reference.pt`` (rank 0: per optimizer step, full parameters before and
after, full gradients) and ``logs/`` (TensorBoard, rank 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_scale.record.updates as updates
from lightning_scale import ScaleMonitor

FAIL = {"armed": False, "now": False}
_row_of = updates.row_of


def _flaky_row_of(*args: Any) -> torch.Tensor:
    if FAIL["now"]:
        raise RuntimeError("injected update-row failure")
    return _row_of(*args)


updates.row_of = _flaky_row_of


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a collective under FSDP2
    return full.detach().double().clone()


class Module(pl.LightningModule):
    def __init__(self, fsdp: bool) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def configure_model(self) -> None:
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if self.global_step == 5 and self.global_rank == 1:
            loss = loss + 1e3 * loss.detach()
        FAIL["now"] = FAIL["armed"] and self.global_step == 7 and self.global_rank == 1
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Reference(pl.Callback):
    """Full parameters before and after each optimizer step, and the gradients it used."""

    def __init__(self) -> None:
        self.steps: List[Dict[str, Dict[str, torch.Tensor]]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append({"before": {n: _full(p) for n, p in pl_module.named_parameters()}})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        params = list(pl_module.named_parameters())
        self.steps[-1]["after"] = {n: _full(p) for n, p in params}
        self.steps[-1]["grad"] = {n: _full(p.grad) for n, p in params}


def main(out: Path, strategy_name: str) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if strategy_name == "fsdp2"
        else strategy_name
    )
    reference = Reference()
    monitor = ScaleMonitor(
        every_n_steps=None, steps=[1], histograms=False, figure=False, code=False, anomaly_steps=2, update_ratios=True
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=10,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=[monitor, reference],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(strategy_name == "fsdp2"), DataLoader(data, batch_size=4, shuffle=False))
    if trainer.is_global_zero:
        torch.save(reference.steps, out / "reference.pt")


def runs(out: Path, names: List[str]) -> None:
    for name in names:
        strategy, _, fail = name.partition(":")
        folder = out / name.replace(":", "_")
        folder.mkdir(parents=True, exist_ok=True)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"=== run {folder.name} ===", flush=True)
        FAIL["armed"], FAIL["now"] = fail == "fail", False
        main(folder, strategy)
        if torch.distributed.is_initialized():  # a fit's console lines before the next marker
            torch.distributed.barrier()
    if torch.distributed.is_initialized():  # else gloo's teardown waits ~10 s at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    runs(Path(sys.argv[1]), sys.argv[2:])
