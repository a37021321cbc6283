"""capture: deep fx traces with per-submodule fallback, dynamo capture, readable labels."""

from __future__ import annotations

import copy
import os
import re
from typing import Any, Callable, Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from lightning_scale.record import stats
from lightning_scale.capture import Capture, CaptureError, DeepTracer, capture
from lightning_scale.capture.coverage import CoverageReport, skipped_line
from lightning_scale.capture.interpreter import ScaleTrackingInterpreter
from lightning_scale.tools.models import GPT, GPTConfig
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny GPT-2 is built from a config
GROUPS = ("moments", "range", "formats")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    # Every test compiles its own models; don't let the caches of one reach the next.
    yield
    torch._dynamo.reset()


def tracked_step(
    cap: Capture, *args: Any, grad_of: Callable[[Any], Tensor] = lambda out: out.sum(), **kwargs: Any
) -> Tuple[Any, Tensor]:
    """One tracked forward and backward, as the callback runs it: (output, records)."""
    fn = cap.tracked()
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        out = fn(*args, **kwargs)
    grad_of(out).backward()
    records = rec.records(cap.node_labels, cap.aliases).cpu()
    rec.clear()
    return out, records


def std_of(records: Tensor, labels: List[str], label: str) -> Tuple[float, float]:
    fwd, bwd = stats.statistic(records[labels.index(label)], "std").tolist()
    return fwd, bwd


def assert_same_training_state(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    for (name, x), y in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(x, y), name


# ---------------------------------------------------------------------------------------
# fx: the deep tracer


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("offset", torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x)) + self.offset


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.head = nn.Sequential(nn.Linear(4, 8), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.inner(x))


def test_deep_tracer_recurses_into_every_submodule() -> None:
    model = Outer()
    assert any(n.op == "call_module" for n in fx.symbolic_trace(model).graph.nodes)  # plain fx stops
    gm = fx.GraphModule(model, DeepTracer().trace(model))
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch._C._nn.linear in calls and torch.tanh in calls and F.gelu in calls
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), model(x))
    assert capture(model, "fx").node_labels == [
        "x",
        "inner.fc.weight",
        "inner.fc.bias",
        "inner.fc/linear",
        "inner/tanh",
        "inner.offset",
        "inner/add",
        "head.0.weight",
        "head.0.bias",
        "head.0/linear",
        "head.1/gelu",
    ]
    # Module outputs follow their last node: aliases, never computed twice.
    assert capture(model, "fx").tags == [
        "x",
        "inner.fc.weight",
        "inner.fc.bias",
        "inner.fc/linear",
        "inner.fc",
        "inner/tanh",
        "inner.offset",
        "inner/add",
        "inner",
        "head.0.weight",
        "head.0.bias",
        "head.0/linear",
        "head.0",
        "head.1/gelu",
        "head",
        "head.1",
    ]


def test_graph_module_shares_parameters_and_buffers() -> None:
    model = Outer()
    cap = capture(model, "fx")
    gm = cap.graphs[0]
    for name, p in model.named_parameters():
        assert gm.get_parameter(name) is p
    assert gm.get_buffer("inner.offset") is model.inner.offset
    x = torch.randn(3, 4)
    with torch.no_grad():
        model.inner.fc.weight.mul_(3)  # an optimizer step, in place
    assert torch.equal(cap.tracked()(x), model(x))
    model.head[0].weight = nn.Parameter(torch.randn(8, 4))  # a swapped parameter object
    assert torch.equal(cap.tracked()(x), model(x))


