"""Outlier statistics: kurtosis, and how far a tensor's worst channel sticks out.

**Kurtosis.** ``kurtosis = E[(x - mean)^4] / var^2`` (population moments: 3 for a
Gaussian, 1.8 for a uniform), of the finite elements (the ``nan``/``inf`` counts report
the others). Kept per node: a moments row ``MOMENT_FIELDS`` = (count, mean, m2, m3, m4),
``m_k`` the sum of ``(x - mean)^k``. Rows merge exactly (the central-moment merge of
Chan et al. / Pébay 2008): ``merge_moments`` does it on stacked rows; across ranks it is
three reductions as the record's mean and m2 are pooled: a sum of ``count`` and
``count x (mean - c)`` (``c`` any common shift, e.g. the midpoint of the least and
largest mean), then a sum of ``moment_deviations(rows, merged mean)``. Each row is
computed about its chunk's own mean in float64, so a mean far above the spread loses
nothing to cancellation. The kurtosis of a row is ``count * m4 / m2^2``: NaN where
``m2`` is 0 (constant or empty).

**Channels.** A tensor's channels are the entries of its last dimension (features,
the same on every data-parallel rank); a channel's maximum is its max |x| over every
other dimension (finite elements only). ``channel_max_ratio`` is the largest channel
maximum over the median one (the mean of the two middle ones for an even count; +inf
where the median is 0 and the maximum not, NaN where both are 0); ``outlier_channels``
is the fraction of channels whose maximum exceeds ``OUTLIER`` (6, LLM.int8's threshold).
Kept per node, a ``CHANNEL_WIDTH`` row in two parts:

* merged by a max (``CHANNEL_MAX_WIDTH`` entries): the channel count, the largest
  channel maximum, and the maxima of up to ``CHANNEL_CAP`` channels one by one (``-inf``
  in unused slots). Up to the cap the merge is exact: a max over micro-batches and ranks
  is each channel's maximum over the whole step's tensor.
* merged by a sum: the count of channel maxima above ``OUTLIER`` and a histogram of the
  channel maxima in ``HIST_BINS_PER_OCTAVE`` bins an octave over ``[2^HIST_LO,
  2^HIST_HI)`` (lower maxima, 0 included, in the first bin, higher ones in the last).
  Both are zero up to the cap. Above it (more than ``CHANNEL_CAP`` channels) only this
  part and the largest maximum are kept: the median and the outlier fraction are then
  those of the channel maxima of each micro-batch and rank pooled (not of their maximum
  over micro-batches and ranks), the median read from the histogram as the geometric
  centre of the bin that holds it (the lower middle one for an even count): within a
  factor ``2^(1 / (2 * HIST_BINS_PER_OCTAVE))`` (4.4%) of it inside the histogram's range.

A row is ``CHANNEL_WIDTH`` (5,123) float64 numbers: 40 KB a node and direction.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.blocks import row_pieces

#: Fields of a moments row.
MOMENT_FIELDS: Tuple[str, ...] = ("count", "mean", "m2", "m3", "m4")
#: Elements read at a time: a few temporaries of this size (4 MB each in float32).
CHUNK = 1 << 20

#: A channel maximum above this is an outlier (LLM.int8).
OUTLIER = 6.0
#: Up to this many channels, their maxima are kept one by one.
CHANNEL_CAP = 4096
HIST_LO, HIST_HI, HIST_BINS_PER_OCTAVE = -64, 64, 8
_BINS = (HIST_HI - HIST_LO) * HIST_BINS_PER_OCTAVE
#: Entries of a channel row merged by a max (count, largest, the slots), then by a sum.
CHANNEL_MAX_WIDTH = 2 + CHANNEL_CAP
CHANNEL_WIDTH = CHANNEL_MAX_WIDTH + 1 + _BINS


# ---------------------------------------------------------------------------------------
# Kurtosis: moments rows.


def moments_row(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """The float64 moments row ``MOMENT_FIELDS`` of ``x``'s finite elements, on its device.

    ``x`` is read ``chunk`` elements at a time, each in rows of ``_ROW`` (float32; float64
    for float64 ``x``) whose moments are merged in float64 (``merge_moments``).

    Example:
        >>> float(kurtosis(moments_row(torch.tensor([1.0, 2.0, 3.0, 4.0]))))
        1.64
    """
    parts = [_chunk_moments(part.reshape(-1)) for part, _ in row_pieces(x.detach(), chunk)]
    if not parts:
        return torch.zeros(len(MOMENT_FIELDS), dtype=torch.float64, device=x.device)
    return merge_moments(torch.cat(parts))


_ROW = 4096  # elements a row: float32 row sums (pairwise) exact to ~1e-7, merged in float64


def _chunk_moments(part: Tensor) -> Tensor:
    """Moments rows ``[r, 5]`` of one chunk, a row per ``_ROW`` elements (the tail its own).

    Each row's sums of powers are taken about its own mean ``c`` of the values scaled by a
    power of two ``s`` that brings the chunk's max |x| to [1, 2) (so that fourth powers
    neither overflow nor lose precision to subnormals), then moved to the exact mean
    ``c + r`` (``r`` the mean of ``x s - c``: rounding only) and scaled back in float64.
    Non-finite elements enter as 0 and their share is taken out again.
    """
    acc = torch.float64 if part.dtype == torch.float64 else torch.float32
    finite = part.isfinite()
    y = torch.nan_to_num(part.to(acc), 0.0, 0.0, 0.0)
    top = y.abs().amax()
    s = torch.where(top > 0, torch.exp2(-torch.floor(torch.log2(top.clamp(min=torch.finfo(acc).tiny)))), 1.0)
    y.mul_(s)
    m = y.numel() // _ROW * _ROW
    pieces = [(y[:m].view(-1, _ROW), finite[:m].view(-1, _ROW))] if m else []
    if m < y.numel():
        pieces.append((y[m:].view(1, -1), finite[m:].view(1, -1)))
    rows = torch.cat([_row_moments(v, f) for v, f in pieces])
    s64 = s.double()
    return rows / torch.stack([s64**0, s64, s64**2, s64**3, s64**4])


def _row_moments(y: Tensor, finite: Tensor) -> Tensor:
    """Moments rows ``[r, 5]`` of the rows of ``y`` (scaled; non-finite entries 0, ``finite`` False)."""
    n = finite.sum(1).double()
    zeros = y.shape[1] - n  # (the non-finite entries, 0 in y)
    c = (y.sum(1).double() / n.clamp(min=1)).to(y.dtype)
    d = y - c[:, None]
    d2 = d * d
    sums = [d.sum(1), d2.sum(1), (d2 * d).sum(1), (d2 * d2).sum(1)]
    c64 = c.double()
    s1, s2, s3, s4 = (v.double() - zeros * (-c64) ** k for k, v in enumerate(sums, 1))
    r = s1 / n.clamp(min=1)
    m2 = s2 - n * r * r
    m3 = s3 - 3 * r * s2 + 2 * n * r**3
    m4 = s4 - 4 * r * s3 + 6 * r * r * s2 - 3 * n * r**4
    mean = torch.where(n > 0, c64 + r, 0.0)
    return torch.stack([n, mean, m2, m3, m4], -1)


def moment_deviations(rows: Tensor, mean: Tensor) -> Tensor:
    """``[..., 3]``: each row's (m2, m3, m4) about ``mean`` (broadcast against ``rows[..., 0]``);
    summed over rows, the merged central moments. Empty rows give zeros."""
    n = rows[..., 0]
    out = moved_moments(n, rows[..., 1] - mean, rows[..., 2], rows[..., 3], rows[..., 4])
    return torch.where((n > 0).unsqueeze(-1), out, 0.0)


def moved_moments(n: Tensor, d: Tensor, m2: Tensor, m3: Tensor, m4: Tensor) -> Tensor:
    """``[..., 3]``: sums of ``(x - mean)^k`` (k = 2, 3, 4) of ``n`` values whose own mean is
    ``mean + d`` and central moments m2, m3, m4: ``m2 + n d^2``, ``m3 + 3 d m2 + n d^3``,
    ``m4 + 4 d m3 + 6 d^2 m2 + n d^4``."""
    d2 = d * d
    return torch.stack([m2 + n * d2, m3 + d * (3 * m2 + n * d2), m4 + d * (4 * m3 + d * (6 * m2 + n * d2))], -1)


def merge_higher(
    na: Tensor, nb: Tensor, delta: Tensor, m2a: Tensor, m3a: Tensor, m4a: Tensor, m2b: Tensor, m3b: Tensor, m4b: Tensor
) -> Tuple[Tensor, Tensor]:
    """m3 and m4 of two merged sets of ``na`` and ``nb`` values (Pébay 2008, eqs. 2.1 and
    2.2), ``delta`` = b's mean - a's. NaN where both are empty (callers pick)."""
    n = na + nb
    d_n = delta / n
    m3 = m3a + m3b + delta * d_n * d_n * na * nb * (na - nb) + 3 * d_n * (na * m2b - nb * m2a)
    m4 = (
        m4a
        + m4b
        + delta * d_n**3 * na * nb * (na * na - na * nb + nb * nb)
        + 6 * d_n * d_n * (na * na * m2b + nb * nb * m2a)
        + 4 * d_n * (na * m3b - nb * m3a)
    )
    return m3, m4


def merge_moments(rows: Tensor) -> Tensor:
    """Merge moments rows ``[k, 5]`` (or ``[..., k, 5]``) into one, as if their elements were concatenated."""
    n = rows[..., 0]
    has = n > 0
    total = n.sum(-1)
    first = torch.where(has, rows[..., 1], 0.0).gather(-1, has.double().argmax(-1, keepdim=True))  # a shift
    shifted = torch.where(has, n * (rows[..., 1] - first), 0.0).sum(-1, keepdim=True)
    mean = first + shifted / total.clamp(min=1).unsqueeze(-1)
    central = moment_deviations(rows, mean).sum(-2)
    return torch.cat([total.unsqueeze(-1), torch.where(total > 0, mean.squeeze(-1), 0.0).unsqueeze(-1), central], -1)


def kurtosis(rows: Tensor) -> Tensor:
    """``count * m4 / m2^2`` of moments rows ``[..., 5]``: NaN where m2 is 0."""
    n, m2, m4 = rows[..., 0], rows[..., 2], rows[..., 4]
    return torch.where(m2 > 0, n * m4 / (m2 * m2), math.nan)


# ---------------------------------------------------------------------------------------
# Channels: per-channel maxima, kept one by one up to the cap, else as a histogram.


def channel_maxima(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """float64 ``[C]``: each last-dimension channel's max |x| over the finite elements (0 where none)."""
    x = x.detach()
    c = x.shape[-1] if x.dim() else 1
    out = torch.zeros(c, dtype=torch.float64, device=x.device)
    for part, j in row_pieces(x, chunk):
        a = torch.nan_to_num(part.abs(), nan=0.0, posinf=0.0).amax(0).double()
        out[j : j + a.numel()] = torch.maximum(out[j : j + a.numel()], a)
    return out


