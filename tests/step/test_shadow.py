"""The shadow pass (``ScaleMonitor(shadow=...)``, ``lightning_scale/step/shadow.py``).

Its backward leaves every ``.grad`` alone and fires no accumulation hook, while tensor hooks
see the gradients a real backward computes. In real ``Trainer`` fits (a model with dropout and
BatchNorm; gradient accumulation; ``bf16-mixed`` autocast; manual optimization; validation)
training with ``shadow="always"`` is bit-identical to training without the callback, and,
where tracking in place is bit-identical too (an eager model on the CPU), the shadow logs
exactly what tracking in place logs: the same tensors, from the same state and random
numbers. A shadow that fails, or that no backward lets run, warns once and changes nothing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn

from lightning_scale import ScaleMonitor
from lightning_scale.capture import capture
from lightning_scale.step import shadow as shadow_module
from lightning_scale.step.captures import Captures
from lightning_scale.step.selection import Selection
from lightning_scale.step.shadow import Modes, backward_apart, graph_leaves

pytestmark = pytest.mark.filterwarnings(
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
)


def test_backward_apart_leaves_grad_alone_and_hooks_see_the_gradients() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 4, requires_grad=True)
    seed = torch.randn(5, 3)
    want = torch.autograd.grad(net(x), [*net.parameters(), x], seed)  # (a real backward's gradients)

    sentinel = [torch.full_like(p, 7.0) for p in net.parameters()]
    for p, s in zip(net.parameters(), sentinel):
        p.grad = s.clone()
    accumulated: List[int] = []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda t: accumulated.append(1))
    seen: Dict[str, Tensor] = {}
    hidden = net[1](net[0](x))
    hidden.register_hook(lambda g: seen.__setitem__("hidden", g.clone()))
    for i, p in enumerate(net.parameters()):
        p.register_hook(lambda g, i=i: seen.__setitem__(f"p{i}", g.clone()))
    x.register_hook(lambda g: seen.__setitem__("x", g.clone()))
    out = net[2](hidden)

    assert {id(t) for t in graph_leaves([out])} == {id(t) for t in [*net.parameters(), x]}
    backward_apart([out], [seed])
    for i, (p, s) in enumerate(zip(net.parameters(), sentinel)):
        assert torch.equal(p.grad, s), i  # untouched
        assert torch.equal(seen[f"p{i}"], want[i]), i  # the hooks saw the real gradient
    assert x.grad is None and torch.equal(seen["x"], want[-1])
    assert "hidden" in seen and not accumulated  # (DDP's all-reduce is such an accumulation hook)


def test_modes_are_those_the_forward_ran_in() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        modes = Modes.now()
    assert modes == Modes(grad=False, inference=False, autocast=(("cpu", torch.bfloat16),))
    lin = nn.Linear(4, 4)
    with modes.entered():
        out = lin(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and not out.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16), Modes(True, False, ()).entered():
        assert lin(torch.randn(2, 4)).dtype == torch.float32  # (autocast off where the forward had it off)


class Net(pl.LightningModule):
    """Dropout (draws random numbers) and BatchNorm (updates buffers in forward); the loss
    draws a random number too, so the state the step leaves is not the forward's."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))
        self.automatic_optimization = not manual
        self.skip_at: Optional[int] = None

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Optional[Tensor]:
        loss = self(batch).pow(2).mean() + 1e-3 * torch.rand(())  # (a draw after the forward)
        if self.global_step == self.skip_at:
            return None  # (no backward, no optimizer step)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        self.log("val_loss", self(batch).pow(2).mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def fit(path: Path, monitor: Optional[ScaleMonitor], module: Optional[Net] = None, **trainer: Any) -> Net:
    torch.manual_seed(1)
    data = torch.utils.data.DataLoader(torch.randn(32, 8), batch_size=4)
    module = module or Net()
    pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=TensorBoardLogger(str(path), name="", version=""),
        callbacks=[monitor] if monitor is not None else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer,
    ).fit(module, data, data if "limit_val_batches" in trainer else None)
    return module