class Mixed(nn.Module):
    """Modules fx cannot trace through, inside a model it can."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.proj = nn.Linear(8, 16)
        self.mha = nn.MultiheadAttention(16, 2, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn(self.conv(x)))  # (B, 8, H, W)
        h = self.proj(h.flatten(2).transpose(1, 2))  # (B, HW, 16)
        a, _ = self.mha(h, h, h)
        return self.head(self.drop(self.enc(h + a))).mean(1)


def test_untraceable_submodules_become_leaves() -> None:
    tracer = DeepTracer(leaf_modules=())  # no default leaves: the fallback must find them
    model = Mixed().eval()  # (fx bakes the training flag of traced ops into the graph)
    gm = fx.GraphModule(model, tracer.trace(model))
    assert list(tracer.fallbacks) == ["bn", "mha", "enc"]
    assert all("control flow" in why for why in tracer.fallbacks.values())
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert leaves == ["bn", "mha", "enc"]
    x = torch.randn(2, 3, 4, 4)  # the rolled-back trace still computes the model
    assert torch.equal(gm(x), model(x))


def test_capture_with_leaves_trains_bit_identically_to_eager() -> None:
    torch.manual_seed(0)
    model = Mixed().train()
    eager = copy.deepcopy(model)
    cap = capture(model, "auto")
    assert cap.mode == "fx" and cap.fallbacks == {}
    assert cap.leaves == ["bn", "mha", "enc"]
    assert {"bn/batchnorm2d", "mha/multiheadattention", "enc/transformerencoderlayer"} <= set(cap.node_labels)
    for step in range(2):
        x = torch.randn(2, 3, 4, 4)
        torch.manual_seed(10 + step)  # the same dropout masks for both
        out, records = tracked_step(cap, x)
        torch.manual_seed(10 + step)
        expected = eager(x)
        expected.sum().backward()
        assert torch.equal(out, expected)
        assert_same_training_state(model, eager)
    assert int(model.bn.num_batches_tracked) == 2 and not torch.equal(model.bn.running_mean, torch.zeros(8))
    labels = cap.node_labels
    assert std_of(records, labels, "head/linear")[0] > 0 and std_of(records, labels, "bn/batchnorm2d")[1] > 0


class Gate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.mean() > 0:  # control flow on a tensor: fx cannot trace this module
            return x * 2
        return x


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.gate(self.fc(x)))


def test_unexpected_fallbacks_make_auto_choose_dynamo() -> None:
    model = WithGate()
    fx_cap = capture(model, "fx")
    assert fx_cap.mode == "fx" and list(fx_cap.fallbacks) == ["gate"]
    assert "gate/gate" in fx_cap.node_labels
    x = torch.randn(5, 4)
    out, _ = tracked_step(fx_cap, x)
    assert torch.equal(out, model(x))
    auto = capture(model, "auto")
    assert auto.mode == "dynamo" and auto.reason == "auto: fx needed fallbacks for gate"
    assert "gate" in auto.describe()


def test_invalid_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"`mode` must be one of \['auto', 'fx', 'dynamo'\], got 'jit'"):
        capture(Outer(), "jit")


# ---------------------------------------------------------------------------------------
# dynamo


class Branchy(nn.Module):
    """Data-dependent control flow at the root: fx fails, dynamo breaks the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 3)
        with torch.no_grad():  # positive inputs take one branch, negative ones the other
            self.fc1.weight.abs_()
            self.fc1.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if h.sum() > 0:
            h = torch.relu(h)
        else:
            h = -h
        out = self.fc2(h)
        out += 1.0  # in place on a node's value
        return out * 2


def test_root_that_fx_cannot_trace_is_captured_by_dynamo() -> None:
    with pytest.raises(CaptureError, match="torch.fx could not trace Branchy: TraceError: .*control flow"):
        capture(Branchy(), "fx")
    cap = capture(Branchy(), "auto")
    assert cap.mode == "dynamo"
    assert cap.reason.startswith("auto: fx failed (TraceError: ") and "control flow" in cap.reason


def test_dynamo_records_across_graph_breaks_and_matches_eager() -> None:
    torch.manual_seed(1)
    model = Branchy()
    eager = copy.deepcopy(model)
    cap = capture(model, "dynamo")
    x = torch.rand(5, 6)  # positive: the relu branch
    out, records = tracked_step(cap, x)

    xe = x.clone()
    h = eager.fc1(xe)
    r = torch.relu(h)
    o = eager.fc2(r)
    o2 = o + 1.0
    y = o2 * 2
    for t in (h, r, o, y):
        t.retain_grad()
    y.sum().backward()
    assert torch.equal(out, y)
    assert_same_training_state(model, eager)

    assert len(cap.graphs) >= 2  # a graph break at the `if`
    assert "fc1/linear" in cap.labels[0].values() and "fc2/linear" in cap.labels[-1].values()
    labels = cap.node_labels
    for label, t in {"fc1/linear": h, "relu": r, "fc2/linear": o, "mul": y}.items():
        fwd, bwd = std_of(records, labels, label)
        assert fwd == pytest.approx(float(t.detach().std()), rel=1e-5), label  # float32 reference
        assert bwd == pytest.approx(float(t.grad.std()), rel=1e-6, abs=1e-12), label
    fwd, bwd = std_of(records, labels, "fc1.weight")
    assert fwd == pytest.approx(float(model.fc1.weight.detach().std()), rel=1e-6)
    assert bwd == pytest.approx(float(model.fc1.weight.grad.std()), rel=1e-6)

    # The other branch compiles a new graph; earlier labels keep their names.
    before = list(labels)
    x = -torch.rand(5, 6)
    out, records = tracked_step(cap, x)
    assert torch.equal(out, eager(x))
    assert cap.node_labels[: len(before)] == before and "neg" in cap.node_labels[len(before) :]
    neg = -eager.fc1(x)
    assert std_of(records, cap.node_labels, "neg")[0] == pytest.approx(float(neg.detach().std()), rel=1e-6)
    assert float(records[cap.node_labels.index("relu"), FORWARD, 0]) == 0  # not taken this step


