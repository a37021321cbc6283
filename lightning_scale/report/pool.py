"""Pool statistics records across ranks with reductions: bytes per rank independent of the
world size, no padding, exact.

A tracked step travels as named segments: the node records ``[n, 2, FIELDS]``, their value
histograms, and optionally the optimizer step's update statistics (``UpdateStats``:
``update_pool`` cuts them into record rows, sums and rank 0's rows) and the loss scale
(rank 0's). ``pool_step`` returns them pooled under the same names (``Pooled``). It pools
in at most four collectives, each a fixed number of float64 entries per node whatever the
world size:

1. **Header**, ``all_reduce(MAX)`` of 8 numbers (``Header``): the row count, the
   fingerprint of the labels (and of the payload's layout) and the histogram row count,
   each sent with its negation (equal on every rank exactly when ``MAX(x) == -MAX(-x)``),
   and the highest and lowest failing rank. A failure raises the same error on every
   rank, before any collective whose size depends on the node count.
   When the labels differ (a rank's forward took another branch), ``strict`` raises
   ``RankMismatchError`` on every rank; otherwise the ranks agree on the labels they all
   share (``shared_labels``: exact, only on this rare path, bytes per rank independent
   of the world size) and pool those alone, after a second header; what is not shared is
   not pooled, and ``Pooled.unshared`` says what (rank 0 names the first ones).
2. **Extremes**, ``all_reduce(MAX)`` (``stats.merge_extremes``): absmax, minus the
   least nonzero value, NaN flags (a NaN is sent as a count, never as a value: MAX's NaN
   handling depends on the backend), the largest finite mean and minus the least; for
   ``rank_spread`` each rank's std, its negation and minus its count; for tensors every
   rank holds whole (parameters, buffers) their forward record and its negation. A
   replicated record is one tensor when every rank sent the same (``MAX == -MAX(-)``):
   it is counted once, and so is its value histogram (the sum over ranks / world).
   The ``channels`` segment (``stats.channels``: per node and direction a channel row that
   merges by a max) rides in this collective as it is: no collective of its own.
3. **Sums**, ``all_reduce(SUM)`` (``stats.merge_sums``): count, count x (mean - c) with
   c the midpoint of the least and largest mean of stage 2 (rounding relative to the
   means' spread, not their size), NaN/Inf/zero and format counts, FP8 sums; the value
   histograms, the sharded parameters' update sums and rank 0's own values (whole
   parameters' update rows, the loss scale: each other rank adds zeros, exact).
4. **M2**, a second ``SUM`` (``reduce`` to the writing rank when only it needs the
   result): ``m2_i + n_i (mean_i - mean)^2`` with the merged mean of stage 3
   (``stats.deviations``); more accurate than pairwise merging
   (``benchmarks/pool_accuracy.py``).

No Python loop runs over ranks and nothing world-sized is kept. Everything stays on the
device; the pooled record, histograms, update rows, loss scale and spread come to the host
in one copy, on the rank that writes (``dst``) or on every rank. The header's 64 bytes are
read first: that read decides whether the other collectives may run at all.
"""

from __future__ import annotations

import hashlib
from typing import Collection, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale.record import stats
from lightning_scale.record.stats.channels import CHANNEL_WIDTH
from lightning_scale.record.updates import USED, UpdateStats
from lightning_scale.report import update_pool
from lightning_scale.report.columns import Columns
from lightning_scale.report.pool_header import (
    Header,
    RankFailedError,
    RankMismatchError,
    exchange_header,
    mismatch_error,
)
from lightning_scale.report.rank_spread import SPREAD, RankSpread, spread_of, spread_part
from lightning_scale.report.replicated import count_once, replicated_part
from lightning_scale.report.shared_labels import Unshared, shared_labels

__all__ = [
    "Pooled",
    "RankFailedError",
    "RankMismatchError",
    "RankSpread",
    "collective_bytes",
    "fingerprint",
    "pool",
    "pool_step",
    "rank",
    "world_size",
]


