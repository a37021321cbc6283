"""ScaleMonitor on compiled models (Inductor on the CPU): the three ways users compile a GPT
in a LightningModule train bit-identically with and without the callback, every label of the
uncompiled model is logged, with the uncompiled model's values within compiled rounding, and
switching between tracked and untracked steps compiles nothing."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from tests.compiling import GraphCount
from lightning_scale import ScaleMonitor, Statistic
from lightning_scale.capture import compiled, instrument
from lightning_scale.tools.models import GPT, GPTConfig, synthetic_tokens

pytestmark = [
    pytest.mark.filterwarnings(
        "ignore::lightning.fabric.utilities.warnings.PossibleUserWarning", "ignore:.*LeafSpec.*:FutureWarning"
    ),
    # Inductor compiles with g++: ~20 s a cold compile here when idle, minutes when loaded.
    pytest.mark.timeout(1800),
]
VOCAB = 32


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles the GPT's forward afresh: dynamo keeps at most ``recompile_limit``
    (8) compiled versions of one code object, and this file's fits together make more; past
    the limit dynamo runs the forward uncompiled, the user's and the tracked version alike,
    and a later test would test nothing of the compiled route."""
    torch._dynamo.reset()


class CompiledGPT(pl.LightningModule):
    """A tiny GPT compiled as ``pattern`` says: ``whole`` (``torch.compile(model)``),
    ``in_place`` (``model.compile()``), ``blocks`` (each block ``torch.compile(block)``), or
    ``None`` (not compiled)."""

    def __init__(
        self, pattern: Optional[str], backend: str = "inductor", layers: int = 2, dropout: float = 0.0
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        gpt: Any = GPT(GPTConfig(vocab=VOCAB, seq=8, layers=layers, dim=32, heads=2, dropout=dropout))
        if pattern == "whole":
            gpt = torch.compile(gpt, backend=backend)
        elif pattern == "in_place":
            gpt.compile()
        elif pattern == "blocks":
            for i, block in enumerate(gpt.blocks):
                gpt.blocks[i] = torch.compile(block)
        self.model = gpt

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    tmp_path: Path,
    pattern: Optional[str],
    monitor: Optional[ScaleMonitor],
    backend: str = "inductor",
    layers: int = 2,
    precision: str = "32-true",
    dropout: float = 0.0,
) -> Tuple[CompiledGPT, GraphCount]:
    x, y = synthetic_tokens(16, 8, VOCAB)
    module, count = CompiledGPT(pattern, backend, layers, dropout), GraphCount()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=4,
        precision=precision,  # type: ignore[arg-type]
        logger=TensorBoardLogger(str(tmp_path), name="", version=""),
        callbacks=[count] + ([monitor] if monitor is not None else []),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    return module, count


def logged(path: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {
        tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"] if tag.startswith("scale/")
    }


def monitor(**kwargs: Any) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=2, histograms=False, code=False, **kwargs)  # steps 0 and 2 tracked


@pytest.fixture(scope="module")
def uncompiled(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[int, float]]:
    """What the uncompiled model logs, through the dynamo route (whose labels the compiled
    route gives)."""
    path = tmp_path_factory.mktemp("uncompiled")
    fit(path, None, monitor(capture="dynamo"))
    torch._dynamo.reset()
    return logged(path)


@pytest.fixture(scope="module")
def uncompiled_fx(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[int, float]]:
    """What the uncompiled model logs through the fx route."""
    path = tmp_path_factory.mktemp("uncompiled_fx")
    fit(path, None, monitor(capture="fx"))
    return logged(path)


def test_fx_and_dynamo_log_the_same_tags(
    uncompiled: Dict[str, Dict[int, float]], uncompiled_fx: Dict[str, Dict[int, float]]
) -> None:
    """q, k and v of attention are ``attn/split[0..2]`` on both routes (they were
    ``getitem_3..5`` under fx, numbered after the shape items, and ``getitem..getitem_2``
    under dynamo), so the uncompiled routes log the same tags, with the same values."""
    assert sorted(uncompiled_fx) == sorted(uncompiled)
    assert "scale/fwd/model.blocks.1.attn/split[0]" in uncompiled
    for tag, values in uncompiled.items():
        assert uncompiled_fx[tag] == pytest.approx(values, rel=1e-6), tag


