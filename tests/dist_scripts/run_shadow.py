"""The shadow pass on 2 CPU processes over gloo: DDP, FSDP2 or tensor parallelism.

Usage: ``python run_shadow.py OUT STRATEGY RUN [RUN ...]``: STRATEGY ``ddp`` (``DDPStrategy``,
a comm hook counting the gradient buckets it all-reduces), ``fsdp2``
(``ModelParallelStrategy``, ``fully_shard`` on ``fc1``, ``fc2`` and the model) or ``tp``
(``ModelParallelStrategy``, ``fc1`` column- and ``fc2`` row-parallel; the embedding and the
head outside the plan); each RUN one fit of 4 steps (0 and 2 tracked), in turn in the same
rank processes: ``off`` (no callback), ``always`` (``ScaleMonitor(shadow="always")``) or
``never`` (tracked in place). Lightning's launcher re-runs this script for rank 1.

Writes to ``OUT/RUN``: ``params.pt`` (full parameters after the fit, rank 0), ``logs/``
(TensorBoard, rank 0), ``calls_rank<r>.json``: the ``torch.distributed`` collectives the rank
called during the fit, whoever called them (name and global step, in order), and the buckets
DDP's comm hook all-reduced.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_dist import fits_in_turn, full_state  # noqa: E402

from lightning_scale import ScaleMonitor  # noqa: E402

VOCAB, D, H, T = 32, 16, 32, 6
_NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "barrier",
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, H)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(H, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.drop(F.gelu(self.fc1(self.emb(idx))))))


class Module(pl.LightningModule):
    def __init__(self, strategy: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model, self.strategy_name = MLP(), strategy

    def configure_model(self) -> None:
        if self.strategy_name == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
        elif self.strategy_name == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.model.fc1, self.model.fc2):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, y = batch
        return F.cross_entropy(self(idx).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def counting(calls: List[Any], trainer: List[pl.Trainer]) -> None:
    """Wrap ``torch.distributed``'s collectives: every call is appended to ``calls``."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append([name, trainer[0].global_step if trainer else None])
            return fn(*args, **kwargs)

        return counted

    for name in _NAMES:
        if hasattr(torch.distributed, name):
            setattr(torch.distributed, name, wrap(name, getattr(torch.distributed, name)))


class CountBuckets(pl.Callback):
    """A DDP comm hook (Lightning registers ``ddp_comm_hook`` on CUDA only) that counts the
    gradient buckets DDP all-reduces, in ``calls``."""

    def __init__(self, calls: List[Any]) -> None:
        self.calls = calls

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP refuses any annotation but GradBucket's)
            self.calls.append(["ddp_bucket", trainer.global_step])
            return allreduce_hook(state, bucket)

        trainer.strategy.model.register_comm_hook(None, hook)  # type: ignore[union-attr]


def strategy_of(name: str) -> Any:
    if name == "ddp":
        return DDPStrategy()
    tp = 2 if name == "tp" else 1
    return ModelParallelStrategy(data_parallel_size=2 // tp, tensor_parallel_size=tp)


def fit(out: Path, strategy: str, mode: str, calls: "tuple[list, list]") -> None:
    holder, collectives = calls
    collectives.clear()
    torch.manual_seed(0)
    dp = 1 if strategy == "tp" else 2
    data = TensorDataset(torch.randint(0, VOCAB, (8 * dp, T)), torch.randint(0, VOCAB, (8 * dp, T)))
    module = Module(strategy)
    monitor = ScaleMonitor(every_n_steps=2, shadow=mode, histograms=False, code=False) if mode != "off" else None
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_of(strategy),
        max_steps=4,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=([CountBuckets(collectives)] if strategy == "ddp" else []) + ([monitor] if monitor else []),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    holder[:] = [trainer]
    trainer.fit(module, DataLoader(data, batch_size=2, shuffle=False))
    rank = trainer.global_rank
    (out / f"calls_rank{rank}.json").write_text(json.dumps(list(collectives)))
    state = full_state(module.model)
    if trainer.is_global_zero:
        torch.save(state, out / "params.pt")
        if monitor is not None:
            (out / "shadowed.json").write_text(json.dumps([c.shadowed for c in monitor.captures.values()]))


def main(out: Path, strategy: str, runs: List[str]) -> None:
    holder: List[pl.Trainer] = []
    collectives: List[Any] = []
    counting(collectives, holder)
    fits_in_turn(
        out, runs, lambda mode: mode, lambda folder, mode, _: fit(folder, strategy, mode, (holder, collectives))
    )


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
