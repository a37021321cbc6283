"""Two user statistics the multi-process tests log beside the built-in ones: a sum and a max.

``mean_abs``: the mean |x| (a ``sums`` function, pooled by a sum); ``peak_sq``: the largest
x² (a ``maxes`` function, pooled by a max). Importable from the rank processes (their own
folder is on ``sys.path``) and by the dotted path ``user_statistics.MEAN_ABS``.
"""

import torch

from lightning_scale import Statistic

MEAN_ABS = Statistic(
    "mean_abs",
    sums={"abs": torch.abs},
    value=lambda s: s["abs"] / s["count"],
    axis="log2",
    worse=None,
    unscale=1,
    doc="mean |x|",
)
PEAK_SQ = Statistic("peak_sq", maxes={"sq": torch.square}, value=lambda s: s["sq"], unscale=2, doc="max x²")
