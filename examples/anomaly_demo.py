"""A loss spike that triggers tracking, and update/weight ratios, on the demo GPT.

Run from the repository root (about a minute on two cores)::

    .venv/bin/python examples/anomaly_demo.py --logdir lightning_logs

The demo GPT trains on synthetic tokens with ``ScaleMonitor(every_n_steps=20,
anomaly_steps=3, update_ratios=True)``. At step ``--spike`` one batch goes wrong: its
logits are multiplied by 1000 (as an overflowing activation would), so the loss jumps.
The monitor tracks steps 0, 20, 40 by schedule and, one step of latency later, the three
steps after the spike. The script prints the anomaly, the tracked steps and the update
ratios read back from the TensorBoard event file.
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_scale import ScaleMonitor
from lightning_scale.tools.demo import GPTModule, token_loaders


class SpikyGPT(GPTModule):
    """The demo GPT, with one corrupted batch at step ``spike``."""

    def __init__(self, spike: int) -> None:
        super().__init__()
        self.spike = spike

    def _loss(self, batch: Any) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        if self.training and self.global_step == self.spike:
            logits = logits * 1000.0
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _read(logdir: str) -> EventAccumulator:
    acc = EventAccumulator(
        os.path.dirname(
            glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)[0]
        )  # every event file of the run, size_guidance={"scalars": 0, "tensors": 0}
    )
    acc.Reload()
    return acc


def _ratio_table(acc: EventAccumulator, names: List[str]) -> str:
    rows: Dict[int, Dict[str, float]] = {}
    for name in names:
        for event in acc.Scalars(f"update_ratio/{name}"):
            rows.setdefault(event.step, {})[name] = event.value
    head = "| step | " + " | ".join(f"`{n}`" for n in names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    lines += [f"| {s} | " + " | ".join(f"{rows[s][n]:.2e}" for n in names) + " |" for s in sorted(rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--spike", type=int, default=45)
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, _ = token_loaders()
    monitor = ScaleMonitor(
        every_n_steps=20, anomaly_steps=3, update_ratios=True, figure=False, histograms=False, code=False
    )
    logger = pl.loggers.TensorBoardLogger(args.logdir, name="anomaly_demo")
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SpikyGPT(args.spike), train)
    acc = _read(logger.log_dir)
    tracked = [e.step for e in acc.Scalars(next(t for t in acc.Tags()["scalars"] if t.startswith("scale/fwd/")))]
    print("\nanomaly/event:")
    for event in acc.Tensors("anomaly/event/text_summary"):
        print("   ", event.tensor_proto.string_val[0].decode())
    print(f"tracked steps: {tracked}")
    names = ["model.tok.weight", "model.blocks.0.attn.qkv.weight", "model.blocks.3.mlp.fc2.weight", "model.head.weight"]
    print("\nupdate_ratio (RMS of the AdamW update / RMS of the weight):\n")
    print(_ratio_table(acc, names))


if __name__ == "__main__":
    main()
