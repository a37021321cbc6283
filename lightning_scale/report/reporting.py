"""Reporting a tracked step: pool it, check it, write it off the training thread.

``Reporter.pool`` pools a step's records, value histograms, failure flag, loss scale and
update statistics (``lightning_scale.record.updates.UpdateStats``) over ranks with
reductions (``pool.pool_step``: named segments, bytes per rank independent of the world
size), and brings the result (``PooledStep``, the same names) to the writing rank in one
device-to-host transfer. ``Reporter.report`` then
decides, on the training thread, what little must be decided there (anomaly warnings,
which nodes to write; all on the pooled host copy) and hands the rest (unscaling,
annotated code, scalars, histograms, figure, text, the dashboard's records, update
ratios) to a ``Worker``, which writes them for TensorBoard loggers to the callback's own
event file in each run directory (``event_file``: a failure or ``max_log_bytes`` stops it
with one warning, never the fit; ``close`` at fit end); ``max_tags`` caps the per-node
scalars only (``ScaleWriter``), the dashboard's records hold every node.
``Reporter.log_anomaly`` queues an anomaly event there too. Other loggers (CSV, W&B,
MLflow, ...) are not safe to call from a second thread while Lightning logs: they get
their scalars through ``log_metrics`` on the training thread (``loggers.LoggerOutput``: its
first failure stops it, with one warning). Nothing here imports Lightning: the callback
passes loggers, the rank and the accumulation factor in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx

from lightning_scale.capture import Capture
from lightning_scale.capture.interpreter import ScalePair
from lightning_scale.record import updates
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder
from lightning_scale.report import pool
from lightning_scale.report.anomalies import AnomalyWatch
from lightning_scale.report.code import annotate_code
from lightning_scale.report.event_file import Budget, EventFile
from lightning_scale.report.loggers import LoggerOutput, is_tensorboard, log_dir_of
from lightning_scale.report.options import ReportOptions
from lightning_scale.report.tensorboard import ScaleWriter
from lightning_scale.report.values import StepValues
from lightning_scale.report.worker import Worker

__all__ = ["PooledStep", "Reporter", "StepData"]

PooledStep = pool.Pooled  # one tracked step pooled over all ranks (``Reporter.pool``)


@dataclass(kw_only=True)
class StepData:
    """What one tracked step recorded, as the callback hands it over (keywords only)."""

    step: int
    prefix: str
    capture: Capture
    recorder: Recorder
    labels: List[str]
    target: str = ""  # how the user names the captured module (``submodule`` or its class)
    loss_scale: Optional[Tensor] = None
    updates: Optional[updates.UpdateStats] = None  # the optimizer step's, on a tracked training step
    # labels of parameters and buffers: every rank holds them whole (pooling counts their
    # forward record once) and the dashboard marks them
    parameters: Collection[str] = ()


@dataclass
class _Written:
    """One step's pooled host data, on its way to the worker."""

    step: int
    prefix: str
    labels: List[str]
    values: StepValues  # the written nodes' statistics, backward ones unscaled where asked
    spread: Optional[pool.RankSpread]
    histograms: Dict[str, Tensor]
    loss_scale: Optional[float]
    updates: Optional[Tuple[List[str], Tensor]]  # parameter names, their pooled update rows
    code: Optional[List[Tuple[fx.GraphModule, Dict[str, str]]]]
    aliases: Dict[str, str] = field(default_factory=dict)  # label -> label of the same tensor


