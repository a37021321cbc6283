"""One rank of ``pool_step`` over gloo on a synthetic record, without Lightning.

Usage: ``python run_pool.py OUT RANK WORLD NODES`` with ``MASTER_ADDR``/``MASTER_PORT``
set. Every rank builds its own small tensors for ``NODES`` nodes (``tensors``: some empty,
some with NaN or Inf, every tenth node a parameter that every rank holds whole and equal
in the forward direction), records them, and pools them with ``pool_step`` (value
histograms of 20 nodes, ``rank_spread``, the update statistics of three parameters, two of
them sharded, and a loss scale) into rank 0.
Every call to a ``torch.distributed`` collective is counted with the bytes of its tensors.
Then: a ``dst=None`` pool of the first 20 nodes (every rank gets it), a pool of the
moments and range fields only (``groups``), a pool where rank
``WORLD - 1`` fails, one where rank 1 has other labels, one where rank 1 has fewer nodes
(with ``strict``: each must raise on every rank), a last good pool, and (not strict) a
pool where rank 1 lacks a node and has one of its own (``partial``: the shared nodes are
pooled, ``partial_reference`` pools the same nodes with equal labels), with its
collectives counted.

Writes ``OUT/rank<RANK>.pt``: its records, its update rows, the counted collectives of the
big pool, its result (rank 0), the peak RSS it added and its time, the small pool's
result, the partial-groups pool's (rank 0), the outcome of each failing pool, and the
shared-labels pool's result, reference and collectives.

The package's ``__init__`` (which imports Lightning) is not run: a bare package module
stands in for it, so a rank starts in the time torch takes to import.
"""

from __future__ import annotations

import sys
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("moments", "range", "formats", "fp8")
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all_single",
)


def _package() -> None:
    """Import ``lightning_scale``'s modules without its ``__init__``."""
    if "lightning_scale" not in sys.modules:
        pkg = types.ModuleType("lightning_scale")
        pkg.__path__ = [str(ROOT / "lightning_scale")]  # type: ignore[attr-defined]
        sys.modules["lightning_scale"] = pkg


def is_parameter(i: int) -> bool:
    return i % 10 == 0


def label(i: int) -> str:
    return f"p{i}.weight" if is_parameter(i) else f"n{i}/op"


