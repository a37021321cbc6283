"""``lightning_scale.coord_check`` (the module) is :mod:`lightning_scale.tools.coord_check`."""

import sys

from lightning_scale.tools import coord_check as _coord_check

sys.modules[__name__] = _coord_check
