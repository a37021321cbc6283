"""Where records go: each slot's output rows (its key, keys that returned its tensor,
aliases, transitively), and the scatter or merge of the assembled records into them."""

from __future__ import annotations

import torch

from lightning_scale.record import stats
from lightning_scale.record.placing import place, targets
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder


def test_targets_follow_same_tensors_and_aliases_transitively() -> None:
    own = ("a", "b", "c")
    keys = ("c", "a", "alias_of_a", "alias_of_alias", "b")
    aliases = (("alias_of_a", "a"), ("alias_of_alias", "alias_of_a"))
    same = ((1, (2,)),)  # slot 1 ("b") returned the tensor of slot 2 ("c")
    got = targets(own, keys, aliases, same)
    assert got == {0: [1, 2, 3], 1: [4, 0], 2: [0]}


def test_place_scatters_single_records_and_merges_repeated_ones() -> None:
    a, b, c = torch.randn(100), torch.randn(50) + 3, torch.randn(7)
    assembled = stats.assemble([stats.record_of(t, host_reads=False) for t in (a, b, c)])
    flat = torch.zeros(3, len(stats.FIELDS), dtype=torch.float64)
    place(flat, assembled, dst=[0, 2, 2], src=[2, 0, 1])  # row 2 took a and b: merged
    torch.testing.assert_close(flat[0], assembled[2], rtol=0, atol=0, equal_nan=True)
    both = stats.assemble([stats.record_of(torch.cat([a, b]), host_reads=False)])[0]
    torch.testing.assert_close(flat[2], both, rtol=1e-6, atol=0, equal_nan=True)  # (float32 sums: ~1e-7)
    assert float(flat[1].abs().sum()) == 0  # no record: left as it was


def test_blocks_and_observed_records_land_where_one_row_at_a_time_puts_them() -> None:
    """Rows added as blocks (two graphs' worth, one key in both, one aliased) among observed
    tensors, against the same rows added one by one."""
    torch.manual_seed(0)
    tensors = {k: torch.randn(20 + i) * (i + 1) for i, k in enumerate("pqrstu")}
    rows = {k: stats.assemble([stats.record_of(t, host_reads=False)]) for k, t in tensors.items()}

    def fill(rec: Recorder, blocks: bool) -> None:
        rec.observe("s", tensors["s"])
        for keys, direction in ((["p", "q"], FORWARD), (["q", "r"], BACKWARD), (["p"], BACKWARD)):
            block = torch.cat([rows[k] for k in keys])
            if blocks:
                rec.add_rows(keys, direction, block)
            else:
                for k, row in zip(keys, block):
                    rec.add_rows([k], direction, row[None])
        rec.observe("p", tensors["t"])  # p forward twice: merged

    keys, aliases = ["r", "p", "q", "s", "view_of_q", "never"], {"view_of_q": "q"}
    blocked, single = Recorder(), Recorder()
    fill(blocked, True)
    fill(single, False)
    got, want = blocked.records(keys, aliases), single.records(keys, aliases)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[4], got[2], rtol=0, atol=0, equal_nan=True)  # the alias: q's records
    torch.testing.assert_close(got[0, BACKWARD], rows["r"][0], rtol=0, atol=0, equal_nan=True)
    p_both = stats.assemble([stats.record_of(torch.cat([tensors["p"], tensors["t"]]), host_reads=False)])[0]
    torch.testing.assert_close(got[1, FORWARD], p_both, rtol=1e-6, atol=0, equal_nan=True)
    assert float(got[5].abs().sum()) == 0  # never seen
    blocked.clear()
    assert float(blocked.records(keys, aliases).abs().sum()) == 0  # the blocks went with the step
