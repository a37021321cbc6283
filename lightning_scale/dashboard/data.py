"""What the ``scales`` dashboard reads from a run: tags parsed into per-node series.

A run's scalar tags ``<prefix><stat>/<dir>/<label>`` become ``values[stat][dir][label]``
(``{step: value}``; the std's tag ``scale`` is called ``std`` here). The node order and the
parameter marks come from the writer's ``scale_nodes`` summary; logs without it fall
back to the tags' order. Reading goes through TensorBoard's data provider only, so it
works with both of its loaders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from lightning_scale.dashboard import metadata

__all__ = ["RunData", "fingerprint", "list_runs", "load"]

DIRS = ("fwd", "bwd")
# Written by the writer but derived from others or not per node: not shown as statistics.
_DERIVED = {"scale_log2", "scale_summary", "scale_hist", "values_log2"}
_DOWNSAMPLE = 100_000  # every tracked step: the dashboard needs all of them


@dataclass
class RunData:
    """One run's node statistics for one tag prefix (``""`` training, ``"val_"`` validation)."""

    labels: List[str]
    parameters: Set[str]
    steps: List[int]
    values: Dict[str, Dict[str, Dict[str, Dict[int, float]]]]  # stat -> dir -> label -> step -> value
    ratios: Dict[str, Dict[int, float]] = field(default_factory=dict)  # parameter -> step -> update ratio
    code: Dict[int, str] = field(default_factory=dict)  # step -> annotated code

    def value(self, stat: str, d: str, label: str, step: int) -> float:
        """The logged value, NaN where none."""
        return self.values.get(stat, {}).get(d, {}).get(label, {}).get(step, math.nan)


def _parse(tag: str, prefix: str, others: Set[str]) -> Optional[tuple]:
    """``(stat, dir, label)`` of a per-node tag of ``prefix``, else None."""
    if not tag.startswith(prefix) or any(o.startswith(prefix) and o != prefix and tag.startswith(o) for o in others):
        return None
    parts = tag[len(prefix) :].split("/", 2)
    if len(parts) != 3 or parts[1] not in DIRS or parts[0] in _DERIVED or not parts[2]:
        return None
    return ("std" if parts[0] == "scale" else parts[0], parts[1], parts[2])


def _node_lists(provider: Any, ctx: Any, eid: str, run: str) -> Dict[str, Dict[str, List[str]]]:
    """``{prefix: {"labels": [...], "parameters": [...]}}``: the latest node list per prefix."""
    from tensorboard.data.provider import RunTagFilter

    listing = provider.list_tensors(ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter(runs=[run]))
    tags = [t for t in listing.get(run, {}) if t.endswith(metadata.TAG)]
    if not tags:
        return {}
    data = provider.read_tensors(ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, downsample=1000, run_tag_filter=RunTagFilter(runs=[run], tags=tags))
    out = {}
    for tag, datums in data.get(run, {}).items():
        if datums:
            out[tag[: -len(metadata.TAG)]] = metadata.decode(max(datums, key=lambda d: d.step).numpy)
    return out


def list_runs(provider: Any, ctx: Any, eid: str) -> Dict[str, List[str]]:
    """``{run: [prefixes with node statistics]}`` over the experiment."""
    from tensorboard.data.provider import RunTagFilter

    out: Dict[str, Set[str]] = {}
    for run, tags in provider.list_tensors(ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter()).items():
        out.setdefault(run, set()).update(t[: -len(metadata.TAG)] for t in tags if t.endswith(metadata.TAG))
    for run, tags in provider.list_scalars(ctx, experiment_id=eid, plugin_name="scalars").items():
        for tag in tags:
            head = tag.split("/", 1)[0]
            if head.endswith("scale") and tag[len(head) :].startswith(("/fwd/", "/bwd/")):
                out.setdefault(run, set()).add(head[: -len("scale")])
    return {run: sorted(p) for run, p in sorted(out.items())}


def fingerprint(provider: Any, ctx: Any, eid: str, run: str) -> tuple:
    """Changes whenever the run's scalars or texts grow: (tags, newest step, newest wall time) per kind.

    Listing is metadata only; reading every value of a large run takes seconds.
    """
    from tensorboard.data.provider import RunTagFilter

    out = []
    for lister, plugin in ((provider.list_scalars, "scalars"), (provider.list_tensors, "text"), (provider.list_tensors, metadata.PLUGIN_NAME)):
        series = lister(ctx, experiment_id=eid, plugin_name=plugin, run_tag_filter=RunTagFilter(runs=[run])).get(run, {}).values()
        out.append((len(series), max((s.max_step for s in series), default=-1), max((s.max_wall_time for s in series), default=0.0)))
    return tuple(out)


def load(provider: Any, ctx: Any, eid: str, run: str, prefix: str) -> RunData:
    """Read one run's statistics for ``prefix``."""
    from tensorboard.data.provider import RunTagFilter

    nodes = _node_lists(provider, ctx, eid, run)
    others = set(nodes) | {"val_"}
    scalar_tags = list(provider.list_scalars(ctx, experiment_id=eid, plugin_name="scalars", run_tag_filter=RunTagFilter(runs=[run])).get(run, {}))
    parsed = {t: _parse(t, prefix, others) for t in scalar_tags}
    ratio_tags = [t for t in scalar_tags if t.startswith("update_ratio/")] if prefix == "" else []
    wanted = [t for t, p in parsed.items() if p] + ratio_tags
    read = provider.read_scalars(ctx, experiment_id=eid, plugin_name="scalars", downsample=_DOWNSAMPLE, run_tag_filter=RunTagFilter(runs=[run], tags=wanted)) if wanted else {}
    series = {tag: {d.step: d.value for d in datums} for tag, datums in read.get(run, {}).items()}
    values: Dict[str, Dict[str, Dict[str, Dict[int, float]]]] = {}
    steps: Set[int] = set()
    seen: List[str] = []
    for tag in wanted:
        if tag in ratio_tags or tag not in series:
            continue
        stat, d, label = parsed[tag]
        values.setdefault(stat, {}).setdefault(d, {})[label] = series[tag]
        steps.update(series[tag])
        seen.append(label)
    doc = nodes.get(prefix, {"labels": [], "parameters": []})
    labels = list(doc["labels"]) + sorted(set(seen) - set(doc["labels"]))
    # Without the writer's list, a dotted label with no op part is a parameter or buffer read
    params = set(doc["parameters"]) or {l for l in labels if "/" not in l and "." in l}
    ratios = {t[len("update_ratio/") :]: series.get(t, {}) for t in ratio_tags}
    return RunData(labels, params, sorted(steps), values, ratios, _code(provider, ctx, eid, run, prefix))


def _code(provider: Any, ctx: Any, eid: str, run: str, prefix: str) -> Dict[int, str]:
    from tensorboard.data.provider import RunTagFilter

    listing = provider.list_tensors(ctx, experiment_id=eid, plugin_name="text", run_tag_filter=RunTagFilter(runs=[run]))
    tags = [t for t in listing.get(run, {}) if t.split("/", 1)[0] == f"{prefix}scale_code"]
    if not tags:
        return {}
    data = provider.read_tensors(ctx, experiment_id=eid, plugin_name="text", downsample=1000, run_tag_filter=RunTagFilter(runs=[run], tags=tags[:1]))
    out = {}
    for datum in data.get(run, {}).get(tags[0], []):
        raw = datum.numpy.flatten()[0] if datum.numpy.size else b""
        out[datum.step] = raw.decode() if isinstance(raw, bytes) else str(raw)
    return out
