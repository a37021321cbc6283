"""Placements: the part of a distributed tensor (``DTensor``) that this rank records.

The pool merges every rank's record of a node as if their tensors were concatenated, so
a node's pooled record is that of the full logical tensor when the ranks' records describe
disjoint parts of it. Over the mesh of a ``DTensor`` that means, per mesh dimension:

* ``Shard(d)``: every rank records its local shard (the shards are disjoint);
* ``Replicate()``: only the rank at coordinate 0 of that dimension records; the others add
  nothing (an empty record is the merge identity);
* ``Partial()``: the local values are summands, not a part. A capture records such a
  forward value through the node that reduces it. A ``Partial`` gradient that no node
  reduces (a ``SequenceParallel`` norm's parameter gradient, reduced by the optimizer
  step) is kept as a detached copy (``PartialSums``) and reduced at the end of the step,
  all of them in one ``all_reduce`` over the mesh dim's group, then recorded as a replica.
  Such copies are kept on every rank whatever its state, so every rank of the group
  joins that one collective.

Statistics are then taken on ``to_local()``, a plain tensor: no DTensor op runs inside
them (those would be collectives, or implicit replications of the scalar results).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["PARTIAL", "PartialSums", "first_beyond", "first_of_replicas", "is_distributed", "is_partial", "local_part"]

#: why a ``Partial`` tensor is not recorded on any rank (``Recorder.skipped``)
PARTIAL = "Partial placement (a sum over ranks that no node of the step reduces)"


def is_distributed(x: Any) -> bool:
    """Whether ``x`` is a ``DTensor`` (without importing ``torch.distributed`` when absent)."""
    cls = type(x)
    return cls.__name__ == "DTensor" and hasattr(x, "placements") and hasattr(x, "to_local")


def first_of_replicas(mesh: Any, dims: Optional[Tuple[int, ...]] = None) -> bool:
    """Whether this rank is at coordinate 0 of ``mesh`` on ``dims`` (all by default): the
    one copy of a tensor replicated over them that is recorded. False off the mesh."""
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return False
    return all(coordinate[d] == 0 for d in (range(len(coordinate)) if dims is None else dims))


def local_part(x: Tensor, parameter: bool = False) -> Tuple[Optional[Tensor], Optional[str]]:
    """``(tensor to record, why none)`` for a ``DTensor`` ``x``: its local tensor where this
    rank holds a disjoint part of the full tensor, ``(None, None)`` where another rank
    records the same values (a replica), ``(None, PARTIAL)`` where no rank holds a part.

    ``parameter``: ``x`` is a parameter's value, the same on every data-parallel replica of
    its mesh (FSDP2 x TP: the unsharded parameter lives on the tensor-parallel submesh of
    a (data_parallel, tensor_parallel) mesh): recorded at coordinate 0 of the other dims."""
    placements = tuple(x.placements)  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        return None, PARTIAL
    replicated = tuple(i for i, p in enumerate(placements) if p.is_replicate())
    mesh = x.device_mesh  # type: ignore[attr-defined]
    if not first_of_replicas(mesh, replicated) or (parameter and not first_beyond(mesh)):
        return None, None
    return x.detach().to_local(), None  # type: ignore[attr-defined]  # (no autograd node of ours)


def first_beyond(mesh: Any) -> bool:
    """Whether this rank is at coordinate 0 of the dims of ``mesh``'s root mesh that
    ``mesh`` (a submesh, sliced by name) does not have; True for a root mesh."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh  # (torch's own accessor)
    if root is mesh or not root.mesh_dim_names or not mesh.mesh_dim_names:
        return True
    others = tuple(i for i, name in enumerate(root.mesh_dim_names) if name not in mesh.mesh_dim_names)
    return first_of_replicas(root, others)


def is_partial(x: Any) -> bool:
    """Whether ``x`` is a DTensor with a ``Partial`` placement."""
    return is_distributed(x) and any(p.is_partial() for p in x.placements)


class PartialSums:
    """``Partial`` gradients of one step, reduced together at its end.

    ``add`` keeps a detached copy of the local summands; ``reduce`` sums every copy over
    its mesh dim's group, one ``all_reduce`` per group (one in all under tensor
    parallelism), and yields ``(key, the tensor this rank records or None)``: the reduced
    value is replicated on that dim, so only coordinate 0 records it. Bytes: the sizes of
    the copies, not the world's.
    """

    def __init__(self) -> None:
        self._kept: List[Tuple[Any, Tensor, Any, int]] = []  # (key, local copy, mesh, partial dim)

    def __len__(self) -> int:
        return len(self._kept)

    def add(self, key: Any, x: Tensor) -> bool:
        """Keep ``x`` (a DTensor) if it is partial on exactly one mesh dim; False otherwise."""
        dims = [i for i, p in enumerate(x.placements) if p.is_partial()]  # type: ignore[attr-defined]
        if len(dims) != 1:
            return False
        local = x.to_local().detach().clone()  # type: ignore[attr-defined]
        self._kept.append((key, local, x.device_mesh, dims[0]))  # type: ignore[attr-defined]
        return True

    def reduce(self) -> Iterator[Tuple[Any, Optional[Tensor]]]:
        """Sum the kept copies over their groups (a collective: call on every rank alike)."""
        kept, self._kept = self._kept, []
        groups: Dict[Tuple[int, int], List[Tuple[Any, Tensor, Any, int]]] = {}
        for item in kept:
            groups.setdefault((id(item[2]), item[3]), []).append(item)
        for items in groups.values():
            mesh, dim = items[0][2], items[0][3]
            flat = torch.cat([t.reshape(-1) for _, t, _, _ in items])
            torch.distributed.all_reduce(flat, group=mesh.get_group(dim))
            first = first_of_replicas(mesh, (dim,))
            for (key, t, _, _), summed in zip(items, flat.split([t.numel() for _, t, _, _ in items])):
                yield key, summed.view_as(t) if first else None

    def clear(self) -> None:
        self._kept.clear()
