"""Pool statistics records across ranks in one collective.

Every rank gathers every rank's records and value histograms (one flat ``all_gather``
per tracked step, then one device-to-host copy) and
merges them exactly (``stats.merge_rows``), so the pooled record of a node is the record
of the concatenation of all ranks' tensors. Tensors that every rank holds whole and equal
(parameters and buffers under data parallelism) are one tensor, not ``world`` copies: their
forward record is taken from rank 0 when all ranks agree on it. A header row carries the
row count, a fingerprint of the node labels and a failure flag, so ranks that captured
different graphs, or whose statistics failed, raise the same error on every rank instead
of logging nonsense or leaving the others waiting in the collective.
"""

from __future__ import annotations

import hashlib
from typing import Collection, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.recorder import FORWARD

__all__ = ["Pooled", "RankFailedError", "RankMismatchError", "fingerprint", "pool", "pool_step", "world_size"]


class RankMismatchError(RuntimeError):
    """Ranks recorded different nodes, so their statistics cannot be pooled."""


class RankFailedError(RuntimeError):
    """A rank's statistics failed on this step; raised on every rank, so all skip it."""


def world_size() -> int:
    """The default process group's size, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fingerprint(labels: Sequence[str]) -> float:
    """A 48-bit hash of the ordered labels, exact in float64."""
    digest = hashlib.sha1("\n".join(labels).encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))


class Pooled(NamedTuple):
    """One tracked step pooled over all ranks, on the host.

    Attributes:
        records: ``[n, 2, FIELDS]``, the exact merge of every rank's records.
        per_rank: ``[world, n, 2, FIELDS]``, each rank's own.
        histograms: ``[h, 2, bins]``, the sum of every rank's value histograms (a
            replicated tensor's forward histogram counted once, as its record).
    """

    records: Tensor
    per_rank: Tensor
    histograms: Tensor


def pool(
    records: Tensor,
    labels: Sequence[str],
    rows: Optional[int] = None,
    replicated: Collection[str] = (),
    failed: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Pool ``records`` ``[n, 2, FIELDS]`` over all ranks: ``pool_step`` without histograms.

    Returns:
        ``(pooled [n, 2, FIELDS], per_rank [world, n, 2, FIELDS])`` on the host.
    """
    out = pool_step(records, labels, rows=rows, replicated=replicated, failed=failed)
    return out.records, out.per_rank


