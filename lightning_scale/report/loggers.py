"""Where a tracked step is written: which loggers are TensorBoard, and the others, guarded.

TensorBoard loggers get everything through the callback's own ``EventFile`` in their run
directory. Other loggers (CSV, W&B, MLflow, ...) get the scalars through ``log_metrics``
on the training thread, through a ``LoggerOutput``: its first failure stops the writing
to that logger, with one warning, and never reaches training.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

__all__ = ["LoggerOutput", "is_tensorboard", "log_dir_of", "writable_loggers"]


def is_tensorboard(logger: Any) -> bool:
    """Whether ``logger`` writes TensorBoard events (its experiment is a ``SummaryWriter``)."""
    exp = getattr(logger, "experiment", None)
    return exp is not None and hasattr(exp, "add_histogram_raw")


def log_dir_of(logger: Any) -> Optional[str]:
    """The run directory a TensorBoard ``logger`` writes its events to (None if unknown)."""
    get_logdir = getattr(getattr(logger, "experiment", None), "get_logdir", None)
    log_dir = get_logdir() if callable(get_logdir) else getattr(logger, "log_dir", None)
    return None if log_dir is None else str(log_dir)


def writable_loggers(trainer: Any) -> List[Any]:
    """The loggers the writer thread may use, their experiments created here on the
    training thread (a lazily created experiment must not be created from two threads)."""
    from lightning.pytorch.loggers.logger import DummyLogger

    loggers = [logger for logger in trainer.loggers if not isinstance(logger, DummyLogger)]
    for logger in loggers:
        getattr(logger, "experiment", None)
    return loggers


class LoggerOutput:
    """A logger's ``log_metrics``, stopped at its first failure with one warning.

    Args:
        logger: a Lightning logger (anything with ``log_metrics(metrics, step=...)``).
        warn: called once, with what was lost and from which step, when writing stops.
    """

    def __init__(self, logger: Any, warn: Callable[[str], None]) -> None:
        self.logger = logger
        self.warn = warn
        self.stopped: Optional[str] = None

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        """``logger.log_metrics(metrics, step=step)`` unless stopped; a failure stops it."""
        if self.stopped or not metrics:
            return
        try:
            self.logger.log_metrics(metrics, step=step)
        except Exception as err:  # noqa: BLE001 - a failing logger must not end the fit
            name = type(self.logger).__name__
            self.stopped = f"{type(err).__name__}: {err}"
            self.warn(
                f"ScaleMonitor: writing to {name} failed at step {step} ({self.stopped}); it writes nothing more "
                f"to that logger this run: its scale scalars from step {step} on are lost. Training continues."
            )
