"""Channel rows pooled over 2 gloo processes (``dist_scripts/run_channel_pool.py``): the pooled
rows and statistics equal a single-process reference over every rank's and micro-batch's
tensors concatenated, with no collective of their own and the bytes ``collective_bytes`` gives
(no world size in it); and with ranks sharing part of their labels."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.record.stats.channels import CHANNEL_WIDTH, channel_row, channel_statistics
from lightning_scale.report import pool
from tests.gloo import load_script, run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "dist_scripts" / "run_channel_pool.py"


def _script() -> Any:
    return load_script(SCRIPT)


def _run(out: Path, world: int) -> List[Dict[str, Any]]:
    return run_ranks(SCRIPT, out, world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[int, List[Dict[str, Any]]]:
    return {2: _run(tmp_path_factory.mktemp("channels"), 2)}


def _reference(script: Any, world: int, nodes: List[int]) -> torch.Tensor:
    """``[n, 2, CHANNEL_WIDTH]``: the channel rows of every rank's and micro-batch's tensors of
    each node concatenated (a parameter's value once: every rank holds the same)."""
    out = torch.zeros(len(nodes), 2, CHANNEL_WIDTH, dtype=torch.float64)
    for k, i in enumerate(nodes):
        for d in (FORWARD, BACKWARD):
            parts = [script.tensors(i, r, m)[d] for r in range(world) for m in (0, 1)]
            out[k, d] = channel_row(torch.cat(parts))
    return out


def test_pooled_channels_equal_one_process_over_the_concatenated_data(runs: Dict[int, List[Dict[str, Any]]]) -> None:
    script, world = _script(), 2
    got: pool.Pooled = runs[world][0]["result"]
    want = _reference(script, world, list(range(script.NODES)))
    assert got.channels is not None and torch.equal(got.channels, want)
    for name, values in channel_statistics(want).items():
        torch.testing.assert_close(channel_statistics(got.channels)[name], values, rtol=0, atol=0, equal_nan=True)
    ratio = channel_statistics(want)["outlier_channels"]
    assert (ratio > 0).any() and (want[:, :, 0] > 4096).any()  # outliers and a folded node are in the test
    without: pool.Pooled = runs[world][0]["without"]
    assert without.channels is None
    torch.testing.assert_close(without.records, got.records, rtol=0, atol=0, equal_nan=True)  # (records untouched)


def test_no_collective_of_their_own_and_bytes_without_the_world_size(runs: Dict[int, List[Dict[str, Any]]]) -> None:
    nodes = _script().NODES
    per_rank = pool.collective_bytes(nodes, replicated=1, groups=("moments", "range"), channels=nodes)
    for saved in runs[2]:
        calls, without = saved["calls"], saved["calls_without"]
        assert [c[:2] for c in calls] == [c[:2] for c in without]  # the same collectives
        extra = [a[2] - b[2] for a, b in zip(calls, without)]
        assert sum(extra) == 8 * nodes * 2 * CHANNEL_WIDTH == extra[1]  # all in the extremes' MAX
        assert [c[2] for c in calls] == list(per_rank.values())  # (the header, extremes, sums, m2)


def test_ranks_sharing_part_of_their_labels(runs: Dict[int, List[Dict[str, Any]]]) -> None:
    """Rank 1 lacks node 2 and has one of its own: the shared nodes' rows are pooled."""
    script = _script()
    shared: pool.Pooled = runs[2][0]["shared"]
    kept = [i for i in range(script.NODES) if i != 2]
    assert shared.labels == [script.label(i) for i in kept] and shared.unshared is not None
    assert torch.equal(shared.channels, _reference(script, 2, kept))
