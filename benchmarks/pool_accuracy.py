"""Relative m2 error of merging ranks' records, against an exact rational merge.

``python benchmarks/pool_accuracy.py``: the accuracy table of docs/distributed.md. Each
rank holds ``n`` float64 values ``mean + offset_r + std * randn``; its record comes from
``stats.record_of``. Those records are merged three ways:

* exactly, in ``fractions.Fraction`` (the reference: the exact merge of the same records);
* pairwise (a tree of Chan's two-record merge, ``stats.merge``, for comparison);
* in two stages as the pool's reductions do (``stats.merge_rows``: sums and maxes, then
  the deviations about the merged mean), summed in two orders: torch's sum over the ranks,
  and one rank after another (a ring all-reduce adds in a rank order).

The figure is the worst ``|m2 - exact| / exact`` over 5 seeds.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Callable, List, Tuple

import workload  # noqa: F401 - puts the checkout's package on sys.path
import torch

from lightning_scale.record import stats

_M2 = stats.FIELDS.index("m2")
#: (case, mean, std, offset per rank in stds (rank r gets offset * (r % 7 - 3)), values per rank)
CASES: List[Tuple[str, float, float, float, int]] = [
    ("mean 0, std 1", 0.0, 1.0, 0.0, 1000),
    ("mean 1, std 1e-3, rank offsets", 1.0, 1e-3, 2.0, 1000),
    ("mean 1e8, std 1e-6, rank offsets", 1e8, 1e-6, 2.0, 1000),
    ("mean 1e15, std 1", 1e15, 1.0, 0.0, 1000),
    ("mean 1e4, std 1, one value a rank", 1e4, 1.0, 0.0, 1),
]
WORLDS = (16, 256, 4096)


def records(mean: float, std: float, offset: float, n: int, world: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(world, dtype=torch.float64).unsqueeze(1)
    x = mean + offset * std * (ranks % 7 - 3) + std * torch.randn(world, n, generator=g, dtype=torch.float64)
    return stats.assemble([stats.record_of(row, ("moments",)) for row in x])


def exact_m2(recs: torch.Tensor) -> Fraction:
    rows = [(Fraction(c), Fraction(m), Fraction(m2)) for c, m, m2 in recs[:, :3].tolist()]
    n = sum(c for c, _, _ in rows)
    mean = sum(c * m for c, m, _ in rows) / n
    return sum(m2 + c * (m - mean) ** 2 for c, m, m2 in rows)


def pairwise(recs: torch.Tensor) -> float:
    parts = list(recs.unbind(0))
    while len(parts) > 1:
        nxt = [stats.merge(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return float(parts[0][_M2])


def two_stage(recs: torch.Tensor) -> float:
    return float(stats.merge_rows(recs)[_M2])


def two_stage_in_rank_order(recs: torch.Tensor) -> float:
    ext = stats.merge_extremes(recs).amax(0)
    add = stats.merge_sums(recs, ext)
    total = add[0].clone()
    for row in add[1:]:  # one rank after another
        total += row
    dev = stats.deviations(recs, ext, total)
    m2 = dev[0].clone()
    for d in dev[1:]:
        m2 += d
    return float(m2)


def worst(case: Tuple[str, float, float, float, int], world: int, merge: Callable[[torch.Tensor], float]) -> float:
    _, mean, std, offset, n = case
    err = 0.0
    for seed in range(5):
        recs = records(mean, std, offset, n, world, seed)
        want = exact_m2(recs)
        err = max(err, float(abs(Fraction(merge(recs)) - want) / want))
    return err


def main() -> None:
    print("| case | ranks | pairwise | two-stage, torch sum | two-stage, rank order |")
    print("|---|---:|---:|---:|---:|")
    for case in CASES:
        for world in WORLDS:
            errs = [worst(case, world, f) for f in (pairwise, two_stage, two_stage_in_rank_order)]
            print(f"| {case[0]} | {world} | " + " | ".join(f"{e:.1e}" if e else "0" for e in errs) + " |")


if __name__ == "__main__":
    main()
