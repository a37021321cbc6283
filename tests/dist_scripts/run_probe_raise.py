"""Two CPU processes (gloo, ``ddp``) where rank 1's forward raises on the probed step.

Usage: ``python run_probe_raise.py OUT CALLBACK`` (CALLBACK ``on`` or ``off``). Step 0 is
tracked and is the capture's first tracked step, so the fidelity probe runs the eager forward first: on rank 1 it raises
``ValueError("rank 1 failed in forward")``. The fit must end with that error, as it does
without the callback; rank 0 must not claim that training continues untracked.
Lightning's ``ddp`` launcher re-runs this script for rank 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor


class Armed(nn.Module):
    """Linear(8, 4) that raises while ``armed`` (set per step by the LightningModule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("rank 1 failed in forward")
        return self.fc(x)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Armed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.model.armed = self.global_rank == 1 and self.global_step == 0
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out: Path, callback: bool) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=2,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=[ScaleMonitor(every_n_steps=1, histograms=False, code=False, capture="fx")] if callback else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=4, shuffle=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] == "on")
