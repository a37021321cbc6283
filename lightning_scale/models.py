"""``lightning_scale.models`` is :mod:`lightning_scale.tools.models` (the demo GPT)."""

import sys

from lightning_scale.tools import models as _models

sys.modules[__name__] = _models
