"""Kurtosis: moments rows that merge exactly across micro-batches and ranks.

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

The channel statistics (``channel_max_ratio``, ``outlier_channels``) are in ``channels``.
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
