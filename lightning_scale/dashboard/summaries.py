"""The summaries the writer stores for the dashboard and for Custom Scalars (writer side).

As TensorBoard's ``plugins/scalar/summary.py`` beside its ``metadata.py``: builds the
``Summary`` protos of the node list, one step's records (format in ``metadata``) and the
Custom Scalars layout (``layout``). The reader is ``plugin`` / ``data``.
"""

from __future__ import annotations

import json
from typing import Any, Collection, Mapping, Optional, Sequence

import numpy as np

from lightning_scale.dashboard import layout, metadata

__all__ = ["layout_summary", "nodes_summary", "records_summary"]


def _tensor_summary(tag: str, tensor: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.summary_metadata(), tensor=tensor)])


def nodes_summary(
    tag: str,
    labels: Sequence[str],
    parameters: Collection[str] = (),
    statistics: Sequence[str] = (),
    aliases: Optional[Mapping[str, str]] = None,
    meta: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> Any:
    """A ``Summary`` holding the node list (execution order), the parameter labels among it,
    the statistics of the records that follow, what the dashboard needs to know of each
    (``meta``: ``Statistic.meta()``, by name) and the aliases among the labels."""
    from tensorboard.util import tensor_util

    params, present = set(parameters), set(labels)
    same = {a: s for a, s in (aliases or {}).items() if a in present and s in present}
    doc = {
        "version": metadata.VERSION,
        "labels": list(labels),
        "parameters": [l for l in labels if l in params],
        "statistics": list(statistics),
        "aliases": same,
        "meta": {k: dict(v) for k, v in (meta or {}).items()},
    }
    return _tensor_summary(tag, tensor_util.make_tensor_proto(np.array(json.dumps(doc).encode(), dtype=object)))


def records_summary(tag: str, values: Any) -> Any:
    """A ``Summary`` holding one step's ``[nodes, 2, statistics]`` array (stored as float32)."""
    from tensorboard.util import tensor_util

    return _tensor_summary(tag, tensor_util.make_tensor_proto(np.ascontiguousarray(values, dtype=np.float32)))


def layout_summary(categories: layout.Layout) -> Any:
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
