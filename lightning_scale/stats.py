"""``lightning_scale.stats`` is :mod:`lightning_scale.record.stats` (this import path is documented)."""

import sys

from lightning_scale.record import stats as _stats

sys.modules[__name__] = _stats
