"""A tiny Llama under FSDP2 with compiled decoder layers, on one gloo rank of ``WORLD``.

Usage: ``python run_hf_fsdp.py OUT RANK WORLD PATTERN`` (``tests/gloo.run_ranks`` starts the
ranks). PATTERN ``blocks`` replaces each layer by ``torch.compile(layer)`` after
``fully_shard(layer)``, ``blocks_in_place`` calls ``layer.compile()`` on it. The backend is
``aot_eager`` (the route is Inductor's without its C++ compiles). Trains three steps with
``ScaleMonitor`` (steps 0 and 2 tracked), then the same from the same seed without it, in this
one process, and saves ``rank{RANK}.pt``: the full parameters after each fit, the tags the
callback's capture made and the callback's warnings; rank 0 also writes TensorBoard logs to
``OUT/logs``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from lightning_scale import ScaleMonitor
from tests.compiling import tiny_llama

VOCAB, SEQ = 64, 8


class FsdpLlama(pl.LightningModule):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_llama(VOCAB)
        self.pattern = pattern

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        layers = self.model.model.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        for i, layer in enumerate(layers):  # (the per-block pattern of large trainers)
            if self.pattern == "blocks":
                layers[i] = torch.compile(layer, backend="aot_eager")
            else:
                layer.compile(backend="aot_eager")

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def full_state(module: nn.Module) -> Dict[str, Tensor]:
    """Full (unsharded) parameters; a collective under FSDP2."""
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def fit(out: Path, world: int, pattern: str, monitor: Optional[ScaleMonitor]) -> Dict[str, Tensor]:
    batches = [torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i)) for i in range(6 * world)]
    module = FsdpLlama(pattern)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=3,
        logger=TensorBoardLogger(str(out), name="logs", version=0) if monitor else False,
        callbacks=[monitor] if monitor else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=2))
    return full_state(module.model)


def main(out: Path, rank: int, world: int, pattern: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # (ranks started outside)
    monitor = ScaleMonitor(every_n_steps=2, histograms=False, code=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = fit(out, world, pattern, monitor)
    ours: List[str] = [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)]
    tags: List[Any] = [list(c.tags) for c in monitor.captures.values()]
    torch._dynamo.reset()
    off = fit(out, world, pattern, None)
    torch.save({"on": on, "off": off, "tags": tags, "warnings": ours}, out / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
