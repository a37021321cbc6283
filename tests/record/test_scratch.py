"""Temporaries while one tensor is recorded stay within ``layout.scratch_bytes``: a quarter
of the tensor's bytes (at most 64 MiB) plus a fixed floor (4 MiB on the host path, 64 MiB
on the device path's torch kernels), on every path, dtype and layout.

Measured at dispatch level (``OpCounter.largest``: the largest tensor any aten op
allocated while recording), on tensors whose mean is far above their spread (the case
that used to take a float32 copy and then ``y - c``: 4x a bfloat16 tensor), with the
results checked against float64.
"""

from __future__ import annotations

import math
from typing import Callable, Collection, Dict

import pytest
import torch
from torch import Tensor

from lightning_scale.record import native, stats
from lightning_scale.record.stats import fp8, layout
from lightning_scale.tools.op_count import OpCounter

ALL = ("moments", "range", "formats", "fp8")


def mean_dominated(n: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g).mul_(0.1).add_(3.0)).to(dtype)  # |mean| = 30 std


def recorded(x: Tensor, groups: Collection[str], host_reads: bool) -> tuple[Dict[str, float], int]:
    """The record of ``x`` and the bytes of the largest temporary taken to compute it."""
    counter = OpCounter(1 << 62)
    with counter:
        entries = stats.record_of(x, groups, host_reads=host_reads, kernel="torch")
    row = stats.assemble([entries])[0]
    return dict(zip(stats.FIELDS, row.tolist())), counter.largest


def float64_moments(x: Tensor) -> tuple[float, float, float]:
    """(mean, std, absmax) of ``x`` in float64, a piece at a time (the reference's own
    copies are not measured)."""
    total, count, top = 0.0, 0, 0.0
    flat = x.reshape(-1)
    for part in flat.split(1 << 22):
        total += float(part.double().sum())
        count += part.numel()
        top = max(top, float(part.double().abs().max()))
    mean = total / count
    m2 = sum(float((part.double() - mean).square().sum()) for part in flat.split(1 << 22))
    return mean, math.sqrt(m2 / (count - 1)), top


def check(got: Dict[str, float], x: Tensor) -> None:
    mean, std, top = float64_moments(x)
    assert abs(got["mean"] - mean) <= 1e-6 * (abs(mean) + std)
    got_std = math.sqrt(got["m2"] / (got["count"] - 1))
    assert abs(got_std - std) <= 1e-6 * std, (got_std, std)
    assert got["count"] == x.numel() and got["nan"] == 0 and got["inf"] == 0
    if not math.isnan(got["absmax"]):
        assert got["absmax"] == top


def bound(x: Tensor, host_reads: bool) -> int:
    return layout.scratch_bytes(x, layout.SCRATCH_FLOOR if host_reads else layout.DEVICE_SCRATCH_FLOOR)


@pytest.mark.parametrize("path", ["native", "torch", "device"])
def test_recording_a_64m_element_bfloat16_tensor_takes_a_bounded_temporary(path: str) -> None:
    """128 MiB of bfloat16: at most 32 MiB of temporaries plus the path's floor (the
    float32 copy alone would take 256 MiB), on the host path with or without the native
    kernel and on the device path's torch kernels, and the moments of float64."""
    x = mean_dominated(64 << 20, torch.bfloat16)
    host_reads = path != "device"
    assert bound(x, host_reads) == (32 << 20) + (layout.SCRATCH_FLOOR if host_reads else layout.DEVICE_SCRATCH_FLOOR)
    if path == "native" and native.load() is None:
        pytest.skip(native.status())
    groups = ("moments", "range", "formats")
    if path == "torch":
        with native.switched_off():
            got, largest = recorded(x, groups, host_reads)
    else:
        got, largest = recorded(x, groups, host_reads)
    assert largest <= bound(x, host_reads), (largest, bound(x, host_reads))
    check(got, x)
    assert got["zeros"] == 0 and got["overflow_e4m3"] == 0 and got["min_nonzero"] > 0


@pytest.mark.parametrize("host_reads", [True, False], ids=["host_reads", "device_only"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: mean_dominated(4 << 20, torch.float32, 1),
        lambda: mean_dominated(3 << 20, torch.float16, 2).view(1024, 3072).t(),  # transposed
        lambda: mean_dominated(3 << 19, torch.float64, 3).view(512, 3072)[:, 1000:],  # a slice: not dense
        lambda: mean_dominated(6 << 20, torch.bfloat16, 4).view(3, 2048, 1024)[:, ::2],  # strided, 3-D
    ],
    ids=["float32", "float16-transposed", "float64-slice", "bfloat16-strided"],
)
def test_every_dtype_layout_and_group_stays_within_the_bound(make: Callable[[], Tensor], host_reads: bool) -> None:
    x = make()
    got, largest = recorded(x, ALL, host_reads)
    assert largest <= bound(x, host_reads), (largest, bound(x, host_reads))
    check(got, x)
    whole = fp8.fp8_fields_in_pieces(x, stats.sum64, x.numel())  # (unbounded, as it was: the reference)
    for name, value in zip(stats.FP8_FIELDS, whole):
        assert got[name] == pytest.approx(float(value), rel=1e-12, abs=0), name


def test_pieces_cover_every_element_once_at_any_layout() -> None:
    x = torch.arange(4 * 5 * 7, dtype=torch.float32).view(4, 5, 7)
    for view in (x, x.transpose(0, 2), x[:, 1:, ::2], x[1:2], x.expand(2, 4, 5, 7)[1]):
        for size in (1, 3, 7, 8, 35, 1000):
            parts = list(layout.pieces(view, size))
            assert all(0 < p.numel() <= size for p in parts)
            assert all(p.data_ptr() >= x.data_ptr() and p.untyped_storage().data_ptr() == x.data_ptr() for p in parts)
            got = torch.cat([p.reshape(-1) for p in parts]).sort().values
            assert torch.equal(got, view.reshape(-1).sort().values)
