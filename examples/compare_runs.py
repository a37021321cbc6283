"""Where do two runs part? Two short runs of the demo GPT, one with a layer's weights x8 at
initialisation, compared node by node with ``lightning-scale compare``.

Run from the repository root (about a minute on two cores)::

    .venv/bin/python examples/compare_runs.py --logdir compare_logs

It trains ``compare_logs/base`` and ``compare_logs/scaled`` (the same seed and data; in
``scaled``, ``model.blocks.1.mlp.fc2``'s weight is multiplied by 8), tracking steps 0, 10 and
20, then prints ``lightning-scale compare`` at step 0, where the change entered (that weight is
the first divergence, +3.00 octaves, then that layer's output), and at the last step both runs
tracked (step 20). Then try::

    lightning-scale compare compare_logs/base compare_logs/scaled --json
    tensorboard --logdir compare_logs    # SCALES -> Compare, run B: scaled
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional

import lightning.pytorch as pl
import torch

from lightning_scale import ScaleMonitor
from lightning_scale.tools.cli import main as cli
from lightning_scale.tools.demo import GPTModule, token_loaders


def train(logdir: Path, name: str, factor: float = 1.0, steps: int = 21) -> Path:
    """The demo GPT (2 layers, width 32) for ``steps`` steps, ``fc2`` of block 1 scaled by ``factor``."""
    torch.manual_seed(0)
    module = GPTModule(vocab=64, seq=16, layers=2, dim=32, heads=2)
    with torch.no_grad():
        module.model.blocks[1].mlp.fc2.weight.mul_(factor)
    loader, _ = token_loaders(n=512, seq=16, vocab=64, batch=8)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(logdir), name=name, version=""),
        callbacks=[ScaleMonitor(every_n_steps=10, statistics=["std", "absmax"])],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return logdir / name


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="compare_logs")
    args = parser.parse_args(argv)
    base, scaled = train(Path(args.logdir), "base"), train(Path(args.logdir), "scaled", factor=8.0)
    for when in (["--step", "0"], []):
        print(f"\n$ lightning-scale compare {base} {scaled} {' '.join(when)} --top 8")
        cli(["compare", str(base), str(scaled), *when, "--top", "8"])


if __name__ == "__main__":
    main()
