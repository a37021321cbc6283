"""Writing pooled statistics: TensorBoard scalars, histograms, text, figure; other loggers.

Tags, for each direction ``<dir>`` (``fwd``, ``bwd``) and node ``<label>``:

- ``scale/<dir>/<label>``: the std; any other statistic ``<name>/<dir>/<label>``;
- ``scale_log2/<dir>/<label>``: log2 of the std (gradients of ~1e-5 read as -17, not 0);
- ``scale_summary/<dir>/below_normal_<fmt>`` and ``above_max_<fmt>``: how many nodes have
  their std below the format's smallest normal, their absmax (or std) above its max;
- ``scale_hist/<dir>``: histogram of log2 std over nodes; ``values_log2/<dir>/<label>``:
  histogram of log2|x| of chosen nodes' values;
- text ``scale_worst`` (the nodes nearest a format edge) and ``scale_code``;
- ``scale_nodes`` and ``scale_records/<first step>``: the node list and every node's
  statistics per step, for the ``scales`` dashboard (``dashboard/metadata.py``).

``max_tags`` caps the per-node scalars (and the Custom Scalars charts and the figure); the
dashboard's records, the summary counts, the histograms and the ``scale_worst`` table
cover every node.

The writer may run off the training thread; it keeps no state shared between writers
except the custom-scalars layout of a ``SummaryWriter``, guarded by a lock.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.dashboard import headroom, layout, metadata
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.report.figure import scale_figure

__all__ = [
    "DIRECTIONS",
    "WORST_COLUMNS",
    "ScaleWriter",
    "fast_record_checksums",
    "is_tensorboard",
    "scale_figure",
    "scalar_metrics",
    "summary_metrics",
    "worst_table",
]

DIRECTIONS = (("fwd", FORWARD), ("bwd", BACKWARD))

# TensorBoard shows the last custom-scalars layout of a run, so each SummaryWriter gets
# every prefix's charts at once: its categories so far, by prefix.
_LAYOUTS: "weakref.WeakKeyDictionary[Any, Dict[str, layout.Layout]]" = weakref.WeakKeyDictionary()
_LAYOUT_LOCK = threading.Lock()


def _tag_stat(name: str) -> str:
    return "scale" if name == "std" else name


def scalar_metrics(
    labels: Sequence[str], records: Tensor, names: Sequence[str], log2: bool = False
) -> Dict[str, float]:
    """``{"scale/fwd/<label>": std, "<stat>/bwd/<label>": ...}`` for present records
    (and ``scale_log2/<dir>/<label>`` for positive finite stds if ``log2``)."""
    values, keep = _scalar_values(records, names, log2)
    return dict(zip(_scalar_tags(tuple(labels), tuple(names), log2, _mask_key(keep)), values[keep].tolist()))


def _scalar_values(records: Tensor, names: Sequence[str], log2: bool) -> Tuple[Tensor, Tensor]:
    """Every scalar at once: values ``[statistics (+ log2), nodes, 2]`` and which to write
    (present records; for log2 also a positive finite std)."""
    rows = [stats.statistic(records, name) for name in names]
    keep = (records[..., 0] > 0).expand(len(rows) + log2, -1, -1).clone()
    if log2:
        std = rows[names.index("std")] if "std" in names else stats.statistic(records, "std")
        ok = (std > 0) & torch.isfinite(std)
        rows.append(torch.where(ok, std, torch.ones_like(std)).log2())
        keep[-1] &= ok
    return torch.stack(rows), keep


def _mask_key(keep: Tensor) -> Tuple[Tuple[int, ...], bytes]:
    return tuple(keep.shape), keep.numpy().tobytes()


@functools.lru_cache(maxsize=8)
def _scalar_tags(
    labels: Tuple[str, ...], names: Tuple[str, ...], log2: bool, mask: Tuple[Tuple[int, ...], bytes]
) -> Tuple[str, ...]:
    """The tags of ``_scalar_values``'s kept entries, in their order (cached: a run
    writes the same tags step after step, ~6000 strings with every statistic)."""
    keep = torch.frombuffer(bytearray(mask[1]), dtype=torch.bool).view(mask[0]).tolist()
    stat_names = [_tag_stat(n) for n in names] + (["scale_log2"] if log2 else [])
    return tuple(
        f"{stat}/{tag}/{label}"
        for k, stat in enumerate(stat_names)
        for i, label in enumerate(labels)
        for tag, d in DIRECTIONS
        if keep[k][i][d]
    )


def _log2_or_nan(t: Tensor) -> Tensor:
    """log2 where positive and finite, else NaN (as ``headroom.log2``)."""
    ok = (t > 0) & torch.isfinite(t)
    return torch.where(ok, torch.where(ok, t, torch.ones_like(t)).log2(), torch.full_like(t, math.nan))


def _log2_scales(std: Tensor, absmax: Tensor) -> Tuple[Tensor, Tensor]:
    """log2 std, and log2 absmax where logged (else log2 std), as ``headroom.headroom``."""
    log_std, top = _log2_or_nan(std), _log2_or_nan(absmax)
    return log_std, torch.where(top.isnan(), log_std, top)


def _headrooms(log_std: Tensor, top: Tensor, fmts: Sequence[str]) -> Tuple[Tensor, Tensor, Tensor]:
    """``headroom.headroom`` on whole tensors, formats on a new last axis: (under, over, headroom)."""
    low = torch.tensor([math.log2(stats.FORMATS[f].min_normal) for f in fmts], dtype=log_std.dtype)
    high = torch.tensor([math.log2(stats.FORMATS[f].max) for f in fmts], dtype=log_std.dtype)
    under, over = log_std.unsqueeze(-1) - low, high - top.unsqueeze(-1)
    return under, over, torch.minimum(under, over)  # NaN where either is


def summary_metrics(records: Tensor) -> Dict[str, float]:
    """``{"scale_summary/<dir>/below_normal_<fmt>": count, ".../above_max_<fmt>": count}`` over nodes."""
    fmts = headroom.FORMAT_NAMES
    under, over, _ = _headrooms(
        *_log2_scales(stats.statistic(records, "std"), stats.statistic(records, "absmax")), fmts
    )
    present = (records[..., 0] > 0).unsqueeze(-1)  # (nodes, 2, 1)
    below, above = ((under < 0) & present).sum(0).tolist(), ((over < 0) & present).sum(0).tolist()  # (2, formats)
    out: Dict[str, float] = {}
    for tag, d in DIRECTIONS:
        for j, fmt in enumerate(fmts):
            out[f"scale_summary/{tag}/below_normal_{fmt}"] = float(below[d][j])
            out[f"scale_summary/{tag}/above_max_{fmt}"] = float(above[d][j])
    return out


#: The columns the ``scale_worst`` table and the dashboard's Worst-nodes view share.
WORST_COLUMNS = ("log2 std", "log2 absmax", "above min normal", "below max", "headroom")


def worst_table(
    labels: Sequence[str], records: Tensor, k: int = 10, fmt: str = "fp16", aliases: Optional[Dict[str, str]] = None
) -> str:
    """Markdown table of the ``k`` node directions with the least headroom to ``fmt``'s edges.

    The columns and their signs are the Worst-nodes view's (``headroom.headroom``):
    octaves inside the range are positive, outside negative. A label in ``aliases``
    (``{alias: source}``: the same tensor) is listed in its source's row, not ranked again.
    """
    aliases = aliases or {}
    std, absmax = stats.statistic(records, "std").T.reshape(-1), stats.statistic(records, "absmax").T.reshape(-1)
    present = (records[..., 0] > 0).T.reshape(-1)  # rows: every fwd node, then every bwd node
    if aliases:
        own = torch.tensor([label not in aliases for label in labels]).repeat(2)
        present = present & own
    room = _headrooms(*_log2_scales(std, absmax), [fmt])[2][:, 0]
    # headroom.rank's order: smallest first, ties in row order, NaN last; absent rows out
    order = torch.sort(torch.where(room.isnan(), math.inf, room), stable=True).indices
    order = order[torch.sort(room[order].isnan().to(torch.uint8), stable=True).indices]
    top = [j for j in order[present[order]][:k].tolist()]
    head = " | ".join(WORST_COLUMNS)
    lines = [
        f"Nodes nearest the {fmt} range edges (octaves inside the range; negative = outside)",
        "",
        f"| # | node | dir | {head} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    std_l, absmax_l = std.tolist(), absmax.tolist()
    same: Dict[str, List[str]] = {}
    for alias, source in aliases.items():
        same.setdefault(source, []).append(alias)
    for n, j in enumerate(top, 1):
        label, tag = labels[j % len(labels)], DIRECTIONS[j // len(labels)][0]
        r = headroom.headroom(std_l[j], absmax_l[j], fmt)
        also = f" (= {', '.join(f'`{a}`' for a in same[label])})" if label in same else ""
        lines.append(
            f"| {n} | `{label}`{also} | {tag} | {headroom.log2(std_l[j]):.2f} | {headroom.log2(absmax_l[j]):.2f} | {r['under']:.2f} | {r['over']:.2f} | {r['headroom']:.2f} |"
        )
    return "\n".join(lines)


def _add_scalars(writer: Any, tags: Sequence[str], values: Sequence[float], step: int) -> None:
    """All scalars of a step as one event (one ``Summary`` of many values).

    ``add_scalar`` writes one event per tag through a queue of 10 that blocks on the
    writer thread: ~50 us a tag, 15 ms a step for a few hundred nodes. Building the
    ``Summary`` from its wire bytes (tags' encodings cached) instead of one
    ``Summary.Value`` object per tag saves ~10 us a tag.
    """
    file_writer = getattr(writer, "_get_file_writer", None)
    if file_writer is None:  # another SummaryWriter implementation: the public way
        for tag, value in zip(tags, values):
            writer.add_scalar(tag, value, step)
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    file_writer().add_summary(Summary.FromString(_summary_bytes(tags, values)), step)


def _summary_bytes(tags: Sequence[str], values: Sequence[float]) -> bytes:
    """The wire encoding of ``Summary(value=[Value(tag=t, simple_value=v), ...])``."""
    with np.errstate(over="ignore"):  # as protobuf: beyond float32 is +-inf
        raw = np.asarray(values, dtype=np.float64).astype("<f4").tobytes()
    floats = [raw[i : i + 4] for i in range(0, len(raw), 4)]
    return b"".join(map(bytes.__add__, map(_value_head, tags), floats))


@functools.lru_cache(maxsize=1 << 16)
def _value_head(tag: str) -> bytes:
    """``Summary.value`` entry up to its float: field 1 (Value, length-delimited), its
    field 1 (tag, a string) and field 2's key (simple_value, fixed32)."""
    t = tag.encode()
    body = b"\x0a" + _varint(len(t)) + t + b"\x15"
    return b"\x0a" + _varint(len(body) + 4) + body


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def fast_record_checksums() -> bool:
    """Checksum TensorBoard's event records with google-crc32c's C code, where installed.

    TensorBoard's writer checksums every record with a pure-Python CRC-32C, ~0.3 us a
    byte: ~90 ms of CPU per step for ~6000 scalars, more than all the rest of writing.
    The C implementation gives the same checksums (so the same files); it replaces the
    one function for every TensorBoard writer in the process. Returns whether it is in use.
    """
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if google_crc32c.implementation != "c":  # its pure-Python fallback is no faster
        return False
    record_writer.masked_crc32c = _masked_crc32c
    return True


def _masked_crc32c(data: bytes) -> int:
    """TensorBoard's ``masked_crc32c`` (TFRecord framing) on google-crc32c."""
    import google_crc32c

    x = google_crc32c.value(bytes(data))
    return (((x >> 15) | ((x << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF


def is_tensorboard(logger: Any) -> bool:
    """Whether ``logger`` writes TensorBoard events (its experiment is a ``SummaryWriter``)."""
    exp = getattr(logger, "experiment", None)
    return exp is not None and hasattr(exp, "add_histogram_raw")


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
        loggers: Sequence[Any],
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
        self.loggers = list(loggers)
        self.statistics = list(statistics)
        self.histograms = histograms
        self.figure = figure
        self.prefix = prefix
        self.figure_every = figure_every
        self.parameters = frozenset(parameters)
        self.log2, self.summary, self.top_k, self.max_tags = log2, summary, top_k, max_tags
        self._writes = 0
        self._nodes: Optional[Tuple[Any, ...]] = None
        self._chunk: Tuple[int, int] = (0, metadata.CHUNK)  # (first step, steps in it) of the records tag
        self._layout_key: Optional[Tuple[Any, ...]] = None
        self._tag_key: Optional[Tuple[Any, ...]] = None
        fast_record_checksums()
        self._tag_list: Tuple[str, ...] = ()

    def _tensorboards(self) -> List[Any]:
        return [logger.experiment for logger in self.loggers if self._tensorboards_of(logger)]

    def write(
        self,
        step: int,
        labels: Sequence[str],
        records: Tensor,
        code: Optional[str] = None,
        spread: Any = None,
        aliases: Optional[Dict[str, str]] = None,
    ) -> None:
        """Write scalars, histograms, figure, text and the dashboard's records for ``step``
        (``labels`` in execution order; ``spread``: a ``pool.RankSpread`` or None;
        ``aliases``: ``{label: label of the same tensor}``)."""
        values, keep = _scalar_values(records, self.statistics, self.log2)
        n = len(labels) if self.max_tags is None else min(len(labels), self.max_tags)
        tags = list(self._tags(labels[:n], keep[:, :n]))
        numbers = values[:, :n][keep[:, :n]].tolist()
        extra = self._spread(labels[:n], spread) if spread is not None else {}
        if self.summary:
            extra.update(summary_metrics(records))
        tags += [self.prefix + k for k in extra]
        numbers += list(extra.values())
        for logger in self.loggers:
            if self._tensorboards_of(logger):
                _add_scalars(logger.experiment, tags, numbers, step)
            else:
                logger.log_metrics(dict(zip(tags, numbers)), step=step)
        draw = self._writes % self.figure_every == 0
        self._writes += 1
        rows = self._rows(values, keep, spread)
        written = set(labels)
        same = {a: s for a, s in (aliases or {}).items() if a in written and s in written}
        for writer in self._tensorboards():
            self._write_records(writer, step, labels, rows, same)
            self._write_extras(writer, step, labels, records, n, code, draw, same)

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
        key = (tuple(labels), _mask_key(keep))
        if self._tag_key != key:
            tags = _scalar_tags(key[0], tuple(self.statistics), self.log2, key[1])
            self._tag_key, self._tag_list = key, tuple(self.prefix + t for t in tags)
        return self._tag_list

    def _tensorboards_of(self, logger: Any) -> bool:
        return is_tensorboard(logger)

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

    def _write_records(
        self, writer: Any, step: int, labels: Sequence[str], rows: Tensor, aliases: Dict[str, str]
    ) -> None:
        """Every node's statistics at ``step``, and the node list before them when it changed;
        a new records tag every ``metadata.CHUNK`` steps and whenever the node list changes."""
        file_writer = getattr(writer, "_get_file_writer", None)
        if file_writer is None:
            return
        names = self._statistics(rows)
        key = (tuple(labels), tuple(names), tuple(sorted(aliases.items())))
        if key != self._nodes:
            self._nodes, self._chunk = key, (step, 0)
            file_writer().add_summary(
                metadata.nodes_summary(self.prefix + metadata.TAG, labels, self.parameters, names, aliases), step
            )
        first, count = self._chunk if self._chunk[1] < metadata.CHUNK else (step, 0)
        self._chunk = (first, count + 1)
        file_writer().add_summary(metadata.records_summary(metadata.chunk_tag(self.prefix, first), rows.numpy()), step)

    def _write_extras(
        self,
        writer: Any,
        step: int,
        labels: Sequence[str],
        records: Tensor,
        n: int,
        code: Optional[str],
        draw: bool,
        aliases: Dict[str, str],
    ) -> None:
        self._write_layout(writer, labels[:n], records[:n])
        if self.histograms:
            std = stats.statistic(records, "std")
            for tag, d in DIRECTIONS:
                ok = (records[:, d, 0] > 0) & (std[:, d] > 0) & torch.isfinite(std[:, d])
                if bool(ok.any()):
                    writer.add_histogram(f"{self.prefix}scale_hist/{tag}", std[ok, d].log2(), step)
        if self.figure and draw:
            try:
                fig = scale_figure(labels[:n], records[:n], f"step {step}")
            except ImportError:
                self.figure = False
            else:
                writer.add_figure(f"{self.prefix}scale_plot", fig, step, close=True)
        if self.summary and len(labels):
            writer.add_text(
                f"{self.prefix}scale_worst", worst_table(labels, records, self.top_k, aliases=aliases), step
            )
        if code:
            writer.add_text(f"{self.prefix}scale_code", "    " + code.replace("\n", "\n    "), step)

    def _write_layout(self, writer: Any, labels: Sequence[str], records: Tensor) -> None:
        """Custom Scalars charts of the tags written (rewritten only when those change)."""
        mask = records[..., 0] > 0
        key = (tuple(labels), _mask_key(mask))
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
            per_prefix = _LAYOUTS.setdefault(writer, {})
            before = any(per_prefix.values())
            per_prefix[self.prefix] = categories
            merged = [category for prefix in sorted(per_prefix) for category in per_prefix[prefix]]
        if not merged and not before:  # too many charts, and no earlier layout to replace
            return
        file_writer = getattr(writer, "_get_file_writer", None)
        if file_writer is not None:
            file_writer().add_summary(_layout_summary(merged))
        elif merged:  # another SummaryWriter implementation: the public way (every category open)
            writer.add_custom_scalars(
                {title: {chart: ["Multiline", tags] for chart, tags in charts} for title, charts in merged}
            )

    def write_value_histograms(self, step: int, histograms: Dict[str, Tensor]) -> None:
        """Histograms of log2|x| (``{"fwd/<label>": counts over exponent bins}``)."""
        for writer in self._tensorboards():
            for key, counts in histograms.items():
                _add_log2_histogram(writer, f"{self.prefix}values_log2/{key}", counts, step)


def _layout_summary(categories: layout.Layout) -> Any:
    """The Custom Scalars layout ``Summary``, every category but the first closed
    (TensorBoard stamps a category's charts only when it is open). An empty layout
    replaces an earlier one: the tab then says there is none."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.plugins.custom_scalar import layout_pb2

    proto = layout_pb2.Layout()
    for i, (title, charts) in enumerate(categories):
        category = proto.category.add(title=title, closed=i > 0)
        for name, tags in charts:
            category.chart.add(title=name, multiline=layout_pb2.MultilineChartContent(tag=tags))
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="custom_scalars"))
    tensor = TensorProto(dtype="DT_STRING", string_val=[proto.SerializeToString()], tensor_shape=TensorShapeProto())
    return Summary(value=[Summary.Value(tag="custom_scalars__config__", tensor=tensor, metadata=meta)])


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
