"""ScaleWriter: writes one tracked step's pooled records to the callback's outputs.

The writer is split as TensorBoard's ``plugins/scalar/`` is: this orchestrator decides
what goes where; ``report.scalars`` builds the scalar tags and their encoding,
``report.tables`` the ``scale_worst`` text, ``dashboard.summaries`` the dashboard's node
list and records and the Custom Scalars layout (format in ``dashboard.metadata``, read
by ``dashboard.plugin``), ``report.figure`` the figure, ``report.event_file`` the bytes.

Outputs: ``EventFile`` (a TensorBoard run directory: scalars, histograms
``scale_hist/<dir>`` and ``values_log2/<dir>/<label>``, figure ``scale_plot``, text
``scale_worst`` and ``scale_code``, the dashboard's ``scale_nodes`` and
``scale_records/<first step>``, the layout) and ``LoggerOutput`` (other loggers: the
scalars). ``max_tags`` caps the per-node scalars (and the Custom Scalars charts and the
figure); the dashboard's records, the summary counts, the histograms and the
``scale_worst`` table cover every node.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.dashboard import layout, metadata, summaries
from lightning_scale.record import stats
from lightning_scale.report.event_file import EventFile
from lightning_scale.report.figure import scale_figure
from lightning_scale.report.loggers import LoggerOutput, is_tensorboard
from lightning_scale.report.scalars import DIRECTIONS, mask_key, scalar_tags, scalar_values, summary_bytes
from lightning_scale.report.scalars import summary_metrics
from lightning_scale.report.tables import worst_table
from lightning_scale.report.values import StepValues

__all__ = ["ScaleWriter", "is_tensorboard"]

# TensorBoard shows the last custom-scalars layout of a run, so each event file gets every
# prefix's charts at once: its categories so far, by prefix.
_LAYOUTS: "weakref.WeakKeyDictionary[EventFile, Dict[str, layout.Layout]]" = weakref.WeakKeyDictionary()
_LAYOUT_LOCK = threading.Lock()


class ScaleWriter:
    """Writes one tracked step's pooled records to event files and other loggers.

    Args:
        outputs: ``EventFile`` s (get everything) and ``LoggerOutput`` s (get the scalars).
        statistics: statistic names to write as scalars (``std`` as ``scale/``).
        histograms: write ``scale_hist/{fwd,bwd}``.
        figure: write the per-node scale figure (needs matplotlib).
        prefix: prepended to every tag (e.g. ``"val_"`` for validation tracking).
        figure_every: draw the figure on the first write and every n-th after it
            (drawing a few hundred nodes takes matplotlib about a second).
        parameters: labels of nodes that are parameters or buffers (the dashboard marks them).
        log2: also write ``scale_log2/`` (log2 std) and chart it in Custom Scalars.
        summary: write the ``scale_summary/`` counts and the ``scale_worst`` table.
        top_k: rows of the ``scale_worst`` table.
        max_tags: the most nodes (the first, in execution order) whose scalars are written;
            ``None``: all. The dashboard's records always hold every node.

    Raises:
        ValueError: ``top_k`` is not a positive integer.
    """

    def __init__(
        self,
        outputs: Sequence[Any],
        *,
        statistics: Sequence[str],
        histograms: bool = True,
        figure: bool = True,
        prefix: str = "",
        figure_every: int = 1,
        parameters: Collection[str] = (),
        log2: bool = True,
        summary: bool = True,
        top_k: int = 10,
        max_tags: Optional[int] = None,
    ) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0:
            raise ValueError(f"`top_k` must be a positive integer, got {top_k!r}")
        self.files = [o for o in outputs if isinstance(o, EventFile)]
        self.loggers: List[LoggerOutput] = [o for o in outputs if isinstance(o, LoggerOutput)]
        self.statistics = list(statistics)
        self.histograms, self.figure, self.prefix, self.figure_every = histograms, figure, prefix, figure_every
        self.parameters = frozenset(parameters)
        self.log2, self.summary, self.top_k, self.max_tags = log2, summary, top_k, max_tags
        self._writes = 0
        self._nodes: Dict[EventFile, Tuple[Any, ...]] = {}  # the node list last written to each file
        self._chunk: Tuple[int, int] = (0, metadata.CHUNK)  # (first step, steps in it) of the records tag
        self._layout_key: Optional[Tuple[Any, ...]] = None
        self._tag_key: Optional[Tuple[Any, ...]] = None
        self._tag_list: Tuple[str, ...] = ()

    def _live(self) -> List[EventFile]:
        return [f for f in self.files if not f.stopped]

    def write(
        self,
        step: int,
        labels: Sequence[str],
        step_values: StepValues,
        code: Optional[str] = None,
        spread: Any = None,
        aliases: Optional[Dict[str, str]] = None,
    ) -> None:
        """Write scalars, histograms, figure, text and the dashboard's records for ``step``
        (``labels`` in execution order; ``step_values``: their statistics, ``StepValues``;
        ``spread``: a ``pool.RankSpread`` or None; ``aliases``: ``{label: label of the same
        tensor}``)."""
        files = self._live()
        if not files and all(o.stopped for o in self.loggers):
            return  # every output has stopped: nothing to compute
        values, keep = scalar_values(step_values, self.statistics, self.log2)
        n = len(labels) if self.max_tags is None else min(len(labels), self.max_tags)
        tags = list(self._tags(labels[:n], keep[:, :n]))
        numbers = values[:, :n][keep[:, :n]].tolist()
        extra = self._spread(labels[:n], spread) if spread is not None else {}
        if self.summary:
            extra.update(summary_metrics(step_values))
        tags += [self.prefix + k for k in extra]
        numbers += list(extra.values())
        self._scalars(files, tags, numbers, step)
        draw = self._writes % self.figure_every == 0
        self._writes += 1
        if not files:
            return
        rows = self._rows(values, keep, spread)
        written = set(labels)
        same = {a: s for a, s in (aliases or {}).items() if a in written and s in written}
        advance = self._advance_chunk(step)
        for file in files:
            self._write_records(file, step, labels, rows, same, advance, step_values)
            self._write_extras(file, step, labels, step_values, n, code, draw, same)

    def write_metrics(self, metrics: Dict[str, float], step: int) -> None:
        """Scalars under their own tags (loss scale, update ratios, anomalies), to every output."""
        self._scalars(self._live(), list(metrics), list(metrics.values()), step)

    def write_text(self, tag: str, text: str, step: int) -> None:
        """A text summary in every event file."""
        from torch.utils.tensorboard.summary import text as text_summary

        for file in self._live():
            file.add_summary(text_summary(tag, text), step)

    def write_value_histograms(self, step: int, histograms: Dict[str, Tensor]) -> None:
        """Histograms of log2|x| (``{"fwd/<label>": counts over exponent bins}``)."""
        for file in self._live():
            for key, counts in histograms.items():
                summary = _log2_histogram(f"{self.prefix}values_log2/{key}", counts)
                if summary is not None:
                    file.add_summary(summary, step)

    def flush(self) -> None:
        """Append what was queued to the event files (one write per file and step)."""
        for file in self.files:
            file.flush()

    def _scalars(self, files: Sequence[EventFile], tags: List[str], numbers: List[float], step: int) -> None:
        if not tags:
            return
        data = summary_bytes(tags, numbers) if files else b""
        for file in files:
            file.add_summary(data, step)
        for logger in self.loggers:
            logger.log_metrics(dict(zip(tags, numbers)), step)

    def _rows(self, values: Tensor, keep: Tensor, spread: Any) -> Tensor:
        """The dashboard's ``[nodes, 2, statistics]`` array: NaN where nothing was recorded;
        with a ``pool.RankSpread``, the least and largest std over ranks as two more."""
        k = len(self.statistics)
        rows = torch.where(keep[:k], values[:k], torch.full_like(values[:k], math.nan))
        if spread is not None:
            present = spread.present.bool()
            low = torch.where(present, spread.low.to(rows.dtype), math.nan)
            high = torch.where(present, spread.high.to(rows.dtype), math.nan)
            rows = torch.cat([rows, low[None], high[None]])
        return rows.permute(1, 2, 0)

    def _statistics(self, rows: Tensor) -> List[str]:
        return self.statistics + (["scale_rank_min", "scale_rank_max"] if rows.shape[-1] > len(self.statistics) else [])

    def _tags(self, labels: Sequence[str], keep: Tensor) -> Tuple[str, ...]:
        """The prefixed tags of the kept scalars (kept from the last step when unchanged)."""
        key = (tuple(labels), mask_key(keep))
        if self._tag_key != key:
            tags = scalar_tags(key[0], tuple(self.statistics), self.log2, key[1])
            self._tag_key, self._tag_list = key, tuple(self.prefix + t for t in tags)
        return self._tag_list

    def _spread(self, labels: Sequence[str], spread: Any) -> Dict[str, float]:
        """``scale_rank_min/...`` and ``scale_rank_max/...`` from a ``pool.RankSpread``."""
        present, lo, hi = spread.present.tolist(), spread.low.tolist(), spread.high.tolist()
        out: Dict[str, float] = {}
        for i, label in enumerate(labels):
            for tag, d in DIRECTIONS:
                if present[i][d]:
                    out[f"scale_rank_min/{tag}/{label}"] = lo[i][d]
                    out[f"scale_rank_max/{tag}/{label}"] = hi[i][d]
        return out

    def _advance_chunk(self, step: int) -> Tuple[int, int]:
        """The records tag's chunk for ``step``: a new one every ``metadata.CHUNK`` steps."""
        first, count = self._chunk if self._chunk[1] < metadata.CHUNK else (step, 0)
        return first, count + 1

    def _write_records(
        self,
        file: EventFile,
        step: int,
        labels: Sequence[str],
        rows: Tensor,
        aliases: Dict[str, str],
        chunk: Any,
        step_values: StepValues,
    ) -> None:
        """Every node's statistics at ``step``, and the node list before them when it changed;
        a new records tag every ``metadata.CHUNK`` steps and whenever the node list changes."""
        names = self._statistics(rows)
        key = (tuple(labels), tuple(names), tuple(sorted(aliases.items())))
        if key != self._nodes.get(file):
            self._nodes[file], chunk = key, (step, 1)
            tag = self.prefix + metadata.TAG
            meta = {name: step_values.layout.statistic(name).meta() for name in self.statistics}
            file.add_summary(summaries.nodes_summary(tag, labels, self.parameters, names, aliases, meta), step)
        self._chunk = chunk
        file.add_summary(summaries.records_summary(metadata.chunk_tag(self.prefix, chunk[0]), rows.numpy()), step)

    def _write_extras(
        self,
        file: EventFile,
        step: int,
        labels: Sequence[str],
        values: StepValues,
        n: int,
        code: Optional[str],
        draw: bool,
        aliases: Dict[str, str],
    ) -> None:
        from torch.utils.tensorboard.summary import histogram, text

        self._write_layout(file, labels[:n], values.present[:n])
        if self.histograms:
            std = values("std")
            for tag, d in DIRECTIONS:
                ok = values.present[:, d] & (std[:, d] > 0) & torch.isfinite(std[:, d])
                if bool(ok.any()):
                    file.add_summary(histogram(f"{self.prefix}scale_hist/{tag}", std[ok, d].log2(), _bins()), step)
        if self.figure and draw:
            self._write_figure(file, step, labels[:n], values.take(list(range(n))))
        if self.summary and len(labels):
            table = worst_table(labels, values, self.top_k, aliases=aliases)
            file.add_summary(text(f"{self.prefix}scale_worst", table), step)
        if code:
            file.add_summary(text(f"{self.prefix}scale_code", "    " + code.replace("\n", "\n    ")), step)

    def _write_figure(self, file: EventFile, step: int, labels: Sequence[str], values: StepValues) -> None:
        from torch.utils.tensorboard._utils import figure_to_image
        from torch.utils.tensorboard.summary import image

        try:
            fig = scale_figure(labels, values, f"step {step}")
        except ImportError:
            self.figure = False
            return
        file.add_summary(image(f"{self.prefix}scale_plot", figure_to_image(fig, True), dataformats="CHW"), step)

    def _write_layout(self, file: EventFile, labels: Sequence[str], mask: Tensor) -> None:
        """Custom Scalars charts of the tags written (``mask``: the present node directions;
        rewritten only when those change)."""
        key = (tuple(labels), mask_key(mask))
        if key == self._layout_key:  # (the same nodes present as last step: the same charts)
            return
        self._layout_key = key
        present = mask.tolist()
        written = {tag: tuple(l for i, l in enumerate(labels) if present[i][d]) for tag, d in DIRECTIONS}
        name = "scale_log2" if self.log2 else "scale"
        categories = layout.custom_scalar_layout(
            self.prefix, labels, written, stat=name, parameters=self.parameters or None
        )
        with _LAYOUT_LOCK:
            per_prefix = _LAYOUTS.setdefault(file, {})
            before = any(per_prefix.values())
            per_prefix[self.prefix] = categories
            merged = [category for prefix in sorted(per_prefix) for category in per_prefix[prefix]]
        if merged or before:  # (too many charts, and no earlier layout to replace: none)
            file.add_summary(summaries.layout_summary(merged))


@functools.lru_cache(maxsize=1)
def _bins() -> List[float]:
    """``SummaryWriter``'s default histogram bins (``add_histogram(..., bins="tensorflow")``)."""
    v, buckets = 1e-12, []
    while v < 1e20:
        buckets.append(v)
        v *= 1.1
    return [-b for b in reversed(buckets)] + [0] + buckets


def _log2_histogram(tag: str, counts: Tensor) -> Any:
    """A histogram ``Summary`` of counts over log2 bins (bin i covers [e, e+1)); None if empty."""
    from torch.utils.tensorboard.summary import histogram_raw

    counts = counts.double()
    nz = torch.nonzero(counts).flatten()
    if nz.numel() == 0:
        return None
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    c = counts[lo:hi]
    edges = torch.arange(lo, hi + 1, dtype=torch.float64) + stats.LOG2_LO
    mids = edges[:-1] + 0.5
    sums = float((c * mids).sum()), float((c * mids * mids).sum())
    return histogram_raw(tag, float(edges[0]), float(edges[-1]), float(c.sum()), *sums, edges[1:].tolist(), c.tolist())
