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