def test_dynamo_labels_are_stable_across_captures_and_steps() -> None:
    model = Branchy()
    runs = []
    for _ in range(2):
        cap = capture(model, "dynamo")
        keys = []
        for _ in range(2):
            fn = cap.tracked()
            rec = Recorder()
            with recording(rec):
                fn(torch.rand(4, 6)).sum().backward()
            keys.append(rec.keys)
            rec.clear()
        assert keys[0] == keys[1]
        runs.append(cap.node_labels)
        torch._dynamo.reset()
    assert runs[0] == runs[1] and len(set(runs[0])) == len(runs[0])


def test_tiny_hugging_face_gpt2_is_captured_with_readable_labels() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(2)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).train()
    eager = copy.deepcopy(model)
    cap = capture(model, "auto")
    assert cap.mode == "dynamo" and cap.reason.startswith("auto: fx failed")
    ids = torch.randint(100, (2, 8))
    labels_per_step = []
    for step in range(2):
        model.zero_grad()
        eager.zero_grad()
        torch.manual_seed(20 + step)  # the same dropout masks for both
        out, records = tracked_step(cap, input_ids=ids, labels=ids, grad_of=lambda o: o.loss)
        torch.manual_seed(20 + step)
        expected = eager(input_ids=ids, labels=ids)
        expected.loss.backward()
        assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)
        assert_same_training_state(model, eager)
        labels_per_step.append(cap.node_labels)
    labels = labels_per_step[0]
    assert labels_per_step[1] == labels and len(set(labels)) == len(labels)
    for path in ("transformer.h.0.attn", "transformer.h.1.mlp", "transformer.ln_f"):
        assert any(label.startswith((path + "/", path + ".")) and "/" in label for label in labels), path
    assert "transformer.h.0.attn.c_attn.weight" in labels
    assert any(label.endswith("/scaled_dot_product_attention") for label in labels)
    # The tied embedding: its gradient sums the embedding's and the head's.
    wte = model.transformer.wte.weight
    fwd, bwd = std_of(records, labels, "transformer.wte.weight")
    assert fwd == pytest.approx(float(wte.detach().std()), rel=1e-6)
    assert bwd == pytest.approx(float(wte.grad.std()), rel=1e-6)


# ---------------------------------------------------------------------------------------
# Labels of the example GPT


def small_gpt() -> GPT:
    return GPT(GPTConfig(vocab=32, seq=8, layers=2, dim=16, heads=2))


def test_gpt_labels_are_readable_unique_and_stable() -> None:
    torch.manual_seed(3)
    model = small_gpt()
    cap = capture(model, "auto")
    assert cap.mode == "fx"
    labels = cap.node_labels
    assert len(set(labels)) == len(labels)
    for label in (
        "idx",
        "tok.weight",
        "blocks.0.mlp.fc1/linear",
        "blocks.0.mlp.fc1.weight",
        "blocks.1.attn/scaled_dot_product_attention",
        "blocks.1.ln2/layer_norm",
        "head/linear",
    ):
        assert label in labels, label
    assert capture(model, "fx").node_labels == labels
    assert capture(small_gpt(), "fx").node_labels == labels  # another instance, same shape
    idx = torch.randint(32, (2, 8))
    keys = []
    for _ in range(2):
        rec = Recorder()
        with recording(rec):
            cap.tracked()(idx).sum().backward()
        keys.append(rec.keys)
        rec.clear()
    assert keys[0] == keys[1]
    assert set(keys[0]) <= set(labels) - set(cap.aliases)  # aliases are never computed
    assert "blocks.0.mlp.fc1/linear" in keys[0] and "idx" not in keys[0]  # floats only


