"""ReportOptions: what the ``Reporter`` writes, as ``ScaleMonitor``'s arguments of the same names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

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
        if not isinstance(self.figure_every, int) or isinstance(self.figure_every, bool) or self.figure_every <= 0:
            raise ValueError(f"`figure_every` must be a positive integer, got {self.figure_every!r}")
        if not isinstance(self.max_tags, int) or self.max_tags <= 0:
            raise ValueError(f"`max_tags` must be a positive integer, got {self.max_tags!r}")
        cap = self.max_log_bytes
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0):
            raise ValueError(f"`max_log_bytes` must be a positive integer (bytes) or None, got {cap!r}")
