"""The host path as one graph op (``host_record``, the compiled route's statistics on the
CPU): its vectors are the host path's own records (``RecordLayout``: views), agree with the
traceable ops and with float64 references (|mean| far above the spread, NaN and ±Inf, half
types, strided views, every group and the channel row), and Inductor keeps it as one call."""

from __future__ import annotations

import importlib
import math
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats import host_op
from lightning_scale.record.stats.channels import channel_row
from lightning_scale.record.settings import Settings
from lightning_scale.record.stats.host_op import ENV, RecordLayout, host_record, record_size, uses_host_op
from lightning_scale.record.stats.traceable import PackedLayout, packed_record, traceable_record
from lightning_scale.record.stats.traceable_channels import traceable_channel_row
from test_outliers import reference_moments

ALL_GROUPS = tuple(stats.GROUPS)  # (channels included)
IX = {name: i for i, name in enumerate(stats.FIELDS)}
CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(600)


def same(a: Tensor, b: Tensor) -> bool:
    """Equal bit for bit, NaN (the fields of groups not taken) where NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cases() -> Dict[str, Tensor]:
    """Short tensors (torch code) and long ones (the native kernel above 4096 elements), |mean|
    1e4 times the spread, NaN and ±Inf, strided and expanded views, float64, bfloat16 and float16."""
    bad = torch.randn(300, generator=_gen(14))
    bad[5], bad[260], bad[299] = math.nan, math.inf, -math.inf
    inf = torch.randn(64, 96, generator=_gen(15))
    inf[3, 2] = -math.inf
    return {
        "short": torch.randn(100, generator=_gen(10)),
        # short tensors the kernel's one-pass sums cannot give (the torch path takes over)
        "single": torch.tensor([3.0]),
        "constant_short": torch.ones(128),  # (a LayerNorm weight at initialisation)
        "tiny_short": torch.randn(64, generator=_gen(25)) * 1e-35,  # (squares below float32's normals)
        "long": torch.randn(16, 8, 40, generator=_gen(11)) * 3,
        "mean_1e4_std": (torch.randn(64, 80, generator=_gen(12), dtype=torch.float64) + 1e4).float(),
        "mean_1e3_std_short": 1 + 1e-3 * torch.randn(6, 100, generator=_gen(13)),
        "strided": torch.randn(96, 64, 2, generator=_gen(16))[..., 0].t(),
        "expanded": (torch.randn(64, 1, generator=_gen(24)) * 3).expand(64, 96),  # (stride 0)
        "expanded_constant": torch.full((1,), 0.5).expand(64, 96),  # (the gradient of a mean)
        "float64": torch.randn(24, 64, generator=_gen(17), dtype=torch.float64).t(),
        "bfloat16": (torch.randn(80, 70, generator=_gen(18)) * 3 + 1).bfloat16(),
        "float16": (torch.randn(40, 130, generator=_gen(19)) * 2).half(),
        "non_finite": bad,
        "one_inf": inf,
    }


@pytest.mark.parametrize("groups", [("moments",), ("moments", "range"), ALL_GROUPS])
def test_the_ops_vectors_are_the_host_paths_records(groups: Tuple[str, ...]) -> None:
    """All cases at once through ``RecordLayout``: each tensor's record is the host path's
    record bit for bit (``fast_host_record`` where it takes the tensor, else
    ``record_of(x, groups, host_reads=True)``), its channel row ``channel_row(x)``, and
    moments within 1e-6 of fsum."""
    xs = cases()
    fast = stats.fast_host_record(groups)
    packed = [host_record(x, groups) for x in xs.values()]
    assert {p.numel() for p in packed} == {record_size(groups)}
    layout = RecordLayout([x.numel() for x in xs.values()], groups)
    rows = layout.records(torch.cat(packed))
    for row, (case, x) in zip(rows, xs.items()):
        dense = x.contiguous() if 0 in x.stride() else x  # (the op copies an expanded tensor)
        # (the op's source: the native kernel's record where it takes the tensor, at any size)
        short = fast(dense) if fast is not None else None
        want = stats.assemble([short if short is not None else stats.record_of(dense, groups, host_reads=True)])[0]
        torch.testing.assert_close(row, want, rtol=0, atol=0, equal_nan=True, msg=case)
        n, mean, m2, _, _ = reference_moments(x)
        assert row[IX["count"]] == x.numel() and row[IX["nan"]] == int(x.isnan().sum()), case
        assert row[IX["inf"]] == int(x.isinf().sum()), case
        if x.isfinite().all():
            sigma = math.sqrt(m2 / n)
            assert float(row[IX["mean"]]) == pytest.approx(mean, rel=0, abs=1e-6 * (abs(mean) + sigma)), case
            assert float(row[IX["m2"]]) == pytest.approx(m2, rel=1e-6), case
    by_case = dict(zip(xs, rows))
    assert by_case["one_inf"][IX["mean"]] == -math.inf and by_case["one_inf"][IX["m2"]].isnan()
    assert by_case["non_finite"][IX["mean"]].isnan() and by_case["non_finite"][IX["m2"]].isnan()
    channels = layout.channel_rows(torch.cat(packed))
    assert (channels is None) == ("channels" not in groups)
    for i, x in enumerate(xs.values() if channels is not None else ()):
        assert torch.equal(channels[i], channel_row(x).double()) and torch.equal(channels[i], traceable_channel_row(x))


@pytest.mark.parametrize("groups", [("moments", "range"), ALL_GROUPS])
def test_host_op_agrees_with_the_traceable_ops(groups: Tuple[str, ...]) -> None:
    """The two forms of the compiled route's statistics (the host op's records, the traceable
    ops' row partial sums finished by ``PackedLayout``): counts, NaN/Inf, max |x|, the format
    counts and the channel row equal; every other field within 1e-5."""
    xs = cases()
    numels = [x.numel() for x in xs.values()]
    host = torch.cat([host_record(x, groups) for x in xs.values()])
    rows = RecordLayout(numels, groups).records(host)
    channels = RecordLayout(numels, groups).channel_rows(host)
    traced = torch.cat([packed_record(x, groups) for x in xs.values()])
    layout = PackedLayout(numels, groups, CPU)
    others, other_channels = layout.records(traced), layout.channel_rows(traced)
    exact = [IX[f] for f in ("count", "nan", "inf", "absmax")]
    exact += [IX[f] for f in stats.FORMAT_FIELDS] if "formats" in groups else []
    for row, other, (case, x) in zip(rows, others, xs.items()):
        torch.testing.assert_close(other, traceable_record(x, groups), rtol=0, atol=0, equal_nan=True, msg=case)
        torch.testing.assert_close(row[exact], other[exact], rtol=0, atol=0, equal_nan=True, msg=case)
        torch.testing.assert_close(row, other, rtol=1e-5, atol=1e-9, equal_nan=True, msg=case)
    assert (channels is None) == (other_channels is None) == ("channels" not in groups)
    if channels is not None:
        assert torch.equal(channels, other_channels)


def test_layout_rejects_vectors_of_another_length() -> None:
    layout = RecordLayout([100, 300], ("moments",))
    want = 2 * record_size(("moments",))
    with pytest.raises(ValueError, match=rf"`packed` must have shape \[{want}\], got \[7\]"):
        layout.records(torch.zeros(7, dtype=torch.float64))


def test_inductor_keeps_the_op_as_one_call_and_compiles_once() -> None:
    """Under ``torch.compile`` (Inductor) the op is one call in the generated code (no
    statistic kernels to generate), its numbers are the eager op's, and new values reuse
    the compiled graph."""
    from torch._inductor.utils import run_and_get_code

    groups = ("moments", "range", "channels")
    torch._dynamo.reset()
    fn = torch.compile(lambda t: host_record(t * 2.0 + 1.0, groups), fullgraph=True, dynamic=False)
    x = torch.randn(64, 96, generator=_gen(20))
    got, code = run_and_get_code(fn, x)
    assert "lightning_scale.host_record" in "\n".join(code)
    assert same(got, host_record(x * 2.0 + 1.0, groups))
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed in (21, 22):
        y = torch.randn(64, 96, generator=_gen(seed)) * 1e3
        assert same(fn(y), host_record(y * 2.0 + 1.0, groups))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    torch._dynamo.reset()


def test_environment_variable_chooses_the_ops() -> None:
    for value, cpu in (("", True), ("auto", True), ("HOST", True), ("ops", False)):
        choice = Settings.from_env({ENV: value}).compiled_stats
        assert uses_host_op(CPU, choice) is cpu, value
        assert uses_host_op(torch.device("meta"), choice) is False, value
    with pytest.raises(
        ValueError, match=r"`LIGHTNING_SCALE_COMPILED_STATS` must be one of auto, host, ops; got 'fast'"
    ):
        Settings.from_env({ENV: "fast"})
    with pytest.raises(ValueError, match=r"`LIGHTNING_SCALE_COMPILED_STATS` must be one of auto, host, ops, got 'x'"):
        uses_host_op(CPU, "x")


def test_a_second_import_finds_the_op_defined_once() -> None:
    x = torch.randn(50, 3, generator=_gen(23))
    before = host_record(x)
    importlib.reload(host_op)  # (defining the op again would raise)
    assert same(host_op.host_record(x), before)
    assert same(host_record(x), before)
