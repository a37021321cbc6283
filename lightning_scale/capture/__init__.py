"""Capture: a module becomes torch.fx graphs that record as they run.

In: an ``nn.Module`` (a LightningModule, or one of its submodules) and a capture mode.
Out: a :class:`Capture`, the module's graphs instrumented so that each node's output and
its gradient are observed by the active :class:`~lightning_scale.record.recorder.Recorder`,
with a full, stable label per node (``blocks.0.attn/linear``), module outputs under their
paths, and a coverage report of what was and was not recorded.

Two routes: symbolic tracing with a deep tracer (``tracer``), or TorchDynamo with a backend
of our own (``dynamo``, ``frames``) where fx cannot trace. ``fidelity`` proves, on a
capture's first tracked step, that its forward is the model's own bit for bit (or picks
the other route, or none). ``forward_swap`` swaps a module's ``forward`` and puts back
exactly what was there. ``interpreter`` is the one-off scale-tracking interpreter with the
reference library's API. Imports only ``record``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_scale.capture.graphs import CAPTURE_MODES, Capture, CaptureError, DeepTracer, capture
    from lightning_scale.capture.tracer import DEFAULT_LEAF_TYPES

__all__ = ["CAPTURE_MODES", "Capture", "CaptureError", "DEFAULT_LEAF_TYPES", "DeepTracer", "capture"]


def __getattr__(name: str) -> Any:
    """The package's names, imported on first use: a module of it (``recipe_check``) is imported
    without TorchDynamo and the capture routes (the command-line tools start faster)."""
    if name not in __all__:
        raise AttributeError(f"module 'lightning_scale.capture' has no attribute {name!r}")
    module = "tracer" if name == "DEFAULT_LEAF_TYPES" else "graphs"
    value = getattr(importlib.import_module(f"lightning_scale.capture.{module}"), name)
    globals()[name] = value
    return value
