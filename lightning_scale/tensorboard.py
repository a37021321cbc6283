"""Writing pooled statistics: TensorBoard scalars, histograms, figure, text; other loggers.

Tags: ``scale/fwd/<label>`` and ``scale/bwd/<label>`` hold the std; any other statistic
``<name>/fwd/<label>``. ``scale_hist/fwd`` and ``scale_hist/bwd`` hold log2 of the std of
every node at a step; ``values_log2/<dir>/<label>`` the histogram of log2|x| of chosen
nodes' values.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import Tensor

from lightning_scale import stats
from lightning_scale.recorder import BACKWARD, FORWARD

__all__ = ["DIRECTIONS", "ScaleWriter", "scale_figure", "scalar_metrics"]

DIRECTIONS = (("fwd", FORWARD), ("bwd", BACKWARD))

# TensorBoard shows the last custom-scalars layout of a run, so each SummaryWriter gets
# every prefix's charts at once: its categories so far, by title.
_LAYOUTS: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def _tag_stat(name: str) -> str:
    return "scale" if name == "std" else name


def scalar_metrics(labels: Sequence[str], records: Tensor, names: Sequence[str]) -> Dict[str, float]:
    """``{"scale/fwd/<label>": std, "<stat>/bwd/<label>": ...}`` for present records."""
    out: Dict[str, float] = {}
    present = (records[..., 0] > 0).tolist()
    for name in names:
        values = stats.statistic(records, name).tolist()
        for i, label in enumerate(labels):
            for tag, d in DIRECTIONS:
                if present[i][d]:
                    out[f"{_tag_stat(name)}/{tag}/{label}"] = values[i][d]
    return out


def _add_scalars(writer: Any, metrics: Dict[str, float], step: int) -> None:
    """All scalars of a step as one event (one ``Summary`` of many values).

    ``add_scalar`` writes one event per tag through a queue of 10 that blocks on the
    writer thread: ~50 us a tag, 15 ms a step for a few hundred nodes.
    """
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:  # another SummaryWriter implementation: the public way
        for tag, value in metrics.items():
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=tag, simple_value=value) for tag, value in metrics.items()]
    file_writer().add_summary(Summary(value=values), step)


def scale_figure(labels: Sequence[str], records: Tensor, title: str = "") -> Any:
    """A matplotlib figure: every node top to bottom, log2 of its forward and backward std,
    with the FP16, FP8 E4M3 and E5M2 normal ranges marked."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    std = stats.statistic(records, "std")
    present = records[..., 0] > 0
    n = len(labels)
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.16 * n + 1.2)))
    ys = list(range(n))
    for (tag, d), colour in zip(DIRECTIONS, ("tab:blue", "tab:orange")):
        xs = [math.log2(v) if p and v > 0 and math.isfinite(v) else math.nan for v, p in zip(std[:, d].tolist(), present[:, d].tolist())]
        ax.scatter(xs, ys, s=12, color=colour, label="forward" if tag == "fwd" else "backward", zorder=3)
    for fmt, colour in (("fp16", "tab:green"), ("e4m3", "tab:red"), ("e5m2", "tab:purple")):
        f = stats.FORMATS[fmt]
        ax.axvspan(math.log2(f.min_normal), math.log2(f.max), color=colour, alpha=0.07, zorder=1)
        ax.axvline(math.log2(f.max), color=colour, lw=0.8, ls="--", label=f"{fmt} max / min normal", zorder=2)
        ax.axvline(math.log2(f.min_normal), color=colour, lw=0.8, ls="--", zorder=2)
    ax.set_yticks(ys)
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("log2(std)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or "Scale of every node (forward, backward)")
    # Fixed margins (tight_layout measures every label: slow for hundreds of nodes).
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.3, right=0.98, top=1 - 0.5 / height, bottom=0.6 / height)
    return fig


