"""The matplotlib figure of every node's scale at one step (optional; the dashboard replaces it)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.report.values import StepValues

__all__ = ["scale_figure"]

# FP16 and E5M2 share their smallest normal (2^-14) and nearly their max: different line
# styles keep both visible.
_FORMAT_STYLE = {
    "fp16": ("tab:green", "--"),
    "bf16": ("tab:gray", "-"),
    "e4m3": ("tab:red", "-."),
    "e5m2": ("tab:purple", ":"),
}


def scale_figure(labels: Sequence[str], values: StepValues, title: str = "") -> Any:
    """A matplotlib figure: every node top to bottom, log2 of its forward and backward std,
    with the edges of the FP16, FP8 E4M3 and E5M2 normal ranges marked (in the legend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    std = values("std")
    present = values.present
    n = len(labels)
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.2 * n + 1.5)))
    ys = list(range(n))
    for d, colour, name in ((FORWARD, "tab:blue", "forward"), (BACKWARD, "tab:orange", "backward")):
        xs = [
            math.log2(v) if p and v > 0 and math.isfinite(v) else math.nan
            for v, p in zip(std[:, d].tolist(), present[:, d].tolist())
        ]
        ax.scatter(xs, ys, s=18, color=colour, label=name, zorder=3)
    for fmt, (colour, style) in _FORMAT_STYLE.items():
        f = stats.FORMATS[fmt]
        lo, hi = math.log2(f.min_normal), math.log2(f.max)
        label = f"{fmt} normal range 2^{lo:.0f}..2^{hi:.1f}"
        for edge in (lo, hi):
            if -40 < edge < 40:  # bf16's edges (2^-126, 2^128) would squash everything else
                ax.axvline(edge, color=colour, lw=1.2, ls=style, zorder=2, label=label)
                label = None
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("log2(std)")
    ax.xaxis.set_tick_params(labeltop=True)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower left", framealpha=0.9)
    ax.set_title(title or "Scale of every node (forward, backward)", fontsize=10)
    # Fixed margins (tight_layout measures every label: slow for hundreds of nodes).
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.32, right=0.98, top=1 - 0.8 / height, bottom=0.6 / height)
    return fig
