"""The precision advisor's statistics of a tracked step: pooled over ranks, written for the
dashboard's Advice view and ``lightning-scale advise`` (format: ``dashboard.advice_log``).

Every rank pools its ``GemmRecorder``'s sums with one ``all_reduce`` (SUM) of its own, the
what-ifs' tensor and a failure flag together: every entry is a sum, so the pooled sums are
those of the global batch, exactly, whatever the world size. A rank whose what-ifs failed
makes every rank drop the step's (one warning). Global rank zero then writes the layer table
and the sums, on the reporter's writer thread, to an event file of the advisor's own in each
TensorBoard run directory (``event_file.EventFile``: a failure stops it with one warning,
never the fit). Worst cases over the tracked steps are taken by the readers, from every
step's sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_scale.capture.frames import strip_compiled
from lightning_scale.dashboard import advice_log, metadata
from lightning_scale.record.gemm_recorder import GemmRecorder
from lightning_scale.record.gemm_whatif import FIELDS, GEMMS, RECIPES
from lightning_scale.report.event_file import Budget, EventFile
from lightning_scale.report.loggers import is_tensorboard, log_dir_of
from lightning_scale.report.worker import Worker

__all__ = ["AdviceWriter", "LayerTable", "pool_gemms"]


def pool_gemms(gemms: Optional[GemmRecorder], count: int, device: torch.device) -> Optional[Tensor]:
    """Every rank's what-if sums ``[count, GEMMS, RECIPES, FIELDS]`` summed over ranks, on the
    host (every rank gets them); None if a rank's failed (on every rank alike). Collective."""
    shape = (count, len(GEMMS), len(RECIPES), len(FIELDS))
    failed = gemms is not None and gemms.error is not None
    local = gemms.sums if gemms is not None and gemms.sums is not None and not failed else None
    flat = torch.zeros(count * len(GEMMS) * len(RECIPES) * len(FIELDS) + 1, dtype=torch.float64, device=device)
    if local is not None:
        flat[:-1] = local.reshape(-1).to(device)
    flat[-1] = float(failed)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    host = flat.cpu()
    return None if host[-1] > 0 else host[:-1].reshape(shape)


@dataclass
class LayerTable:
    """The rows of the advisor's sums: every 2-D floating parameter of the LightningModule
    that may be a GEMM's weight, sorted by layer name (the same on every rank).

    A layer is named by the module that owns its weight where the weight is that module's
    ``weight`` (an ``nn.Linear``, a ``Conv1D``), else by the parameter's path; a weight tied
    to several modules takes the name of an ``nn.Linear`` among them. Compiled wrappers'
    ``_orig_mod`` is left out of every name.
    """

    names: List[str]
    modules: List[str]  # the class of the module that owns the weight
    linear: List[bool]  # that module is an nn.Linear: torchao converts it
    bias: List[bool]
    dims: List[Tuple[Optional[int], Optional[int]]]  # (K, N) of an nn.Linear (in, out features)
    submodule: str = ""

    @classmethod
    def of(cls, root: nn.Module, submodule: str = "") -> "LayerTable":
        """The table of ``root`` (the LightningModule); ``submodule``: the captured module's path."""
        owners = {name: module for name, module in _weights(root).values()}
        names = sorted(owners)
        m = [owners[n] for n in names]
        linear = [isinstance(x, nn.Linear) for x in m]
        bias = [getattr(x, "bias", None) is not None for x in m]
        dims = [(x.in_features, x.out_features) if isinstance(x, nn.Linear) else (None, None) for x in m]
        return cls(names, [type(x).__name__ for x in m], linear, bias, dims, submodule)

    def ids(self, root: nn.Module) -> Dict[int, int]:
        """``id`` of each weight parameter of ``root`` now -> its row."""
        row = {n: i for i, n in enumerate(self.names)}
        return {key: row[name] for key, (name, _) in _weights(root).items() if name in row}

    def entries(self, sums: Tensor, gemms: Optional[GemmRecorder]) -> Tuple[List[Dict[str, Any]], Tensor]:
        """The layers written (the nn.Linear ones and those seen on some rank) and their rows
        of the pooled ``sums``; how each was used and its K, N as this rank saw them."""
        seen = (sums[:, 0, 0, FIELDS.index("calls")] > 0).tolist()
        shapes = gemms.shapes if gemms is not None else {}
        keep = [i for i, name in enumerate(self.names) if self.linear[i] or seen[i]]
        out = []
        for i in keep:
            how, k, n = shapes.get(i, ("", *self.dims[i]))
            out.append(
                {"name": self.names[i], "module": self.modules[i], "linear": self.linear[i], "bias": self.bias[i]}
                | {"how": how, "k": k, "n": n}
            )
        return out, sums[keep]


