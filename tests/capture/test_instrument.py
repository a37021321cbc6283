"""The compiled route's graph rewrite: statistics after each recorded node, probes on those
with a gradient; with the host op, a graph's parameters recorded by one call and probed by
one ``ProbeInputs`` (their gradients' records come back together, empty where backward did
not reach one), and one probe tensor for the whole graph (a slice per node)."""

from __future__ import annotations

import operator
from typing import Any, List, Tuple

import pytest
import torch
from torch import Tensor, fx, nn

from lightning_scale.capture.instrument import instrument_graph, probe_inputs
from lightning_scale.record import stats
from lightning_scale.record.stats.host_op import ENV, host_record, host_records, record_size

GROUPS = ("moments", "range")
IX = {name: i for i, name in enumerate(stats.FIELDS)}


def same(a: Tensor, b: Tensor) -> bool:
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


def dynamo_graph(module: nn.Module, x: Tensor) -> Tuple[fx.GraphModule, List[Any]]:
    got: List[Tuple[fx.GraphModule, List[Any]]] = []

    def keep(gm: fx.GraphModule, inputs: List[Any]) -> Any:
        got.append((gm, inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=keep, fullgraph=True)(x)
    torch._dynamo.reset()
    return got[0]


def test_probe_inputs_returns_its_inputs_and_their_gradients_records() -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(4, 3, requires_grad=True), torch.randn(7, requires_grad=True)
    probe = torch.zeros(2 * record_size(GROUPS), dtype=torch.float64, requires_grad=True)
    a, b = probe_inputs(probe, GROUPS, w1, w2)
    assert torch.equal(a, w1) and torch.equal(b, w2)
    (a * torch.arange(12.0).reshape(4, 3)).sum().backward()  # (b unused: no gradient)
    assert torch.equal(w1.grad, torch.arange(12.0).reshape(4, 3)) and w2.grad is None
    width = record_size(GROUPS)
    assert same(probe.grad[:width], host_record(w1.grad, GROUPS))
    assert float(probe.grad[width:].abs().sum()) == 0  # not reached: an empty record (count 0)
    assert float(probe.grad[IX["count"]]) == 12


def test_host_records_is_each_tensors_record_in_one_call() -> None:
    xs = [torch.randn(30), None, torch.randn(5, 9) + 100, torch.ones(3)]
    got = host_records(xs, GROUPS)
    width = record_size(GROUPS)
    for i, x in enumerate(xs):
        part = got[i * width : (i + 1) * width]
        assert same(part, host_record(x, GROUPS)) if x is not None else float(part.abs().sum()) == 0


@pytest.mark.parametrize("ops", ["auto", "ops"])
def test_with_the_host_op_parameters_are_recorded_together_and_a_graph_has_one_probe(
    ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, ops)
    gm, inputs = dynamo_graph(TwoLayers(), torch.randn(2, 6))
    params = [n.name for n in gm.graph.nodes if n.op == "placeholder" and "parameters" in n.name]
    computed = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    names = computed + params  # (asked in another order: parameters' rows come first)
    rewritten = instrument_graph(gm, names, inputs, GROUPS)
    assert rewritten is not None
    targets = [n.target for n in rewritten.gm.graph.nodes if n.op == "call_function"]
    calls = sum(1 for t in targets if getattr(t, "__name__", "") == "host_records")
    together = sum(1 for t in targets if getattr(t, "__name__", "") == "probe_inputs")
    probes = [n for n in rewritten.gm.graph.nodes if n.op == "placeholder" and n.name.startswith("statistics_probe")]
    if ops == "auto":
        assert rewritten.host and calls == 1 and together == 1
        assert rewritten.names[:4] == [n for n in rewritten.names if n in params] and set(rewritten.names[:4]) == set(
            params
        )
        assert rewritten.probed == [list(range(len(rewritten.names)))]  # (one probe for every node)
        assert len(probes) == 1
    else:  # (the traceable ops: one probe per node)
        assert not rewritten.host and calls == 0 and together == 0
        assert len(probes) == len(params) + len(computed)


class Residuals(nn.Module):
    """Adds whose input takes the add's gradient unchanged (the input used there alone, of
    the add's shape), and inputs that do not (a second use, ``a + a``)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.zero, self.live = nn.Dropout(0.0), nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        a = x + self.f(x)  # f's output: used by the add alone -> a's gradient (x: also used by f)
        b = a + self.zero(self.g(a))  # g's output, through a dropout that does nothing -> b's
        h = self.h(b)
        c = b + h * 2  # h * 2 -> c's gradient (h: used twice)
        d = c + c  # (c twice: twice the gradient)
        e = d + self.live(h)  # d and the live dropout's output -> e's, and so the last add's
        return e + torch.ones(8)  # e -> the last add's (the constant broadcasts: no node)


def test_an_add_hands_its_gradient_to_an_input_used_there_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "auto")
    gm, inputs = dynamo_graph(Residuals().train(), torch.randn(4, 8))
    zero = next(n for n in gm.graph.nodes if n.op == "call_function" and n.args[1:2] == (0.0,))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function" and n is not zero]  # (a copy of g's)
    rewritten = instrument_graph(gm, names, inputs, GROUPS)
    assert rewritten is not None
    row = {n: i for i, n in enumerate(rewritten.names)}
    by_name = {n.name: n for n in gm.graph.nodes}
    linears = [n for n in names if by_name[n].target is torch._C._nn.linear]
    adds = [n for n in names if by_name[n].target is operator.add]
    muls = [n for n in names if by_name[n].target is operator.mul]
    live = [n for n in names if n not in linears + adds + muls]
    f_out, g_out, h_out = linears
    a, b, c, d, e, last = adds
    got = {rewritten.names[k]: rewritten.names[v] for k, v in rewritten.gradient_of.items()}
    assert got == {f_out: a, g_out: b, muls[0]: c, d: last, e: last, live[0]: last}
    probed = {i for p in rewritten.probed for i in p}
    assert not any(row[k] in probed for k in got)  # (no probe of their own)
    assert {row[n] for n in (a, b, c, h_out, last)} <= probed


class Offset(nn.Module):
    """A parameter of the activation's shape, used by one add alone."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.offset = nn.Parameter(torch.zeros(4, 8))

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.lin(x) + self.offset)


