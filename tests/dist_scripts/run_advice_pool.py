"""One rank of the precision advisor's what-ifs (``record.gemm_recorder``) recorded and pooled
with ``report.advice.pool_gemms`` over gloo, without Lightning.

Usage: ``python run_advice_pool.py OUT RANK WORLD`` with ``MASTER_ADDR``/``MASTER_PORT`` set.
Every rank runs two linear layers' GEMMs on inputs and output gradients of its own
(``operands``: rows, scales and a wide spread that differ per rank; a third row of the table
is never seen), then pools: once with every rank's what-ifs sound, once with rank 1's failed,
every ``torch.distributed`` call counted.

Writes ``OUT/rank<RANK>.pt``: its own sums, the pooled ones (both pools) and the collectives.
"""

from __future__ import annotations

import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "lightning_scale" not in sys.modules:  # (the package's __init__ imports Lightning: not needed)
    pkg = types.ModuleType("lightning_scale")
    pkg.__path__ = [str(ROOT / "lightning_scale")]  # type: ignore[attr-defined]
    sys.modules["lightning_scale"] = pkg

from run_pool import Counter  # noqa: E402

ROWS = 3  # table rows: two layers seen, one never


def weights() -> Tuple[torch.Tensor, torch.Tensor]:
    """The two layers' weights ``[N, K]``, the same on every rank (as parameters are)."""
    gen = torch.Generator().manual_seed(7)
    return torch.randn(64, 32, generator=gen) * 0.1, torch.randn(32, 64, generator=gen) * 0.1


def operands(layer: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s input ``[M, K]`` and output gradient ``[M, N]`` on ``rank``: M of 32 or 64
    tokens, outlier columns in layer 0's input on rank 1 (a wide spread: per-tensor FP8 flushes there)."""
    gen = torch.Generator().manual_seed(100 * layer + rank)
    m = 32 * (1 + rank)
    k, n = (32, 64) if layer == 0 else (64, 32)
    x = torch.randn(m, k, generator=gen)
    if rank == 1 and layer == 0:
        x[:, :2] *= 1e5
    return x, torch.randn(m, n, generator=gen) * 1e-3


def record(rank: int) -> Any:
    from lightning_scale.record.gemm_recorder import GemmRecorder

    ws = [w.requires_grad_() for w in weights()]
    gemms = GemmRecorder({id(w): i for i, w in enumerate(ws)}, ROWS)
    for i, w in enumerate(ws):
        x, g = operands(i, rank)
        out = torch.nn.functional.linear(x, w)
        gemms.observe(out, x, w, "linear")
        out.backward(g)
    return gemms


def main(out: Path, rank: int, world: int) -> None:
    from lightning_scale.report.advice import pool_gemms

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    counter = Counter()
    gemms = record(rank)
    pooled = pool_gemms(gemms, ROWS, torch.device("cpu"))
    calls = list(counter.calls)
    if rank == 1:
        gemms.error = RuntimeError("a what-if failed here")
    failed = pool_gemms(gemms, ROWS, torch.device("cpu"))
    saved: Dict[str, Any] = {"local": record(rank).sums, "pooled": pooled, "failed": failed, "calls": calls}
    torch.save(saved, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
