"""Train a tiny MLP on 2 CPU processes (gloo) and save what the distributed tests check.

Usage: ``python run_dist.py OUT STRATEGY CALLBACK`` with STRATEGY one of ``ddp``,
``ddp_spawn``, ``fsdp2`` and CALLBACK ``on``, ``off`` or ``fail`` (on, and every
statistic raises on rank 1 only). Lightning's ``ddp`` launcher re-runs this script for
rank 1.

Writes to OUT: ``init.pt`` (initial parameters), ``batch_rank<r>.pt`` (each rank's first
batch), ``params.pt`` (full parameters after training), ``logs/`` (TensorBoard, rank 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """Linear(8, 16) - ReLU - Linear(16, 4), as two blocks (two FSDP units)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8, 16, True), Block(16, 4, False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Module(pl.LightningModule):
    def __init__(self, out: Path, fsdp: bool) -> None:
        super().__init__()
        self.out, self.fsdp = out, fsdp
        self.model = MLP()

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        if self.global_step == 0:
            torch.save((x, y), self.out / f"batch_rank{self.global_rank}.pt")
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def full_state(module: nn.Module) -> dict:
    """Full (unsharded) parameters; a collective under FSDP2."""
    out = {}
    for name, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _fail_on_rank_1() -> None:
    if int(os.environ.get("LOCAL_RANK", "0")) == 1:
        from lightning_scale.record import short_records
        from lightning_scale.record import stats

        def record_of(*args: object, **kwargs: object) -> None:
            raise RuntimeError("injected failure on rank 1")

        stats.record_of = record_of  # type: ignore[assignment]
        short_records.records_of_many = record_of  # type: ignore[assignment]  # short tensors, computed together


def main(out: Path, strategy_name: str, mode: str) -> None:
    callback = mode in ("on", "fail")
    if mode == "fail":
        _fail_on_rank_1()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    module = Module(out, fsdp=strategy_name == "fsdp2")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(full_state(module.model), out / "init.pt")
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if strategy_name == "fsdp2" else strategy_name
    callbacks = [ScaleMonitor(every_n_steps=None, steps=[0], histograms=False, figure=False, code=False, rank_spread=True)] if callback else []
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False))
    state = full_state(module.model)
    if trainer.is_global_zero:
        torch.save(state, out / "params.pt")
    if torch.distributed.is_initialized():  # else gloo's teardown waits ~10 s at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
