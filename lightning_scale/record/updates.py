"""Update/weight ratios and gradient spread of every parameter, as exactly poolable rows.

For one optimizer step and parameter ``w`` with gradient ``g`` (the one the optimizer used):

* ``update_ratio = RMS(w_after - w_before) / RMS(w_before)``
* ``grad_std = std(g)`` (Bessel-corrected, as ``torch.std``)

Each parameter becomes one float64 row ``[2, len(stats.FIELDS)]``, so it travels as an
extra row of the records the callback pools (``distributed.pool``), in the same transfer:

* ``row[0, :3]`` = element count, sum of squared updates, sum of squared weights (before);
* ``row[1, :3]`` = the gradient's element count, mean and sum of squared deviations (the
  moments of ``stats``: Chan's merge combines them exactly);
* everything else 0.

Computed in float64 on the device, on the rank's local elements: a plain parameter (whole
on every rank under data parallelism, equal after the gradient all-reduce) is counted
once, from rank 0's row; a sharded one (an FSDP2 ``DTensor`` with a ``Shard`` placement)
adds: sums add, moments merge. ``pool`` does that on the host from the per-rank rows.

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["UpdateTracker", "is_sharded", "pool", "ratios", "row_of"]

_WEIGHT, _GRAD = 0, 1
_COUNT, _SUM_D2, _SUM_W2 = 0, 1, 2
_MEAN, _M2 = 1, 2

NamedParameters = Iterable[Tuple[str, Tensor]]


def is_sharded(p: Tensor) -> bool:
    """Whether ``p`` is a DTensor sharded over ranks (its local elements differ per rank)."""
    placements = getattr(p, "placements", None)
    return placements is not None and any(pl.is_shard() for pl in placements)


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)  # a DTensor's shard on this rank
    return (to_local() if to_local is not None else t).detach()


def row_of(before: Tensor, after: Tensor, grad: "Tensor | None") -> Tensor:
    """The row ``[2, len(FIELDS)]`` of one parameter's update (local tensors, on their device)."""
    row = torch.zeros(2, len(stats.FIELDS), dtype=torch.float64, device=after.device)
    w = before.to(torch.float64)
    row[_WEIGHT, _COUNT] = w.numel()
    row[_WEIGHT, _SUM_D2] = (after.to(torch.float64) - w).square().sum()
    row[_WEIGHT, _SUM_W2] = w.square().sum()
    if grad is not None and grad.numel() > 0:
        g = grad.to(torch.float64)
        mean = g.mean()  # two passes in float64: exact to rounding whatever the mean
        row[_GRAD, _COUNT] = g.numel()
        row[_GRAD, _MEAN] = mean
        row[_GRAD, _M2] = (g - mean).square().sum()
    return row


class UpdateTracker:
    """Snapshots parameters before an optimizer step and turns the step into rows.

    Example::

        tracker = UpdateTracker()
        tracker.snapshot(model.named_parameters())   # before optimizer.step()
        optimizer.step()
        names, rows = tracker.rows(model.named_parameters())
    """

    def __init__(self) -> None:
        self._before: Dict[str, Tensor] = {}
        self.step = -1
        self.error: Optional[BaseException] = None  # the last ``rows`` call's failure, if any

    @property
    def pending(self) -> bool:
        """Whether a snapshot waits for its optimizer step's rows."""
        return bool(self._before)

    def snapshot(self, params: NamedParameters, step: int = -1) -> None:
        """Copy (on their device) every parameter that requires a gradient."""
        self._before = {name: _local(p).clone() for name, p in params if p.requires_grad}
        self.step = step

    def rows(self, params: NamedParameters) -> Tuple[List[str], List[bool], Tensor]:
        """``(names, sharded, rows [n, 2, FIELDS])`` of the step since the snapshot; forgets it."""
        before, self._before = self._before, {}
        names: List[str] = []
        sharded: List[bool] = []
        out: List[Tensor] = []
        self.error = None
        for name, p in params:
            if name not in before:
                continue
            try:
                grad = None if p.grad is None else _local(p.grad)
                out.append(row_of(before[name], _local(p), grad))
            except Exception as err:  # noqa: BLE001 - see below
                # Every rank must still send a row per parameter (the same payload shape),
                # so a failure gives a placeholder and ``error``; the caller flags the step.
                self.error = self.error or err
                out.append(torch.zeros(2, len(stats.FIELDS), dtype=torch.float64, device=before[name].device))
            names.append(name)
            sharded.append(is_sharded(p))
        if not out:
            return names, sharded, torch.zeros(0, 2, len(stats.FIELDS), dtype=torch.float64)
        return names, sharded, torch.stack(out)

    def clear(self) -> None:
        """Drop a snapshot whose step will not complete (an exception, the end of a fit)."""
        self._before = {}


def pool(per_rank: Tensor, sharded: Sequence[bool]) -> Tensor:
    """Pool rows ``[world, n, 2, FIELDS]`` (host) into ``[n, 2, FIELDS]``: rank 0's row for a
    whole parameter, the exact sum/merge over ranks for a sharded one."""
    out = per_rank[0].clone()
    for i, shard in enumerate(sharded):
        if not shard:
            continue
        out[i, _WEIGHT] = per_rank[:, i, _WEIGHT].sum(0)
        out[i, _GRAD] = _merge_moments(per_rank[:, i, _GRAD])
    return out


def _merge_moments(rows: Tensor) -> Tensor:
    """Chan's merge of ``[k, FIELDS]`` (count, mean, m2) rows; empty shards drop out."""
    n, mean, m2 = 0.0, 0.0, 0.0
    for nb, mb, m2b in rows[:, :3].tolist():
        if nb == 0:
            continue
        total = n + nb
        delta = mb - mean
        mean += delta * nb / total
        m2 += m2b + delta * delta * n * nb / total
        n = total
    out = torch.zeros_like(rows[0])
    out[:3] = torch.tensor([n, mean, m2], dtype=out.dtype)
    return out


def ratios(names: Sequence[str], pooled: Tensor, prefix: str = "") -> Dict[str, float]:
    """Scalars ``update_ratio/<name>`` and ``grad_std/<name>`` from pooled rows (host)."""
    out: Dict[str, float] = {}
    for name, (weight, grad) in zip(names, pooled.tolist()):
        out[f"{prefix}update_ratio/{name}"] = _ratio(weight[_SUM_D2], weight[_SUM_W2])
        if grad[_COUNT] > 0:
            out[f"{prefix}grad_std/{name}"] = math.sqrt(max(grad[_M2], 0.0) / max(grad[_COUNT] - 1, 1.0))
    return out


def _ratio(sum_d2: float, sum_w2: float) -> float:
    # The counts cancel: RMS(d) / RMS(w) = sqrt(sum d^2 / sum w^2). A zero weight gives inf
    # (or NaN with a zero update), which is what the ratio is.
    if sum_w2 == 0:
        return math.inf if sum_d2 > 0 else math.nan
    return math.sqrt(sum_d2 / sum_w2)