def test_a_parameter_an_add_alone_uses_takes_the_adds_gradient_not_a_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph inputs follow the add rule as other nodes do: the parameter's gradient is the
    add's, so it is not passed through ``ProbeInputs`` (recorded forward with the others)."""
    monkeypatch.setenv(ENV, "auto")
    gm, inputs = dynamo_graph(Offset(), torch.randn(4, 8))
    names = [n.name for n in gm.graph.nodes if n.op in ("placeholder", "call_function") and n.name != "l_x_"]
    rewritten = instrument_graph(gm, names, inputs, GROUPS)
    assert rewritten is not None and rewritten.host
    row = {n: i for i, n in enumerate(rewritten.names)}
    offset = next(n for n in rewritten.names if "offset" in n)
    add = next(n for n in rewritten.names if n.startswith("add"))
    linear = next(n for n in rewritten.names if n.startswith("linear"))
    assert rewritten.gradient_of == {row[offset]: row[add], row[linear]: row[add]}
    assert row[offset] not in rewritten.probed[0] and row[offset] < 3  # (a graph input: its row among the first)
    through = [n for n in rewritten.gm.graph.nodes if getattr(n.target, "__name__", "") == "probe_inputs"]
    assert len(through) == 1 and not any("offset" in str(a) for a in through[0].args)


class InPlace(nn.Module):
    """A linear's output changed in place by a later op, as Falcon's ``mlp_output += attention_output``."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.f(x)
        y += self.g(x)
        return y.relu()


@pytest.mark.parametrize("ops", ["auto", "ops"])
def test_a_node_changed_in_place_later_has_no_probe(ops: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Probe``'s output is a view of its node; autograd refuses to change it in place
    ("Output 0 of Probe is a view and is being modified inplace"): the node changed in place
    is recorded forward only, and the graph runs forward and backward as the user's does."""
    monkeypatch.setenv(ENV, ops)
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(4, 8)
    gm, inputs = dynamo_graph(model, x)
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    rewritten = instrument_graph(gm, names, inputs, GROUPS)
    assert rewritten is not None
    f_out = next(n.name for n in gm.graph.nodes if any(u.target is operator.iadd and u.args[0] is n for u in n.users))
    probed = {rewritten.names[i] for p in rewritten.probed for i in p}
    assert f_out in rewritten.names and f_out not in probed and len(probed) >= 2
    width = record_size(GROUPS) if rewritten.host else None
    sizes = [len(p) * width if width else len(p) for p in rewritten.probed]
    if width:
        probes = [torch.zeros(sum(sizes), dtype=torch.float64, requires_grad=True)]
    else:
        from lightning_scale.record.stats.traceable import packed_size

        probes = [
            torch.zeros(packed_size(rewritten.numels[p[0]], GROUPS), dtype=torch.float64, requires_grad=True)
            for p in rewritten.probed
        ]
    params = [inputs[i] for i in range(len(inputs)) if isinstance(inputs[i], Tensor) and inputs[i].requires_grad]
    out = rewritten.gm(*inputs, *probes)
    want = model(x)
    assert torch.equal(out[0], want)
    (g,) = torch.autograd.grad(out[0].sum(), [params[0]])
    (h,) = torch.autograd.grad(want.sum(), [params[0]])
    assert torch.equal(g, h)
