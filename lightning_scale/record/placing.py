"""Where a recorder's records go in ``Recorder.records``: the output rows each slot's record
answers (its key, keys that returned the same tensor, aliases), and the scatter (or merge,
for a key observed more than once in a direction) of the assembled records into them."""

from __future__ import annotations

import functools
from typing import Dict, Hashable, Iterator, List, Mapping, NamedTuple, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record import stats

__all__ = ["BlockRow", "place", "sharing", "targets"]


class BlockRow(NamedTuple):
    """A record that is row ``at`` of a recorder's row blocks (``Recorder.add_rows``, in order)."""

    at: int


@functools.lru_cache(maxsize=16)
def targets(
    own: Tuple[Hashable, ...],
    keys: Tuple[Hashable, ...],
    aliases: Tuple[Tuple[Hashable, Hashable], ...],
    same: Tuple[Tuple[int, Tuple[int, ...]], ...],
) -> Dict[int, List[int]]:
    """Slot -> output indices (in ``keys``) its records answer, for a recorder with slot keys
    ``own`` and ``_same`` items ``same`` (``Recorder._targets``; do not modify the result: it
    is shared)."""
    followers: Dict[Hashable, List[Hashable]] = {}  # key -> keys whose records are its record
    for s, sames in same:
        followers.setdefault(own[s], []).extend(own[t] for t in sames)
    for key, source in aliases:
        followers.setdefault(source, []).append(key)
    index = {k: i for i, k in enumerate(keys)}
    out: Dict[int, List[int]] = {}
    for slot, key in enumerate(own):
        found = [index[k] for k in sharing(key, followers) if k in index]
        if found:
            out[slot] = found
    return out


def sharing(key: Hashable, followers: Mapping[Hashable, List[Hashable]]) -> Iterator[Hashable]:
    """``key`` and, transitively, every key that shares its record."""
    yield key
    for follower in followers.get(key, ()):
        yield from sharing(follower, followers)


def place(flat: Tensor, assembled: Tensor, dst: Sequence[int], src: Sequence[int]) -> None:
    """Write ``assembled[src[k]]`` into ``flat[dst[k]]`` (``flat``: the output's rows, key * 2 +
    direction); rows with several records (a key observed more than once in a direction) get
    them merged (``stats.merge_rows``)."""
    if len(set(dst)) == len(dst):  # the common case, each key once per direction: one scatter
        to, at = _indices(tuple(dst), tuple(src), flat.device)
        flat[to] = assembled[at]
        return
    groups: Dict[int, List[int]] = {}
    for i, j in zip(dst, src):
        groups.setdefault(i, []).append(j)
    single = [(i, js[0]) for i, js in groups.items() if len(js) == 1]
    if single:
        one_dst, one_src = zip(*single)
        flat[stats.index_tensor(one_dst, flat.device)] = assembled[stats.index_tensor(one_src, flat.device)]
    for i, js in groups.items():
        if len(js) > 1:
            flat[i] = stats.merge_rows(assembled[stats.index_tensor(js, flat.device)])


@functools.lru_cache(maxsize=8)
def _indices(dst: Tuple[int, ...], src: Tuple[int, ...], device: torch.device) -> Tuple[Tensor, Tensor]:
    """``dst`` and ``src`` as index tensors on ``device``: made once while the placements
    repeat from step to step (do not modify them: they are shared)."""
    return stats.index_tensor(dst, device), stats.index_tensor(src, device)
