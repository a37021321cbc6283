"""Reliability: ScaleMonitor must never crash, hang or change a training run.

Every case is a real ``Trainer.fit`` on CPU, run twice from the same seeds: once without
the callback and once with ``ScaleMonitor(every_n_steps=1)``. The two runs must end with
parameters and buffers that are bit-identical (compared as raw bits, so NaN payloads
count too), and the tracked run must have written ``scale/fwd/...`` and ``scale/bwd/...``
scalars for every step. Failure paths (nothing can capture the model, user code raising
inside a tracked step, NaN/Inf, thousands of nodes) must warn once and leave no trace:
forward restored, no hooks on parameters, nothing retained between steps.
"""

from __future__ import annotations

import gc
import importlib
import math
import random
import re
import warnings
import weakref
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_scale.step.captures
from lightning_scale import ScaleMonitor
from lightning_scale.record import recorder
from lightning_scale.capture import CaptureError, capture

STEPS = 3
BATCH = 4

ModuleFactory = Callable[[], pl.LightningModule]
DataFactory = Callable[[], DataLoader]


# ---- harness ---------------------------------------------------------------------------


@dataclass
class Run:
    """One finished ``Trainer.fit``: the trained module, and what ScaleMonitor warned."""

    module: pl.LightningModule
    trainer: pl.Trainer
    warnings: List[str]

    def scalars(self) -> Dict[str, Dict[int, float]]:
        """Every scalar written to TensorBoard: tag -> {step: value}."""
        acc = EventAccumulator(self.trainer.logger.log_dir, size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def fit(
    root: Any,
    name: str,
    make_module: ModuleFactory,
    make_data: DataFactory,
    callbacks: Sequence[pl.Callback],
    steps: int = STEPS,
) -> Run:
    """Seed, build, train ``steps`` optimizer steps; collect ScaleMonitor's warnings."""
    pl.seed_everything(0, verbose=False)
    module = make_module()
    data = make_data()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=TensorBoardLogger(str(root), name=name, version=0),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    assert trainer.global_step == steps
    return Run(module, trainer, [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)])


