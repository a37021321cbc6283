"""Channel outliers (record/stats/channels.py): closed forms on constructed tensors, a float64 numpy
reference, the fold above the cap, rows merged across micro-batches as the whole, the Recorder's
placement; and a real Trainer run on the demo GPT read back from TensorBoard against the same
float64 reference of the twin's tensors, with training bit-identical to training without the
monitor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Tuple

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn

from lightning_scale import ScaleMonitor
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, observe, recording
from lightning_scale.record.stats.channels import (
    CHANNEL_CAP,
    CHANNEL_WIDTH,
    OUTLIER,
    channel_max_ratio,
    channel_maxima,
    channel_row,
    channel_statistics,
    merge_channel_rows,
    outlier_channels,
)
from lightning_scale.report.values import StepValues
from lightning_scale.report.scalars import scalar_values
from lightning_scale.tools.demo import GPTModule
from test_fp8_whatif import STEPS, fit, tiny_gpt, twin_tensors

CHANNELS = ["channel_max_ratio", "outlier_channels"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference(x: Tensor) -> Tuple[float, float]:
    """(max / median, fraction above 6) of the channel maxima of ``x`` in float64 numpy; above
    ``CHANNEL_CAP`` channels of the folded maxima (slot k: channels k, k + CAP, ...)."""
    a = np.abs(x.double().numpy())
    a = np.where(np.isfinite(a), a, 0.0)
    m = a.reshape(-1, a.shape[-1] if a.ndim else 1).max(0)
    if m.size > CHANNEL_CAP:
        m = np.array([m[k::CHANNEL_CAP].max() for k in range(CHANNEL_CAP)])
    median = float(np.median(m))
    ratio = float(m.max()) / median if median > 0 else (math.inf if m.max() > 0 else math.nan)
    return ratio, float((m > OUTLIER).mean())


def spiky(rows: int, channels: int, seed: int) -> Tensor:
    """Gaussian activations with a few outlier channels (as LLM hidden states have)."""
    x = torch.randn(rows, channels, generator=_gen(seed))
    x[:, 5] *= 40
    x[rows // 2, 7] = -25.0
    return x


def test_closed_forms() -> None:
    """Channel j of 100 holds +-(j + 1): maxima 1..100, median 50.5, 94 of them above 6."""
    x = torch.arange(1.0, 101.0).repeat(3, 1)
    x[1] *= -1
    row = channel_row(x)
    assert row[0] == 100 and torch.equal(row[1:101], torch.arange(1.0, 101.0, dtype=torch.float64))
    assert float(channel_max_ratio(row)) == 100 / 50.5
    assert float(outlier_channels(row)) == 0.94
    odd = channel_row(torch.tensor([[1.0, 2.0, 9.0], [-3.0, 0.5, 0.0]]))  # maxima 3, 2, 9
    assert float(channel_max_ratio(odd)) == 3.0 and float(outlier_channels(odd)) == 1 / 3
    assert float(channel_max_ratio(channel_row(torch.full((5, 8), -2.0)))) == 1.0  # every channel alike


@pytest.mark.parametrize("shape", [(64, 100), (2, 16, 33), (7,), (1, 4096), (3, 5000)])
def test_statistics_equal_a_float64_reference(shape: tuple) -> None:
    x = torch.randn(shape, generator=_gen(11)) * 3
    x.view(-1)[0] = 50.0
    row = channel_row(x)
    assert row.shape == (CHANNEL_WIDTH,) and row[0] == shape[-1]
    ratio, outliers = reference(x)
    assert float(channel_max_ratio(row)) == pytest.approx(ratio, rel=1e-15)
    assert float(outlier_channels(row)) == outliers
    got = channel_statistics(row[None])
    assert list(got) == CHANNELS and float(got["outlier_channels"][0]) == outliers


def test_layouts_and_chunks_read_the_same_channels() -> None:
    x = spiky(48, 96, 3)
    want = channel_row(x)
    assert torch.equal(channel_row(x, chunk=64), want)  # pieces of whole rows
    assert torch.equal(channel_row(x, chunk=40), want)  # pieces that cut rows at 32 columns
    assert torch.equal(channel_row(x.t().contiguous().t()), want)  # a column-major layout
    assert torch.equal(channel_row(x.view(4, 12, 96)[:, ::2].reshape(-1, 96)), channel_row(x.view(4, 12, 96)[:, ::2]))
    assert torch.equal(channel_row(x.half()), channel_row(x.half().float()))
    y = x.clone()  # with NaN and Inf: the host's max/min no longer serve, |x| is read in pieces
    y[3, 7], y[40, 90] = math.nan, -math.inf
    ratio, outliers = reference(y)
    for chunk in (40, 64, 1 << 20):
        row = channel_row(y.t().contiguous().t(), chunk=chunk)
        assert float(channel_max_ratio(row)) == pytest.approx(ratio, rel=1e-15)
        assert float(outlier_channels(row)) == outliers and row[8] == float(torch.cat([x[:3, 7], x[4:, 7]]).abs().max())


def test_micro_batches_and_ranks_merge_exactly_by_a_max() -> None:
    for x in (spiky(96, 512, 12), spiky(30, CHANNEL_CAP + 904, 13)):
        parts = torch.stack([channel_row(p) for p in x.split([10, 13, 7] if x.shape[0] == 30 else [10, 50, 36])])
        merged = merge_channel_rows(parts)
        assert torch.equal(merged, channel_row(x))
        ratio, outliers = reference(x)
        assert float(channel_max_ratio(merged)) == pytest.approx(ratio, rel=1e-15)
        assert float(outlier_channels(merged)) == outliers


def test_the_fold_above_the_cap() -> None:
    """5,000 Gaussian channels: the largest maximum is exact; the slots' median (some the max of
    two channels) is above the channels', so the ratio reads lower; the two outlier channels
    (5 and 7) fill two of the 4,096 slots."""
    x = spiky(40, CHANNEL_CAP + 904, 14)
    row = channel_row(x)
    assert row[0] == CHANNEL_CAP + 904 and float(row[1:].max()) == float(x.abs().max())
    m = channel_maxima(x)
    true_ratio = float(m.max() / m.median()) if m.numel() % 2 else float(m.max() / m.quantile(0.5))
    assert float(channel_max_ratio(row)) <= true_ratio
    assert float(outlier_channels(row)) == 2 / CHANNEL_CAP and int((m > OUTLIER).sum()) == 2


def test_non_finite_empty_and_zero_tensors() -> None:
    x = torch.randn(8, 10, generator=_gen(14))
    y, z = x.clone(), x.clone()
    y[2, 3], y[4, 4], y[5, 5] = math.nan, math.inf, -math.inf
    z[2, 3], z[4, 4], z[5, 5] = 0.0, 0.0, 0.0
    assert torch.equal(channel_row(y), channel_row(z))  # (non-finite elements count as 0)
    none = torch.zeros(2, CHANNEL_WIDTH)  # a node without channel rows (count 0)
    assert channel_max_ratio(none).isnan().all() and outlier_channels(none).isnan().all()
    zeros = channel_row(torch.zeros(3, 4))
    assert math.isnan(float(channel_max_ratio(zeros))) and float(outlier_channels(zeros)) == 0.0
    one_spike = torch.zeros(3, 4)
    one_spike[0, 0] = 1.0
    assert float(channel_max_ratio(channel_row(one_spike))) == math.inf  # median 0, max not
    assert channel_row(torch.empty(0, 5))[0] == 5 and channel_row(torch.tensor(-7.0))[:2].tolist() == [1.0, 7.0]
    with pytest.raises(ValueError, match="`names` must be channel statistics"):
        channel_statistics(zeros, ["std"])
    with pytest.raises(ValueError, match="not derived from a record"):
        stats.statistic(torch.zeros(1, len(stats.FIELDS), dtype=torch.float64), "outlier_channels")


# ---------------------------------------------------------------------------------------
# The Recorder keeps a row per key and direction, merged over micro-batches, placed as records


def test_recorder_merges_micro_batches_and_places_aliases() -> None:
    a, b = spiky(6, 40, 1).requires_grad_(), spiky(9, 40, 2).requires_grad_()
    rec = Recorder(("moments", "channels"))
    with recording(rec):
        for x in (a, b):  # two micro-batches of one node
            y = x * 1.0
            observe(y, "node")
            (y * torch.arange(40.0)).sum().backward()
    rows = rec.channel_tensor(["node", "view", "unseen"], {"view": "node"})
    assert rows.shape == (3, 2, CHANNEL_WIDTH)
    assert torch.equal(rows[0, FORWARD], channel_row(torch.cat([a, b]).detach()))
    assert torch.equal(rows[0, BACKWARD], channel_row(torch.arange(40.0).expand(15, 40)))
    assert torch.equal(rows[1], rows[0]) and not rows[2].any()
    plain = Recorder(("moments",))
    with recording(plain):
        observe(a * 1.0, "node")
    assert plain.channels is None and not plain.channel_tensor(["node"]).any()
    # the channels group changes no record: the same rows with and without it
    rec2 = Recorder(("moments", "range", "channels"))
    plain2 = Recorder(("moments", "range"))
    for r in (rec2, plain2):
        with recording(r):
            observe(a.detach() * 2, "node")
    torch.testing.assert_close(rec2.records(["node"]), plain2.records(["node"]), rtol=0, atol=0, equal_nan=True)
    rec.clear()
    assert not rec.channel_tensor(["node"]).any()


def test_unscaled_gradients_move_the_outlier_threshold_not_the_ratio() -> None:
    """With a loss scale of 1024 the backward maxima 1..8 arrive as 1024..8192: unscaled (x 1/1024)
    two of eight channels are above 6 again; the ratio does not change; forward rows are untouched."""
    rows = torch.stack([channel_row(torch.arange(1.0, 9.0)), channel_row(torch.arange(1.0, 9.0) * 1024)])[None]
    records = torch.zeros(1, 2, len(stats.FIELDS), dtype=torch.float64)
    records[..., 0] = 8.0
    scaled, unscaled = StepValues(records, channels=rows), StepValues(records, factor=-1 / 1024, channels=rows)
    assert outlier_channels(rows[0]).tolist() == [0.25, 1.0] == scaled("outlier_channels")[0].tolist()
    assert unscaled("outlier_channels")[0].tolist() == [0.25, 0.25]  # (a negative factor scales maxima by its size)
    assert unscaled("channel_max_ratio")[0].tolist() == channel_max_ratio(rows[0]).tolist() == [8 / 4.5, 8 / 4.5]
    assert torch.equal(rows[0, BACKWARD, 1:9], torch.arange(1.0, 9.0, dtype=torch.float64) * 1024)  # (not changed)


def test_scalars_leave_out_unknown_channel_statistics() -> None:
    records = torch.zeros(2, 2, len(stats.FIELDS), dtype=torch.float64)
    records[..., 0] = 4.0  # every record present
    rows = torch.zeros(2, 2, CHANNEL_WIDTH, dtype=torch.float64)
    rows[..., 0], rows[..., 1:3] = 2.0, torch.tensor([1.0, 2.0], dtype=torch.float64)  # ratio 2 / 1.5
    rows[0, BACKWARD] = 0.0  # no channel row (count 0): unknown
    values, keep = scalar_values(StepValues(records, channels=rows), ["count", "channel_max_ratio"], False)
    assert keep[0].all() and keep[1].tolist() == [[True, False], [True, True]]
    assert values[1, 1, 1] == 2.0 / 1.5
    _, keep = scalar_values(StepValues(records), ["outlier_channels"], False)  # none pooled: none written
    assert not keep.any()


# ---------------------------------------------------------------------------------------
# A real Trainer run, read back from TensorBoard


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]]:
    monitor = ScaleMonitor(every_n_steps=1, statistics=["std", *CHANNELS], figure=False, histograms=False, code=False)
    module, log_dir = fit(tmp_path_factory.mktemp("channels"), monitor)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return module, monitor, {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_logged_channel_statistics_equal_float64_of_the_same_tensors(
    watched: Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]],
) -> None:
    logged = watched[2]
    compared, ratios = set(), []
    for (step, d, label), x in twin_tensors().items():
        if f"channel_max_ratio/{d}/{label}" not in logged:
            continue
        ratio, outliers = reference(x)
        if math.isnan(ratio):  # (every channel maximum 0: not written)
            assert step not in logged[f"channel_max_ratio/{d}/{label}"]
            continue
        assert logged[f"channel_max_ratio/{d}/{label}"][step] == pytest.approx(ratio, rel=1.2e-7), (step, d, label)
        assert logged[f"outlier_channels/{d}/{label}"][step] == pytest.approx(outliers, abs=1e-7), (step, d, label)
        compared.add(label)
        ratios.append(ratio)
    twin = tiny_gpt()
    layers = {f"model.{n}" for n, m in twin.model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm))}
    every_param = {n for n, _ in twin.named_parameters()}
    assert layers | every_param <= compared, sorted((layers | every_param) - compared)
    assert min(ratios) == 1.0 and max(ratios) > 3  # (LayerNorm's initial gains: all channels alike)


def test_training_with_the_channels_group_is_bit_identical(
    tmp_path: Path, watched: Tuple[GPTModule, ScaleMonitor, Any]
) -> None:
    plain, _ = fit(tmp_path, None)
    module, monitor, logged = watched
    assert "channels" in monitor.groups
    assert logged["channel_max_ratio/bwd/model.head.weight"].keys() == set(range(STEPS))
    for (name, a), (_, b) in zip(plain.state_dict().items(), module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
