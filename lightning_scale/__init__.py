"""lightning-scale: the scale of every tensor in your model, forward and backward, while it trains.

The public names are imported on first use (PEP 562): ``lightning-scale``'s command-line
tools, which read logs, start without importing Lightning (about 4 s of a 2-core CPU).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any, Dict

if TYPE_CHECKING:  # (for type checkers and editors: the same names, imported eagerly)
    from lightning_scale.callback import ScaleMonitor
    from lightning_scale.capture import Capture, CaptureError, DeepTracer, capture
    from lightning_scale.capture.interpreter import ScalePair, ScaleTrackingInterpreter
    from lightning_scale.capture.recipe_check import check_recipe
    from lightning_scale.record.recorder import Recorder, recording
    from lightning_scale.record.stats.table import Statistic
    from lightning_scale.tools.analyse import analyse_module, records_table
    from lightning_scale.tools.coord_check import coord_check

#: Each public name -> the module that defines it.
_WHERE: Dict[str, str] = {
    "Capture": "lightning_scale.capture",
    "CaptureError": "lightning_scale.capture",
    "DeepTracer": "lightning_scale.capture",
    "Recorder": "lightning_scale.record.recorder",
    "ScaleMonitor": "lightning_scale.callback",
    "ScalePair": "lightning_scale.capture.interpreter",
    "ScaleTrackingInterpreter": "lightning_scale.capture.interpreter",
    "Statistic": "lightning_scale.record.stats.table",
    "analyse_module": "lightning_scale.tools.analyse",
    "capture": "lightning_scale.capture",
    "check_recipe": "lightning_scale.capture.recipe_check",
    "coord_check": "lightning_scale.tools.coord_check",
    "recording": "lightning_scale.record.recorder",
    "records_table": "lightning_scale.tools.analyse",
}

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
assert sorted(_WHERE) == __all__


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'lightning_scale' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # (looked up once)
    return value


def __dir__() -> list:
    return sorted([*globals(), *_WHERE])


class _Package(types.ModuleType):
    """A public name is its object: importing a submodule of the same name (the subpackage
    ``lightning_scale.capture``, which the callback imports; the module alias
    ``lightning_scale.coord_check``) binds nothing over it, so ``from lightning_scale import
    capture`` gives the function in any import order."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