def state(module: nn.Module) -> Dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in chain(module.named_parameters(), module.named_buffers())}


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` on the raw bits, so equal NaNs are equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.detach().view(as_int), b.detach().view(as_int))
    return torch.equal(a, b)


def assert_bit_identical(expected: Dict[str, Tensor], actual: Dict[str, Tensor]) -> None:
    assert expected.keys() == actual.keys()
    differing = [k for k in expected if not same_bits(expected[k], actual[k])]
    assert not differing, f"differ from the run without ScaleMonitor: {differing}"


def train_both(
    tmp_path: Any,
    make_module: ModuleFactory,
    make_data: DataFactory,
    steps: int = STEPS,
    **monitor_kwargs: Any,
) -> Tuple[Run, ScaleMonitor]:
    """Train without and with ``ScaleMonitor(every_n_steps=1, **monitor_kwargs)``; require
    bit-identical parameters and buffers, and that training changed them."""
    pl.seed_everything(0, verbose=False)
    initial = state(make_module())
    plain = fit(tmp_path, "plain", make_module, make_data, [], steps)
    monitor = ScaleMonitor(every_n_steps=1, **monitor_kwargs)
    tracked = fit(tmp_path, "tracked", make_module, make_data, [monitor], steps)
    assert_bit_identical(state(plain.module), state(tracked.module))
    changed = [k for k, v in initial.items() if not same_bits(v, state(tracked.module)[k])]
    assert changed, "training did not change anything: the comparison would be vacuous"
    return tracked, monitor


def scale_tags(run: Run, steps: int = STEPS) -> Dict[str, Dict[int, float]]:
    """The run's ``scale/`` scalars; asserts both directions were written at every step."""
    scalars = {tag: v for tag, v in run.scalars().items() if tag.startswith("scale/")}
    for direction in ("fwd", "bwd"):
        tags = [t for t in scalars if t.startswith(f"scale/{direction}/")]
        assert tags, f"no scale/{direction}/ tags written"
        written = set().union(*(scalars[t] for t in tags))
        assert written == set(range(steps)), f"scale/{direction}/ written at steps {sorted(written)}"
    bad = {t: v for t, v in scalars.items() if not all(math.isfinite(s) and s >= 0 for s in v.values())}
    assert not bad, f"std must be finite and non-negative: {bad}"
    return scalars


def modes(monitor: ScaleMonitor) -> List[str]:
    """Capture modes ScaleMonitor used (one capture per train/eval flag pattern)."""
    return sorted({c.mode for c in monitor.captures.values()})


def param_hooks(module: nn.Module) -> int:
    return sum(len(p._backward_hooks or {}) for p in module.parameters())


# ---- modules and data ------------------------------------------------------------------


def floats(out: Any) -> List[Tensor]:
    """Floating tensors in a nested output (tensor, tuple, list, dict)."""
    if isinstance(out, Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in floats(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in floats(v)]
    return []


class Net(pl.LightningModule):
    """Trains ``net``: the loss pulls every floating output towards 0.5, whatever the
    output structure; SGD with momentum (state that would carry any difference on)."""

    def __init__(self, net: nn.Module, lr: float = 0.05) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def forward(self, x: Tensor) -> Any:
        return self.net(x)

    def loss(self, out: Any) -> Tensor:
        return torch.stack([(t - 0.5).pow(2).mean() for t in floats(out)]).sum()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(self(batch[0]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dense(*shape: int, n: int = 16, batch: int = BATCH) -> DataFactory:
    def make() -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(n, *shape, generator=g)), batch_size=batch)

    return make


def tokens(seq: int = 6, vocab: int = 50, n: int = 16) -> DataFactory:
    def make() -> DataLoader:
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randint(vocab, (n, seq), generator=g)), batch_size=BATCH)

    return make


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn2 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn2(self.conv(x))).flatten(1)  # (B, 144)
        return self.head(F.relu(self.bn1(self.fc(h))))


class InplaceResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.fc1(x))  # ResNet's basic block, without convolutions
        out = self.fc2(out)
        out += x
        return self.relu(out)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.encoder(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, weights = self.attn(x, x, x, need_weights=True)  # (B, T, C), (B, T, T)
        return out * weights.sum(-1, keepdim=True)


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return self.a(x), torch.tanh(self.b(x))


class DictOut(TupleOut):
    def forward(self, x: Tensor) -> Dict[str, Any]:  # type: ignore[override]
        a, b = super().forward(x)
        return {"a": a, "nested": (b, x.argmax(-1))}


class Routing(nn.Module):
    """Top-2 mixture of experts: integer routing indices, boolean masks, torch.where."""

    def __init__(self, experts: int = 4, dim: int = 8) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        top = torch.topk(self.gate(x), 2, dim=-1)
        weights = top.values.softmax(-1)  # (B, 2)
        idx = top.indices  # (B, 2) int64
        outs = torch.stack([e(x) for e in self.experts], 1)  # (B, E, D)
        chosen = outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.size(-1)))  # (B, 2, D)
        h = (weights.unsqueeze(-1) * chosen).sum(1)
        mask = h > 0  # bool
        h = torch.where(mask, h, 0.1 * h)
        active = mask.sum(-1, keepdim=True)  # int64
        return h / (active + 1)


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.fc = nn.Linear(16, 4)

    def forward(self, idx: Tensor) -> Tensor:
        mask = (idx != 0).unsqueeze(-1)  # (B, T, 1) bool
        h = (self.emb(idx) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.fc(h)


class Dropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class Functional(nn.Module):
    """Parameters only; every op a torch.nn.functional call."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 8) / 8**0.5)
        self.b1 = nn.Parameter(torch.zeros(16))
        self.g = nn.Parameter(torch.ones(16))
        self.w2 = nn.Parameter(torch.randn(4, 16) / 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.layer_norm(F.linear(x, self.w1, self.b1), (16,), self.g)
        h = F.dropout(F.gelu(h), p=0.2, training=self.training)
        return F.softmax(F.linear(h, self.w2), dim=-1) + F.silu(x[:, :4])


class DataDependent(nn.Module):
    """A Python ``if`` on a tensor value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if h.mean() > 0:
            h = torch.relu(h)
        else:
            h = torch.tanh(h)
        return self.fc2(h)


class Teacher(nn.Module):
    """A frozen-target branch under ``torch.no_grad()`` inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            target = self.teacher(x)
        return self.student(x) - target


class AutocastRegion(nn.Module):
    """A bfloat16 autocast region inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc1(x)  # bfloat16
        return self.fc2(h.float())


MODELS = {
    "batchnorm": (ConvBN, dense(3, 8, 8)),
    "inplace_relu_and_residual": (InplaceResidual, dense(8)),
    "transformer_encoder": (Encoder, dense(5, 16)),
    "multihead_attention": (Attention, dense(5, 16)),
    "tuple_output": (TupleOut, dense(8)),
    "dict_output": (DictOut, dense(8)),
    "int_and_bool_intermediates": (Routing, dense(8)),
    "embedding": (Embedder, tokens()),
    "dropout": (Dropouts, dense(8)),
    "functional_only": (Functional, dense(8)),
    "no_grad_inside_forward": (Teacher, dense(8)),
    "autocast_inside_forward": (AutocastRegion, dense(8)),
}


# ---- models train bit-identically ---------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_bit_identically(tmp_path: Any, name: str) -> None:
    net, data = MODELS[name]
    run, _ = train_both(tmp_path, lambda: Net(net()), data)
    scale_tags(run)
    assert run.warnings == []


def test_batchnorm_running_stats_and_counter_identical(tmp_path: Any) -> None:
    run, monitor = train_both(tmp_path, lambda: Net(ConvBN()), dense(3, 8, 8))
    assert modes(monitor) == ["fx"]
    for bn in (run.module.net.bn1, run.module.net.bn2):
        assert int(bn.num_batches_tracked) == STEPS  # counted once per step, tracked or not
    tags = scale_tags(run)
    assert "scale/fwd/net.bn2/batchnorm2d" in tags and "scale/bwd/net.bn1/batchnorm1d" in tags


def test_untraceable_model_is_tracked_through_dynamo(tmp_path: Any) -> None:
    run, monitor = train_both(tmp_path, lambda: Net(DataDependent()), dense(8))
    assert modes(monitor) == ["dynamo"]
    tags = scale_tags(run)
    assert any("fc2" in t for t in tags), sorted(tags)


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
@pytest.mark.parametrize("net", [Teacher, AutocastRegion], ids=["no_grad", "autocast"])
def test_grad_and_autocast_switches_inside_forward_are_kept(
    tmp_path: Any, net: Callable[[], nn.Module], mode: str
) -> None:
    # An fx graph records neither switch: the module holding one must run as a leaf.
    run, monitor = train_both(tmp_path, lambda: Net(net()), dense(8), capture=mode, figure=False)
    assert modes(monitor) == [mode]
    scale_tags(run)


class PythonState(nn.Module):
    """Reads Python state that changes during training: a flag and the ``random`` module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.double = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.double:
            h = h * 2
        if random.random() < 0.5:  # stochastic depth
            return h[:, :4]
        return self.fc2(h)


class FlagFromStep1(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.net.double = self.global_step >= 1
        random.seed(self.global_step)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["dynamo", "auto"])
def test_python_state_read_in_forward(tmp_path: Any, mode: str) -> None:
    # dynamo guards on the flag and replays `random`; fx would bake both into the graph,
    # but its trace draws from `random`, so auto refuses fx and takes dynamo
    train_both(tmp_path, lambda: FlagFromStep1(PythonState()), dense(8), steps=4, capture=mode, figure=False)


class TinyGPT2(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.gpt(input_ids=idx).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        idx = batch[0]
        logits = self(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_hugging_face_gpt2_trains_bit_identically(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, monitor = train_both(tmp_path, TinyGPT2, tokens(seq=9, vocab=100), figure=False)
    assert modes(monitor) == ["dynamo"]
    tags = scale_tags(run)
    assert any("gpt.transformer.h.1" in t for t in tags), sorted(tags)[:20]


# ---- nothing can capture the model --------------------------------------------------


def test_capture_failure_warns_once_and_trains_untracked(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("capture exploded")

    monkeypatch.setattr(lightning_scale.step.captures, "capture", broken)
    run, _ = train_both(tmp_path, lambda: Net(Dropouts()), dense(8))
    assert len(run.warnings) == 1, run.warnings
    assert "capture exploded" in run.warnings[0] and "continues untracked" in run.warnings[0]
    assert not any(t.startswith("scale") for t in run.scalars())


class BranchingRoot(Net):
    """The data-dependent ``if`` in the captured module's own forward: no submodule to
    fall back to, so fx cannot trace it at all."""

    def forward(self, x: Tensor) -> Any:
        if x.mean() > 0:
            x = -x
        return self.net(x)


def test_fx_only_on_untraceable_model_warns_once_and_trains_untracked(tmp_path: Any) -> None:
    run, _ = train_both(tmp_path, lambda: BranchingRoot(Dropouts()), dense(8), capture="fx")
    assert len(run.warnings) == 1, run.warnings
    assert "torch.fx could not trace" in run.warnings[0]
    assert not any(t.startswith("scale") for t in run.scalars())


def test_model_neither_fx_nor_dynamo_can_capture_warns_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("graph cannot be labelled")

    # fx fails on the root's `if`; the dynamo backend then fails on every graph it gets
    monkeypatch.setattr(importlib.import_module("lightning_scale.capture.frames"), "node_sites", broken)
    run, monitor = train_both(tmp_path, lambda: BranchingRoot(Dropouts()), dense(8), figure=False)
    assert modes(monitor) == ["dynamo"]
    assert len(run.warnings) == 1 and "graph cannot be labelled" in run.warnings[0], run.warnings
    assert not any(t.startswith("scale") for t in run.scalars())


def test_dynamo_fits_of_one_class_stay_tracked_and_free_their_models(tmp_path: Any) -> None:
    # dynamo caches per code object; every fit of `Net` compiles `Net.forward` again
    alive = []
    for i in range(10):  # beyond dynamo's default recompile limit of 8
        modules: List[Net] = []

        def make() -> Net:  # closes over `modules`, deleted below so the models can be freed
            modules.append(Net(Dropouts()))  # noqa: B023, F821
            return modules[-1]  # noqa: B023, F821

        run = fit(
            tmp_path,
            f"fit{i}",
            make,
            dense(8),
            [ScaleMonitor(every_n_steps=1, capture="dynamo", figure=False)],
            steps=1,
        )
        assert run.warnings == [] and scale_tags(run, steps=1), i
        alive.append(weakref.ref(modules[0]))
        del run, modules
    gc.collect()
    assert sum(ref() is not None for ref in alive) == 0, "tracked models kept alive after their fit"


# ---- input shapes change between tracked steps ----------------------------------------


class Sequences(Dataset):
    """Pre-built batches of token sequences of varying length (batch_size=None)."""

    def __init__(self, lengths: Sequence[int], vocab: int = 50) -> None:
        g = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(1, vocab, (BATCH, t), generator=g) for t in lengths]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Tuple[Tensor]:
        return (self.batches[i],)


class Positional(nn.Module):
    """Token and position embeddings: the graph reads the sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(50, 16), nn.Embedding(16, 16)
        self.fc = nn.Linear(16, 4)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.tok(idx) + self.pos(pos)  # (B, T, C)
        return self.fc(h.mean(1))


SHAPES = {
    "last_batch_smaller": (lambda: Net(Dropouts()), dense(8, n=10, batch=4), 6),  # 4, 4, 2, 4, 4, 2
    "variable_sequence_length": (
        lambda: Net(Positional()),
        lambda: DataLoader(Sequences([3, 7, 5, 3, 9]), batch_size=None),
        5,
    ),
}


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_changing_input_shapes(tmp_path: Any, case: str, mode: str) -> None:
    make_module, make_data, steps = SHAPES[case]
    run, monitor = train_both(tmp_path, make_module, make_data, steps=steps, capture=mode, figure=False)
    assert modes(monitor) == [mode]
    tags = scale_tags(run, steps)
    missing = {t: sorted(v) for t, v in tags.items() if set(v) != set(range(steps))}
    assert not missing, f"a node's tag must not change with the input shape: {missing}"
    assert run.warnings == []


# ---- user code raising inside a tracked step --------------------------------------------

FAIL_STEP = 1


class RaiseInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if RaiseInBackward.armed:
            raise ValueError("user code failed in backward")
        return grad


class Guarded(nn.Module):
    """Raises from forward on NaN input (a tensor check: dynamo), and from backward when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        if torch.isnan(x).any():
            raise ValueError("user code failed in forward: NaN input")
        return self.fc2(RaiseInBackward.apply(torch.relu(self.fc1(x))))


class Failing(Net):
    def __init__(self, where: str) -> None:
        super().__init__(Guarded())
        self.where = where
        self.before: Optional[Dict[str, Tensor]] = None

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch[0]
        failing = self.global_step == FAIL_STEP
        if failing:
            self.before = state(self)
            if self.where == "forward":
                x = x.clone().fill_(math.nan)
            RaiseInBackward.armed = self.where == "backward"
        loss = self.loss(self(x))
        if failing and self.where == "training_step":
            raise ValueError("user code failed in training_step")
        return loss


@pytest.mark.parametrize(
    "where,mode",
    [
        ("training_step", "fx"),
        ("training_step", "dynamo"),
        ("backward", "fx"),
        ("backward", "dynamo"),
        ("forward", "auto"),
    ],
)
def test_user_exception_in_tracked_step_surfaces_and_leaves_no_trace(tmp_path: Any, where: str, mode: str) -> None:
    monitor = ScaleMonitor(every_n_steps=1, capture=mode, figure=False)  # type: ignore[arg-type]
    modules: List[Failing] = []

    def make() -> Failing:
        modules.append(Failing(where))
        return modules[-1]

    try:
        with pytest.raises(ValueError, match=f"^user code failed in {where}") as info:
            fit(tmp_path, "failing", make, dense(8), [monitor], steps=STEPS)
    finally:
        RaiseInBackward.armed = False
    assert type(info.value) is ValueError
    module = modules[-1]
    assert "forward" not in module.__dict__, "tracked forward left installed"
    assert all("forward" not in m.__dict__ for m in module.modules())
    assert recorder.active() is None
    assert param_hooks(module) == 0
    assert module.before is not None
    assert_bit_identical(module.before, state(module))
    assert modes(monitor) == (["dynamo"] if mode == "auto" else [mode])


# ---- NaN and Inf -----------------------------------------------------------------------


class Poisoned(nn.Module):
    """Multiplies by inf while the ``poison`` buffer is set."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("poison", torch.tensor(False))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = h * torch.where(self.poison, math.inf, 1.0)  # (B, 8), all +-inf when poisoned
        return self.fc2(torch.tanh(h))  # finite again: tanh(+-inf) = +-1


class PoisonAtStep1(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.net.poison.fill_(self.global_step == 1)
        return super().training_step(batch, batch_idx)


NONFINITE_STATS = ["std", "nan", "inf"]


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
def test_inf_in_forward_counted_and_warned_only_where_harmful(tmp_path: Any, mode: str) -> None:
    run, _ = train_both(
        tmp_path, lambda: PoisonAtStep1(Poisoned()), dense(8), statistics=NONFINITE_STATS, capture=mode, figure=False
    )
    scalars = run.scalars()
    mul = "net/mul"
    assert scalars[f"inf/fwd/{mul}"] == {0: 0.0, 1: BATCH * 8, 2: 0.0}
    # step 1: tanh'(+-inf) = 0, so d/dh = 0 * inf = NaN at fc1's output and its parameters
    assert scalars["nan/bwd/net.fc1/linear"][1] == BATCH * 8
    assert scalars["nan/bwd/net.fc1/linear"][0] == 0.0
    # Per node, where it first appears: the forward Inf is absorbed by tanh (counted, not
    # warned); the NaN gradient is; the NaN update then reaches the parameters at step 2.
    assert firsts(run.warnings) == [
        ("backward", 1, "net.fc1/linear"),
        ("forward", 2, "net.fc1.weight"),
        ("backward", 2, "net.fc2/linear"),
    ], run.warnings


class MaskAcrossBreak(nn.Module):
    """A ``-inf`` causal-style mask built before a graph break and used after it: either
    absorbed by a softmax (benign) or, while ``poison`` is set, carried to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.register_buffer("poison", torch.tensor(False))

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.ones(8, 8, dtype=torch.bool).tril()[: x.shape[0] % 8 + 1].any(0)  # a fixed, partial mask
        scores = self.fc1(x).masked_fill(~keep, -math.inf)
        torch._dynamo.graph_break()  # the mask's consumers run in the next graph
        h = torch.softmax(scores, -1)  # finite again
        return self.fc2(h) * torch.where(self.poison, math.inf, 1.0)


class PoisonOutputAtStep1(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.net.poison.fill_(self.global_step == 1)
        return super().training_step(batch, batch_idx)


def test_inf_across_a_graph_break_is_judged_by_the_next_graph(tmp_path: Any) -> None:
    run, monitor = train_both(
        tmp_path, lambda: Net(MaskAcrossBreak()), dense(8), statistics=NONFINITE_STATS, figure=False
    )
    assert modes(monitor) == ["dynamo"]
    inf = run.scalars()["inf/fwd/net/masked_fill"]
    assert inf[0] > 0 and set(inf) == set(range(STEPS))  # counted at every step ...
    assert not firsts(run.warnings), run.warnings  # ... never warned: the softmax absorbs it
    run, _ = train_both(
        tmp_path / "poisoned",
        lambda: PoisonOutputAtStep1(MaskAcrossBreak()),
        dense(8),
        statistics=NONFINITE_STATS,
        figure=False,
    )
    forward = [w for w in firsts(run.warnings) if w[0] == "forward"]
    assert forward and forward[0][1] == 1 and forward[0][2] != "net/masked_fill", (
        run.warnings
    )  # the output's Inf, not the mask's


def nan_inputs() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 8, generator=g)
    x[BATCH, 0] = x[BATCH + 1, 3] = x[BATCH + 2, 5] = math.nan  # 3 NaNs, all in batch 1
    return DataLoader(TensorDataset(x), batch_size=BATCH)


def test_nan_inputs_counted_and_warned_where_they_first_appear(tmp_path: Any) -> None:
    run, _ = train_both(tmp_path, lambda: Net(Dropouts()), nan_inputs, statistics=NONFINITE_STATS, figure=False)
    scalars = run.scalars()
    assert scalars["nan/fwd/x"] == {0: 0.0, 1: 3.0, 2: 0.0}
    # three rows hold a NaN: every feature of those rows is NaN after fc1
    assert scalars["nan/fwd/net.fc1/linear"][1] == 3 * 32
    assert firsts(run.warnings)[0] == ("forward", 1, "x"), run.warnings
    assert [w for w in firsts(run.warnings) if w[1] == 1] == [("forward", 1, "x"), ("backward", 1, "net.fc2/linear")], (
        run.warnings
    )


def firsts(warnings: List[str]) -> List[Tuple[str, int, str]]:
    """(direction, step, first node) of each anomaly warning."""
    found = [re.search(r"in the (\w+) pass at step (\d+), first at `([^`]+)`", w) for w in warnings]
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in found if m]


# ---- nothing retained between steps -------------------------------------------------------


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Tensor))


