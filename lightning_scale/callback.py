"""ScaleMonitor
^^^^^^^^^^^^

A Lightning callback that records the scale (std and other statistics) of every
intermediate tensor of the model, forward and backward, on selected training steps, pools
it across ranks and writes it to TensorBoard. Untracked steps run the user's module
untouched. The Lightning-free parts (capture, recording, statistics, pooling, writing) live
in their own modules; this one decides *when*.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_scale import arguments as check
from lightning_scale.capture import CAPTURE_MODES
from lightning_scale.record import kernels, native
from lightning_scale.record.settings import Settings
from lightning_scale.record.stats import run_table
from lightning_scale.record.stats.table import Statistic
from lightning_scale.record.recorder import Recorder
from lightning_scale.record.updates import UpdateStats, UpdateTracker
from lightning_scale.report.loggers import writable_loggers
from lightning_scale.report.options import ReportOptions
from lightning_scale.report.reporting import Reporter, StepData
from lightning_scale.step.advising import Advising
from lightning_scale.step.anomaly import AnomalyTrigger
from lightning_scale.step.schedule import Schedule
from lightning_scale.step.selection import Matching, Selection, check_leaf_modules, compile_pattern, resolve_submodule
from lightning_scale.step.captures import Captures
from lightning_scale.step.shadow import SHADOW_MODES
from lightning_scale.step.tracked_step import TrackedStep
from lightning_scale.step.verification import agree_over_ranks

__all__ = ["ScaleMonitor"]


class ScaleMonitor(Callback):
    r"""Records and logs the scale of every tensor in the model's forward and backward pass.

    Args:
        every_n_steps: track optimizer steps ``start_step, start_step + n, ...``; ``None`` tracks only ``steps``.
        steps: explicit optimizer steps to track as well (sorted, non-negative, no repeats).
        start_step: first step that may be tracked.
        stop_step: no step at or after it is tracked, even one in ``steps``; above ``start_step``.
        submodule: dotted path of the submodule to capture, for a ``training_step`` that calls it directly
            (``self.model(x)``); by default the LightningModule's ``forward`` is captured.
        capture: ``"auto"`` (fx where it traces the whole model, TorchDynamo otherwise), ``"fx"`` or ``"dynamo"``.
        statistics: statistics to log: built-in names (docs/statistics.md; default ``["std"]``, logged as
            ``scale/``), ``lightning_scale.Statistic`` objects, or import paths of them
            (``"my_package.stats.mean_abs"``, as LightningCLI YAML names one).
        include: regex; log only nodes whose label matches it.
        exclude: regex; do not log nodes whose label matches it.
        prune_views: do not log views/reshapes whose statistics equal their input's (their records are their
            input's).
        max_tags: the most nodes whose scalars are written (beyond it, a warning once); the SCALES dashboard's
            records hold every node.
        histograms: write ``scale_hist/fwd`` and ``scale_hist/bwd`` (log2 std over all nodes).
        figure: also write the per-node scale figure (needs matplotlib; drawn on the background writer; off by
            default: the dashboard shows the profile).
        figure_every: draw the figure on the first tracked step and then on every n-th tracked step (matplotlib
            takes about a second for a few hundred nodes).
        code: write the captured code annotated with scales as text.
        value_histograms: regex; for matching nodes, write the histogram of log2|x| of the values and gradients
            (``values_log2/``).
        rank_spread: also log the min and max over ranks of each node's std.
        track_validation: also track the first validation batch of each validation run (forward only; tags
            prefixed ``val_``).
        unscale_gradients: divide backward statistics by the loss scale of a GradScaler and multiply by
            ``accumulate_grad_batches``, so they show the gradients of the unscaled, unaccumulated loss.
        leaf_modules: qualified names of submodules to keep as leaves in an fx capture.
        anomaly_steps: when a step's loss is non-finite, jumps above ``anomaly_factor`` x its running median, or
            a GradScaler skips the step, track the next this many steps whatever the schedule, after one step of
            latency (0: off). Logged as ``anomaly/loss`` and the text ``anomaly/event``. See docs/anomaly.md.
        anomaly_factor: the spike threshold, a multiple of the running median loss (> 1).
        update_ratios: on tracked steps, log ``update_ratio/<parameter>`` (RMS of the optimizer step's update /
            RMS of the parameter before it) and ``grad_std/<parameter>`` (std of the gradient the optimizer
            used), pooled exactly across ranks. Holds a copy of the parameters during a tracked step.
        verify_capture: on the first tracked step of each capture, run the captured forward and the model's own
            from the same saved state (RNG, buffers, attributes) and compare outputs, buffers and gradients bit
            for bit; if they differ, try the other capture route; if none matches, see ``shadow`` (a one-off
            cost of two forwards and backwards, see docs/benchmarks.md). ``False``: track in place, unverified.
        shadow: ``"auto"``: where the probe finds that tracking in place would change training (a model compiled
            with Inductor), track by a shadow pass: the step runs untouched, then the instrumented forward and
            backward again from its saved state (statistics of the same tensors up to its rounding; about one
            more forward and backward per tracked step); ``"always"``: every tracked step (no probe);
            ``"never"``: train untracked, with one warning, where the probe refuses. See docs/capture.md.
        max_log_bytes: the most bytes the callback's event files take per run (None: no cap); the step that would
            pass it and every later one are not written, with one warning. A write that fails (a full disk)
            stops the writing the same way; training never stops (docs/usage.md#writing-never-ends-a-fit).
        strict_ranks: when ranks capture different graphs on a tracked step (a rank's forward takes another
            branch), raise ``RankMismatchError`` on every rank, ending the fit. Off by default: the nodes every
            rank has are pooled and logged, the others are not, and one warning names the first differing nodes.
        advise: on tracked steps, measure what FP8 (tensorwise, rowwise) and MXFP8 recipes would do to each
            linear layer's three GEMMs, pooled exactly across ranks; ``lightning-scale advise`` and the
            dashboard's Advice view turn them into a per-layer recipe with torchao exports
            (docs/low_precision.md).
        recipe: a ``recipe.json`` of ``lightning-scale advise``: warn at fit start naming the layers that
            contradict it (``lightning_scale.check_recipe``).

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
        statistics: Optional[List[Union[str, Statistic]]] = None,
        include: Optional[str] = None,
        exclude: Optional[str] = None,
        prune_views: bool = True,
        max_tags: int = 1000,
        histograms: bool = True,
        figure: bool = False,
        figure_every: int = 10,
        code: bool = True,
        value_histograms: Optional[str] = None,
        rank_spread: bool = False,
        track_validation: bool = False,
        unscale_gradients: bool = False,
        leaf_modules: Optional[List[str]] = None,
        anomaly_steps: int = 0,
        anomaly_factor: float = 10.0,
        update_ratios: bool = False,
        verify_capture: bool = True,
        shadow: Literal["auto", "always", "never"] = "auto",
        max_log_bytes: Optional[int] = None,
        strict_ranks: bool = False,
        advise: bool = False,
        recipe: Optional[str] = None,
    ) -> None:
        self.schedule = Schedule(every_n_steps, steps, start_step, stop_step)
        self.capture_mode = check.one_of("capture", capture, CAPTURE_MODES)
        self.statistics, self.groups, self._user_statistics = run_table.resolve(statistics)
        check.booleans(histograms=histograms, figure=figure, code=code, rank_spread=rank_spread)
        max_tags, figure_every = (
            check.positive_int("max_tags", max_tags),
            check.positive_int("figure_every", figure_every),
        )
        self.selection = Selection(include, exclude, prune_views)
        self.value_histograms = compile_pattern("value_histograms", value_histograms)
        self.submodule = check.module_path("submodule", submodule)
        self.track_validation = check.boolean("track_validation", track_validation)
        check.boolean("unscale_gradients", unscale_gradients)
        self.leaf_modules = check.module_paths("leaf_modules", leaf_modules)
        self._anomaly = AnomalyTrigger(anomaly_steps, anomaly_factor, self._detection_failed)
        self.anomaly_steps, self.anomaly_factor = self._anomaly.steps, self._anomaly.factor
        self.update_ratios = check.boolean("update_ratios", update_ratios)
        self.verify_capture = check.boolean("verify_capture", verify_capture)
        self.shadow = check.one_of("shadow", shadow, SHADOW_MODES)
        self.strict_ranks = check.boolean("strict_ranks", strict_ranks)
        self._advising = Advising(check.boolean("advise", advise), recipe, rank_zero_warn, max_log_bytes)
        self._updates = UpdateTracker()
        self.last_tracked_step = -1
        self.settings: Optional[Settings] = None  # the environment switches, read at fit start
        self.captures = Captures(
            mode=self.capture_mode,
            leaf_modules=self.leaf_modules,
            verify=self.verify_capture,
            selection=self.selection,
            info=rank_zero_info,
            warn=rank_zero_warn,
            groups=self.groups,
            shadow=self.shadow,
        )
        self._active: Optional[TrackedStep] = None
        options = ReportOptions(
            statistics=self.statistics,
            histograms=histograms,
            figure=figure,
            figure_every=figure_every,
            code=code,
            rank_spread=rank_spread,
            max_tags=max_tags,
            unscale_gradients=unscale_gradients,
            value_histograms=self.value_histograms,
            coverage=not self.selection.narrowed,
            max_log_bytes=max_log_bytes,
        )
        self.reporter = Reporter(options, warn=rank_zero_warn, info=rank_zero_info)

    include = property(lambda self: self.selection.include, doc="The compiled ``include`` regex (None: every node).")
    exclude = property(lambda self: self.selection.exclude, doc="The compiled ``exclude`` regex (None: none left out).")

    # ---- Lightning hooks ---------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        writes = stage == "fit" or (stage == "validate" and self.track_validation)
        # Only rank zero writes: other ranks may have no logger, or a dummy one.
        if writes and trainer.is_global_zero and not trainer.loggers:
            raise ValueError(
                "`ScaleMonitor` needs a logger to write to, but the Trainer has none "
                "(`Trainer(logger=False)`); pass `logger=True` (TensorBoard) or a logger instance"
            )
        for stat in self._user_statistics:  # (a spawned rank: they came pickled, the registry did not)
            run_table.register(stat)
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
        target = self._target(pl_module)
        check_leaf_modules(target, self.leaf_modules)  # names known only with the model: checked before step 0
        self.settings = self.captures.settings = Settings.from_env().apply()  # (raises on a bad value)
        self.captures.of(target, train=True, announce=True)
        self._advising.check_model(pl_module)
        host_reads = self.settings.host_reads
        if pl_module.device.type == "cpu" and host_reads is not False:  # host statistics: build the kernel now
            native.load()
            line = native.status()
        else:  # device statistics: which kernel (LIGHTNING_SCALE_KERNEL)
            line = kernels.status(pl_module.device, host_reads, self.settings.kernel)
        rank_zero_info(f"ScaleMonitor: {line}; {self.settings.line()}")

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        self._poll_anomaly(trainer, step)
        tracked = self.schedule.is_tracked(step) or self._anomaly.tracks(step)
        if self.captures.disabled or step == self.last_tracked_step or not tracked:
            return
        self._begin(pl_module, step, "")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active is not None and self._active.loss_scale is None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, Tensor):
                self._active.loss_scale = scale.detach().clone().double().reshape(())
        if self._active is not None and self._active.prefix == "":
            self._active.run_shadow()  # (before the optimizer step: the parameters the forward read)

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._anomaly.remember_scale(getattr(trainer.precision_plugin, "scaler", None))
        if self.update_ratios and trainer.global_step == self.last_tracked_step and not self._updates.pending:
            self._updates.snapshot(self._target(pl_module).named_parameters(), trainer.global_step)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._active is not None and self._active.prefix == "":
            self._active.uninstall()  # later micro-batches of the step run untouched
            if not self._waits_for_optimizer_step(trainer):
                self._finish(trainer, pl_module)
        self._anomaly.observe(outputs, getattr(trainer.precision_plugin, "scaler", None))

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._active is not None:  # a training step still waits for its optimizer step
            return
        if (
            self.track_validation
            and not self.captures.disabled
            and not trainer.sanity_checking
            and batch_idx == 0
            and dataloader_idx == 0
        ):
            self._begin(pl_module, trainer.global_step, "val_")

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._active is not None and self._active.prefix == "val_":
            self._finish(trainer, pl_module)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.reporter.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abort(pl_module)
        self._anomaly.reset()
        self.reporter.close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._abort(pl_module)
        self.reporter.close()

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"last_tracked_step": self.last_tracked_step}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.last_tracked_step = int(state_dict.get("last_tracked_step", -1))

    def _start_run(self, target: nn.Module, stage: str) -> None:
        """Forget what belongs to the previous run: its loggers, its module's captures."""
        self.reporter.start_run()
        if stage == "fit":
            self.last_tracked_step = -1  # a resumed checkpoint restores it after setup
            self._anomaly.start_fit()
        self.captures.forget_unless_of(target)

    # ---- capture -------------------------------------------------------------------------

    def _target(self, pl_module: pl.LightningModule) -> nn.Module:
        return resolve_submodule(pl_module, self.submodule) if self.submodule else pl_module

    # ---- a tracked step ------------------------------------------------------------------

    def _begin(self, pl_module: pl.LightningModule, step: int, prefix: str) -> None:
        target = self._target(pl_module)
        cap = self.captures.of(target, train=False)
        strategy = type(pl_module.trainer.strategy).__name__
        if cap is None or not self.captures.trackable(cap, strategy):
            return
        rec = Recorder(self.groups, settings=self.settings)
        if self.value_histograms is not None:
            # (a pattern, not a set: dynamo labels appear as it compiles)
            rec.histogram_keys = Matching(self.value_histograms)  # type: ignore[assignment]
        self._active = TrackedStep(step, prefix, cap, rec)
        self._advising.begin(rec, pl_module, self.submodule or "", training=prefix == "")
        verify = self.captures.verifier(target, cap, strategy, lambda ok: agree_over_ranks(pl_module.trainer, ok))
        self._active.install(target, verify, shadow=cap.shadowed)
        if prefix == "":
            self.last_tracked_step = step

    def _abort(self, pl_module: pl.LightningModule) -> None:
        self._advising.close(self.reporter.worker)
        self._updates.clear()
        self._anomaly.clear()
        if self._active is not None:
            self._active.uninstall()
            self._active.recorder.clear()
            self._active = None

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        active, self._active = self._active, None
        assert active is not None
        active.uninstall()
        active.end_shadow()
        self.captures.act_on(active.check)
        if active.untracked:  # the fidelity probe fell back to the user's forward
            self._updates.clear()
            active.recorder.clear()
            return
        skipped = active.skipped_warning()  # (named once per run)
        if skipped is not None:
            self.reporter.warn_once("skipped", skipped)
        try:
            self._report(trainer, active)
        finally:
            active.recorder.clear()

    def _report(self, trainer: pl.Trainer, active: TrackedStep) -> None:
        cap = active.capture
        labels, replicated = self.captures.labels_of(cap, self._target(trainer.lightning_module))
        data = StepData(
            step=active.step,
            prefix=active.prefix,
            capture=cap,
            recorder=active.recorder,
            labels=labels,
            target=self.submodule or "",
            loss_scale=active.loss_scale,
            updates=self._update_rows(trainer, active),
            parameters=replicated,
        )
        loggers = writable_loggers(trainer) if trainer.is_global_zero else []
        self.reporter.publish(
            data,
            device=trainer.strategy.root_device,
            strict=self.strict_ranks,
            is_zero=trainer.is_global_zero,
            loggers=loggers,
            accumulate=trainer.accumulate_grad_batches,
        )
        self._advising.publish(
            active.recorder, active.step, trainer.strategy.root_device, loggers, self.reporter.worker
        )

    # ---- anomaly-triggered tracking and update ratios (lightning_scale.step.anomaly, .updates)

    def _poll_anomaly(self, trainer: pl.Trainer, step: int) -> None:
        """Judge the loss read one batch late; an anomaly extends which steps are tracked."""
        found = self._anomaly.poll(step)
        if found is not None and trainer.is_global_zero:
            rank_zero_info(f"ScaleMonitor: anomaly at {found.describe()}")
            self.reporter.log_anomaly(writable_loggers(trainer), found.step, found.loss, found.describe())

    def _detection_failed(self, err: Exception) -> None:
        self.reporter.warn_once(
            "anomaly", f"ScaleMonitor: anomaly detection failed ({type(err).__name__}: {err}); it is off for this fit"
        )

    def _waits_for_optimizer_step(self, trainer: pl.Trainer) -> bool:
        """With accumulation, report after the optimizer step that ends the tracked step,
        so its update rows travel with the records."""
        assert self._active is not None
        return self.update_ratios and trainer.global_step == self._active.step

    def _update_rows(self, trainer: pl.Trainer, active: TrackedStep) -> Optional[UpdateStats]:
        if active.prefix or not self._updates.pending or self._updates.step != active.step:
            return None
        rows = self._updates.rows(self._target(trainer.lightning_module).named_parameters())
        if self._updates.error is not None and active.recorder.error is None:
            active.recorder.error = self._updates.error  # pooled as this rank's failure flag: every rank drops the step
        return rows
