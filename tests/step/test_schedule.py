"""schedule: which optimizer steps are tracked, and every argument error."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from lightning_scale.step.schedule import Schedule


def tracked(schedule: Schedule, upto: int = 40) -> list:
    return [s for s in range(upto) if schedule.is_tracked(s)]


def test_every_n_steps_from_zero() -> None:
    assert tracked(Schedule(every_n_steps=5), 21) == [0, 5, 10, 15, 20]


def test_every_step() -> None:
    assert tracked(Schedule(every_n_steps=1), 4) == [0, 1, 2, 3]


def test_start_and_stop() -> None:
    # counted from start_step; stop_step itself is excluded
    assert tracked(Schedule(every_n_steps=4, start_step=3, stop_step=15)) == [3, 7, 11]


def test_explicit_steps_only() -> None:
    assert tracked(Schedule(every_n_steps=None, steps=[1, 2, 30])) == [1, 2, 30]


def test_explicit_steps_add_to_every_n() -> None:
    assert tracked(Schedule(every_n_steps=10, steps=[1, 10, 13]), 25) == [0, 1, 10, 13, 20]


def test_explicit_steps_respect_start_and_stop() -> None:
    assert tracked(Schedule(every_n_steps=None, steps=[1, 5, 9], start_step=2, stop_step=9)) == [5]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be a positive integer or None, got 0"),
        ({"every_n_steps": -1}, r"`every_n_steps` must be a positive integer or None, got -1"),
        ({"every_n_steps": 2.0}, r"`every_n_steps` must be a positive integer or None, got 2.0"),
        ({"every_n_steps": True}, r"`every_n_steps` must be a positive integer or None, got True"),
        ({"steps": [3, 1]}, r"`steps` must be sorted and free of repeats, got \[3, 1\]"),
        ({"steps": [1, 1, 2]}, r"`steps` must be sorted and free of repeats, got \[1, 1, 2\]"),
        ({"steps": [-1, 2]}, r"`steps` must hold non-negative integers, got \[-1\] in \[-1, 2\]"),
        ({"steps": [0.5]}, r"`steps` must hold non-negative integers, got \[0.5\]"),
        ({"start_step": -1}, r"`start_step` must be a non-negative integer, got -1"),
        ({"start_step": 5, "stop_step": 5}, r"`stop_step` must be an integer above `start_step` \(5\) or None, got 5"),
        ({"start_step": 5, "stop_step": 2}, r"`stop_step` must be an integer above `start_step` \(5\) or None, got 2"),
        ({"every_n_steps": None}, r"Nothing to track: give `every_n_steps` or a non-empty `steps` list"),
        ({"every_n_steps": None, "steps": []}, r"Nothing to track"),
    ],
)
def test_argument_errors(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)
