"""Short host tensors' records computed together equal ``stats.record_of``'s, one by one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_scale.record import stats
from lightning_scale.record.recorder import FORWARD, Recorder
from lightning_scale.record.short_records import MAX_ELEMENTS, batchable, records_of_many

GROUPS = ("moments", "range", "formats")
EXACT = ["count", "nan", "inf", "absmax", "zeros", "min_nonzero"] + [
    f for f in stats.FIELDS if f.startswith(("underflow", "below_normal", "overflow"))
]
SPECIALS = {
    "zero": 0.0,
    "subnormal": 3e-42,
    "tiny": 2.0**-140,
    "huge": 3e38,
    "inf": math.inf,
    "nan": math.nan,
    "fp16_max": 65504.0,
    "e4m3_edge": 448.0,
}


@st.composite
def short_tensor(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    n = draw(st.integers(1, 600))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = (torch.randn(n, generator=g, dtype=torch.float64) + draw(st.sampled_from([0.0, 3.0, 1e4]))) * 2.0 ** draw(
        st.integers(-30, 30)
    )
    for kind in draw(st.lists(st.sampled_from(sorted(SPECIALS)), max_size=4)):
        x[int(torch.randint(0, n, (), generator=g))] = SPECIALS[kind]
    return x.to(torch.float32).to(dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(short_tensor(), min_size=1, max_size=6))
def test_batched_records_equal_one_by_one(xs: list) -> None:
    flat = [x.float().reshape(-1) for x in xs]
    rows = records_of_many(torch.cat(flat).numpy(), [x.numel() for x in flat], GROUPS)
    for x, row in zip(xs, rows):
        want = stats.record_of(x, GROUPS, host_reads=True)
        got = dict(zip(stats.FIELDS, row))
        for name in EXACT:
            w = float(want[stats.FIELDS.index(name)])
            assert got[name] == w or (math.isnan(w) and math.isnan(got[name])), (name, got[name], w)
        v = x.double()
        finite = bool(torch.isfinite(v).all())
        mean = float(v.mean())
        assert got["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-300, nan_ok=True) or (
            math.isinf(mean) and got["mean"] == mean
        )
        if finite:  # float64 two passes: far inside the 1e-6 of the one-by-one path
            m2 = float(((v - v.mean()) ** 2).sum())
            assert got["m2"] == pytest.approx(m2, rel=1e-9, abs=1e-300)
        else:
            assert math.isnan(got["m2"])


def test_recorder_batches_short_tensors_and_keeps_their_value_at_observe_time() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert batchable(x, GROUPS) and not batchable(torch.randn(MAX_ELEMENTS + 1), GROUPS)
    assert not batchable(x.double(), GROUPS) and not batchable(x, ("moments", "fp8"))
    rec = Recorder(GROUPS)
    rec.observe("x", x)
    x.mul_(100.0)  # after the observation: not what was recorded
    got = dict(zip(stats.FIELDS, rec.records(["x"])[0, FORWARD].tolist()))
    assert (got["count"], got["mean"], got["m2"], got["absmax"], got["zeros"], got["min_nonzero"]) == (
        4.0,
        2.5,
        5.0,
        4.0,
        0.0,
        1.0,
    )
    assert np.isnan(got["fp8_e4m3_sq_err"])  # not asked for: NaN, as record_of


def test_a_failure_of_the_batched_statistics_is_kept_in_error_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_scale.record import short_records

    def broken(*args: object) -> None:
        raise RuntimeError("broken statistics")

    monkeypatch.setattr(short_records, "records_of_many", broken)
    rec = Recorder(GROUPS)
    rec.observe("x", torch.ones(8))
    rec.flush()  # what Reporter.pool does before reading `error`
    assert isinstance(rec.error, RuntimeError) and "broken" in str(rec.error)
    assert rec.records(["x"]).shape == (1, 2, len(stats.FIELDS))  # no raise: the step goes on


def test_short_tensors_with_the_block_and_kurtosis_groups_are_batched_and_equal_record_of() -> None:
    """The block what-ifs and central moments come from each tensor as it is observed (before
    the in-place op below), the batched groups from its copy: together the one-by-one record
    (blocks within the kernel's float32 rounding, flushed counts exact; kurtosis to 1e-6)."""
    groups = ("moments", "range", "formats", "blocks", "kurtosis")
    g = torch.Generator().manual_seed(7)
    xs = [
        torch.distributions.StudentT(torch.tensor(3.0)).sample((4, 40)),
        torch.randn(130, generator=g).bfloat16(),
        (torch.randn(3, 7, generator=g) * 1e-3 + 2.0).half(),  # (blocks: the torch code)
        torch.tensor(5.0),
    ]
    xs[0][1, 3] = math.nan
    assert all(batchable(x, groups) for x in xs) and not batchable(xs[0], (*groups, "fp8"))
    rec = Recorder(groups)
    for i, x in enumerate(xs):
        rec.observe(i, x)
    wants = [stats.record_of(x, groups, host_reads=True) for x in xs]
    for x in xs:
        x.mul_(3.0)  # after the observation: not what was recorded
    got = rec.records(list(range(len(xs))))[:, FORWARD]
    blocks = stats.GROUPS["blocks"]
    for row, want in zip(got.tolist(), wants):
        for name in blocks:
            w = float(want[stats.IX[name]])
            assert row[stats.IX[name]] == (w if name.endswith("flushed") else pytest.approx(w, rel=1e-6)), name
        for name in ("m3", "m4"):
            w = float(want[stats.IX[name]])
            assert row[stats.IX[name]] == pytest.approx(w, rel=1e-6, abs=1e-12) or math.isnan(w), name
    kurt = stats.statistic(got, "kurtosis")
    assert math.isnan(float(kurt[0]))  # (a NaN: NaN, as std)
    assert float(kurt[1]) == pytest.approx(float(stats.statistic(stats.assemble([wants[1]]), "kurtosis")[0]), rel=1e-6)
