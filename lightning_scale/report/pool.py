"""Pool statistics records across ranks with reductions: bytes per rank independent of the
world size, no padding, exact.

A tracked step pools in at most four collectives, each a fixed number of float64 entries
per node whatever the world size:

1. **Header**, ``all_reduce(MAX)`` of 8 numbers: the node count and the fingerprint of
   the labels (and of the payload's layout), each with its negation, the histogram row
   count likewise, and the highest and lowest failing rank. Equal on every rank exactly
   when ``MAX(x) == -MAX(-x)``. A mismatch or a failure raises the same error on every
   rank, before any collective whose size depends on the node count: ranks that captured
   different graphs are refused, not left waiting, without padding.
2. **Extremes**, ``all_reduce(MAX)`` (``stats.merge_extremes``): absmax, minus the
   least nonzero value, NaN flags (a NaN is sent as a count, never as a value: MAX's NaN
   handling depends on the backend), the largest finite mean and minus the least; for
   ``rank_spread`` each rank's std, its negation and minus its count; for tensors every
   rank holds whole (parameters, buffers) their forward record and its negation. A
   replicated record is one tensor when every rank sent the same (``MAX == -MAX(-)``):
   it is counted once, and so is its value histogram (the sum over ranks / world).
3. **Sums**, ``all_reduce(SUM)`` (``stats.merge_sums``): count, count x (mean - c) with
   c the midpoint of the least and largest mean of stage 2 (rounding relative to the
   means' spread, not their size), NaN/Inf/zero and format counts, FP8 sums; the value
   histograms, the caller's plain sums (sharded update sums) and rank 0's own values
   (each other rank adds zeros: exact).
4. **M2**, a second ``SUM`` (``reduce`` to the writing rank when only it needs the
   result): ``m2_i + n_i (mean_i - mean)^2`` with the merged mean of stage 3
   (``stats.deviations``); more accurate than pairwise merging
   (``benchmarks/pool_accuracy.py``).

No Python loop runs over ranks and nothing world-sized is kept. Everything stays on the
device; the pooled record, histograms and spread come to the host in one copy, on the
rank that writes (``dst``) or on every rank. The header's 64 bytes are read first: that
read decides whether the other collectives may run at all.
"""

from __future__ import annotations

import hashlib
import math
from typing import Collection, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_scale.record import stats

FORWARD = (
    0  # a record tensor's row [i, 0] is the forward record (``recorder.FORWARD``; not imported: it imports dynamo)
)

__all__ = [
    "Pooled",
    "RankFailedError",
    "RankMismatchError",
    "RankSpread",
    "fingerprint",
    "pool",
    "pool_step",
    "rank",
    "world_size",
]


class RankMismatchError(RuntimeError):
    """Ranks recorded different nodes, so their statistics cannot be pooled."""


class RankFailedError(RuntimeError):
    """A rank's statistics failed on this step; raised on every rank, so all skip it."""


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


class RankSpread(NamedTuple):
    """Each node's std over ranks (host): ``low`` and ``high`` ``[n, 2]`` are the least and
    the largest of the ranks' own stds (NaN where a rank's is NaN), ``present`` ``[n, 2]``
    whether every rank recorded the node in that direction."""

    present: Tensor
    low: Tensor
    high: Tensor


class Pooled(NamedTuple):
    """One tracked step pooled over all ranks, on the host.

    Attributes:
        records: ``[n, 2, FIELDS]``, the record of the concatenation of every rank's
            tensors (a replicated tensor counted once).
        histograms: ``[h, 2, bins]``, the sum of every rank's value histograms (a
            replicated tensor's forward histogram counted once, as its record).
        spread: the std's spread over ranks (``rank_spread``), or None.
        sums: the caller's ``sums``, added over ranks, or None.
        first: the caller's ``first`` as rank 0 sent it, or None.
    """

    records: Tensor
    histograms: Tensor
    spread: Optional[RankSpread] = None
    sums: Optional[Tensor] = None
    first: Optional[Tensor] = None