class Reporter:
    """Pools, checks and writes tracked steps; the writing runs on a background worker.

    Args:
        options: what to pool and write (``ReportOptions``: ``ScaleMonitor``'s arguments).
        warn: how to warn (the callback passes Lightning's ``rank_zero_warn``).
        info: how to log a line (``rank_zero_info``): the coverage of the first tracked step.
    """

    def __init__(
        self,
        options: ReportOptions,
        *,
        warn: Callable[[str], None],
        info: Callable[[str], None] = lambda message: None,
    ) -> None:
        self.options = options
        self.statistics = list(options.statistics)
        self.rank_spread, self.max_tags, self.code = options.rank_spread, options.max_tags, options.code
        self.unscale_gradients, self.value_histograms = options.unscale_gradients, options.value_histograms
        self.warn, self.info = warn, info
        self.report_coverage = options.coverage
        self.worker = Worker()
        self.anomalies = AnomalyWatch()
        self._warned: Dict[str, bool] = {}
        self._writers: Dict[str, ScaleWriter] = {}
        self._outputs: Dict[Any, Any] = {}  # a run's EventFile per log dir, LoggerOutput per logger
        self._budget = Budget(options.max_log_bytes)

    def start_run(self) -> None:
        """A new fit/validate: finish the previous run's writing, forget its loggers and files."""
        self.close()

    def flush(self) -> None:
        """Block until every submitted step is written."""
        if self._outputs:
            self.worker.submit("flush", _flush, list(self._outputs.values()))
        self.worker.flush()

    def close(self) -> None:
        """Write every submitted step, close this run's event files (the fit ends or failed);
        a later step opens new ones. Never raises: failures are warned by the files."""
        outputs, self._outputs = list(self._outputs.values()), {}
        if outputs:
            self.worker.submit("closing the event files", _close, outputs)
        self.worker.close()
        self._writers.clear()
        self._budget = Budget(self.options.max_log_bytes)

    # ---- on the training thread ----------------------------------------------------------

    def pool(self, data: StepData, device: torch.device, strict: bool = False) -> Optional[PooledStep]:
        """Every rank pools its records, update statistics, loss scale, histograms and a
        failure flag (``pool.pool_step``), also when its statistics failed, so no rank is
        left waiting. Global rank zero gets the result; other ranks get None. Where ranks
        captured different graphs, the labels they share are pooled (``PooledStep.unshared``
        says what was left out) unless ``strict``.

        Raises:
            pool.RankFailedError: a rank's statistics failed (on every rank alike).
            pool.RankMismatchError: with ``strict``, ranks captured different graphs; or
                their payloads differ beyond the labels (on every rank alike).
        """
        rec, cap, labels = data.recorder, data.capture, data.labels
        rec.flush()  # (the short tensors' statistics: a failure there is a failure too)
        failed = rec.error is not None
        records = (
            torch.zeros(len(labels), 2, rec.width, dtype=torch.float64, device=device)
            if failed
            else rec.records(labels, cap.aliases)
        )
        hist_labels = self.histogram_labels(data)
        return pool.pool_step(
            records,
            labels,
            replicated=data.parameters,
            failed=failed,
            histograms=rec.histogram_tensor(hist_labels) if hist_labels else None,
            histogram_labels=hist_labels,
            spread=self.rank_spread,
            updates=data.updates,
            loss_scale=data.loss_scale,
            dst=0,
            groups=rec.groups,
            strict=strict,
            channels=rec.channel_tensor(labels, cap.aliases) if rec.channels is not None and not failed else None,
        )

    def histogram_labels(self, data: StepData) -> List[str]:
        """The selected labels whose value histograms are pooled."""
        if self.value_histograms is None:
            return []
        return [l for l in data.labels if self.value_histograms.search(l)]

    def publish(
        self,
        data: StepData,
        *,
        device: torch.device,
        strict: bool,
        is_zero: bool,
        loggers: Sequence[Any],
        accumulate: int,
    ) -> None:
        """Pool a tracked step over ranks (``pool``) and write it (``report``). A rank whose
        statistics failed, ranks whose graphs differ (unless ``strict``, where the
        ``RankMismatchError`` is raised) and a fault while reporting each end as one warning."""
        try:
            pooled = self.pool(data, device, strict=strict)
        except pool.RankFailedError as err:  # raised on every rank alike
            here = f"; here: {data.recorder.error!r}" if data.recorder.error is not None else ""
            self.warn_once("error", f"ScaleMonitor: {err} at step {data.step}{here}; nothing logged for it")
            return
        except pool.RankMismatchError as err:  # raised on every rank alike
            if strict:
                raise
            self.warn_once("ranks", f"ScaleMonitor: {err} at step {data.step}; nothing logged for it")
            return
        if pooled is not None and pooled.unshared is not None:
            why = f"{pooled.unshared.describe()} (warned once; `strict_ranks=True` raises instead)"
            self.warn_once("unshared", f"ScaleMonitor: step {data.step}: {why}")
        try:
            self.report(data, pooled, is_zero, loggers, accumulate)
        except Exception as err:  # noqa: BLE001 - after the collectives: a fault here stays here
            why = f"({type(err).__name__}: {err}); training continues"
            self.warn_once("report", f"ScaleMonitor: reporting step {data.step} failed {why}")

    def report(
        self, data: StepData, step: Optional[PooledStep], is_zero: bool, loggers: Sequence[Any], accumulate: int
    ) -> None:
        """On rank zero (which got the pooled step), warn about anomalies, choose what to
        write and queue the writing."""
        if step is None:
            return
        pooled, loss_scale, labels = step, step.loss_scale, step.labels  # labels: those every rank shares
        for message in self.anomalies.check(data.capture, labels, pooled.records, data.step, data.prefix):
            self.warn(message)
        if not is_zero:
            return
        keep = torch.nonzero((pooled.records[:, :, 0] > 0).any(1)).flatten().tolist()
        if not keep:
            self.warn_once(f"empty{data.prefix}", _nothing_recorded(data))
            return
        self._coverage(data, [labels[i] for i in keep])
        self._warn_cap(len(keep))
        if not loggers:
            return
        unscale = accumulate / (loss_scale or 1.0) if self.unscale_gradients else 1.0
        values = StepValues(pooled.records, data.recorder.layout, unscale, pooled.channels)
        spread = _unscaled_spread(pooled.spread, unscale)
        hist_labels = step.histogram_labels
        job = _Written(
            data.step,
            data.prefix,
            [labels[i] for i in keep],
            values.take(keep),
            None if spread is None else pool.RankSpread(*(t[keep] for t in spread)),
            {
                f"{'fwd' if d == FORWARD else 'bwd'}/{l}": pooled.histograms[i, d]
                for i, l in enumerate(hist_labels)
                for d in (FORWARD, BACKWARD)
            },
            loss_scale,
            _updates(data, step),
            list(zip(data.capture.graphs, data.capture.labels)) if self.code else None,
            dict(data.capture.aliases),
        )
        boards, others = _split(loggers)
        if boards:
            writer = self._writer(boards, data.prefix, data.parameters, "boards")
            self.worker.submit(f"step {data.step}", _write, writer, job, {l: i for i, l in enumerate(labels)}, values)
        if others:  # not thread-safe: their scalars go out here, now
            writer = self._writer(others, data.prefix, data.parameters, "others")
            self.worker.run_now(f"step {data.step}", _write, writer, replace(job, code=None, histograms={}), {}, values)

    def log_anomaly(self, loggers: Sequence[Any], step: int, loss: float, text: str) -> None:
        """Log the scalar ``anomaly/loss`` and the text ``anomaly/event`` at the anomalous
        ``step`` (queued for TensorBoard, at once for other loggers)."""
        boards, others = _split(loggers)
        if boards:
            writer = self._writer(boards, "", (), "anomaly boards")
            self.worker.submit(f"anomaly at step {step}", _write_anomaly, writer, step, loss, text)
        if others:
            writer = self._writer(others, "", (), "anomaly others")
            self.worker.run_now(f"anomaly at step {step}", _write_anomaly, writer, step, loss, text)

    def _coverage(self, data: StepData, recorded: List[str]) -> None:
        """Once per run, after the first tracked training step (dynamo compiles lazily)."""
        if data.prefix or not self.report_coverage or self._warned.get("coverage"):
            return
        self._warned["coverage"] = True
        report = data.capture.coverage(recorded)
        self.info(f"ScaleMonitor: {report.line()}")
        warning = report.warning()
        if warning:
            self.warn(warning)

    def warn_once(self, key: str, message: str) -> None:
        """Warn ``message`` the first time ``key`` is seen."""
        if not self._warned.get(key):
            self._warned[key] = True
            self.warn(message)

    def _warn_cap(self, nodes: int) -> None:
        if nodes > self.max_tags:
            self.warn_once(
                "max_tags",
                f"ScaleMonitor: {nodes} nodes have tensors; writing the first {self.max_tags} "
                f"(raise `max_tags`, or narrow with `include` / `exclude` / `prune_views`) as scalars; the SCALES "
                f"dashboard shows all {nodes}",
            )

    def _outputs_of(self, loggers: Sequence[Any]) -> List[Any]:
        """This run's output for each logger: one ``EventFile`` per TensorBoard log dir,
        a ``LoggerOutput`` per other logger (each stops at its first failure)."""
        out = []
        for logger in loggers:
            log_dir = log_dir_of(logger) if is_tensorboard(logger) else None
            key = ("dir", log_dir) if log_dir is not None else ("logger", id(logger))
            if key not in self._outputs:
                self._outputs[key] = (
                    EventFile(log_dir, self.warn, self._budget)
                    if log_dir is not None
                    else LoggerOutput(logger, self.warn)
                )
            if self._outputs[key] not in out:
                out.append(self._outputs[key])
        return out

    def _writer(self, loggers: Sequence[Any], prefix: str, parameters: Collection[str], kind: str) -> ScaleWriter:
        """One writer per tag prefix and kind: ``boards`` is used on the worker only,
        ``others`` on the training thread only (neither shares its caches across threads)."""
        key = f"{kind}:{prefix}"
        if key not in self._writers:
            o = self.options
            self._writers[key] = ScaleWriter(
                self._outputs_of(loggers),
                statistics=self.statistics,
                histograms=o.histograms,
                figure=o.figure,
                prefix=prefix,
                figure_every=o.figure_every,
                parameters=parameters,
                max_tags=self.max_tags,
            )
        return self._writers[key]


