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

from lightning_scale.capture.graphs import CAPTURE_MODES, Capture, CaptureError, DeepTracer, capture
from lightning_scale.capture.tracer import DEFAULT_LEAF_TYPES

__all__ = ["CAPTURE_MODES", "Capture", "CaptureError", "DEFAULT_LEAF_TYPES", "DeepTracer", "capture"]
