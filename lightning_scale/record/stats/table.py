"""``lightning_scale.record.stats.table`` (the module) is :mod:`lightning_scale.record.table`: the
statistic table lives outside ``stats`` so that its readers import it without torch."""

import sys

from lightning_scale.record import table as _table

sys.modules[__name__] = _table
