"""Update/weight ratios and gradient spread of every parameter, as exactly poolable rows.

For one optimizer step and parameter ``w`` with gradient ``g`` (the one the optimizer used):

* ``update_ratio = RMS(w_after - w_before) / RMS(w_before)``
* ``grad_std = std(g)`` (Bessel-corrected, as ``torch.std``)

Each parameter becomes one float64 row ``[2, len(stats.FIELDS)]``; a step's rows, with the
parameters' names and whether each is sharded, are an ``UpdateStats``, which the callback
pools as a named segment beside the node records (``report.pool.pool_step(...,
updates=...)``), in the same collectives:

* ``row[0, :3]`` = element count, sum of squared updates, sum of squared weights (before);
* ``row[1, :3]`` = the gradient's element count, mean and sum of squared deviations (the
  moments of ``stats``: Chan's merge combines them exactly);
* everything else 0.

Computed in float64 on the device, on the rank's local elements: a plain parameter (whole
on every rank under data parallelism, equal after the gradient all-reduce) is counted
once, from rank 0's row; a sharded one (an FSDP2 ``DTensor`` with a ``Shard`` placement)
adds: sums add, moments merge (``report.update_pool``: ``split_updates`` / ``pooled_updates``
with reductions, ``merge_updates`` in one process).

Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["GRAD", "USED", "UpdateStats", "UpdateTracker", "WEIGHT", "is_sharded", "ratios", "row_of"]

WEIGHT, GRAD = 0, 1  # a row's two directions: the weight's update sums, the gradient's moments
USED = 3  # the columns a row uses in each direction; the others stay 0
_COUNT, _SUM_D2, _SUM_W2 = 0, 1, 2
_MEAN, _M2 = 1, 2

NamedParameters = Iterable[Tuple[str, Tensor]]


class UpdateStats(NamedTuple):
    """One optimizer step's update statistics, per parameter (``UpdateTracker.rows``).

    Attributes:
        names: the parameters' names, the same order on every rank.
        sharded: whether each is sharded over ranks (its rows add up) or whole on every
            rank (rank 0's row counts).
        rows: ``[k, 2, FIELDS]`` float64 (``row_of``), on the parameters' device.
    """

    names: List[str]
    sharded: List[bool]
    rows: Tensor


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
    row[WEIGHT, _COUNT] = w.numel()
    row[WEIGHT, _SUM_D2] = (after.to(torch.float64) - w).square().sum()
    row[WEIGHT, _SUM_W2] = w.square().sum()
    if grad is not None and grad.numel() > 0:
        g = grad.to(torch.float64)
        mean = g.mean()  # two passes in float64: exact to rounding whatever the mean
        row[GRAD, _COUNT] = g.numel()
        row[GRAD, _MEAN] = mean
        row[GRAD, _M2] = (g - mean).square().sum()
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

    def rows(self, params: NamedParameters) -> UpdateStats:
        """The ``UpdateStats`` of the step since the snapshot; forgets it."""
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
            return UpdateStats(names, sharded, torch.zeros(0, 2, len(stats.FIELDS), dtype=torch.float64))
        return UpdateStats(names, sharded, torch.stack(out))

    def clear(self) -> None:
        """Drop a snapshot whose step will not complete (an exception, the end of a fit)."""
        self._before = {}


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
