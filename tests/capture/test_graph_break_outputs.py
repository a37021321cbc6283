"""Module outputs across graph breaks on the dynamo route, and what the fidelity probe keeps.

A frame dynamo skips (a graph break inside a loop skips the whole frame) runs eagerly: the
user's modules it calls are compiled as frames of their own, whose output is the module's
(tagged under its path); torch's own modules it calls are hooked for the tracked call, so
dynamo compiles them too (or, under ``torch.compiler.disable``, the hook records them).
Each tag carries the values float64 forward and tensor hooks on an eager twin measure.
The real cases: Wav2Vec2 with its default SpecAugment masking and LayerDrop (the encoder's
layer loop breaks on LayerDrop's draw), and Mamba, which dynamo changes (``associative_scan``
when ``is_compiling()``): the probe tracks it with dynamo seeing ``is_compiling()`` false,
where every mixer's projections are tagged, instead of fx, where the mixer is a leaf.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording
from lightning_scale.step.verification import EAGER_BRANCHES, check_capture
from tests.capture.test_models import Task, ctc_loss, lm_loss, seed, tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    yield
    torch._dynamo.reset()


def hooked(model: nn.Module, paths: List[str], run: Callable[[nn.Module], Tensor]) -> Dict[str, Tuple[float, float]]:
    """(forward std, gradient std) in float64 of each module's output, from hooks."""
    outs: Dict[str, Tensor] = {}
    grads: Dict[str, Tensor] = {}

    def keep(path: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out
            outs[path] = out.detach().double()
            out.register_hook(lambda g: grads.__setitem__(path, g.double()))

        return hook

    handles = [model.get_submodule(p).register_forward_hook(keep(p)) for p in paths]
    run(model).backward()
    for h in handles:
        h.remove()
    return {p: (float(outs[p].std()), float(grads[p].std())) for p in paths}


def assert_tagged_as_hooked(cap: Any, rec: Recorder, reference: Dict[str, Tuple[float, float]], rel: float) -> None:
    assert rec.error is None, rec.error
    std = stats.statistic(rec.records(cap.tags, cap.aliases), "std")
    for path, (fwd, bwd) in reference.items():
        assert cap.tags.count(path) == 1, path
        i = cap.tags.index(path)
        assert float(std[i, FORWARD]) == pytest.approx(fwd, rel=rel), path
        assert float(std[i, BACKWARD]) == pytest.approx(bwd, rel=rel), path


# ---- the general case, on small models -------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class Skipped(nn.Module):
    """A loop whose graph break (a data-dependent branch) makes dynamo skip the whole frame:
    the norm, the blocks and the dropout run from eager code."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        for block in self.blocks:
            if h.sum() > -1e9:  # (always: a graph break inside the loop)
                h = block(h)
        return self.drop(h)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Skipped()
        self.head = nn.Linear(8, 1)
        self.hidden = nn.Linear(8, 8)

    @torch.compiler.disable  # (no frame dynamo compiles: the hook records `hidden` itself)
    def eager(self, x: Tensor) -> Tensor:
        return self.hidden(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.eager(self.inner(x))).sum()


def test_modules_called_from_a_skipped_frame_are_tagged_with_their_values() -> None:
    torch.manual_seed(0)
    model = Outer()
    twin = copy.deepcopy(model)
    x = torch.randn(4, 8)
    paths = ["inner.norm", "inner.blocks.0", "inner.blocks.1", "inner.blocks.1.fc", "inner.drop", "hidden", "head"]
    cap = capture(model, "dynamo")
    rec = Recorder()
    torch.manual_seed(1)
    with recording(rec):
        cap.tracked()(x).backward()
    torch.manual_seed(1)
    assert_tagged_as_hooked(cap, rec, hooked(twin, paths, lambda m: m(x)), rel=1e-6)
    assert {"hidden.weight", "hidden.bias", "inner.norm.weight"} <= set(cap.tags)  # (their parameters too)
    assert not [t for t in cap.tags if t.startswith("inner/") and t.endswith("layer_norm")]  # (under its own path)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---- Wav2Vec2 with its default SpecAugment masking and LayerDrop --------------------------


def wav2vec2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.05,  # (the default; and the default LayerDrop, 0.1)
    )
    return transformers.Wav2Vec2ForCTC(cfg)


def test_wav2vec2_encoder_outputs_are_tagged_with_their_values() -> None:
    task = Task(wav2vec2(), ctc_loss)
    twin = copy.deepcopy(task)
    encoder = "model.wav2vec2.encoder"
    paths = [f"{encoder}.{p}" for p in ("pos_conv_embed", "layer_norm", "dropout", "layers.0")] + ["model.lm_head"]
    cap = capture(task, "auto")
    rec = Recorder()
    seed(3)  # (LayerDrop keeps the layer with this draw)
    with recording(rec):
        cap.tracked()(tokens(0)).backward()
    seed(3)
    assert cap.mode == "dynamo"
    assert_tagged_as_hooked(cap, rec, hooked(twin, paths, lambda m: m(tokens(0))), rel=1e-6)


# ---- Mamba: dynamo changes it; the probe keeps dynamo with is_compiling() false ------------


def mamba() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, use_mambapy=False)
    return transformers.MambaForCausalLM(cfg)


def test_the_probe_tracks_mamba_with_dynamo_and_its_projections_tagged() -> None:
    task = Task(mamba(), lm_loss)
    twin = copy.deepcopy(task)
    cap = capture(task, "auto")
    assert cap.mode == "dynamo"  # (fx keeps each mixer a leaf)
    check = check_capture(
        task, cap, task.forward, (tokens(0),), {}, build=lambda mode: capture(task, mode), agree=lambda ok: ok
    )
    assert check.kind == "switched" and check.capture is not None and check.capture.eager_branches, check.why
    assert check.why.endswith(f"{EAGER_BRANCHES}: bit-identical); tracking with {EAGER_BRANCHES}")
    assert "dynamo: gradient of `model.backbone.layers.0.mixer." in check.why  # (associative_scan's last bits)
    mixers = [f"model.backbone.layers.{i}.mixer" for i in range(2)]
    paths = [f"{m}.{p}" for m in mixers for p in ("in_proj", "x_proj", "out_proj")]
    rec = Recorder()
    with recording(rec):
        check.capture.tracked()(tokens(1)).backward()
    # (the same loop as eager: no associative_scan; the scan's order is the eager one)
    assert_tagged_as_hooked(check.capture, rec, hooked(twin, paths, lambda m: m(tokens(1))), rel=1e-6)
