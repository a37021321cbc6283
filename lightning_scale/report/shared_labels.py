"""The labels every rank shares, agreed on when ranks captured different graphs.

``pool.pool_step`` takes this path only when the header says the ranks' labels differ (a
rank's forward took another branch on a tracked step); the common path never runs it.
The agreement is exact (labels compared as strings, no hashing), in three or four
collectives whose bytes per rank do not depend on the world size:

1. rank 0 **broadcasts** its node and histogram labels (their length, then their UTF-8
   bytes): every rank receives rank 0's labels, whatever the number of ranks;
2. every rank marks which of rank 0's labels it has (1 or 0, one number per label of rank
   0), adds minus the number of its own labels rank 0 lacks and its rank if it has any
   (the world size otherwise), and these are **all-reduced with MIN**: a label of rank 0
   is on every rank exactly when its MIN is 1 (the intersection, in rank 0's order); the
   other two give the most labels any rank has beyond rank 0's and the lowest such rank;
3. only when some rank has labels rank 0 lacks: that lowest rank **broadcasts** its first
   few of them in a fixed ``EXAMPLE_BYTES`` buffer, so rank 0's warning can name them.

Each rank then pools its rows of the shared labels, in rank 0's order; what is not shared
is not pooled (nor written).
"""

from __future__ import annotations

import json
from typing import Dict, List, NamedTuple, Sequence

import torch
import torch.distributed as dist

__all__ = ["EXAMPLE_BYTES", "Shared", "Unshared", "shared_labels"]

EXAMPLE_BYTES = 512  # the fixed size of the buffer naming a rank's first labels rank 0 lacks
_EXAMPLES = 3  # the most labels named in a warning, per side


class Unshared(NamedTuple):
    """What the ranks do not share (the same on every rank).

    Attributes:
        shared: how many nodes every rank has (those pooled).
        here: rank 0's node labels that some rank lacks.
        elsewhere: the most node labels any rank has that rank 0 lacks.
        examples: the first few of those, from the lowest rank that has any.
    """

    shared: int
    here: List[str]
    elsewhere: int
    examples: List[str]

    def describe(self) -> str:
        """One sentence naming the first differing nodes and how many."""
        parts = []
        if self.here:
            parts.append(f"{len(self.here)} of rank 0's nodes are not on every rank ({_names(self.here)})")
        if self.elsewhere:
            parts.append(f"a rank has {self.elsewhere} node(s) rank 0 has not ({_names(self.examples)})")
        if not parts:  # the same nodes in another order, or other value histogram labels
            parts.append("the same nodes, in another order or with other value histograms")
        shared = f"only the {self.shared} nodes every rank has are logged"
        return f"ranks captured different graphs: {'; '.join(parts)}; {shared}"


class Shared(NamedTuple):
    """The labels every rank has, in rank 0's order, and this rank's rows of them."""

    labels: List[str]
    rows: List[int]
    histogram_labels: List[str]
    histogram_rows: List[int]
    unshared: Unshared


def shared_labels(labels: Sequence[str], histogram_labels: Sequence[str], device: torch.device) -> Shared:
    """Agree with every rank on the labels (and histogram labels) all of them have; see the
    module docstring. A collective: every rank calls it."""
    zero_labels, zero_hists = json.loads(_broadcast_text(json.dumps([list(labels), list(histogram_labels)]), device))
    mine, my_hists = _positions(labels), _positions(histogram_labels)
    theirs = set(zero_labels)
    extra = [label for label in labels if label not in theirs]
    me = dist.get_rank()
    marks = [float(label in mine) for label in zero_labels] + [float(label in my_hists) for label in zero_hists]
    vote = torch.tensor(
        [*marks, -float(len(extra)), float(me if extra else dist.get_world_size())], dtype=torch.float64
    )
    vote = vote.to(device)
    dist.all_reduce(vote, op=dist.ReduceOp.MIN)
    top = vote.tolist()  # (a host read on the rare path only)
    n = len(zero_labels)
    keep = [label for label, m in zip(zero_labels, top[:n]) if m == 1.0]
    keep_hists = [label for label, m in zip(zero_hists, top[n : n + len(zero_hists)]) if m == 1.0]
    elsewhere, lowest = int(-top[-2]), int(top[-1])
    examples = _examples(extra, lowest, device) if elsewhere else []
    shared = set(keep)
    here = [label for label in zero_labels if label not in shared]  # (every rank holds rank 0's labels)
    return Shared(
        keep,
        [mine[label] for label in keep],
        keep_hists,
        [my_hists[label] for label in keep_hists],
        Unshared(len(keep), here, elsewhere, examples),
    )


def _positions(labels: Sequence[str]) -> Dict[str, int]:
    return {label: i for i, label in enumerate(labels)}


def _broadcast_text(text: str, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank: its length, then its bytes."""
    zero = dist.get_rank() == 0
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if zero else None  # (never empty: JSON)
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buffer = data.to(device) if data is not None else torch.zeros(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, 0)
    return buffer.cpu().numpy().tobytes().decode()


def _examples(extra: List[str], lowest: int, device: torch.device) -> List[str]:
    """The first labels rank ``lowest`` has beyond rank 0's, as many as fit ``EXAMPLE_BYTES``."""
    buffer = torch.full((EXAMPLE_BYTES,), ord(" "), dtype=torch.uint8)  # JSON, padded with spaces
    if dist.get_rank() == lowest:
        encoded = _fitting(extra[:_EXAMPLES])
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, lowest)
    return json.loads(buffer.cpu().numpy().tobytes().decode())


def _fitting(labels: List[str]) -> bytes:
    """The JSON of the most leading ``labels`` (each cut to 80 characters) that fits the buffer."""
    cut = [label if len(label) <= 80 else label[:77] + "..." for label in labels]
    for k in range(len(cut), 0, -1):
        encoded = json.dumps(cut[:k]).encode()
        if len(encoded) <= EXAMPLE_BYTES:
            return encoded
    return b"[]"


def _names(labels: Sequence[str]) -> str:
    shown = ", ".join(f"`{label}`" for label in labels[:_EXAMPLES])
    return shown + (", ..." if len(labels) > _EXAMPLES else "")
