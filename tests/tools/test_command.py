"""The ``lightning-scale`` command: its subcommands on real logs, and bad input as exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_scale.tools import synthetic
from lightning_scale.tools.cli import main


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("logs")
    synthetic.main(["--nodes", "12", "--steps", "3", "--logdir", str(root / "run_a")])
    return root


def test_runs_lists_each_run_with_its_steps_and_nodes(logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", str(logs)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run_a: 3 tracked steps (0..")
    assert "12 nodes, statistics absmax, std" in out


def test_a_path_without_runs_is_exit_status_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"lightning-scale runs: error: `{tmp_path / 'missing'}` does not exist"
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 2
    assert "holds no run written by ScaleMonitor" in capsys.readouterr().err


def test_the_console_script_module_runs_and_says_its_commands() -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_scale.tools.cli", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "runs" in done.stdout and "usage: lightning-scale" in done.stdout