class Probe(pl.Callback):
    """Counts live tensors and parameter hooks after chosen steps."""

    def __init__(self, at: Sequence[int]) -> None:
        self.at = set(at)
        self.seen: Dict[int, Tuple[int, int]] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step in self.at:
            for cb in trainer.callbacks:  # the writer thread holds a step's host copy until written
                if isinstance(cb, ScaleMonitor):
                    cb.reporter.flush()
            self.seen[trainer.global_step] = (live_tensors(), param_hooks(pl_module))


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
def test_no_memory_retained_over_60_tracked_steps(tmp_path: Any, mode: str) -> None:
    monitor = ScaleMonitor(
        every_n_steps=1,
        capture=mode,  # type: ignore[arg-type]
        figure=False,
        histograms=False,
        code=False,
    )
    probe = Probe(at=(2, 60))  # both after the 2nd batch of an epoch of 2
    fit(tmp_path, "leak", lambda: Net(Dropouts()), dense(8, n=8), [monitor, probe], steps=60)
    # Nothing accumulates: no more live tensors after 60 tracked steps than after 2 (fewer
    # is possible when objects of earlier tests in the process are released meanwhile); a
    # tensor kept per step would show 58 more.
    assert probe.seen[60][0] <= probe.seen[2][0], probe.seen
    assert probe.seen[60][1] == 0


