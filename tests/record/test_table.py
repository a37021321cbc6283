"""The statistic table: declarations, what follows from them, and the checks of user statistics.

Each built-in statistic's declared unscaling agrees with how its fields scale; the docs'
definitions table is the table's; a user statistic's fields merge by their declared merges
(sums add, maxima take the max) in pairwise merges and in the reductions that pool ranks;
a declaration that cannot work is a ``ValueError`` naming the statistic and what is wrong.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

from lightning_scale import ScaleMonitor, Statistic
from lightning_scale.record import stats
from lightning_scale.record.stats import run_table, table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "statistics.md"

MEAN_ABS = Statistic("mean_abs_t", sums={"abs": torch.abs}, value=lambda s: s["abs"] / s["count"], unscale=1)
PEAK = Statistic("peak_t", maxes={"sq": torch.square}, value=lambda s: s["sq"].sqrt(), unscale=1, worse="high")


def _random_records(n: int = 50) -> torch.Tensor:
    torch.manual_seed(0)
    rows = []
    for i in range(n):
        x = torch.randn(100 + i) * (2.0 ** (i % 7 - 3)) + (i % 3)
        rows.append(stats.record_of(x, ("moments", "range", "formats", "fp8", "blocks", "kurtosis")))
    return stats.assemble(rows)


def test_each_builtin_statistic_scales_as_it_declares() -> None:
    """Multiply every field by the factor to its declared power (a field without one, a count
    under a threshold, unchanged): each statistic moves by the factor to its own declared power."""
    records = _random_records()
    c = 2.0**-5
    scaled = records.clone()
    for i, f in enumerate(table.TABLE):
        if f.power:
            scaled[:, i] *= c**f.power
    checked = 0
    for name, stat in table.BUILTIN.items():
        got, want = stats.statistic(scaled, name), stats.statistic(records, name)
        if stat.unscale is not None:
            want = want * c**stat.unscale
        torch.testing.assert_close(got, want, rtol=1e-9, atol=0, equal_nan=True, msg=name)
        checked += 1
    assert checked == len(table.BUILTIN) == 34


def test_the_docs_definitions_are_the_table() -> None:
    page = DOCS.read_text()
    found = re.search(r"<!-- table: .*? -->\n(.*?)\n<!-- end of table -->", page, re.S)
    assert found is not None, "docs/statistics.md lost its table markers"
    assert found.group(1) == table.markdown(), "regenerate with: python -c 'from ...table import markdown'"
    for name in table.ALL:  # (every statistic once, with its docs line)
        assert found.group(1).count(f"| `{name}` |") == 1, name


def test_user_fields_merge_by_their_declared_merges() -> None:
    groups = ("moments", run_table.register(MEAN_ABS), run_table.register(PEAK))
    lay = run_table.layout(groups)
    assert lay.names[-2:] == ("mean_abs_t.abs", "peak_t.sq") and lay.width == len(stats.FIELDS) + 2
    parts = [torch.randn(300) * 3, torch.randn(17) - 5, torch.tensor([40.0])]
    whole = torch.cat(parts)
    rows = stats.assemble([stats.record_of(p, groups, layout=lay) for p in parts], width=lay.width)
    want = stats.assemble([stats.record_of(whole, groups, layout=lay)], width=lay.width)[0]
    pairwise = stats.merge(stats.merge(rows[0], rows[1], lay), rows[2], lay)
    for merged in (stats.merge_rows(rows, layout=lay), pairwise):
        assert float(merged[lay.ix["peak_t.sq"]]) == 1600.0 == float(want[lay.ix["peak_t.sq"]])
        assert float(merged[lay.ix["mean_abs_t.abs"]]) == pytest.approx(float(whole.abs().double().sum()), rel=1e-7)
        assert float(stats.statistic(merged, "mean_abs_t", lay)) == pytest.approx(float(whole.abs().mean()), rel=1e-6)
    with pytest.raises(ValueError, match=r"records of 42 fields need their `layout` \(the built-in has 40\)"):
        stats.merge_rows(rows)


def test_a_statistic_registers_once_a_namesake_gets_its_own_key_and_pickles_by_reference() -> None:
    key = run_table.register(MEAN_ABS)
    assert run_table.register(MEAN_ABS) == key and run_table.registered(key) is MEAN_ABS
    twin = Statistic("mean_abs_t", sums={"abs": torch.abs}, value=lambda s: s["abs"] / s["count"])
    assert run_table.register(twin) == f"{key}#2"
    assert pickle.loads(pickle.dumps(MEAN_ABS)) is MEAN_ABS  # (a module global: by reference)


def _elementwise_not(x: torch.Tensor) -> torch.Tensor:
    return x - x.mean()


BAD: Dict[str, Any] = {
    "a built-in's name": (
        lambda: ScaleMonitor(statistics=[Statistic("std", sums={"a": torch.abs}, value=lambda s: s["a"])]),
        r"Statistic 'std': the name is a built-in statistic's; choose another",
    ),
    "not elementwise": (
        lambda: ScaleMonitor(statistics=[Statistic("centred", sums={"c": _elementwise_not}, value=lambda s: s["c"])]),
        r"Statistic 'centred': `sums\['c'\]` must be elementwise: applied to part of a tensor",
    ),
    "a reduction": (
        lambda: ScaleMonitor(statistics=[Statistic("total", sums={"t": torch.sum}, value=lambda s: s["t"])]),
        r"Statistic 'total': `sums\['t'\]` must be elementwise \(the same shape out\): .* gave \[\]",
    ),
    "a failing value": (
        lambda: ScaleMonitor(statistics=[Statistic("v", sums={"a": torch.abs}, value=lambda s: s["missing"])]),
        r"Statistic 'v': `value` fails on a small tensor's fields \(KeyError",
    ),
    "one number for all records": (
        lambda: ScaleMonitor(statistics=[Statistic("w", sums={"a": torch.abs}, value=lambda s: s["a"].sum())]),
        r"Statistic 'w': `value` must give one number per record .* got shape \[\]",
    ),
    "the same name twice": (
        lambda: ScaleMonitor(statistics=[MEAN_ABS, MEAN_ABS]),
        r"`statistics` must name each statistic once, got \['mean_abs_t', 'mean_abs_t'\]",
    ),
    "no function": (lambda: Statistic("empty", value=lambda s: s["count"]), r"give at least one function"),
    "a bad axis": (
        lambda: Statistic("a", sums={"x": torch.abs}, value=lambda s: s["x"], axis="log10"),
        r"Statistic 'a': `axis` must be one of \('linear', 'log2'\), got 'log10'",
    ),
    "a bad worse": (
        lambda: Statistic("a", sums={"x": torch.abs}, value=lambda s: s["x"], worse="up"),
        r"Statistic 'a': `worse` must be 'high', 'low' or None, got 'up'",
    ),
    "a bad unscale": (
        lambda: Statistic("a", sums={"x": torch.abs}, value=lambda s: s["x"], unscale=1.5),
        r"Statistic 'a': `unscale` must be an int power or None, got 1.5",
    ),
    "a bad name": (
        lambda: Statistic("mean abs", sums={"x": torch.abs}, value=lambda s: s["x"]),
        r"`name` must be a non-empty name of letters, digits and underscores, got 'mean abs'",
    ),
    "count as a field name": (
        lambda: Statistic("a", sums={"count": torch.abs}, value=lambda s: s["count"]),
        r"`sums` and `maxes` must use distinct names other than 'count'",
    ),
    "not a statistic's path": (
        lambda: ScaleMonitor(statistics=["torch.abs"]),
        r"`statistics`: 'torch.abs' is a builtin_function_or_method, not a `lightning_scale.Statistic`",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_declaration_that_cannot_work_is_a_value_error_naming_it(case: str) -> None:
    build, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        build()


def test_a_user_value_is_its_fields_read_once_per_record() -> None:
    groups = ("moments", run_table.register(MEAN_ABS))
    lay = run_table.layout(groups)
    x = torch.tensor([[-3.0, 1.0], [0.5, -0.5]])
    row = stats.assemble([stats.record_of(x, groups, layout=lay)], width=lay.width)
    assert float(stats.statistic(row, "mean_abs_t", lay)[0]) == 1.25
    plain = stats.assemble([stats.record_of(x, ("moments",))])  # (a layout without it)
    with pytest.raises(ValueError, match=r"Unknown statistic 'mean_abs_t'; choose from"):
        stats.statistic(plain, "mean_abs_t")
