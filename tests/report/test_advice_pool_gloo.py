"""The precision advisor's what-ifs pooled over 2 gloo processes (``dist_scripts/run_advice_pool.py``):
every rank gets the sum of every rank's sums, equal to a single-process reference over each rank's
operands, with one collective of its own; a rank whose what-ifs failed makes every rank drop them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from lightning_scale.record.gemm_whatif import FIELDS, RECIPES, backward_rows, forward_rows
from tests.gloo import load_script, run_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "dist_scripts" / "run_advice_pool.py"
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    return run_ranks(SCRIPT, tmp_path_factory.mktemp("advice"), WORLD)


def test_every_rank_gets_the_sum_of_every_ranks_sums(ranks: List[Dict[str, Any]]) -> None:
    script = load_script(SCRIPT)
    want = torch.zeros(script.ROWS, 3, len(RECIPES), len(FIELDS), dtype=torch.float64)
    for rank in range(WORLD):
        for i, w in enumerate(script.weights()):
            x, g = script.operands(i, rank)
            want[i, 0] += forward_rows(x, w)
            want[i, 1:] += backward_rows(x, w, g)
    local = sum(r["local"] for r in ranks)
    for r in ranks:
        assert torch.equal(r["pooled"], local)  # (sums of two float64 numbers: exact in any order)
        torch.testing.assert_close(r["pooled"], want, rtol=1e-9, atol=0)
        assert r["failed"] is None
    assert (want[2] == 0).all() and (want[:2, :, :, FIELDS.index("calls")] == WORLD).all()
    flushed = want[:, 0, 0, FIELDS.index("a_flushed")]
    assert flushed[0] > 0 and flushed[1] == 0  # rank 1's outlier columns flush the rest of layer 0's input


def test_one_collective_of_its_own_whatever_the_world_size(ranks: List[Dict[str, Any]]) -> None:
    size = (3 * 3 * len(RECIPES) * len(FIELDS) + 1) * 8  # the sums and the failure flag, float64
    for r in ranks:
        assert r["calls"] == [("all_reduce", "SUM", size)]