# ---- a model with thousands of nodes ------------------------------------------------------


class Chain(nn.Module):
    """~3000 nodes: 1000 residual rounds of three elementwise ops."""

    def __init__(self, rounds: int = 1000) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rounds = rounds

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        for _ in range(self.rounds):
            h = h + 0.01 * torch.tanh(h)
        return h


class InputGradNet(Net):
    """Makes the input require grad, so every node has both a forward and a backward tag."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(self(batch[0].requires_grad_()))


def test_huge_model_writes_max_tags_nodes_and_warns(tmp_path: Any) -> None:
    run, monitor = train_both(tmp_path, lambda: InputGradNet(Chain()), dense(8), steps=2, max_tags=100)
    assert modes(monitor) == ["fx"]
    tags = scale_tags(run, steps=2)
    fwd = {t[len("scale/fwd/") :] for t in tags if t.startswith("scale/fwd/")}
    bwd = {t[len("scale/bwd/") :] for t in tags if t.startswith("scale/bwd/")}
    assert len(fwd) == 100 and fwd == bwd
    assert len(run.warnings) == 1 and "`max_tags`" in run.warnings[0], run.warnings


# ---- capture fidelity on real model classes ----------------------------------


class AuxRouter(nn.Module):
    """Stores a tensor on itself in forward (an MoE router's auxiliary loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.aux_loss: Any = None

    def forward(self, x: Tensor) -> Tensor:
        probs = self.gate(x).softmax(-1)
        self.aux_loss = probs.pow(2).mean()
        return probs


class AuxNet(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self.loss(self(batch[0])) + self.net.aux_loss


def test_attribute_written_in_forward_routes_auto_to_dynamo(tmp_path: Any) -> None:
    run, monitor = train_both(tmp_path, lambda: AuxNet(AuxRouter()), dense(8), figure=False)
    assert modes(monitor) == ["dynamo"] and run.warnings == []
    cap = next(iter(monitor.captures.values()))
    assert "net.aux_loss` assigned in forward at" in cap.reason and "test_reliability.py" in cap.reason
    assert isinstance(run.module.net.aux_loss, Tensor) and not isinstance(run.module.net.aux_loss, torch.fx.Proxy)
    model = AuxRouter()
    with pytest.raises(
        CaptureError, match=r"forward writes module state \(`aux_loss` assigned in forward at .*test_reliability.py"
    ):
        capture(model, "fx")
    assert model.aux_loss is None  # nothing of the trace stays on the module


class WithCompiledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh())
        # aot_eager draws dropout differently from eager: running it eagerly would show.
        self.block = torch.compile(block, backend="aot_eager")
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.fc(x)))


