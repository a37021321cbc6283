"""The compiled route: statistics compiled into the user's Inductor graphs, training unchanged.

Inductor on the CPU compiles C++ with g++ (10-20 s a cold compile of a small block): the
models are tiny and each is compiled once per module, shared by the tests below.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.capture.compiled import CompiledRoute, Packing, user_compile
from lightning_scale.capture.instrument import instrument_graph
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording
from lightning_scale.record.stats.channels import CHANNEL_CAP, channel_row, channel_statistics
from lightning_scale.record.stats.host_op import ENV, host_record, host_records
from lightning_scale.record.stats.traceable import packed_record, traceable_record
from lightning_scale.tools.models import Block, GPTConfig
from test_instrument import dynamo_graph

GROUPS = ("moments", "range", "formats")
# Inductor compiles with g++: a cold compile of the block here takes ~20 s on an idle machine,
# minutes on a loaded one (pytest's default limit here is 300 s per test, setup included).
pytestmark = pytest.mark.timeout(1200)
IX = {name: i for i, name in enumerate(stats.FIELDS)}
#: The device path's standard against float64 (tests/record/test_stats.py): rows are float32
#: sums of 256 elements merged in float64 (~1e-7), as the device path's.
DEVICE_REL = 1e-6


class Holder(nn.Module):
    """The captured module, holding a compiled submodule (``self.model = torch.compile(...)``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def row_summary(row: Tensor) -> Dict[str, float]:
    return stats.summarise(row.double().cpu(), ("count", "mean", "std", "absmax", "nan", "inf"))


def float64_summary(t: Tensor) -> Dict[str, float]:
    v = t.detach().double().reshape(-1)
    return {
        "count": float(v.numel()),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "absmax": float(v.abs().max()),
        "nan": 0.0,
        "inf": 0.0,
    }


def assert_close_summary(got: Dict[str, float], want: Dict[str, float], rel: float, what: str) -> None:
    """Counts exact; mean within ``rel`` of the tensor's scale (a mean near 0 has no relative
    accuracy of its own); std and absmax within ``rel``."""
    for name in ("count", "nan", "inf"):
        assert got[name] == want[name], (what, name)
    scale = want["std"] + abs(want["mean"]) + 1e-30
    assert abs(got["mean"] - want["mean"]) <= rel * scale, (what, got, want)
    assert got["std"] == pytest.approx(want["std"], rel=rel, abs=1e-30), (what, got, want)
    assert got["absmax"] == pytest.approx(want["absmax"], rel=rel, abs=1e-30), (what, got, want)


# ---------------------------------------------------------------------------------------
# The record as graph ops, run eagerly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_traceable_record_equals_the_device_path(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 1000, generator=g) * torch.logspace(-30, 5, 1000)).to(dtype)
    x[0, :7] = 0.0
    x[1, 3] = 1e38 if dtype != torch.bfloat16 else 3e38
    got = traceable_record(x, GROUPS)
    want = stats.assemble([stats.record_of(x, GROUPS, host_reads=False)])[0]
    exact = [IX[f] for f in ("count", "absmax", "nan", "inf", *stats.GROUPS["formats"])]
    torch.testing.assert_close(got[exact], want[exact], rtol=0, atol=0)
    summary, reference = row_summary(got), float64_summary(x)
    assert_close_summary(summary, reference, DEVICE_REL, str(dtype))
    assert torch.isnan(got[[IX[f] for f in stats.GROUPS["fp8"]]]).all()  # (a group not asked for)


@pytest.mark.parametrize("noise", [1e-3, 0.032])
def test_traceable_std_is_accurate_when_mean_dominates(noise: float) -> None:
    # x = 1 + noise * randn: |mean| / std about 1000 and 30 (tests/record/test_stats.py's case)
    x = 1 + noise * torch.randn(2**16, generator=torch.Generator().manual_seed(4))
    exact = float(x.double().std())
    assert row_summary(traceable_record(x))["std"] == pytest.approx(exact, rel=DEVICE_REL)
    shifted = x + 1e4  # |mean| / std about 1e7: the same accuracy (each row's sums are about its own mean)
    got = row_summary(traceable_record(shifted))["std"]
    assert got == pytest.approx(float(shifted.double().std()), rel=1e-6)


def test_traceable_record_of_non_finite_values_matches_the_device_path() -> None:
    for special in ([math.inf], [-math.inf, math.inf], [math.nan], [math.inf, math.nan]):
        x = torch.randn(100)
        x[: len(special)] = torch.tensor(special)
        got = traceable_record(x, GROUPS)
        want = stats.assemble([stats.record_of(x, GROUPS, host_reads=False)])[0]
        moments = [IX[f] for f in ("count", "mean", "m2", "absmax", "nan", "inf", "zeros")]
        torch.testing.assert_close(got[moments], want[moments], rtol=0, atol=0, equal_nan=True)


def test_user_compile_reads_the_backend_and_options_of_each_pattern() -> None:
    block = nn.Linear(4, 4)
    whole = user_compile(torch.compile(block, mode="max-autotune-no-cudagraphs", dynamic=False))
    assert whole is not None and whole.dynamic is False and not whole.fullgraph
    assert whole.backend.config.get("max_autotune") is True  # the user's Inductor options
    eager = user_compile(torch.compile(block, backend="aot_eager", fullgraph=True))
    assert eager is not None and eager.fullgraph and "aot_eager" in eager.backend.compiler_name
    in_place = nn.Linear(4, 4)
    assert user_compile(in_place) is None
    in_place.compile(dynamic=True)
    found = user_compile(in_place)
    assert found is not None and found.dynamic is True and found.backend.compiler_name == "inductor"
    with pytest.raises(ValueError, match=r"`compiled` must be an OptimizedModule or compiled in place, got Linear"):
        CompiledRoute(nn.Linear(4, 4)).forward_for(nn.Linear(4, 4))


# ---------------------------------------------------------------------------------------
# A GPT block under Inductor: the user's compiled version and the instrumented one


class Run:
    """One module compiled by the user, its instrumented twin, and what two steps gave."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab=32, seq=8, layers=1, dim=32, heads=2)
        self.eager = Holder(Block(cfg))
        self.holder = Holder(torch.compile(copy.deepcopy(self.eager.model)))
        self.route = CompiledRoute(self.holder, GROUPS)
        self.x = torch.randn(2, 8, 32)
        self.records: List[Tensor] = []
        self.graphs: List[int] = []


@pytest.fixture(params=["auto", "ops"])
def statistics_ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both forms of the route's statistics on the CPU: the host op (``auto``) and the
    traceable ops (``ops``, what compiles into an accelerator's kernels)."""
    monkeypatch.setenv(ENV, request.param)
    return str(request.param)


def loss_of(out: Tensor) -> Tensor:
    return out.square().mean()


def run_step(run: Run, forward: Callable[[Tensor], Tensor], tracked: bool) -> Tuple[Tensor, List[Tensor]]:
    rec = Recorder(groups=GROUPS)
    with recording(rec) if tracked else contextlib.nullcontext():
        out = forward(run.x)
    loss_of(out).backward()
    if tracked:
        run.records.append(rec.records(run.route.labels.tags, run.route.labels.aliases))
    grads = [p.grad.clone() for p in run.holder.parameters()]
    run.holder.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.fixture(scope="module", params=["auto", "ops"])
def block_run(request: pytest.FixtureRequest) -> Iterator[Run]:
    """Two SGD steps; each runs the user's compiled block, then the instrumented one from
    the same parameters, and steps with the instrumented gradients; with the host op
    (``auto``) and with the traceable ops (``ops``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV, request.param)
        yield from _block_run()


def _block_run() -> Iterator[Run]:
    torch._dynamo.reset()
    run = Run()
    opt = torch.optim.SGD(run.holder.parameters(), lr=0.5)
    instrumented = run.route.forward_for(run.holder.model)
    counters = torch._dynamo.utils.counters["stats"]
    run.outputs = []  # type: ignore[attr-defined]
    for _ in range(2):
        user = run_step(run, run.holder.model, tracked=False)
        mine = run_step(run, instrumented, tracked=True)
        run.outputs.append((user, mine))  # type: ignore[attr-defined]
        run.graphs.append(counters["unique_graphs"])
        for p, g in zip(run.holder.parameters(), mine[1]):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    user_again = run_step(run, run.holder.model, tracked=False)  # (switched back: no compile)
    run.graphs.append(counters["unique_graphs"])
    run.user_again = user_again  # type: ignore[attr-defined]
    yield run
    torch._dynamo.reset()


def test_instrumented_block_trains_bit_identically_to_the_users_compiled_block(block_run: Run) -> None:
    for step, ((out_u, grads_u), (out_t, grads_t)) in enumerate(block_run.outputs):  # type: ignore[attr-defined]
        assert torch.equal(out_u, out_t), step
        for (name, _), a, b in zip(block_run.holder.named_parameters(), grads_u, grads_t):
            assert torch.equal(a, b), (step, name)
    # both versions were compiled on the first step; switching between them compiled nothing
    assert block_run.graphs[0] == block_run.graphs[1] == block_run.graphs[2]
    assert block_run.route.compile_seconds > 0


def test_labels_equal_the_uncompiled_dynamo_capture(block_run: Run) -> None:
    eager = copy.deepcopy(block_run.eager)
    cap = capture(eager, "dynamo")
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        cap.tracked()(block_run.x)
    torch._dynamo.reset()
    # the root's input `x` is recorded by the capture around a compiled module, not in it
    assert block_run.route.labels.tags == [t for t in cap.tags if t != "x"]
    assert block_run.route.labels.aliases == cap.aliases
    assert "model.mlp.fc1" in block_run.route.labels.module_outputs and "model" in block_run.route.labels.tags


def test_rows_equal_float64_statistics_of_the_eager_tensors(block_run: Run) -> None:
    """The first tracked step's rows against float64 statistics of the same tensors in an
    eager twin (same parameters, same input). Inductor fuses and reorders float32 work
    (layer norm, GELU, the softmax of attention), so the tensors themselves differ from
    eager in the last bits (~1e-6 relative): their statistics agree to 1e-4 of their scale."""
    eager = copy.deepcopy(block_run.eager)
    values: Dict[str, Tensor] = {}

    def keep(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: object, out: Tensor) -> None:
            out.retain_grad()
            values[path] = out

        return hook

    for path, m in eager.named_modules():
        if path:
            m.register_forward_hook(keep(path))
    loss_of(eager(block_run.x)).backward()
    records, tags = block_run.records[0], block_run.route.labels.tags
    for path, t in values.items():
        row = records[tags.index(path)]
        assert_close_summary(row_summary(row[FORWARD]), float64_summary(t), 1e-4, path)
        assert_close_summary(row_summary(row[BACKWARD]), float64_summary(t.grad), 1e-4, path + " grad")
    for name, p in eager.named_parameters():
        row = records[tags.index(name)]
        assert_close_summary(row_summary(row[FORWARD]), float64_summary(p), DEVICE_REL, name)
        assert_close_summary(row_summary(row[BACKWARD]), float64_summary(p.grad), 1e-4, name + " grad")
    assert len(values) >= 8


def test_rows_of_the_second_step_describe_the_updated_parameters(block_run: Run) -> None:
    tags = block_run.route.labels.tags
    first, second = block_run.records
    weight = tags.index("model.mlp.fc1.weight")
    assert not torch.equal(first[weight, FORWARD], second[weight, FORWARD])  # the SGD step moved it
    assert float(second[weight, FORWARD, IX["count"]]) == 32 * 128


class Shifted(nn.Module):
    """``linear(x) * 1e-3 + 1``: a mean about 1000 times the spread."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * 1e-3 + 1.0


def test_compiled_std_is_accurate_when_mean_dominates(statistics_ops: str) -> None:
    """tests/record/test_stats.py's standard (rel 1e-4 at |mean| / std ~ 1000), on the rows
    Inductor computes; a one-pass float32 formula misses it by far."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    eager = Holder(Shifted())
    holder = Holder(torch.compile(copy.deepcopy(eager.model)))
    route = CompiledRoute(holder, GROUPS)
    x = torch.randn(64, 64)
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        out = route.forward_for(holder.model)(x)
    out.sum().backward()
    records = rec.records(route.labels.tags, route.labels.aliases)
    want = eager(x).detach().double()
    assert abs(float(want.mean())) > 500 * float(want.std())
    got = row_summary(records[route.labels.tags.index("model"), FORWARD])
    assert got["std"] == pytest.approx(float(want.std()), rel=1e-4)
    assert got["mean"] == pytest.approx(float(want.mean()), rel=1e-7)
    w = want.float()
    naive = math.sqrt(max(float((w * w).mean() - w.mean() ** 2), 0.0))
    assert abs(naive / float(want.std()) - 1) > 1e-3
    torch._dynamo.reset()


class Gained(nn.Module):
    """A Linear to 4,100 channels (folded into 4,096 slots) times a gain: an outlier channel,
    and ±Inf and NaN channels (forward and, through the loss, backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, CHANNEL_CAP + 4)
        gain = torch.ones(CHANNEL_CAP + 4)
        gain[7], gain[CHANNEL_CAP + 1], gain[CHANNEL_CAP + 3] = 40.0, math.inf, math.nan
        self.register_buffer("gain", gain)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.gain


def test_channel_rows_on_the_compiled_route_equal_the_eager_routes(statistics_ops: str) -> None:
    """The ``channels`` group compiled into the graph: every node's channel row, forward and
    backward, is bit for bit the one the eager (dynamo) route takes on the host path from the
    same computation, and the module output's is the host path's row of the very tensors
    (folding, NaN and ±Inf included). The other fields are still recorded (against float64).
    The user's backend is AOTAutograd without Inductor (no C++ compile)."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    groups = ("moments", "range", "channels")
    eager = Holder(Gained())
    holder = Holder(torch.compile(copy.deepcopy(eager.model), backend="aot_eager"))
    route = CompiledRoute(holder, groups)
    x = torch.randn(16, 48)
    rec = Recorder(groups=groups)
    with recording(rec):
        out = route.forward_for(holder.model)(x)
    out.retain_grad()
    out.square().mean().backward()
    tags = route.labels.tags
    channels = rec.channel_tensor(tags, route.labels.aliases)
    model = tags.index("model")
    assert torch.equal(channels[model, FORWARD], channel_row(out)) and channels[model, FORWARD, 0] == CHANNEL_CAP + 4
    assert torch.equal(channels[model, BACKWARD], channel_row(out.grad))
    assert float(channel_statistics(channels[model, FORWARD])["channel_max_ratio"]) > 20  # the gain-40 channel
    records = rec.records(tags, route.labels.aliases)
    lin = holder.model.lin.weight
    weight = tags.index("model.lin.weight")
    assert_close_summary(row_summary(records[weight, FORWARD]), float64_summary(lin), DEVICE_REL, "weight")
    assert torch.equal(channels[weight, BACKWARD], channel_row(lin.grad))  # (rows of NaN and ±Inf)

    cap = capture(eager, "dynamo")  # the eager route, the host path's channel rows
    eager_rec = Recorder(groups=groups)
    with recording(eager_rec):
        eager_out = cap.tracked()(x)
    eager_out.square().mean().backward()
    want = eager_rec.channel_tensor(tags, cap.aliases)
    assert int((want[:, :, 0] > 0).sum()) >= 8  # (nodes with rows: the linear, the gain, the product, ...)
    for i, tag in enumerate(tags):
        assert torch.equal(channels[i], want[i]), tag
    torch._dynamo.reset()


class TwoHeads(nn.Module):
    """Two outputs of one hidden layer, and a parameter only the second head uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.full((16,), 2.0))

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = self.lin(x)
        return torch.relu(h), torch.sigmoid(h) * self.scale