def pool(records: Tensor, labels: Sequence[str], replicated: Collection[str] = (), failed: bool = False) -> Tensor:
    """``pool_step``'s pooled records ``[n, 2, FIELDS]`` (host), without histograms, on every rank."""
    out = pool_step(records, labels, replicated=replicated, failed=failed)
    assert out is not None
    return out.records


def pool_step(
    records: Tensor,
    labels: Sequence[str],
    replicated: Collection[str] = (),
    failed: bool = False,
    histograms: Optional[Tensor] = None,
    histogram_labels: Sequence[str] = (),
    spread: bool = False,
    sums: Optional[Tensor] = None,
    first: Optional[Tensor] = None,
    dst: Optional[int] = None,
    groups: Optional[Collection[str]] = None,
) -> Optional[Pooled]:
    """Pool ``records`` ``[n, 2, FIELDS]`` and value ``histograms`` over all ranks, in at
    most four collectives and one device-to-host transfer (see the module docstring).

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
        sums: float64 numbers to add over ranks (any shape, the same on every rank).
        first: float64 numbers to take from rank 0 (any shape, the same on every rank).
        dst: the rank that gets the result; None: every rank.
        groups: the ``stats.GROUPS`` the records were computed with (the same on every
            rank): only their fields travel, the others come back NaN (not computed).
            None: every field.

    Returns:
        A ``Pooled`` on the host (the step's one device-to-host transfer), or None on a
        rank other than ``dst``.

    Raises:
        RankMismatchError: ranks sent different labels, node counts or payload layouts.
        RankFailedError: a rank passed ``failed=True``.
    """
    device = records.device
    bins = stats.LOG2_HI - stats.LOG2_LO
    hists = torch.zeros(0, 2, bins, dtype=torch.float64, device=device) if histograms is None else histograms
    given = (sums is not None, first is not None)
    extra = [t if t is not None else torch.zeros(0, dtype=torch.float64, device=device) for t in (sums, first)]
    rep = [i for i, label in enumerate(labels) if label in replicated]
    rep_of = {labels[i]: k for k, i in enumerate(rep)}  # label -> its row among the replicated
    hist_rep = [
        (j, rep_of[label]) for j, label in enumerate(histogram_labels) if label in rep_of
    ]  # (histogram row, replicated row)
    cols = _Columns.of(groups)
    layout = f"{records.shape[0]}|{hists.shape[0]}|{spread}|{tuple(extra[0].shape)}|{tuple(extra[1].shape)}|{rep}|{cols.fields}"
    print_ = fingerprint([*labels, "", *histogram_labels, "", layout])
    world = world_size()
    if world == 1:
        if failed:
            raise RankFailedError("statistics failed on rank(s) [0]")
        return _one_rank(records, hists, spread, extra, given)
    me = rank()
    _check_header(_header(records.shape[0], hists.shape[0], print_, failed, me, world, device))

    # stage 2 (MAX), 3 (SUM), 4 (SUM)
    n = records.shape[0]
    ext = stats.merge_extremes(records)[..., cols.extremes]  # (n, 2, E) of the computed fields
    rep_index = stats.index_tensor(rep, device) if rep else None
    rep_part = _replicated_part(records[..., cols.fields], rep_index)
    top = torch.cat(
        [ext.reshape(-1), _spread_part(records).reshape(-1) if spread else records.new_zeros(0), rep_part.reshape(-1)]
    )
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    ext_top, spread_top, rep_top = torch.split(top, [ext.numel(), n * 2 * _SPREAD if spread else 0, rep_part.numel()])
    ext_top = cols.extremes_of(ext_top.view(ext.shape))
    add = stats.merge_sums(records, ext_top)[..., cols.sums]  # (n, 2, A) of the computed fields
    mine = extra[1] if me == 0 else torch.zeros_like(extra[1])
    total = torch.cat([add.reshape(-1), hists.reshape(-1), extra[0].reshape(-1), mine.reshape(-1)])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    add_sum, hist_sum, sums_sum, first_sum = torch.split(
        total, [add.numel(), hists.numel(), extra[0].numel(), extra[1].numel()]
    )
    add_sum = cols.sums_of(add_sum.view(add.shape))
    dev = stats.deviations(records, ext_top, add_sum)
    _reduce(dev, dist.ReduceOp.SUM, dst)
    if dst is not None and me != dst:
        return None

    merged = stats.merged_record(add_sum, ext_top, dev)
    hist_sum = hist_sum.view(hists.shape)
    if rep_index is not None:
        same, value = _replicated_of(rep_top.view(len(rep), -1))
        value = torch.full((len(rep), len(stats.FIELDS)), math.nan, dtype=torch.float64, device=device).index_copy_(
            1, cols.field_index(device), value
        )
        fwd = merged[rep_index, FORWARD]
        merged[rep_index, FORWARD] = torch.where(same.unsqueeze(-1), value, fwd)
        if hist_rep:
            rows = stats.index_tensor([j for j, _ in hist_rep], device)
            agree = same[stats.index_tensor([k for _, k in hist_rep], device)]
            counted = hist_sum[rows, FORWARD]
            hist_sum[rows, FORWARD] = torch.where(agree.unsqueeze(-1), counted / world, counted)
    parts = [merged, hist_sum, sums_sum, first_sum]
    if spread:
        parts.append(_spread_of(spread_top.view(n, 2, _SPREAD)))
    host = torch.cat([p.reshape(-1) for p in parts]).cpu()  # the step's one device-to-host transfer
    return _unpack(host, records.shape, hists.shape, extra, given, spread)


