"""ScaleTrackingInterpreter against the reference (unit-scaling's), and where it does better."""

from __future__ import annotations

import doctest
import math
import warnings
from typing import Any, Callable, Dict, List, Sequence

import einops
import pytest
import torch
import torch.nn.functional as F
import unit_scaling
import unit_scaling.functional
from torch import Tensor, fx, nn
from unit_scaling import utils as reference

from lightning_scale.capture import interpreter
from lightning_scale.capture import DeepTracer
from lightning_scale.capture.interpreter import ScalePair, ScaleTrackingInterpreter, instrument
from lightning_scale.tools.models import GPT, GPTConfig
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording


def trace_like_reference(module: nn.Module, **kwargs: Any) -> fx.GraphModule:
    """A deep trace with the reference's own tracer and autowrap modules."""
    kwargs.setdefault("autowrap_modules", (math, einops, unit_scaling.functional))
    tracer = reference._DeepTracer(**kwargs)
    return fx.GraphModule(module, tracer.trace(module))


def fresh(inputs: Sequence[Tensor]) -> List[Tensor]:
    return [t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in inputs]


def tracked_scales(
    cls: type, gm: fx.GraphModule, inputs: Sequence[Tensor], grad: Tensor, boxed: bool = False
) -> "Dict[str, ScalePair]":
    interp = cls(gm)
    args = fresh(inputs)
    out = interp.boxed_run(args) if boxed else interp.run(*args)
    out.backward(grad)
    return interp.scales


def assert_same_scales(ours: "Dict[str, ScalePair]", theirs: "Dict[str, ScalePair]", names: Sequence[str]) -> None:
    for name in names:
        for direction in ("forward", "backward"):
            a, b = getattr(ours[name], direction), getattr(theirs[name], direction)
            assert (a is None) == (b is None), (name, direction, a, b)
            if a is not None:
                assert a == pytest.approx(b, rel=1e-4, abs=1e-7), (name, direction)


def _models() -> Dict[str, Callable[[], Any]]:
    def plain():
        return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 12)), torch.randn(16, 12)

    return {
        "unit_scaling.MLP": lambda: (unit_scaling.MLP(16), torch.randn(32, 16)),
        "unit_scaling.MHSA": lambda: (unit_scaling.MHSA(16, 2, is_causal=True), torch.randn(4, 8, 16)),
        "unit_scaling.TransformerDecoder": lambda: (
            unit_scaling.TransformerDecoder(16, 50, 2, 2),
            torch.randint(50, (3, 8)),
        ),
        "torch.nn": plain,
    }


MODELS = _models()