def test_an_output_the_loss_does_not_use_has_zero_gradients_as_the_users_module_has(statistics_ops: str) -> None:
    """The loss uses the first head only. AOTAutograd hands the compiled backward zeros for
    the unused head, so its nodes' and its parameter's gradients are zeros in the user's
    compiled module too: recorded as such (count, mean 0, m2 0), and training is unchanged."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    user = Holder(torch.compile(TwoHeads(), backend="aot_eager"))
    holder = Holder(torch.compile(copy.deepcopy(user.model._orig_mod), backend="aot_eager"))
    route = CompiledRoute(holder, GROUPS)
    x = torch.randn(8, 16)
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        first, _ = route.forward_for(holder.model)(x)
    first.sum().backward()
    user(x)[0].sum().backward()
    records, tags = rec.records(route.labels.tags, route.labels.aliases), route.labels.tags
    mine = dict(holder.model._orig_mod.named_parameters())
    for name, p in user.model._orig_mod.named_parameters():
        assert torch.equal(p.grad, mine[name].grad), name
        got = row_summary(records[tags.index(f"model.{name}"), BACKWARD])
        assert_close_summary(got, float64_summary(p.grad), DEVICE_REL, name)
    assert float(user.model._orig_mod.scale.grad.abs().sum()) == 0  # (the unused head's parameter: zeros)
    sigmoid = next(t for t in tags if t.startswith("model/") and "sigmoid" in t)
    row = row_summary(records[tags.index(sigmoid), BACKWARD])
    assert row["count"] == 8 * 16 and row["mean"] == 0 and row["std"] == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("ops", ["auto", "ops"])
def test_gradients_backward_did_not_reach_give_empty_records(ops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Packing.gradient_rows`` where backward reached part of a graph: the nodes it missed
    have rows of zeros (count 0, an empty record), the others the records of their gradients,
    in the order of the rows asked for. With the host op the graph has one probe (a missed
    node's slice of its gradient stays zero); with the traceable ops one per node (a missed
    node's probe has no gradient)."""
    monkeypatch.setenv(ENV, ops)
    gm, inputs = dynamo_graph(TwoHeads(), torch.randn(2, 16))
    names = [n.name for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    rewritten = instrument_graph(gm, names, inputs, GROUPS)
    assert rewritten is not None and rewritten.host == (ops == "auto")
    packing = Packing(rewritten, GROUPS, torch.device("cpu"))
    probes = packing.probes()
    probed = [i for group in rewritten.probed for i in group]
    missed = set(probed[1::3])
    grads = {i: torch.randn(rewritten.numels[i]) * (i + 1) for i in probed if i not in missed}
    if rewritten.host:
        assert len(probes) == 1
        probes[0].grad = host_records([grads.get(i) for i in probed], GROUPS)
    else:
        assert len(probes) == len(probed)
        for k, i in enumerate(probed):
            probes[k].grad = packed_record(grads[i], GROUPS) if i in grads else None
    kept = tuple(reversed(range(len(rewritten.names))))
    rows = packing.gradient_rows([p.grad for p in probes], kept)
    assert rows is not None and rows.shape == (len(kept), len(stats.FIELDS))
    for row, i in zip(rows, kept):
        if i in grads:
            want = traceable_record(grads[i], GROUPS) if not rewritten.host else host_record(grads[i], GROUPS)
            torch.testing.assert_close(row, want[: len(stats.FIELDS)], rtol=0, atol=0, equal_nan=True, msg=str(i))
        else:
            assert float(row.abs().sum()) == 0, i
    assert packing.gradient_rows([None for _ in probes], kept) is None  # (no gradient at all)
