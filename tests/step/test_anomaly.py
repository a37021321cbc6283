"""AnomalyDetector without Lightning: the median window, the factor, non-finite losses, a
GradScaler's skipped step, the one-step latency, argument errors, and two gloo ranks that
see different losses but decide the same."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence

import pytest
import torch

from lightning_scale.step.anomaly import LATENCY, Anomaly, AnomalyDetector, check_arguments, judge


def _run(detector: AnomalyDetector, losses: Sequence[float], skipped: Sequence[int] = ()) -> List[int]:
    """Drive the detector as the callback does; return the steps it asks to track."""
    tracked = []
    for step, loss in enumerate(losses):
        detector.poll(step)
        if detector.tracks(step):
            tracked.append(step)
        before = torch.tensor(2.0**16)
        after = before * (0.5 if step in skipped else 1.0)
        detector.observe(step, torch.tensor(loss), before, after)
    return tracked


def test_a_spike_tracks_the_next_steps_after_one_step_of_latency() -> None:
    losses = [2.0, 2.2, 1.8, 2.1, 2.0, 2.0, 30.0] + [2.0] * 10
    det = AnomalyDetector(steps=3, factor=10)
    assert _run(det, losses) == [6 + 1 + LATENCY + i for i in range(3)] == [8, 9, 10]
    (event,) = det.anomalies
    assert (event.step, event.loss, event.median, event.first, event.last) == (6, 30.0, 2.0, 8, 10)
    assert event.reason.startswith("loss spike: 30 > 10 x running median 2")


def test_the_factor_is_a_strict_threshold_on_the_median_of_the_window() -> None:
    # median of [1, 1, 100, 1, 1] is 1: an earlier outlier (seen before min_history) does not move it
    assert _run(AnomalyDetector(steps=1, factor=10), [1, 1, 100, 1, 1, 11.0, 1, 1]) == [7]
    # exactly factor x median is not a spike; just above is
    assert _run(AnomalyDetector(steps=1, factor=10), [1, 1, 1, 1, 10.0, 1, 1]) == []
    assert _run(AnomalyDetector(steps=1, factor=10), [1, 1, 1, 1, 10.001, 1, 1]) == [6]


def test_the_median_is_taken_over_the_last_window_losses() -> None:
    # window 4: the first two 100s see a median of 1 (steps 4, 5 trigger 6, 7); the third
    # sees [1, 1, 100, 100] (median 50.5); 500 at step 8 sees [100] * 4: 5x, no spike
    det = AnomalyDetector(steps=1, factor=10, window=4, min_history=4)
    tracked = _run(det, [1.0] * 4 + [100.0] * 4 + [500.0, 1, 1])
    assert tracked == [6, 7]
    assert list(det.losses.values) == [100.0, 100.0, 100.0, 500.0]  # steps 9, 10 still in flight


def test_no_spike_is_judged_before_min_history_losses() -> None:
    assert _run(AnomalyDetector(steps=2, min_history=4), [1, 1, 1, 100.0, 1, 1, 1]) == []
    assert _run(AnomalyDetector(steps=2, min_history=3), [1, 1, 1, 100.0, 1, 1, 1]) == [5, 6]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_triggers_and_stays_out_of_the_window(bad: float) -> None:
    det = AnomalyDetector(steps=2)
    assert _run(det, [1.0, bad, 1.0, 1.0, 1.0]) == [3, 4]  # no history needed
    (event,) = det.anomalies
    assert event.reason == "non-finite loss" and math.isnan(event.loss) and event.step == 1
    assert list(det.losses.values) == [1.0, 1.0]  # steps 0 and 2; 3 and 4 still in flight


def test_a_gradscaler_skip_triggers() -> None:
    det = AnomalyDetector(steps=2)
    assert _run(det, [1.0] * 8, skipped=[3]) == [5, 6]
    assert det.anomalies[0].reason == "GradScaler skipped the optimizer step (non-finite gradients)"


def test_overlapping_anomalies_extend_one_window() -> None:
    det = AnomalyDetector(steps=3, min_history=1)
    assert _run(det, [1.0, math.nan, math.nan, 1.0, 1.0, 1.0, 1.0, 1.0]) == [3, 4, 5, 6]
    first, second = det.anomalies
    assert (first.first, first.last, second.first, second.last) == (3, 5, 3, 6)


def test_a_reset_drops_losses_in_flight() -> None:
    det = AnomalyDetector(steps=1, min_history=1)
    det.observe(0, torch.tensor(math.nan))
    det.poll(1)
    det.reset()
    assert det.poll(2) is None and det.anomalies == []


def test_judge_names_every_reason_and_ignores_non_positive_medians() -> None:
    assert judge(5.0, False, False, None, 10) is None
    assert judge(-1.0, False, False, -0.5, 10) is None  # 2 x a negative median is no spike
    assert (
        judge(math.nan, True, True, 1.0, 10)
        == "non-finite loss; GradScaler skipped the optimizer step (non-finite gradients)"
    )
    assert judge(11.0, False, False, 1.0, 10) == "loss spike: 11 > 10 x running median 1"


def test_describe_gives_step_loss_reason_and_tracked_steps() -> None:
    text = Anomaly(4, 30.0, 2.0, "loss spike", 6, 9).describe()
    assert text == "step 4: loss 30 (running median 2); loss spike; tracking steps 6..9"


@pytest.mark.parametrize(
    ("steps", "factor", "match"),
    [
        (-1, 10, r"`anomaly_steps` must be a non-negative integer \(0 turns detection off\), got -1"),
        (True, 10, r"`anomaly_steps` must be a non-negative integer .*got True"),
        (2.0, 10, r"`anomaly_steps` must be a non-negative integer .*got 2.0"),
        (2, 1, r"`anomaly_factor` must be a finite number above 1, got 1"),
        (2, "10", r"`anomaly_factor` must be a finite number above 1, got '10' \(str\)"),
        (2, math.nan, r"`anomaly_factor` must be a finite number above 1, got nan"),
        (2, math.inf, r"`anomaly_factor` must be a finite number above 1, got inf"),
        (2, True, r"`anomaly_factor` must be a finite number above 1, got True \(bool\)"),
    ],
)
def test_bad_arguments_are_named(steps: object, factor: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_arguments(steps, factor)  # type: ignore[arg-type]


def test_a_detector_needs_positive_steps_and_a_valid_history() -> None:
    with pytest.raises(ValueError, match=r"`anomaly_steps` must be positive for a detector, got 0"):
        AnomalyDetector(0)
    with pytest.raises(ValueError, match=r"`min_history` must be in \[1, window=4\], got 5"):
        AnomalyDetector(1, window=4, min_history=5)
    with pytest.raises(ValueError, match=r"`min_history` must be a positive integer, got 0"):
        AnomalyDetector(1, window=4, min_history=0)
    with pytest.raises(ValueError, match=r"`window` must be a positive integer, got 2.0 \(float\)"):
        AnomalyDetector(1, window=2.0)  # type: ignore[arg-type]


# ---- two ranks over gloo -------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ranks_with_different_losses_decide_the_same(tmp_path: Path) -> None:
    # Two plain processes that import torch and anomaly.py only (not this module, nor
    # Lightning): the ranks start in seconds; what is tested is the detector's reduction.
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    script = str(ROOT / "tests" / "dist_scripts" / "run_detector.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(tmp_path), str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("detector ranks hung")
    assert [p.returncode for p in procs] == [0, 0], outputs
    results: List[Optional[dict]] = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert repr(results[0]) == repr(results[1])  # repr: NaN != NaN
    assert results[0] is not None and results[0]["tracked"] == [8, 9, 14, 15]
    (s1, l1, r1), (s2, l2, r2) = results[0]["events"]
    assert (s1, l1, s2, r2) == (6, 40.0, 12, "non-finite loss") and r1.startswith("loss spike")
    assert math.isnan(l2)


# ---- real Trainer runs -----------------------------------------------------------------

import lightning.pytorch as pl  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_scale import ScaleMonitor  # noqa: E402


class Spiky(pl.LightningModule):
    """An MLP whose loss *value* jumps (or turns NaN) at chosen steps, its gradient unchanged,
    or whose gradient turns infinite at chosen steps (GradScaler skips them)."""

    def __init__(self, spike: Sequence[int] = (), nan: Sequence[int] = (), inf_grad: Sequence[int] = ()) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        self.spike, self.nan, self.inf_grad = set(spike), set(nan), set(inf_grad)
        self.losses: List[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        if self.global_step in self.inf_grad:
            out.register_hook(lambda g: g * math.inf)
        loss = F.mse_loss(out.float(), y)
        if self.global_step in self.spike:
            loss = loss + 1e3 * loss.detach()
        if self.global_step in self.nan:
            loss = loss + (loss * math.nan).detach()
        self.losses.append(float(loss.detach()))  # the test's record; the monitor never reads it
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(
    tmp_path: Path, module: pl.LightningModule, steps: int, monitor: Optional[ScaleMonitor], **kwargs: object
) -> Path:
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(4 * steps * 2, 6), torch.randn(4 * steps * 2, 3))
    trainer = pl.Trainer(
        max_steps=steps,
        logger=TensorBoardLogger(str(tmp_path), name="logs", version=0),
        callbacks=[monitor] if monitor else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,  # type: ignore[arg-type]
    )
    trainer.fit(module, DataLoader(data, batch_size=4))
    return tmp_path / "logs" / "version_0"


def _events(logdir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _tracked_steps(acc: EventAccumulator) -> List[int]:
    tag = next(t for t in acc.Tags()["scalars"] if t.startswith("scale/fwd/"))
    return [e.step for e in acc.Scalars(tag)]


def _monitor(**kwargs: Any) -> ScaleMonitor:
    return ScaleMonitor(every_n_steps=None, steps=[0], histograms=False, figure=False, code=False, **kwargs)


def test_a_loss_spike_triggers_tracking_and_is_logged(tmp_path: Path) -> None:
    module = Spiky(spike=[6])
    acc = _events(_fit(tmp_path, module, 14, _monitor(anomaly_steps=3)))
    assert _tracked_steps(acc) == [0, 8, 9, 10]  # 6 + 1 + LATENCY .. + 3
    (event,) = acc.Scalars("anomaly/loss")
    assert event.step == 6 and event.value == pytest.approx(module.losses[6], rel=1e-6)
    (text,) = acc.Tensors("anomaly/event/text_summary")
    message = text.tensor_proto.string_val[0].decode()
    assert text.step == 6 and message.startswith(f"step 6: loss {module.losses[6]:.6g}")
    assert "loss spike" in message and message.endswith("tracking steps 8..10")


def test_a_non_finite_loss_triggers_tracking(tmp_path: Path) -> None:
    acc = _events(_fit(tmp_path, Spiky(nan=[2]), 8, _monitor(anomaly_steps=2)))
    assert _tracked_steps(acc) == [0, 4, 5]
    (event,) = acc.Scalars("anomaly/loss")
    assert event.step == 2 and math.isnan(event.value)


def test_a_gradscaler_skip_triggers_tracking(tmp_path: Path) -> None:
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    acc = _events(_fit(tmp_path, Spiky(inf_grad=[3]), 8, _monitor(anomaly_steps=2), plugins=[plugin]))
    assert _tracked_steps(acc) == [0, 5, 6]
    (text,) = acc.Tensors("anomaly/event/text_summary")
    assert "GradScaler skipped the optimizer step" in text.tensor_proto.string_val[0].decode()


def test_training_is_bit_identical_with_detection_and_update_ratios(tmp_path: Path) -> None:
    watched, plain = Spiky(spike=[3]), Spiky(spike=[3])
    plain.load_state_dict(watched.state_dict())
    _fit(tmp_path / "on", watched, 10, _monitor(anomaly_steps=2, update_ratios=True), accumulate_grad_batches=2)
    _fit(tmp_path / "off", plain, 10, None, accumulate_grad_batches=2)
    assert watched.losses == plain.losses
    for (name, a), b in zip(watched.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), name


def test_callback_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`anomaly_steps` must be a non-negative integer"):
        ScaleMonitor(anomaly_steps=-2)
    with pytest.raises(ValueError, match=r"`anomaly_factor` must be a finite number above 1, got 0.5"):
        ScaleMonitor(anomaly_steps=2, anomaly_factor=0.5)