@pytest.mark.parametrize("mode", ["fx", "dynamo"])
def test_compiled_submodule_runs_as_compiled_on_tracked_steps(tmp_path: Any, mode: str) -> None:
    run, monitor = train_both(tmp_path, lambda: Net(WithCompiledBlock()), dense(8), capture=mode, figure=False)
    assert run.warnings == []
    cap = next(iter(monitor.captures.values()))
    assert not any("_orig_mod" in label for label in cap.tags)
    # (dynamo: the call is a graph break, and a module whose last op ends a graph at a
    # break may go on in the next graph: `net.fc` has only its op label there)
    assert {"net.block", "net.head"} | ({"net.fc"} if mode == "fx" else set()) <= set(cap.tags)
    # Logged: its recorded output (dynamo) or its leaf node (fx).
    assert any(tag.endswith(("net.block", "net.block/sequential")) for tag in run.scalars())


class CheckpointedDropout(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)  # reentrant checkpointing needs an input that requires grad
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU()) for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_dropout_under_dynamo_trains_bit_identically(tmp_path: Any, reentrant: bool) -> None:
    run, monitor = train_both(
        tmp_path, lambda: Net(CheckpointedDropout(reentrant)), dense(8), capture="dynamo", figure=False
    )
    assert run.warnings == []
    labels = next(iter(monitor.captures.values())).node_labels
    assert {"net.blocks.0.0/linear", "net.blocks.1.0/linear", "net.blocks.1.1/dropout"} <= set(labels)


class CompiledStep(Net):
    """The user compiles their own step; the tracked forward runs inside it."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self._compiled(batch[0])

    def on_fit_start(self) -> None:
        self._compiled = torch.compile(lambda x: self.loss(self(x)), backend="eager")


def test_recorder_is_opaque_to_the_users_compile(tmp_path: Any) -> None:
    run, _ = train_both(
        tmp_path,
        lambda: CompiledStep(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))),
        dense(8),
        capture="fx",
        figure=False,
    )
    assert run.warnings == []
    assert any(tag.startswith("scale/") for tag in run.scalars())
    counters = torch._dynamo.utils.counters
    assert not any("recompile" in str(k) and "limit" in str(k) for k in counters["stats"])
