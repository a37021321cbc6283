"""Exactly one device-to-host transfer per tracked step, none on untracked steps.

A CPU proxy for host syncs (no accelerator needed): with the device path forced
(``LIGHTNING_SCALE_HOST_READS=0``), a ``TorchDispatchMode`` counts
``aten._local_scalar_dense`` (behind ``.item()``, ``float(t)``, ``bool(t)``) and ops whose
output shape depends on the data (``nonzero``, ``masked_select``, ``unique``,
``bincount``, ...), and a ``TorchFunctionMode`` counts ``.cpu()``, ``.tolist()``,
``.numpy()`` and ``.to("cpu")``. Host copies (what a ``.cpu()`` returned, and everything
computed from it) are host data: reading them is free on an accelerator, so it is not
counted. The user's own reads (Lightning's loop, the GradScaler's ``found_inf.item()``)
are separated by running the same fit without the callback and subtracting, step by step.
On CPU a read or a move may return its input itself, so the counter keeps the real-device
meaning: a read returns a host copy (a clone here) and leaves its input device data; a
host tensor moved to the device is device data. The data set and the freshly built model
are host data, so Lightning's moves of batches and of the model are uploads, and what
training computes from them is device data whose every read is seen.
The background writer's thread is counted too.

With ``anomaly_steps`` on, the detector adds one read per step, and it is counted as one:
the 3-number loss payload queued at a batch end is copied to the host with
``non_blocking=True`` at the next batch start and read a batch later (on CUDA into pinned
memory behind an event; see ``lightning_scale.step.anomaly``). It never blocks on the step in
flight, but it is a device-to-host copy, so the test asserts exactly one such
non-blocking copy on every step after the first, and, beside it, still exactly one
blocking transfer per tracked step (the triggered ones included) and none untracked.
``update_ratios`` adds rows to the tracked step's payload and no transfer.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.record import stats
from lightning_scale.report.worker import Worker

pytestmark = pytest.mark.filterwarnings(
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
)

aten = torch.ops.aten
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
}
_READS = {Tensor.cpu, Tensor.tolist, Tensor.numpy}
_FROM_PYTHON = {torch.tensor, torch.as_tensor}
_HOST = "_sync_counter_host"  # attribute that marks host data


def _is_host(t: Any) -> bool:
    return isinstance(t, Tensor) and getattr(t, _HOST, False)


def _moves(func: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """``t.to(device, ...)``: on CPU every device is the host, so any device argument
    counts as a move (a download from device data, an upload from host data)."""
    if func is not Tensor.to:
        return False
    leaves, _ = tree_flatten((args[1:], kwargs))
    return any(isinstance(v, (str, torch.device)) for v in leaves)


class SyncCounter:
    """Counts host reads of device data, per step (``step`` set by the caller), per thread."""

    def __init__(self) -> None:
        self.step: Any = "setup"
        self.counts: Counter = Counter()
        self.ops: Dict[Any, List[str]] = {}
        self._lock = threading.Lock()
        outer = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func in _DATA_DEPENDENT and not any(_is_host(a) for a in tree_flatten((args, kwargs))[0]):
                    outer.hit(str(func))
                return func(*args, **(kwargs or {}))

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                inputs = tree_flatten((args, kwargs))[0]
                host = any(_is_host(a) for a in inputs)
                moves = _moves(func, args, kwargs)
                read = func in _READS or (moves and not host)
                if read and not host:
                    lagged = func is Tensor.to and kwargs.get("non_blocking") is True
                    outer.hit("to(non_blocking)" if lagged else getattr(func, "__name__", str(func)))
                written = {id(a) for a in inputs if isinstance(a, Tensor) and not _is_host(a)}
                out = func(*args, **kwargs)
                if read and isinstance(out, Tensor) and any(out is a for a in inputs):
                    out = (
                        out.clone()
                    )  # on CPU a read may return its input; on a device it is a copy, and the input stays device data
                # A host copy, what is computed from one, and tensors made from Python data
                # are host data; a host tensor moved "to a device" is device data again. A
                # device tensor written in place from host data (the GradScaler's scale,
                # updated from its found_inf) stays device data: it lives where it lived.
                if host and moves:  # on CPU ``.to`` may return its input itself: untag it
                    for t in tree_flatten(out)[0]:
                        if _is_host(t):
                            delattr(t, _HOST)
                if (
                    read
                    or (host and not moves)
                    or (func in _FROM_PYTHON and not any(isinstance(a, Tensor) for a in inputs))
                ):
                    for t in tree_flatten(out)[0]:
                        if isinstance(t, Tensor) and (read or id(t) not in written):
                            setattr(t, _HOST, True)
                return out

        self.dispatch, self.function = Dispatch, Function

    def hit(self, what: str) -> None:
        key = self.step if threading.current_thread() is threading.main_thread() else "worker"
        with self._lock:
            self.counts[key] += 1
            self.ops.setdefault(key, []).append(what)

    def __enter__(self) -> "SyncCounter":
        self._modes = [self.function(), self.dispatch()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def test_the_counter_sees_reads_and_not_host_copies() -> None:
    x, z = torch.randn(8), torch.randn(4)
    with SyncCounter() as counter:
        counter.step = 0
        float(x.sum())
        torch.nonzero(x > 0)
        host = (x + 1).cpu()  # on CPU the very same tensor, but a host copy on a device
        host.tolist(), float(host[0] * 2), torch.nonzero(host * 1 > 0)  # host data: free
        x.to("cpu")
        counter.step = 1
        z.numpy()
        z.cpu(), float(z.sum())  # a read leaves the device tensor device data
        counter.step = 2
        uploaded = torch.tensor([1.0, 2.0]).to("cpu")  # made on the host, then moved to the device
        float(uploaded.sum())
    assert counter.counts == Counter({0: 4, 1: 3, 2: 1}), counter.ops


class Net(pl.LightningModule):
    """Two linears and a GELU; the batch at ``nan_step`` carries a NaN."""

    def __init__(self, nan_step: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
        self.nan_step = nan_step
        self.losses: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.global_step == self.nan_step:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = F.mse_loss(self(x).float(), y)
        self.losses.append(loss.detach().clone())
        self.log("loss", loss)  # the user's own read, in both runs
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class StepMarker(Callback):
    """Attributes the counts between two batch starts to the step that began."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counter.step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counter.step = "end"