@pytest.mark.parametrize("pattern", ["whole", "in_place", "blocks"])
def test_compiled_gpt_is_seen_inside_and_trains_unchanged(
    tmp_path: Path, pattern: str, uncompiled: Dict[str, Dict[int, float]]
) -> None:
    plain, _ = fit(tmp_path / "plain", pattern, None)
    watched = monitor()
    tracked, count = fit(tmp_path / "tracked", pattern, watched)
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name  # the callback changed nothing

    # steps 2 (tracked) and 3 (untracked) compiled nothing: both versions were ready
    assert count.counts[1] == count.counts[2] == count.counts[3]
    (cap,) = list(watched.captures.values())
    assert cap.compiled is not None and cap.compiled.compile_seconds > 0

    got = logged(tmp_path / "tracked")
    assert "scale/fwd/model.blocks.1.mlp.fc1/linear" in got and "scale/bwd/model.blocks.0.attn" in got
    assert set(uncompiled) <= set(got), sorted(set(uncompiled) - set(got))
    assert "scale/fwd/model.blocks.0.attn/split[1]" in got  # k: named after its source on this route too
    # the rest is the compiled modules' own outputs, as fx leaves (`model/gpt`, `model.blocks.0/block`)
    assert all(re.fullmatch(r"scale/(fwd|bwd)/model(\.blocks\.\d)?/(gpt|block)", t) for t in set(got) - set(uncompiled))
    for tag, values in uncompiled.items():
        # step 0: the same parameters and batch; Inductor rounds float32 work differently
        # (fused layer norm, GELU, softmax): ~1e-6 relative per element
        assert got[tag][0] == pytest.approx(values[0], rel=1e-4, abs=1e-7), tag
        assert got[tag][2] == pytest.approx(values[2], rel=1e-3, abs=1e-6), tag
    print(pattern, sorted(set(got) - set(uncompiled)))


@pytest.mark.parametrize("shadow", ["never", "auto"])
def test_a_tracked_version_that_differs_is_never_tracked_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shadow: str
) -> None:
    """Fault injection: an instrumented graph that changes the forward (a probe adding
    1e-3) is caught by the fidelity probe; the fit trains as without the callback, untracked
    with one warning (``shadow="never"``) or tracked by a shadow pass (the default), whose
    statistics are the instrumented version's."""
    plain, _ = fit(tmp_path / "plain", "whole", None, backend="aot_eager")  # (no C++ compile: fast)

    def shifted(ctx: Any, x: Tensor, probe: Tensor, groups: Tuple[str, ...], copy: bool, host: bool) -> Tensor:
        ctx.groups, ctx.host = groups, host
        return x + 1e-3

    monkeypatch.setattr(instrument.Probe, "forward", staticmethod(shifted))
    watched = monitor(shadow=shadow)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tracked, _ = fit(tmp_path / "tracked", "whole", watched, backend="aot_eager")
    ours = [str(w.message) for w in record if "ScaleMonitor" in str(w.message)]
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name
    got = [t for t in logged(tmp_path / "tracked") if t.startswith("scale/fwd/model.blocks")]
    if shadow == "never":
        assert len(ours) == 1 and "does not reproduce its own forward bit for bit" in ours[0], ours
        assert "training continues untracked" in ours[0] and not got
    else:
        assert ours == [] and "scale/fwd/model.blocks.1.mlp.fc1/linear" in got
        assert [cap.shadowed for cap in watched.captures.values()] == [True]