def logged(path: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    keep = ("scale/", "val_scale/")
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"] if t.startswith(keep)}


def same_state(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def three_fits(tmp_path: Path, make: Any = Net, **kwargs: Any) -> Tuple[Net, Net, Dict[str, Any], Dict[str, Any]]:
    """Without the callback, with ``shadow="always"``, and tracked in place (``"never"``)."""
    trainer = {k: kwargs.pop(k) for k in list(kwargs) if k in ("precision", "accumulate_grad_batches")}
    trainer.update({k: kwargs.pop(k) for k in list(kwargs) if k in ("limit_val_batches", "val_check_interval")})
    plain = fit(tmp_path / "plain", None, make(), **trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shadowed = fit(tmp_path / "shadow", ScaleMonitor(every_n_steps=2, shadow="always", **kwargs), make(), **trainer)
    fit(tmp_path / "inplace", ScaleMonitor(every_n_steps=2, shadow="never", **kwargs), make(), **trainer)
    ours = [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)]
    assert ours == []
    return plain, shadowed, logged(tmp_path / "shadow"), logged(tmp_path / "inplace")


@pytest.mark.parametrize("case", ["plain", "accumulate", "bf16-mixed"])
def test_shadow_trains_bit_identically_and_logs_what_tracking_in_place_logs(tmp_path: Path, case: str) -> None:
    kwargs = {"accumulate": {"accumulate_grad_batches": 2}, "bf16-mixed": {"precision": "bf16-mixed"}}.get(case, {})
    plain, shadowed, got, want = three_fits(tmp_path, **kwargs)
    assert same_state(plain, shadowed)  # parameters, BatchNorm's running statistics and its count
    assert "scale/fwd/body.3/dropout" in want and "scale/bwd/body.0.weight" in want and "scale/fwd/body.1" in want
    assert got == want  # the same tensors, bit for bit: the eager route reproduces the forward
    assert all(set(v) == {0, 2} for v in got.values())


def test_shadow_under_manual_optimization(tmp_path: Path) -> None:
    """``manual_backward`` fires ``on_after_backward``: the shadow runs there, before ``opt.step()``."""
    plain, shadowed, got, want = three_fits(tmp_path, make=lambda: Net(manual=True))
    assert same_state(plain, shadowed)
    assert got == want and "scale/bwd/body.4/linear" in got


def test_shadow_of_validation_runs_the_forward_only(tmp_path: Path) -> None:
    plain, shadowed, got, want = three_fits(tmp_path, track_validation=True, limit_val_batches=1, val_check_interval=2)
    assert same_state(plain, shadowed)
    val = {t: v for t, v in got.items() if t.startswith("val_scale/")}
    assert "val_scale/fwd/body.4/linear" in val and not any("/bwd/" in t for t in val)
    assert got == want


def test_a_failing_shadow_warns_once_and_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("injected")

    plain = fit(tmp_path / "plain", None)
    monkeypatch.setattr(shadow_module, "backward_apart", broken)
    with pytest.warns(UserWarning) as record:
        shadowed = fit(tmp_path / "shadow", ScaleMonitor(every_n_steps=2, shadow="always"))
    ours = [str(w.message) for w in record if "ScaleMonitor" in str(w.message)]
    assert len(ours) == 1 and "the shadow pass failed (RuntimeError: injected)" in ours[0], ours
    assert same_state(plain, shadowed) and logged(tmp_path / "shadow") == {}


def test_a_step_without_backward_logs_nothing_and_says_why(tmp_path: Path) -> None:
    """Step 0 returns no loss (no backward, no optimizer step): its shadow cannot run."""
    make = lambda: Net()  # noqa: E731

    def skipping() -> Net:
        net = make()
        net.skip_at = 0
        return net

    plain = fit(tmp_path / "plain", None, skipping())
    with pytest.warns(UserWarning, match=r"the shadow pass did not run: no backward came after the model's forward"):
        shadowed = fit(tmp_path / "shadow", ScaleMonitor(every_n_steps=1, shadow="always"), skipping())
    assert same_state(plain, shadowed)
    got = logged(tmp_path / "shadow")
    assert got and all(0 not in v for v in got.values())  # the later steps are logged


def captures(shadow: str) -> Tuple[Captures, List[str]]:
    said: List[str] = []
    made = Captures(
        mode="auto",
        leaf_modules=[],
        verify=True,
        selection=Selection(None, None, True),
        info=said.append,
        warn=said.append,
        shadow=shadow,
    )
    return made, said


def test_no_shadow_under_strategies_that_expect_one_backward_per_forward() -> None:
    model = nn.Linear(2, 2)
    always, said = captures("always")
    cap = always.of(model, train=True)
    assert cap is not None and cap.shadowed
    assert always.verifier(model, cap, "DDPStrategy", lambda ok: ok) is None  # (shadowing: no probe)
    assert always.trackable(cap, "DDPStrategy") and not always.disabled
    assert not always.trackable(cap, "FSDPStrategy")
    assert said == [
        "ScaleMonitor: a shadow pass (`shadow='always'`) cannot run under FSDPStrategy, whose backward hooks "
        "expect one backward per forward; training continues untracked."
    ]
    auto, _ = captures("auto")
    cap = auto.of(model, train=True)
    assert cap is not None and not cap.shadowed and auto.trackable(cap, "FSDPStrategy")
    assert capture(model, "fx").shadowed is False
