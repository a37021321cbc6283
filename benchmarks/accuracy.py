"""Worst relative error of the mean and std against float64, by dtype and path.

``python benchmarks/accuracy.py``: the sweep of docs/statistics.md (sizes 1e3, 1e5, 1.6e7;
|mean|/std 0, 3, 9.5, 100, 1e4; ``x = (randn(n) + offset).to(dtype)`` against
``x.double()``, one thread). The host path is measured with the native one-read kernel
(``lightning_scale.record.native``, float32 and bfloat16; the reference takes what it leaves)
and without it (the reference alone, as on a machine without a C compiler); the device path is
the reference (torch's kernels, no host read); the mean's error is relative to |mean| + std
(as tests/record/test_stats_property.py judges it).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import workload  # noqa: F401 - puts the checkout's package on sys.path
import torch

from lightning_scale.record import native
from lightning_scale.record import stats

SIZES = (1_000, 100_000, 16_000_000)
OFFSETS = (0.0, 3.0, 9.5, 100.0, 1e4)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def worst(dtype: torch.dtype, host_reads: bool) -> Tuple[float, float]:
    mean_err = std_err = 0.0
    for n in SIZES:
        g = torch.Generator().manual_seed(n)
        base = torch.randn(n, generator=g, dtype=torch.float64)
        for offset in OFFSETS:
            x = (base + offset).to(dtype)
            v = x.double()
            mean = float(v.mean())
            std = math.sqrt(float((v - mean).square().sum()) / (n - 1))
            rec = stats.assemble([stats.record_of(x, ("moments",), host_reads)])
            got_mean, got_std = float(stats.statistic(rec, "mean")[0]), float(stats.statistic(rec, "std")[0])
            if std == 0:  # (bf16 or fp16 near 1e4: all 1,000 values may round alike)
                std_err = max(std_err, 0.0 if got_std == 0 else math.inf)
                mean_err = max(mean_err, abs(got_mean - mean) / abs(mean))
                continue
            mean_err = max(mean_err, abs(got_mean - mean) / (abs(mean) + std))
            std_err = max(std_err, abs(got_std - std) / std)
    return mean_err, std_err


def main() -> None:
    torch.set_num_threads(1)
    loaded = native.load()
    rows: Dict[str, Tuple[float, float]] = {}
    for dtype in DTYPES:
        name = str(dtype).replace("torch.", "")
        if loaded is not None and dtype in (torch.float32, torch.bfloat16):
            rows[f"{name} | host, native kernel"] = worst(dtype, True)
        with native.switched_off():
            rows[f"{name} | host, reference alone"] = worst(dtype, True)
        rows[f"{name} | device, reference"] = worst(dtype, False)
    print(f"({native.status()})\n")
    print("| dtype | path | mean | std |\n|---|---|---|---|")
    for key, (m, s) in rows.items():
        print(f"| {key} | {m:.1e} | {s:.1e} |")


if __name__ == "__main__":
    main()
