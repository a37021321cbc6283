"""lightning-scale: the scale of every tensor in your model, forward and backward, while it trains."""

from lightning_scale.callback import ScaleMonitor
from lightning_scale.capture import Capture, CaptureError, DeepTracer, capture
from lightning_scale.capture.interpreter import ScalePair, ScaleTrackingInterpreter
from lightning_scale.capture.recipe_check import check_recipe
from lightning_scale.coord_check import coord_check  # the documented module path, then the function
from lightning_scale.record.recorder import Recorder, recording
from lightning_scale.record.stats.table import Statistic
from lightning_scale.tools.analyse import analyse_module, records_table

__all__ = [
    "Capture",
    "CaptureError",
    "DeepTracer",
    "Recorder",
    "ScaleMonitor",
    "ScalePair",
    "ScaleTrackingInterpreter",
    "Statistic",
    "analyse_module",
    "capture",
    "check_recipe",
    "coord_check",
    "recording",
    "records_table",
]
