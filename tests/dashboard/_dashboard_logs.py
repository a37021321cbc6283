"""A real short Trainer run with ScaleMonitor, shared by the dashboard tests, and readers
of what it wrote (an independent path: TensorBoard's EventAccumulator)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor, Statistic

STEPS = 4
#: A user statistic the run logs beside the built-in ones: the dashboard shows it on the log2
#: axis it declares and ranks nodes by it, largest first.
PEAK_ABS = Statistic(
    "peak_abs",
    maxes={"a": torch.abs},
    value=lambda s: s["a"],
    axis="log2",
    worse="high",
    unscale=1,
    doc="max |x|, ours",
)


class Blocks(pl.LightningModule):
    """Two residual blocks (Linear-GELU-Linear) and a head; the gradient of the loss is scaled
    down so backward scales fall below FP16's smallest normal, as in real runs."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)) for _ in range(2)
        )
        self.head = nn.Linear(dim, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y) * 1e-4

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class UpdateRatios(pl.Callback):
    """Logs ``update_ratio/<parameter>`` as the update/weight-ratio feature names it, so the
    dashboard's side panel has something to show (value: the step number, recognisable)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        trainer.logger.experiment.add_scalar(
            "update_ratio/blocks.0.0.weight", 0.001 * (trainer.global_step), trainer.global_step - 1
        )


def write_logs(root: Path) -> Path:
    """Train ``Blocks`` for ``STEPS`` steps, every step tracked (and one validation batch); the log dir."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, torch.randn(64, 2))
    monitor = ScaleMonitor(
        every_n_steps=1,
        statistics=["std", "absmax", "below_normal_fp16", PEAK_ABS],
        figure=False,
        track_validation=True,
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="run"),
        callbacks=[monitor, UpdateRatios()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=2,
        limit_val_batches=1,
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
    return Path(trainer.logger.log_dir)


GPT_STEPS = 3


def write_gpt_logs(root: Path, layers: int = 56) -> Path:
    """The demo GPT with ``layers`` narrow layers (width 8: ~36 nodes a layer, 56 layers ~2,000
    nodes) trained ``GPT_STEPS`` steps with default ``ScaleMonitor`` options but every step
    tracked (so ``max_tags=1000`` caps its scalars); the log dir. A few seconds on a CPU."""
    from lightning_scale.tools.demo import GPTModule, token_loaders

    torch.manual_seed(0)
    train, _ = token_loaders(n=64, seq=8, vocab=32, batch=4)
    trainer = pl.Trainer(
        max_steps=GPT_STEPS,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="gpt"),
        callbacks=[ScaleMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer.fit(GPTModule(vocab=32, seq=8, layers=layers, dim=8, heads=2), train)
    return Path(trainer.logger.log_dir)


def logged(log_dir: Path) -> Tuple[EventAccumulator, Dict[str, Dict[int, float]]]:
    """The run's events and every scalar as ``{tag: {step: value}}``."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc, {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}


def logged_labels(scalars: Dict[str, Dict[int, float]], prefix: str = "") -> List[str]:
    """Labels that have a ``<prefix>scale/`` tag."""
    return sorted({t.split("/", 2)[2] for t in scalars if t.startswith(f"{prefix}scale/")})
