"""What the writer stores for the dashboard besides scalars, shared by writer and reader.

As TensorBoard's ``plugins/scalar/metadata.py``: the names, the format and its decoding;
``summaries`` (beside it) builds the summaries, ``plugin`` / ``data`` read them.

Scalar tags sort alphabetically, carry no structure and are capped by ``max_tags``; the
dashboard needs every node, in execution order. The writer stores, as ``tensor``
summaries with ``plugin_name="scales"``:

- ``<prefix>scale_nodes``: a JSON document ``{"version": 1, "labels": [...],
  "parameters": [...], "statistics": [...], "aliases": {alias: source}, "meta": {statistic:
  {"axis", "worse", "unscale", "doc"}}}``, written once and again whenever the labels or the
  statistics change. ``aliases`` names the labels that are the same tensor as another label
  (a view, a module's output); ``meta`` is each statistic's declaration as the dashboard needs
  it (``Statistic.meta``: user statistics are known only from it). ``statistics``,
  ``aliases`` and ``meta`` were added without a new version: a dashboard that predates them
  ignores them and reads the scalars.
- ``<prefix>scale_records/<first step>``: one float32 array ``[nodes, 2, statistics]`` per
  tracked step (axis 1: forward, backward; NaN where nothing was recorded), in the order
  of the node list in force at that step. A tag holds at most ``CHUNK`` steps:
  TensorBoard keeps only 10 samples per tag of a plugin it does not know (it samples the
  rest away), so the writer opens a new tag every ``CHUNK`` steps.
"""

from __future__ import annotations

import json
from typing import Any, Dict

__all__ = ["CHUNK", "PLUGIN_NAME", "RECORDS", "TAG", "VERSION", "chunk_tag", "decode", "summary_metadata"]

PLUGIN_NAME = "scales"
TAG = "scale_nodes"
RECORDS = "scale_records"
CHUNK = 10  # TensorBoard's default reservoir for a third-party plugin's tensors
VERSION = 1  # of the node list document


def summary_metadata() -> Any:
    """The ``SummaryMetadata`` of every tensor summary of this plugin (``summaries`` writes them)."""
    from tensorboard.compat.proto.summary_pb2 import DATA_CLASS_TENSOR, SummaryMetadata

    # DATA_CLASS_TENSOR: TensorBoard's data providers serve it through `read_tensors`
    return SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"1"), data_class=DATA_CLASS_TENSOR
    )


def decode(value: Any) -> Dict[str, Any]:
    """The document of a ``nodes_summary`` read back (a numpy bytes scalar, bytes or str);
    one written before ``statistics`` and ``aliases`` existed gets them empty.

    Raises:
        ValueError: not a node list this version reads.
    """
    raw = value.item() if hasattr(value, "item") else value
    try:
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"not a scales node list: {str(raw)[:80]!r}") from e
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(
            f"unsupported scales node list version: {doc.get('version') if isinstance(doc, dict) else doc!r}"
        )
    out: Dict[str, Any] = {"labels": list(doc["labels"]), "parameters": list(doc.get("parameters", []))}
    out["statistics"] = list(doc.get("statistics", []))
    out["aliases"] = dict(doc.get("aliases", {}))
    out["meta"] = dict(doc.get("meta", {}))
    return out


def chunk_tag(prefix: str, first_step: int) -> str:
    """The records tag of the chunk that starts at ``first_step``."""
    return f"{prefix}{RECORDS}/{first_step:012d}"
