"""The node list of a run, written once (and again when it changes) for the dashboard.

Scalar tags sort alphabetically and carry no structure; the dashboard needs the execution
order and which nodes are parameters or buffers. The writer stores them as one
``tensor`` summary with ``plugin_name="scales"`` at tag ``<prefix>scale_nodes``, holding a
JSON document ``{"version": 1, "labels": [...], "parameters": [...]}``.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Dict, List, Sequence

__all__ = ["PLUGIN_NAME", "TAG", "decode", "nodes_summary"]

PLUGIN_NAME = "scales"
TAG = "scale_nodes"
_VERSION = 1


def nodes_summary(tag: str, labels: Sequence[str], parameters: Collection[str] = ()) -> Any:
    """A ``Summary`` holding the node list (execution order) and the parameter labels among it."""
    import numpy as np
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.util import tensor_util

    params = set(parameters)
    doc = {"version": _VERSION, "labels": list(labels), "parameters": [l for l in labels if l in params]}
    from tensorboard.compat.proto.summary_pb2 import DATA_CLASS_TENSOR

    # DATA_CLASS_TENSOR: TensorBoard's data providers serve it through `read_tensors`
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=b"1"), data_class=DATA_CLASS_TENSOR)
    tensor = tensor_util.make_tensor_proto(np.array(json.dumps(doc).encode(), dtype=object))
    return Summary(value=[Summary.Value(tag=tag, metadata=metadata, tensor=tensor)])


def decode(value: Any) -> Dict[str, List[str]]:
    """The document of a ``nodes_summary`` read back (a numpy bytes scalar, bytes or str).

    Raises:
        ValueError: not a node list this version writes.
    """
    raw = value.item() if hasattr(value, "item") else value
    try:
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"not a scales node list: {str(raw)[:80]!r}") from e
    if not isinstance(doc, dict) or doc.get("version") != _VERSION:
        raise ValueError(f"unsupported scales node list version: {doc.get('version') if isinstance(doc, dict) else doc!r}")
    return {"labels": list(doc["labels"]), "parameters": list(doc.get("parameters", []))}