def _split(loggers: Sequence[Any]) -> Tuple[List[Any], List[Any]]:
    """(TensorBoard loggers with a log dir, the others). Our own event file in a log dir is
    written from the worker; other loggers may not be (Lightning's ``CSVLogger.save()`` on
    the training thread fails if a row with new columns arrives from another thread while
    it writes), so they are only called on the training thread."""
    boards: List[Any] = []
    others: List[Any] = []
    for logger in loggers:
        (boards if is_tensorboard(logger) and log_dir_of(logger) is not None else others).append(logger)
    return boards, others


# ---- on the worker (TensorBoard), or on the training thread (other loggers) ---------------


def _write(writer: ScaleWriter, job: _Written, index: Dict[str, int], all_values: StepValues) -> None:
    code = _code(job.code, index, all_values) if job.code is not None else None
    writer.write(job.step, job.labels, job.values, code, job.spread, job.aliases)
    if job.loss_scale is not None:
        writer.write_metrics({f"{job.prefix}scale_loss/loss_scale": job.loss_scale}, job.step)
    if job.histograms:
        writer.write_value_histograms(job.step, job.histograms)
    if job.updates is not None:
        writer.write_metrics(updates.ratios(*job.updates, job.prefix), job.step)
    writer.flush()


def _write_anomaly(writer: ScaleWriter, step: int, loss: float, text: str) -> None:
    writer.write_metrics({"anomaly/loss": loss}, step)
    writer.write_text("anomaly/event", text, step)
    writer.flush()


