"""Synthetic logs of an ``n``-node model, written through ``ScaleWriter``: for trying and
timing the dashboard at sizes no CPU demo reaches.

    python -m lightning_scale.tools.synthetic --nodes 1000 --steps 20 --logdir /tmp/synth
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

import torch

from lightning_scale.record import stats
from lightning_scale.report.event_file import EventFile
from lightning_scale.report.tensorboard import ScaleWriter
from lightning_scale.report.values import StepValues

__all__ = ["labels_of", "main", "records_of"]


def labels_of(nodes: int, per_block: int = 20) -> List[str]:
    """``blocks.<i>.<part>/<op>`` labels and one parameter per block, in execution order."""
    out = []
    for i in range(nodes):
        block, k = divmod(i, per_block)
        out.append(
            f"blocks.{block}.fc.weight"
            if k == 0
            else f"blocks.{block}.{'attn' if k < per_block // 2 else 'mlp'}/op_{k}"
        )
    return out


def records_of(nodes: int, step: int, seed: int = 0) -> torch.Tensor:
    """Host float64 records [nodes, 2, len(FIELDS)]: stds drifting by step, gradients ~2^-12..2^-20."""
    g = torch.Generator().manual_seed(seed)
    depth = torch.linspace(0, 1, nodes, dtype=torch.float64)
    log2_std = torch.stack(
        [torch.randn(nodes, generator=g, dtype=torch.float64) + 2 * depth, -12 - 8 * depth + 0.05 * step], 1
    )
    std = 2.0**log2_std
    records = torch.zeros(nodes, 2, len(stats.FIELDS), dtype=torch.float64)
    count = 4096.0
    records[..., stats.FIELDS.index("count")] = count
    records[..., stats.FIELDS.index("m2")] = std**2 * (count - 1)
    records[..., stats.FIELDS.index("absmax")] = std * 4.5
    return records


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--logdir", required=True)
    args = parser.parse_args(argv)
    file = EventFile(args.logdir, warn=print)
    labels = labels_of(args.nodes)
    writer = ScaleWriter(
        [file], statistics=["std", "absmax"], figure=False, parameters=[l for l in labels if "/" not in l]
    )
    for k in range(args.steps):
        writer.write(k * 50, labels, StepValues(records_of(args.nodes, k, seed=k)))
        writer.flush()
    file.close()
    print(f"{args.nodes} nodes x {args.steps} steps written to {args.logdir}")


if __name__ == "__main__":
    main()
