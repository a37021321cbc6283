"""Every statistic group as graph ops (``traceable_record``, the compiled route's rows), eager and
compiled by Inductor, against the float64 references of the device path's tests: an fsum
quantisation for ``fp8``, torchao's emulated casts for ``blocks``, fsum central moments for
``kurtosis``, including tensors whose |mean| is far above their spread."""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats.traceable import TRACEABLE_GROUPS, PackedLayout, packed_record, traceable_record
from test_blocks_whatif import FORMATS as BLOCK_FORMATS
from test_blocks_whatif import what_if as block_what_if
from test_fp8_whatif import FP8
from test_fp8_whatif import what_if as fp8_what_if
from test_outliers import assert_moments_close, reference_moments

ALL_GROUPS = tuple(stats.GROUPS)
IX = {name: i for i, name in enumerate(stats.FIELDS)}
# Inductor compiles C++ with g++: ~20 s cold here, minutes on a loaded machine.
pytestmark = pytest.mark.timeout(1200)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: Same shape (one compile serves all), float32: a last dimension that is not a multiple of 32
#: (zero-padded blocks), and means from 0 to 1e4 times the spread.
CASES: Dict[str, Callable[[], Tensor]] = {
    "gaussian": lambda: torch.randn(6, 100, generator=_gen(0)),
    "mean_1e3_std": lambda: 1 + 1e-3 * torch.randn(6, 100, generator=_gen(1)),
    "mean_1e4_std": lambda: (torch.randn(6, 100, generator=_gen(2), dtype=torch.float64) + 1e4).float(),
    "heavy_tails": lambda: torch.exp(2 * torch.randn(6, 100, generator=_gen(3))) * 1e-3,
    "tiny": lambda: torch.randn(6, 100, generator=_gen(4)) * 1e-30,
}


def test_every_group_is_traceable() -> None:
    # every group with fields in the record (``channels`` is a row beside it, not on this route)
    assert (
        set(TRACEABLE_GROUPS) == {g for g, fields in stats.GROUPS.items() if fields} == set(stats.GROUPS) - {"channels"}
    )
    row = traceable_record(torch.randn(4, 40, generator=_gen(9)), ALL_GROUPS)
    assert not row.isnan().any(), [f for f, v in zip(stats.FIELDS, row.tolist()) if math.isnan(v)]
    only = traceable_record(torch.randn(4, 40, generator=_gen(9)), ("moments",))
    assert only[[IX[f] for f in (*stats.GROUPS["fp8"], *stats.GROUPS["blocks"], "m3", "m4")]].isnan().all()


def assert_matches_references(row: Tensor, x: Tensor, what: str) -> None:
    """``row``'s fp8 and block what-ifs and its moments against the float64 references, to the
    device path's tolerances (test_fp8_whatif.py, test_blocks_whatif.py, test_outliers.py)."""
    got = stats.summarise(row.double().cpu(), _NAMES)
    for fmt in FP8:
        snr, flushed = fp8_what_if(x, fmt)
        assert got[f"fp8_{fmt}_snr_db"] == pytest.approx(snr, rel=1e-6), (what, fmt)
        assert got[f"fp8_{fmt}_flushed"] == pytest.approx(flushed, abs=1e-7), (what, fmt)
    for fmt in BLOCK_FORMATS:
        snr, flushed = block_what_if(x, fmt)
        assert got[f"{fmt}_snr_db"] == pytest.approx(snr, abs=1e-4), (what, fmt)  # dB
        assert got[f"{fmt}_flushed"] == pytest.approx(flushed, abs=1e-7), (what, fmt)
    moments = torch.stack([row[IX[f]] for f in ("count", "mean", "m2", "m3", "m4")])
    assert_moments_close(moments, reference_moments(x), 1e-6)


_NAMES: List[str] = [
    *(f"fp8_{fmt}_{k}" for fmt in FP8 for k in ("snr_db", "flushed")),
    *(f"{fmt}_{k}" for fmt in BLOCK_FORMATS for k in ("snr_db", "flushed")),
    "kurtosis",
]


@pytest.mark.parametrize("case", list(CASES))
def test_eager_rows_match_float64_references(case: str) -> None:
    x = CASES[case]()
    assert_matches_references(traceable_record(x, ALL_GROUPS), x, case)


