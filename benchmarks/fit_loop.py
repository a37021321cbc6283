"""Untracked steps: a real ``lightning.Trainer`` fit loop with and without ``ScaleMonitor``.

``ScaleMonitor(every_n_steps=10**9)`` tracks step 0 only; every later step is an
untracked step with the callback installed, which is what is timed. A step's time is the
period between consecutive ``on_train_batch_start`` calls, so it holds every hook of
every callback, the data loading and Lightning's own loop; it is taken on both clocks
(wall and process CPU time, as ``timing``). The first ``skip`` periods of each fit
(warm-up, the tracked step 0) are dropped. Each round runs a plain and a monitored fit,
and which goes first alternates: the second fit of a round ran ~1% slower in trials.
The time spent inside the monitor's own hooks is also summed per step: a direct,
noise-free measure of the callback's per-step work.
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, TensorDataset

from timing import Samples
from workload import Size, Workload


def monitor_class() -> Optional[type]:
    """``lightning_scale.ScaleMonitor`` if the package has it yet, else None."""
    import lightning_scale

    return getattr(lightning_scale, "ScaleMonitor", None)


def _lightning_module(size: Size) -> Any:
    import lightning as L

    class GPTModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.work = Workload(size)
            self.gpt = self.work.model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gpt(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return GPTModule()


def _step_timer() -> Any:
    import lightning as L

    class StepTimer(L.Callback):
        """Step periods, and the time spent in a watched callback's hooks per step."""

        def __init__(self) -> None:
            self.starts: List[float] = []
            self.cpu_starts: List[float] = []
            self.hooks: Dict[int, float] = {}

        def on_train_batch_start(self, *args: Any) -> None:
            self.starts.append(time.perf_counter())
            self.cpu_starts.append(time.process_time())

        def periods(self, skip: int) -> Samples:
            wall = [b - a for a, b in zip(self.starts, self.starts[1:])]
            cpu = [b - a for a, b in zip(self.cpu_starts, self.cpu_starts[1:])]
            return Samples(wall[skip:], cpu[skip:])

        def hook_times(self) -> List[float]:
            return [self.hooks.get(i, 0.0) for i in range(len(self.starts) - 1)]

        def watch(self, callback: Any) -> None:
            """Time every hook ``callback`` overrides (instance attributes shadow the methods)."""
            base = L.Callback
            for name in dir(base):
                if name.startswith("on_") and getattr(type(callback), name) is not getattr(base, name):
                    setattr(callback, name, self._timed(getattr(callback, name)))

        def _timed(self, hook: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return hook(*args, **kwargs)
                finally:
                    step = len(self.starts) - 1  # -1: before the first batch (fit start)
                    self.hooks[step] = self.hooks.get(step, 0.0) + time.perf_counter() - t0

            return timed

    return StepTimer()


def _fit(size: Size, steps: int, monitor: Optional[Any], root: str) -> Any:
    import lightning as L
    from lightning.pytorch.loggers import TensorBoardLogger

    module = _lightning_module(size)
    x, y = module.work.x, module.work.y
    data = DataLoader(TensorDataset(x.repeat(steps + 1, 1), y.repeat(steps + 1, 1)), batch_size=size.batch)
    timer = _step_timer()
    if monitor is not None:
        timer.watch(monitor)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=TensorBoardLogger(root),
        callbacks=[timer] + ([monitor] if monitor is not None else []),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data)
    return timer


def measure(size: Size, rounds: int = 5, steps: int = 30, skip: int = 5, budget_s: Optional[float] = None) -> Tuple[Dict[str, List[Samples]], List[float]]:
    """Kept step periods of each fit, by round, for "fit" (plain) and "fit_monitor"; and
    the wall time spent in ``ScaleMonitor``'s hooks in each kept monitored step.

    With ``budget_s``, stops after the round (at least two) that passes that much wall time.

    Raises:
        RuntimeError: ``lightning_scale.ScaleMonitor`` does not exist yet.
    """
    cls = monitor_class()
    if cls is None:
        raise RuntimeError("lightning_scale.ScaleMonitor does not exist yet")
    out: Dict[str, List[Samples]] = {"fit": [], "fit_monitor": []}
    hooks: List[float] = []
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(rounds):
            if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
                break
            pair = [("fit", None), ("fit_monitor", cls(every_n_steps=10**9))]
            for name, monitor in pair if r % 2 == 0 else pair[::-1]:  # no place bias
                gc.collect()
                timer = _fit(size, steps, monitor, root)
                out[name].append(timer.periods(skip))
                if monitor is not None:
                    hooks += timer.hook_times()[skip:]
    return out, hooks