def _fit(root: Path, monitor: bool, steps: int, nan_step: int, anomaly: bool = False) -> Tuple[SyncCounter, Net]:
    pl.seed_everything(11, verbose=False)
    model, counter = Net(nan_step), SyncCounter()
    callbacks: List[Callback] = [StepMarker(counter)]
    if monitor:
        extra: Dict[str, Any] = {"anomaly_steps": 2, "update_ratios": True} if anomaly else {}
        callbacks.append(
            ScaleMonitor(
                every_n_steps=2,
                statistics=sorted(stats.STATISTICS),
                rank_spread=True,
                value_histograms=r"fc1|fc2/linear",
                unscale_gradients=True,
                figure=True,
                **extra,
            )
        )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    # The data set and the freshly built model live on the host: Lightning's moves of a
    # batch and of the model to the device are uploads, after which they are device data.
    for t in (x, y, *model.parameters()):
        setattr(t, _HOST, True)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        callbacks=callbacks,
        plugins=[MixedPrecision("16-mixed", "cpu")],
        logger=TensorBoardLogger(str(root), name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    with counter:
        trainer.fit(model, data)
    return counter, model


@pytest.fixture()
def worker_counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[SyncCounter]]:
    """Runs the background writer's jobs under the counter of the fit that submitted them."""
    active: List[SyncCounter] = []
    call = Worker._call

    def counted(self: Worker, *job: Any) -> None:
        with active[-1]:
            call(self, *job)

    monkeypatch.setattr(Worker, "_call", counted)
    yield active


def _triton_interpreted() -> bool:
    from lightning_scale.record import kernels

    if kernels.triton_missing() is not None:
        return False
    from lightning_scale.record import triton_stats

    return triton_stats.interpreted()


