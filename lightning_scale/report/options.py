"""ReportOptions: what the ``Reporter`` writes, as ``ScaleMonitor``'s arguments of the same names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_scale import arguments as check

__all__ = ["ReportOptions"]


@dataclass(frozen=True, kw_only=True)
class ReportOptions:
    """What a ``Reporter`` pools and writes (keyword-only; see ``ScaleMonitor``'s arguments).

    Args:
        statistics: statistic names written as scalars.
        histograms, figure, figure_every, code, rank_spread, max_tags, unscale_gradients,
            value_histograms, max_log_bytes: as ``ScaleMonitor``'s arguments of the same names.
        coverage: report coverage (off when ``include`` / ``exclude`` select nodes).

    Raises:
        ValueError: ``figure_every`` or ``max_tags`` is not a positive integer, ``max_log_bytes``
            neither None nor one.

    Example::

        ReportOptions(statistics=["std"], max_log_bytes=2**20)
    """

    statistics: Sequence[str] = ("std",)
    histograms: bool = True
    figure: bool = False
    figure_every: int = 10
    code: bool = True
    rank_spread: bool = False
    max_tags: int = 1000
    unscale_gradients: bool = False
    value_histograms: Optional["re.Pattern[str]"] = None
    coverage: bool = True
    max_log_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        check.positive_int("figure_every", self.figure_every)
        check.positive_int("max_tags", self.max_tags)
        check.integer("max_log_bytes", self.max_log_bytes, minimum=1, allow_none=True, note="bytes")
