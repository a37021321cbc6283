"""An MLP language model with outlier features in one layer: where per-tensor FP8 breaks a GEMM.

``MLPLM`` predicts the next token from the current and the previous one (their embeddings
summed) through pre-LayerNorm MLP blocks (``fc1``, GELU, ``fc2``), with or without residual
connections. In block ``outlier_block``, ``outliers`` hidden channels are multiplied by
``factor`` before ``fc2`` and the matching columns of ``fc2``'s weight are divided by it, so
the block computes what it would without them while ``fc2``'s input holds a few channels
``factor`` times the others (the "massive activations" of LLMs). Per-tensor scaling of that
input flushes the ordinary channels; the other layers are ordinary. ``OutlierLM`` trains it
with Adam; the outlier columns of ``fc2`` are held fixed (their gradient is zeroed before
each optimizer step), so the outliers last through training.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MLPLM", "OutlierLM"]


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int, outliers: int, factor: float, residual: bool, bias: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.residual, self.outliers = residual, outliers
        gain = torch.ones(hidden)
        gain[:outliers] = factor
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.fc2.weight[:, :outliers] /= factor

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc2(F.gelu(self.fc1(self.ln(x))) * self.gain)  # (B, T, dim)
        return x + y if self.residual else y


class MLPLM(nn.Module):
    """A next-token MLP model whose block ``outlier_block`` carries outlier features into ``fc2``.

    Args:
        vocab: tokens.
        dim: model width (the hidden width is 4x).
        blocks: MLP blocks.
        outlier_block: the block with outlier channels (-1: none).
        outliers: how many hidden channels are outliers there.
        factor: how much larger they are.
        residual: residual connections around the blocks (without them every block's output
            is the only way forward).
        bias: the linear layers have biases.
    """

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 64,
        blocks: int = 4,
        outlier_block: int = 2,
        outliers: int = 2,
        factor: float = 1e5,
        residual: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.tok, self.prev = nn.Embedding(vocab, dim), nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            _Block(dim, 4 * dim, outliers if i == outlier_block else 0, factor, residual, bias) for i in range(blocks)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=bias)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.prev(F.pad(idx[:, :-1], (1, 0)))  # (B, T, dim): this token and the last
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class OutlierLM(pl.LightningModule):
    """``MLPLM`` trained on next-token cross-entropy with Adam (keyword arguments: ``MLPLM``'s)."""

    def __init__(self, lr: float = 3e-3, **kwargs: Any) -> None:
        super().__init__()
        self.model = MLPLM(**kwargs)
        self.lr = lr
        self.losses: List[float] = []

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: Tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        for block in self.model.blocks:
            grad = block.fc2.weight.grad
            if block.outliers and grad is not None:
                grad[:, : block.outliers] = 0  # (the outliers' columns stay as built)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)