@pytest.mark.parametrize(
    "anomaly,kernel",
    [
        (False, "torch"),
        (True, "torch"),
        pytest.param(
            False,
            "triton",
            marks=pytest.mark.skipif(not _triton_interpreted(), reason="needs triton with TRITON_INTERPRET=1"),
        ),
    ],
    ids=["schedule", "anomaly", "schedule-triton"],
)
def test_one_transfer_per_tracked_step_and_none_untracked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, worker_counted: List[SyncCounter], anomaly: bool, kernel: str
) -> None:
    """(``triton``: the fused kernel, run by Triton's interpreter on the CPU: the same
    launches and record rows as on a GPU.)"""
    monkeypatch.setenv("LIGHTNING_SCALE_HOST_READS", "0")
    monkeypatch.setenv("LIGHTNING_SCALE_KERNEL", kernel)
    steps, nan_step = 6, 2
    # every 2nd step; the NaN loss (and the GradScaler's skip) at step 2 tracks 4 and 5
    expected = [0, 2, 4, 5] if anomaly else [0, 2, 4]
    plain, plain_model = _fit(tmp_path / "plain", False, steps, nan_step)
    tracked = SyncCounter()
    worker_counted.append(tracked)
    with pytest.warns(UserWarning, match=rf"ScaleMonitor: NaN in the forward pass at step {nan_step}, first at `x`"):
        tracked, model = _fit(tmp_path / "tracked", True, steps, nan_step, anomaly)
    assert len(model.losses) == steps and bool(model.losses[nan_step].isnan())
    torch.testing.assert_close(
        torch.stack(model.losses), torch.stack(plain_model.losses), rtol=0, atol=0, equal_nan=True
    )
    assert plain.counts[nan_step] > 0  # the counter sees the user's reads (GradScaler, logging)
    lagged = {s: int(anomaly and s > 0) for s in range(steps)}  # the detector's copy of step s - 1's loss
    probe = {s: int(s == 0) for s in range(steps)}  # the fidelity probe's verdict, read once at the first tracked step
    ours = {step: tracked.counts[step] - plain.counts[step] for step in range(steps)}
    assert ours == {s: int(s in expected) + lagged[s] + probe[s] for s in range(steps)}, (
        ours,
        tracked.ops.get(0),
        plain.ops.get(0),
    )
    for step in range(steps):  # the one blocking read is the pooled copy; the other the lagged one
        ours_ops = (
            ["cpu"] * (step in expected)
            + ["to(non_blocking)"] * lagged[step]
            + ["aten._local_scalar_dense.default"] * probe[step]
        )
        assert sorted(tracked.ops.get(step, [])) == sorted(plain.ops.get(step, []) + ours_ops), step
    assert tracked.counts["worker"] == 0, tracked.ops.get("worker")
    # and everything was written: every statistic group, spread, histograms, figure
    acc = EventAccumulator(
        str(tmp_path / "tracked"), size_guidance={"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}
    )
    acc.Reload()
    for tag in (
        "scale/fwd/fc1/linear",
        "underflow_e4m3/bwd/fc2/linear",
        "scale_rank_max/fwd/fc1.weight",
        "nan/fwd/x",
        "scale_loss/loss_scale",
    ):
        assert [e.step for e in acc.Scalars(tag)] == expected, tag
    assert [e.step for e in acc.Histograms("values_log2/bwd/fc1/linear")] == expected
    assert [e.step for e in acc.Images("scale_plot")] == [0]
    assert acc.Scalars("nan/fwd/x")[1].value == 1.0
    if anomaly:  # the event, and the ratios riding the tracked steps' one transfer
        (event,) = acc.Scalars("anomaly/loss")
        assert event.step == nan_step and math.isnan(event.value)
        (text,) = acc.Tensors("anomaly/event/text_summary")
        assert "non-finite loss; GradScaler skipped" in text.tensor_proto.string_val[0].decode()
        for name in ("fc1.weight", "fc2.bias"):
            assert [e.step for e in acc.Scalars(f"update_ratio/{name}")] == expected
            assert [e.step for e in acc.Scalars(f"grad_std/{name}")] == expected
        assert acc.Scalars("update_ratio/fc1.weight")[1].value == 0.0  # the skipped step moved nothing
        assert math.isnan(acc.Scalars("grad_std/fc1.weight")[1].value)  # ... because its gradient was not finite
