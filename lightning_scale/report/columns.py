"""Which columns of a record travel in the pool's collectives: those of the groups a step computed.

``pool`` sends only the columns of a record, of ``stats.merge_extremes`` and of
``stats.merge_sums`` that the step's groups fill (user statistics' included: their sums
travel in the sums, their maxima in the extremes), and puts NaN back for the others.
"""

from __future__ import annotations

import math
from typing import Collection, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats import run_table

__all__ = ["Columns"]


class Columns(NamedTuple):
    """Which columns of a record (``fields``), of ``stats.merge_extremes`` (``extremes``)
    and of ``stats.merge_sums`` (``sums``) a step's groups compute: only those travel."""

    fields: Tuple[int, ...]
    extremes: Tuple[int, ...]
    sums: Tuple[int, ...]
    #: of ``stats.deviations`` (the central moments m2, m3, m4)
    central: Tuple[int, ...]
    #: the record layout of the groups
    layout: run_table.Layout = stats.BASE

    @staticmethod
    def of(groups: Optional[Collection[str]]) -> "Columns":
        lay = run_table.layout(() if groups is None else groups)
        if groups is None:
            names = set(lay.names)
        else:
            chosen = {"moments", *groups}
            names = {f.name for f in lay.fields if f.group in chosen}
        fields = tuple(i for i, f in enumerate(lay.names) if f in names)
        central = tuple(i for i, f in enumerate(stats.CENTRAL) if f in names)
        m = stats.merging(lay)
        return Columns(fields, m.extreme_columns(names), m.sum_columns(names), central, lay)

    def central_of(self, sent: Tensor) -> Tensor:
        """Every column of ``stats.deviations`` from those sent: a moment not computed is NaN."""
        full = torch.full((*sent.shape[:-1], len(stats.CENTRAL)), math.nan, dtype=sent.dtype, device=sent.device)
        full[..., list(self.central)] = sent
        return full

    def extremes_of(self, sent: Tensor) -> Tensor:
        """Every column of the extremes from those sent: a field not computed is NaN (flag 1)."""
        m = stats.merging(self.layout)
        full = torch.full((*sent.shape[:-1], len(m.extremes)), -math.inf, dtype=sent.dtype, device=sent.device)
        full[..., list(m.nan_flags)] = 1.0
        full[..., list(self.extremes)] = sent
        return full

    def sums_of(self, sent: Tensor) -> Tensor:
        """All additive columns from those sent: a field not computed is NaN."""
        m = stats.merging(self.layout)
        full = torch.full((*sent.shape[:-1], len(m.sums)), math.nan, dtype=sent.dtype, device=sent.device)
        full[..., list(self.sums)] = sent
        return full

    def field_index(self, device: torch.device) -> Tensor:
        return torch.tensor(self.fields, dtype=torch.long, device=device)
