"""Records of many short host tensors at once: biases, norms' weights, their gradients.

On the host path a short tensor's record costs 10-50 us of call overhead (a dozen torch
and numpy calls on a few hundred elements), far more than reading its data; a GPT has
dozens of them per direction. ``ShortRecords`` takes a float32 copy of each when it is
observed (so later in-place ops cannot change what is recorded) and computes every
record of the step in one set of numpy reductions over their concatenation: moments in
float64 by two passes (each mean first, then the squared deviations from it: no
cancellation, and float32 data can neither overflow nor underflow there), absmax, and the
zeros / min_nonzero / format counts from one sorted search and one histogram over the
format bounds (``stats.formats``), and each user statistic's elementwise functions applied to
the concatenation (elementwise: the same values as on each tensor) and summed or maxed per
tensor. It is an acceleration of the reference (``stats.reference``): the fields mean what
``stats.record_of``'s do, with the same NaN/Inf conventions. The groups that depend on a
tensor as a whole (the block what-ifs, kurtosis) are taken from each tensor when it is added
(``stats.accelerate``: the host kernel's calls, a few microseconds each; else the reference),
and kept through ``flush``. Nothing here imports Lightning.
"""

from __future__ import annotations

import math
from typing import Collection, List, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats import formats, reference, run_table, table
from lightning_scale.record.stats.fields import FORMAT_COUNTS_SPAN

__all__ = ["MAX_ELEMENTS", "ShortRecords", "batchable", "records_of_many"]

#: Tensors up to this many elements are batched (above, one pass per statistic is cheaper).
MAX_ELEMENTS = 4096
_GROUPS = frozenset(("moments", "range", "formats"))  # fp8 scales each tensor by itself: not batched
_IX = stats.IX
#: Groups read from each tensor as it is added (they depend on the tensor as a whole).
_OWN = frozenset(("blocks", "kurtosis"))
#: Groups batched (``_GROUPS``, user statistics) or read from the tensor as it is added.
_TAKEN = _GROUPS | _OWN


def batchable(x: Tensor, groups: Collection[str]) -> bool:
    """Whether ``x``'s record may be computed by ``ShortRecords`` (short, not float64, on
    the host, groups that do not depend on the tensor as a whole)."""
    return (
        0 < x.numel() <= MAX_ELEMENTS
        and x.dtype != torch.float64
        and x.device.type == "cpu"
        and all(g in _TAKEN or run_table.is_user(g) for g in groups)
    )


class ShortRecords:
    """Entries (``stats.Entry`` lists) of short tensors, filled together by ``flush``.

    Args:
        groups: the statistic groups to compute (a subset of moments, range, formats, blocks,
            kurtosis: the last two from each tensor as it is added).
    """

    def __init__(self, groups: Collection[str]) -> None:
        self.groups = (frozenset(groups) & _GROUPS) | {"moments"}
        self.layout = run_table.layout(groups)
        self.user = tuple(s for s in self.layout.user if s.group in groups)
        self._own = frozenset(groups) & _OWN  # (read as each tensor is added)
        self._own_columns = [_IX[name] for g in sorted(self._own) for name in stats.GROUPS[g]]
        self._copies: List[Tensor] = []
        self._entries: List[List[stats.Entry]] = []

    def add(self, x: Tensor) -> List[stats.Entry]:
        """A float32 copy of ``x`` now; its entry list, filled in place by ``flush``."""
        x = x.detach()
        # (clone: ~2 us; .to(copy=True) and a reshape: ~6 us, paid by dozens of tensors a step)
        self._copies.append(x.clone() if x.dtype == torch.float32 else x.to(torch.float32, copy=True))
        entry: List[stats.Entry] = [math.nan] * self.layout.width
        if self._own:  # (no mean known yet: the moments kernel takes each chunk's own)
            reference.fill(x, stats.accelerate(x, self._own, entry), entry, self.layout, host=True)
        self._entries.append(entry)
        return entry

    def flush(self) -> None:
        """Fill every entry added since the last flush, and forget the copies."""
        if not self._copies:
            return
        values = torch.cat([c.reshape(-1) for c in self._copies]).numpy()
        rows = records_of_many(values, [c.numel() for c in self._copies], self.groups, self.layout, self.user)
        own = self._own_columns
        for entry, row in zip(self._entries, rows):
            kept = [entry[c] for c in own]
            entry[:] = row
            for c, value in zip(own, kept):
                entry[c] = value
        self.clear()

    def clear(self) -> None:
        self._copies.clear()
        self._entries.clear()