_HEADER = 8  # n, -n, fingerprint, -fingerprint, h, -h, highest failing rank + 1, -lowest failing rank
_SPREAD = 4  # per node and direction: std, -std, NaN std (0/1), -count


class _Columns(NamedTuple):
    """Which columns of a record (``fields``), of ``stats.merge_extremes`` (``extremes``)
    and of ``stats.merge_sums`` (``sums``) a step's groups compute: only those travel."""

    fields: Tuple[int, ...]
    extremes: Tuple[int, ...]
    sums: Tuple[int, ...]

    @staticmethod
    def of(groups: Optional[Collection[str]]) -> "_Columns":
        names = set(stats.FIELDS) if groups is None else {f for g in {"moments", *groups} for f in stats.GROUPS[g]}
        fields = tuple(i for i, f in enumerate(stats.FIELDS) if f in names)
        return _Columns(fields, stats.extreme_columns(names), stats.sum_columns(names))

    def extremes_of(self, sent: Tensor) -> Tensor:
        """Every column of ``stats.EXTREMES`` from those sent: a field not computed is NaN (flag 1)."""
        full = torch.full((*sent.shape[:-1], len(stats.EXTREMES)), -math.inf, dtype=sent.dtype, device=sent.device)
        full[..., list(stats.EXTREME_NAN_FLAGS)] = 1.0
        full[..., list(self.extremes)] = sent
        return full

    def sums_of(self, sent: Tensor) -> Tensor:
        """All additive columns from those sent: a field not computed is NaN."""
        full = torch.full((*sent.shape[:-1], len(stats.SUMS)), math.nan, dtype=sent.dtype, device=sent.device)
        full[..., list(self.sums)] = sent
        return full

    def field_index(self, device: torch.device) -> Tensor:
        return torch.tensor(self.fields, dtype=torch.long, device=device)


def _reduce(t: Tensor, op: "dist.ReduceOp", dst: Optional[int]) -> None:
    if dst is None:
        dist.all_reduce(t, op=op)
    else:
        dist.reduce(t, dst, op=op)


def _header(n: int, h: int, print_: float, failed: bool, me: int, world: int, device: torch.device) -> Tensor:
    lowest = -float(me) if failed else -float(world)
    return torch.tensor([n, -n, print_, -print_, h, -h, me + 1.0 if failed else 0.0, lowest], dtype=torch.float64).to(
        device
    )


