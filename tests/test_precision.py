"""Mixed and true half precision on CPU: forward statistics are of the tensors the model
actually holds, the loss scale of a real GradScaler is logged and carried by the backward
statistics, and ``unscale_gradients`` divides it (and the accumulation factor) out."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor

REL = 1e-5  # TensorBoard stores scalars as float32


class Net(pl.LightningModule):
    """Linear(8, 16) - ReLU - Linear(16, 4), MSE loss, SGD; keeps the first step's batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.first_batches: List[Tuple[Tensor, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.global_step == 0:
            self.first_batches.append((x.detach().clone(), y.detach().clone()))
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ScaleProbe(Callback):
    """The GradScaler's scale after each backward of step 0, read the documented way."""

    def __init__(self) -> None:
        self.scales: List[float] = []

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == 0:
            self.scales.append(trainer.precision_plugin.scaler.get_scale())  # type: ignore[attr-defined]


def fit(
    out: Path, monitor: ScaleMonitor, extra: Optional[List[Callback]] = None, **kwargs: Any
) -> Tuple[Net, Dict[str, Tensor], Dict[str, float]]:
    torch.manual_seed(0)
    model = Net()
    init = copy.deepcopy(model.state_dict())
    data = TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=TensorBoardLogger(str(out), name="", version=0),
        callbacks=[monitor, *(extra or [])],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    acc = EventAccumulator(str(out / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    logged = {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}
    return model, init, logged


def monitor(**kwargs: Any) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=None, steps=[0], histograms=False, figure=False, code=False, **kwargs)


def std(t: Tensor) -> float:
    return float(t.double().std())


def forward_nodes(x: Tensor, w: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The model's intermediates written out: ``label -> tensor``."""
    h = F.linear(x, w["net.0.weight"], w["net.0.bias"])
    a = h.relu()
    return {"x": x, "net.0/linear": h, "net.1/relu": a, "net.2/linear": F.linear(a, w["net.2.weight"], w["net.2.bias"])}


def test_bf16_mixed_forward_statistics_are_of_the_bf16_tensors_held(tmp_path: Path) -> None:
    model, init, logged = fit(tmp_path, monitor(), precision="bf16-mixed")
    ((x, _),) = model.first_batches
    with torch.autocast("cpu", dtype=torch.bfloat16):
        held = forward_nodes(x, init)
    exact = forward_nodes(x.double(), {k: v.double() for k, v in init.items()})
    assert held["net.0/linear"].dtype == held["net.2/linear"].dtype == torch.bfloat16
    for label, t in held.items():
        assert logged[f"scale/fwd/{label}"] == pytest.approx(std(t), rel=REL), label
    for label in ("net.0/linear", "net.2/linear"):  # and bf16 rounding is visible at this tolerance
        assert logged[f"scale/fwd/{label}"] != pytest.approx(std(exact[label]), rel=REL), label
    for name, p in init.items():  # parameters stay float32 under mixed precision
        assert logged[f"scale/fwd/{name}"] == pytest.approx(std(p), rel=REL), name
    assert all(f"scale/bwd/{label}" in logged for label in ("net.0/linear", "net.1/relu", "net.2/linear"))
    assert "scale_loss/loss_scale" not in logged  # bf16 needs no GradScaler


def _grad_scaler_runs(
    tmp_path: Path, accumulate: int
) -> Tuple[Dict[str, float], Dict[str, float], float, Net, Dict[str, Tensor]]:
    runs = {}
    for unscale in (False, True):
        probe = ScaleProbe()
        plugin = MixedPrecision("16-mixed", "cpu")
        model, init, logged = fit(
            tmp_path / f"{unscale}",
            monitor(unscale_gradients=unscale),
            [probe],
            plugins=[plugin],
            accumulate_grad_batches=accumulate,
        )
        assert plugin.scaler is not None and len(probe.scales) == accumulate
        assert len(set(probe.scales)) == 1, "one scale for every micro-batch of the step"
        runs[unscale] = (logged, probe.scales[0], model, init)
    (scaled, scale, model, init), (unscaled, scale_b, _, _) = runs[False], runs[True]
    assert scale == scale_b
    return scaled, unscaled, scale, model, init


def test_grad_scaler_loss_scale_is_logged_and_carried_by_gradients(tmp_path: Path) -> None:
    scaled, unscaled, scale, model, init = _grad_scaler_runs(tmp_path, accumulate=1)
    assert scale == 2.0**16  # GradScaler's initial scale: a real scaler, not a no-op
    assert scaled["scale_loss/loss_scale"] == scale == unscaled["scale_loss/loss_scale"]
    bwd = [tag for tag in scaled if tag.startswith("scale/bwd/")]
    # 7 nodes and 4 module outputs (net, net.0, net.1, net.2)
    assert len(bwd) == 11 and bwd == [tag for tag in unscaled if tag.startswith("scale/bwd/")]
    for tag in bwd:
        assert scaled[tag] / unscaled[tag] == pytest.approx(scale, rel=1e-6), tag
    for tag in (t for t in scaled if t.startswith("scale/fwd/")):
        assert scaled[tag] == unscaled[tag], tag
    # The output's gradient, written out: d(mse)/d(out) of the float16 output, times the scale.
    ((x, y),) = model.first_batches
    with torch.autocast("cpu", dtype=torch.float16):
        out = forward_nodes(x, init)["net.2/linear"]
    assert out.dtype == torch.float16
    grad = 2 * (out.double() - y.double()) / y.numel()
    assert scaled["scale/bwd/net.2/linear"] == pytest.approx(std(grad) * scale, rel=2e-3)
    assert unscaled["scale/bwd/net.2/linear"] == pytest.approx(std(grad), rel=2e-3)


def test_unscale_gradients_also_removes_the_accumulation_factor(tmp_path: Path) -> None:
    scaled, unscaled, scale, _, _ = _grad_scaler_runs(tmp_path, accumulate=2)
    for tag in (t for t in scaled if t.startswith("scale/bwd/")):
        assert scaled[tag] / unscaled[tag] == pytest.approx(scale / 2, rel=1e-6), tag


def test_bf16_true_runs_and_logs_the_bf16_tensors(tmp_path: Path) -> None:
    model, init, logged = fit(tmp_path, monitor(), precision="bf16-true")
    ((x, _),) = model.first_batches
    assert x.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.bfloat16
    held = forward_nodes(x, {k: v.to(torch.bfloat16) for k, v in init.items()})
    for label, t in held.items():
        assert logged[f"scale/fwd/{label}"] == pytest.approx(std(t), rel=REL), label
    for name, p in init.items():
        assert logged[f"scale/fwd/{name}"] == pytest.approx(std(p.to(torch.bfloat16)), rel=REL), name
    bwd = {tag: v for tag, v in logged.items() if tag.startswith("scale/bwd/")}
    assert len(bwd) == 11 and all(0 < v < float("inf") for v in bwd.values())
