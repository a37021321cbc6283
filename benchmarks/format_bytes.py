"""Bytes per element the device path allocates for the ``formats`` group (issue 10: <= 20).

The same measurement as ``tests/record/test_stats_property.py``'s
``test_format_counts_need_at_most_20_bytes_per_element``: ``torch.profiler`` with
``profile_memory`` around ``stats.format_counts_device`` on a float32 tensor of 2**20
standard-normal elements, on CPU (the device path runs there with the same ops); every
allocation counted once and frees ignored, so the figure is an upper bound of the peak.

Usage: ``python benchmarks/format_bytes.py``.
"""

from __future__ import annotations

import torch

import workload  # noqa: F401 - puts the checkout's package on sys.path

from lightning_scale.record.stats import formats


def measure(numel: int = 1 << 20) -> float:
    """Bytes allocated per element by one call of the device-path format counts."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    nan = torch.isnan(x).sum()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        formats.format_counts_device(x, nan)  # noqa: SLF001 - the path measured
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    return allocated / numel


if __name__ == "__main__":
    print(f"formats group, device path: {measure():.1f} bytes/element allocated")