@pytest.mark.parametrize("name", list(MODELS))
def test_run_matches_reference(name: str) -> None:
    torch.manual_seed(0)
    module, x = MODELS[name]()
    gm = trace_like_reference(module)
    grad = torch.randn_like(module(x))
    ours = tracked_scales(ScaleTrackingInterpreter, gm, [x], grad)
    theirs = tracked_scales(reference.ScaleTrackingInterpreter, gm, [x], grad)
    assert list(ours) == list(theirs)
    assert len(ours) > 5
    assert_same_scales(ours, theirs, list(theirs))
    assert any(p.backward is not None and p.backward > 0 for p in ours.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_boxed_run_records_placeholders_too(name: str) -> None:
    torch.manual_seed(1)
    module, x = MODELS[name]()
    gm = trace_like_reference(module)
    grad = torch.randn_like(module(x))
    ours = tracked_scales(ScaleTrackingInterpreter, gm, [x], grad, boxed=True)
    theirs = tracked_scales(reference.ScaleTrackingInterpreter, gm, [x], grad, boxed=True)
    float_inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"} if x.is_floating_point() else set()
    assert set(ours) - set(theirs) == float_inputs
    assert [k for k in ours if k in theirs] == list(theirs)  # same order otherwise
    assert_same_scales(ours, theirs, list(theirs))
    for placeholder in float_inputs:  # the input and its gradient, as a plain run gives them
        assert ours[placeholder].forward == pytest.approx(float(x.std()), rel=1e-6)
        assert ours[placeholder].backward is not None


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        out = self.fc2(self.act(self.fc1(x)))
        out += x  # fx records this as `add`; eager and dynamo run it in place
        return out.mul_(0.5)


def test_in_place_ops_work_where_the_reference_raises() -> None:
    torch.manual_seed(2)
    model = InPlace()
    gm = fx.GraphModule(model, DeepTracer().trace(model))
    x, grad = torch.randn(32, 8), torch.randn(32, 8)
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace"):
        tracked_scales(reference.ScaleTrackingInterpreter, gm, [x], grad)

    ours = tracked_scales(ScaleTrackingInterpreter, gm, [x], grad)
    # Out-of-place eager twin; each recorded value is the node's value before any later
    # in-place op, and its gradient is the gradient with respect to that value.
    xe = x.clone().requires_grad_()
    pre = F.linear(xe, model.fc1.weight, model.fc1.bias)
    act = F.relu(pre)
    lin = F.linear(act, model.fc2.weight, model.fc2.bias)
    add = lin + xe
    out = add * 0.5
    for t in (pre, act, lin, add, out):
        t.retain_grad()
    out.backward(grad)
    want = {"linear": pre, "relu": act, "linear_1": lin, "add": add, "mul_": out}
    assert [n for n in ours if n in want] == list(want)
    for name, t in want.items():
        assert ours[name].forward == pytest.approx(float(t.detach().std()), rel=1e-5), name
        assert ours[name].backward == pytest.approx(float(t.grad.std()), rel=1e-5), name
    assert ours["x"].backward == pytest.approx(float(xe.grad.std()), rel=1e-5)


def test_in_place_model_runs_like_eager() -> None:
    torch.manual_seed(3)
    model = InPlace()
    gm = fx.GraphModule(model, DeepTracer().trace(model))
    x, grad = torch.randn(32, 8), torch.randn(32, 8)
    (xi,) = fresh([x])
    out = ScaleTrackingInterpreter(gm).run(xi)
    out.backward(grad)
    tracked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (xe,) = fresh([x])
    eager = model(xe)
    eager.backward(grad)
    assert torch.equal(out, eager)
    assert torch.equal(xi.grad, xe.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(tracked_grads, model.parameters()))


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(self.fc(x), target)


def test_scalar_loss_node_has_std_zero_without_warning() -> None:
    torch.manual_seed(4)
    gm = fx.GraphModule(Regression(), DeepTracer().trace(Regression()))
    x, target = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        interp = ScaleTrackingInterpreter(gm)
        interp.run(x.clone().requires_grad_(), target).backward()
        scales = interp.scales
    assert scales["mse_loss"] == ScalePair(0.0, 0.0)
    assert scales["fc_bias"] == ScalePair(0.0, 0.0)  # one element too
    assert scales["target"].backward is None  # no gradient reaches it
    assert not any(math.isnan(v) for p in scales.values() for v in (p.forward, p.backward) if v is not None)
    # The reference reports NaN with a warning for the same nodes.
    with pytest.warns(UserWarning, match="degrees of freedom"):
        ref = reference.ScaleTrackingInterpreter(gm)
        ref.run(x.clone().requires_grad_(), target).backward()
    assert math.isnan(ref.scales["mse_loss"].forward)


def _double(t: Tensor) -> Tensor:
    return t * 2


def apply(fn: Callable[[Tensor], Tensor], t: Tensor) -> Tensor:
    return fn(t)


class PassesAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return apply(_double, self.fc(x)) + 1


@pytest.mark.parametrize("tracer", ["ours", "reference"])
@pytest.mark.parametrize("boxed", [False, True], ids=["run", "boxed_run"])
def test_function_placeholders_are_resolved(tracer: str, boxed: bool) -> None:
    torch.manual_seed(5)
    model = PassesAFunction()
    if tracer == "ours":
        gm = fx.GraphModule(model, DeepTracer(autowrap_functions=(apply,)).trace(model))
    else:
        gm = trace_like_reference(model, autowrap_functions=(apply,))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.target for n in placeholders] == ["x", "function_placeholder___double"]
    assert gm.graph._tracer_extras["target_to_function"]["function_placeholder___double"] is _double
    x, grad = torch.randn(5, 6), torch.randn(5, 6)
    interp = ScaleTrackingInterpreter(gm)
    (xi,) = fresh([x])
    out = interp.boxed_run([xi]) if boxed else interp.run(xi)
    assert torch.equal(out, model(x))
    out.backward(grad)
    scales = interp.scales
    assert "_double" not in scales and "function_placeholder___double" not in scales
    assert scales["apply"].forward == pytest.approx(2 * scales["linear"].forward, rel=1e-6)
    assert scales["linear"].backward == pytest.approx(2 * float(grad.std()), rel=1e-6)
    theirs = tracked_scales(reference.ScaleTrackingInterpreter, gm, [x], grad)
    assert_same_scales(scales, theirs, list(theirs))


