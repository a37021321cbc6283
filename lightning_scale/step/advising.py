"""The precision advisor on tracked steps (``ScaleMonitor(advise=True)``), and the recipe
check at fit start (``ScaleMonitor(recipe=path)``).

On each tracked training step a ``GemmRecorder`` (``record.gemm_recorder``) is attached to
the step's ``Recorder``: the captured graphs' GEMMs of known weights feed it. After the
step every rank pools it and rank zero writes it (``report.advice``). At fit start, a
recipe given is checked against the model as it trains (``capture.recipe_check``), with one
warning naming the layers that contradict it. Nothing here imports Lightning.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lightning_scale.capture.recipe_check import contradictions, load_recipe
from lightning_scale.record import gemm_recorder
from lightning_scale.record.recorder import Recorder
from lightning_scale.report.advice import AdviceWriter, LayerTable
from lightning_scale.report.worker import Worker

__all__ = ["Advising"]


class Advising:
    """What ``advise`` and ``recipe`` add to a fit.

    Args:
        enabled: measure the GEMM what-ifs on tracked training steps.
        recipe: a ``recipe.json`` to check the model against at fit start (read and checked here).
        warn: how to warn (rank zero only).
        max_log_bytes: the byte cap of the advisor's event files per run.

    Raises:
        ValueError: ``recipe`` is not a recipe file (the message names ``recipe``).
    """

    def __init__(
        self, enabled: bool, recipe: Optional[str], warn: Callable[[str], None], max_log_bytes: Optional[int] = None
    ) -> None:
        self.enabled, self.warn = enabled, warn
        self.recipe_path = recipe
        self.recipe = load_recipe(recipe) if recipe is not None else None
        self.writer = AdviceWriter(warn, max_log_bytes)
        self._table: Optional[LayerTable] = None
        self._root: Optional[nn.Module] = None

    def check_model(self, root: nn.Module) -> None:
        """Warn once, naming them, about the layers of ``root`` that contradict the recipe.

        Raises:
            ValueError: the recipe is of another model.
        """
        if self.recipe is None:
            return
        found = contradictions(root, self.recipe, f"`recipe` ({self.recipe_path!r})")
        if found:
            shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
            self.warn(f"ScaleMonitor: the model does not follow `recipe` ({self.recipe_path}): {shown}")

    def begin(self, rec: Recorder, root: nn.Module, submodule: str, training: bool) -> None:
        """Attach a ``GemmRecorder`` of ``root``'s weights to ``rec`` on a tracked ``training`` step."""
        if not self.enabled or not training:
            return
        if self._table is None or self._root is not root:
            self._table, self._root = LayerTable.of(root, submodule), root
        table = self._table
        gemm_recorder.attach(
            rec, gemm_recorder.GemmRecorder(table.ids(root), len(table.names), lambda: table.ids(root))
        )

    def publish(self, rec: Recorder, step: int, device: torch.device, loggers: Sequence[Any], worker: Worker) -> None:
        """Pool (every rank) and queue the writing (rank zero: the one with ``loggers``) of the
        step's what-ifs, if this step measured them (a training step with ``advise``)."""
        if not self.enabled or self._table is None or gemm_recorder.attached(rec) is None:
            return
        self.writer.publish(
            step, self._table, gemm_recorder.attached(rec), device=device, loggers=loggers, worker=worker
        )

    def close(self, worker: Worker) -> None:
        """Close the advisor's event files after every queued write."""
        self.writer.close(worker)
