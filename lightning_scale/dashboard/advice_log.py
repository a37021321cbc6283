"""The precision advisor's log: what ``ScaleMonitor(advise=True)`` stores per tracked step,
shared by the writer (``report.advice``) and the readers (``dashboard.advice``, the
``lightning-scale advise`` command).

Two tensor summaries of the ``scales`` plugin per tracked step, under tags that start a new
chunk every ``metadata.CHUNK`` steps (TensorBoard keeps 10 samples per tag of a plugin it
does not know):

- ``advice_layers/<first step>``: a JSON document ``{"version": 1, "submodule": ...,
  "recipes": [...], "gemms": [...], "fields": [...], "layers": [{"name", "module",
  "linear", "bias", "how", "k", "n"}, ...]}``: each linear layer's name (as in
  ``LightningModule.named_modules()``, compiled wrappers' ``_orig_mod`` left out), the class
  of the module that owns its weight, whether that is an ``nn.Linear`` (torchao converts
  those only), whether it has a bias, how the weight was used (``"linear"``, ``"matmul"``;
  ``""``: not seen on the writing rank) and K, N;
- ``advice_gemms/<first step>``: float64 ``[layers, len(GEMMS), len(RECIPES), len(FIELDS)]``,
  the step's what-if sums (``record.gemm_whatif``) pooled over ranks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from lightning_scale.dashboard import metadata
from lightning_scale.record.gemm_names import FIELDS, GEMMS, RECIPES

__all__ = [
    "AdviceRun",
    "DEFAULT_FLUSHED",
    "DEFAULT_SNR_DB",
    "GEMMS_TAG",
    "LAYERS_TAG",
    "VERSION",
    "gemms_summary",
    "layers_summary",
    "read",
]

#: The decision's default thresholds (``dashboard.advice.Thresholds``): a GEMM result must keep
#: this SNR (E5M2 gradients put ordinary results near 25 dB, E4M3 near 29-31) ...
DEFAULT_SNR_DB = 15.0
#: ... and no operand may lose more than this fraction of its nonzero values to zero.
DEFAULT_FLUSHED = 0.1

LAYERS_TAG = "advice_layers"
GEMMS_TAG = "advice_gemms"
VERSION = 1


def layers_summary(tag: str, layers: Sequence[Dict[str, Any]], submodule: str) -> Any:
    """The ``Summary`` of a step's layer table (``layers``: one dict per layer, in row order)."""
    from tensorboard.util import tensor_util

    doc = {
        "version": VERSION,
        "submodule": submodule,
        "recipes": list(RECIPES),
        "gemms": list(GEMMS),
        "fields": list(FIELDS),
        "layers": list(layers),
    }
    return _summary(tag, tensor_util.make_tensor_proto(np.array(json.dumps(doc).encode(), dtype=object)))


def gemms_summary(tag: str, sums: Any) -> Any:
    """The ``Summary`` of a step's pooled what-if sums (float64, kept exact)."""
    from tensorboard.util import tensor_util

    return _summary(tag, tensor_util.make_tensor_proto(np.ascontiguousarray(sums, dtype=np.float64)))


def _summary(tag: str, tensor: Any) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.summary_metadata(), tensor=tensor)])


def chunk_tag(kind: str, first_step: int) -> str:
    """The tag of ``kind`` (``LAYERS_TAG`` or ``GEMMS_TAG``) for the chunk starting at ``first_step``."""
    return f"{kind}/{first_step:012d}"


@dataclass
class AdviceRun:
    """A run's advisor statistics: ``sums[t, i]`` is layer ``layers[i]``'s
    ``[GEMMS, RECIPES, FIELDS]`` at step ``steps[t]`` (NaN where the layer was not in that step's table)."""

    steps: List[int]
    layers: List[Dict[str, Any]]
    sums: np.ndarray
    submodule: str = ""
    names: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.names = [layer["name"] for layer in self.layers]


def _decode(value: Any) -> Dict[str, Any]:
    raw = value.item() if hasattr(value, "item") else value
    try:
        doc = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"not an advisor layer table: {str(raw)[:80]!r}") from e
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(
            f"unsupported advisor layer table version: {doc.get('version') if isinstance(doc, dict) else doc}"
        )
    if (doc["recipes"], doc["gemms"], doc["fields"]) != (list(RECIPES), list(GEMMS), list(FIELDS)):
        raise ValueError("the advisor layer table names other recipes, GEMMs or fields than this version reads")
    return doc


def read(provider: Any, ctx: Any, eid: str, run: str) -> Optional[AdviceRun]:
    """A run's advisor statistics through TensorBoard's data provider; None if it has none."""
    from tensorboard.data.provider import RunTagFilter

    listing = provider.list_tensors(
        ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter(runs=[run])
    ).get(run, {})
    tags = [t for t in listing if t.startswith((LAYERS_TAG + "/", GEMMS_TAG + "/"))]
    if not tags:
        return None
    read_ = provider.read_tensors(
        ctx,
        experiment_id=eid,
        plugin_name=metadata.PLUGIN_NAME,
        downsample=100_000,
        run_tag_filter=RunTagFilter(runs=[run], tags=tags),
    ).get(run, {})
    docs = {d.step: _decode(d.numpy) for t, ds in read_.items() if t.startswith(LAYERS_TAG) for d in ds}
    arrays = {d.step: d.numpy for t, ds in read_.items() if t.startswith(GEMMS_TAG) for d in ds}
    steps = sorted(s for s in docs if s in arrays and arrays[s].shape[0] == len(docs[s]["layers"]))
    if not steps:
        return None
    return _joined(steps, docs, arrays)


def _joined(steps: List[int], docs: Dict[int, Dict[str, Any]], arrays: Dict[int, np.ndarray]) -> AdviceRun:
    """One array over the steps: layers by name, each described by its latest table entry
    that saw it (``how`` set), else its latest."""
    layers: Dict[str, Dict[str, Any]] = {}
    for step in steps:
        for layer in docs[step]["layers"]:
            if layer["name"] not in layers or layer.get("how") or not layers[layer["name"]].get("how"):
                layers[layer["name"]] = layer
    names = sorted(layers)
    where = {n: i for i, n in enumerate(names)}
    sums = np.full((len(steps), len(names), len(GEMMS), len(RECIPES), len(FIELDS)), math.nan)
    for t, step in enumerate(steps):
        rows = [where[layer["name"]] for layer in docs[step]["layers"]]
        sums[t, rows] = arrays[step]
    return AdviceRun(steps, [layers[n] for n in names], sums, submodule=docs[steps[-1]].get("submodule", ""))
