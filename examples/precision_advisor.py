"""The precision advisor's path, end to end, on a CPU (torchao's emulated FP8):

1. train in high precision with ``ScaleMonitor(advise=True)``;
2. ``lightning-scale advise`` on its logs: ``recipe.json`` and ``torchao_recipe.py``;
3. apply the exported file to a fresh model with torchao and ``check_recipe`` it;
4. train, from the same initial weights and batches, the advised recipe and every linear layer
   in FP8 tensorwise, and print a table: each run's layers in low precision, its share of the
   GEMMs (by count, and by size K x N) and its losses.

Models: ``outlier`` (``tools.outlier_model.MLPLM`` without residual connections, so block 2's
``fc2``, whose input carries two channels 1e5 times the others, is on the only path) or ``gpt``
(the demo GPT, small). The run with ``ScaleMonitor`` trains bit for bit as a plain one, so it is
the high-precision row.

    .venv/bin/python examples/precision_advisor.py --model outlier --steps 200 --logdir lightning_logs/advisor
    .venv/bin/python examples/precision_advisor.py --model gpt --steps 100 --logdir lightning_logs/advisor_gpt
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor, check_recipe
from lightning_scale.tools.cli import main as command
from lightning_scale.tools.demo import GPTModule
from lightning_scale.tools.models import synthetic_tokens
from lightning_scale.tools.outlier_model import OutlierLM

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training


class LossLog(pl.Callback):
    """Every training step's loss."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def build(model: str) -> pl.LightningModule:
    torch.manual_seed(0)
    if model == "outlier":
        return OutlierLM(residual=False)
    return GPTModule(vocab=64, seq=32, layers=2, dim=64, heads=4)


def train(lit: pl.LightningModule, steps: int, callbacks: Sequence[Any], logdir: Optional[str]) -> List[float]:
    x, y = synthetic_tokens(4096, 32, 64)
    losses = LossLog()
    trainer = pl.Trainer(
        max_steps=steps,
        logger=pl.loggers.TensorBoardLogger(logdir, name="high_precision") if logdir else False,
        callbacks=[losses, *callbacks],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(1)  # (the same batches in every run)
    trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    return losses.losses


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("torchao_recipe", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fp8_layers(lit: pl.LightningModule) -> Dict[str, int]:
    """Linear layer name -> K x N, for those in FP8 (``Float8Linear``)."""
    return {n: m.in_features * m.out_features for n, m in lit.named_modules() if type(m).__name__ == "Float8Linear"}


def row(name: str, lit: pl.LightningModule, losses: List[float], sizes: Dict[str, int]) -> str:
    low = fp8_layers(lit)
    share = sum(low.values()) / sum(sizes.values())
    last = sum(losses[-20:]) / len(losses[-20:])
    return (
        f"| {name} | {len(low)} of {len(sizes)} ({len(low) / len(sizes):.0%}) | {share:.0%} | "
        f"{losses[0]:.3f} | {last:.3f} |"
    )


def run(model: str, steps: int, logdir: str) -> None:
    start = time.time()
    high = build(model)
    monitor = ScaleMonitor(every_n_steps=max(1, steps // 4), advise=True)
    losses = {"high precision (fp32)": train(high, steps, [monitor], logdir)}
    out = Path(logdir) / "advice"
    assert command(["advise", logdir, "--out", str(out)]) == 0
    exported = load(out / "torchao_recipe.py")
    runs = {"high precision (fp32)": high}
    for name in ("every linear layer in fp8-tensorwise", "the advised recipe (torchao_recipe.py)"):
        lit = build(model)
        if name.startswith("every"):
            convert_to_float8_training(lit, config=dataclasses.replace(Float8LinearConfig(), emulate=True))
        else:
            convert_to_float8_training(lit, config=exported.config, module_filter_fn=exported.module_filter_fn)
            assert check_recipe(lit, out / "recipe.json") == []
        losses[name] = train(lit, steps, [], None)
        runs[name] = lit
    sizes = {n: m.in_features * m.out_features for n, m in high.named_modules() if isinstance(m, torch.nn.Linear)}
    print(f"\n{model}: {steps} steps, batch 32 x 32 tokens, Adam; {time.time() - start:.0f} s")
    print("| run | linear layers in FP8 | share of GEMM size (K x N) | first loss | mean loss, last 20 steps |")
    print("|---|---|---|---|---|")
    for name, lit in runs.items():
        print(row(name, lit, losses[name], sizes))


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["outlier", "gpt"], default="outlier")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--logdir", default="lightning_logs/advisor")
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    run(args.model, args.steps, args.logdir)
