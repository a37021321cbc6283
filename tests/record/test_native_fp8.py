"""The native kernel's per-tensor FP8 what-if (``native.fp8``) against the torch code that
defines it (``stats.fp8.fp8_fields``) and torch's own casts: every E4M3 and E5M2 rounding,
tie and subnormal one element at a time (exactly), the flushed counts exactly and the sums
to float64 rounding on random, heavy-tailed, subnormal-heavy, NaN/Inf-bearing and
mean-dominated tensors in float32, bfloat16 and float16, the layouts it reads in place, the
ones it declines (torch code then), and ``record_of`` taking it on the host path."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_scale.record import native, stats
from lightning_scale.record.stats.fields import FP8_DTYPES, FP8_FIELDS, FP8_SPAN, host_sum
from lightning_scale.record.stats.fp8 import fp8_fields

from test_blocks import CASES, _gen

#: The sums are float64 in another order than torch's: a few roundings of float64 apart.
F64 = 1e-12


@pytest.fixture(autouse=True)
def kernels():
    k = native.load()
    if k is None:
        pytest.skip(native.status())
    return k


def reference(x: Tensor) -> list:
    return [float(v) for v in fp8_fields(x, host_sum)]


def assert_matches(got, x: Tensor) -> None:
    assert got is not None
    for name, g, w in zip(FP8_FIELDS, list(got), reference(x)):
        if name.endswith("flushed"):
            assert g == w, name
        else:
            assert g == pytest.approx(w, rel=F64, abs=0), name


def _cases() -> dict:
    out = {name: (lambda s, make=make: make(s)) for name, make in CASES.items()}  # (test_blocks' cases)
    out["mean_dominated"] = lambda s: torch.randn(s, generator=_gen(20)) * 0.01 + 1e3  # |mean| = 1e5 std
    out["subnormal_amax"] = lambda s: torch.randn(s, generator=_gen(21)) * 1e-40  # scale = max / amax is inf
    out["zeros"] = lambda s: torch.zeros(s)
    return out


CASES_FP8 = _cases()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES_FP8))
def test_fields_equal_the_torch_code(case: str, dtype: torch.dtype) -> None:
    x = CASES_FP8[case]((37, 61)).to(dtype)  # (61: a tail of 5 after 7 vectors of 8)
    got = native.fp8(x)
    assert_matches(got, x)
    finite = torch.nan_to_num(x.float(), 0.0, 0.0, 0.0).abs().max()
    assert native.fp8(x, float(finite)).tolist() == got.tolist()  # (the caller's amax: the same numbers)


def test_every_e4m3_and_e5m2_value_tie_and_subnormal_one_at_a_time() -> None:
    # [448, v]: scale 1 for E4M3 and 128 for E5M2 (powers of two: the errors are exact and 448's is
    # zero), so each 2-element what-if is v's alone and must equal torch's cast's bit for bit.
    grid = torch.arange(256, dtype=torch.uint8)
    values = {}
    for name, dtype in FP8_DTYPES.items():
        exact = grid.view(dtype).float()
        exact = exact[exact.isfinite() & (exact.abs() <= 448)]
        scale = 448.0 / torch.finfo(dtype).max if name == "e5m2" else 1.0
        sorted_ = exact.unique() * scale  # in x's units: the values cast exactly
        values[name] = torch.cat([sorted_, (sorted_[1:] + sorted_[:-1]) / 2])  # and every tie
    sweep = torch.linspace(-448.0, 448.0, 4001)
    body = torch.cat([*values.values(), sweep, sweep / 2**12, torch.tensor([2.0**-20, -(2.0**-19), 1e-30])])
    for v in body.tolist():
        x = torch.tensor([448.0, v])
        got = native.fp8(x).tolist()
        assert got == reference(x), v


def test_layouts_read_in_place_and_declined() -> None:
    x = torch.randn(64, 200, generator=_gen(23)) * 4
    for t in (x[:, 3:131], x.t(), x.view(8, 8, 200).transpose(0, 1)):  # rows in wider rows, dense permutations
        assert_matches(native.fp8(t), t)
    for t in (x[::2, ::3], x.view(-1)[::2], x.double(), torch.empty(0)):  # (strided elements; another dtype)
        assert native.fp8(t) is None


GROUPS = [("moments", "fp8"), ("moments", "range", "fp8"), ("moments", "range", "formats", "fp8")]


@pytest.mark.parametrize("groups", GROUPS)
def test_record_of_takes_the_kernel_on_the_host_path(groups: tuple) -> None:
    x = torch.distributions.StudentT(torch.tensor(2.0)).sample((96, 170)) * 5
    rec = stats.record_of(x, groups)
    assert rec[FP8_SPAN] == native.fp8(x).tolist()
    with native.switched_off():
        ref = stats.record_of(x, groups)
    assert ref[FP8_SPAN] == reference(x)
    assert_matches(rec[FP8_SPAN], x)
    x[5, 7] = float("inf")  # (amax then found by the kernel: the range group's max |x| is inf)
    assert_matches(stats.record_of(x, groups)[FP8_SPAN], x)


def test_what_the_kernel_declines_takes_the_torch_code() -> None:
    x = torch.randn(40, 90, generator=_gen(24))
    for t in (x[::2, ::3], x.double()):
        assert stats.record_of(t, ("moments", "fp8"))[FP8_SPAN] == reference(t)
