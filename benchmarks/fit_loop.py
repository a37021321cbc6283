"""Steps of a real ``lightning.Trainer`` fit loop, with and without ``ScaleMonitor``.

``measure``: untracked steps (below). ``measure_tracked``: tracked steps and whole fits
(see its docstring).

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

import contextlib
import gc
import logging
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, TensorDataset

from timing import Samples, Stopwatch
from workload import Size, Workload  # puts the repository root on sys.path

from lightning_scale import ScaleMonitor
from lightning_scale.record import native
from lightning_scale.record import stats

#: "Every statistic group" of the Trainer goal: moments, range and formats (std, absmax,
#: zeros, min_nonzero, the format fractions); the opt-in ``fp8`` what-if is measured apart.
EVERY_GROUP = sorted(name for name, group in stats.STATISTICS.items() if group in ("moments", "range", "formats"))
#: std and the ``fp8`` what-if group.
WITH_FP8 = ["std"] + sorted(name for name, group in stats.STATISTICS.items() if group == "fp8")


@contextmanager
def _rounds(rounds: int, budget_s: Optional[float]) -> Iterator[Tuple[str, Iterator[int]]]:
    """A scratch log folder, and the round numbers to run: at least two, then more while
    ``budget_s`` of wall time has not passed; Lightning's chatter silenced."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    start = time.perf_counter()

    def numbers() -> Iterator[int]:
        for r in range(rounds):
            if budget_s is not None and r >= 2 and time.perf_counter() - start > budget_s:
                return
            yield r

    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield root, numbers()


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
            self.global_steps: List[int] = []  # trainer.global_step at each batch start
            self.total: Tuple[float, float] = (float("nan"), float("nan"))  # trainer.fit(): wall, cpu

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self.global_steps.append(trainer.global_step)
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
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=TensorBoardLogger(root),
        callbacks=[timer] + ([monitor] if monitor is not None else []),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    watch = Stopwatch()
    trainer.fit(module, data)
    timer.total = watch.lap()
    return timer


def measure(
    size: Size, rounds: int = 5, steps: int = 30, skip: int = 5, budget_s: Optional[float] = None
) -> Tuple[Dict[str, List[Samples]], List[float]]:
    """Kept step periods of each fit, by round, for "fit" (plain) and "fit_monitor"; and
    the wall time spent in ``ScaleMonitor``'s hooks in each kept monitored step.

    With ``budget_s``, stops after the round (at least two) that passes that much wall time.
    """
    out: Dict[str, List[Samples]] = {"fit": [], "fit_monitor": []}
    hooks: List[float] = []
    with _rounds(rounds, budget_s) as (root, numbers):
        for r in numbers:
            pair = [("fit", None), ("fit_monitor", ScaleMonitor(every_n_steps=10**9))]
            for name, monitor in pair if r % 2 == 0 else pair[::-1]:  # no place bias
                gc.collect()
                timer = _fit(size, steps, monitor, root)
                out[name].append(timer.periods(skip))
                if monitor is not None:
                    hooks += timer.hook_times()[skip:]
    return out, hooks


#: Kinds of kept step in ``TrackedFits.steps``.
TRACKED_KINDS = (
    "plain",
    "untracked",
    "tracked",
    "after_tracked",
    "tracked_figure",
    "after_figure",
    "tracked_all",
    "after_all",
    "tracked_fp8",
    "after_fp8",
    "tracked_torch",
    "after_torch",
)


@dataclass
class TrackedFits:
    """What ``measure_tracked`` measured."""

    every_n_steps: int
    figure_every: int
    steps: int  # of each short fit with frequent tracking
    whole_steps: int  # of each whole fit
    skip: int
    steps_by_kind: Dict[str, Samples] = field(default_factory=dict)  # TRACKED_KINDS -> step periods, all rounds
    hooks: Dict[str, List[float]] = field(default_factory=dict)  # kind -> wall s in ScaleMonitor's hooks per step
    totals: Dict[str, Samples] = field(default_factory=dict)  # "fit" / "fit_default" -> trainer.fit() time per round
    plain_by_round: List[Samples] = field(default_factory=list)  # kept plain steps, by round (noise floor)
    rounds: int = 0
    seconds: float = 0.0  # wall time of the whole measurement


