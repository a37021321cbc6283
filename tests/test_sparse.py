"""Sparse tensors in a real ``Trainer`` fit: an ``nn.Embedding(sparse=True)`` (its weight's
gradient is sparse) and a sparse buffer used in forward. Training is bit-identical with and
without ScaleMonitor; the dense nodes are logged (read back from the event files, the
embedding's output against a float64 reference); the sparse tensor is skipped, named in
one warning and in the coverage line, and no warning blames the capture."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor

STEPS = 3


class Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, i: Tensor) -> Tensor:
        return self.fc(self.emb(i))


class Masked(nn.Module):
    """A fixed sparse mixing matrix (a buffer) applied before a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        indices = torch.tensor([[0, 1, 2, 5], [0, 3, 5, 7]])
        self.register_buffer("mask", torch.sparse_coo_tensor(indices, torch.tensor([1.0, -2.0, 0.5, 3.0]), (8, 8)))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.sparse.mm(self.mask, x.t()).t())


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # (takes sparse gradients)


def data(kind: str) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 16, (16,), generator=g) if kind == "embedding" else torch.randn(16, 8, generator=g)
    return TensorDataset(x, torch.randn(16, 4, generator=g))


def fit(root: Path, kind: str, callbacks: List[pl.Callback]) -> Tuple[Module, List[str], List[str]]:
    torch.manual_seed(0)
    module = Module(Embedded() if kind == "embedding" else Masked())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        logger=TensorBoardLogger(str(root), name=kind, version=0),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    lines: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("lightning.pytorch").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, DataLoader(data(kind), batch_size=4))
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(handler)
    assert trainer.global_step == STEPS
    return module, [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)], lines


def scalars(root: Path, kind: str) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(root / kind / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def first_batch_reference(kind: str, module: Callable[[], nn.Module]) -> Dict[str, float]:
    """float64 std of the first step's dense intermediate tensors, from the initial weights."""
    torch.manual_seed(0)
    net = module()
    x = data(kind).tensors[0][:4]
    with torch.no_grad():
        if kind == "embedding":
            h = net.emb.weight.double()[x]  # (4, 8)
            y = h @ net.fc.weight.double().T + net.fc.bias.double()  # (4, 4)
            return {"net.emb/embedding": float(h.std()), "net.fc/linear": float(y.std())}
        mixed = (net.mask.double().to_dense() @ x.double().t()).t()  # (4, 8)
        return {"net/sparse_mm": float(mixed.std())}


@pytest.mark.parametrize(
    "kind,skipped,absent",
    [("embedding", "net.emb.weight grad", "scale/bwd/net.emb.weight"), ("buffer", "net.mask", "scale/fwd/net.mask")],
)
def test_sparse_tensors_are_skipped_named_and_the_rest_logged(
    tmp_path: Path, kind: str, skipped: str, absent: str
) -> None:
    plain, _, _ = fit(tmp_path / "plain", kind, [])
    tracked, warned, lines = fit(tmp_path / "tracked", kind, [ScaleMonitor(every_n_steps=1)])
    for (name, a), b in zip(plain.state_dict().items(), tracked.state_dict().values()):
        assert a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense()), f"{name} differs"
    torch.manual_seed(0)
    initial = Embedded() if kind == "embedding" else Masked()
    assert not torch.equal(initial.fc.weight, tracked.net.fc.weight)  # training changed it: not a vacuous match
    assert warned == [
        f"ScaleMonitor: 1 node skipped: sparse_coo layout ({skipped}) at step 0: no statistics of these tensors, "
        "for the reason given; the rest of the step is recorded"
    ]
    coverage = [line for line in lines if line.startswith("ScaleMonitor: coverage:")]
    assert len(coverage) == 1 and coverage[0].endswith(f"; 1 node skipped: sparse_coo layout ({skipped})")
    assert any("verified" in line for line in lines)  # the probe compared the sparse tensors bit for bit
    logged = scalars(tmp_path / "tracked", kind)
    assert absent not in logged
    reference = first_batch_reference(kind, Embedded if kind == "embedding" else Masked)
    for label, std in reference.items():
        assert sorted(logged[f"scale/fwd/{label}"]) == list(range(STEPS))
        assert abs(logged[f"scale/fwd/{label}"][0] / std - 1) < 1e-5  # (float32 in the event file)
    for tag in ("scale/fwd/net.fc.weight", "scale/bwd/net.fc.weight", "scale/bwd/net.fc/linear"):
        assert sorted(logged[tag]) == list(range(STEPS))
