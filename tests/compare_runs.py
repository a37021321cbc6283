"""Pairs of real runs for the comparison's tests: short Trainer fits with ScaleMonitor of a
tiny GPT (``tools.models.GPT``), the same seed and data, differing in one way each (a
layer's weights scaled at initialisation, ``torch.compile``, the statistics logged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.tools.models import GPT, GPTConfig, synthetic_tokens

VOCAB, SEQ, STEPS = 32, 8, 3
#: The layer whose weights ``fit(scaled=...)`` multiplies: the second block's MLP output layer.
SCALED_LAYER = "model.blocks.1.mlp.fc2"


class TinyGPT(pl.LightningModule):
    """A 2-layer GPT of width 16, ``compile``: ``torch.compile(gpt, backend=...)``;
    ``scaled``: a factor for ``SCALED_LAYER``'s weight at initialisation."""

    def __init__(self, compile_backend: Optional[str] = None, scaled: Optional[float] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        gpt: Any = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, layers=2, dim=16, heads=2))
        if scaled is not None:
            with torch.no_grad():
                gpt.get_submodule(SCALED_LAYER.removeprefix("model.")).weight.mul_(scaled)
        self.model = torch.compile(gpt, backend=compile_backend) if compile_backend else gpt

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    root: Path,
    name: str,
    *,
    compile_backend: Optional[str] = None,
    scaled: Optional[float] = None,
    statistics: Sequence[str] = ("std", "absmax"),
    every_n_steps: int = 1,
    steps: int = STEPS,
    module: Callable[..., pl.LightningModule] = TinyGPT,
) -> Path:
    """Train ``module(compile_backend, scaled)`` (a ``TinyGPT``) for ``steps`` steps under
    ``ScaleMonitor`` into ``root/name``; the run's directory."""
    x, y = synthetic_tokens(32, SEQ, VOCAB)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=pl.loggers.TensorBoardLogger(str(root), name=name, version=""),
        callbacks=[
            ScaleMonitor(every_n_steps=every_n_steps, statistics=list(statistics), figure=False, histograms=False)
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module(compile_backend, scaled), DataLoader(TensorDataset(x, y), batch_size=8))
    return root / name