def pool_step(
    records: Tensor,
    labels: Sequence[str],
    rows: Optional[int] = None,
    replicated: Collection[str] = (),
    failed: bool = False,
    histograms: Optional[Tensor] = None,
    histogram_labels: Sequence[str] = (),
    histogram_rows: Optional[int] = None,
) -> Pooled:
    """Pool ``records`` ``[n, 2, FIELDS]`` and value ``histograms`` over all ranks, in one
    collective and one device-to-host transfer.

    Args:
        records: this rank's records for ``labels``, on the device the collective uses.
        labels: the node labels, in the same order on every rank.
        rows: pad the records to this many rows (>= n), for captures whose node count is
            not known to agree across ranks beforehand; the same on every rank. Without
            it the payload has ``n`` rows, and ``n`` must agree: payloads of different
            sizes cannot be gathered (gloo aborts the process, NCCL waits for its timeout).
        replicated: labels of tensors every rank holds whole and equal (parameters,
            buffers). Where all ranks' forward records of one agree exactly, the pooled
            forward record (and histogram) is rank 0's, not a merge of ``world`` copies.
            Their gradients are merged like any other: each rank's is its own.
        failed: this rank's statistics failed; ``records`` is a placeholder of the right
            shape, sent so the other ranks are not left waiting.
        histograms: ``[h, 2, bins]`` float64 counts for ``histogram_labels`` (on the
            records' device), or None for none.
        histogram_labels: the labels of the histogram rows, the same order on every rank.
        histogram_rows: pad the histograms to this many rows (>= h), as ``rows``.

    Returns:
        A ``Pooled``, on the host: the only device-to-host transfer of the step.

    Raises:
        RankMismatchError: ranks sent different labels or node counts.
        RankFailedError: a rank passed ``failed=True``.
        ValueError: ``rows`` or ``histogram_rows`` is smaller than what it pads.
    """
    n, bins = records.shape[0], stats.LOG2_HI - stats.LOG2_LO
    hists = torch.zeros(0, 2, bins, dtype=torch.float64, device=records.device) if histograms is None else histograms
    h = hists.shape[0]
    rows = _rows("rows", rows, n, "records")
    hrows = _rows("histogram_rows", histogram_rows, h, "histograms")
    if failed and world_size() == 1:
        raise RankFailedError("statistics failed on rank(s) [0]")
    sizes = (n * 2 * len(stats.FIELDS), h * 2 * bins)
    width = _HEADER + rows * 2 * len(stats.FIELDS) + hrows * 2 * bins
    payload = torch.zeros(width, dtype=torch.float64, device=records.device)
    payload[:_HEADER] = torch.tensor([n, fingerprint([*labels, "", *histogram_labels]), float(failed), h], dtype=torch.float64)
    payload[_HEADER : _HEADER + sizes[0]] = records.reshape(-1)
    start = _HEADER + rows * 2 * len(stats.FIELDS)
    payload[start : start + sizes[1]] = hists.reshape(-1)  # copied on the device
    if world_size() == 1:
        everyone = payload.cpu().unsqueeze(0)  # the step's one device-to-host transfer
    else:
        gathered = [torch.empty_like(payload) for _ in range(world_size())]
        dist.all_gather(gathered, payload)
        everyone = torch.stack(gathered).cpu()  # the step's one device-to-host transfer
    _check_headers(everyone[:, :_HEADER])
    world = everyone.shape[0]
    per_rank = everyone[:, _HEADER : _HEADER + sizes[0]].reshape(world, n, 2, len(stats.FIELDS))
    per_hist = everyone[:, start : start + sizes[1]].reshape(world, h, 2, bins)
    if world_size() == 1:
        return Pooled(per_rank[0], per_rank, per_hist[0])
    pooled, per_rank = _replicated_from_rank0(stats.merge_rows(per_rank, dim=0), per_rank, labels, replicated)
    return Pooled(pooled, per_rank, _pool_histograms(per_hist, histogram_labels, replicated))


_HEADER = 4  # node count, label fingerprint, failure flag, histogram count


def _rows(name: str, rows: Optional[int], n: int, what: str) -> int:
    if rows is None:
        return n
    if rows < n:
        raise ValueError(f"`{name}` ({rows}) must be at least the number of {what} ({n})")
    return rows


def _pool_histograms(per_rank: Tensor, labels: Sequence[str], replicated: Collection[str]) -> Tensor:
    """Counts add over ranks; a replicated tensor's forward counts are rank 0's where
    every rank's agree (one tensor, not ``world`` copies)."""
    pooled = per_rank.sum(0)
    rows = [i for i, label in enumerate(labels) if label in replicated]
    if rows:
        index = torch.tensor(rows)
        fwd = per_rank[:, index, FORWARD]  # (world, k, bins)
        same = (fwd == fwd[0]).all(-1).all(0)
        pooled[index[same], FORWARD] = fwd[0, same]
    return pooled


def _check_headers(headers: Tensor) -> None:
    failed = [r for r, flag in enumerate(headers[:, 2].tolist()) if flag]
    if failed:
        raise RankFailedError(f"statistics failed on rank(s) {failed}")
    sizes = headers[:, [0, 1, 3]]
    if not bool((sizes == sizes[0]).all()):
        raise RankMismatchError(
            "Ranks captured different graphs (node count, label fingerprint per rank: "
            f"{sizes.tolist()}); every rank must run the same model code on a tracked step"
        )


def _replicated_from_rank0(pooled: Tensor, per_rank: Tensor, labels: Sequence[str], replicated: Collection[str]) -> Tuple[Tensor, Tensor]:
    rows = [i for i, label in enumerate(labels) if label in replicated]
    if not rows:
        return pooled, per_rank
    index = torch.tensor(rows)
    fwd = per_rank[:, index, FORWARD]  # (world, k, FIELDS)
    first = fwd[0].expand_as(fwd)
    same = ((fwd == first) | (fwd.isnan() & first.isnan())).all(-1).all(0)  # (k,)
    pooled[index[same], FORWARD] = fwd[0, same]
    return pooled, per_rank
