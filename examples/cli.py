"""LightningCLI over the demo GPT, with ScaleMonitor configured from YAML.

Run from the repository root::

    .venv/bin/python examples/cli.py fit --config examples/cli_config.yaml

``trainer.callbacks`` in the YAML file sets the ``ScaleMonitor`` (``class_path`` and
``init_args``); any of its arguments can also be given on the command line, e.g.
``--trainer.callbacks.every_n_steps=10`` after the config.
"""

from __future__ import annotations

from typing import Any, List, Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale.tools.demo import GPTModule
from lightning_scale.tools.models import synthetic_tokens


class TokenDataModule(pl.LightningDataModule):
    """Synthetic token sequences (``models.synthetic_tokens``): 90% train, 10% validation.

    Args:
        n: number of sequences.
        seq: sequence length.
        vocab: vocabulary size.
        batch_size: sequences per batch.
        seed: seed of the generated data.
    """

    def __init__(self, n: int = 4096, seq: int = 64, vocab: int = 256, batch_size: int = 16, seed: int = 0) -> None:
        super().__init__()
        self.n, self.seq, self.vocab, self.batch_size, self.seed = n, seq, vocab, batch_size, seed
        self.train: Optional[TensorDataset] = None
        self.val: Optional[TensorDataset] = None

    def setup(self, stage: str) -> None:
        x, y = synthetic_tokens(self.n, self.seq, self.vocab, seed=self.seed)
        split = self.n * 9 // 10
        self.train = TensorDataset(x[:split], y[:split])
        self.val = TensorDataset(x[split:], y[split:])

    def train_dataloader(self) -> DataLoader:
        assert self.train is not None
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val is not None
        return DataLoader(self.val, batch_size=self.batch_size)


class ScaleCLI(LightningCLI):
    """The model's sequence length and vocabulary follow the data's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.seq", "model.seq")
        parser.link_arguments("data.vocab", "model.vocab")


def main(args: Optional[List[str]] = None, **kwargs: Any) -> ScaleCLI:
    """Parse ``args`` (default: the command line) and run the subcommand."""
    return ScaleCLI(GPTModule, TokenDataModule, args=args, save_config_kwargs={"overwrite": True}, **kwargs)


if __name__ == "__main__":
    main()
