"""Pool statistics records across ranks in one collective.

Every rank gathers every rank's records (``all_gather``, one call per tracked step) and
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
from typing import Collection, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale import stats
from lightning_scale.recorder import FORWARD

__all__ = ["RankFailedError", "RankMismatchError", "fingerprint", "pool", "world_size"]


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


def pool(
    records: Tensor,
    labels: Sequence[str],
    rows: Optional[int] = None,
    replicated: Collection[str] = (),
    failed: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Pool ``records`` ``[n, 2, FIELDS]`` over all ranks.

    Args:
        records: this rank's records for ``labels``, on the device the collective uses.
        labels: the node labels, in the same order on every rank.
        rows: pad the payload to this many rows (>= n), for captures whose node count is
            not known to agree across ranks beforehand; the same on every rank. Without
            it the payload has ``n`` rows, and ``n`` must agree: payloads of different
            sizes cannot be gathered (gloo aborts the process, NCCL waits for its timeout).
        replicated: labels of tensors every rank holds whole and equal (parameters,
            buffers). Where all ranks' forward records of one agree exactly, the pooled
            forward record is rank 0's, not a merge of ``world`` copies. Their gradients
            are merged like any other: each rank's is its own, before any reduction.
        failed: this rank's statistics failed; ``records`` is a placeholder of the right
            shape, sent so the other ranks are not left waiting.

    Returns:
        ``(pooled [n, 2, FIELDS], per_rank [world, n, 2, FIELDS])``, on the host: the
        only device-to-host transfer of the step.

    Raises:
        RankMismatchError: ranks sent different labels or node counts.
        RankFailedError: a rank passed ``failed=True``.
        ValueError: ``rows`` is smaller than the number of records.
    """
    n = records.shape[0]
    rows = n if rows is None else rows
    if rows < n:
        raise ValueError(f"`rows` ({rows}) must be at least the number of records ({n})")
    if failed and world_size() == 1:
        raise RankFailedError("statistics failed on rank(s) [0]")
    if world_size() == 1:
        host = records.cpu()  # the step's one device-to-host transfer
        return host, host.unsqueeze(0)
    payload = torch.zeros(rows + 1, 2, len(stats.FIELDS), dtype=torch.float64, device=records.device)
    payload[0, 0, 0] = n
    payload[0, 0, 1] = fingerprint(labels)
    payload[0, 0, 2] = float(failed)
    payload[1 : n + 1] = records
    gathered = [torch.empty_like(payload) for _ in range(world_size())]
    dist.all_gather(gathered, payload)
    # Only rows 1..n can matter: if another rank sent more, the headers differ anyway.
    everyone = torch.stack(gathered)[:, : n + 1].cpu()  # the step's one device-to-host transfer
    _check_headers(everyone[:, 0, 0, :3])
    per_rank = everyone[:, 1:]
    return _replicated_from_rank0(stats.merge_rows(per_rank, dim=0), per_rank, labels, replicated)


def _check_headers(headers: Tensor) -> None:
    failed = [r for r, flag in enumerate(headers[:, 2].tolist()) if flag]
    if failed:
        raise RankFailedError(f"statistics failed on rank(s) {failed}")
    sizes = headers[:, :2]
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