def _flush(outputs: List[Any]) -> None:
    for output in outputs:
        if isinstance(output, EventFile):
            output.flush()


def _close(outputs: List[Any]) -> None:
    for output in outputs:
        if isinstance(output, EventFile):
            output.close()


def _updates(data: StepData, step: PooledStep) -> Optional[Tuple[List[str], Tensor]]:
    return None if data.updates is None or step.updates is None else (data.updates.names, step.updates)


def _code(graphs: List[Tuple[fx.GraphModule, Dict[str, str]]], index: Dict[str, int], values: StepValues) -> str:
    std = values("std").tolist()
    present = values.present.tolist()
    texts = []
    for gm, names in graphs:
        scales = {}
        for name, label in names.items():
            i = index.get(label)
            if i is not None:
                scales[name] = ScalePair(std[i][0] if present[i][0] else None, std[i][1] if present[i][1] else None)
        texts.append(annotate_code(gm.code, scales, labels=names))
    return "\n\n".join(texts)


def _unscaled_spread(spread: Optional[pool.RankSpread], factor: float) -> Optional[pool.RankSpread]:
    """The std's spread over ranks with its backward part unscaled (a std scales by |factor|)."""
    if spread is None or factor == 1.0:
        return spread
    scale = torch.ones(2, dtype=torch.float64)
    scale[BACKWARD] = abs(factor)
    return pool.RankSpread(spread.present, spread.low * scale, spread.high * scale)


def _nothing_recorded(data: StepData) -> str:
    where = f"step {data.step}" + (" (validation)" if data.prefix else "")
    target = data.target or type(data.capture.module).__name__
    nodes = len(data.capture.node_labels)
    if not data.labels and nodes:
        return (
            f"ScaleMonitor: no node selected at {where}: `include` / `exclude` / `prune_views` leave none of "
            f"{nodes} nodes"
        )
    if not nodes:
        return (
            f"ScaleMonitor: nothing recorded at {where}: the capture of `{target}` holds no graph "
            "(with capture='dynamo', torch.compile may have refused every frame of its forward, e.g. one "
            "that uses a sparse tensor; capture='fx' may trace it)"
        )
    return (
        f"ScaleMonitor: nothing recorded at {where}: the captured forward of `{target}` did not run "
        "(call the module, e.g. `self(x)`, in the step; with capture='dynamo' the compile cache may be full)"
    )
