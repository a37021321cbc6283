"""LightningCLI: ScaleMonitor configured from examples/cli_config.yaml, run in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


def _parser() -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ScaleMonitor, "monitor")
    return parser


def _build(parser: Any, yaml: str) -> ScaleMonitor:
    cfg = parser.parse_string(yaml)
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    return build(cfg).monitor


def test_yaml_lists_and_nulls_reach_scale_monitor_as_lists_and_none() -> None:
    """jsonargparse passes YAML lists as lists: the type hints of `__init__` still parse, and
    the values pass the argument checks."""
    parser = _parser()
    yaml = "monitor:\n  every_n_steps: null\n  steps: [1, 4]\n  statistics: [std, absmax]\n"
    monitor = _build(parser, yaml + "  leaf_modules: [blocks.0]\n  exclude: 'fc\\d'\n  submodule: model\n")
    assert monitor.schedule.every_n_steps is None and monitor.schedule.steps == [1, 4]
    assert monitor.statistics == ["std", "absmax"] and monitor.leaf_modules == ["blocks.0"]
    assert monitor.exclude is not None and monitor.exclude.pattern == r"fc\d" and monitor.submodule == "model"


def test_a_bad_yaml_value_is_a_value_error_naming_the_argument() -> None:
    parser = _parser()
    with pytest.raises(ValueError, match=r"`statistics` must name each statistic once, got \['std', 'std'\]"):
        _build(parser, "monitor:\n  statistics: [std, std]\n")
    with pytest.raises(ValueError, match=r"`anomaly_factor` must be a finite number above 1, got inf"):
        _build(parser, "monitor:\n  anomaly_factor: .inf\n")


def test_yaml_names_the_block_kurtosis_and_channel_statistics() -> None:
    """The opt-in statistics by name from YAML: each switches its group on."""
    parser = _parser()
    names = ["std", "kurtosis", "mxfp4_snr_db", "nvfp4_flushed", "channel_max_ratio", "outlier_channels"]
    monitor = _build(parser, f"monitor:\n  statistics: [{', '.join(names)}]\n")
    assert monitor.statistics == names
    assert monitor.groups == ["blocks", "channels", "kurtosis", "moments"]
    with pytest.raises(ValueError, match=r"unknown statistic 'channel_ratio'; .*'channel_max_ratio'"):
        _build(parser, "monitor:\n  statistics: [channel_ratio]\n")


def test_yaml_names_a_user_statistic_by_its_import_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``Statistic`` object from YAML: its dotted import path, resolved at construction."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent / "dist_scripts"))
    import user_statistics

    parser = _parser()
    monitor = _build(parser, "monitor:\n  statistics: [std, user_statistics.MEAN_ABS, user_statistics.PEAK_SQ]\n")
    assert monitor.statistics == ["std", "mean_abs", "peak_sq"]
    assert monitor.groups == ["moments", user_statistics.MEAN_ABS.group, user_statistics.PEAK_SQ.group]
    with pytest.raises(ValueError, match=r"`statistics`: 'user_statistics.torch' is a module, not a `lightning_scale"):
        _build(parser, "monitor:\n  statistics: [user_statistics.torch]\n")
    with pytest.raises(ValueError, match=r"`statistics`: cannot import 'no_such_module.MEAN_ABS' \(ModuleNotFound"):
        _build(parser, "monitor:\n  statistics: [no_such_module.MEAN_ABS]\n")
