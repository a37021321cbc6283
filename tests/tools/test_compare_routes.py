"""``lightning-scale compare`` across capture routes and strategies, on real runs: an eager and
a compiled run of the same model, a single-device and a DDP run (two gloo ranks), a float32
and a torchao float8-converted run. Each says what matched and where the runs part."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.tools.cli import main
from tests import compare_runs
from tests.gloo import ROOT, free_port, load_script

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
    ),
    pytest.mark.timeout(600),
]
RUN_DIST = ROOT / "tests" / "dist_scripts" / "run_dist.py"


def compared(capsys: pytest.CaptureFixture[str], *args: Any) -> Dict[str, Any]:
    assert main(["compare", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module", autouse=True)
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    """A 2-rank DDP fit of ``run_dist.py``'s MLP (step 0 tracked), started first: its ranks
    start up while the other runs train."""
    out = tmp_path_factory.mktemp("ddp")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, str(RUN_DIST), str(out), "ddp", "on"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    state: Dict[str, Any] = {"out": out, "proc": proc}
    yield state
    if proc.poll() is None:  # the launcher's own process group: the other rank goes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.fixture(scope="module")
def eager(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compare_runs.fit(tmp_path_factory.mktemp("eager"), "eager")


def test_an_eager_and_a_compiled_run_match_without_divergence(
    eager: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``torch.compile(gpt)`` (``aot_eager``: AOTAutograd's graphs, no C++ compile) logs every
    label of the eager fx route plus the compiled module's own output; the values agree to
    rounding."""
    torch._dynamo.reset()
    compiled = compare_runs.fit(tmp_path, "compiled", compile_backend="aot_eager", steps=1)  # (one compile)
    out = compared(capsys, eager, compiled)
    assert out["steps"] == {"a": 0, "b": 0, "how": "the latest step both runs tracked"}
    assert out["only_a"] == [] and out["only_b"] == ["model/gpt"]
    assert out["matched"] / (out["matched"] + len(out["only_b"])) >= 0.95
    assert out["first_divergence"] is None
    assert max(abs(r["difference"]["log2_std"] or 0.0) for r in out["rows"]) < 1e-3


def test_a_ddp_and_a_single_device_run_differ_by_the_rank_count_in_activation_gradients(
    ddp_run: Dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same MLP, initial weights and global batch (the two ranks' first batches, joined):
    forward statistics agree; each DDP rank's activation gradients are of its own loss, a mean
    over half the batch, so they are exactly 2x the single device's, +1 octave: the first
    divergence is the backward nearest the loss."""
    log, _ = ddp_run["proc"].communicate(timeout=300)
    assert ddp_run["proc"].returncode == 0, log[-3000:]
    out: Path = ddp_run["out"]
    run_dist = load_script(RUN_DIST)
    torch.manual_seed(0)
    torch.randn(16, 8), torch.randn(16, 4)  # the script's data, drawn before the model (same weights)
    module = run_dist.Module(tmp_path, fsdp=False)
    batches = [torch.load(out / f"batch_rank{r}.pt") for r in (0, 1)]
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    monitor = ScaleMonitor(every_n_steps=None, steps=[0], histograms=False, figure=False, code=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=TensorBoardLogger(str(tmp_path), name="single", version=""),
        callbacks=[monitor],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=8))
    result = compared(capsys, tmp_path / "single", out / "logs" / "version_0")
    assert result["matched"] == 15 and result["only_a"] == result["only_b"] == []
    # the DDP run's user statistics (tests/dist_scripts/user_statistics.py) and rank spread
    assert result["statistics"]["only_b"] == ["mean_abs", "peak_sq", "scale_rank_max", "scale_rank_min"]
    params = {f"model.layers.{i}.fc.{p}" for i in (0, 1) for p in ("weight", "bias")}
    for row in result["rows"]:
        diff = row["difference"]["log2_std"]
        if row["direction"] == "fwd":
            assert diff == pytest.approx(0.0, abs=1e-5), row
        elif row["node"] not in params:  # activation gradients (parameter gradients: pooled per rank)
            assert diff == pytest.approx(1.0, abs=1e-5), row
    div = result["first_divergence"]
    assert (div["node"], div["direction"]) == ("model.layers.1.fc", "bwd") and div["difference"] == pytest.approx(1.0)


def test_a_torchao_float8_run_matches_all_but_its_converted_layers(
    eager: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The MLP Linears converted by torchao (emulated float8): fx cannot trace them, dynamo
    takes them, and they keep their module-output tags (``fc1``, ``mlp``, the blocks match);
    only the ops inside differ: the high-precision ``fc1/linear`` against the float8 layer's
    matmul and casts (``fc1/cast_input``, ...). Float8's rounding stays far below the threshold."""
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    class Float8GPT(compare_runs.TinyGPT):
        def __init__(self, *args: Any) -> None:
            super().__init__()
            config = dataclasses.replace(Float8LinearConfig(), emulate=True)
            convert_to_float8_training(self.model, config=config, module_filter_fn=lambda m, fqn: ".mlp." in fqn)

    converted = compare_runs.fit(tmp_path, "float8", module=Float8GPT)
    out = compared(capsys, eager, converted)
    layers = [f"model.blocks.{i}.mlp.{fc}" for i in (0, 1) for fc in ("fc1", "fc2")]
    assert out["only_a"] == [f"{layer}/linear" for layer in layers]
    assert all(label.split("/")[0] in layers for label in out["only_b"]), out["only_b"]
    assert f"{compare_runs.SCALED_LAYER}/cast_input" in out["only_b"]
    compared_nodes = {r["node"] for r in out["rows"]}
    assert set(layers) | {"model.blocks.1.mlp", "model.blocks.1"} <= compared_nodes  # (module outputs match)
    assert out["matched"] >= 80 and any(r["node"] == "model.blocks.1.attn.qkv/linear" for r in out["rows"])
    assert out["first_divergence"] is None
