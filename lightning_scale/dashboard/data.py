"""What the ``scales`` dashboard reads from a run: every node's statistics per tracked step.

The writer stores each tracked step's records as one tensor (``<prefix>scale_records/``,
``metadata.py``) in the order of the node list in force at that step
(``<prefix>scale_nodes``); they hold every node whatever ``max_tags``. Logs written before
those existed fall back to the scalar tags ``<prefix><stat>/<dir>/<label>`` (the std's
tag ``scale`` is called ``std`` here), which ``max_tags`` caps. Either way a run becomes
one array ``values[step, node, direction, statistic]``. Reading goes through TensorBoard's
data provider only, so it works with both of its loaders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from lightning_scale.dashboard import metadata

__all__ = ["RunData", "fingerprint", "from_records", "list_runs", "load"]

DIRS = ("fwd", "bwd")
# Written by the writer but derived from others or not per node: not shown as statistics.
_DERIVED = {"scale_log2", "scale_summary", "scale_hist", "values_log2"}
_DOWNSAMPLE = 100_000  # every tracked step: the dashboard needs all of them


@dataclass
class RunData:
    """One run's node statistics for one tag prefix (``""`` training, ``"val_"`` validation).

    ``values[t, i, d, k]``: statistic ``stats[k]`` of node ``labels[i]`` in direction
    ``DIRS[d]`` at step ``steps[t]``; NaN where not logged.
    """

    labels: List[str]
    parameters: Set[str]
    steps: List[int]
    stats: List[str]
    values: np.ndarray
    aliases: Dict[str, str] = field(default_factory=dict)  # label -> label of the same tensor
    ratios: Dict[str, Dict[int, float]] = field(default_factory=dict)  # parameter -> step -> update ratio
    code: Dict[int, str] = field(default_factory=dict)  # step -> annotated code
    #: statistic -> its declaration as the writer stored it (``Statistic.meta``: axis, worse, ...)
    meta: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    def column(self, stat: str) -> np.ndarray:
        """``[steps, nodes, 2]`` of ``stat`` (all NaN if the run did not log it)."""
        if stat not in self.stats:
            return np.full(self.values.shape[:3], math.nan)
        return self.values[..., self.stats.index(stat)]

    def value(self, stat: str, d: str, label: str, step: int) -> float:
        """The logged value, NaN where none."""
        if stat not in self.stats or label not in self.labels or step not in self.steps:
            return math.nan
        return float(
            self.values[self.steps.index(step), self.labels.index(label), DIRS.index(d), self.stats.index(stat)]
        )


def of_series(
    labels: Sequence[str], parameters: Set[str], series: Dict[str, Dict[str, Dict[str, Dict[int, float]]]], **extra: Any
) -> RunData:
    """A ``RunData`` from ``{stat: {dir: {label: {step: value}}}}``."""
    stats = sorted(series)
    steps = sorted(
        {s for per_dir in series.values() for per_label in per_dir.values() for v in per_label.values() for s in v}
    )
    values = np.full((len(steps), len(labels), 2, len(stats)), math.nan)
    where_step, where_label = {s: t for t, s in enumerate(steps)}, {l: i for i, l in enumerate(labels)}
    for k, stat in enumerate(stats):
        for d, per_label in series[stat].items():
            for label, points in per_label.items():
                for s, v in points.items():
                    values[where_step[s], where_label[label], DIRS.index(d), k] = v
    return RunData(list(labels), parameters, steps, stats, values, **extra)


def _parse(tag: str, prefix: str, others: Set[str]) -> Optional[tuple]:
    """``(stat, dir, label)`` of a per-node tag of ``prefix``, else None."""
    if not tag.startswith(prefix) or any(o.startswith(prefix) and o != prefix and tag.startswith(o) for o in others):
        return None
    parts = tag[len(prefix) :].split("/", 2)
    if len(parts) != 3 or parts[1] not in DIRS or parts[0] in _DERIVED or not parts[2]:
        return None
    return ("std" if parts[0] == "scale" else parts[0], parts[1], parts[2])


def _read_tensors(provider: Any, ctx: Any, eid: str, run: str, tags: List[str]) -> Dict[str, Any]:
    from tensorboard.data.provider import RunTagFilter

    if not tags:
        return {}
    data = provider.read_tensors(
        ctx,
        experiment_id=eid,
        plugin_name=metadata.PLUGIN_NAME,
        downsample=_DOWNSAMPLE,
        run_tag_filter=RunTagFilter(runs=[run], tags=tags),
    )
    return data.get(run, {})


def _listing(provider: Any, ctx: Any, eid: str, run: str) -> List[str]:
    from tensorboard.data.provider import RunTagFilter

    return list(
        provider.list_tensors(
            ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter(runs=[run])
        ).get(run, {})
    )


def _node_docs(
    provider: Any, ctx: Any, eid: str, run: str, tags: List[str]
) -> Dict[str, List[Tuple[int, Dict[str, Any]]]]:
    """``{prefix: [(step, node list document), ...]}`` by step."""
    out: Dict[str, List[Tuple[int, Dict[str, Any]]]] = {}
    for tag, datums in _read_tensors(provider, ctx, eid, run, [t for t in tags if t.endswith(metadata.TAG)]).items():
        out[tag[: -len(metadata.TAG)]] = sorted(
            ((d.step, metadata.decode(d.numpy)) for d in datums), key=lambda p: p[0]
        )
    return out


def list_runs(provider: Any, ctx: Any, eid: str) -> Dict[str, List[str]]:
    """``{run: [prefixes with node statistics]}`` over the experiment."""
    from tensorboard.data.provider import RunTagFilter

    out: Dict[str, Set[str]] = {}
    for run, tags in provider.list_tensors(
        ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter()
    ).items():
        out.setdefault(run, set()).update(t[: -len(metadata.TAG)] for t in tags if t.endswith(metadata.TAG))
    for run, tags in provider.list_scalars(ctx, experiment_id=eid, plugin_name="scalars").items():
        for tag in tags:
            head = tag.split("/", 1)[0]
            if head.endswith("scale") and tag[len(head) :].startswith(("/fwd/", "/bwd/")):
                out.setdefault(run, set()).add(head[: -len("scale")])
    return {run: sorted(p) for run, p in sorted(out.items())}


def fingerprint(provider: Any, ctx: Any, eid: str, run: str) -> tuple:
    """Changes whenever the run's records (or, for logs without records, its scalars) or texts
    grow: (tags, newest step, newest wall time) per kind.

    Listing is metadata only; reading every value of a large run takes seconds. Listing the
    scalars of a 2,000-node run takes ~0.3 s itself, so a run with records is judged by its
    records alone (update ratios, also scalars, then show up with the next tracked step).
    """
    from tensorboard.data.provider import RunTagFilter

    def summary(lister: Any, plugin: str) -> Tuple[int, int, float]:
        series = lister(ctx, experiment_id=eid, plugin_name=plugin, run_tag_filter=RunTagFilter(runs=[run])).get(
            run, {}
        )
        if plugin == metadata.PLUGIN_NAME:
            has_records[0] = any(metadata.RECORDS in tag for tag in series)
        values = series.values()
        return (
            len(values),
            max((s.max_step for s in values), default=-1),
            max((s.max_wall_time for s in values), default=0.0),
        )

    has_records = [False]
    out = [summary(provider.list_tensors, metadata.PLUGIN_NAME), summary(provider.list_tensors, "text")]
    if not has_records[0]:
        out.append(summary(provider.list_scalars, "scalars"))
    return tuple(out)


def load(provider: Any, ctx: Any, eid: str, run: str, prefix: str) -> RunData:
    """Read one run's statistics for ``prefix``: its records where written, else its scalars."""
    tags = _listing(provider, ctx, eid, run)
    docs = _node_docs(provider, ctx, eid, run, tags)
    records = [t for t in tags if t.startswith(f"{prefix}{metadata.RECORDS}/")]
    scalar_tags = _scalar_tags(provider, ctx, eid, run)
    ratio_tags = [t for t in scalar_tags if t.startswith("update_ratio/")] if prefix == "" else []
    ratios = {t[len("update_ratio/") :]: s for t, s in _read_scalars(provider, ctx, eid, run, ratio_tags).items()}
    extra = {"ratios": ratios, "code": _code(provider, ctx, eid, run, prefix)}
    if records and docs.get(prefix):
        return from_records(docs[prefix], _read_tensors(provider, ctx, eid, run, records), extra)
    return _from_scalars(provider, ctx, eid, run, prefix, scalar_tags, docs, extra)