def _check_header(header: Tensor) -> None:
    """All-reduce the header (MAX) and raise what every rank raises alike."""
    dist.all_reduce(header, op=dist.ReduceOp.MAX)
    top = header.tolist()  # the only host read before the step's transfer: it decides whether to go on
    if top[6] > 0:
        lo, hi = int(-top[7]), int(top[6]) - 1
        which = (
            f"[{lo}]"
            if lo == hi
            else f"[{lo}, {hi}]"
            if hi == lo + 1
            else f"[{lo}, ..., {hi}] (the lowest and highest)"
        )
        raise RankFailedError(f"statistics failed on rank(s) {which}")
    differ = [
        f"{what} {int(-top[i + 1])} to {int(top[i])}"
        for i, what in ((0, "node counts"), (4, "value histogram rows"))
        if top[i] != -top[i + 1]
    ]
    if top[2] != -top[3]:
        differ.append("the fingerprints of the labels differ")
    if differ:
        raise RankMismatchError(
            f"Ranks captured different graphs ({', '.join(differ)}); every rank must run the same model code on a tracked step"
        )


def _spread_part(records: Tensor) -> Tensor:
    """``[n, 2, _SPREAD]``: this rank's std (-inf where absent or NaN), its negation, a NaN
    flag and minus the count (MAX gives minus the least count: present on every rank?)."""
    count = records[..., 0]
    std = stats.statistic(records, "std")
    ok = (count > 0) & ~std.isnan()
    low = torch.full_like(std, -math.inf)
    return torch.stack(
        [torch.where(ok, std, low), torch.where(ok, -std, low), ((count > 0) & std.isnan()).double(), -count], -1
    )


def _spread_of(top: Tensor) -> Tensor:
    """``[n, 2, 3]``: present (0/1), least std, largest std, from MAX of ``_spread_part``."""
    nan = top[..., 2] > 0
    present = top[..., 3] < 0
    low = torch.where(nan, math.nan, -top[..., 1])
    high = torch.where(nan, math.nan, top[..., 0])
    return torch.stack([present.double(), low, high], -1)


def _replicated_part(records: Tensor, index: Optional[Tensor]) -> Tensor:
    """``[r, 2 F + 2]``: the forward records (``F`` fields) of replicated rows without NaN,
    their negation, and the NaN fields as a bit mask, with its negation."""
    if index is None:
        return records.new_zeros(0)
    fwd = records[index, FORWARD]  # (r, F)
    nan = fwd.isnan()
    value = torch.where(nan, 0.0, fwd)
    bits = 2.0 ** torch.arange(fwd.shape[-1], dtype=torch.float64, device=fwd.device)
    mask = (nan.double() * bits).sum(-1, keepdim=True)  # exact: F < 53
    return torch.cat([value, -value, mask, -mask], -1)


def _replicated_of(top: Tensor) -> Tuple[Tensor, Tensor]:
    """(every rank sent the same record ``[r]``, that record ``[r, F]``) from MAX of
    ``_replicated_part``."""
    f = (top.shape[-1] - 2) // 2
    value, neg, mask, neg_mask = top[:, :f], top[:, f : 2 * f], top[:, 2 * f], top[:, 2 * f + 1]
    same = (value == -neg).all(-1) & (mask == -neg_mask)
    bits = (mask.long().unsqueeze(-1) >> torch.arange(f, device=top.device)) & 1
    return same, torch.where(bits.bool(), math.nan, value)


def _one_rank(records: Tensor, hists: Tensor, spread: bool, extra: List[Tensor], given: Tuple[bool, bool]) -> Pooled:
    parts = [records, hists, *extra]
    host = torch.cat([p.reshape(-1) for p in parts]).cpu()  # the step's one device-to-host transfer
    out = _unpack(host, records.shape, hists.shape, extra, given, False)
    if not spread:
        return out
    std = stats.statistic(out.records, "std")
    return out._replace(spread=RankSpread(out.records[..., 0] > 0, std, std))


