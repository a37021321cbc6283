"""Layers converted by torchao's training recipes keep the labels of the model they came from.

``convert_to_float8_training`` (``Float8Linear``, emulated on the CPU) is captured by dynamo
(fx falls back in every converted layer): each layer's output is tagged under its path as
the high-precision model's is, so the two runs are laid side by side by label; the casts
inside it are nodes of their own, whose records equal a float64 emulation of the float8 cast
written from the format alone (tensor-wise scale ``max / amax``, saturated; to float32
rounding: torchao divides back in its own order); training is bit
for bit the same with and without tracking; the capture line names each fallback reason
once and counts the converted layers. The MXFP8-wrapped model (``quantize_`` with
``MXFP8TrainingOpConfig``) is traced by fx and keeps its tags too.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    float8 = pytest.importorskip("torchao.float8")
VOCAB, D, LAYERS = 64, 32, ["fc1", "fc2", "fc3"]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1, self.fc2, self.fc3 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.fc3(self.fc2(torch.relu(self.fc1(self.emb(ids)))))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def float8_model(model: nn.Module) -> nn.Module:
    config = dataclasses.replace(float8.Float8LinearConfig(), emulate=True)
    return float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in LAYERS)


def mxfp8_model(model: nn.Module) -> nn.Module:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.quantization import quantize_

    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    quantize_(model, config, filter_fn=lambda m, fqn: fqn in LAYERS)
    return model


def ids(seed: int = 1) -> Tensor:
    return torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(seed))


def plain() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


@pytest.mark.parametrize("convert, route", [(float8_model, "dynamo"), (mxfp8_model, "fx")], ids=["float8", "mxfp8"])
def test_converted_layers_are_tagged_as_the_high_precision_models(
    convert: Callable[..., nn.Module], route: str
) -> None:
    reference = capture(plain(), "auto")
    cap = capture(convert(plain()), "auto")
    with recording(Recorder()):  # (dynamo captures on the first tracked call)
        cap.tracked()(ids()).backward()
    assert cap.mode == route
    assert reference.module_outputs == cap.module_outputs == {"emb", "head", *LAYERS}
    assert not [t for t in cap.tags if "trampoline" in t]


def _saturated_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The tensor-wise float8 cast from the format alone: scale ``max / amax``, values
    clamped to the format's range, rounded to it, and divided back (float32, as torchao
    computes; returned in float64)."""
    top = torch.finfo(dtype).max
    scale = top / x.abs().amax().double().clamp(min=1e-12).float()
    bits = (x.float() * scale).clamp(-top, top).to(dtype)
    return (bits.float() / scale).double()


def _hooked(model: nn.Module, batch: Tensor) -> Dict[str, Tuple[Tensor, Tensor]]:
    """(input, output gradient) of each converted layer, from hooks on an eager run."""
    seen: Dict[str, Tuple[Tensor, Tensor]] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, args: Tuple[Tensor, ...], out: Tensor) -> None:
            out.register_hook(lambda g: seen.__setitem__(name, (args[0].detach(), g.detach())))

        return hook

    handles = [getattr(model, n).register_forward_hook(keep(n)) for n in LAYERS]
    model(batch).backward()
    for h in handles:
        h.remove()
    return seen


def test_the_casts_are_nodes_with_the_float8_values() -> None:
    model = float8_model(plain())
    twin = copy.deepcopy(model)
    cap = capture(model, "auto")
    rec = Recorder()
    with recording(rec):
        cap.tracked()(ids()).backward()
    assert rec.error is None, rec.error
    records = rec.records(cap.tags, cap.aliases)
    std, absmax, count = (stats.statistic(records, s) for s in ("std", "absmax", "count"))
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for name, (x, grad) in _hooked(twin, ids()).items():
        weight = getattr(twin, name).weight.detach()
        expected = {
            (f"{name}/cast_input", FORWARD): (_saturated_cast(x, e4m3), x),
            (f"{name}/cast_weight", FORWARD): (_saturated_cast(weight, e4m3), weight),
            (f"{name}/cast_grad_output", BACKWARD): (_saturated_cast(grad, e5m2), grad),
        }
        for (label, d), (value, unrounded) in expected.items():
            i = cap.tags.index(label)
            assert float(absmax[i, d]) == pytest.approx(float(value.abs().max()), rel=1e-6), label
            assert float(std[i, d]) == pytest.approx(float(value.std()), rel=1e-6), label
            assert float(std[i, d]) != pytest.approx(float(unrounded.double().std()), rel=1e-5), label  # (the cast's)
            assert int(count[i, d]) == value.numel() and int(count[i, 1 - d]) == 0, label  # (one direction)


def test_tracking_a_converted_model_trains_it_bit_for_bit_as_without() -> None:
    model = float8_model(plain())
    twin = copy.deepcopy(model)
    cap = capture(model, "auto")
    with recording(Recorder()):
        cap.tracked()(ids()).backward()
    twin(ids()).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_the_capture_line_names_each_fallback_reason_once_and_counts_the_converted_layers() -> None:
    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])

        def forward(self, x: Tensor) -> Tensor:
            return self.layers(x).square().mean()

    config = dataclasses.replace(float8.Float8LinearConfig(), emulate=True)
    cap = capture(float8.convert_to_float8_training(Deep(), config=config), "auto")
    line = cap.describe()
    assert line.count("RuntimeError") == 1, line
    assert "fx fallbacks: 6 modules: layers.0, layers.1, layers.2 and 3 more (RuntimeError: call_function abs" in line
    assert "converted layers: 6 Float8Linear (torchao.float8)" in line
    assert line.endswith("auto: fx needed fallbacks for layers.0, layers.1, layers.2 and 3 more")
