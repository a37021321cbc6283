"""StepValues: one tracked step's statistic values, per node and direction, as they are written.

Derived from the pooled records (and channel rows) by the statistic table alone
(``run_table.Layout.value``, ``Statistic.value``), each once. Under ``unscale_gradients`` a
backward value is multiplied by the factor (``accumulate_grad_batches / loss scale``) to the
power its statistic declares (``Statistic.unscale``: 1 for the std, absmax, rms, mean; None
for counts, fractions and ratios, which stay as recorded); the channel rows are magnitudes,
scaled by the factor's size before the channel statistics are read from them.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD
from lightning_scale.record.stats import run_table, table

__all__ = ["StepValues"]


class StepValues:
    """Statistic values ``[nodes, 2]`` of a step's records, by name, computed on first use.

    Args:
        records: ``[nodes, 2, width]`` pooled records (host).
        layout: their layout (user statistics' fields after the built-in ones).
        factor: backward values are multiplied by ``factor ** Statistic.unscale``.
        channels: ``[nodes, 2, CHANNEL_WIDTH]`` pooled channel rows, or None.
    """

    def __init__(
        self,
        records: Tensor,
        layout: run_table.Layout = stats.BASE,
        factor: float = 1.0,
        channels: Optional[Tensor] = None,
    ) -> None:
        self.records, self.layout, self.factor, self.channels = records, layout, factor, channels
        #: ``[nodes, 2]``: where a record holds elements (the others are not written)
        self.present = records[..., stats.Col.COUNT] > 0
        self._cache: Dict[str, Tensor] = {}

    def __len__(self) -> int:
        return self.records.shape[0]

    def __call__(self, name: str) -> Tensor:
        """The values of statistic ``name``, ``[nodes, 2]`` float64 (NaN where not computed;
        a channel statistic without channel rows: NaN).

        Raises:
            ValueError: an unknown statistic.
        """
        found = self._cache.get(name)
        if found is None:
            found = self._cache[name] = self._compute(self.layout.statistic(name))
        return found

    def _compute(self, stat: table.Statistic) -> Tensor:
        if stat.group == "channels":
            if self.channels is None:
                return torch.full(self.present.shape, float("nan"), dtype=torch.float64)
            rows = self.channels.clone()
            rows[:, BACKWARD, 1:] *= abs(self.factor)  # (the rows hold magnitudes)
            return stat.value({"rows": rows})
        out = stat.value(self.layout.view(self.records, stat)).to(torch.float64)
        if stat.unscale and self.factor != 1.0:
            out = out.clone()
            out[:, BACKWARD] *= self.factor**stat.unscale
        return out

    def take(self, index: "list[int]") -> "StepValues":
        """The values of the nodes ``index`` (in that order)."""
        channels = None if self.channels is None else self.channels[index]
        return StepValues(self.records[index], self.layout, self.factor, channels)