def tensors(i: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Node ``i``'s forward value and gradient on ``rank``: up to 12 elements (some empty,
    nodes 250k + 7 on every rank),
    scales from 2^-20 to 2^19 with offsets, a NaN (node 97k, rank 1) or Inf (node 89k, the
    last rank's gradient). A parameter's value is the same on every rank."""
    gen = torch.Generator().manual_seed(i * 1009 + (0 if is_parameter(i) else rank + 1))
    scale = 2.0 ** (i % 40 - 20)
    size = 6 + i % 5 if is_parameter(i) else (i * 7 + rank * 3) % 13 if i % 250 != 7 else 0
    fwd = torch.randn(size, generator=gen, dtype=torch.float64) * scale + (i % 5 - 2) * 3 * scale
    grad = (
        torch.randn(
            (i * 5 + rank) % 9 if i % 250 != 7 else 0,
            generator=torch.Generator().manual_seed(i * 7919 + rank),
            dtype=torch.float64,
        )
        * scale
    )
    if i % 97 == 0 and rank == 1 and size and not is_parameter(i):
        fwd[0] = float("nan")
    if i % 89 == 0 and grad.numel():
        grad[-1] = float("inf") if rank == 1 else grad[-1]
    return fwd, grad


def records(nodes: int, rank: int) -> torch.Tensor:
    return records_of(range(nodes), rank)


def records_of(ids: Sequence[int], rank: int) -> torch.Tensor:
    """``[len(ids), 2, FIELDS]``: the records of nodes ``ids`` on ``rank``."""
    from lightning_scale.record import stats

    rows = [stats.record_of(t, GROUPS) for i in ids for t in tensors(i, rank)]
    return stats.assemble(rows).view(len(ids), 2, len(stats.FIELDS))


def histogram_nodes(nodes: int) -> List[int]:
    """The nodes with value histograms: every 200th (a parameter) and the third after it."""
    return [i for i in range(nodes) if i % 200 in (0, 3)]


def histograms(nodes: int, rank: int) -> Tuple[List[str], torch.Tensor]:
    from lightning_scale.record import stats

    rows = histogram_nodes(nodes)
    hists = [torch.stack([stats.log2_histogram(t) for t in tensors(i, rank)]) for i in rows]
    return [label(i) for i in rows], torch.stack(hists)


SHARDED = [True, False, True]  # the update statistics' parameters: sharded, whole, sharded


def update_rows(rank: int) -> torch.Tensor:
    """``[3, 2, FIELDS]``: this rank's rows of a sharded parameter (its own shard), a whole
    one (different per rank here, so that rank 0's is seen to be taken) and a sharded one."""
    from lightning_scale.record import updates

    rows = []
    for k in range(len(SHARDED)):
        gen = torch.Generator().manual_seed(100 * k + rank)
        before = torch.randn(3 + rank + k, 4, generator=gen) * 2 + 1
        rows.append(updates.row_of(before, before + 0.01 * torch.randn(before.shape, generator=gen), before * 0.5))
    return torch.stack(rows)


def partial_labels(nodes: int, rank: int) -> List[int]:
    """The first 40 nodes; rank 1 lacks node 3 (with a histogram) and has node ``nodes + 1``
    (its own) at position 10."""
    kept = list(range(40))
    if rank == 1:
        kept.remove(3)
        kept.insert(10, nodes + 1)
    return kept


class Counter:
    """Counts calls to ``torch.distributed`` collectives and the bytes of their tensors."""

    def __init__(self) -> None:
        self.calls: List[Tuple[str, str, int]] = []
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            flat = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
            size = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
            op = kwargs.get("op", next((a for a in args if isinstance(a, dist.ReduceOp.RedOpType)), dist.ReduceOp.SUM))
            self.calls.append((name, str(op).split(".")[-1], size))
            return fn(*args, **kwargs)

        return counted


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _peak_rss()


def _outcome(fn: Callable[[], Any]) -> Any:
    from lightning_scale.report import pool

    try:
        out = fn()
        return "ok" if out is not None else "none"
    except (pool.RankMismatchError, pool.RankFailedError) as err:
        return err


def _shared_pools(nodes: int, rank: int, counter: Counter) -> Dict[str, Any]:
    """The pool over the labels every rank shares (rank 1: a node less, one of its own), its
    collectives, and the reference: the same shared nodes pooled with equal labels."""
    from lightning_scale.report import pool

    mine = partial_labels(nodes, rank)
    labels = [label(i) for i in mine]
    hist_rows = [k for k, i in enumerate(mine) if i in histogram_nodes(nodes) or i == nodes + 1]
    hists = torch.stack([torch.stack([stats_hist(t) for t in tensors(mine[k], rank)]) for k in hist_rows])
    replicated = {label(i) for i in mine if is_parameter(i)}
    start = len(counter.calls)
    partial = pool.pool_step(
        records_of(mine, rank),
        labels,
        replicated=replicated,
        histograms=hists,
        histogram_labels=[labels[k] for k in hist_rows],
        spread=True,
        dst=0,
    )
    calls = counter.calls[start:]
    shared = [i for i in range(40) if i != 3]
    shared_hists = [i for i in shared if i in histogram_nodes(nodes)]
    reference = pool.pool_step(
        records_of(shared, rank),
        [label(i) for i in shared],
        replicated=replicated,
        spread=True,
        dst=0,
        strict=True,
        histograms=torch.stack([torch.stack([stats_hist(t) for t in tensors(i, rank)]) for i in shared_hists]),
        histogram_labels=[label(i) for i in shared_hists],
    )
    return {"shared": partial, "shared_reference": reference, "shared_calls": calls}


def stats_hist(t: torch.Tensor) -> torch.Tensor:
    from lightning_scale.record import stats

    return stats.log2_histogram(t)


def _outcomes(recs: torch.Tensor, labels: List[str], rank: int, world: int) -> Dict[str, Any]:
    """A failing rank, other labels and fewer nodes on rank 1 (with ``strict``), then a good pool."""
    from lightning_scale.report import pool

    n = len(labels) - (rank == 1)
    return {
        "failed": _outcome(lambda: pool.pool_step(recs, labels, failed=rank == world - 1)),
        "names": _outcome(lambda: pool.pool_step(recs, [*labels[:-1], f"other{rank == 1}"], strict=True)),
        "count": _outcome(lambda: pool.pool_step(recs[:n], labels[:n], strict=True)),
        "after": _outcome(lambda: pool.pool_step(recs, labels)),
    }


def main(out: Path, rank: int, world: int, nodes: int) -> None:
    _package()
    from lightning_scale.record.updates import UpdateStats
    from lightning_scale.report import pool

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    recs = records(nodes, rank)
    labels = [label(i) for i in range(nodes)]
    replicated = {label(i) for i in range(nodes) if is_parameter(i)}
    hist_labels, hists = histograms(nodes, rank)
    rows = update_rows(rank)
    update_stats = UpdateStats(["a", "b", "c"], SHARDED, rows)
    loss_scale = torch.tensor(2.0 ** (rank + 10))

    def big() -> Any:
        return pool.pool_step(
            recs,
            labels,
            replicated=replicated,
            histograms=hists,
            histogram_labels=hist_labels,
            spread=True,
            updates=update_stats,
            loss_scale=loss_scale,
            dst=0,
        )

    big()  # warm-up: the first collective sets gloo up
    dist.barrier()
    counter = Counter()
    before = _reset_peak()
    start = time.perf_counter()
    result = big()
    seconds = time.perf_counter() - start
    added = _peak_rss() - before
    calls = list(counter.calls)
    small = pool.pool_step(recs[:20], labels[:20], replicated=replicated, spread=True)
    partial = pool.pool_step(recs, labels, replicated=replicated, dst=0, groups=("moments", "range"))
    outcomes = _outcomes(recs, labels, rank, world)
    shared = _shared_pools(nodes, rank, counter)
    saved: Dict[str, Any] = {
        "records": recs,
        "update_rows": rows,
        **shared,
        "calls": calls,
        "seconds": seconds,
        "peak_rss_added": added,
        "small": small,
        "outcomes": outcomes,
    }
    if rank == 0:
        saved["result"], saved["partial"] = result, partial
    else:
        saved["result_is_none"] = result is None
    torch.save(saved, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
