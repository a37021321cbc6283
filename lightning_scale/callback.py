"""ScaleMonitor
^^^^^^^^^^^^

A Lightning callback that records the scale (std and other statistics) of every
intermediate tensor of the model, forward and backward, on selected training steps, pools
it across ranks and writes it to TensorBoard. Untracked steps run the user's module
untouched. The Lightning-free parts (capture, recording, statistics, pooling, writing) live
in their own modules; this one decides *when*.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Dict, List, Literal, Optional, Tuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_scale import distributed, stats
from lightning_scale.capture import CAPTURE_MODES, Capture, capture
from lightning_scale.interpreter import ScalePair
from lightning_scale.recorder import BACKWARD, FORWARD, Recorder, recording
from lightning_scale.report import annotate_code
from lightning_scale.schedule import Schedule
from lightning_scale.tensorboard import ScaleWriter

__all__ = ["ScaleMonitor"]

_MISSING = object()
_DYNAMO_ROWS = 4096  # fixed payload rows when ranks cannot agree on a node count beforehand


class ScaleMonitor(Callback):
    r"""Records and logs the scale of every tensor in the model's forward and backward pass.

    Args:
        every_n_steps: track optimizer steps ``start_step, start_step + n, ...``; ``None`` for
            only ``steps``.
        steps: explicit optimizer steps to track (sorted, non-negative), in addition.
        start_step: first step that may be tracked.
        stop_step: no step at or after it is tracked.
        submodule: dotted path of the submodule to capture (default: the LightningModule's
            ``forward``).
        capture: ``"auto"`` (fx where it traces the model, TorchDynamo otherwise), ``"fx"``
            or ``"dynamo"``.
        statistics: statistics to log as scalars, from ``lightning_scale.stats.STATISTICS``
            (default ``["std"]``, logged as ``scale/``).
        include: regex; log only nodes whose label matches it.
        exclude: regex; do not log nodes whose label matches it.
        prune_views: do not log views/reshapes whose statistics equal their input's.
        max_tags: the most nodes whose scalars are written (beyond it, a warning once).
        histograms: write ``scale_hist/fwd`` and ``scale_hist/bwd``.
        figure: write the per-node scale figure (needs matplotlib).
        figure_every: draw the figure on the first tracked step and then on every n-th
            tracked step (matplotlib takes about a second for a few hundred nodes).
        code: write the captured code annotated with scales as text.
        value_histograms: regex; for matching nodes, write the histogram of log2|x| of
            the values and gradients (``values_log2/``).
        rank_spread: also log the min and max over ranks of each node's std.
        track_validation: also track the first validation batch of each validation run
            (forward only; tags prefixed ``val_``).
        unscale_gradients: divide backward statistics by the loss scale of a GradScaler
            and multiply by ``accumulate_grad_batches``, so they show the gradients of the
            unscaled, unaccumulated loss.
        leaf_modules: qualified names of submodules to keep as leaves in an fx capture.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).

    Example::

        trainer = Trainer(callbacks=[ScaleMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = 50,
        steps: Optional[List[int]] = None,
        start_step: int = 0,
        stop_step: Optional[int] = None,
        submodule: Optional[str] = None,
        capture: Literal["auto", "fx", "dynamo"] = "auto",
        statistics: Optional[List[str]] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        prune_views: bool = False,
        max_tags: int = 1000,
        histograms: bool = True,
        figure: bool = True,
        figure_every: int = 10,
        code: bool = True,
        value_histograms: Optional[str] = None,
        rank_spread: bool = False,
        track_validation: bool = False,
        unscale_gradients: bool = False,
        leaf_modules: Optional[List[str]] = None,
    ) -> None:
        self.schedule = Schedule(every_n_steps, steps, start_step, stop_step)
        if capture not in CAPTURE_MODES:
            raise ValueError(f"`capture` must be one of {list(CAPTURE_MODES)}, got {capture!r}")
        self.statistics = ["std"] if statistics is None else list(statistics)
        unknown = [s for s in self.statistics if s not in stats.STATISTICS]
        if unknown or not self.statistics:
            raise ValueError(f"`statistics` must be a non-empty list from {sorted(stats.STATISTICS)}, got {statistics!r}")
        if not isinstance(figure_every, int) or isinstance(figure_every, bool) or figure_every <= 0:
            raise ValueError(f"`figure_every` must be a positive integer, got {figure_every!r}")
        if not isinstance(max_tags, int) or max_tags <= 0:
            raise ValueError(f"`max_tags` must be a positive integer, got {max_tags!r}")
        self.include = _compile("include", include)
        self.exclude = _compile("exclude", exclude)
        self.value_histograms = _compile("value_histograms", value_histograms)
        self.submodule = submodule
        self.capture_mode = capture
        self.prune_views, self.max_tags = prune_views, max_tags
        self.histograms, self.figure, self.code = histograms, figure, code
        self.figure_every = figure_every
        self.rank_spread, self.track_validation = rank_spread, track_validation
        self.unscale_gradients = unscale_gradients
        self.leaf_modules = list(leaf_modules or [])
        self.groups = sorted({stats.STATISTICS[s] for s in self.statistics} | {"moments"})
        self.last_tracked_step = -1
        self._captures: Dict[Tuple[bool, ...], Capture] = {}
        self._active: Optional[_TrackedStep] = None
        self._disabled: Optional[str] = None
        self._warned: Dict[str, bool] = {}
        self._writers: Dict[str, ScaleWriter] = {}

    # ---- Lightning hooks ---------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        writes = stage == "fit" or (stage == "validate" and self.track_validation)
        if writes and not trainer.loggers:
            raise ValueError(
                "`ScaleMonitor` needs a logger to write to, but the Trainer has none "
                "(`Trainer(logger=False)`); pass `logger=True` (TensorBoard) or a logger instance"
            )
        self._start_run(self._setup_target(pl_module), stage)

    def _setup_target(self, pl_module: pl.LightningModule) -> nn.Module:
        try:
            return self._target(pl_module)
        except ValueError:
            # `configure_model` runs after setup and may create the submodule: check again
            # at fit start, where a path that still does not exist raises the same error.
            if type(pl_module).configure_model is not pl.LightningModule.configure_model:
                return pl_module
            raise

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._capture(self._target(pl_module), train=True, announce=True)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if self._disabled or step == self.last_tracked_step or not self.schedule.is_tracked(step):
            return
        self._begin(pl_module, step, "")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active is not None and self._active.loss_scale is None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, Tensor):
                self._active.loss_scale = scale.detach().clone().double().reshape(())

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._active is not None and self._active.prefix == "":
            self._finish(trainer, pl_module)

    @override
    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.track_validation and not self._disabled and not trainer.sanity_checking and batch_idx == 0 and dataloader_idx == 0:
            self._begin(pl_module, trainer.global_step, "val_")

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._active is not None and self._active.prefix == "val_":
            self._finish(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abort(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abort(pl_module)

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"last_tracked_step": self.last_tracked_step}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.last_tracked_step = int(state_dict.get("last_tracked_step", -1))

    def _start_run(self, target: nn.Module, stage: str) -> None:
        """Forget what belongs to the previous run: its loggers, its module's captures."""
        self._writers.clear()
        if stage == "fit":
            self.last_tracked_step = -1  # a resumed checkpoint restores it after setup
        if any(cap.module is not target for cap in self._captures.values()):
            self._captures.clear()
            self._disabled = None

    # ---- capture -------------------------------------------------------------------------

    def _target(self, pl_module: pl.LightningModule) -> nn.Module:
        return _resolve_submodule(pl_module, self.submodule) if self.submodule else pl_module

    def _capture(self, target: nn.Module, train: bool, announce: bool = False) -> Optional[Capture]:
        flags = {m: m.training for m in target.modules()}
        if train and not target.training:
            target.train()
        key = tuple(m.training for m in target.modules())
        try:
            if key not in self._captures:
                self._captures[key] = self._new_capture(target)
                if announce:
                    rank_zero_info(f"ScaleMonitor: captured {type(target).__name__}: {self._captures[key].describe()}")
            return self._captures[key]
        except Exception as err:  # noqa: BLE001 - a model we cannot capture trains untracked
            self._disable(f"could not capture {type(target).__name__} ({type(err).__name__}: {err})")
            return None
        finally:
            for m, flag in flags.items():
                m.training = flag

    def _new_capture(self, target: nn.Module) -> Capture:
        units = _fsdp_units(target)
        return capture(target, self.capture_mode, leaf_modules=self.leaf_modules, units=units)

    def _disable(self, why: str) -> None:
        self._disabled = why
        rank_zero_warn(f"ScaleMonitor: {why}; training continues untracked.")

    # ---- a tracked step ------------------------------------------------------------------

    def _begin(self, pl_module: pl.LightningModule, step: int, prefix: str) -> None:
        target = self._target(pl_module)
        cap = self._capture(target, train=False)
        if cap is None:
            return
        rec = Recorder(self.groups)
        if self.value_histograms is not None:
            rec.histogram_keys = _Matching(self.value_histograms)  # type: ignore[assignment]  # dynamo labels appear as it compiles
        self._active = _TrackedStep(step, prefix, cap, rec)
        self._active.install(target)
        if prefix == "":
            self.last_tracked_step = step

    def _abort(self, pl_module: pl.LightningModule) -> None:
        if self._active is not None:
            self._active.uninstall()
            self._active.recorder.clear()
            self._active = None

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        active, self._active = self._active, None
        assert active is not None
        active.uninstall()
        try:
            self._report(trainer, active)
        finally:
            active.recorder.clear()

    def _report(self, trainer: pl.Trainer, active: "_TrackedStep") -> None:
        rec, cap = active.recorder, active.capture
        labels = [l for l in cap.node_labels if self._selected(l, cap)]
        try:
            pooled, per_rank, loss_scale_value = self._pool(trainer, active, labels)
        except distributed.RankFailedError as err:  # raised on every rank alike
            here = f"; here: {rec.error!r}" if rec.error is not None else ""
            self._warn_once("error", f"ScaleMonitor: {err} at step {active.step}{here}; nothing logged for it")
            return
        self._check_nonfinite(rec, pooled, labels, active.step)
        if not trainer.is_global_zero:
            return
        pooled, per_rank = self._unscale(trainer, pooled, per_rank, loss_scale_value)
        keep = [i for i in range(len(labels)) if bool((pooled[i, :, 0] > 0).any())]
        if not self._warned.get("coverage"):  # dynamo compiles lazily: known after the first tracked step
            self._warned["coverage"] = True
            report = cap.coverage([labels[i] for i in keep])
            rank_zero_info(f"ScaleMonitor: {report.line()}")
            if report.warning():
                rank_zero_warn(report.warning())
        if not keep:
            self._warn_once(f"empty{active.prefix}", self._nothing_recorded(active, labels))
            return
        keep = self._cap(keep, labels)
        out_labels = [labels[i] for i in keep]
        writer = self._writer(trainer, active.prefix)
        code = self._code(cap, labels, pooled) if self.code else None
        writer.write(active.step, out_labels, pooled[keep], code, per_rank[:, keep] if self.rank_spread else None)
        if loss_scale_value is not None:
            for logger in trainer.loggers:
                logger.log_metrics({f"{active.prefix}scale_loss/loss_scale": loss_scale_value}, step=active.step)
        if rec.histograms:
            hists = {f"{'fwd' if d == FORWARD else 'bwd'}/{k}": h.cpu() for (k, d), h in rec.histograms.items()}
            writer.write_value_histograms(active.step, hists)

    def _pool(self, trainer: pl.Trainer, active: "_TrackedStep", labels: List[str]) -> Tuple[Tensor, Tensor, Optional[float]]:
        """Every rank sends its records, a failure flag and the loss scale in one collective,
        also when its statistics failed, so no rank is left waiting."""
        rec, cap = active.recorder, active.capture
        failed = rec.error is not None
        if failed:
            records = torch.zeros(len(labels), 2, len(stats.FIELDS), dtype=torch.float64, device=trainer.strategy.root_device)
        else:
            records = rec.records(labels, cap.aliases)
        if active.loss_scale is not None:  # an extra row, so it travels in the same transfer
            extra = torch.zeros(1, 2, len(stats.FIELDS), dtype=torch.float64, device=records.device)
            extra[0, FORWARD, 0] = 1.0
            extra[0, FORWARD, 1] = active.loss_scale.to(records.device)
            records = torch.cat([records, extra])
        rows = records.shape[0] if cap.mode == "fx" else max(records.shape[0], _DYNAMO_ROWS)
        replicated = _replicated_labels(self._target(trainer.lightning_module))
        pooled, per_rank = distributed.pool(records, labels, rows, replicated, failed)
        if active.loss_scale is None:
            return pooled, per_rank, None
        return pooled[:-1], per_rank[:, :-1], float(pooled[-1, FORWARD, 1])

    def _nothing_recorded(self, active: "_TrackedStep", labels: List[str]) -> str:
        where = f"step {active.step}" + (" (validation)" if active.prefix else "")
        if not labels:
            return f"ScaleMonitor: no node selected at {where}: `include` / `exclude` / `prune_views` leave none of {len(active.capture.node_labels)} nodes"
        target = self.submodule or type(active.capture.module).__name__
        return (
            f"ScaleMonitor: nothing recorded at {where}: the captured forward of `{target}` did not run "
            "(call the module, e.g. `self(x)`, in the step; with capture='dynamo' the compile cache may be full)"
        )

    def _selected(self, label: str, cap: Capture) -> bool:
        if self.include is not None and not self.include.search(label):
            return False
        if self.exclude is not None and self.exclude.search(label):
            return False
        return not (self.prune_views and label in cap.aliases)

    def _cap(self, keep: List[int], labels: List[str]) -> List[int]:
        if len(keep) <= self.max_tags:
            return keep
        self._warn_once(
            "max_tags",
            f"ScaleMonitor: {len(keep)} nodes have tensors; writing the first {self.max_tags} "
            "(raise `max_tags`, or narrow with `include` / `exclude` / `prune_views`)",
        )
        return keep[: self.max_tags]

    def _unscale(self, trainer: pl.Trainer, pooled: Tensor, per_rank: Tensor, loss_scale: Optional[float]) -> Tuple[Tensor, Tensor]:
        if not self.unscale_gradients:
            return pooled, per_rank
        factor = trainer.accumulate_grad_batches / (loss_scale or 1.0)
        return _scale_backward(pooled, factor), _scale_backward(per_rank, factor)

    def _check_nonfinite(self, rec: Recorder, pooled: Tensor, labels: List[str], step: int) -> None:
        for name, d in (("forward", FORWARD), ("backward", BACKWARD)):
            bad = pooled[:, d, stats.FIELDS.index("nan")] + pooled[:, d, stats.FIELDS.index("inf")]
            if self._warned.get(f"nonfinite_{name}") or not bool((bad > 0).any()):
                continue
            first = rec.first_nonfinite(d)
            if first is None:  # on another rank: name the first in graph order
                first = labels[int(torch.nonzero(bad > 0)[0])]
            self._warn_once(f"nonfinite_{name}", f"ScaleMonitor: non-finite values in the {name} pass at step {step}; first produced by `{first}`")

    def _warn_once(self, key: str, message: str) -> None:
        if not self._warned.get(key):
            self._warned[key] = True
            rank_zero_warn(message)

    def _writer(self, trainer: pl.Trainer, prefix: str) -> ScaleWriter:
        if prefix not in self._writers:
            self._writers[prefix] = ScaleWriter(trainer.loggers, self.statistics, self.histograms, self.figure, prefix, self.figure_every)
        return self._writers[prefix]

    def _code(self, cap: Capture, labels: List[str], pooled: Tensor) -> str:
        index = {l: i for i, l in enumerate(labels)}
        std = stats.statistic(pooled, "std").tolist()
        present = (pooled[..., 0] > 0).tolist()
        texts = []
        for gm, names in zip(cap.graphs, cap.labels):
            scales = {}
            for name, label in names.items():
                i = index.get(label)
                if i is not None:
                    scales[name] = ScalePair(std[i][0] if present[i][0] else None, std[i][1] if present[i][1] else None)
            texts.append(annotate_code(gm.code, scales))
        return "\n\n".join(texts)


class _TrackedStep:
    """What one tracked step swapped in, and how to put it back."""

    def __init__(self, step: int, prefix: str, cap: Capture, recorder: Recorder) -> None:
        self.step, self.prefix, self.capture, self.recorder = step, prefix, cap, recorder
        self.loss_scale: Optional[Tensor] = None
        self._saved: List[Tuple[nn.Module, Any]] = []

    def install(self, target: nn.Module) -> None:
        for path, fn in self.capture.parts():
            module = target.get_submodule(path) if path else target
            self._saved.append((module, module.__dict__.get("forward", _MISSING)))
            module.forward = _recording(fn, self.recorder)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for module, previous in reversed(self._saved):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous  # type: ignore[method-assign]
        self._saved.clear()


def _recording(fn: Any, rec: Recorder) -> Any:
    def tracked_forward(*args: Any, **kwargs: Any) -> Any:
        with recording(rec):
            return fn(*args, **kwargs)

    return tracked_forward


def _scale_backward(records: Tensor, factor: float) -> Tensor:
    out = records.clone()
    bwd = out[..., BACKWARD, :]
    for name, power in (("mean", 1), ("m2", 2), ("absmax", 1), ("min_nonzero", 1)):
        bwd[..., stats.FIELDS.index(name)] *= factor**power
    return out


class _Matching:
    """The labels a regex matches, as a container (``label in matching``)."""

    def __init__(self, pattern: "re.Pattern[str]") -> None:
        self.pattern = pattern

    def __contains__(self, label: object) -> bool:
        return isinstance(label, str) and self.pattern.search(label) is not None

    def __bool__(self) -> bool:
        return True


def _compile(name: str, pattern: Optional[str]) -> Optional["re.Pattern[str]"]:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"`{name}` must be a valid regular expression, got {pattern!r} ({err})") from err


def _resolve_submodule(root: nn.Module, path: str) -> nn.Module:
    try:
        return root.get_submodule(path)
    except AttributeError:
        names = [n for n, _ in root.named_modules() if n]
        near = difflib.get_close_matches(path, names, n=5, cutoff=0.3)
        hint = f"; nearest: {near}" if near else f"; submodules include {names[:8]}"
        raise ValueError(f"`submodule` {path!r} is not a submodule of {type(root).__name__}{hint}") from None


def _replicated_labels(target: nn.Module) -> "set[str]":
    """Parameter and buffer paths: under data parallelism every rank holds them whole."""
    return {n for n, _ in target.named_parameters()} | {n for n, _ in target.named_buffers()}


def _fsdp_units(target: nn.Module) -> List[str]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [name for name, m in target.named_modules() if name and isinstance(m, FSDPModule)]
