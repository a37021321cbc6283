"""Pool statistics records across ranks in one collective.

Every rank gathers every rank's records (``all_gather``, one call per tracked step) and
merges them exactly (``stats.merge_rows``), so the pooled record of a node is the record
of the concatenation of all ranks' tensors. A header row carries the row count and a
fingerprint of the node labels, so ranks that captured different graphs raise a clear
error instead of logging nonsense.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale import stats

__all__ = ["RankMismatchError", "fingerprint", "pool", "world_size"]


class RankMismatchError(RuntimeError):
    """Ranks recorded different nodes, so their statistics cannot be pooled."""


def world_size() -> int:
    """The default process group's size, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fingerprint(labels: Sequence[str]) -> float:
    """A 48-bit hash of the ordered labels, exact in float64."""
    digest = hashlib.sha1("\n".join(labels).encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))


def pool(records: Tensor, labels: Sequence[str], rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """Pool ``records`` ``[n, 2, FIELDS]`` over all ranks.

    Args:
        records: this rank's records for ``labels``, on the device the collective uses.
        labels: the node labels, in the same order on every rank.
        rows: pad the payload to this many rows (>= n), for captures whose node count is
            not known to agree across ranks beforehand; the same on every rank.

    Returns:
        ``(pooled [n, 2, FIELDS], per_rank [world, n, 2, FIELDS])``, on the host: the
        only device-to-host transfer of the step.

    Raises:
        RankMismatchError: ranks sent different labels or node counts.
    """
    n = records.shape[0]
    if world_size() == 1:
        host = records.cpu()  # the step's one device-to-host transfer
        return host, host.unsqueeze(0)
    rows = n if rows is None else rows
    if rows < n:
        raise ValueError(f"`rows` ({rows}) must be at least the number of records ({n})")
    payload = torch.zeros(rows + 1, 2, len(stats.FIELDS), dtype=torch.float64, device=records.device)
    payload[0, 0, 0] = n
    payload[0, 0, 1] = fingerprint(labels)
    payload[1 : n + 1] = records
    gathered = [torch.empty_like(payload) for _ in range(world_size())]
    dist.all_gather(gathered, payload)
    everyone = torch.stack(gathered).cpu()  # the step's one device-to-host transfer
    headers = everyone[:, 0, 0, :2]
    if not bool((headers == headers[0]).all()):
        raise RankMismatchError(
            "Ranks captured different graphs (node count, label fingerprint per rank: "
            f"{headers.tolist()}); every rank must run the same model code on a tracked step"
        )
    per_rank = everyone[:, 1 : n + 1]
    return stats.merge_rows(per_rank, dim=0), per_rank
