"""FP8 what-if on the demo GPT: which ops would lose the most if cast to FP8?

Run from the repository root (about two minutes on two cores)::

    .venv/bin/python examples/fp8_whatif.py --logdir lightning_logs

The demo GPT trains on synthetic tokens with ``ScaleMonitor`` logging the ``fp8`` group
(every tracked tensor cast to E4M3 and to E5M2 with per-tensor amax scaling, see
docs/fp8.md). The script reads the values back from the TensorBoard event file and prints,
at the last tracked step, the ops and parameters with the lowest signal-to-noise ratio and
the highest fraction of nonzeros flushed to zero: forward values in E4M3, gradients in
E5M2 (the usual FP8 training recipe), and what gradients would lose in E4M3 (recipes that
use E4M3 everywhere). ``--precision bf16-mixed`` runs the model in bf16.
"""

from __future__ import annotations

import argparse
import glob
import os
import math
from typing import Dict, List, Set, Tuple

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_scale import ScaleMonitor
from lightning_scale.tools.demo import GPTModule, token_loaders

#: (direction, format, what): E4M3 forward, E5M2 for gradients, and gradients in E4M3.
SECTIONS = (
    ("fwd", "e4m3", "forward values"),
    ("bwd", "e5m2", "gradients"),
    ("bwd", "e4m3", "gradients (recipes with E4M3 everywhere)"),
)
STATISTICS = ["std", "absmax", *(f"fp8_{fmt}_{kind}" for fmt in ("e4m3", "e5m2") for kind in ("snr_db", "flushed"))]
Row = Tuple[str, float, float, float, float]  # label, SNR dB, flushed fraction, std, absmax


def read(logdir: str) -> Dict[str, Dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in the run's event file."""
    acc = EventAccumulator(
        os.path.dirname(
            glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)[0]
        )  # every event file of the run, size_guidance={"scalars": 0}
    )
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def rows(scalars: Dict[str, Dict[int, float]], d: str, fmt: str, step: int, parameters: Set[str]) -> List[Row]:
    """One row per op node (``module/op``) and parameter of direction ``d`` in ``fmt`` at ``step``.

    Module outputs (``model.blocks.0.mlp``) are left out: each is also an op's output.
    """
    head = f"fp8_{fmt}_snr_db/{d}/"
    out = []
    for tag in scalars:
        label = tag[len(head) :]
        if not tag.startswith(head) or step not in scalars[tag] or ("/" not in label and label not in parameters):
            continue
        flushed = scalars[f"fp8_{fmt}_flushed/{d}/{label}"][step]
        out.append(
            (
                label,
                scalars[tag][step],
                flushed,
                scalars[f"scale/{d}/{label}"][step],
                scalars[f"absmax/{d}/{label}"][step],
            )
        )
    return out


def table(title: str, picked: List[Row], parameters: Set[str]) -> str:
    """A markdown table of ``picked`` rows; parameters are marked (param). ``absmax/std`` in
    octaves is the range the per-tensor scale has to cover: the wider, the more values fall
    below the format's normal range."""
    lines = [f"**{title}**", "", "| node | SNR dB | flushed | std | log2(absmax/std) |", "|---|---:|---:|---:|---:|"]
    for label, snr, flushed, std, absmax in picked:
        mark = " (param)" if label in parameters else ""
        crest = math.log2(absmax / std) if std > 0 else math.inf
        lines.append(f"| `{label}`{mark} | {snr:.1f} | {100 * flushed:.2g}% | {std:.3g} | {crest:.1f} |")
    return "\n".join(lines)


def report(scalars: Dict[str, Dict[int, float]], step: int, parameters: Set[str], top: int) -> str:
    """For each of ``SECTIONS``: the ``top`` lowest-SNR and highest-flushed rows, and a summary."""
    parts = []
    for d, name, what in SECTIONS:
        fmt = name.upper()
        all_rows = rows(scalars, d, name, step, parameters)
        finite = sorted(r[1] for r in all_rows if math.isfinite(r[1]))
        median = finite[len(finite) // 2] if finite else math.nan
        parts.append(f"### {what} in {fmt} ({len(all_rows)} nodes, median SNR {median:.1f} dB, step {step})")
        parts.append(table(f"lowest SNR in {fmt}", sorted(all_rows, key=lambda r: r[1])[:top], parameters))
        flushed = [r for r in sorted(all_rows, key=lambda r: -r[2]) if r[2] > 0][:top]
        parts.append(
            table(f"highest fraction flushed to 0 in {fmt}", flushed, parameters)
            if flushed
            else f"no value flushed to 0 in {fmt}"
        )
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--precision", default="32-true", help='"32-true" or "bf16-mixed"')
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, _ = token_loaders()
    monitor = ScaleMonitor(every_n_steps=args.every, statistics=STATISTICS, figure=False, histograms=False, code=False)
    logger = pl.loggers.TensorBoardLogger(args.logdir, name="fp8_whatif")
    trainer = pl.Trainer(
        max_steps=args.steps,
        precision=args.precision,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = GPTModule()
    trainer.fit(model, train)
    scalars = read(logger.log_dir)
    step = max(s for tag, series in scalars.items() if tag.startswith("scale/fwd/") for s in series)
    parameters = {name for name, _ in model.named_parameters()}
    print(f"\nFP8 what-if on the demo GPT ({args.precision}), read back from {logger.log_dir}\n")
    print(report(scalars, step, parameters, args.top))


if __name__ == "__main__":
    main()
