"""Schedule: which optimizer steps are tracked (pure; no Lightning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """Tracked steps: ``start_step, start_step + n, ...`` and/or an explicit list, before ``stop_step``.

    Args:
        every_n_steps: track every n-th optimizer step from ``start_step``; ``None`` for none.
        steps: explicit steps to track (sorted, non-negative), in addition.
        start_step: first step considered.
        stop_step: no step at or after it is tracked; ``None`` for no end.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).
    """

    every_n_steps: Optional[int] = 50
    steps: Optional[List[int]] = None
    start_step: int = 0
    stop_step: Optional[int] = None

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and (not _is_int(self.every_n_steps) or self.every_n_steps <= 0):
            raise ValueError(f"`every_n_steps` must be a positive integer or None, got {self.every_n_steps!r}")
        if self.steps is not None:
            bad = [s for s in self.steps if not _is_int(s) or s < 0]
            if bad:
                raise ValueError(f"`steps` must hold non-negative integers, got {bad!r} in {self.steps!r}")
            if list(self.steps) != sorted(set(self.steps)):
                raise ValueError(f"`steps` must be sorted and free of repeats, got {self.steps!r}")
        if not _is_int(self.start_step) or self.start_step < 0:
            raise ValueError(f"`start_step` must be a non-negative integer, got {self.start_step!r}")
        if self.stop_step is not None and (not _is_int(self.stop_step) or self.stop_step <= self.start_step):
            raise ValueError(
                f"`stop_step` must be an integer above `start_step` ({self.start_step}) or None, got {self.stop_step!r}"
            )
        if self.every_n_steps is None and not self.steps:
            raise ValueError("Nothing to track: give `every_n_steps` or a non-empty `steps` list")

    def is_tracked(self, step: int) -> bool:
        """Whether optimizer step ``step`` is tracked."""
        if step < self.start_step or (self.stop_step is not None and step >= self.stop_step):
            return False
        if self.steps and step in self.steps:
            return True
        return self.every_n_steps is not None and (step - self.start_step) % self.every_n_steps == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python
