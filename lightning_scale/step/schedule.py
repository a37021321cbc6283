"""Schedule: which optimizer steps are tracked (pure; no Lightning)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from lightning_scale import arguments

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """Tracked steps: ``start_step, start_step + n, ...`` and/or an explicit list, before ``stop_step``.

    Args:
        every_n_steps: track every n-th optimizer step from ``start_step``; ``None`` for none.
        steps: explicit steps to track (a list or tuple, sorted, non-negative), in addition.
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
        # frozen: the checked values (plain ints, a list for a tuple) replace what was given
        every = arguments.integer("every_n_steps", self.every_n_steps, minimum=1, allow_none=True)
        steps = arguments.int_list("steps", self.steps, minimum=0, allow_none=True)
        if steps is not None and steps != sorted(set(steps)):
            raise ValueError(f"`steps` must be sorted and free of repeats, got {self.steps!r}")
        start = arguments.non_negative_int("start_step", self.start_step)
        stop = arguments.integer("stop_step", self.stop_step, allow_none=True)
        if stop is not None and stop <= start:
            raise ValueError(f"`stop_step` must be an integer above `start_step` ({start}) or None, got {stop!r}")
        if every is None and not steps:
            raise ValueError("Nothing to track: give `every_n_steps` or a non-empty `steps` list")
        for field, value in (("every_n_steps", every), ("steps", steps), ("start_step", start), ("stop_step", stop)):
            object.__setattr__(self, field, value)

    def is_tracked(self, step: int) -> bool:
        """Whether optimizer step ``step`` is tracked."""
        if step < self.start_step or (self.stop_step is not None and step >= self.stop_step):
            return False
        if self.steps and step in self.steps:
            return True
        return self.every_n_steps is not None and (step - self.start_step) % self.every_n_steps == 0
