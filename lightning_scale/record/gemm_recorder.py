"""GemmRecorder: one tracked step's GEMM what-ifs (``gemm_whatif``) of every linear layer.

Captured graphs call ``observe_gemm(out, x, w, how)`` after each ``F.linear`` / matmul
(``capture.gemm_sites``). Where a ``GemmRecorder`` is attached to the active ``Recorder``
(``attach``: ``ScaleMonitor(advise=True)`` on tracked steps) and ``w`` is one of the
weights it knows (a parameter, by identity), it adds the forward GEMM's what-if rows at once
and hooks ``out``'s gradient for the two backward GEMMs. Everything stays on the device in
one float64 tensor ``[layers, len(GEMMS), len(RECIPES), len(FIELDS)]``, every entry a sum.
A failure is kept in ``error`` and never reaches the model. Without an attached recorder
``observe_gemm`` returns at once.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

import torch
from torch import Tensor

from lightning_scale.record import recorder
from lightning_scale.record.gemm_whatif import FIELDS, GEMMS, RECIPES, backward_rows, forward_rows

__all__ = ["GemmRecorder", "attach", "attached", "observe_gemm"]

#: the GEMM recorder of each active ``Recorder`` (weakly: a step's recorder dies with it)
_ATTACHED: "weakref.WeakKeyDictionary[recorder.Recorder, GemmRecorder]" = weakref.WeakKeyDictionary()


class GemmRecorder:
    """The GEMM what-ifs of the layers whose weights ``rows`` names, for one step.

    Args:
        rows: ``id`` of each weight parameter -> its layer's row.
        count: the number of rows.
        refresh: called when a parameter not in ``rows`` is seen, once per such parameter and
            step (FSDP swaps in each unit's unsharded parameters as its forward starts); returns
            the rows anew.

    Attributes:
        sums: ``[count, len(GEMMS), len(RECIPES), len(FIELDS)]`` float64, None until a GEMM is seen.
        shapes: row -> (how the weight is used: ``"linear"`` or ``"matmul"``, K, N) as seen.
        error: the first failure (the step's what-ifs are then dropped by every rank).
    """

    def __init__(
        self, rows: Mapping[int, int], count: int, refresh: Optional[Callable[[], Mapping[int, int]]] = None
    ) -> None:
        self.rows, self.count, self.refresh = rows, count, refresh
        self.sums: Optional[Tensor] = None
        self.shapes: Dict[int, Tuple[str, int, int]] = {}
        self.error: Optional[BaseException] = None
        self._refreshed_for: Set[int] = set()  # (parameters that asked for a refresh this step)
        self._first = frozenset(rows)  # (the parameters known from the start: not swapped in)

    def row_of(self, w: Tensor) -> Optional[int]:
        """The row of weight ``w`` (None: not a known weight)."""
        row = self.rows.get(id(w))
        if row is None and self.refresh is not None and isinstance(w, torch.nn.Parameter):
            if id(w) in self._refreshed_for:
                return None
            self._refreshed_for.add(id(w))
            self.rows = self.refresh()
            row = self.rows.get(id(w))
        return row

    def observe(self, out: Tensor, x: Tensor, w: Tensor, how: str) -> None:
        """A GEMM ``out = x @ w^T`` (``how="linear"``, ``w [N, K]``) or ``x @ w``
        (``"matmul"``, ``w [K, N]``) of a known weight: its forward rows now, a hook for the rest."""
        row = self.row_of(w)
        if row is None or w.dim() != 2 or x.dim() < 1 or _distributed(x, w):
            return
        w_nk = w if how == "linear" else w.t()
        x2 = x.detach().reshape(-1, x.shape[-1])
        if out.dtype != x2.dtype and out.dtype in (torch.bfloat16, torch.float16):
            x2 = x2.to(out.dtype)  # (autocast: the input the GEMM took; torchao casts it so too)
        w_nk = w_nk.detach()
        if id(w) not in self._first and out.requires_grad:
            w_nk = w_nk.clone()  # (a swapped-in weight, FSDP's: its storage is freed after forward)
        self.shapes.setdefault(row, (how, w_nk.shape[1], w_nk.shape[0]))
        self._add(row, 0, forward_rows(x2, w_nk))
        if out.requires_grad and torch.is_grad_enabled():
            out.register_hook(functools.partial(self._on_grad, row, x2, w_nk, w.requires_grad))

    def _on_grad(self, row: int, x2: Tensor, w_nk: Tensor, weight_grad: bool, grad: Tensor) -> None:
        if self.error is not None:
            return
        try:
            rows = backward_rows(x2, w_nk, grad.reshape(-1, w_nk.shape[0]), weight_grad)
            self._add(row, 1, rows[0])
            if weight_grad:
                self._add(row, 2, rows[1])
        except Exception as err:  # noqa: BLE001 - never break the user's backward
            self.error = err

    def _add(self, row: int, gemm: int, rows: Tensor) -> None:
        if self.sums is None:
            shape = (self.count, len(GEMMS), len(RECIPES), len(FIELDS))
            self.sums = torch.zeros(shape, dtype=torch.float64, device=rows.device)
        self.sums[row, gemm] += rows


def _distributed(*tensors: Tensor) -> bool:
    """A DTensor operand (tensor parallelism): its local GEMM is not the layer's."""
    return any(type(t).__name__ == "DTensor" for t in tensors)


def attach(rec: "recorder.Recorder", gemms: GemmRecorder) -> None:
    """Route ``observe_gemm`` calls made while ``rec`` is active to ``gemms``."""
    _ATTACHED[rec] = gemms


def attached(rec: "recorder.Recorder") -> Optional[GemmRecorder]:
    """The ``GemmRecorder`` attached to ``rec``, if any."""
    return _ATTACHED.get(rec)


@torch.compiler.disable
def observe_gemm(out: Any, x: Any, w: Any, how: str) -> None:
    """Called by captured graphs after each GEMM node: the attached ``GemmRecorder`` of the
    active recorder, if any, takes it. Opaque to TorchDynamo; never raises."""
    rec = recorder.active()
    gemms = _ATTACHED.get(rec) if rec is not None else None
    if gemms is None or gemms.error is not None:
        return
    if not (isinstance(out, Tensor) and isinstance(x, Tensor) and isinstance(w, Tensor)) or not x.is_floating_point():
        return
    try:
        gemms.observe(out, x, w, how)
    except Exception as err:  # noqa: BLE001 - never break the user's forward
        gemms.error = err
