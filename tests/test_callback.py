"""ScaleMonitor in real Trainer runs on CPU: logged values against an independent float64
reference, what is written where, bit-identical training, accumulation, manual
optimization, resume, validation, other loggers, argument errors, failures, dynamo."""

from __future__ import annotations

import csv
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor

pytestmark = pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`")

ALL_EVENTS = {k: 0 for k in ("scalars", "histograms", "compressedHistograms", "images", "tensors", "audio")}
REL = 1e-5  # TensorBoard stores scalars as float32


# ---- models and data -----------------------------------------------------------------


class MLP(pl.LightningModule):
    """Linear-ReLU-Linear, MSE loss, plain SGD."""

    def __init__(self, n_in: int = 6, hidden: int = 16, n_out: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))
        self.losses: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ManualMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = F.mse_loss(self(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


class Failing(MLP):
    """Raises inside ``training_step`` after its forward, while ``fail`` is set."""

    fail = True

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        out = self(batch[0])
        if self.fail:
            raise KeyError("boom in training_step")
        return F.mse_loss(out, batch[1])


class Bypass(MLP):
    """Calls a submodule directly, never ``self(x)``: the captured forward does not run."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])


class Noisy(MLP):
    """Dropout (consumes the RNG) and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 3))


class Views(MLP):
    """fx-traceable, with reshapes whose statistics equal their input's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x).relu().reshape(-1, 2, 4).flatten(1)
        return self.fc2(h)


class Branchy(Views):
    """Data-dependent control flow at the root: fx cannot trace it, dynamo can."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = (h if h.sum() > 0 else -h) * 2  # a graph break, then a multiplication
        return self.fc2(h.relu().reshape(-1, 2, 4).flatten(1))


def loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)),
        batch_size=batch_size,
        shuffle=False,
    )


class Snapshot(Callback):
    """Keeps each training batch and the weights it met, keyed by (global_step, batch_idx)."""

    def __init__(self) -> None:
        self.seen: Dict[Tuple[int, int], Tuple[List[Tensor], Dict[str, Tensor]]] = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.seen[(trainer.global_step, batch_idx)] = ([t.clone() for t in batch], state)


def fit(
    model: pl.LightningModule,
    root: Path,
    callbacks: List[Callback],
    max_steps: int = 3,
    train: Optional[DataLoader] = None,
    val: Optional[DataLoader] = None,
    logger: Any = None,
    ckpt_path: Optional[str] = None,
    **kwargs: Any,
) -> pl.Trainer:
    options: Dict[str, Any] = dict(enable_checkpointing=False, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=callbacks,
        default_root_dir=root,
        logger=TensorBoardLogger(root, name="tb") if logger is None else logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{**options, **kwargs},
    )
    trainer.fit(model, train or loader(), val, ckpt_path=ckpt_path)
    return trainer


def events(trainer: pl.Trainer) -> EventAccumulator:
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance=ALL_EVENTS)
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, prefix: str = "scale/") -> Dict[str, List[Tuple[int, float]]]:
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"] if t.startswith(prefix)}


def steps_of(series: Dict[str, List[Tuple[int, float]]]) -> set:
    return {step for points in series.values() for step, _ in points}


def at(series: Dict[str, List[Tuple[int, float]]], tag: str, step: int) -> float:
    values = [v for s, v in series[tag] if s == step]
    assert len(values) == 1, (tag, series[tag])
    return values[0]


# ---- an independent float64 reference ---------------------------------------------------


def mlp_reference(
    batch: List[Tensor], state: Dict[str, Tensor], loss_factor: float = 1.0
) -> Dict[str, Tuple[Tensor, Optional[Tensor]]]:
    """label -> (value, gradient) of every intermediate of ``MLP`` in float64."""
    x, y = (t.double() for t in batch)
    p = {k: v.double().requires_grad_() for k, v in state.items()}
    h = x @ p["net.0.weight"].T + p["net.0.bias"]
    r = h.relu()
    o = r @ p["net.2.weight"].T + p["net.2.bias"]
    loss = F.mse_loss(o, y) * loss_factor
    values = {"net.0/linear": h, "net.1/relu": r, "net.2/linear": o, **{k: p[k] for k in p}}
    grads = torch.autograd.grad(loss, list(values.values()))
    out: Dict[str, Tuple[Tensor, Optional[Tensor]]] = {k: (v.detach(), g) for (k, v), g in zip(values.items(), grads)}
    out["x"] = (x, None)
    return out


def assert_matches_reference(
    series: Dict[str, List[Tuple[int, float]]],
    step: int,
    ref: Dict[str, Tuple[Tensor, Optional[Tensor]]],
    prefix: str = "scale",
) -> None:
    for label, (value, grad) in ref.items():
        assert at(series, f"{prefix}/fwd/{label}", step) == pytest.approx(float(value.std()), rel=REL), label
        if grad is None:
            assert f"{prefix}/bwd/{label}" not in series
        else:
            assert at(series, f"{prefix}/bwd/{label}", step) == pytest.approx(float(grad.std()), rel=REL), label


# ---- 1. values ----------------------------------------------------------------------------


def test_logged_std_equals_float64_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    snap = Snapshot()
    trainer = fit(MLP(), tmp_path, [snap, ScaleMonitor(every_n_steps=2)], max_steps=3)
    series = scalars(events(trainer))
    assert steps_of(series) == {0, 2}
    labels = {t.split("/", 2)[2] for t in series}
    ops = {
        "x",
        "net.0.weight",
        "net.0.bias",
        "net.0/linear",
        "net.1/relu",
        "net.2.weight",
        "net.2.bias",
        "net.2/linear",
    }
    assert labels == ops | {"net", "net.0", "net.1", "net.2"}  # module outputs, by module path
    for step in (0, 2):
        batch, state = snap.seen[(step, step)]
        ref = mlp_reference(batch, state)
        outputs = {
            "net.0": ref["net.0/linear"],
            "net.1": ref["net.1/relu"],
            "net.2": ref["net.2/linear"],
            "net": ref["net.2/linear"],
        }
        assert_matches_reference(series, step, {**ref, **outputs})


# ---- 2. histograms, figure, code, layout, other statistics --------------------------------


def test_extras_statistics_and_value_histograms(tmp_path: Path) -> None:
    torch.manual_seed(0)
    snap = Snapshot()
    monitor = ScaleMonitor(
        every_n_steps=2,
        statistics=["std", "absmax", "underflow_e4m3"],
        value_histograms=r"^net\.0/linear$",
        rank_spread=True,
        figure=True,
        figure_every=1,
    )
    acc = events(fit(MLP(), tmp_path, [snap, monitor], max_steps=3))
    tags = acc.Tags()
    # 8 op nodes + 4 module outputs (net, net.0, net.1, net.2); the input has no gradient
    for tag, nodes in (("scale_hist/fwd", 12), ("scale_hist/bwd", 11)):
        hist = acc.Histograms(tag)
        assert [e.step for e in hist] == [0, 2]
        assert all(e.histogram_value.num == nodes for e in hist)
    assert [e.step for e in acc.Images("scale_plot")] == [0, 2]
    code = acc.Tensors("scale_code/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "def forward" in code and "linear" in code and "(-> " in code
    assert "custom_scalars__config__" in tags["tensors"]

    ref = mlp_reference(*snap.seen[(0, 0)])
    fwd, grad = ref["net.0/linear"]
    series = scalars(acc, "")
    assert at(series, "absmax/fwd/net.0/linear", 0) == pytest.approx(float(fwd.abs().max()), rel=REL)
    assert at(series, "absmax/bwd/net.0/linear", 0) == pytest.approx(float(grad.abs().max()), rel=REL)
    a = grad.float().abs()  # the run's gradients are float32
    underflow = float(((a > 0) & (a < 2.0**-9)).sum()) / a.numel()
    assert underflow > 0
    assert at(series, "underflow_e4m3/bwd/net.0/linear", 0) == pytest.approx(underflow, abs=1.01 / a.numel())
    assert at(series, "scale/fwd/net.0/linear", 0) == pytest.approx(float(fwd.std()), rel=REL)
    for bound in ("min", "max"):  # one rank: its own std
        assert series[f"scale_rank_{bound}/bwd/net.0/linear"] == series["scale/bwd/net.0/linear"]

    for direction, values in (("fwd", fwd), ("bwd", grad)):
        hist = acc.Histograms(f"values_log2/{direction}/net.0/linear")
        assert [e.step for e in hist] == [0, 2]
        assert hist[0].histogram_value.num == int((values != 0).sum())
    assert not [t for t in tags["histograms"] if t.startswith("values_log2/") and "net.0/linear" not in t]


def test_figure_is_drawn_every_n_tracked_steps(tmp_path: Path) -> None:
    acc = events(fit(MLP(), tmp_path, [ScaleMonitor(every_n_steps=1, figure=True, figure_every=2)], max_steps=5))
    assert [e.step for e in acc.Images("scale_plot")] == [0, 2, 4]
    assert [e.step for e in acc.Histograms("scale_hist/fwd")] == [0, 1, 2, 3, 4]


def test_extras_can_be_switched_off(tmp_path: Path) -> None:
    torch.manual_seed(0)
    acc = events(fit(MLP(), tmp_path, [ScaleMonitor(every_n_steps=2, histograms=False, figure=False, code=False)]))
    tags = acc.Tags()
    assert not tags["histograms"] and not tags["images"]
    assert sorted(tags["tensors"]) == [
        "custom_scalars__config__",
        "scale_nodes",
        "scale_records/000000000000",
        "scale_worst/text_summary",
    ]  # records: the SCALES dashboard's
    assert steps_of(scalars(acc)) == {0, 2}


# ---- 3. bit-identical training ----------------------------------------------------------------


def _train_noisy(root: Path, callbacks: List[Callback]) -> Noisy:
    pl.seed_everything(7, verbose=False)
    model = Noisy()
    fit(model, root, callbacks, max_steps=6)
    return model


def test_training_is_bit_identical_with_and_without_monitor(tmp_path: Path) -> None:
    plain = _train_noisy(tmp_path / "plain", [])
    monitor = ScaleMonitor(every_n_steps=1)
    tracked = _train_noisy(tmp_path / "tracked", [monitor])
    assert monitor.last_tracked_step == 5
    assert len(plain.losses) == len(tracked.losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, tracked.losses))
    for (name, a), (_, b) in zip(plain.named_parameters(), tracked.named_parameters()):
        assert torch.equal(a, b), name
    assert "forward" not in tracked.__dict__


# ---- 4. gradient accumulation ---------------------------------------------------------------------


def test_accumulation_records_the_first_micro_batch_once(tmp_path: Path) -> None:
    runs = {}
    for unscale in (False, True):
        torch.manual_seed(0)
        snap = Snapshot()
        monitor = ScaleMonitor(every_n_steps=2, unscale_gradients=unscale)
        trainer = fit(MLP(), tmp_path / str(unscale), [snap, monitor], max_steps=3, accumulate_grad_batches=2)
        runs[unscale] = (scalars(events(trainer)), snap)
    series, snap = runs[False]
    assert all([s for s, _ in points] == [0, 2] for points in series.values())  # one event per tracked step
    # the loss is divided by k=2 before backward; step 2 begins at batch 4
    for step, batch_idx in ((0, 0), (2, 4)):
        assert_matches_reference(series, step, mlp_reference(*snap.seen[(step, batch_idx)], loss_factor=0.5))
    unscaled = runs[True][0]
    assert unscaled.keys() == series.keys()
    for tag, points in series.items():
        factor = 2.0 if "/bwd/" in tag else 1.0
        assert [v for _, v in unscaled[tag]] == pytest.approx([v * factor for _, v in points], rel=1e-6), tag


def test_unscale_divides_by_the_grad_scaler_scale(tmp_path: Path) -> None:
    runs = {}
    for name, unscale, plugins in (
        ("plain", False, []),
        ("scaled", False, [MixedPrecision("16-mixed", "cpu")]),
        ("unscaled", True, [MixedPrecision("16-mixed", "cpu")]),
    ):
        torch.manual_seed(0)
        trainer = fit(
            MLP(), tmp_path / name, [ScaleMonitor(every_n_steps=2, unscale_gradients=unscale)], plugins=plugins
        )
        runs[name] = scalars(events(trainer), "")
    scale = at(runs["scaled"], "scale_loss/loss_scale", 0)
    assert scale == 2.0**16  # GradScaler's initial scale
    plain, scaled, unscaled = (at(runs[n], "scale/bwd/net.0/linear", 0) for n in ("plain", "scaled", "unscaled"))
    assert scaled == pytest.approx(unscaled * scale, rel=1e-6)
    assert unscaled == pytest.approx(plain, rel=1e-2)  # float16 autocast against float32


# ---- 5. manual optimization ---------------------------------------------------------------------


def test_manual_optimization(tmp_path: Path) -> None:
    torch.manual_seed(0)
    snap = Snapshot()
    series = scalars(events(fit(ManualMLP(), tmp_path, [snap, ScaleMonitor(every_n_steps=2)], max_steps=3)))
    assert steps_of(series) == {0, 2}
    assert any(t.startswith("scale/bwd/") for t in series)
    assert_matches_reference(series, 0, mlp_reference(*snap.seen[(0, 0)]))


# ---- 6. resume ------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_resume_continues_the_schedule(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = loader(n=32)  # 4 batches an epoch
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)
    first = fit(
        MLP(), tmp_path / "a", [ScaleMonitor(every_n_steps=3), ckpt], max_steps=4, train=data, enable_checkpointing=True
    )
    series = scalars(events(first))
    assert steps_of(series) == {0, 3}  # max_steps=4 ends on tracked step 3: logged
    assert all([s for s, _ in points] == [0, 3] for points in series.values())

    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)  # as when it was made
    resumed = fit(
        MLP(),
        tmp_path / "b",
        [ScaleMonitor(every_n_steps=3), again],
        max_steps=8,
        train=data,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
        enable_checkpointing=True,
    )
    assert resumed.global_step == 8
    series = scalars(events(resumed))
    assert series and all([s for s, _ in points] == [6] for points in series.values())


# ---- 7. validation ---------------------------------------------------------------------------------


def test_validation_tracking(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = ScaleMonitor(every_n_steps=2, track_validation=True)
    trainer = fit(
        MLP(), tmp_path, [monitor], max_steps=4, val=loader(n=16), val_check_interval=2, num_sanity_val_steps=2
    )
    acc = events(trainer)
    val = scalars(acc, "val_scale/")
    assert val and all(t.startswith("val_scale/fwd/") for t in val)
    assert steps_of(val) == {2, 4}  # no sanity-check step, first batch of each run only
    assert "val_scale_hist/fwd" in acc.Tags()["histograms"]
    assert steps_of(scalars(acc)) == {0, 2}
    layout = layout_pb2.Layout()
    layout.ParseFromString(acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    titles = {c.title for c in layout.category}
    assert any(t.startswith("scale_log2 · ") for t in titles)
    assert any(t.startswith("val_scale_log2 · ") for t in titles)


# ---- 8. other loggers ------------------------------------------------------------------------------


def test_csv_logger_gets_scalars(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = fit(MLP(), tmp_path, [ScaleMonitor(every_n_steps=2)], logger=CSVLogger(tmp_path, name="csv"))
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert {"scale/fwd/net.0/linear", "scale/bwd/net.0/linear", "scale/fwd/x"} <= columns
    logged = {int(r["step"]) for r in rows if r["scale/fwd/net.0/linear"]}
    assert logged == {0, 2}


class ThreadRecordingLogger(Logger):
    """A non-TensorBoard logger that notes the thread of every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Tuple[int, int, Dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "threads"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        self.calls.append((threading.get_ident(), -1 if step is None else step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_other_loggers_are_only_called_on_the_training_thread(tmp_path: Path) -> None:
    # Loggers other than TensorBoard are not thread-safe: Lightning's CSVLogger.save() on
    # the training thread fails when a row with new columns arrives from the writer thread
    # while it writes. Their scalars must be logged on the training thread; TensorBoard's
    # still go through the background writer, and both get the same values.
    torch.manual_seed(0)
    other = ThreadRecordingLogger()
    monitor = ScaleMonitor(every_n_steps=2, update_ratios=True)
    fit(MLP(), tmp_path, [monitor], logger=[TensorBoardLogger(tmp_path, name="tb"), other])
    ours = [
        (thread, step, m)
        for thread, step, m in other.calls
        if any(k.startswith(("scale/", "update_ratio/")) for k in m)
    ]
    assert {step for _, step, _ in ours} == {0, 2}
    assert {thread for thread, _, _ in ours} == {threading.get_ident()}
    assert any("update_ratio/net.0.weight" in m for _, _, m in ours)
    acc = EventAccumulator(str(next(tmp_path.glob("tb/version_*"))), size_guidance={"scalars": 0})
    acc.Reload()
    for _, step, metrics in ours:
        for tag in ("scale/fwd/net.0/linear", "scale/bwd/net.0/linear"):
            if tag in metrics:
                event = next(e for e in acc.Scalars(tag) if e.step == step)
                assert event.value == pytest.approx(metrics[tag], rel=1e-6)


def test_no_logger_is_an_error_at_fit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`ScaleMonitor` needs a logger.*`Trainer\(logger=False\)`"):
        fit(MLP(), tmp_path, [ScaleMonitor()], logger=False)


# ---- 9. argument errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, r"`every_n_steps` must be a positive integer or None, got 0"),
        ({"every_n_steps": -1}, r"`every_n_steps` must be a positive integer or None, got -1"),
        ({"steps": [4, 2]}, r"`steps` must be sorted and free of repeats, got \[4, 2\]"),
        ({"steps": [2, 2]}, r"`steps` must be sorted and free of repeats, got \[2, 2\]"),
        ({"steps": [-3]}, r"`steps` must hold non-negative integers, got \[-3\]"),
        (
            {"statistics": ["std", "skewness"]},
            r"`statistics` has an unknown statistic 'skewness'; choose from \[.*'absmax'.*\]",
        ),
        ({"statistics": []}, r"`statistics` must be a non-empty list of statistic names"),
        ({"include": "net(["}, r"`include` must be a valid regular expression, got 'net\(\['"),
        ({"exclude": "*x"}, r"`exclude` must be a valid regular expression, got '\*x'"),
        ({"value_histograms": "a)"}, r"`value_histograms` must be a valid regular expression, got 'a\)'"),
        ({"capture": "jit"}, r"`capture` must be one of \['auto', 'fx', 'dynamo'\], got 'jit'"),
        ({"max_tags": 0}, r"`max_tags` must be a positive integer, got 0"),
        ({"figure_every": 0}, r"`figure_every` must be a positive integer, got 0"),
        ({"start_step": 3, "stop_step": 3}, r"`stop_step` must be an integer above `start_step` \(3\) or None, got 3"),
        ({"start_step": 3, "stop_step": 1}, r"`stop_step` must be an integer above `start_step` \(3\)"),
    ],
)
def test_argument_errors(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaleMonitor(**kwargs)


def test_unknown_submodule_names_the_nearest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`submodule` 'net.3' is not a submodule of MLP; nearest: \[.*'net.2'.*\]"):
        fit(MLP(), tmp_path, [ScaleMonitor(submodule="net.3")])


class LateMLP(MLP):
    """Builds its head in `configure_model`, which runs after the callbacks' `setup`."""

    def __init__(self) -> None:
        super().__init__()
        self.head: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.head is None:
            self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.net(x))


def test_submodule_created_in_configure_model(tmp_path: Path) -> None:
    acc = events(fit(LateMLP(), tmp_path, [ScaleMonitor(every_n_steps=1, submodule="head")], max_steps=1))
    assert set(scalars(acc)) == {
        f"scale/{d}/{n}" for d in ("fwd", "bwd") for n in ("input", "weight", "bias", "linear")
    }
    with pytest.raises(ValueError, match=r"`submodule` 'hed' is not a submodule of LateMLP; nearest: \['head'"):
        fit(LateMLP(), tmp_path, [ScaleMonitor(submodule="hed")])


def test_validate_without_a_logger_is_fine_unless_validation_is_tracked(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        callbacks=[ScaleMonitor()],
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.validate(MLP(), loader(), verbose=False)  # nothing to write: no error
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        callbacks=[ScaleMonitor(track_validation=True)],
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ValueError, match=r"`ScaleMonitor` needs a logger"):
        trainer.validate(MLP(), loader(), verbose=False)


def test_submodule_capture(tmp_path: Path) -> None:
    torch.manual_seed(0)
    series = scalars(events(fit(MLP(), tmp_path, [ScaleMonitor(every_n_steps=2, submodule="net")])))
    assert {"scale/fwd/0/linear", "scale/bwd/2/linear"} <= series.keys()


# ---- 10. a failing tracked step ---------------------------------------------------------------------


def test_exception_in_tracked_step_restores_the_module(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Failing()
    monitor = ScaleMonitor(every_n_steps=1)
    with pytest.raises(KeyError) as info:
        fit(model, tmp_path / "a", [monitor])
    assert type(info.value) is KeyError and info.value.args == ("boom in training_step",)
    assert "forward" not in model.__dict__
    assert all(not p._backward_hooks for p in model.parameters())

    model.fail = False  # the same module and callback train normally afterwards
    series = scalars(events(fit(model, tmp_path / "b", [monitor], max_steps=2)))
    assert steps_of(series) == {0, 1}
    assert "forward" not in model.__dict__


def test_monitor_reused_on_another_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = ScaleMonitor(every_n_steps=2)
    fit(MLP(), tmp_path / "a", [monitor])
    snap = Snapshot()
    model = MLP()
    series = scalars(events(fit(model, tmp_path / "b", [snap, monitor])))
    assert steps_of(series) == {0, 2}
    assert_matches_reference(series, 0, mlp_reference(*snap.seen[(0, 0)]))
    assert not torch.equal(snap.seen[(0, 0)][1]["net.0.weight"], snap.seen[(2, 2)][1]["net.0.weight"])  # it trained


# ---- 11. dynamo, selection ----------------------------------------------------------------------------


def test_untraceable_model_is_tracked_with_dynamo(tmp_path: Path) -> None:
    torch.manual_seed(0)
    monitor = ScaleMonitor(every_n_steps=2, value_histograms=r"^fc1/linear$")
    acc = events(fit(Branchy(), tmp_path, [monitor]))
    series = scalars(acc)
    assert steps_of(series) == {0, 2}
    assert {
        "scale/fwd/fc1/linear",
        "scale/bwd/fc1/linear",
        "scale/fwd/fc2/linear",
        "scale/bwd/fc2.weight",
        "scale/fwd/mul",
    } <= series.keys()
    assert [e.step for e in acc.Histograms("values_log2/fwd/fc1/linear")] == [0, 2]
    assert all(c.mode == "dynamo" for c in monitor.captures.values())


def test_include_exclude_prune_views(tmp_path: Path) -> None:
    cases = {
        "include": ({"include": r"fc1"}, {"fc1.weight", "fc1.bias", "fc1/linear", "fc1"}),  # `fc1`: the module's output
        "exclude": (
            {"exclude": r"\.(weight|bias)$|^x$", "prune_views": False},
            {"fc1/linear", "relu", "reshape", "flatten", "fc2/linear", "fc1", "fc2"},
        ),
        "prune": (
            {"include": r"/|relu|reshape|flatten"},
            {"fc1/linear", "relu", "fc2/linear"},
        ),  # views pruned by default
        "view": ({"include": r"^reshape$", "prune_views": False}, {"reshape"}),
    }
    for name, (kwargs, expected) in cases.items():
        torch.manual_seed(0)
        series = scalars(events(fit(Views(), tmp_path / name, [ScaleMonitor(every_n_steps=2, **kwargs)])))
        assert {t.split("/", 2)[2] for t in series} == expected, name
    # a view reports its input's statistics
    torch.manual_seed(0)
    series = scalars(events(fit(Views(), tmp_path / "all", [ScaleMonitor(every_n_steps=2, prune_views=False)])))
    for direction in ("fwd", "bwd"):
        assert series[f"scale/{direction}/reshape"] == series[f"scale/{direction}/relu"]


def test_leaf_modules_are_recorded_at_their_output(tmp_path: Path) -> None:
    torch.manual_seed(0)
    series = scalars(events(fit(MLP(), tmp_path, [ScaleMonitor(every_n_steps=2, leaf_modules=["net.0"])])))
    labels = {t.split("/", 2)[2] for t in series}
    assert {"net.0/linear", "net.2.weight"} <= labels and "net.0.weight" not in labels


def test_forced_fx_on_untraceable_model_trains_untracked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Branchy()
    with pytest.warns(
        UserWarning,
        match=r"ScaleMonitor: could not capture Branchy \(CaptureError: torch.fx could not trace Branchy"
        r".*training continues untracked",
    ):
        trainer = fit(model, tmp_path, [ScaleMonitor(every_n_steps=1, capture="fx")])
    assert trainer.global_step == 3 and len(model.losses) == 3
    assert not scalars(events(trainer))


def test_warns_when_nothing_is_recorded(tmp_path: Path) -> None:
    with pytest.warns(
        UserWarning, match=r"ScaleMonitor: nothing recorded at step 0: the captured forward of `Bypass` did not run"
    ):
        trainer = fit(Bypass(), tmp_path / "bypass", [ScaleMonitor(every_n_steps=2)])
    assert not scalars(events(trainer))
    with pytest.warns(
        UserWarning,
        match=r"ScaleMonitor: no node selected at step 0: `include` / `exclude` / `prune_views` leave none of 8 nodes",
    ):
        trainer = fit(MLP(), tmp_path / "none", [ScaleMonitor(every_n_steps=2, include="nothing-matches")])
    assert not scalars(events(trainer))


def test_max_tags_warns_and_caps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with pytest.warns(
        UserWarning, match=r"ScaleMonitor: 12 nodes have tensors; writing the first 3 \(raise `max_tags`"
    ):
        trainer = fit(Views(), tmp_path, [ScaleMonitor(every_n_steps=2, max_tags=3, prune_views=False)])
    series = scalars(events(trainer))
    assert {t.split("/", 2)[2] for t in series} == {"x", "fc1.weight", "fc1.bias"}


# ---- anomaly warnings, per node -----------------------------------------------------------


class CausalAttention(MLP):
    """Single-head causal self-attention: a ``masked_fill(-inf)`` and an additive ``-inf``
    mask, both absorbed by the softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(6, 18), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 6) seen as (B, T=2, 3) twice over
        q, k, v = self.qkv(x).reshape(x.shape[0], 3, 3, 2).unbind(1)  # (B, T=3, 2) each
        scores = q @ k.transpose(1, 2)  # (B, T, T)
        causal = torch.ones(3, 3, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        scores = scores + torch.zeros(3, 3).masked_fill(causal, float("-inf"))
        h = (scores.softmax(-1) @ v).reshape(x.shape[0], 6)
        return self.out(h)


class Poison(MLP):
    """NaN replaces the first block's output at the steps in ``first``, the second's at
    the steps in ``second``; the loss ignores NaN, so nothing else turns NaN."""

    def __init__(self, first: Tuple[int, ...], second: Tuple[int, ...]) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.first, self.second = first, second
        self.register_buffer("p1", torch.tensor(False))
        self.register_buffer("p2", torch.tensor(False))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.where(self.p1, torch.nan, self.fc1(x))
        return torch.where(self.p2, torch.nan, self.fc2(h.relu()))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.p1.fill_(self.global_step in self.first)
        self.p2.fill_(self.global_step in self.second)
        return F.mse_loss(self(batch[0]).nan_to_num(0.0), batch[1])


def _anomalies(record: Any) -> List[str]:
    return [str(w.message) for w in record if "pass at step" in str(w.message)]


def test_causal_masks_are_counted_not_warned(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        acc = events(
            fit(CausalAttention(), tmp_path, [ScaleMonitor(every_n_steps=1, statistics=["std", "inf"])], max_steps=2)
        )
    assert not _anomalies(record)
    series = scalars(acc, "inf/fwd/")
    assert at(series, "inf/fwd/masked_fill", 0) == 8 * 3  # batch 8, 3 masked entries of each 3x3
    assert at(series, "inf/fwd/add", 1) == 8 * 3
    assert at(series, "inf/fwd/softmax", 0) == 0


def test_nan_is_warned_per_node_where_it_first_appears(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Poison(first=(3,), second=(1, 2)), tmp_path, [ScaleMonitor(every_n_steps=1)], max_steps=4)
    found = _anomalies(record)
    assert found[:2] == [
        "ScaleMonitor: NaN in the forward pass at step 1, first at `where_1`",  # step 2: the same node, not again
        "ScaleMonitor: NaN in the forward pass at step 3, first at `where`; also new at 2 more node(s)",  # relu, fc2
    ], found
    # at step 3 the NaN reaches fc2's weight gradient too (relu(NaN) is its input)
    assert found[2:] == ["ScaleMonitor: NaN in the backward pass at step 3, first at `fc2.weight`"], found


class MaskThenOutput(nn.Module):
    """A ``-inf`` mask absorbed by a softmax, then a head whose output is the model's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        scores = self.fc(x).masked_fill(torch.arange(3) > 0, float("-inf"))  # (B, 3), columns 1, 2 masked
        return self.fc(scores.softmax(-1)) * 2.0


def test_anomaly_rules_on_pooled_records() -> None:
    from lightning_scale.record import stats
    from lightning_scale.report.anomalies import AnomalyWatch, consumers_of
    from lightning_scale.capture import capture

    cap = capture(MaskThenOutput(), "fx")
    labels = cap.node_labels
    assert "\x00output" in consumers_of(cap)["mul"] and consumers_of(cap)["masked_fill"] == {"softmax"}
    nan, inf = stats.FIELDS.index("nan"), stats.FIELDS.index("inf")

    def records(**marks: Tuple[int, int, int]) -> Tensor:  # label -> (direction, field, count)
        out = torch.zeros(len(labels), 2, len(stats.FIELDS), dtype=torch.float64)
        out[..., 0] = 1.0
        for label, (d, f, n) in marks.items():
            out[labels.index(label), d, f] = n
        return out

    watch = AnomalyWatch()
    assert watch.check(cap, labels, records(masked_fill=(0, inf, 2)), 0) == []  # absorbed
    assert watch.check(cap, labels, records(masked_fill=(0, inf, 2), mul=(0, inf, 1)), 1) == [
        "ScaleMonitor: Inf in the forward pass at step 1, first at `mul`"  # the model's output
    ]
    assert watch.check(cap, labels, records(softmax=(1, inf, 1)), 2) == [
        "ScaleMonitor: Inf in the backward pass at step 2, first at `softmax`"
    ]
    assert watch.check(cap, labels, records(softmax=(1, inf, 1), mul=(0, inf, 1)), 3) == []  # both seen before
    assert watch.check(cap, labels, records(masked_fill=(0, inf, 2), softmax=(0, nan, 3)), 4, "val_") == [
        "ScaleMonitor: Inf in the forward pass at step 4 (validation), first at `masked_fill`; also new at 1 more "
        "node(s)"
    ]  # a consumer turned NaN: the mask is no longer benign
