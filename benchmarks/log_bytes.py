"""Bytes ScaleMonitor's own event file takes per tracked step (docs/usage.md's table).

MLPs of 12, 30 and 102 nodes (1, 4 and 16 hidden layers of width 32) trained for 13 steps,
every step tracked, with ``ScaleMonitor(every_n_steps=1)``'s defaults, then with one more
statistic (``absmax``) and with ``code=False``; each event record of the callback's file
(``*.scales``) is counted at its step, framing included. Prints the first step and the median
of steps 2-12.

Usage: ``python benchmarks/log_bytes.py`` (about a minute on two cores).
"""

from __future__ import annotations

import glob
import os
import statistics
import struct
import sys
import tempfile
from typing import Any, Dict, List

import workload  # noqa: F401 - puts the checkout's package on sys.path

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor

DEPTHS = (1, 4, 16)
STEPS = 13
VARIANTS: Dict[str, Dict[str, Any]] = {
    "defaults": {},
    "statistics=['std', 'absmax']": {"statistics": ["std", "absmax"]},
    "code=False": {"code": False},
}


class MLP(pl.LightningModule):
    """``depth`` hidden layers of width 32 (Linear, ReLU), a linear head."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(32, 32), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def bytes_by_step(path: str) -> Dict[int, int]:
    """Bytes of each step's records in a TFRecord event file (length, CRCs and payload)."""
    out: Dict[int, int] = {}
    data, pos = open(path, "rb").read(), 0
    while pos < len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12 : pos + 12 + n])
        out[event.step] = out.get(event.step, 0) + n + 16
        pos += n + 16
    return out


def measure(root: str, depth: int, **kwargs: Any) -> Dict[str, float]:
    """Nodes logged, the first step's bytes and the median of steps 2-12."""
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(512, 32), torch.randn(512, 1)), batch_size=16)
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=[ScaleMonitor(every_n_steps=1, **kwargs)],
        logger=pl.loggers.TensorBoardLogger(root, name=f"d{depth}"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(MLP(depth), data)
    [path] = glob.glob(os.path.join(trainer.logger.log_dir, "*.scales"))
    steps = bytes_by_step(path)
    events = EventAccumulator(trainer.logger.log_dir)
    events.Reload()
    nodes = {t.split("/", 2)[2] for t in events.Tags()["scalars"] if t.startswith("scale/")}
    return {"nodes": len(nodes), "first": steps[0], "step": statistics.median(steps[s] for s in range(2, STEPS))}


def main() -> int:
    print("| nodes N | variant | first step, bytes | bytes per tracked step (median, steps 2-12) |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for depth in DEPTHS:
            for name, kwargs in VARIANTS.items():
                m = measure(root, depth, **kwargs)
                print(f"| {m['nodes']} | {name} | {m['first']:,} | {m['step']:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
