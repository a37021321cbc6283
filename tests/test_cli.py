"""LightningCLI: ScaleMonitor configured from examples/cli_config.yaml, run in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_scale import ScaleMonitor

pytest.importorskip("jsonargparse")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("examples_cli", EXAMPLES / "cli.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_config_sets_up_scale_monitor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # pytest's own arguments are not the CLI's
    args = [
        "fit",
        "--config",
        str(EXAMPLES / "cli_config.yaml"),
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    args += [
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=1",
    ]
    cli = load_example().main(args)

    [monitor] = [c for c in cli.trainer.callbacks if isinstance(c, ScaleMonitor)]
    assert monitor.statistics == ["std", "absmax", "underflow_e4m3"]
    assert monitor.schedule.every_n_steps == 50 and monitor.capture_mode == "auto"
    assert monitor.include is not None and monitor.include.pattern == r"blocks\.0\.|head|ln_f"
    assert cli.model.hparams.seq == cli.datamodule.seq == 16  # linked
    assert cli.trainer.global_step == 2

    acc = EventAccumulator(
        cli.trainer.logger.log_dir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0, "images": 0}
    )
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if "/fwd/" in t or "/bwd/" in t]
    for stat in ("scale", "absmax", "underflow_e4m3"):
        assert f"{stat}/fwd/model.blocks.0.mlp.fc1/linear" in tags
        assert f"{stat}/bwd/model.blocks.0.mlp.fc1/linear" in tags
    assert "scale/fwd/model.head/linear" in tags
    assert not [t for t in tags if "blocks.1." in t]  # outside `include`
    assert {e.step for t in tags for e in acc.Scalars(t)} == {0}
    assert "scale_hist/fwd" in acc.Tags()["histograms"]