def _weights(root: nn.Module) -> Dict[int, Tuple[str, nn.Module]]:
    """``id`` of each 2-D floating parameter -> (its layer name, the module that owns it)."""
    found: Dict[int, Tuple[str, nn.Module]] = {}
    for path, module in root.named_modules(remove_duplicate=False):
        for attr, p in module.named_parameters(recurse=False):
            if p.dim() != 2 or not p.is_floating_point():
                continue
            name = strip_compiled(path if attr == "weight" and path else f"{path}.{attr}".lstrip("."))
            if id(p) not in found or (isinstance(module, nn.Linear) and not isinstance(found[id(p)][1], nn.Linear)):
                found[id(p)] = (name, module)
    return found


class AdviceWriter:
    """Writes each tracked step's pooled what-ifs on rank zero, one event file of its own per
    run directory (its own byte cap: ``max_log_bytes``).

    Args:
        warn: how to warn (once per kind of failure).
        max_log_bytes: the byte cap of the advisor's event files per run (None: none).
    """

    def __init__(self, warn: Callable[[str], None], max_log_bytes: Optional[int] = None) -> None:
        self.warn, self.max_log_bytes = warn, max_log_bytes
        self._files: Dict[str, EventFile] = {}
        self._chunk = (0, metadata.CHUNK)  # (first step, steps in it) of the current tags
        self._budget = Budget(max_log_bytes)
        self._warned: Dict[str, bool] = {}

    def publish(
        self,
        step: int,
        table: LayerTable,
        gemms: Optional[GemmRecorder],
        *,
        device: torch.device,
        loggers: Sequence[Any],
        worker: Worker,
    ) -> None:
        """Pool the step's what-ifs (every rank: a collective) and queue their writing (where
        ``loggers`` holds TensorBoard loggers: rank zero)."""
        try:
            pooled = pool_gemms(gemms, len(table.names), device)
        except Exception as err:  # noqa: BLE001 - a collective that fails: the fit's own error follows
            self._warn_once("pool", f"ScaleMonitor: pooling the precision advisor's statistics failed ({err!r})")
            return
        if pooled is None:
            here = f" (here: {gemms.error!r})" if gemms is not None and gemms.error is not None else ""
            why = f"the precision advisor failed at step {step}{here}"
            self._warn_once("error", f"ScaleMonitor: {why}; its statistics are not written, training continues")
            return
        dirs = [log_dir_of(logger) for logger in loggers if is_tensorboard(logger)]
        files = [self._file(d) for d in dirs if d is not None]
        if not files:
            return
        entries, rows = table.entries(pooled, gemms)
        first, done = self._chunk if self._chunk[1] < metadata.CHUNK else (step, 0)
        self._chunk = (first, done + 1)
        job = (files, step, first, table.submodule, entries, rows)
        worker.submit(f"the precision advisor's statistics at step {step}", _write, *job)

    def close(self, worker: Worker) -> None:
        """Close this run's files after every queued write; a later step opens new ones."""
        files, self._files = list(self._files.values()), {}
        self._chunk, self._budget = (0, metadata.CHUNK), Budget(self.max_log_bytes)
        if files:
            worker.submit("closing the precision advisor's event files", _close, files)

    def _file(self, log_dir: str) -> EventFile:
        if log_dir not in self._files:
            self._files[log_dir] = EventFile(log_dir, self.warn, self._budget)
        return self._files[log_dir]

    def _warn_once(self, key: str, message: str) -> None:
        if not self._warned.get(key):
            self._warned[key] = True
            self.warn(message)


def _write(
    files: List[EventFile], step: int, first: int, submodule: str, layers: List[Dict[str, Any]], rows: Tensor
) -> None:
    tables = advice_log.layers_summary(advice_log.chunk_tag(advice_log.LAYERS_TAG, first), layers, submodule)
    sums = advice_log.gemms_summary(advice_log.chunk_tag(advice_log.GEMMS_TAG, first), rows.numpy())
    for file in files:
        file.add_summary(tables, step)
        file.add_summary(sums, step)
        file.flush()


def _close(files: List[EventFile]) -> None:
    for file in files:
        file.close()
