"""Train a tiny language model with tensor parallelism on CPU processes (gloo).

Usage: ``python run_tp.py OUT DP TP RUN [RUN ...]``: DP x TP the mesh
(``ModelParallelStrategy``; DP > 1 adds FSDP2's ``fully_shard``), and each RUN
``MODEL:CALLBACK:LOCAL`` one fit, all in turn in the same rank processes (one launch, one
process group: start-up is most of a fit's time). MODEL is ``mlp`` (embedding - fc1 colwise -
gelu - fc2 rowwise - head), ``brk`` and ``tail`` (``mlp`` with a dynamo graph break after fc1,
after fc2: ``BreakMLP``), ``attn``
(embedding - head-sharded q, k, v colwise - attention - out rowwise - head) or ``sp``
(sequence parallel: ``mlp`` with LayerNorms before fc1 and after fc2 and a ``loss_parallel``
loss, see ``SequenceParallelMLP``) or ``blocks`` (embedding - two residual MLP blocks, each an
FSDP2 unit when DP > 1 - LayerNorm - head, the last three outside the plan: ``Blocks``);
CALLBACK ``on`` or ``off``; LOCAL ``1`` (``use_local_output=True``, the default) or ``0``
(DTensor outputs, taken back to local tensors by the model). Lightning's launcher re-runs
this script for the other ranks.

Writes to ``OUT/MODEL_CALLBACK``: ``init.pt`` (initial parameters), ``batch_rank<r>.pt`` (each
rank's first batch), ``params.pt`` (full parameters after training), ``logs/`` (TensorBoard,
rank 0), ``collectives_rank<r>.json`` (the package's collectives, as ``run_dist.py``),
``warnings_rank<r>.json`` (every warning of the fit: category, message, file). Rank 0 prints
``=== run MODEL CALLBACK ===`` before each fit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_dist import fits_in_turn, full_state  # noqa: E402

from lightning_scale import ScaleMonitor  # noqa: E402
from user_statistics import MEAN_ABS, PEAK_SQ  # noqa: E402

VOCAB, D, H, HEADS, T = 32, 16, 32, 4, 6
STATISTICS = [
    "std",
    "absmax",
    "count",
    "zeros",
    "underflow_e4m3",
    "below_normal_e4m3",
    "underflow_e5m2",
    MEAN_ABS,
    PEAK_SQ,
]


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, H)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(H, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.act(_local(self.fc1(self.emb(idx))))
        return self.head(_local(self.fc2(h)))

    @staticmethod
    def plan(local: bool) -> dict:
        return {"fc1": ColwiseParallel(use_local_output=local), "fc2": RowwiseParallel(use_local_output=local)}


class BreakMLP(MLP):
    """The MLP with a dynamo graph break after ``fc1`` (``brk``: the next graph starts from
    fc1's local shard, a plain tensor whose placement fc2's input hook declares) or after
    ``fc2`` (``tail``: the head's graph computes no DTensor, and nothing in it says that its
    input is a replica)."""

    def __init__(self, after: str) -> None:
        super().__init__()
        self.after = after

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = _local(self.fc1(self.emb(idx)))
        if self.after == "fc1":
            torch._dynamo.graph_break()
        h = _local(self.fc2(self.act(h)))
        if self.after == "fc2":
            torch._dynamo.graph_break()
        return self.head(h)


class Attention(nn.Module):
    """Causal self-attention whose heads are split over the tensor-parallel ranks (the first
    query sees one key: its gradient is zero, in float32 up to rounding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.q, self.v = nn.Linear(D, D), nn.Linear(D, D)
        self.k = nn.Linear(D, D, bias=False)  # (a key bias shifts every score of a query alike: its gradient is 0)
        self.out = nn.Linear(D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, _ = x.shape
        q, k, v = (_local(f(x)) for f in (self.q, self.k, self.v))
        q, k, v = (a.view(b, t, -1, D // HEADS).transpose(1, 2) for a in (q, k, v))  # (B, heads here, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.head(_local(self.out(y)))

    @staticmethod
    def plan(local: bool) -> dict:
        col = {n: ColwiseParallel(use_local_output=local) for n in ("q", "k", "v")}
        return {**col, "out": RowwiseParallel(use_local_output=local)}


class SequenceParallelMLP(nn.Module):
    """The MLP with LayerNorms whose activations are sharded on the sequence dim
    (``SequenceParallel``): the embedding rowwise (vocabulary-sharded, its partial sums
    reduce-scattered to sequence shards), the head's logits sharded on the vocabulary (a
    DTensor), their loss taken with ``loss_parallel``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(H, D)
        self.norm2 = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(self.norm(self.emb(idx))))
        return self.head(self.norm2(self.fc2(h)))

    @staticmethod
    def plan(local: bool) -> dict:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import SequenceParallel

        return {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "fc1": ColwiseParallel(input_layouts=Shard(1)),
            "fc2": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }


class Block(nn.Module):
    """A residual MLP block: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _local(self.fc2(self.act(_local(self.fc1(x)))))


class Blocks(nn.Module):
    """Embedding - two residual blocks - LayerNorm - head: the embedding, the final norm and
    the head are outside the tensor-parallel plan; with DP > 1 each block is an FSDP2 unit of
    its own (``fully_shard`` per block, then the root), as a transformer is sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    @staticmethod
    def plan(local: bool) -> dict:
        layers = {f"blocks.{i}.fc1": ColwiseParallel(use_local_output=local) for i in range(2)}
        return {**layers, **{f"blocks.{i}.fc2": RowwiseParallel(use_local_output=local) for i in range(2)}}


class Module(pl.LightningModule):
    def __init__(self, out: Path, model: str, local: bool) -> None:
        super().__init__()
        self.out, self.local = out, local
        models = {"mlp": MLP, "attn": Attention, "sp": SequenceParallelMLP, "blocks": Blocks}
        self.model = {**models, "brk": lambda: BreakMLP("fc1"), "tail": lambda: BreakMLP("fc2")}[model]()

    def configure_model(self) -> None:
        parallelize_module(self.model, self.device_mesh["tensor_parallel"], self.model.plan(self.local))
        if self.device_mesh["data_parallel"].size() > 1:
            from torch.distributed.fsdp import fully_shard

            for block in getattr(self.model, "blocks", []):
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        idx, y = batch
        if self.global_step == 0:
            torch.save((idx, y), self.out / f"batch_rank{self.global_rank}.pt")
        with self._loss_context():
            return F.cross_entropy(self(idx).flatten(0, 1), y.flatten())

    def backward(self, loss: torch.Tensor, *args: object, **kwargs: object) -> None:
        with self._loss_context():
            super().backward(loss, *args, **kwargs)

    def _loss_context(self) -> "contextlib.AbstractContextManager[object]":
        """``loss_parallel`` (vocabulary-sharded logits) for the ``sp`` model, forward and backward."""
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if isinstance(self.model, SequenceParallelMLP) else contextlib.nullcontext()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(out: Path, model: str, mode: str, dp: int, tp: int, local: bool, calls: "tuple[list, list]") -> None:
    """One fit of ``model`` with (``mode="on"``) or without the callback, written to ``out``;
    ``calls``: (the trainer holder, the collectives list) of ``count_collectives``."""
    holder, collectives = calls
    collectives.clear()
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (4 * dp, T)), torch.randint(0, VOCAB, (4 * dp, T)))
    module = Module(out, model, local)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        torch.save(full_state(module.model), out / "init.pt")
    monitor = ScaleMonitor(
        every_n_steps=None, steps=[0], statistics=STATISTICS, histograms=False, figure=False, code=False
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=dp * tp,
        strategy=ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp),
        max_steps=2,
        logger=TensorBoardLogger(str(out), name="logs", version=0),
        callbacks=[monitor] if mode == "on" else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    holder[:] = [trainer]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # (each fit's own: a repeat in a later fit is not hidden)
        trainer.fit(module, DataLoader(data, batch_size=2, shuffle=False))
    rank = trainer.global_rank
    (out / f"collectives_rank{rank}.json").write_text(json.dumps(collectives))
    seen = [[w.category.__name__, str(w.message), w.filename] for w in caught]
    (out / f"warnings_rank{rank}.json").write_text(json.dumps(seen))
    state = full_state(module.model)
    if trainer.is_global_zero:
        torch.save(state, out / "params.pt")


def main(out: Path, dp: int, tp: int, runs: "list[str]") -> None:
    """Each run ``MODEL:CALLBACK:LOCAL`` in turn, in these processes, to ``OUT/MODEL_CALLBACK``."""
    fits_in_turn(
        out,
        runs,
        lambda model, mode, local: f"{model}_{mode}",
        lambda folder, model, mode, local, calls: fit(folder, model, mode, dp, tp, bool(int(local)), calls),
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