def test_a_graph_that_cannot_be_instrumented_runs_as_the_user_compiled_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the instrumentation raises; the graph runs as the user's backend
    compiles it, the step logs nothing and one warning says why."""
    plain, _ = fit(tmp_path / "plain", "whole", None, backend="aot_eager")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(compiled, "instrument_graph", broken)
    with pytest.warns(UserWarning) as record:
        tracked, _ = fit(tmp_path / "tracked", "whole", monitor(), backend="aot_eager")
    ours = [str(w.message) for w in record if "ScaleMonitor" in str(w.message)]
    assert len(ours) == 1 and "compiled graph not instrumented (RuntimeError: injected)" in ours[0], ours
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name


CHANNELS = ["channel_max_ratio", "outlier_channels"]


def channel_logged(path: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.split("/")[0] in CHANNELS]
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags}


def test_channel_statistics_of_a_compiled_gpt_equal_the_uncompiled_models(tmp_path: Path) -> None:
    """The ``channels`` group compiled into the graphs (aot_eager: no C++ compile): every
    channel tag the uncompiled model logs through the dynamo route (the host path's rows) is
    logged, with the same value at both tracked steps (a max is exact, and aot_eager computes
    eager's tensors); training is bit-identical to the compiled model's without the callback."""
    statistics = ["std", *CHANNELS]  # (one block: the tracked version's compile is most of the test's time)
    fit(tmp_path / "uncompiled", None, monitor(capture="dynamo", statistics=statistics), layers=1)
    torch._dynamo.reset()
    plain, _ = fit(tmp_path / "plain", "whole", None, backend="aot_eager", layers=1)
    tracked, _ = fit(tmp_path / "tracked", "whole", monitor(statistics=statistics), backend="aot_eager", layers=1)
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name
    want, got = channel_logged(tmp_path / "uncompiled"), channel_logged(tmp_path / "tracked")
    assert "channel_max_ratio/fwd/model.blocks.0.mlp.fc1/linear" in want
    assert "outlier_channels/bwd/model.blocks.0.attn" in want and "channel_max_ratio/bwd/model.head.weight" in want
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for tag, values in want.items():  # (steps where every channel maximum is 0, zero-initialised biases: none)
        assert set(values) <= {0, 2} and got[tag] == values, tag
    assert sum(len(v) for v in want.values()) > 100
    torch._dynamo.reset()


PEAK = Statistic("peak_sq", maxes={"sq": torch.square}, value=lambda s: s["sq"], unscale=2)
MEAN_ABS = Statistic("mean_abs", sums={"abs": torch.abs}, value=lambda s: s["abs"] / s["count"], unscale=1)


def user_logged(path: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith(("mean_abs/", "peak_sq/"))]
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in tags}


@pytest.mark.parametrize("ops", ["auto", "ops"])
def test_user_statistics_of_a_compiled_gpt_equal_the_uncompiled_models(
    tmp_path: Path, ops: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user statistic's sum and max compiled into the graphs, with the host op (``auto``) and
    with the traceable ops (``ops``; aot_eager: no C++ compile): every tag the uncompiled model
    logs through the dynamo route is logged, a max exactly, a mean within float32 row sums;
    training is bit-identical to the compiled model's without the callback."""
    monkeypatch.setenv("LIGHTNING_SCALE_COMPILED_STATS", ops)
    statistics = ["std", MEAN_ABS, PEAK]
    fit(tmp_path / "uncompiled", None, monitor(capture="dynamo", statistics=statistics), layers=1)
    torch._dynamo.reset()
    plain, _ = fit(tmp_path / "plain", "whole", None, backend="aot_eager", layers=1)
    tracked, _ = fit(tmp_path / "tracked", "whole", monitor(statistics=statistics), backend="aot_eager", layers=1)
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name
    want, got = user_logged(tmp_path / "uncompiled"), user_logged(tmp_path / "tracked")
    assert "mean_abs/fwd/model.blocks.0.mlp.fc1/linear" in want and "peak_sq/bwd/model.head.weight" in want
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for tag, values in want.items():
        assert set(values) == {0, 2}, tag
        for step, v in values.items():
            assert got[tag][step] == pytest.approx(v, rel=1e-6 if tag.startswith("mean_abs") else 0), (tag, step)
    assert len(want) > 60
    torch._dynamo.reset()


def test_bf16_mixed_is_tracked_in_place_and_bf16_true_by_a_shadow_pass(tmp_path: Path) -> None:
    """Under autocast (``bf16-mixed``) the compiled route tracks in place and training is
    bit-identical. A model held in bf16 (``bf16-true``): Inductor keeps a fused chain's
    intermediates in float32 and rounds only what it stores, so a graph whose intermediates
    are also recorded rounds differently; the fidelity probe sees it, and the fit is tracked by
    a shadow pass, bit-identical to the fit without the callback (docs/limitations.md)."""
    for precision in ("bf16-mixed", "bf16-true"):
        plain, _ = fit(tmp_path / precision / "plain", "whole", None, layers=1, precision=precision)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watched = monitor()
            tracked, _ = fit(tmp_path / precision / "tracked", "whole", watched, layers=1, precision=precision)
        for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
            assert torch.equal(p, q), (precision, name)
        assert not [w for w in caught if "ScaleMonitor" in str(w.message)]
        got = logged(tmp_path / precision / "tracked")
        assert "scale/fwd/model.blocks.0.mlp.fc1/linear" in got and "scale/bwd/model.blocks.0.attn" in got
        (cap,) = list(watched.captures.values())
        assert cap.shadowed == (precision == "bf16-true")
        if precision == "bf16-true":
            assert next(tracked.parameters()).dtype == torch.bfloat16


@pytest.fixture
def deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for one test, then as it was."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_compiled_gpt_with_dropout_is_tracked_and_trains_unchanged(tmp_path: Path, deterministic: None) -> None:
    """Dropout inside the compiled graph (Inductor draws its own random numbers, from seeds
    taken off the global generator once per call): the tracked version draws the same masks
    and leaves the generator where the user's version leaves it, and the fidelity probe puts
    back what it drew, so the fit is bit-identical to the fit without the callback.

    Deterministic algorithms are on because the user's compiled model is not reproducible on
    its own otherwise: Inductor's CPU embedding backward adds into the weight's gradient with
    atomic adds from several threads, so two fits without the callback can already differ in
    the last bits (seen on a Hugging Face GPT-2, with and without dropout; docs/limitations.md)."""
    plain, _ = fit(tmp_path / "plain", "whole", None, layers=1, dropout=0.1)
    tracked, _ = fit(tmp_path / "tracked", "whole", monitor(), layers=1, dropout=0.1)
    for (name, p), q in zip(plain.named_parameters(), tracked.parameters()):
        assert torch.equal(p, q), name
    got = logged(tmp_path / "tracked")
    assert got["scale/fwd/model.blocks.0.mlp.drop/dropout"].keys() == {0, 2}, sorted(got)
    assert "scale/bwd/model.blocks.0.attn" in got
    # the dropout is live in the compiled graph: two training-mode forwards differ
    x, _ = synthetic_tokens(4, 8, VOCAB)
    with torch.no_grad():
        assert not torch.equal(tracked.model(x), tracked.model(x))


def test_a_statistics_op_failing_after_the_probe_ends_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection: the host op raises on step 2's tracked step, after the fidelity probe
    passed. It raises inside the compiled graph, so it must not raise at all: the step's
    statistics are dropped with a warning, the fit finishes, training is unchanged."""
    from lightning_scale.record.stats import host_op

    plain, _ = fit(tmp_path / "plain", "whole", None, backend="aot_eager")
    real, broken = host_op._values, []

    def record(x: Tensor, groups: str) -> Any:
        if broken:
            raise RuntimeError("injected fault in the statistics op")
        return real(x, groups)

    class BreakAtStep2(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                broken.append(True)

    monkeypatch.setattr(host_op, "_values", record)
    watched = monitor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = CompiledGPT("whole", "aot_eager")
        x, y = synthetic_tokens(16, 8, VOCAB)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=TensorBoardLogger(str(tmp_path / "tracked"), name="", version=""),
            callbacks=[BreakAtStep2(), watched],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=4))
    assert trainer.global_step == 4
    for (name, p), q in zip(plain.named_parameters(), module.parameters()):
        assert torch.equal(p, q), name
    failed = [str(w.message) for w in caught if "injected fault in the statistics op" in str(w.message)]
    assert len(failed) == 1 and "at step 2" in failed[0], failed
    got = logged(tmp_path / "tracked")
    assert got["scale/fwd/model.blocks.0.mlp.fc1/linear"].keys() == {0}  # step 0 logged, step 2 dropped
