"""Ranks whose captured graphs differ, in one process: the header's named slots, the
warning's sentence, ``strict_ranks`` checked, ``StepData`` keyword-only. The collectives
themselves run over gloo in ``test_distributed.py`` (``pool_step`` with ranks sharing part
of their labels; a DDP run where rank 1's forward has an extra op)."""

from __future__ import annotations

import pytest

from lightning_scale import ScaleMonitor
from lightning_scale.report.pool_header import Header, mismatch_error
from lightning_scale.report.reporting import StepData
from lightning_scale.report.shared_labels import Unshared


def _reduced(*headers: Header) -> Header:
    """The MAX all-reduce of ``headers``, in one process."""
    return Header(*(max(slot) for slot in zip(*headers)))


def test_the_header_agrees_exactly_when_every_rank_sent_the_same() -> None:
    same = _reduced(*(Header.of(10, 2, 123.0, False, r, 4) for r in range(4)))
    assert same.differences() == [] and same.failure() is None
    differ = _reduced(Header.of(10, 2, 123.0, False, 0, 4), Header.of(12, 2, 124.0, False, 1, 4))
    assert differ.differences() == ["node counts 10 to 12", "the fingerprints of the labels differ"]
    assert str(mismatch_error(differ.differences())) == (
        "Ranks captured different graphs (node counts 10 to 12, the fingerprints of the labels differ); "
        "every rank must run the same model code on a tracked step"
    )


@pytest.mark.parametrize(
    "failing, text",
    [([2], "[2]"), ([1, 2], "[1, 2]"), ([0, 3, 5], "[0, ..., 5] (the lowest and highest)")],
)
def test_the_header_names_the_failing_ranks(failing: list, text: str) -> None:
    top = _reduced(*(Header.of(3, 0, 1.0, r in failing, r, 6) for r in range(6)))
    assert top.failure() == f"statistics failed on rank(s) {text}"


def test_the_warning_names_the_first_differing_nodes_and_how_many() -> None:
    both = Unshared(7, ["a/relu", "b/relu", "c/relu", "d/relu"], 2, ["x/tanh", "y/mul"])
    assert both.describe() == (
        "ranks captured different graphs: 4 of rank 0's nodes are not on every rank (`a/relu`, `b/relu`, "
        "`c/relu`, ...); a rank has 2 node(s) rank 0 has not (`x/tanh`, `y/mul`); "
        "only the 7 nodes every rank has are logged"
    )
    assert Unshared(3, ["a"], 0, []).describe().startswith("ranks captured different graphs: 1 of rank 0's nodes")
    assert Unshared(3, [], 0, []).describe() == (
        "ranks captured different graphs: the same nodes, in another order or with other value histograms; "
        "only the 3 nodes every rank has are logged"
    )


@pytest.mark.parametrize("value", [1, "yes", None])
def test_strict_ranks_must_be_a_bool(value: object) -> None:
    with pytest.raises(ValueError, match=r"`strict_ranks` must be True or False, got"):
        ScaleMonitor(strict_ranks=value)  # type: ignore[arg-type]
    assert ScaleMonitor(strict_ranks=True).strict_ranks is True


def test_step_data_takes_keywords_only() -> None:
    with pytest.raises(TypeError, match="positional"):
        StepData(0, "", None, None, [])  # type: ignore[misc, arg-type]
