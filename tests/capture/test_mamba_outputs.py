"""Module outputs inside transformers' ``MambaMixer`` on every route that sees inside it.

Under dynamo (and so under ``torch.compile``) transformers runs the mixer's scan through
``associative_scan``, a ``vmap`` that dynamo inlines into the graph; the mixer's projections
(``in_proj``, ``x_proj``, ``out_proj``) sit around it. Recording the values inside the vmap
failed the dynamo step (a tensor escaping the transform) and crashed the compiled one (an
autograd Function under vmap, then dynamo's guard on functorch's state). Now the vmap's inside
is left out, and each projection's output is tagged once under its path, with the values
float64 hooks on an eager twin measure. fx keeps the mixer a leaf (its slow path branches on
tensors): its output is tagged, its inside is not seen.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)
VOCAB = 64
PROJECTIONS = ["in_proj", "x_proj", "out_proj"]


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, labels=ids).loss


def mamba() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1, expand=2, conv_kernel=4, time_step_rank=4
    )
    return transformers.MambaForCausalLM(cfg)


def compiled_whole(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="aot_eager")  # (the route is the same under Inductor)


def compiled_mixers(model: nn.Module) -> nn.Module:
    for layer in model.backbone.layers:
        layer.mixer.compile(backend="aot_eager")
    return model


def hook_reference(model: nn.Module, ids: Tensor) -> Dict[str, Tuple[float, float]]:
    """(forward std, gradient std) in float64 of each projection's output, from hooks."""
    outs: Dict[str, Tensor] = {}
    grads: Dict[str, Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, out: Tensor) -> None:
            outs[name] = out.detach().double()
            out.register_hook(lambda g: grads.__setitem__(name, g.double()))

        return hook

    mixer = model.backbone.layers[0].mixer
    handles = [getattr(mixer, p).register_forward_hook(keep(p)) for p in PROJECTIONS]
    model(input_ids=ids, labels=ids).loss.backward()
    for h in handles:
        h.remove()
    return {p: (float(outs[p].std()), float(grads[p].std())) for p in PROJECTIONS}


@pytest.mark.parametrize(
    "route, prepare",
    [("dynamo", lambda m: m), ("auto", compiled_whole), ("auto", compiled_mixers)],
    ids=["dynamo", "compiled-whole", "compiled-mixers-in-place"],
)
def test_each_projection_is_tagged_once_with_the_hooks_values(route: str, prepare: Callable[..., Any]) -> None:
    torch._dynamo.reset()
    eager = mamba()
    holder = Holder(prepare(copy.deepcopy(eager)))
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    cap = capture(holder, route)
    rec = Recorder()
    with recording(rec):
        cap.tracked()(ids).backward()
    assert rec.error is None, rec.error
    records = rec.records(cap.tags, cap.aliases)
    std = stats.statistic(records, "std")
    # (dynamo and the compiled model scan with `associative_scan`, eager with a loop: last bits)
    for name, (fwd, bwd) in hook_reference(eager, ids).items():
        tag = f"model.backbone.layers.0.mixer.{name}"
        assert cap.tags.count(tag) == 1, tag
        i = cap.tags.index(tag)
        assert float(std[i, FORWARD]) == pytest.approx(fwd, rel=1e-5), tag
        assert float(std[i, BACKWARD]) == pytest.approx(bwd, rel=1e-4), tag
    torch._dynamo.reset()


def test_fx_keeps_the_mixer_a_leaf_tagged_at_its_output() -> None:
    cap = capture(Holder(mamba()), "fx")
    assert cap.tags.count("model.backbone.layers.0.mixer") == 1
    assert not [t for t in cap.tags if t.startswith("model.backbone.layers.0.mixer.")]
