"""The environment switches: read once, into ``Settings``, checked, and named in the status line."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.record.settings import Settings


def test_every_switch_is_parsed_at_once_with_its_default() -> None:
    assert Settings.from_env({}) == Settings("auto", "auto", None, True, None)
    env = {
        "LIGHTNING_SCALE_KERNEL": "Triton",
        "LIGHTNING_SCALE_COMPILED_STATS": "ops",
        "LIGHTNING_SCALE_HOST_READS": "0",
        "LIGHTNING_SCALE_NATIVE": "0",
        "LIGHTNING_SCALE_CACHE": "/tmp/ls-cache",
    }
    got = Settings.from_env(env)
    assert got == Settings("triton", "ops", False, False, "/tmp/ls-cache")
    assert got.line() == "settings: kernel=triton, compiled statistics=ops, host reads=false, native kernel off"


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("KERNEL", "cuda", r"`LIGHTNING_SCALE_KERNEL` must be one of auto, triton, torch; got 'cuda'"),
        ("COMPILED_STATS", "fast", r"`LIGHTNING_SCALE_COMPILED_STATS` must be one of auto, host, ops; got 'fast'"),
        ("HOST_READS", "yes", r"`LIGHTNING_SCALE_HOST_READS` must be 0 \(device path forced\) or 1 .*, got 'yes'"),
        ("NATIVE", "off", r"`LIGHTNING_SCALE_NATIVE` must be 0 \(off\) or 1 \(on, the default\), got 'off'"),
    ],
)
def test_a_bad_switch_is_a_value_error_naming_it(name: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Settings.from_env({f"LIGHTNING_SCALE_{name}": value})


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_the_fit_reads_them_at_its_start_and_says_what_is_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LIGHTNING_SCALE_COMPILED_STATS", "ops")
    monitor = ScaleMonitor(every_n_steps=1)  # (built before: the switches are read at fit start)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    trainer = pl.Trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[monitor], enable_progress_bar=False)
    with caplog.at_level(logging.INFO):
        trainer.fit(Tiny(), data)
    assert monitor.settings is not None and monitor.settings.compiled_stats == "ops"
    assert "settings: kernel=auto, compiled statistics=ops, host reads=by device" in caplog.text
    monkeypatch.setenv("LIGHTNING_SCALE_KERNEL", "gpu")
    with pytest.raises(ValueError, match=r"`LIGHTNING_SCALE_KERNEL` must be one of"):
        pl.Trainer(max_steps=1, default_root_dir=tmp_path, callbacks=[ScaleMonitor()], enable_progress_bar=False).fit(
            Tiny(), data
        )