def channel_row(x: Tensor, chunk: int = CHUNK) -> Tensor:
    """The float64 ``CHANNEL_WIDTH`` row of ``x`` (see the module docstring), on its device."""
    maxima = channel_maxima(x, chunk)
    c = maxima.numel()
    row = torch.zeros(CHANNEL_WIDTH, dtype=torch.float64, device=maxima.device)
    row[0] = c
    row[1] = maxima.max() if c else 0.0
    row[2:CHANNEL_MAX_WIDTH] = -math.inf
    if c <= CHANNEL_CAP:
        row[2 : 2 + c] = maxima
        return row
    row[CHANNEL_MAX_WIDTH] = (maxima > OUTLIER).sum()
    row[CHANNEL_MAX_WIDTH + 1 :] = torch.bincount(_bin(maxima), minlength=_BINS).double()
    return row


def _bin(maxima: Tensor) -> Tensor:
    safe = maxima.clamp(min=2.0**HIST_LO)  # (0 in the first bin)
    i = torch.floor((torch.log2(safe) - HIST_LO) * HIST_BINS_PER_OCTAVE)
    return i.clamp(0, _BINS - 1).long()


def merge_channel_rows(rows: Tensor) -> Tensor:
    """Merge channel rows ``[k, CHANNEL_WIDTH]`` into one: the first part by a max, the rest by a sum."""
    return torch.cat([rows[:, :CHANNEL_MAX_WIDTH].amax(0), rows[:, CHANNEL_MAX_WIDTH:].sum(0)])