def records_of_many(
    values: "np.ndarray",
    sizes: List[int],
    groups: Collection[str],
    layout: run_table.Layout = stats.BASE,
    user: Sequence[table.Statistic] = (),
) -> List[List[float]]:
    """``stats.record_of`` of each of the float32 tensors laid end to end in ``values``
    (``sizes`` elements each, every size positive), as lists of floats (``layout.width``;
    the fields of ``user`` statistics too)."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    n = np.asarray(sizes, dtype=np.float64)
    out = np.full((len(sizes), layout.width), math.nan)
    for stat in user:
        _user_fields(values, starts, stat, layout, out)
    out[:, _IX["count"]] = n
    x = values.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as torch.mean
        total = np.add.reduceat(x, starts)
        mean = total / n
        dev = x - np.repeat(mean, sizes)
        m2 = np.add.reduceat(dev * dev, starts)
    if np.isfinite(total).all():  # (float64 sums of float32 values: finite iff every value is)
        nan = inf = np.zeros(len(sizes), dtype=np.int64)
    else:
        nan = np.add.reduceat(np.isnan(x), starts, dtype=np.int64)
        inf = np.add.reduceat(np.isinf(x), starts, dtype=np.int64)
    out[:, _IX["mean"]] = mean
    out[:, _IX["m2"]] = np.where((nan > 0) | (inf > 0), math.nan, m2)
    out[:, _IX["nan"]], out[:, _IX["inf"]] = nan, inf
    if not ("range" in groups or "formats" in groups):
        return out.tolist()
    a = np.abs(values)
    if "range" in groups:
        out[:, _IX["absmax"]] = np.maximum.reduceat(a, starts)  # NaN with a NaN, as aminmax
    if "formats" in groups:
        _format_fields(a, starts, sizes, nan, out)
    return out.tolist()


def _user_fields(
    values: "np.ndarray", starts: "np.ndarray", stat: table.Statistic, layout: run_table.Layout, out: "np.ndarray"
) -> None:
    """A user statistic's fields of each tensor: its functions on the concatenation (elementwise:
    each tensor's own values), summed (in float64) or maxed per tensor."""
    x = torch.from_numpy(values)
    for key, fn in stat.sums.items():
        out[:, layout.ix[f"{stat.name}.{key}"]] = np.add.reduceat(fn(x).to(torch.float64).numpy(), starts)
    for key, fn in stat.maxes.items():
        out[:, layout.ix[f"{stat.name}.{key}"]] = np.maximum.reduceat(fn(x).to(torch.float64).numpy(), starts)


def _format_fields(
    a: "np.ndarray", starts: "np.ndarray", sizes: List[int], nan: "np.ndarray", out: "np.ndarray"
) -> None:
    """zeros, min_nonzero and the format counts into ``out``, from |x| (float32)."""
    bounds = formats.BOUNDS[torch.float32][0]  # (the one definition of the boundaries)
    clean = np.where(np.isnan(a), np.float32(0), a)  # NaN joins the zeros' bucket; subtracted below
    bucket = np.searchsorted(np.asarray(bounds, dtype=np.float32), clean, side="right")
    width = len(bounds) + 1
    segment = np.repeat(np.arange(len(sizes)), sizes)
    cum = np.bincount(segment * width + bucket, minlength=len(sizes) * width).reshape(len(sizes), width).cumsum(1)
    zeros = cum[:, 0] - nan  # cum[:, k] = #{|x| < bounds[k]}: bounds[0] is the smallest positive float32
    out[:, _IX["zeros"]] = zeros
    out[:, _IX["min_nonzero"]] = np.minimum.reduceat(np.where(clean > 0, clean, np.float32(math.inf)), starts)
    out[:, FORMAT_COUNTS_SPAN] = formats.format_fields_of_cumulative(cum, torch.float32)