class ScaleWriter:
    """Writes one tracked step's pooled records to the trainer's loggers.

    Args:
        loggers: the trainer's loggers; TensorBoard ones get everything, others the
            scalars through ``log_metrics``.
        statistics: statistic names to write as scalars (``std`` as ``scale/``).
        histograms: write ``scale_hist/{fwd,bwd}``.
        figure: write the per-node scale figure (needs matplotlib).
        prefix: prepended to every tag (e.g. ``"val_"`` for validation tracking).
        figure_every: draw the figure on the first write and every n-th after it
            (drawing a few hundred nodes takes matplotlib about a second).
    """

    def __init__(self, loggers: Sequence[Any], statistics: Sequence[str], histograms: bool = True, figure: bool = True, prefix: str = "", figure_every: int = 1) -> None:
        self.loggers = list(loggers)
        self.statistics = list(statistics)
        self.histograms = histograms
        self.figure = figure
        self.prefix = prefix
        self.figure_every = figure_every
        self._writes = 0

    def _tensorboards(self) -> List[Any]:
        out = []
        for logger in self.loggers:
            exp = getattr(logger, "experiment", None)
            if exp is not None and hasattr(exp, "add_histogram_raw"):
                out.append(exp)
        return out

    def write(self, step: int, labels: Sequence[str], records: Tensor, code: Optional[str] = None, spread: Optional[Tensor] = None) -> None:
        """Write scalars, histograms, figure and annotated code for ``step``."""
        metrics = scalar_metrics(labels, records, self.statistics)
        if spread is not None:
            metrics.update(self._spread(labels, spread))
        metrics = {self.prefix + k: v for k, v in metrics.items()}
        for logger in self.loggers:
            if self._tensorboards_of(logger):
                _add_scalars(logger.experiment, metrics, step)
            else:
                logger.log_metrics(metrics, step=step)
        draw = self._writes % self.figure_every == 0
        self._writes += 1
        for writer in self._tensorboards():
            self._write_extras(writer, step, labels, records, code, draw)

    def _tensorboards_of(self, logger: Any) -> bool:
        exp = getattr(logger, "experiment", None)
        return exp is not None and hasattr(exp, "add_histogram_raw")

    def _spread(self, labels: Sequence[str], per_rank: Tensor) -> Dict[str, float]:
        std = stats.statistic(per_rank, "std")  # (world, n, 2)
        present = (per_rank[..., 0] > 0).all(0)
        lo, hi = std.min(0).values.tolist(), std.max(0).values.tolist()
        out: Dict[str, float] = {}
        for i, label in enumerate(labels):
            for tag, d in DIRECTIONS:
                if present[i, d]:
                    out[f"scale_rank_min/{tag}/{label}"] = lo[i][d]
                    out[f"scale_rank_max/{tag}/{label}"] = hi[i][d]
        return out

    def _write_extras(self, writer: Any, step: int, labels: Sequence[str], records: Tensor, code: Optional[str], draw: bool) -> None:
        self._write_layout(writer, labels)
        if self.histograms:
            std = stats.statistic(records, "std")
            for tag, d in DIRECTIONS:
                ok = (records[:, d, 0] > 0) & (std[:, d] > 0) & torch.isfinite(std[:, d])
                if bool(ok.any()):
                    writer.add_histogram(f"{self.prefix}scale_hist/{tag}", std[ok, d].log2(), step)
        if self.figure and draw:
            try:
                fig = scale_figure(labels, records, f"step {step}")
            except ImportError:
                self.figure = False
            else:
                writer.add_figure(f"{self.prefix}scale_plot", fig, step, close=True)
        if code:
            writer.add_text(f"{self.prefix}scale_code", "    " + code.replace("\n", "\n    "), step)

    def _write_layout(self, writer: Any, labels: Sequence[str]) -> None:
        from tensorboard.plugins.custom_scalar import layout_pb2  # noqa: F401 - presence check

        title = f"{self.prefix}scale (fwd and bwd per node)"
        layout = _LAYOUTS.setdefault(writer, {})
        if title in layout:
            return
        layout[title] = {label: ["Multiline", [f"{self.prefix}scale/fwd/{label}", f"{self.prefix}scale/bwd/{label}"]] for label in labels}
        writer.add_custom_scalars(dict(layout))

    def write_value_histograms(self, step: int, histograms: Dict[str, Tensor]) -> None:
        """Histograms of log2|x| (``{"fwd/<label>": counts over exponent bins}``)."""
        for writer in self._tensorboards():
            for key, counts in histograms.items():
                _add_log2_histogram(writer, f"{self.prefix}values_log2/{key}", counts, step)


def _add_log2_histogram(writer: Any, tag: str, counts: Tensor, step: int) -> None:
    counts = counts.double()
    nz = torch.nonzero(counts).flatten()
    if nz.numel() == 0:
        return
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    c = counts[lo:hi]
    edges = torch.arange(lo, hi + 1, dtype=torch.float64) + stats.LOG2_LO  # bin i covers [e, e+1)
    mids = edges[:-1] + 0.5
    total = float(c.sum())
    writer.add_histogram_raw(
        tag,
        min=float(edges[0]),
        max=float(edges[-1]),
        num=total,
        sum=float((c * mids).sum()),
        sum_squares=float((c * mids * mids).sum()),
        bucket_limits=edges[1:].tolist(),
        bucket_counts=c.tolist(),
        global_step=step,
    )