def channel_max_ratio(rows: Tensor) -> Tensor:
    """Largest channel maximum over the median one, of channel rows ``[..., CHANNEL_WIDTH]``."""
    top = rows[..., 1]
    median = torch.where(rows[..., 0] <= CHANNEL_CAP, _slot_median(rows), _histogram_median(rows))
    ratio = torch.where(median > 0, top / median, torch.where(top > 0, math.inf, math.nan))
    return torch.where(rows[..., 0] >= 1, ratio, math.nan)  # (no channel, or not computed: NaN)


def outlier_channels(rows: Tensor) -> Tensor:
    """The fraction of channels whose maximum exceeds ``OUTLIER``, of channel rows ``[..., CHANNEL_WIDTH]``."""
    slots = rows[..., 2:CHANNEL_MAX_WIDTH]
    kept = (slots > OUTLIER).sum(-1).double() / rows[..., 0].clamp(min=1)
    hist = rows[..., CHANNEL_MAX_WIDTH + 1 :].sum(-1)
    pooled = rows[..., CHANNEL_MAX_WIDTH] / hist.clamp(min=1)
    return torch.where(rows[..., 0] >= 1, torch.where(rows[..., 0] <= CHANNEL_CAP, kept, pooled), math.nan)


def _slot_median(rows: Tensor) -> Tensor:
    """The median of the kept slots (the mean of the two middle ones for an even count)."""
    s = rows[..., 2:CHANNEL_MAX_WIDTH].sort(-1).values  # unused (-inf) first
    c = torch.nan_to_num(rows[..., 0], nan=1.0).clamp(1, CHANNEL_CAP).long()
    start = CHANNEL_CAP - c
    lo = s.gather(-1, (start + (c - 1) // 2).unsqueeze(-1)).squeeze(-1)
    hi = s.gather(-1, (start + c // 2).unsqueeze(-1)).squeeze(-1)
    return lo / 2 + hi / 2


def _histogram_median(rows: Tensor) -> Tensor:
    """The geometric centre of the histogram bin that holds the (lower) middle maximum."""
    hist = torch.nan_to_num(rows[..., CHANNEL_MAX_WIDTH + 1 :])
    cum = hist.cumsum(-1)
    half = (cum[..., -1:] / 2).clamp(min=0.5)
    i = torch.searchsorted(cum.contiguous(), half.contiguous()).clamp(max=_BINS - 1).squeeze(-1)
    return torch.exp2(HIST_LO + (i.double() + 0.5) / HIST_BINS_PER_OCTAVE)
