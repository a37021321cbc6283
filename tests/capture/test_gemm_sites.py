"""GEMM sites in captured graphs feed the precision advisor: on the fx and the dynamo route, an
``nn.Linear``, a bare ``F.linear`` and ``x @ W`` on parameters, and ``addmm`` (GPT-2's ``Conv1D``)
give the what-if rows of their operands, forward and backward; layers are named as
``named_modules()`` names them; nothing is recorded without an attached ``GemmRecorder``."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.record.gemm_recorder import GemmRecorder, attach, attached
from lightning_scale.record.gemm_whatif import backward_rows, forward_rows
from lightning_scale.record.recorder import Recorder, recording
from lightning_scale.report.advice import LayerTable


class Conv1D(nn.Module):
    """GPT-2's ``Conv1D`` on 2-D inputs: ``addmm(bias, x, W)`` with ``W [K, N]``."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x: Tensor) -> Tensor:
        return torch.addmm(self.bias, x, self.weight)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.proj = nn.Parameter(torch.randn(48, 64) * 0.1)  # a bare F.linear's weight [N, K]
        self.mix = nn.Parameter(torch.randn(48, 32) * 0.1)  # x @ mix, [K, N]
        self.conv = Conv1D(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        h = F.linear(h, self.proj)
        return self.conv((h @ self.mix).reshape(-1, 32))


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
def test_each_gemm_on_a_parameter_gets_its_rows_on_both_routes(mode: str) -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 16, 32)  # (M = 32 tokens)
    table = LayerTable.of(net)
    assert table.names == ["conv", "fc", "mix", "proj"]  # a module's weight: the module; else the parameter
    assert table.linear == [False, True, False, False] and table.modules == ["Conv1D", "Linear", "Net", "Net"]
    rec, gemms = Recorder(), GemmRecorder(table.ids(net), len(table.names))
    attach(rec, gemms)
    assert attached(rec) is gemms
    with recording(rec):
        out = capture(net, mode).tracked()(x)
    out.square().sum().backward()
    assert gemms.error is None and gemms.sums is not None
    with torch.no_grad():  # each GEMM's input, eagerly
        h = F.gelu(net.fc(x)).reshape(-1, 64)
        p = F.linear(h, net.proj)
        m = p @ net.mix
    ins = {"fc": x.reshape(-1, 32), "proj": h, "mix": p, "conv": m}
    weights = {"fc": net.fc.weight, "proj": net.proj, "mix": net.mix.t(), "conv": net.conv.weight.t()}
    for name in table.names:
        i = table.names.index(name)
        w = weights[name].detach()
        torch.testing.assert_close(gemms.sums[i, 0], forward_rows(ins[name], w), rtol=1e-6, atol=1e-9)
        assert gemms.shapes[i][1:] == (w.shape[1], w.shape[0])
    assert (gemms.sums[:, 1:, :, 0] == 1).all()  # one input- and one weight-gradient GEMM each


def test_backward_rows_are_those_of_the_gradient_the_gemm_got() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(32, 64)
    x = torch.randn(4, 8, 32)
    table = LayerTable.of(nn.Sequential(lin))
    rec, gemms = Recorder(), GemmRecorder(table.ids(nn.Sequential(lin)), 1)
    attach(rec, gemms)
    model = nn.Sequential(lin)
    with recording(rec):
        out = capture(model, "fx").tracked()(x)
    g = torch.randn_like(out)
    out.backward(g)
    want = backward_rows(x.reshape(-1, 32), lin.weight.detach(), g.reshape(-1, 64))
    torch.testing.assert_close(gemms.sums[0, 1:], want, rtol=1e-6, atol=1e-9)


def test_nothing_is_recorded_without_an_attached_recorder_or_an_unknown_weight() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 4, 32)
    fn = capture(net, "fx").tracked()
    before = net(x)
    rec = Recorder()
    with recording(rec):
        torch.testing.assert_close(fn(x), before, rtol=0, atol=0)  # (observing changes nothing)
    gemms = GemmRecorder({}, 4)  # no weight known, nothing to refresh
    attach(rec, gemms)
    with recording(rec):
        fn(x)
    assert gemms.sums is None and gemms.error is None


def test_names_leave_out_compiled_wrappers_and_prefer_a_linear_for_a_tied_weight() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.body = torch.compile(nn.Sequential(nn.Linear(8, 8)))
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

    table = LayerTable.of(Tied())
    assert table.names == ["body.0", "head"] and table.linear == [True, True]
    assert table.bias == [True, False] and table.dims == [(8, 8), (8, 10)]


def test_a_weight_swapped_in_during_forward_is_found_by_a_refresh_once_per_parameter() -> None:
    """FSDP2 swaps each unit's unsharded weights in as its forward starts: every unit's weight is
    found; a parameter still unknown after its refresh asks no more that step."""
    first, second = nn.Linear(32, 32), nn.Linear(32, 32)
    stranger = nn.Parameter(torch.randn(32, 32))
    calls = []
    swapped_in: Dict[int, int] = {}

    def refresh() -> Dict[int, int]:
        calls.append(1)
        return dict(swapped_in)

    gemms = GemmRecorder({}, 2, refresh)
    x = torch.randn(8, 32)
    for row, lin in enumerate((first, second)):
        swapped_in[id(lin.weight)] = row  # (the unit's forward starts)
        gemms.observe(lin(x), x, lin.weight, "linear")
    gemms.observe(stranger @ x.T, x, stranger, "linear")
    gemms.observe(stranger @ x.T, x, stranger, "linear")  # (unknown: refreshed once, not again)
    assert len(calls) == 3 and gemms.sums is not None
    assert gemms.sums[:, 0, 0, 0].tolist() == [1, 1]


def test_gpt2s_conv1d_layers_are_seen_through_addmm_on_the_dynamo_route() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    table = LayerTable.of(model)
    convs = [f"transformer.h.0.{n}" for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert {n: (m, l) for n, m, l in zip(table.names, table.modules, table.linear) if n != "transformer.wpe"} == {
        "lm_head": ("Linear", True),  # (tied to the token embedding: named by its nn.Linear)
        **{n: ("Conv1D", False) for n in convs},
    }
    rec, gemms = Recorder(), GemmRecorder(table.ids(model), len(table.names))
    attach(rec, gemms)
    cap = capture(model, "auto")
    with recording(rec):
        out = cap.tracked()(torch.randint(128, (2, 32)))
    out.logits.square().mean().backward()
    assert cap.mode == "dynamo" and gemms.error is None and gemms.sums is not None
    seen = {table.names[i]: shape for i, shape in gemms.shapes.items()}
    assert seen == {
        "lm_head": ("linear", 64, 128),
        convs[0]: ("matmul", 64, 192),
        convs[1]: ("matmul", 64, 64),
        convs[2]: ("matmul", 64, 256),
        convs[3]: ("matmul", 256, 64),
    }
    assert (gemms.sums[[table.names.index(n) for n in seen], :, :, 0] == 1).all()  # every GEMM once
