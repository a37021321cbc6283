"""Every Trainer mode with ScaleMonitor: fast_dev_run, overfit_batches, limit_*_batches,
sanity checking, validate/test/predict after fit, dummy or absent loggers; and the
background writer: in order, flushed at fit end and on exceptions, its errors warned."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger, TensorBoardLogger
from lightning.pytorch.loggers.logger import DummyLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.report.worker import Worker

pytestmark = pytest.mark.filterwarnings(
    "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
)


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.losses: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = F.mse_loss(self(batch[0]), batch[1])
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", F.mse_loss(self(batch[0]), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)), batch_size=4)


def trainer(tmp_path: Path, callbacks: List[Any], logger: Any = None, **kwargs: Any) -> pl.Trainer:
    logger = TensorBoardLogger(str(tmp_path), name="", version="") if logger is None else logger
    opts: Dict[str, Any] = dict(
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(default_root_dir=str(tmp_path), callbacks=callbacks, **{**opts, **kwargs})


def steps(tmp_path: Path, tag: str) -> List[int]:
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def monitor(**kwargs: Any) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=1, histograms=False, code=False, **kwargs)


def ours(record: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in record if "ScaleMonitor" in str(w.message)]


# ---- Trainer modes -----------------------------------------------------------------------


def test_fast_dev_run_tracks_and_writes_nothing(tmp_path: Path) -> None:
    mon = monitor()
    t = trainer(tmp_path, [mon], fast_dev_run=2)
    assert isinstance(t.logger, DummyLogger)  # what Lightning swaps in
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        t.fit(MLP(), loader(), loader())
    assert mon.last_tracked_step == 1 and not ours(record)


def test_overfit_and_limited_batches_with_validation_tracking(tmp_path: Path) -> None:
    mon = monitor(track_validation=True)
    t = trainer(tmp_path, [mon], overfit_batches=2, max_epochs=2, limit_val_batches=1, num_sanity_val_steps=2)
    t.fit(MLP(), loader(), loader())
    assert steps(tmp_path, "scale/fwd/net.0/linear") == [0, 1, 2, 3]
    # validation after each epoch (at global steps 2 and 4), never the sanity check
    assert steps(tmp_path, "val_scale/fwd/net.0/linear") == [2, 4]


def test_limit_batches_then_validate_test_predict(tmp_path: Path) -> None:
    mon, model = monitor(track_validation=True), MLP()
    t = trainer(
        tmp_path,
        [mon],
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=2,
        limit_test_batches=1,
        limit_predict_batches=1,
    )
    t.fit(model, loader(), loader())
    t.validate(model, loader())
    t.test(model, loader())
    out = t.predict(model, loader())
    assert steps(tmp_path, "scale/fwd/net.0/linear") == [0, 1, 2]
    assert steps(tmp_path, "val_scale/fwd/net.0/linear") == [3, 3]  # after the epoch, and validate()
    assert out is not None and out[0].shape == (4, 3)
    assert "forward" not in model.__dict__ and "forward" not in model.net.__dict__


def test_dummy_logger_beside_a_real_one_and_no_logger_off_rank_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = trainer(
        tmp_path,
        [monitor()],
        logger=[DummyLogger(), TensorBoardLogger(str(tmp_path), name="", version="")],
        max_steps=2,
    )
    t.fit(MLP(), loader())
    assert steps(tmp_path, "scale/fwd/net.0/linear") == [0, 1]
    # Another rank: no logger at all is fine there, only rank zero writes.
    monkeypatch.setattr(pl.Trainer, "is_global_zero", property(lambda self: False))
    mon = monitor()
    trainer(tmp_path / "rank1", [mon], logger=False, max_steps=2).fit(MLP(), loader())
    assert mon.last_tracked_step == 1


# ---- the background writer ---------------------------------------------------------------


class Exploding(Logger):
    """A logger whose every write raises."""

    name, version = "exploding", 0

    @property
    def experiment(self) -> None:
        return None

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        raise OSError("disk full")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_writer_errors_are_warned_and_training_is_unchanged(tmp_path: Path) -> None:
    pl.seed_everything(3, verbose=False)
    plain = MLP()
    trainer(tmp_path / "plain", [], max_steps=3).fit(plain, loader())
    pl.seed_everything(3, verbose=False)
    model = MLP()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(tmp_path, [monitor()], logger=Exploding(), max_steps=3).fit(model, loader())
    assert ours(record) == [  # once, and writing to that logger stops
        "ScaleMonitor: writing to Exploding failed at step 0 (OSError: disk full); it writes nothing more to that "
        "logger this run: its scale scalars from step 0 on are lost. Training continues."
    ]
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, model.losses)) and len(model.losses) == 3


class FailsAtStep(MLP):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.global_step == 3:
            raise RuntimeError("boom at step 3")
        return super().training_step(batch, batch_idx)


def test_every_step_is_written_in_order_and_flushed_on_an_exception(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer(tmp_path, [monitor()], max_steps=6).fit(FailsAtStep(), loader())
    assert steps(tmp_path, "scale/fwd/net.0/linear") == [0, 1, 2]


def test_worker_runs_jobs_in_order_and_survives_errors() -> None:
    worker, seen = Worker(), []

    def job(i: int) -> None:
        time.sleep(0.001 * (i % 3))  # uneven durations must not reorder anything
        if i == 5:
            raise ValueError("bad job")
        seen.append((i, threading.current_thread().name))

    with pytest.warns(UserWarning, match=r"ScaleMonitor: writing job 5 failed \(ValueError: bad job\)"):
        for i in range(20):
            worker.submit(f"job {i}", job, i)
        worker.flush()
    assert [i for i, _ in seen] == [i for i in range(20) if i != 5]
    assert {name for _, name in seen} == {"lightning-scale-writer"} and worker.errors == 1
    worker.close()
    worker.submit("again", job, 6)  # a closed worker starts again
    worker.flush()
    assert seen[-1][0] == 6
    worker.close()


def test_worker_run_now_runs_on_the_calling_thread_and_warns_errors() -> None:
    worker, seen = Worker(), []

    def job(i: int) -> None:
        if i < 0:
            raise ValueError("bad logger")
        seen.append((i, threading.get_ident()))

    worker.run_now("step 1", job, 1)
    with pytest.warns(UserWarning, match=r"ScaleMonitor: writing step 2 failed \(ValueError: bad logger\)"):
        worker.run_now("step 2", job, -1)
    assert seen == [(1, threading.get_ident())] and worker.errors == 1
    assert worker._thread is None  # no thread was started for it
