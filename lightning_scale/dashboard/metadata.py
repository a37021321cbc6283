"""What the writer stores for the dashboard besides scalars: the node list and the records.

Scalar tags sort alphabetically, carry no structure and are capped by ``max_tags``; the
dashboard needs every node, in execution order. The writer stores, as ``tensor``
summaries with ``plugin_name="scales"``:

- ``<prefix>scale_nodes``: a JSON document ``{"version": 1, "labels": [...],
  "parameters": [...], "statistics": [...], "aliases": {alias: source}}``, written once
  and again whenever the labels or the statistics change. ``aliases`` names the labels
  that are the same tensor as another label (a view, a module's output). ``statistics``
  and ``aliases`` were added without a new version: a dashboard that predates them
  ignores them and reads the scalars.
- ``<prefix>scale_records/<first step>``: one float32 array ``[nodes, 2, statistics]`` per
  tracked step (axis 1: forward, backward; NaN where nothing was recorded), in the order
  of the node list in force at that step. A tag holds at most ``CHUNK`` steps:
  TensorBoard keeps only 10 samples per tag of a plugin it does not know (it samples the
  rest away), so the writer opens a new tag every ``CHUNK`` steps.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Dict, Mapping, Optional, Sequence

__all__ = ["CHUNK", "PLUGIN_NAME", "RECORDS", "TAG", "chunk_tag", "decode", "nodes_summary", "records_summary"]

PLUGIN_NAME = "scales"
TAG = "scale_nodes"
RECORDS = "scale_records"
CHUNK = 10  # TensorBoard's default reservoir for a third-party plugin's tensors
_VERSION = 1


def _summary(tag: str, tensor: Any, content: bytes) -> Any:
    from tensorboard.compat.proto.summary_pb2 import DATA_CLASS_TENSOR, Summary, SummaryMetadata

    # DATA_CLASS_TENSOR: TensorBoard's data providers serve it through `read_tensors`
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=content), data_class=DATA_CLASS_TENSOR
    )
    return Summary(value=[Summary.Value(tag=tag, metadata=meta, tensor=tensor)])


def nodes_summary(
    tag: str,
    labels: Sequence[str],
    parameters: Collection[str] = (),
    statistics: Sequence[str] = (),
    aliases: Optional[Mapping[str, str]] = None,
) -> Any:
    """A ``Summary`` holding the node list (execution order), the parameter labels among it,
    the statistics of the records that follow and the aliases among the labels."""
    import numpy as np
    from tensorboard.util import tensor_util

    params, present = set(parameters), set(labels)
    same = {a: s for a, s in (aliases or {}).items() if a in present and s in present}
    doc = {
        "version": _VERSION,
        "labels": list(labels),
        "parameters": [l for l in labels if l in params],
        "statistics": list(statistics),
        "aliases": same,
    }
    return _summary(tag, tensor_util.make_tensor_proto(np.array(json.dumps(doc).encode(), dtype=object)), b"1")


def records_summary(tag: str, values: Any) -> Any:
    """A ``Summary`` holding one step's ``[nodes, 2, statistics]`` array (stored as float32)."""
    import numpy as np
    from tensorboard.util import tensor_util

    return _summary(tag, tensor_util.make_tensor_proto(np.ascontiguousarray(values, dtype=np.float32)), b"1")


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
    if not isinstance(doc, dict) or doc.get("version") != _VERSION:
        raise ValueError(
            f"unsupported scales node list version: {doc.get('version') if isinstance(doc, dict) else doc!r}"
        )
    out: Dict[str, Any] = {"labels": list(doc["labels"]), "parameters": list(doc.get("parameters", []))}
    out["statistics"] = list(doc.get("statistics", []))
    out["aliases"] = dict(doc.get("aliases", {}))
    return out


def chunk_tag(prefix: str, first_step: int) -> str:
    """The records tag of the chunk that starts at ``first_step``."""
    return f"{prefix}{RECORDS}/{first_step:012d}"
