"""The ``channels`` group as graph ops (record/stats/traceable_channels.py, the compiled route's
channel rows): bit for bit the host path's row (``channel_row``: the native kernel or torch
code) and a float64 numpy reference, on spiky, folded (> 4,096 channels), NaN/Inf-bearing,
strided and 0/1-dim tensors, eager and compiled by Inductor; the row a compiled graph
packs (record sums, other fields, then channel row) and its layout's split; whole rows merged
with the host path's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor

from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, observe, recording
from lightning_scale.record.stats.channels import CHANNEL_CAP, CHANNEL_WIDTH, channel_row, channel_statistics
from lightning_scale.record.stats.traceable import PackedLayout, packed_record, packed_size, traceable_record
from lightning_scale.record.stats.traceable_channels import traceable_channel_row


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_row(x: Tensor) -> np.ndarray:
    """The channel row in float64 numpy: count, then each channel's max |x| of the finite
    elements, channel j folded into slot j mod CAP, zeros in unused slots."""
    a = np.abs(x.double().numpy())
    a = np.where(np.isfinite(a), a, 0.0)
    m = a.reshape(-1, a.shape[-1] if a.ndim else 1).max(0)
    slots = np.zeros(CHANNEL_CAP)
    for k in range(min(m.size, CHANNEL_CAP)):
        slots[k] = m[k::CHANNEL_CAP].max()
    return np.concatenate([[float(m.size)], slots])


def spiky(shape: tuple, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Gaussian values with outlier channels and NaN/Inf in some channels."""
    x = torch.randn(shape, generator=_gen(seed))
    if x.dim():
        flat = x.view(-1, x.shape[-1])
        flat[:, 5 % x.shape[-1]] *= 40
        flat[-1, 2 % x.shape[-1]] = math.nan
        flat[0, -1] = -math.inf
        flat[-1, 0] = math.inf
    return x.to(dtype)


SHAPES = [(64, 100), (2, 16, 33), (7,), (), (1, 4096), (3, 5000), (2, 3, 8200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_equals_the_host_path_and_a_float64_reference(shape: tuple, dtype: torch.dtype) -> None:
    x = spiky(shape, seed=len(shape) + sum(shape), dtype=dtype)
    got = traceable_channel_row(x)
    assert got.dtype == torch.float64 and got.shape == (CHANNEL_WIDTH,)
    assert torch.equal(got, channel_row(x)), (shape, dtype)  # the host path: the native kernel or torch code
    np.testing.assert_array_equal(got.numpy(), reference_row(x))


def test_strided_views_and_every_value_non_finite() -> None:
    x = spiky((40, 6000), seed=3).t()  # (channels along the rows of memory: 40 of them)
    assert torch.equal(traceable_channel_row(x), channel_row(x))
    np.testing.assert_array_equal(traceable_channel_row(x).numpy(), reference_row(x))
    bad = torch.full((4, 9), math.nan)
    bad[1] = math.inf
    row = traceable_channel_row(bad)
    assert row[0] == 9 and not row[1:].any() and torch.equal(row, channel_row(bad))
    assert math.isnan(float(channel_statistics(row)["channel_max_ratio"]))  # every maximum 0


def test_folded_statistics_equal_the_host_paths() -> None:
    """Above the cap both paths fold the same way: channel 4,096 + k into slot k."""
    x = torch.randn(8, CHANNEL_CAP + 10, generator=_gen(7))
    x[3, CHANNEL_CAP + 2] = 50.0  # folds into slot 2
    x[:, 2] = 0.0
    row = traceable_channel_row(x)
    assert float(row[1 + 2]) == 50.0
    got, want = channel_statistics(row), channel_statistics(channel_row(x))
    for name in got:
        assert torch.equal(got[name], want[name]), name


def test_compiled_row_equals_the_eager_row() -> None:
    """Inductor fuses |x|, the NaN/Inf mask and the max over the leading dims: the same bits
    (a max is exact in any order)."""
    torch._dynamo.reset()
    compiled = torch.compile(traceable_channel_row, fullgraph=True, dynamic=False)
    x = spiky((3, 5000), seed=11)
    assert torch.equal(compiled(x), channel_row(x))
    torch._dynamo.reset()


def test_packed_vectors_carry_each_tensors_channel_row_after_its_other_statistics() -> None:
    """Tensors of different sizes (one row, divisible, with a tail row) and the optional
    groups' fields between: the layout takes out each one's record and channel row exactly."""
    xs = [spiky((5, 12), seed=2), spiky((7, 300), seed=3), spiky((4, 4097), seed=4)]
    groups = ("moments", "range", "kurtosis", "channels")
    packed = [packed_record(x, groups) for x in xs]
    assert [p.numel() for p in packed] == [packed_size(x.numel(), groups) for x in xs]
    assert packed_size(60, groups) - packed_size(60, ("moments", "range", "kurtosis")) == CHANNEL_WIDTH
    layout = PackedLayout([x.numel() for x in xs], groups, torch.device("cpu"))
    joined = torch.cat(packed)
    records, channels = layout.records(joined), layout.channel_rows(joined)
    assert channels is not None and channels.shape == (3, CHANNEL_WIDTH)
    for i, x in enumerate(xs):
        torch.testing.assert_close(records[i], traceable_record(x, groups), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(channels[i], channel_row(x))
    without = PackedLayout([x.numel() for x in xs], ("moments", "range"), torch.device("cpu"))
    assert without.channel_rows(torch.cat([packed_record(x) for x in xs])) is None


def test_whole_rows_merge_with_host_rows_as_the_concatenation() -> None:
    """``ChannelRows.add_rows`` (a compiled graph's rows) and ``add`` (the host path's) merge
    by a max into the row of the tensors concatenated; later rows are taken when read."""
    x1, x2, x3 = spiky((6, 5000), seed=4), spiky((3, 5000), seed=5) * 9, spiky((2, 5000), seed=6)
    rec = Recorder(groups=("moments", "channels"))
    with recording(rec):
        observe(x1, "a")
    assert rec.channels is not None
    rec.channels.add_rows([rec.slot("a")], FORWARD, traceable_channel_row(x2)[None])
    rec.channels.add_rows_later([rec.slot("a")], FORWARD, lambda: traceable_channel_row(x3)[None])
    rec.channels.add_rows_later([rec.slot("a")], BACKWARD, lambda: None)  # (no backward: nothing)
    got = rec.channel_tensor(["b", "a"], {"b": "a"})  # an alias gets its source's row
    want = channel_row(torch.cat([x1, x2, x3]))
    assert torch.equal(got[1, FORWARD], want) and torch.equal(got[0, FORWARD], want)
    assert not got[:, BACKWARD].any()
    with pytest.raises(ValueError, match=r"`rows` must be \[1, 4097\], got \[2, 4097\]"):
        rec.channels.add_rows([0], FORWARD, torch.zeros(2, CHANNEL_WIDTH, dtype=torch.float64))
