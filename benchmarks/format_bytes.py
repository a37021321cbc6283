"""Peak bytes per element of temporaries the reference's ``formats`` group holds (target <= 20).

The same measurement as ``tests/record/test_stats_property.py``'s
``test_format_counts_need_at_most_20_bytes_per_element``: ``torch.profiler`` with
``profile_memory`` around ``reference.formats`` on a float32 tensor of 2**20 standard-normal
elements, on CPU (the device path runs the same ops); allocations and frees in the order they
happen, the largest total held.

Usage: ``python benchmarks/format_bytes.py``.
"""

from __future__ import annotations

import torch

import workload  # noqa: F401 - puts the checkout's package on sys.path

from lightning_scale.record.stats import reference


def measure(numel: int = 1 << 20) -> float:
    """Peak bytes held per element by one call of the reference format counts."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        reference.formats(x)
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    held = peak = 0
    for e in events:
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak / numel


if __name__ == "__main__":
    print(f"formats group, reference (device path): {measure():.1f} bytes/element at the peak")
