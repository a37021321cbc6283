"""Train a tiny MLP on CPU processes (gloo) and save what the distributed tests check.

Usage: ``python run_dist.py OUT WORLD RUN...``, each RUN ``STRATEGY:CALLBACK:CAPTURE``, fitted in
turn in the same processes (one launch for several fits), each to ``OUT/STRATEGY_CALLBACK_WORLD_CAPTURE``;
or ``python run_dist.py OUT STRATEGY CALLBACK [WORLD [CAPTURE]]``, one fit to OUT (WORLD 2, CAPTURE fx).
STRATEGY is one of ``ddp``, ``ddp_spawn``, ``fsdp2``, ``fsdp2_compiled`` (FSDP2, each block then
compiled: ``torch.compile(block)`` after ``fully_shard(block)``; the backend is the environment's
``RUN_DIST_BACKEND``, ``inductor`` by default), CALLBACK ``on``, ``off`` or ``fail`` (on, and every
statistic raises on rank 1 only, for that fit), ``advise`` (on, with
``advise=True``: the precision advisor's GEMM what-ifs too), or ``branch``, ``branch_off``, ``branch_strict``
(rank 1's forward has an extra ``tanh``, so the ranks capture different graphs; tracked steps 0
and 1; the callback on, off, on with ``strict_ranks=True``), WORLD the number of processes and
CAPTURE the callback's ``capture``. Lightning's ``ddp`` launcher re-runs this script for the
other ranks; ``ddp_spawn`` spawns them for each fit (not to be mixed with the others in one
launch). Rank 0 prints ``=== run FOLDER ===`` before each fit (the test splits the console
output there; the ranks meet in a barrier after each fit, so a fit's lines precede the next
marker).

Writes to each run's folder: ``init.pt`` (initial parameters), ``batch_rank<r>.pt`` (each rank's
first batch), ``params.pt`` (full parameters after training), ``logs/`` (TensorBoard, rank 0),
``collectives_rank<r>.json`` (every ``torch.distributed`` collective called from the
package's code during that fit: name, reduce op, bytes of its tensors, global step).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, List

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from user_statistics import MEAN_ABS, PEAK_SQ  # noqa: E402


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, act: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.act = nn.ReLU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """Linear(8, 16) - ReLU - Linear(16, 4), as two blocks (two FSDP units); with ``branch``
    a ``tanh`` between them."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(8, 16, True), Block(16, 4, False)])
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if self.branch:  # (a Python branch: fx traces it away, so this rank's graph differs)
            x = torch.tanh(x)
        return self.layers[1](x)


