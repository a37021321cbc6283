"""The header of a pooled step: the first collective, 64 bytes, and the errors it raises.

Before any collective whose size depends on the node count, every rank all-reduces (MAX)
one ``Header``: its row count, its payload's fingerprint and its histogram row count, and
whether it failed. The host reads the result (the one read before the step's transfer)
and decides, alike on every rank, whether the step goes on: a failure raises
``RankFailedError`` everywhere; differing payloads are reported by ``differences`` (the
pool then raises ``RankMismatchError`` or agrees on the labels the ranks share).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

__all__ = ["Header", "RankFailedError", "RankMismatchError", "exchange_header", "mismatch_error"]


class RankMismatchError(RuntimeError):
    """Ranks recorded different nodes, so their statistics cannot be pooled."""


class RankFailedError(RuntimeError):
    """A rank's statistics failed on this step; raised on every rank, so all skip it."""


class Header(NamedTuple):
    """The header's slots, all-reduced with MAX. A number that must be the same on every
    rank is sent with its negation (``minus_...``): every rank sent the same ``x`` exactly
    when ``MAX(x) == -MAX(-x)``, and the two are its range otherwise."""

    rows: float  # record rows (nodes and sharded parameters' gradient moments)
    minus_rows: float
    fingerprint: float  # of the labels, histogram labels, update names and the layout
    minus_fingerprint: float
    histograms: float  # value histogram rows
    minus_histograms: float
    failed_above: float  # the highest failing rank + 1; 0: none failed
    minus_failed_below: float  # minus the lowest failing rank; -world: none failed

    @staticmethod
    def of(rows: int, histograms: int, fingerprint: float, failed: bool, me: int, world: int) -> "Header":
        """This rank's header."""
        n, h, f = float(rows), float(histograms), fingerprint
        return Header(n, -n, f, -f, h, -h, me + 1.0 if failed else 0.0, -float(me) if failed else -float(world))

    def agrees(self, name: str) -> bool:
        """Whether every rank sent the same value in slot ``name``."""
        return getattr(self, name) == -getattr(self, f"minus_{name}")

    def range_of(self, name: str) -> str:
        """``"least to largest"`` of slot ``name`` over ranks."""
        return f"{int(-getattr(self, f'minus_{name}'))} to {int(getattr(self, name))}"

    def failure(self) -> Optional[str]:
        """Which ranks failed, or None."""
        if self.failed_above <= 0:
            return None
        lo, hi = int(-self.minus_failed_below), int(self.failed_above) - 1
        which = (
            f"[{lo}]"
            if lo == hi
            else f"[{lo}, {hi}]"
            if hi == lo + 1
            else f"[{lo}, ..., {hi}] (the lowest and highest)"
        )
        return f"statistics failed on rank(s) {which}"

    def differences(self) -> List[str]:
        """What differs between the ranks' payloads (empty: nothing)."""
        differ = [
            f"{what} {self.range_of(name)}"
            for name, what in (("rows", "node counts"), ("histograms", "value histogram rows"))
            if not self.agrees(name)
        ]
        if not self.agrees("fingerprint"):
            differ.append("the fingerprints of the labels differ")
        return differ


def exchange_header(rows: int, histograms: int, fingerprint: float, failed: bool, device: torch.device) -> Header:
    """All-reduce this rank's header (MAX) and read it; a collective.

    Raises:
        RankFailedError: a rank failed (on every rank alike).
    """
    mine = Header.of(rows, histograms, fingerprint, failed, dist.get_rank(), dist.get_world_size())
    header = torch.tensor(mine, dtype=torch.float64).to(device)
    dist.all_reduce(header, op=dist.ReduceOp.MAX)
    top = Header(*header.tolist())  # the only host read before the step's transfer: it decides whether to go on
    failure = top.failure()
    if failure is not None:
        raise RankFailedError(failure)
    return top


def mismatch_error(differ: List[str]) -> RankMismatchError:
    """The error every rank raises for ``Header.differences``."""
    what = ", ".join(differ)
    return RankMismatchError(
        f"Ranks captured different graphs ({what}); every rank must run the same model code on a tracked step"
    )