def from_records(docs: List[Tuple[int, Dict[str, Any]]], read: Dict[str, Any], extra: Dict[str, Any]) -> RunData:
    """Every records datum placed by the node list in force at its step (the latest list's
    labels first, then labels only older lists have).

    ``docs``: ``[(step, node list document), ...]`` sorted by step; ``read``: ``{records tag:
    [datum, ...]}``, each datum with ``.step`` and ``.numpy`` (TensorBoard's ``TensorDatum``);
    ``extra``: further ``RunData`` fields (``ratios``, ``code``)."""
    latest = docs[-1][1]
    labels = list(latest["labels"])
    known = set(labels)
    for _, doc in reversed(docs[:-1]):
        labels += [l for l in doc["labels"] if l not in known]
        known.update(doc["labels"])
    stats = list(dict.fromkeys(s for _, doc in docs for s in doc["statistics"]))
    datums = {d.step: d.numpy for datums in read.values() for d in datums}  # (a step in two chunks: either)
    steps = sorted(datums)
    values = np.full((len(steps), len(labels), 2, len(stats)), math.nan)
    where_label, where_stat = {l: i for i, l in enumerate(labels)}, {s: k for k, s in enumerate(stats)}
    doc_steps = [s for s, _ in docs]
    for t, step in enumerate(steps):
        doc = docs[max(0, int(np.searchsorted(doc_steps, step, side="right")) - 1)][1]
        arr = datums[step]
        if arr.shape != (len(doc["labels"]), 2, len(doc["statistics"])):
            continue  # not the node list's shape: a step written by another writer
        rows = [where_label[l] for l in doc["labels"]]
        cols = [where_stat[s] for s in doc["statistics"]]
        values[t][np.ix_(rows, [0, 1], cols)] = arr
    params = {p for _, doc in docs for p in doc["parameters"]}
    aliases = {a: s for _, doc in docs for a, s in doc["aliases"].items()}
    meta = {k: v for _, doc in docs for k, v in doc.get("meta", {}).items()}
    return RunData(labels, params, steps, stats, values, aliases, meta=meta, **extra)


