"""One rank of a step's channel rows (``stats.channels``) recorded over two micro-batches and
pooled with ``pool_step`` over gloo, without Lightning.

Usage: ``python run_channel_pool.py OUT RANK WORLD`` with ``MASTER_ADDR``/``MASTER_PORT`` set.
Every rank records, with a ``Recorder`` of the ``channels`` group, ``NODES`` nodes over two
micro-batches (``tensors``: its own values and gradients; channel counts from 1 to above the
cap; NaN and Inf; a parameter every rank holds whole) and pools their records and channel
rows into rank 0, every ``torch.distributed`` call counted; then the same step without the
channel rows, and (not strict) with rank 1 lacking node 2 and holding one of its own.

Writes ``OUT/rank<RANK>.pt``: the pooled steps (rank 0) and the counted collectives.
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "lightning_scale" not in sys.modules:  # (the package's __init__ imports Lightning: not needed)
    pkg = types.ModuleType("lightning_scale")
    pkg.__path__ = [str(ROOT / "lightning_scale")]  # type: ignore[attr-defined]
    sys.modules["lightning_scale"] = pkg

from run_pool import Counter  # noqa: E402

GROUPS = ("moments", "range", "channels")
#: Channel counts of the nodes: one, a few, the cap, above the cap (folded), and a parameter's.
CHANNELS = (1, 7, 96, 4096, 5000, 24)
NODES = len(CHANNELS)


def label(i: int) -> str:
    """Node ``i``'s label (``NODES``: rank 1's own node, in the shared-labels pool)."""
    return "p.weight" if i == NODES - 1 else f"n{i}/op"


def tensors(i: int, rank: int, micro: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Node ``i``'s value and gradient on ``rank`` in micro-batch ``micro``: ``[rows, C]`` with
    rows that differ per rank, an outlier channel, NaN (node 1, rank 1) and Inf (node 2, rank 0)."""
    c = CHANNELS[i % NODES]
    if i == NODES - 1:  # a parameter: the same on every rank and micro-batch
        gen = torch.Generator().manual_seed(7)
        return torch.randn(3, c, generator=gen) * 5, torch.randn(3, c, generator=torch.Generator().manual_seed(rank))
    gen = torch.Generator().manual_seed(1000 * i + 10 * rank + micro)
    rows = 2 + (rank + micro + i) % 3
    x = torch.randn(rows, c, generator=gen) * (1 + rank)
    x[0, (3 * rank + micro) % c] = 9.0 + rank
    g = torch.randn(rows, c, generator=gen) * 2.0 ** (i - 3)
    if i == 1 and rank == 1:
        x[-1, 0] = float("nan")
    if i == 2 and rank == 0:
        g[0, 1] = float("inf")
    return x, g


def record(rank: int, nodes: List[int]) -> Any:
    """A Recorder that saw ``nodes`` over two micro-batches, forward and backward."""
    from lightning_scale.record.recorder import Recorder, observe, recording

    rec = Recorder(GROUPS)
    with recording(rec):
        for micro in (0, 1):
            for i in nodes:
                x, g = tensors(i, rank, micro)
                y = x.clone().requires_grad_()
                z = y * 1.0
                observe(z, label(i))
                z.backward(g)
    return rec


def pooled(rank: int, nodes: List[int], counter: Counter, channels: bool = True) -> Tuple[Any, List[Any]]:
    from lightning_scale.report import pool

    rec = record(rank, nodes)
    labels = [label(i) for i in nodes]
    start = len(counter.calls)
    out = pool.pool_step(
        rec.records(labels),
        labels,
        replicated={"p.weight"},
        dst=0,
        groups=rec.groups,
        channels=rec.channel_tensor(labels) if channels else None,
    )
    return out, counter.calls[start:]


def main(out: Path, rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    counter = Counter()
    every = list(range(NODES))
    with_channels, calls = pooled(rank, every, counter)
    without, calls_without = pooled(rank, every, counter, channels=False)
    mine = [i for i in every if not (rank == 1 and i == 2)] + ([NODES] if rank == 1 else [])
    shared, _ = pooled(rank, mine, counter)
    saved: Dict[str, Any] = {"calls": calls, "calls_without": calls_without}
    if rank == 0:
        saved.update(result=with_channels, without=without, shared=shared)
    torch.save(saved, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