def measure_tracked(
    size: Size,
    rounds: int = 3,
    steps: int = 45,
    whole_steps: int = 200,
    every_n_steps: int = 5,
    figure_every: int = 2,
    skip: int = 5,
    budget_s: Optional[float] = None,
) -> TrackedFits:
    """Tracked steps in a Trainer fit, and the whole-fit cost of ``ScaleMonitor()``'s defaults.

    Each round runs these fits, in an order that rotates from round to round:
    a plain fit of ``whole_steps`` steps; a fit of ``whole_steps`` steps with
    ``ScaleMonitor()`` (defaults: every 50th step tracked, a figure on the first tracked
    step and every 10th after it); and four fits of ``steps`` steps tracking every
    ``every_n_steps``-th step: std without the figure; std with the figure every
    ``figure_every``-th tracked step (kept apart: the figure's drawing on the writer
    thread spills into the next steps); every statistic group; std and the fp8 what-if;
    std again without the native one-read kernel (``native.switched_off``: the reference computes every field).
    Of the whole fits, ``trainer.fit()`` is timed (capture at fit start included); of the
    short fits, every kept step period (``global_step >= skip``) is sorted by kind (see
    ``_sort_steps``) and compared with the kept step periods of the plain whole fit. The
    monitor's own hooks are timed per step.

    With ``budget_s``, stops after the round (at least two) that passes that much wall time.
    """
    out = TrackedFits(every_n_steps, figure_every, steps, whole_steps, skip)
    out.steps_by_kind = {k: Samples() for k in TRACKED_KINDS}
    out.hooks = {k: [] for k in TRACKED_KINDS[1:]}
    out.totals = {"fit": Samples(), "fit_default": Samples()}
    start = time.perf_counter()
    with _rounds(rounds, budget_s) as (root, numbers):
        for r in numbers:
            jobs = [
                ("fit", whole_steps, lambda: None),
                ("fit_default", whole_steps, lambda: ScaleMonitor()),
                ("fit_tracked", steps, lambda: ScaleMonitor(every_n_steps=every_n_steps, figure=False)),
                (
                    "fit_tracked_figure",
                    steps,
                    lambda: ScaleMonitor(every_n_steps=every_n_steps, figure=True, figure_every=figure_every),
                ),
                ("fit_tracked_all", steps, lambda: ScaleMonitor(every_n_steps=every_n_steps, statistics=EVERY_GROUP)),
                ("fit_tracked_fp8", steps, lambda: ScaleMonitor(every_n_steps=every_n_steps, statistics=WITH_FP8)),
                # std as fit_tracked, with torch's kernels instead of the native one-read kernel
                ("fit_tracked_torch", steps, lambda: ScaleMonitor(every_n_steps=every_n_steps, figure=False)),
            ]
            for name, n, make in jobs[r % len(jobs) :] + jobs[: r % len(jobs)]:  # no place bias
                gc.collect()
                monitor = make()
                with native.switched_off() if name == "fit_tracked_torch" else contextlib.nullcontext():
                    timer = _fit(size, n, monitor, root)
                if name in out.totals:
                    out.totals[name].wall.append(timer.total[0])
                    out.totals[name].cpu.append(timer.total[1])
                if name == "fit":
                    kept = timer.periods(skip)
                    out.plain_by_round.append(kept)
                    out.steps_by_kind["plain"].wall.extend(kept.wall)
                    out.steps_by_kind["plain"].cpu.extend(kept.cpu)
                elif name.startswith("fit_tracked"):
                    _sort_steps(out, timer, monitor, group=name[len("fit_") :])
            out.rounds = r + 1
    out.seconds = time.perf_counter() - start
    return out


def _sort_steps(out: TrackedFits, timer: Any, monitor: Any, group: str) -> None:
    """Adds the kept step periods of a short tracked fit to ``out`` by kind: its tracked
    steps as ``group`` (``tracked`` std only, ``tracked_all`` every statistic group,
    ``tracked_fp8`` the fp8 what-if, ``tracked_figure`` the steps that draw the figure:
    that fit's other tracked steps, and the steps after them, are left out), the untracked
    step right after each (it pays for the writer thread), and, from the std fit, every
    other untracked step."""
    full = timer.periods(0)
    hooks = timer.hook_times()
    tracked_before = 0  # tracked steps of this fit before the current one
    previous: Optional[str] = "untracked"
    for i, step in enumerate(timer.global_steps[: len(full.wall)]):
        kind: Optional[str]
        if monitor.schedule.is_tracked(step):
            figure = tracked_before % out.figure_every == 0
            kind = group if group != "tracked_figure" or figure else None
            tracked_before += 1
        elif previous is not None and previous.startswith("tracked"):
            kind = "after" + previous[len("tracked") :] if previous != "tracked" else "after_tracked"
        else:
            kind = "untracked" if group == "tracked" and previous is not None else None
        previous = kind
        if step < out.skip or kind is None:
            continue
        out.steps_by_kind[kind].wall.append(full.wall[i])
        out.steps_by_kind[kind].cpu.append(full.cpu[i])
        out.hooks[kind].append(hooks[i])