def test_a_second_run_reports_that_run_only() -> None:
    torch.manual_seed(6)
    module, x = MODELS["torch.nn"]()
    gm = trace_like_reference(module)
    grad = torch.randn(16, 12)
    interp = ScaleTrackingInterpreter(gm)
    interp.run(*fresh([x])).backward(grad)
    interp.run(*fresh([10 * x])).backward(3 * grad)
    theirs = tracked_scales(reference.ScaleTrackingInterpreter, gm, [10 * x], 3 * grad)
    assert_same_scales(interp.scales, theirs, list(theirs))


def test_no_gradient_hooks_outlive_the_step() -> None:
    # Hooks on parameters fire for the gradient they were registered for, then go:
    # later training of the model neither costs statistics nor changes the records.
    torch.manual_seed(7)
    module, x = MODELS["torch.nn"]()
    interp = ScaleTrackingInterpreter(trace_like_reference(module))
    interp.run(*fresh([x])).sum().backward()
    before = interp.records().clone()
    for _ in range(2):
        module(torch.randn(16, 12)).sum().backward()
    torch.testing.assert_close(interp.records(), before, rtol=0, atol=0, equal_nan=True)


def test_recorder_counts_each_parameter_gradient_once_per_observation() -> None:
    # Two micro-batches, one backward each, recorded in one step (gradient accumulation).
    w = nn.Parameter(torch.randn(3, 4))
    rec = Recorder()
    grads = []
    for _ in range(2):
        rec.observe("w", w)
        x = torch.randn(5, 4)
        (x @ w.T).pow(2).sum().backward()
        grads.append(2 * (x @ w.detach().T).T @ x)  # d/dw sum((x w^T)^2)
    records = rec.records(["w"])
    assert records[0, FORWARD, 0] == 2 * w.numel()
    assert records[0, BACKWARD, 0] == 2 * w.numel()
    want = torch.cat([g.flatten() for g in grads]).double()
    assert float(records[0, BACKWARD, 1]) == pytest.approx(float(want.mean()), rel=1e-5)
    rec.clear()


def test_statistics_of_each_node() -> None:
    torch.manual_seed(8)
    x = torch.randn(64, 8)
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    interp = ScaleTrackingInterpreter(gm, groups=("moments", "range", "formats"))
    out = interp.run(x)
    got = interp.statistics
    relu = out.detach().double()
    fwd = got["_1"]["forward"]
    assert fwd["count"] == relu.numel()
    assert fwd["mean"] == pytest.approx(float(relu.mean()), rel=1e-6)
    assert fwd["std"] == pytest.approx(float(relu.std()), rel=1e-6)
    assert fwd["rms"] == pytest.approx(float(relu.square().mean().sqrt()), rel=1e-6)
    assert fwd["absmax"] == float(relu.abs().max())
    assert fwd["zeros"] == float((relu == 0).sum()) / relu.numel()
    assert "backward" not in got["_1"]  # no backward ran


def test_instrumented_code_records_what_the_interpreter_records() -> None:
    torch.manual_seed(9)
    model = GPT(GPTConfig(vocab=32, seq=8, layers=2, dim=16, heads=2))
    gm = fx.GraphModule(model, DeepTracer().trace(model))
    idx = torch.randint(32, (2, 8))
    grad = torch.randn(2, 8, 32)
    interp = ScaleTrackingInterpreter(gm, groups=("moments", "range", "formats"))
    interp.run(idx).backward(grad)
    want = interp.records()
    keys = [str(k) for k in interp.recorder.keys]

    run = instrument(gm, {n.name: n.name for n in gm.graph.nodes if n.op != "output"})
    rec = Recorder(groups=("moments", "range", "formats"))
    with recording(rec):
        out = run(idx)
    out.backward(grad)
    assert torch.equal(out, model(idx))
    got = rec.records(keys)
    rec.clear()
    # The interpreter also records the output node, the same tensor as the last node.
    assert keys[-1] == "output"
    torch.testing.assert_close(want[-1], want[-2], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[:-1], want[:-1], rtol=0, atol=0, equal_nan=True)
    assert run(idx).shape == (2, 8, 32)  # a plain run without an active recorder


def test_docstring_example_runs() -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(
        ScaleTrackingInterpreter,
        "ScaleTrackingInterpreter",
        globs={"torch": torch, "fx": fx, "ScaleTrackingInterpreter": ScaleTrackingInterpreter},
    ):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted > 0
    assert runner.summarize(verbose=False).failed == 0


def test_scale_pair_prints_like_the_reference() -> None:
    assert str(ScalePair(1.0, 0.123456)) == str(reference.ScalePair(1.0, 0.123456)) == "(-> 1.0, <- 0.123)"
    assert str(ScalePair(2.0, None)) == "(-> 2.0, <- n/a)"
    assert interpreter.__all__ == sorted(interpreter.__all__)