def world_size() -> int:
    """The default process group's size, 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def fingerprint(labels: Sequence[str]) -> float:
    """A 48-bit hash of the ordered labels, exact in float64."""
    digest = hashlib.sha1("\n".join(labels).encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))


class Pooled(NamedTuple):
    """One tracked step pooled over all ranks, on the host.

    Attributes:
        records: ``[n, 2, FIELDS]``, the record of the concatenation of every rank's
            tensors (a replicated tensor counted once), one row per label of ``labels``.
        histograms: ``[h, 2, bins]``, the sum of every rank's value histograms (a
            replicated tensor's forward histogram counted once, as its record), one row
            per label of ``histogram_labels``.
        labels: the labels pooled: the caller's, or where ranks captured different graphs
            those every rank has, in rank 0's order.
        histogram_labels: the histogram labels pooled, likewise.
        spread: the std's spread over ranks (``rank_spread``), or None.
        updates: the pooled update rows ``[k, 2, FIELDS]`` of ``UpdateStats.names``, or None.
        loss_scale: rank 0's loss scale, or None.
        unshared: what the ranks did not share (not pooled), or None when they agreed.
        channels: ``[n, 2, CHANNEL_WIDTH]``, the max of every rank's channel rows
            (``stats.channels``) for ``labels``, or None when none were sent.
    """

    records: Tensor
    histograms: Tensor
    labels: List[str]
    histogram_labels: List[str]
    spread: Optional[RankSpread] = None
    updates: Optional[Tensor] = None
    loss_scale: Optional[float] = None
    unshared: Optional[Unshared] = None
    channels: Optional[Tensor] = None


def pool(records: Tensor, labels: Sequence[str], replicated: Collection[str] = (), failed: bool = False) -> Tensor:
    """``pool_step``'s pooled records ``[n, 2, FIELDS]`` (host), without histograms, on every
    rank; ranks whose labels differ raise ``RankMismatchError`` (``strict``)."""
    out = pool_step(records, labels, replicated=replicated, failed=failed, strict=True)
    assert out is not None
    return out.records


def pool_step(
    records: Tensor,
    labels: Sequence[str],
    *,
    replicated: Collection[str] = (),
    failed: bool = False,
    histograms: Optional[Tensor] = None,
    histogram_labels: Sequence[str] = (),
    spread: bool = False,
    updates: Optional[UpdateStats] = None,
    loss_scale: Optional[Tensor] = None,
    dst: Optional[int] = None,
    groups: Optional[Collection[str]] = None,
    strict: bool = False,
    channels: Optional[Tensor] = None,
) -> Optional[Pooled]:
    """Pool ``records`` ``[n, 2, FIELDS]``, value ``histograms``, ``updates`` and the
    ``loss_scale`` over all ranks, in at most four collectives and one device-to-host
    transfer (see the module docstring).

    Args:
        records: this rank's records for ``labels``, on the device the collectives use.
        labels: the node labels, in the same order on every rank.
        replicated: labels of tensors every rank holds whole and equal (parameters,
            buffers). Where all ranks' forward records of one agree exactly, its pooled
            forward record (and histogram) is that one record, not a merge of ``world``
            copies. Their gradients are merged like any other: each rank's is its own.
        failed: this rank's statistics failed; ``records`` may hold anything.
        histograms: ``[h, 2, bins]`` float64 counts for ``histogram_labels`` (on the
            records' device), or None for none.
        histogram_labels: the labels of the histogram rows, the same order on every rank.
        spread: also pool each node's least and largest std over ranks (``RankSpread``).
        updates: the optimizer step's update statistics (the same parameters on every
            rank): whole parameters' rows from rank 0, sharded ones added and merged.
        loss_scale: a one-element tensor; rank 0's is returned.
        dst: the rank that gets the result; None: every rank.
        groups: the ``stats.GROUPS`` the records were computed with (the same on every
            rank): only their fields travel, the others come back NaN (not computed).
            None: every field.
        strict: ranks whose labels differ raise ``RankMismatchError``; otherwise the
            labels every rank has are pooled and ``Pooled.unshared`` names the others.
        channels: ``[n, 2, CHANNEL_WIDTH]`` channel rows of ``labels`` (``stats.channels``),
            pooled by their max in the extremes' collective; None: none.

    Returns:
        A ``Pooled`` on the host (the step's one device-to-host transfer), or None on a
        rank other than ``dst``.

    Raises:
        RankMismatchError: ranks sent different labels, node counts or payload layouts
            (labels: only with ``strict``).
        RankFailedError: a rank passed ``failed=True``.
    """

    def payload(
        rows: Tensor, names: Sequence[str], hists: Optional[Tensor], hist_names: Sequence[str], chans: Optional[Tensor]
    ) -> _Payload:
        sent = _payload(rows, names, hists, hist_names, replicated, spread, updates, loss_scale, groups)
        return sent if chans is None else _with_channels(sent, chans)

    sent = payload(records, labels, histograms, histogram_labels, channels)
    if world_size() == 1:
        if failed:
            raise RankFailedError("statistics failed on rank(s) [0]")
        return _one_rank(sent)
    differ = _exchange_header(sent, failed).differences()
    if not differ:
        return _pool_payload(sent, dst)
    if strict:
        raise mismatch_error(differ)
    shared = shared_labels(labels, histogram_labels, records.device)
    rows, hist_rows = (stats.index_tensor(r, records.device) for r in (shared.rows, shared.histogram_rows))
    hists = None if histograms is None else histograms[hist_rows]
    sent = payload(records[rows], shared.labels, hists, shared.histogram_labels, _rows(channels, rows))
    differ = _exchange_header(sent, False).differences()
    if differ:  # the labels agree now: something else differs
        raise mismatch_error(differ)
    out = _pool_payload(sent, dst)
    return None if out is None else out._replace(unshared=shared.unshared)


class _Payload(NamedTuple):
    """One rank's side of a step, in the segments the collectives carry."""

    records: Tensor  # [n + s, 2, FIELDS]: the nodes, then the sharded parameters' gradient moments
    nodes: int  # n
    hists: Tensor  # [h, 2, bins]
    sums: Tensor  # [s * USED]: the sharded parameters' weight sums, added over ranks
    first: Tensor  # [w * 2 * USED (+ 1)]: the whole parameters' update rows (, the loss scale): rank 0's
    rep: List[int]  # the rows of replicated labels
    rep_index: Optional[Tensor]  # the same on the device, None if none
    hist_rep: List[Tuple[int, int]]  # (histogram row, its row among the replicated)
    cols: "Columns"
    spread: bool
    sharded: Optional[List[bool]]  # each update row's sharded flag; None: no update statistics
    loss_scale: bool
    labels: List[str]
    histogram_labels: List[str]
    fingerprint: float
    channels: Optional[Tensor] = None  # [n, 2, CHANNEL_WIDTH], merged by a max


def _rows(t: Optional[Tensor], index: Tensor) -> Optional[Tensor]:
    return None if t is None else t[index]


def _with_channels(p: _Payload, channels: Tensor) -> _Payload:
    """``p`` with the channel segment (its shape in the fingerprint: ranks must agree on it)."""
    return p._replace(channels=channels, fingerprint=fingerprint([str(p.fingerprint), f"{tuple(channels.shape)}"]))


def _payload(
    records: Tensor,
    labels: Sequence[str],
    histograms: Optional[Tensor],
    histogram_labels: Sequence[str],
    replicated: Collection[str],
    spread: bool,
    updates: Optional[UpdateStats],
    loss_scale: Optional[Tensor],
    groups: Optional[Collection[str]],
) -> _Payload:
    device = records.device
    bins = stats.LOG2_HI - stats.LOG2_LO
    hists = torch.zeros(0, 2, bins, dtype=torch.float64, device=device) if histograms is None else histograms
    rows, sums, first = records, records.new_zeros(0), [records.new_zeros(0)]
    sharded: Optional[List[bool]] = None
    tags: List[str] = []  # the update rows' names and kinds, in the fingerprint
    if updates is not None and updates.names:
        parts = update_pool.split_updates(updates, device)
        grads = update_pool.widened(parts.grads, records.shape[-1])  # (NaN in the user statistics' columns)
        rows, sums = torch.cat([records, grads]), parts.sums.reshape(-1)  # sharded gradients merge as records
        first.append(parts.whole.reshape(-1))
        sharded, tags = list(updates.sharded), [f"{n}|{s}" for n, s in zip(updates.names, updates.sharded)]
    if loss_scale is not None:
        here = loss_scale if loss_scale.device == device else loss_scale.to(device)  # (no call that moves: no copy)
        first.append(here.reshape(1).to(torch.float64))
    whole = torch.cat(first)
    rep = [i for i, label in enumerate(labels) if label in replicated]
    rep_of = {labels[i]: k for k, i in enumerate(rep)}  # label -> its row among the replicated
    hist_rep = [(j, rep_of[label]) for j, label in enumerate(histogram_labels) if label in rep_of]
    cols = Columns.of(groups)
    layout = f"{rows.shape[0]}|{hists.shape[0]}|{spread}|{tuple(sums.shape)}|{tuple(whole.shape)}|{rep}|{cols.fields}"
    print_ = fingerprint([*labels, "", *histogram_labels, "", *tags, "", layout])
    rep_index = stats.index_tensor(rep, device) if rep else None
    return _Payload(
        rows,
        len(labels),
        hists,
        sums,
        whole,
        rep,
        rep_index,
        hist_rep,
        cols,
        spread,
        sharded,
        loss_scale is not None,
        list(labels),
        list(histogram_labels),
        print_,
    )


def _pool_payload(p: _Payload, dst: Optional[int]) -> Optional[Pooled]:
    """Stages 2 (MAX), 3 (SUM) and 4 (SUM), then the one transfer to the host."""
    ext_top, spread_top, rep_top, chan_top = _extremes(p)
    add_sum, hist_sum, sums_sum, first_sum = _sums(p, ext_top)
    dev = stats.deviations(p.records, ext_top, add_sum, p.cols.layout)[..., list(p.cols.central)].contiguous()
    _reduce(dev, dist.ReduceOp.SUM, dst)
    if dst is not None and rank() != dst:
        return None
    merged = stats.merged_record(add_sum, ext_top, p.cols.central_of(dev), p.cols.layout)
    hist_sum = hist_sum.view(p.hists.shape)
    if p.rep_index is not None:
        count_once(merged, hist_sum, rep_top, p.rep_index, p.hist_rep, p.cols.field_index(merged.device))
    parts = [merged, hist_sum, sums_sum, first_sum, chan_top]
    if p.spread:
        parts.append(spread_of(spread_top.view(-1, 2, SPREAD)))
    host = torch.cat([t.reshape(-1) for t in parts]).cpu()  # the step's one device-to-host transfer
    return _unpack(host, p)


def _extremes(p: _Payload) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stage 2, one MAX: (the six extreme columns ``[m, 2, 6]``, the spread part, the
    replicated part, the channel rows), each as every rank's largest."""
    ext = stats.merge_extremes(p.records, p.cols.layout)[..., p.cols.extremes]  # (m, 2, E) of the computed fields
    rep_part = replicated_part(p.records[..., p.cols.fields], p.rep_index)
    sent_spread = spread_part(p.records) if p.spread else p.records.new_zeros(0)
    chans = _channels(p)
    top = torch.cat([ext.reshape(-1), sent_spread.reshape(-1), rep_part.reshape(-1), chans])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    sizes = [ext.numel(), sent_spread.numel(), rep_part.numel(), chans.numel()]
    ext_top, spread_top, rep_top, chan_top = torch.split(top, sizes)
    return p.cols.extremes_of(ext_top.view(ext.shape)), spread_top, rep_top, chan_top


def _channels(p: _Payload) -> Tensor:
    return p.records.new_zeros(0) if p.channels is None else p.channels.reshape(-1)


def _sums(p: _Payload, ext_top: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Stage 3, one SUM: (the additive columns, the histograms, the update sums, rank 0's values)."""
    add = stats.merge_sums(p.records, ext_top, p.cols.layout)[..., p.cols.sums]  # (m, 2, A) of the computed fields
    mine = p.first if rank() == 0 else torch.zeros_like(p.first)
    total = torch.cat([add.reshape(-1), p.hists.reshape(-1), p.sums, mine])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    add_sum, hist_sum, sums_sum, first_sum = torch.split(
        total, [add.numel(), p.hists.numel(), p.sums.numel(), p.first.numel()]
    )
    return p.cols.sums_of(add_sum.view(add.shape)), hist_sum, sums_sum, first_sum


def _exchange_header(p: _Payload, failed: bool) -> Header:
    return exchange_header(p.records.shape[0], p.hists.shape[0], p.fingerprint, failed, p.records.device)


_HEADER = len(Header._fields)  # 8 float64: 64 bytes


def _reduce(t: Tensor, op: "dist.ReduceOp", dst: Optional[int]) -> None:
    if dst is None:
        dist.all_reduce(t, op=op)
    else:
        dist.reduce(t, dst, op=op)


def _one_rank(p: _Payload) -> Pooled:
    host = torch.cat([t.reshape(-1) for t in (p.records, p.hists, p.sums, p.first, _channels(p))]).cpu()  # one copy
    out = _unpack(host, p._replace(spread=False))
    if not p.spread:
        return out
    std = stats.statistic(out.records, "std")
    return out._replace(spread=RankSpread(out.records[..., 0] > 0, std, std))


def _unpack(host: Tensor, p: _Payload) -> Pooled:
    """The pooled segments, by name, from the host copy of ``_pool_payload``'s parts."""
    m = p.records.shape[0]
    chans = _channels(p).numel()
    sizes = [p.records.numel(), p.hists.numel(), p.sums.numel(), p.first.numel(), chans, m * 2 * 3 if p.spread else 0]
    records, hists, sums, first, chan_t, spread_t = torch.split(host, sizes)
    records = records.view(p.records.shape)
    whole, scale = torch.split(first, [first.numel() - p.loss_scale, int(p.loss_scale)])
    rank_spread = None
    if p.spread:
        s = spread_t.view(m, 2, 3)[: p.nodes]
        rank_spread = RankSpread(s[..., 0] > 0, s[..., 1], s[..., 2])
    updates = None
    if p.sharded is not None:
        updates = update_pool.pooled_updates(p.sharded, update_pool.UpdateParts(records[p.nodes :], sums, whole))
    return Pooled(
        records[: p.nodes],
        hists.view(p.hists.shape),
        p.labels,
        p.histogram_labels,
        rank_spread,
        updates,
        float(scale) if p.loss_scale else None,
        channels=None if p.channels is None else chan_t.view(p.channels.shape),
    )


def collective_bytes(
    records: int,
    histograms: int = 0,
    replicated: int = 0,
    spread: bool = False,
    groups: Optional[Collection[str]] = None,
    sharded: int = 0,
    whole: int = 0,
    loss_scale: bool = False,
    channels: int = 0,
) -> Dict[str, int]:
    """Bytes each rank sends into each collective of ``pool_step`` (and receives back),
    from the number of records, histogram rows, replicated rows, and update statistics of
    ``sharded`` and ``whole`` parameters, and ``channels`` rows of channel rows: none
    depends on the world size."""
    cols = Columns.of(groups)
    bins = stats.LOG2_HI - stats.LOG2_LO
    rows = records + sharded  # a sharded parameter's gradient moments travel as a record row
    first = whole * 2 * USED + int(loss_scale)
    return {
        "header (MAX)": 8 * _HEADER,
        "extremes (MAX)": 8
        * (rows * 2 * (len(cols.extremes) + (SPREAD if spread else 0)) + replicated * (2 * len(cols.fields) + 2))
        + 8 * channels * 2 * CHANNEL_WIDTH,
        "sums (SUM)": 8 * (rows * 2 * len(cols.sums) + histograms * 2 * bins + sharded * USED + first),
        "m2 (SUM)": 8 * rows * 2 * len(cols.central),  # (m3 and m4 too with the kurtosis group)
    }
