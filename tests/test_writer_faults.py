"""The callback's writing can never end or change a fit: a full disk, a log dir that turns
read-only, a byte cap. Real ``Trainer`` runs on a small tmpfs where we are root (a patched
file system otherwise), compared with the same fit without the callback."""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub.io import gfile
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.report.event_file import SUFFIX

ROOT = os.geteuid() == 0


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class AtStep(pl.Callback):
    """Calls ``action`` once, at the end of optimizer step ``step``."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.action()


def fit(root: Path, steps: int, callbacks: List[pl.Callback]) -> Tuple[Dict[str, Tensor], List[str], List[Any]]:
    """Train ``MLP`` for ``steps`` steps with a TensorBoard logger in ``root`` (Lightning itself
    logs rarely: ``log_every_n_steps`` 1000); its parameters, ScaleMonitor's warnings and
    any exception a thread raised."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=pl.loggers.TensorBoardLogger(str(root), name="run"),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1000,
    )
    model, raised = MLP(), []
    hook, threading.excepthook = threading.excepthook, raised.append
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(model, DataLoader(data, batch_size=8))
    finally:
        threading.excepthook = hook
    assert trainer.global_step == steps
    ours = [str(w.message) for w in record if str(w.message).startswith("ScaleMonitor") and "writ" in str(w.message)]
    return {k: v.clone() for k, v in model.state_dict().items()}, ours, raised


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Path, Callable[[], None]]]:
    """A 256 KiB file system and a way to make it read-only: a tmpfs where we are root, else
    TensorBoard's local file system patched to fail as one would (ENOSPC, EROFS)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if ROOT:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], check=True)
        try:
            yield disk, lambda: subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        finally:
            subprocess.run(["umount", str(disk)], check=True)
        return
    state = {"bytes": 0, "ro": False}
    write = gfile.LocalFileSystem._write

    def failing(self: Any, filename: Any, content: Any, mode: str) -> None:
        if state["ro"]:
            raise OSError(errno.EROFS, "Read-only file system", filename)
        state["bytes"] += len(content)
        if state["bytes"] > 256 * 1024:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        write(self, filename, content, mode)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", failing)
    yield disk, lambda: state.update(ro=True)


def equal(a: Dict[str, Tensor], b: Dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_disk_stops_our_writing_with_one_warning_and_the_fit_goes_on(small_disk: Any, tmp_path: Path) -> None:
    disk, _ = small_disk
    plain, none, raised = fit(disk / "plain", 40, [])  # without the callback the fit fits on this disk
    assert none == [] and raised == []
    tracked, warned, raised = fit(disk / "tracked", 40, [ScaleMonitor(every_n_steps=1)])
    assert equal(plain, tracked)  # bit-identical training
    assert raised == []  # no writer thread raised into the process
    assert len(warned) == 1 and "failed" in warned[0] and "No space left on device" in warned[0], warned
    assert "from step" in warned[0] and "Training continues" in warned[0]
    # what was written before the disk filled is readable, up to the step named
    first_lost = int(warned[0].split("from step ")[1].split(" ")[0])
    log_dir = disk / "tracked" / "run" / "version_0"
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("scale/fwd/net.0/linear")]
    assert 0 < first_lost < 40 and steps == list(range(first_lost))


def test_a_log_dir_turned_read_only_stops_our_writing_with_one_warning(small_disk: Any) -> None:
    disk, read_only = small_disk
    plain, _, _ = fit(disk / "plain", 6, [])
    monitor = ScaleMonitor(every_n_steps=1)

    def written_then_read_only() -> None:
        monitor.reporter.flush()  # steps 0 and 1 on disk (the writer runs behind training)
        read_only()

    tracked, warned, raised = fit(disk / "tracked", 6, [monitor, AtStep(2, written_then_read_only)])
    assert equal(plain, tracked) and raised == []
    assert len(warned) == 1 and "Read-only file system" in warned[0] and "from step 2 on" in warned[0], warned


def test_max_log_bytes_caps_our_event_file_with_one_warning(tmp_path: Path) -> None:
    cap = 60_000
    plain, _, _ = fit(tmp_path / "plain", 20, [])
    tracked, warned, raised = fit(tmp_path / "tracked", 20, [ScaleMonitor(every_n_steps=1, max_log_bytes=cap)])
    assert equal(plain, tracked) and raised == []
    assert len(warned) == 1 and f"`max_log_bytes`={cap}" in warned[0] and "from step" in warned[0], warned
    (ours,) = (tmp_path / "tracked" / "run" / "version_0").glob(f"*{SUFFIX}")
    size = ours.stat().st_size
    # within the cap (and its 8 + 8-byte file header), less than one step of ~13 KB short of it
    assert cap - 20_000 < size <= cap + 64, size
    uncapped, _, _ = fit(tmp_path / "uncapped", 20, [ScaleMonitor(every_n_steps=1)])
    (full,) = (tmp_path / "uncapped" / "run" / "version_0").glob(f"*{SUFFIX}")
    assert full.stat().st_size > 3 * cap  # (the cap did stop something)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1M"])
def test_max_log_bytes_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"`max_log_bytes` must be a positive integer or None \(bytes\), got "):
        ScaleMonitor(max_log_bytes=bad)


class FailingCSV(pl.loggers.CSVLogger):
    """A CSV logger whose ``log_metrics`` raises (a full disk, a network share gone)."""

    calls = 0

    def log_metrics(self, metrics: Dict[str, float], step: Any = None) -> None:
        type(self).calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")


def test_another_loggers_failure_stops_our_writing_to_it_with_one_warning(tmp_path: Path) -> None:
    plain, _, _ = fit(tmp_path / "plain", 5, [])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=5,
        logger=FailingCSV(str(tmp_path / "csv")),
        callbacks=[ScaleMonitor(every_n_steps=1)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1000,
    )
    model = MLP()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=8))
    warned = [str(w.message) for w in record if str(w.message).startswith("ScaleMonitor: writing")]
    assert len(warned) == 1 and "writing to FailingCSV failed at step 0 (OSError: [Errno 28]" in warned[0], warned
    assert "its scale scalars from step 0 on are lost" in warned[0]
    assert FailingCSV.calls == 1  # tried once: the later steps are not written to it
    assert equal(plain, {k: v for k, v in model.state_dict().items()})
