"""The demo behind ``make demo``: a small GPT-like model trained with ScaleMonitor on CPU.

Synthetic token data (nothing is downloaded); about a minute on two cores. Writes
TensorBoard logs under ``lightning_logs/`` and prints how to open them.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.callback import ScaleMonitor
from lightning_scale.tools.models import GPT, GPTConfig, synthetic_tokens

__all__ = ["GPTModule", "main", "token_loaders"]


class GPTModule(pl.LightningModule):
    """A LightningModule around ``models.GPT``: next-token cross-entropy, AdamW."""

    def __init__(
        self,
        vocab: int = 256,
        seq: int = 64,
        layers: int = 4,
        dim: int = 128,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab, seq, layers, dim, heads, dropout))
        self.lr = lr

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: Any) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def token_loaders(n: int = 4096, seq: int = 64, vocab: int = 256, batch: int = 16) -> "tuple[DataLoader, DataLoader]":
    """Train and validation loaders of synthetic token sequences."""
    x, y = synthetic_tokens(n, seq, vocab, seed=0)
    split = n * 9 // 10
    train = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=batch, shuffle=True)
    val = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=batch)
    return train, val


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--logdir", default="lightning_logs")
    parser.add_argument("--figure", default=None, help="also save the last scale figure to this PNG path")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    train, val = token_loaders()
    monitor = ScaleMonitor(every_n_steps=args.every, statistics=["std", "absmax"], track_validation=True)
    trainer = pl.Trainer(
        max_steps=args.steps,
        # with max_steps alone the bar reads "Epoch 4/-2": give the epochs those steps span
        max_epochs=math.ceil(args.steps / len(train)),
        accelerator="cpu",
        devices=1,
        callbacks=[monitor, _progress_bar()],
        default_root_dir=".",
        logger=pl.loggers.TensorBoardLogger(args.logdir, name="demo"),
        val_check_interval=100,
        log_every_n_steps=10,
        enable_checkpointing=False,
    )
    model = GPTModule()
    trainer.fit(model, train, val)
    logdir = trainer.logger.log_dir if trainer.logger else args.logdir
    if args.figure:
        _save_figure(model, args.figure)
    print(f"\nScale logs written to {os.path.abspath(logdir)}")
    print(f"Open them with:\n\n    .venv/bin/tensorboard --logdir {args.logdir}\n")
    print("then browse http://localhost:6006/#scales: the SCALES dashboard (profile at a step, heatmap,")
    print("worst nodes, annotated code). Also: CUSTOM SCALARS (log2 std by block, forward and backward charts),")
    print("TEXT: scale_worst (nodes nearest the FP16 range edges) and scale_code.")


def _progress_bar() -> pl.Callback:
    """Lightning's default bar without ``v_num`` (the rich bar prints the version as ``0.000``)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    base = RichProgressBar if _RICH_AVAILABLE else TQDMProgressBar

    class Bar(base):  # type: ignore[valid-type,misc]  # chosen at run time, as Lightning does
        def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            return items

    return Bar()


def _save_figure(model: GPTModule, path: str) -> None:
    from lightning_scale.capture import capture
    from lightning_scale.record.recorder import Recorder, recording
    from lightning_scale.report.figure import scale_figure
    from lightning_scale.report.values import StepValues

    x, y = synthetic_tokens(16, 64, 256, seed=1)
    cap = capture(model.model, "auto")
    rec = Recorder()
    with recording(rec):
        logits = cap.tracked()(x)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)).backward()
    labels = [l for l in cap.node_labels if l not in cap.aliases]
    records = rec.records(labels).cpu()
    keep = [i for i in range(len(labels)) if records[i, 0, 0] > 0]
    fig = scale_figure([labels[i] for i in keep], StepValues(records[keep]), "GPT demo, after training")
    fig.savefig(path, dpi=110)
    rec.clear()


if __name__ == "__main__":
    main()