def test_eager_rows_equal_the_device_path_bit_for_bit_for_every_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same functions, the whole tensor as one piece: the device path's own numbers (on a
    device, the what-ifs, kurtosis and channels are torch code: the host's kernels are off)."""
    from lightning_scale.record import native

    for kernel in ("blocks", "moments", "fp8", "channel_maxima"):
        monkeypatch.setattr(native, kernel, lambda *args, **kwargs: None)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x = (torch.randn(5, 70, generator=_gen(5)) * 3 + 40).to(dtype)
        x[0, 0], x[1, 1] = math.inf, math.nan
        want = stats.assemble([stats.record_of(x, ALL_GROUPS, host_reads=False)])[0]
        torch.testing.assert_close(traceable_record(x, ALL_GROUPS), want, rtol=0, atol=0, equal_nan=True)


@pytest.fixture(scope="module")
def compiled_record() -> Callable[[Tensor], Tensor]:
    """As the compiled route computes a record: ``packed_record`` compiled, its rows merged
    after the graph (``PackedLayout.records``)."""
    torch._dynamo.reset()
    packed = torch.compile(lambda t: packed_record(t, ALL_GROUPS), fullgraph=True, dynamic=False)
    yield lambda t: PackedLayout((t.numel(),), ALL_GROUPS, t.device).records(packed(t))[0]
    torch._dynamo.reset()


