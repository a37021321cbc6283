"""Update/weight ratios and gradient std: the row maths against float64 references, pooling
of whole and sharded parameters, and (below) real Trainer runs with ScaleMonitor."""

from __future__ import annotations

import math
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.record import stats, updates
from lightning_scale.report.update_pool import merge_updates

REL = 1e-12


def _ratio64(before: Tensor, after: Tensor) -> float:
    b, a = before.detach().double(), after.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_row_gives_the_float64_ratio_and_grad_std(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    before = (torch.randn(37, 5, generator=gen) * 3 + 1e3).to(dtype)  # a large mean: no cancellation allowed
    after = (before.double() + torch.randn(37, 5, generator=gen, dtype=torch.float64) * 1e-2).to(dtype)
    grad = (torch.randn(37, 5, generator=gen) * 1e-4 + 5e-2).to(dtype)
    row = updates.row_of(before, after, grad)
    assert row.shape == (2, len(stats.FIELDS)) and row.dtype == torch.float64
    got = updates.ratios(["w"], row[None])
    assert got["update_ratio/w"] == pytest.approx(_ratio64(before, after), rel=REL)
    assert got["grad_std/w"] == pytest.approx(float(grad.double().std()), rel=1e-9)


def test_ratios_of_edge_cases() -> None:
    zero = torch.zeros(4)
    row = updates.row_of(zero, zero + 1, None)
    assert updates.ratios(["z"], row[None]) == {"update_ratio/z": math.inf}  # no gradient: no grad_std
    row = updates.row_of(zero, zero, torch.ones(1))
    got = updates.ratios(["z"], row[None], prefix="p_")
    assert math.isnan(got["p_update_ratio/z"]) and got["p_grad_std/z"] == 0.0  # one element: spread 0


def _split_rows(before: Tensor, after: Tensor, grad: Tensor, world: int) -> Tensor:
    """Rows of each rank's shard along dim 0 (uneven, one rank possibly empty): [world, 1, 2, F]."""
    parts = [list(t.tensor_split(world)) for t in (before, after, grad)]
    return torch.stack([updates.row_of(b, a, g)[None] for b, a, g in zip(*parts)])


@pytest.mark.parametrize("world", [2, 3, 7])
def test_pooling_shards_equals_the_whole_parameter(world: int) -> None:
    gen = torch.Generator().manual_seed(1)
    before, grad = torch.randn(6, 4, generator=gen) + 2, torch.randn(6, 4, generator=gen) * 1e-3 - 1e-2
    after = before - 0.1 * grad
    pooled = merge_updates(_split_rows(before, after, grad, world), sharded=[True])
    whole = updates.ratios(["w"], updates.row_of(before, after, grad)[None])
    got = updates.ratios(["w"], pooled)
    assert pooled[0, 0, 0] == 24 and pooled[0, 1, 0] == 24
    assert got["update_ratio/w"] == pytest.approx(whole["update_ratio/w"], rel=REL)
    assert got["grad_std/w"] == pytest.approx(float(grad.double().std()), rel=1e-10)


def test_pooling_a_whole_parameter_counts_it_once() -> None:
    w = torch.randn(5, 3, dtype=torch.float64)
    row = updates.row_of(w, w * 1.01, torch.randn(5, 3))
    per_rank = torch.stack([row[None]] * 4)  # every rank holds it whole and equal
    pooled = merge_updates(per_rank, sharded=[False])
    assert torch.equal(pooled, row[None])
    assert updates.ratios(["w"], pooled)["update_ratio/w"] == pytest.approx(0.01, rel=1e-12)


def test_is_sharded_only_for_shard_placements() -> None:
    class Placement:
        def __init__(self, shard: bool) -> None:
            self.shard = shard

        def is_shard(self) -> bool:
            return self.shard

    t = torch.zeros(2)
    assert not updates.is_sharded(t)
    t.placements = (Placement(False),)  # type: ignore[attr-defined]
    assert not updates.is_sharded(t)
    t.placements = (Placement(False), Placement(True))  # type: ignore[attr-defined]
    assert updates.is_sharded(t)


def test_tracker_measures_an_optimizer_step_and_skips_frozen_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    before: Dict[str, Tensor] = {n: p.detach().clone() for n, p in model.named_parameters()}
    tracker = updates.UpdateTracker()
    tracker.snapshot(model.named_parameters(), step=3)
    assert tracker.pending and tracker.step == 3
    opt.step()
    names, sharded, rows = tracker.rows(model.named_parameters())
    assert not tracker.pending
    assert names == ["0.weight", "0.bias", "2.weight"] and sharded == [False] * 3
    got = updates.ratios(names, merge_updates(rows[None], sharded))
    for name, p in model.named_parameters():
        if name in names:
            assert got[f"update_ratio/{name}"] == pytest.approx(_ratio64(before[name], p), rel=1e-9)
            assert got[f"grad_std/{name}"] == pytest.approx(float(p.grad.double().std()), rel=1e-9)


def test_tracker_without_parameters_and_after_clear() -> None:
    tracker = updates.UpdateTracker()
    tracker.snapshot([])
    names, sharded, rows = tracker.rows([])
    assert (names, sharded, rows.shape) == ([], [], (0, 2, len(stats.FIELDS)))
    tracker.snapshot([("w", nn.Parameter(torch.ones(2)))])
    tracker.clear()
    assert not tracker.pending


# ---- real Trainer runs -----------------------------------------------------------------

import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, List  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_scale import ScaleMonitor  # noqa: E402

TB_REL = 1e-6  # TensorBoard stores scalars as float32
ROOT = Path(__file__).resolve().parents[2]


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class Reference(pl.Callback):
    """Independent float64 copies: parameters before each optimizer step (at the hook the
    monitor snapshots in) and after it, and the gradients at batch end (after clipping)."""

    def __init__(self) -> None:
        self.steps: List[Dict[str, Dict[str, Tensor]]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append({"before": {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.steps and len(self.steps) == trainer.global_step and "after" not in self.steps[-1]:
            self.steps[-1]["after"] = {n: p.detach().double().clone() for n, p in pl_module.named_parameters()}
            self.steps[-1]["grad"] = {n: p.grad.detach().double().clone() for n, p in pl_module.named_parameters()}


def _logged(logdir: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith(("update_ratio/", "grad_std/", "scale/fwd/"))]
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}


def _expected(steps: List[Dict[str, Dict[str, Tensor]]], step: int, names: List[str]) -> Dict[str, float]:
    ref = steps[step]
    out = {}
    for name in names:
        out[f"update_ratio/{name}"] = _ratio64(ref["before"][name], ref["after"][name])
        out[f"grad_std/{name}"] = float(ref["grad"][name].std())
    return out


def _check(logged: Dict[str, Dict[int, float]], reference: Reference, tracked: List[int], names: List[str]) -> None:
    for step in tracked:
        for tag, value in _expected(reference.steps, step, names).items():
            assert logged[tag][step] == pytest.approx(value, rel=TB_REL), (tag, step)
    for name in names:
        assert sorted(logged[f"update_ratio/{name}"]) == tracked


def _fit(tmp_path: Path, steps: int, tracked: List[int], **kwargs: Any) -> Tuple[Path, Reference]:
    torch.manual_seed(0)
    accumulate = int(kwargs.get("accumulate_grad_batches", 1))
    data = TensorDataset(torch.randn(4 * steps * accumulate, 6), torch.randn(4 * steps * accumulate, 3))
    reference = Reference()
    monitor = ScaleMonitor(
        every_n_steps=None, steps=tracked, histograms=False, figure=False, code=False, update_ratios=True
    )
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(str(tmp_path), name="logs", version=0),
        callbacks=[monitor, reference],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(MLP(), DataLoader(data, batch_size=4))
    return tmp_path / "logs" / "version_0", reference


NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


def test_ratios_and_clipped_gradient_std_in_a_trainer(tmp_path: Path) -> None:
    logdir, reference = _fit(tmp_path, 6, [1, 4], gradient_clip_val=0.05)
    logged = _logged(logdir)
    _check(logged, reference, [1, 4], NAMES)
    # the clip is in what was logged: the clipped gradient's norm is the clip value
    norm = torch.cat([g.flatten() for g in reference.steps[1]["grad"].values()]).norm()
    assert float(norm) == pytest.approx(0.05, rel=1e-5)


def test_ratios_with_gradient_accumulation_are_the_optimizer_step_ending_the_tracked_step(tmp_path: Path) -> None:
    logdir, reference = _fit(tmp_path, 5, [0, 2], accumulate_grad_batches=3)
    logged = _logged(logdir)
    _check(logged, reference, [0, 2], NAMES)
    scale_tag = next(t for t in logged if t.startswith("scale/fwd/"))
    assert sorted(logged[scale_tag]) == [0, 2]  # op scales still logged at the tracked steps


class MLPWithValidation(MLP):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


def test_a_validation_run_inside_a_waiting_tracked_step_leaves_it_whole(tmp_path: Path) -> None:
    # Lightning validates between micro-batches (every batch here): the tracked step 0
    # waits for its optimizer step, so the validation run inside it is not tracked.
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 6), torch.randn(16, 3))
    reference = Reference()
    monitor = ScaleMonitor(
        every_n_steps=None,
        steps=[0],
        histograms=False,
        figure=False,
        code=False,
        update_ratios=True,
        track_validation=True,
    )
    trainer = pl.Trainer(
        max_steps=2,
        accumulate_grad_batches=2,
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(tmp_path), name="logs", version=0),
        callbacks=[monitor, reference],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLPWithValidation(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    logdir = tmp_path / "logs" / "version_0"
    logged = _logged(logdir)
    _check(logged, reference, [0], NAMES)
    assert sorted(logged[next(t for t in logged if t.startswith("scale/fwd/"))]) == [0]
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    val_steps = {e.step for t in acc.Tags()["scalars"] if t.startswith("val_scale/fwd/") for e in acc.Scalars(t)}
    assert val_steps and 0 not in val_steps  # later validation runs are tracked


# ---- two ranks over gloo ---------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two_ranks(out: Path, *runs: str) -> Dict[str, str]:
    """Fit ``runs`` in turn in one launch of two processes (``run_updates.py``); each run's
    console output (rank 0's and rank 1's lines of that fit)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(ROOT / "tests" / "dist_scripts" / "run_updates.py"), str(out), *runs]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"training script timed out:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    parts = re.split(r"^=== run (\S+) ===$", output, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Dict[str, str]]:
    """(the runs' folder, each run's output): DDP, FSDP2, and DDP with rank 1's update rows
    failing at step 7, fitted in turn in the same two processes (one launch)."""
    out = tmp_path_factory.mktemp("two_ranks")
    return out, _run_two_ranks(out, "ddp", "fsdp2", "ddp:fail")


RANK_NAMES = [f"model.{n}" for n in ("0.weight", "0.bias", "2.weight", "2.bias")]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_pool_ratios_exactly_and_agree_on_anomalies(
    two_ranks: Tuple[Path, Dict[str, str]], strategy: str
) -> None:
    run = two_ranks[0] / strategy
    assert "failed on rank(s)" not in two_ranks[1][strategy]
    reference = Reference()
    reference.steps = torch.load(run / "reference.pt")
    # step 1 by schedule; rank 1's spike at step 5 tracks 7 and 8 on both ranks (else the
    # tracked step's collective would hang)
    _check(_logged(run / "logs" / "version_0"), reference, [1, 7, 8], RANK_NAMES)


def test_update_rows_failing_on_one_rank_drop_that_step_on_both(two_ranks: Tuple[Path, Dict[str, str]]) -> None:
    """Rank 1's update rows fail at step 7: both ranks still send the same payload (no hang),
    both drop step 7 alike, steps 1 and 8 are logged exactly, training goes on."""
    run, out = two_ranks[0] / "ddp_fail", two_ranks[1]["ddp_fail"]
    assert "failed on rank(s) [1] at step 7; nothing logged for it" in out, out[-3000:]
    reference = Reference()
    reference.steps = torch.load(run / "reference.pt")
    logged = _logged(run / "logs" / "version_0")
    _check(logged, reference, [1, 8], RANK_NAMES)
    assert 7 not in logged["scale/fwd/model.0/linear"] and {1, 8} <= set(logged["scale/fwd/model.0/linear"])
    assert len(reference.steps) == 10  # the fit ran to the end
