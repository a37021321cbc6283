"""Which columns of a record travel in the pool's collectives: those of the groups a step computed.

``pool`` sends only the columns of a record, of ``stats.merge_extremes`` and of
``stats.merge_sums`` that the step's groups fill, and puts NaN back for the others.
"""

from __future__ import annotations

import math
from typing import Collection, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["Columns"]


class Columns(NamedTuple):
    """Which columns of a record (``fields``), of ``stats.merge_extremes`` (``extremes``)
    and of ``stats.merge_sums`` (``sums``) a step's groups compute: only those travel."""

    fields: Tuple[int, ...]
    extremes: Tuple[int, ...]
    sums: Tuple[int, ...]
    #: of ``stats.deviations`` (the central moments m2, m3, m4)
    central: Tuple[int, ...]

    @staticmethod
    def of(groups: Optional[Collection[str]]) -> "Columns":
        names = set(stats.FIELDS) if groups is None else {f for g in {"moments", *groups} for f in stats.GROUPS[g]}
        fields = tuple(i for i, f in enumerate(stats.FIELDS) if f in names)
        central = tuple(i for i, f in enumerate(stats.CENTRAL) if f in names)
        return Columns(fields, stats.extreme_columns(names), stats.sum_columns(names), central)

    def central_of(self, sent: Tensor) -> Tensor:
        """Every column of ``stats.deviations`` from those sent: a moment not computed is NaN."""
        full = torch.full((*sent.shape[:-1], len(stats.CENTRAL)), math.nan, dtype=sent.dtype, device=sent.device)
        full[..., list(self.central)] = sent
        return full

    def extremes_of(self, sent: Tensor) -> Tensor:
        """Every column of ``stats.EXTREMES`` from those sent: a field not computed is NaN (flag 1)."""
        full = torch.full((*sent.shape[:-1], len(stats.EXTREMES)), -math.inf, dtype=sent.dtype, device=sent.device)
        full[..., list(stats.EXTREME_NAN_FLAGS)] = 1.0
        full[..., list(self.extremes)] = sent
        return full

    def sums_of(self, sent: Tensor) -> Tensor:
        """All additive columns from those sent: a field not computed is NaN."""
        full = torch.full((*sent.shape[:-1], len(stats.SUMS)), math.nan, dtype=sent.dtype, device=sent.device)
        full[..., list(self.sums)] = sent
        return full

    def field_index(self, device: torch.device) -> Tensor:
        return torch.tensor(self.fields, dtype=torch.long, device=device)