#: Where the time of a tracked step goes: (row, function, file suffix) read from cProfile.
PROFILE_PARTS = (
    ("recording in the forward (`observe`, its statistics included)", "observe", "lightning_scale/record/recorder.py"),
    (
        "recording gradients (`Recorder._on_grad`, its statistics included)",
        "_on_grad",
        "lightning_scale/record/recorder.py",
    ),
    (
        "of which the statistics one tensor at a time, native kernel's short path (`stats.fast_host_record`), both "
        "directions",
        "record",
        "lightning_scale/record/stats/host.py",
    ),
    (
        "of which the statistics one tensor at a time, general path (`stats.record_of`), both directions",
        "record_of",
        "lightning_scale/record/stats/__init__.py",
    ),
    ("assembling the records (`Recorder.records`)", "records", "lightning_scale/record/recorder.py"),
    (
        "of which the short tensors' statistics, all at once (`ShortRecords.flush`)",
        "flush",
        "lightning_scale/record/short_records.py",
    ),
    ("pooling, the one transfer (`pool.pool_step`)", "pool_step", "lightning_scale/report/pool.py"),
    ("checks and queueing on the training thread (`Reporter.report`)", "report", "lightning_scale/report/reporting.py"),
    ("end of step in total (`ScaleMonitor._finish`)", "_finish", "lightning_scale/callback.py"),
)


@dataclass
class Profile:
    """Per tracked step, milliseconds of each ``PROFILE_PARTS`` row (cumulative, main
    thread, under cProfile, which inflates Python-heavy parts), and of the writer thread."""

    statistics: List[str]
    tracked_steps: int
    parts: Dict[str, float] = field(default_factory=dict)
    writer_ms: float = float("nan")  # wall ms per tracked step in the background writer's jobs
    step_ms: float = float("nan")  # wall ms of a tracked step under the profiler


def profile_tracked(size: Size, statistics: List[str], steps: int = 12) -> Profile:
    """A fit tracking every step from step 2 on, profiled with cProfile on the main thread."""
    import cProfile
    import pstats

    from lightning_scale.report import worker

    out = Profile(list(statistics), steps - 2)
    spent: List[float] = []
    call = worker.Worker._call

    def timed(self: Any, *job: Any) -> None:
        t0 = time.perf_counter()
        call(self, *job)
        spent.append(time.perf_counter() - t0)

    worker.Worker._call = timed  # type: ignore[method-assign]
    profiler = cProfile.Profile()
    try:
        with _rounds(1, None) as (root, _):
            monitor = ScaleMonitor(every_n_steps=1, start_step=2, statistics=list(statistics))
            profiler.enable()
            timer = _fit(size, steps, monitor, root)
            profiler.disable()
    finally:
        worker.Worker._call = call  # type: ignore[method-assign]
    table = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for row, name, suffix in PROFILE_PARTS:
        # max: the module-level ``observe`` calls ``Recorder.observe`` (same file and name)
        cum = max((v[3] for (file, _, func), v in table.items() if func == name and file.endswith(suffix)), default=0.0)
        out.parts[row] = cum * 1e3 / out.tracked_steps
    out.writer_ms = sum(spent[1:]) * 1e3 / max(1, len(spent) - 1)  # step 2's job includes first-use imports
    out.step_ms = statistics_median(timer.periods(3).wall) * 1e3
    return out


def statistics_median(values: List[float]) -> float:
    import statistics as st

    return st.median(values) if values else float("nan")


def recorded_elements(size: Size) -> Tuple[int, int]:
    """(records, elements) a tracked step of ``size`` computes statistics of: one bare
    fx-tracked training step, both directions (tensors that share a record counted once)."""
    from lightning_scale import Recorder, capture, recording
    from lightning_scale.record.recorder import Recorder as _Recorder

    work = Workload(size)
    cap = capture(work.model, "fx")
    seen: List[int] = []
    add = _Recorder._add

    def counted(self: Any, slot: int, direction: int, x: torch.Tensor) -> Any:
        seen.append(x.numel())
        return add(self, slot, direction, x)

    _Recorder._add = counted  # type: ignore[method-assign]
    try:
        with recording(Recorder(("moments",))):
            work.loss(cap.tracked()(work.x)).backward()
    finally:
        _Recorder._add = add  # type: ignore[method-assign]
    return len(seen), sum(seen)
