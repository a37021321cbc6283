"""Block-scaled what-if on the demo GPT: which ops would lose the most in MXFP4 and NVFP4?

Run from the repository root (a few minutes on two cores)::

    .venv/bin/python examples/block_whatif.py --logdir lightning_logs

The demo GPT trains on synthetic tokens with ``ScaleMonitor`` logging the ``blocks`` group
(every tracked tensor cast to MXFP8 E4M3 / E5M2, MXFP4 and NVFP4 with blocks along its last
dimension), ``kurtosis`` and the channel outliers (``channel_max_ratio``,
``outlier_channels``), see docs/low_precision.md. The script reads the values back from the
TensorBoard event file and prints, at the last tracked step: the median SNR of every format
forward and backward, and for MXFP4 and NVFP4, forward and backward, the op nodes and
parameters with the lowest SNR, beside their flushed fraction, kurtosis and channel
statistics (the reasons a tensor loses in a block format: spread inside blocks, heavy tails,
outlier channels).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
from typing import Dict, List, Set, Tuple

import lightning.pytorch as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_scale import ScaleMonitor
from lightning_scale.tools.demo import GPTModule, token_loaders

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
OUTLIERS = ("kurtosis", "channel_max_ratio", "outlier_channels")
STATISTICS = ["std", *(f"{f}_{k}" for f in FORMATS for k in ("snr_db", "flushed")), *OUTLIERS]
DIRECTIONS = (("fwd", "forward values"), ("bwd", "gradients"))
Scalars = Dict[str, Dict[int, float]]


def read(logdir: str) -> Scalars:
    """``{tag: {step: value}}`` of every scalar in the run's event files."""
    path = os.path.dirname(glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True)[0])
    acc = EventAccumulator(path, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def nodes(scalars: Scalars, d: str, step: int, parameters: Set[str]) -> List[str]:
    """The op nodes (``module/op``) and parameters with a record in direction ``d`` at ``step``.

    Module outputs (``model.blocks.0.mlp``) are left out: each is also an op's output.
    """
    head = f"scale/{d}/"
    labels = [t[len(head) :] for t in scalars if t.startswith(head) and step in scalars[t]]
    return [l for l in labels if "/" in l or l in parameters]


def value(scalars: Scalars, name: str, d: str, label: str, step: int) -> float:
    return scalars.get(f"{name}/{d}/{label}", {}).get(step, math.nan)


def medians(scalars: Scalars, step: int, parameters: Set[str]) -> str:
    """Median SNR (dB) and median flushed fraction of every format, forward and backward."""
    lines = [
        "| format | median SNR fwd | median SNR bwd | median flushed fwd | median flushed bwd |",
        "|---|" + "---:|" * 4,
    ]
    for fmt in FORMATS:
        cells = []
        for kind in ("snr_db", "flushed"):
            for d, _ in DIRECTIONS:
                vs = [value(scalars, f"{fmt}_{kind}", d, l, step) for l in nodes(scalars, d, step, parameters)]
                finite = [v for v in vs if math.isfinite(v)]
                m = statistics.median(finite) if finite else math.nan
                cells.append(f"{m:.1f} dB" if kind == "snr_db" else f"{100 * m:.2g}%")
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lowest(scalars: Scalars, fmt: str, d: str, step: int, parameters: Set[str], top: int) -> str:
    """A markdown table of the ``top`` nodes with the lowest SNR in ``fmt`` in direction ``d``,
    after a line counting the nodes flushed whole (every nonzero to 0: 0 dB), not listed."""
    rows: List[Tuple[float, str]] = []
    whole = 0
    for label in nodes(scalars, d, step, parameters):
        snr = value(scalars, f"{fmt}_snr_db", d, label, step)
        if value(scalars, f"{fmt}_flushed", d, label, step) == 1.0:
            whole += 1
        elif not math.isnan(snr):
            rows.append((snr, label))
    rows.sort()
    note = f"{whole} of {whole + len(rows)} nodes flushed whole (0 dB), not listed; the lowest of the others:\n\n"
    other = "nvfp4" if fmt == "mxfp4" else "mxfp4"
    head = (
        f"| node | {fmt} SNR dB | {fmt} flushed | {other} SNR dB | kurtosis | channel max/median | outlier channels |"
    )
    lines = [head, "|---|" + "---:|" * 6]
    for snr, label in rows[:top]:
        mark = " (param)" if label in parameters else ""
        flushed = value(scalars, f"{fmt}_flushed", d, label, step)
        cells = [f"{snr:.1f}", f"{100 * flushed:.3g}%", f"{value(scalars, f'{other}_snr_db', d, label, step):.1f}"]
        cells += [f"{value(scalars, name, d, label, step):.3g}" for name in OUTLIERS[:2]]
        cells.append(f"{100 * value(scalars, 'outlier_channels', d, label, step):.3g}%")
        lines.append(f"| `{label}`{mark} | " + " | ".join(cells) + " |")
    return note + "\n".join(lines)


def channels(scalars: Scalars, step: int, parameters: Set[str], top: int) -> str:
    """How many nodes have a channel above 6 (``outlier_channels`` > 0), and the nodes with the
    largest outlier fraction, then the largest ``channel_max_ratio``, forward and backward."""
    lines = ["| dir | node | channel max/median | outlier channels | kurtosis |", "|---|---|---:|---:|---:|"]
    counts = []
    for d, _ in DIRECTIONS:
        labels = nodes(scalars, d, step, parameters)
        ratio = {l: value(scalars, "channel_max_ratio", d, l, step) for l in labels}
        outliers = {l: value(scalars, "outlier_channels", d, l, step) for l in labels}
        ranked = sorted((l for l in labels if math.isfinite(ratio[l])), key=lambda l: (-outliers[l], -ratio[l]))
        for l in ranked[:top]:
            kurt = value(scalars, "kurtosis", d, l, step)
            mark = " (param)" if l in parameters else ""
            lines.append(f"| {d} | `{l}`{mark} | {ratio[l]:.3g} | {100 * outliers[l]:.3g}% | {kurt:.3g} |")
        spiky = sum(value(scalars, "outlier_channels", d, l, step) > 0 for l in labels)
        counts.append(f"{spiky} of {len(labels)} {d} nodes have a channel above 6")
    return "; ".join(counts) + ".\n\n" + "\n".join(lines)


def report(scalars: Scalars, step: int, parameters: Set[str], top: int) -> str:
    parts = [
        f"#### Median over the {len(nodes(scalars, 'fwd', step, parameters))} nodes (step {step})",
        medians(scalars, step, parameters),
    ]
    for fmt in ("mxfp4", "nvfp4"):
        for d, what in DIRECTIONS:
            parts.append(f"#### {what}: lowest SNR in {fmt.upper()} (step {step})")
            parts.append(lowest(scalars, fmt, d, step, parameters, top))
    parts.append(f"#### Channel outliers: the largest outlier fraction, then channel max/median (step {step})")
    parts.append(channels(scalars, step, parameters, max(3, top // 2)))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=41)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--logdir", default="lightning_logs")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, _ = token_loaders()
    monitor = ScaleMonitor(every_n_steps=args.every, statistics=STATISTICS, figure=False, histograms=False, code=False)
    logger = pl.loggers.TensorBoardLogger(args.logdir, name="block_whatif")
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
    model = GPTModule()
    trainer.fit(model, train)
    scalars = read(logger.log_dir)
    step = max(s for tag, series in scalars.items() if tag.startswith("scale/fwd/") for s in series)
    parameters = {name for name, _ in model.named_parameters()}
    print(f"\nBlock-scaled what-if on the demo GPT (fp32), read back from {logger.log_dir}\n")
    print(report(scalars, step, parameters, args.top))


if __name__ == "__main__":
    main()