def _unpack(
    host: Tensor, shape: torch.Size, hist_shape: torch.Size, extra: List[Tensor], given: Tuple[bool, bool], spread: bool
) -> Pooled:
    n = shape[0]
    sizes = [shape.numel(), hist_shape.numel(), extra[0].numel(), extra[1].numel(), n * 2 * 3 if spread else 0]
    records, hists, sums, first, spread_t = torch.split(host, sizes)
    rank_spread = None
    if spread:
        s = spread_t.view(n, 2, 3)
        rank_spread = RankSpread(s[..., 0] > 0, s[..., 1], s[..., 2])
    return Pooled(
        records.view(shape),
        hists.view(hist_shape),
        rank_spread,
        sums.view(extra[0].shape) if given[0] else None,
        first.view(extra[1].shape) if given[1] else None,
    )


def collective_bytes(
    records: int,
    histograms: int = 0,
    replicated: int = 0,
    spread: bool = False,
    sums: int = 0,
    first: int = 0,
    groups: Optional[Collection[str]] = None,
) -> Dict[str, int]:
    """Bytes each rank sends into each collective of ``pool_step`` (and receives back),
    from the number of records, histogram rows and replicated rows: none depends on the
    world size."""
    cols = _Columns.of(groups)
    bins = stats.LOG2_HI - stats.LOG2_LO
    return {
        "header (MAX)": 8 * _HEADER,
        "extremes (MAX)": 8
        * (records * 2 * (len(cols.extremes) + (_SPREAD if spread else 0)) + replicated * (2 * len(cols.fields) + 2)),
        "sums (SUM)": 8 * (records * 2 * len(cols.sums) + histograms * 2 * bins + sums + first),
        "m2 (SUM)": 8 * records * 2,
    }


# ---- update rows (``updates.row_of``): a whole parameter's row is rank 0's, a sharded one's adds up

_WEIGHT, _GRAD = 0, 1


def update_parts(rows: Tensor, sharded: Sequence[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """Split update rows ``[k, 2, FIELDS]`` for ``pool_step``: (records of the sharded
    parameters' gradient moments ``[s, 2, FIELDS]`` (weight direction empty), to pool as
    records; their weight sums ``[s, 3]``, to add; the whole parameters' rows ``[w, 2, 3]``,
    to take from rank 0)."""
    split = [i for i, shard in enumerate(sharded) if shard]
    whole = [i for i, shard in enumerate(sharded) if not shard]
    s_index, w_index = stats.index_tensor(split, rows.device), stats.index_tensor(whole, rows.device)
    grads = rows[s_index].clone()
    grads[:, _WEIGHT] = 0.0
    return grads, rows[s_index, _WEIGHT, :3], rows[w_index, :, :3]


def pooled_updates(sharded: Sequence[bool], grads: Tensor, sums: Tensor, first: Tensor) -> Tensor:
    """The pooled update rows ``[k, 2, FIELDS]`` (host) from ``update_parts``' pieces pooled."""
    out = torch.zeros(len(sharded), 2, len(stats.FIELDS), dtype=torch.float64)
    split = torch.tensor([i for i, shard in enumerate(sharded) if shard], dtype=torch.long)
    whole = torch.tensor([i for i, shard in enumerate(sharded) if not shard], dtype=torch.long)
    out[whole, :, :3] = first.view(-1, 2, 3)
    out[split, _WEIGHT, :3] = sums.view(-1, 3)
    out[split, _GRAD, :3] = grads.view(-1, 2, len(stats.FIELDS))[:, _GRAD, :3]
    return out


def merge_updates(per_rank: Tensor, sharded: Sequence[bool]) -> Tensor:
    """``pool_step``'s pooling of update rows ``[world, k, 2, FIELDS]`` in one process:
    rank 0's row for a whole parameter, sums and merged gradient moments for a sharded one."""
    split = torch.tensor([i for i, shard in enumerate(sharded) if shard], dtype=torch.long)
    whole = torch.tensor([i for i, shard in enumerate(sharded) if not shard], dtype=torch.long)
    grads = per_rank[:, split].clone()  # (world, s, 2, FIELDS)
    grads[:, :, _WEIGHT] = 0.0
    return pooled_updates(
        sharded, stats.merge_rows(grads), per_rank[:, split, _WEIGHT, :3].sum(0), per_rank[0, whole, :, :3]
    )