def test_inductor_rows_match_float64_references(compiled_record: Callable[[Tensor], Tensor]) -> None:
    """Compiled with Inductor (fused, reordered float32 sums): the references' tolerances hold,
    and the row stays within float32 rounding of the eager one. One compile for every case."""
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for case, make in CASES.items():
        x = make()
        row = compiled_record(x)
        assert_matches_references(row, x, case)
        eager = traceable_record(x, ALL_GROUPS)
        exact = [IX[f] for f in ("count", "nan", "inf", "absmax", "min_nonzero", *stats.FORMAT_FIELDS)]
        exact += [IX[f] for f in (*stats.GROUPS["fp8"], *stats.GROUPS["blocks"]) if f.endswith("flushed")]
        torch.testing.assert_close(row[exact], eager[exact], rtol=0, atol=0)
        torch.testing.assert_close(row, eager, rtol=1e-6, atol=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiles == 1


def test_inductor_rows_of_non_finite_values_match_the_device_path(compiled_record: Callable[[Tensor], Tensor]) -> None:
    """NaN and ±Inf are left out of the what-ifs and moments, as on the device path."""
    x = torch.randn(6, 100, generator=_gen(6)) * 5
    x[0, 3], x[2, 50], x[5, 99] = math.nan, math.inf, -math.inf
    want = stats.assemble([stats.record_of(x, ALL_GROUPS, host_reads=False)])[0]
    got = compiled_record(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
    assert_moments_close(_finite_moments(got, x), reference_moments(x), 1e-6)


def _finite_moments(row: Tensor, x: Tensor) -> Tensor:
    """(count, mean, m2, m3, m4) of the finite elements: the record's m3/m4 with the finite
    elements' own count, mean and m2 (the record's moments of a tensor with NaN are NaN)."""
    finite = x[x.isfinite()]
    own = traceable_record(finite, ("moments",))
    return torch.stack([own[IX["count"]], own[IX["mean"]], own[IX["m2"]], row[IX["m3"]], row[IX["m4"]]])


class Shifted(torch.nn.Module):
    """``linear(x) * 1e-3 + 1``: an output whose mean is about 1000 times its spread."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(48, 40)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * 1e-3 + 1.0


class Holder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


@pytest.mark.parametrize("ops", ["auto", "ops"])
def test_compiled_route_records_every_group_of_the_tensors_it_computes(
    ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled submodule on the compiled route with every group on: each row against the
    float64 references of the very tensors the compiled step computed (its output and that
    output's gradient, a parameter and its gradient). The user's backend here is AOTAutograd
    without Inductor (the route compiles with the user's backend; Inductor's C++ compile of
    every group on every node takes minutes here, and its rows are checked above). On the
    CPU the route records with the host op (``auto``); ``ops`` forces the traceable ops."""
    from lightning_scale.capture.compiled import CompiledRoute
    from lightning_scale.record.stats.host_op import ENV

    monkeypatch.setenv(ENV, ops)
    from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording

    torch._dynamo.reset()
    torch.manual_seed(3)
    holder = Holder(torch.compile(Shifted(), backend="aot_eager"))
    route = CompiledRoute(holder, ALL_GROUPS)
    rec = Recorder(groups=ALL_GROUPS)
    with recording(rec):
        out = route.forward_for(holder.model)(torch.randn(32, 48, generator=_gen(8)))
    out.retain_grad()
    out.square().mean().backward()  # (gradient 2 out / n: its mean too is ~1000 times its spread)
    records, tags = rec.records(route.labels.tags, route.labels.aliases), route.labels.tags
    weight = holder.model.lin.weight
    tensors = {
        ("model", FORWARD): out,
        ("model", BACKWARD): out.grad,
        ("model.lin.weight", FORWARD): weight,
        ("model.lin.weight", BACKWARD): weight.grad,
    }
    for (label, direction), t in tensors.items():
        assert_matches_references(records[tags.index(label), direction], t.detach(), f"{label} {direction}")
    torch._dynamo.reset()


def _packed_cases() -> Dict[str, Tensor]:
    """Tensors whose rows differ: one short row (100), rows that divide the tensor (384: 2 of
    192; a strided view of 8 x 96: read along memory), rows of 256 and a tail (1009, prime),
    |mean| 1e4 times the spread, NaN and ±Inf, float64 and bfloat16."""
    big = torch.randn(24, 64, generator=_gen(12), dtype=torch.float64).t()
    odd = torch.randn(1009, generator=_gen(13)) * 1e-3 + 7.0
    bad = torch.randn(300, generator=_gen(14))
    bad[5], bad[260], bad[299] = math.nan, math.inf, -math.inf
    inf = torch.randn(64, 6, generator=_gen(15))
    inf[3, 2] = -math.inf
    return {
        "short": torch.randn(100, generator=_gen(10)),
        "divides": torch.randn(384, generator=_gen(11)) + 1e4,
        "strided": torch.randn(8, 96, 2, generator=_gen(16))[..., 0].t(),
        "float64": big,
        "tail": odd,
        "non_finite": bad,
        "one_inf": inf,
        "bfloat16": (torch.randn(40, 13, generator=_gen(17)) * 3 + 1).bfloat16(),
    }


@pytest.mark.parametrize("groups", [("moments", "range"), ("moments",), ALL_GROUPS])
def test_packed_records_of_many_tensors_equal_each_tensor_alone(groups: Tuple[str, ...]) -> None:
    """Many tensors' packed vectors finished at once (segment sums over all their rows) give
    each tensor's own record bit for bit, and moments within 1e-6 of float64 (fsum)."""
    cases = _packed_cases()
    layout = PackedLayout([x.numel() for x in cases.values()], groups, torch.device("cpu"))
    packed = [packed_record(x, groups) for x in cases.values()]
    assert [p.numel() for p in packed] == list(layout.sizes)
    rows = layout.records(torch.cat(packed))
    for row, (case, x) in zip(rows, cases.items()):
        torch.testing.assert_close(row, traceable_record(x, groups), rtol=0, atol=0, equal_nan=True, msg=case)
        n, mean, m2, _, _ = reference_moments(x)
        assert row[IX["count"]] == x.numel() and row[IX["nan"]] == int(x.isnan().sum()), case
        assert row[IX["inf"]] == int(x.isinf().sum()), case
        if x.isfinite().all():  # (the device path's standard: 1e-6 of |mean| + sigma, of m2)
            sigma = math.sqrt(m2 / n)
            assert float(row[IX["mean"]]) == pytest.approx(mean, rel=0, abs=1e-6 * (abs(mean) + sigma)), case
            assert float(row[IX["m2"]]) == pytest.approx(m2, rel=1e-6), case
        assert math.isnan(row[IX["absmax"]]) == ("range" not in groups or bool(x.isnan().any())), case
        if "range" in groups and not x.isnan().any():
            assert row[IX["absmax"]] == x.abs().max().double(), case
    by_case = dict(zip(cases, rows))
    assert by_case["one_inf"][IX["mean"]] == -math.inf and by_case["one_inf"][IX["m2"]].isnan()
    assert by_case["non_finite"][IX["mean"]].isnan() and by_case["non_finite"][IX["m2"]].isnan()


def test_packed_layout_rejects_vectors_of_another_size() -> None:
    layout = PackedLayout([100, 300], ("moments",), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"`packed` must have shape \[21\], got \[20\]"):
        layout.records(torch.zeros(20, dtype=torch.float64))


def test_a_recorded_tensor_adds_few_ops_to_the_graph() -> None:
    """The tracked version's compile time grows with the ops each recorded tensor adds to its
    graphs (AOTAutograd traces them, Inductor schedules, generates and compiles them), once
    forward and once backward: ``packed_record`` as Inductor decomposes it stays near the ops
    its row loops need (29; the float64 merge in the graph made it 128 on a GPT)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    for shape in [(16, 64, 128), (384,), (8, 100)]:
        traced = make_fx(lambda t: packed_record(t, ("moments", "range")), decomposition_table=select_decomp_table())
        graph = traced(torch.randn(*shape)).graph
        ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        assert len(ops) <= 32, (shape, len(ops), ops)