def _scalar_tags(provider: Any, ctx: Any, eid: str, run: str) -> List[str]:
    from tensorboard.data.provider import RunTagFilter

    return list(
        provider.list_scalars(
            ctx, experiment_id=eid, plugin_name="scalars", run_tag_filter=RunTagFilter(runs=[run])
        ).get(run, {})
    )


def _read_scalars(provider: Any, ctx: Any, eid: str, run: str, tags: List[str]) -> Dict[str, Dict[int, float]]:
    from tensorboard.data.provider import RunTagFilter

    if not tags:
        return {}
    read = provider.read_scalars(
        ctx,
        experiment_id=eid,
        plugin_name="scalars",
        downsample=_DOWNSAMPLE,
        run_tag_filter=RunTagFilter(runs=[run], tags=tags),
    )
    return {tag: {d.step: d.value for d in datums} for tag, datums in read.get(run, {}).items()}


def _from_scalars(
    provider: Any,
    ctx: Any,
    eid: str,
    run: str,
    prefix: str,
    scalar_tags: List[str],
    docs: Dict[str, Any],
    extra: Dict[str, Any],
) -> RunData:
    others = set(docs) | {"val_"}
    parsed = {t: _parse(t, prefix, others) for t in scalar_tags}
    series = _read_scalars(provider, ctx, eid, run, [t for t, p in parsed.items() if p])
    values: Dict[str, Dict[str, Dict[str, Dict[int, float]]]] = {}
    seen: List[str] = []
    for tag, points in series.items():
        stat, d, label = parsed[tag]
        values.setdefault(stat, {}).setdefault(d, {})[label] = points
        seen.append(label)
    doc = docs[prefix][-1][1] if docs.get(prefix) else {"labels": [], "parameters": [], "aliases": {}}
    labels = list(doc["labels"]) + sorted(set(seen) - set(doc["labels"]))
    # Without the writer's list, a dotted label with no op part is a parameter or buffer read
    params = set(doc["parameters"]) or {l for l in labels if "/" not in l and "." in l}
    return of_series(labels, params, values, aliases=dict(doc["aliases"]), **extra)


def _code(provider: Any, ctx: Any, eid: str, run: str, prefix: str) -> Dict[int, str]:
    from tensorboard.data.provider import RunTagFilter

    listing = provider.list_tensors(ctx, experiment_id=eid, plugin_name="text", run_tag_filter=RunTagFilter(runs=[run]))
    tags = [t for t in listing.get(run, {}) if t.split("/", 1)[0] == f"{prefix}scale_code"]
    if not tags:
        return {}
    data = provider.read_tensors(
        ctx,
        experiment_id=eid,
        plugin_name="text",
        downsample=1000,
        run_tag_filter=RunTagFilter(runs=[run], tags=tags[:1]),
    )
    out = {}
    for datum in data.get(run, {}).get(tags[0], []):
        raw = datum.numpy.flatten()[0] if datum.numpy.size else b""
        out[datum.step] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return out