class Module(pl.LightningModule):
    def __init__(self, out: Path, fsdp: bool, branch: bool = False, compiled: bool = False) -> None:
        super().__init__()
        self.out, self.fsdp, self.compiled = out, fsdp, compiled
        self.model = MLP(branch)

    def configure_model(self) -> None:
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        if self.compiled:  # (the per-block pattern of large trainers)
            for i, layer in enumerate(self.model.layers):
                self.model.layers[i] = torch.compile(layer, backend=os.environ.get("RUN_DIST_BACKEND", "inductor"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        if self.global_step == 0:
            torch.save((x, y), self.out / f"batch_rank{self.global_rank}.pt")
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def full_state(module: nn.Module) -> dict:
    """Full (unsharded) parameters; a collective under FSDP2."""
    out = {}
    for name, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


@contextmanager
def _failing_on_rank_1() -> Iterator[None]:
    """Within the block, every statistic raises on rank 1 (restored after)."""
    from lightning_scale.record import short_records
    from lightning_scale.record import stats

    def record_of(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected failure on rank 1")

    saved = stats.record_of, short_records.records_of_many
    if int(os.environ.get("LOCAL_RANK", "0")) == 1:
        stats.record_of = record_of  # type: ignore[assignment]
        short_records.records_of_many = record_of  # type: ignore[assignment]  # short tensors, computed together
    try:
        yield
    finally:
        stats.record_of, short_records.records_of_many = saved


_PACKAGE = str(Path(__file__).resolve().parents[2] / "lightning_scale")
_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all_single",
    "all_gather_object",
    "broadcast_object_list",
)


def count_collectives(trainer: "list[pl.Trainer]") -> List[Any]:
    """Wrap ``torch.distributed``'s collectives: calls from the package's code are logged."""
    calls: List[Any] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if frame.f_code.co_filename.startswith(_PACKAGE):
                flat = [a for a in (*args, *kwargs.values()) for a in (a if isinstance(a, (list, tuple)) else [a])]
                size = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
                op = kwargs.get(
                    "op", next((a for a in args if isinstance(a, torch.distributed.ReduceOp.RedOpType)), None)
                )
                calls.append([name, str(op).split(".")[-1], size, trainer[0].global_step if trainer else None])
            return fn(*args, **kwargs)

        return counted

    for name in _COLLECTIVES:
        setattr(torch.distributed, name, wrap(name, getattr(torch.distributed, name)))
    return calls


def fit(out: Path, strategy_name: str, mode: str, world: int, capture: str, calls: "tuple[list, list]") -> None:
    """One fit, written to ``out``; ``calls``: (the trainer holder, the collectives list) of
    ``count_collectives``."""
    holder, collectives = calls
    collectives.clear()
    callback = mode in ("on", "fail", "branch", "branch_strict", "advise")
    branch = mode.startswith("branch") and int(os.environ.get("LOCAL_RANK", "0")) == 1
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * world, 8), torch.randn(8 * world, 4))
    fsdp = strategy_name.startswith("fsdp2")
    module = Module(out, fsdp=fsdp, branch=branch, compiled=strategy_name == "fsdp2_compiled")
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(full_state(module.model), out / "init.pt")
    strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if fsdp else strategy_name
    callbacks = (
        [
            ScaleMonitor(
                every_n_steps=None,
                steps=[0, 1] if mode.startswith("branch") else [0],
                statistics=["std", MEAN_ABS, PEAK_SQ],
                histograms=False,
                figure=False,
                code=False,
                rank_spread=True,
                capture=capture,
                strict_ranks=mode == "branch_strict",
                advise=mode == "advise",
            )
        ]
        if callback
        else []
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=2,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    holder[:] = [trainer]
    with _failing_on_rank_1() if mode == "fail" else nullcontext():
        trainer.fit(module, DataLoader(data, batch_size=4, shuffle=False))
    (out / f"collectives_rank{trainer.global_rank}.json").write_text(json.dumps(collectives))
    state = full_state(module.model)
    if trainer.is_global_zero:
        torch.save(state, out / "params.pt")


def fits_in_turn(out: Path, runs: "list[str]", folder_of: Callable[..., str], fit_one: Callable[..., None]) -> None:
    """Each run (``A:B:C``, its fields split at ``:``) in turn, in these processes:
    ``fit_one(OUT/folder_of(*fields), *fields, calls)``, after rank 0's ``=== run FOLDER ===``
    marker (the tests split rank 0's console output there) and before a barrier (a fit's console
    lines before the next marker); then the process group is torn down."""
    holder: "list[pl.Trainer]" = []
    calls = (holder, count_collectives(holder))
    for run in runs:
        fields = run.split(":")
        folder = out / folder_of(*fields)
        folder.mkdir(parents=True, exist_ok=True)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"=== run {folder.name} ===", flush=True)
        fit_one(folder, *fields, calls)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    if torch.distributed.is_initialized():  # else gloo's teardown waits ~10 s at exit
        torch.distributed.destroy_process_group()


def main(out: Path, world: int, runs: "list[str]") -> None:
    """Each run ``STRATEGY:CALLBACK:CAPTURE`` in turn, in these processes."""
    fits_in_turn(
        out,
        runs,
        lambda strategy, mode, capture: f"{strategy}_{mode}_{world}_{capture}",
        lambda folder, strategy, mode, capture, calls: fit(folder, strategy, mode, world, capture, calls),
    )


def main_one(out: Path, strategy: str, mode: str, world: int = 2, capture: str = "fx") -> None:
    """``python run_dist.py OUT STRATEGY CALLBACK [WORLD [CAPTURE]]``: one fit, written to OUT."""
    holder: "list[pl.Trainer]" = []
    fit(out, strategy, mode, world, capture, (holder, count_collectives(holder)))
    if torch.distributed.is_initialized():  # else gloo's teardown waits ~10 s at exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[2].isdigit():
        main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
    else:
        main_one(Path(sys.argv[1]), sys.argv[2], sys.argv[3], *(f(a) for f, a in zip((int, str), sys.argv[4:])))