def test_capture_records_equal_the_interpreter_on_every_node() -> None:
    # Aliased views are filled from their source; every label must still hold the
    # statistics of its own node, forward and backward.
    torch.manual_seed(4)
    model = small_gpt()
    cap = capture(model, "fx")
    assert cap.aliases, "the GPT's head reshapes should be aliased"
    idx = torch.randint(32, (2, 8))
    grad = torch.randn(2, 8, 32)
    _, records = tracked_step(cap, idx, grad_of=lambda out: (out * grad).sum())
    interp = ScaleTrackingInterpreter(cap.graphs[0], groups=GROUPS)
    interp.run(idx).backward(grad)
    by_name = dict(zip(interp.recorder.keys, interp.records()))
    names = {label: name for name, label in cap.labels[0].items()}
    labels = cap.node_labels
    for i, label in enumerate(labels):
        want = by_name.get(names[label])
        if want is None:  # integer nodes: never recorded
            assert records[i, FORWARD, 0] == 0, label
            continue
        for d in (FORWARD, BACKWARD):
            got_std, want_std = stats.statistic(records[i, d], "std"), stats.statistic(want[d], "std")
            assert records[i, d, 0] == want[d, 0], (label, d)
            assert float(got_std) == pytest.approx(float(want_std), rel=1e-6, abs=1e-12), (label, d)
            assert float(stats.statistic(records[i, d], "absmax")) == pytest.approx(
                float(stats.statistic(want[d], "absmax")), rel=0, nan_ok=True
            ), (label, d)


def test_dynamo_tracks_every_input_shape_under_one_set_of_labels() -> None:
    # More distinct batch sizes than dynamo's recompile limit (8): a dynamic-shape graph
    # takes over after the first recompile, and it keeps the labels of the static one.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    cap = capture(model, "dynamo")
    first: List[str] = []
    for batch in range(1, 13):
        x = torch.randn(batch, 4)
        rec = Recorder()
        with recording(rec):
            out = cap.tracked()(x)
        out.sum().backward()
        records = rec.records(cap.node_labels, cap.aliases)
        rec.clear()
        first = first or list(cap.node_labels)
        assert cap.node_labels == first and {"0/linear", "1/relu", "2/linear"} <= set(first)
        assert {"0", "1", "2"} <= set(cap.tags)  # module outputs
        hidden = model[0](x).detach().double()
        got = float(stats.statistic(records, "std")[cap.node_labels.index("0/linear"), FORWARD])
        assert got == pytest.approx(float(hidden.std()), rel=1e-5)
    assert len(cap.graphs) == 1


# ---------------------------------------------------------------------------------------
# labels per module instance, coverage, readable failures


class BreakingBlock(nn.Module):
    """Each instance is compiled as its own frame: a graph break inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        torch._dynamo.graph_break()
        return torch.tanh(y)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BreakingBlock() for _ in range(2))
        self.scale = 2.0  # a cached attribute dynamo guards on

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x) * self.scale
        return x


def test_separately_compiled_blocks_keep_full_unique_labels() -> None:
    torch.manual_seed(0)
    model = Blocks()
    eager = copy.deepcopy(model)
    cap = capture(model, "dynamo")
    x = torch.randn(4, 8)
    out, records = tracked_step(cap, x)
    labels = cap.node_labels
    assert len(set(labels)) == len(labels)
    h0 = eager.blocks[0].fc(x)
    h1 = eager.blocks[1].fc(torch.tanh(h0) * 2.0)
    for i, h in enumerate((h0, h1)):
        count = records[labels.index(f"blocks.{i}.fc/linear"), FORWARD, 0]  # (tags: module outputs too)
        assert int(count) == h.numel()  # not two blocks merged into one record
        assert std_of(records, labels, f"blocks.{i}.fc/linear")[0] == pytest.approx(
            float(h.detach().double().std()), rel=1e-6
        )
        assert int(records[labels.index(f"blocks.{i}.fc.weight"), FORWARD, 0]) == 64
    # A changed cached attribute recompiles: every tensor keeps its tag.
    model.scale = 3.0
    tracked_step(cap, x)
    assert cap.node_labels[: len(labels)] == labels
    assert not any(label.endswith("weight_1") for label in cap.node_labels)


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.big = nn.Linear(4, 64)

    @torch._dynamo.disable  # runs outside every captured graph, and is no module call of `big`
    def hidden(self, x: Tensor) -> Tensor:
        return nn.functional.linear(x, self.big.weight, self.big.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.hidden(self.fc(x)).sum(-1)


def test_low_coverage_is_reported_with_the_largest_unrecorded_module() -> None:
    cap = capture(Hidden(), "dynamo")
    _, records = tracked_step(cap, torch.randn(3, 4))
    recorded = [l for l, row in zip(cap.node_labels, records) if bool((row[:, 0] > 0).any())]
    report = cap.coverage(recorded)
    assert report.elements == 20 + 320 and report.covered_elements == 20
    assert report.parameter_fraction == pytest.approx(20 / 340)
    # floored, never rounded up; the miss counted in elements
    assert (
        "coverage: 5% of parameter elements (320 of 340 unrecorded), 50% of module calls (1/2) recorded"
        == report.line()
    )
    warning = report.warning()
    assert warning is not None and "coverage" in warning and "`big` (320 parameter elements" in warning
    calls_only = cap.coverage(recorded + ["big/linear"])  # the call, but not its weights
    assert calls_only.module_fraction == 1.0 and "`big` (320 parameter elements: its parameters have no records" in str(
        calls_only.warning()
    )
    assert cap.coverage(recorded + ["big/linear", "big.weight", "big.bias"]).warning() is None


def test_fx_failure_names_what_where_and_the_source_line() -> None:
    from lightning.pytorch.demos import Transformer

    with pytest.raises(
        CaptureError, match=r"TypeError: ones\(\) takes .* at .*demos/transformer.py:\d+ \(mask = torch.triu"
    ):
        capture(Transformer(vocab_size=10, ninp=8, nhead=2, nhid=8, nlayers=1), "fx")


# ---------------------------------------------------------------------------------------
# Recurrent layers, Identity, random draws while tracing


class Recurrent(nn.Module):
    def __init__(self, cell: type = nn.LSTM) -> None:
        super().__init__()
        self.rnn = cell(4, 6, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_an_rnn_is_recorded_under_its_path_and_trains_as_eager(mode: str, cell: type) -> None:
    """fx keeps it a leaf (its forward writes `_flat_weights`); dynamo, which refuses RNN
    frames by default, runs the RNN call eagerly and records it at its output."""
    torch.manual_seed(0)
    model = Recurrent(cell)
    reference = copy.deepcopy(model)
    cap = capture(model, mode)
    x = torch.randn(3, 5, 4)
    out, records = tracked_step(cap, x)
    reference(x).sum().backward()
    assert torch.equal(out, reference(x))
    assert_same_training_state(model, reference)
    labels = cap.tags
    assert "rnn" in labels and "head" in labels
    if mode == "fx":
        # the items of its (output, state) tuple are named after it: rnn/lstm[0], rnn/lstm[1]
        item = f"rnn/{cell.__name__.lower()}[0]"
        assert cap.leaves == ["rnn"] and item in labels and not any("getitem" in t for t in labels)
        assert cap.aliases["rnn"] == item
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        cap.tracked()(x).sum().backward()
    std = stats.statistic(rec.records(cap.tags, cap.aliases), "std")
    expected = reference.rnn(x)[0].detach()
    assert float(std[labels.index("rnn"), FORWARD]) == pytest.approx(float(expected.double().std()), rel=1e-6)
    recorded = [t for t, row in zip(cap.tags, rec.records(cap.tags, cap.aliases)) if bool((row[:, 0] > 0).any())]
    assert cap.coverage(recorded).line() == "coverage: 100% of parameter elements, 100% of module calls (2/2) recorded"


class DropPathBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop_path = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop_path(self.fc(x))


def test_identity_output_is_an_alias_of_its_input_under_its_path() -> None:
    cap = capture(nn.Sequential(DropPathBlock(), DropPathBlock()), "fx")
    assert cap.aliases["0.drop_path"] == "0.fc/linear" and cap.aliases["1.drop_path"] == "1.fc/linear"
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        cap.tracked()(torch.randn(8, 4)).sum().backward()
    rows = rec.records(cap.tags, cap.aliases)
    # the same tensor, forward and backward: the same record
    assert torch.allclose(
        rows[cap.tags.index("0.drop_path")], rows[cap.tags.index("0.fc/linear")], rtol=0, atol=0, equal_nan=True
    )
    recorded = [t for t, row in zip(cap.tags, rows) if bool((row[:, 0] > 0).any())]
    report = cap.coverage(recorded)
    assert (report.covered_modules, report.modules) == (6, 6)


def test_an_unrecorded_identity_is_not_a_miss_and_a_small_miss_is_not_100_percent() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.Identity(), nn.LayerNorm(100))
    report = capture(model, "fx").coverage(["0.weight", "0.bias", "0/linear", "0", "2/layer_norm", "2"])
    # LayerNorm's 200 of 10,300 parameter elements have no records: 98%, never rounded up
    assert (
        report.line()
        == "coverage: 98% of parameter elements (200 of 10,300 unrecorded), 100% of module calls (2/2) recorded"
    )
    tiny = capture(nn.Sequential(nn.Linear(1000, 28), nn.LayerNorm(28)), "fx").coverage(
        ["0.weight", "0.bias", "0", "1"]
    )
    assert tiny.line().startswith("coverage: 99.8% of parameter elements (56 of 28,084 unrecorded)")


class Compiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)), backend="eager")

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)


def test_coverage_counts_what_the_compiled_route_sees_inside_a_compiled_submodule() -> None:
    # (a compiled submodule used to be opaque, recorded at its output only: the compiled
    # route records inside it; its compiled code runs instrumented, compiled by its backend)
    cap = capture(Compiled(), "dynamo")
    rec = Recorder(groups=GROUPS)
    with recording(rec):
        cap.tracked()(torch.randn(2, 4)).sum().backward()
    rows = rec.records(cap.tags, cap.aliases)
    recorded = [t for t, row in zip(cap.tags, rows) if bool((row[:, 0] > 0).any())]
    assert recorded[0] == "body" and {"body.0/linear", "body.1/gelu", "body.2/linear", "body.0.weight"} <= set(recorded)
    assert (
        cap.coverage(recorded)
        .line()
        .startswith(
            "coverage: 100% of parameter elements, 100% of module calls (4/4) recorded; compiled modules: body "
            "(tracked version compiled in "
        )
    )


class DrawsWhileTracing(nn.Module):
    def __init__(self, source: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.source = source

    def forward(self, x: Tensor) -> Tensor:
        if self.source == "numpy":
            import numpy as np

            noise = torch.from_numpy(np.random.random_sample(4)).float()
        elif self.source == "random":
            import random

            noise = torch.full((4,), random.random())
        else:
            noise = torch.rand(4)
        return self.fc(x + noise)


@pytest.mark.parametrize(
    ("source", "generator"),
    [("numpy", "numpy's generator"), ("random", "Python's `random`"), ("torch", "torch's CPU generator")],
)
def test_fx_refuses_a_trace_that_draws_random_numbers(source: str, generator: str) -> None:
    """A draw on concrete values runs once while tracing: the graph would repeat it forever."""
    import random

    import numpy as np

    model = DrawsWhileTracing(source)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    with pytest.raises(CaptureError, match=f"forward draws from {re.escape(generator)} outside the traced ops"):
        capture(model, "fx")
    assert (
        torch.equal(before[0], torch.get_rng_state())
        and (before[1] == np.random.get_state()[1]).all()
        and before[2] == random.getstate()
    )
    assert capture(model, "auto").mode == "dynamo"


def test_skipped_tensors_are_counted_and_named_by_reason() -> None:
    names = {f"emb{i}.weight grad": "sparse_coo layout" for i in range(6)}
    names["mask"] = "sparse_csr layout"
    assert skipped_line(names) == (
        "7 nodes skipped: sparse_coo layout (emb0.weight grad, emb1.weight grad, emb2.weight grad, "
        "emb3.weight grad, emb4.weight grad, ...); sparse_csr layout (mask)"
    )
    report = CoverageReport(10, 10, 2, 2, skipped={"mask": "sparse_coo layout"})
    assert report.line().endswith("(2/2) recorded; 1 node skipped: sparse_coo layout (mask)")
    assert report.warning() is None  # full coverage: the skip is named by its own warning
