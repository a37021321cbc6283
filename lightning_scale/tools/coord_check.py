"""Coordinate check: the scale of every node at several widths over a few training steps.

``coord_check`` trains a model at each width with a real Lightning ``Trainer`` and a
``ScaleMonitor`` that tracks every step, and returns a ``CoordCheck``: the table of std
per (node, direction, width, step), the least-squares slope of log2 std against log2
width per node or node group, and a figure. A well-parametrised model (unit-scaled,
muP) has slopes near 0; standard parametrisation shows the growth with width.

Like ``callback.py`` this module drives Lightning; the table, slopes and figure are plain
Python over ``CoordRow`` tuples (no pandas; matplotlib only for ``plot``).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    Collection,
    Dict,
    FrozenSet,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Pattern,
    Sequence,
    Set,
    Tuple,
    Union,
)

import lightning.pytorch as pl
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_scale import arguments
from lightning_scale.callback import ScaleMonitor

__all__ = ["CoordCheck", "CoordRow", "coord_check", "op_type"]

DIRECTIONS = ("fwd", "bwd")
_TAG = re.compile(r"^scale/(fwd|bwd)/(.+)$")
_RESERVED = ("callbacks", "logger", "max_steps")
#: How nodes are grouped: "node", "op", a regex (its first group, or its match, names the
#: group; nodes it does not match are left out) or a callable label -> group or None.
Group = Union[str, Pattern[str], Callable[[str], Optional[str]]]


class CoordRow(NamedTuple):
    """One std: of ``node``'s output (``"fwd"``) or its gradient (``"bwd"``)."""

    node: str
    direction: str
    width: int
    step: int
    std: float


def op_type(label: str, parameters: Collection[str] = ()) -> str:
    """The op of a node label: ``"blocks.0.mlp.fc1/linear"`` -> ``"linear"``,
    ``"blocks.0/add_1"`` -> ``"add"``; a label in ``parameters`` -> ``"parameter"``."""
    if label in parameters:
        return "parameter"
    return re.sub(r"_\d+$", "", label.rsplit("/", 1)[-1])


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs (NaN for fewer than two distinct xs)."""
    n = len(xs)
    mx, my = sum(xs) / max(n, 1), sum(ys) / max(n, 1)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 2 or sxx == 0:
        return math.nan
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


@dataclass(frozen=True)
class CoordCheck:
    """The result of ``coord_check``: rows of std and what can be derived from them.

    Attributes:
        rows: one ``CoordRow`` per node, direction, width and tracked step.
        parameters: labels of parameter and buffer nodes (their ``"fwd"`` std is the
            weight's, their ``"bwd"`` std the weight gradient's).
    """

    rows: Tuple[CoordRow, ...]
    parameters: FrozenSet[str] = frozenset()

    @property
    def widths(self) -> List[int]:
        return sorted({r.width for r in self.rows})

    @property
    def steps(self) -> List[int]:
        return sorted({r.step for r in self.rows})

    @property
    def nodes(self) -> List[str]:
        """Node labels in execution order (first seen)."""
        return list(dict.fromkeys(r.node for r in self.rows))

    def to_dicts(self) -> List[Dict[str, Any]]:
        """The rows as dicts (``pandas.DataFrame(result.to_dicts())`` makes a frame)."""
        return [r._asdict() for r in self.rows]

    def to_csv(self, path: Optional[str] = None) -> str:
        """The table as CSV text (header ``node,direction,width,step,std``); also written
        to ``path`` if given. Floats are written exactly (``repr``)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(CoordRow._fields)
        writer.writerows((r.node, r.direction, r.width, r.step, repr(r.std)) for r in self.rows)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(out.getvalue())
        return out.getvalue()

    def group_of(self, group: Group = "node") -> Dict[str, str]:
        """Node label -> group name under ``group`` (nodes it leaves out are absent)."""
        if callable(group):
            named = {n: group(n) for n in self.nodes}
            return {n: g for n, g in named.items() if g is not None}
        if group == "node":
            return {n: n for n in self.nodes}
        if group == "op":
            return {n: op_type(n, self.parameters) for n in self.nodes}
        pattern = _pattern(group)
        out = {}
        for node in self.nodes:
            m = pattern.search(node)
            if m is not None:
                out[node] = m.group(1) if pattern.groups else m.group(0)
        return out

    def curves(self, group: Group = "node", step: Optional[int] = None) -> Dict[Tuple[str, str], Dict[int, float]]:
        """(group, direction) -> {width: mean over the group's nodes of log2 std} at
        ``step`` (default: the last tracked step). Zero or non-finite stds are skipped."""
        step = self._step(step)
        groups = self.group_of(group)
        sums: Dict[Tuple[str, str], Dict[int, List[float]]] = {}
        for r in self.rows:
            if r.step != step or r.node not in groups or not (r.std > 0 and math.isfinite(r.std)):
                continue
            sums.setdefault((groups[r.node], r.direction), {}).setdefault(r.width, []).append(math.log2(r.std))
        return {key: {w: sum(v) / len(v) for w, v in sorted(by_width.items())} for key, by_width in sums.items()}

    def slopes(self, group: Group = "node", step: Optional[int] = None) -> Dict[Tuple[str, str], float]:
        """(group, direction) -> least-squares slope of log2 std on log2 width at ``step``
        (default: the last). About 0 when the scale does not depend on width; 0.5 when it
        grows as sqrt(width). NaN where fewer than two widths have a value."""
        out = {}
        for key, curve in self.curves(group, step).items():
            out[key] = _slope([math.log2(w) for w in curve], list(curve.values()))
        return out

    def plot(
        self, group: Group = "op", step: Optional[int] = None, axes: Optional[Sequence[Any]] = None, title: str = ""
    ) -> Any:
        """log2 std against width, one line per group, forward and backward side by side.

        Args:
            group: how nodes are grouped (see ``group_of``); the legend gives each slope.
            step: the tracked step shown (default: the last).
            axes: two matplotlib axes to draw into, forward then backward (default: a
                new figure). A legend is drawn when a panel has at most 24 lines.
            title: prefix of the panel titles.

        Returns:
            The matplotlib figure.

        Raises:
            ImportError: matplotlib is not installed.
            ValueError: ``axes`` is not two axes.
        """
        plt = _pyplot()
        if axes is None:
            _, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        if len(axes) != 2:
            raise ValueError(f"`axes` must be two matplotlib axes (forward, backward), got {len(axes)}")
        step = self._step(step)
        curves, slopes = self.curves(group, step), self.slopes(group, step)
        for ax, direction in zip(axes, DIRECTIONS):
            for (name, d), curve in curves.items():
                if d == direction:
                    ax.plot(
                        list(curve),
                        list(curve.values()),
                        marker="o",
                        ms=3,
                        lw=1,
                        label=f"{name} ({slopes[name, d]:+.2f})",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.widths, [str(w) for w in self.widths])
            ax.set_xlabel("width")
            ax.set_ylabel("log2(std)")
            ax.grid(alpha=0.3)
            which = "forward (values)" if direction == "fwd" else "backward (gradients)"
            ax.set_title(f"{title}{': ' if title else ''}{which}, step {step}", fontsize=9)
            if 0 < len(ax.get_lines()) <= 24:
                ax.legend(fontsize=6, title="group (slope)", title_fontsize=6)
        return axes[0].figure

    def _step(self, step: Optional[int]) -> int:
        steps = self.steps
        if not steps:
            raise ValueError("the table has no rows")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"`step` must be one of the tracked steps {steps}, got {step!r}")
        return step


def _pattern(group: Union[str, Pattern[str]]) -> Pattern[str]:
    if isinstance(group, re.Pattern):
        return group
    if not isinstance(group, str):
        raise ValueError(f"`group` must be 'node', 'op', a regex or a callable, got {group!r} ({type(group).__name__})")
    try:
        return re.compile(group)
    except re.error as err:
        raise ValueError(f"`group` must be 'node', 'op' or a valid regular expression, got {group!r} ({err})") from err


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError('CoordCheck.plot needs matplotlib: pip install "lightning-scale[plot]"') from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


class _MemoryLogger(Logger):
    """Keeps what ``ScaleMonitor`` logs through ``log_metrics``: {step: {tag: value}}."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: Dict[int, Dict[str, float]] = {}

    @property
    @override
    def name(self) -> str:
        return "coord_check"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        self.metrics.setdefault(-1 if step is None else int(step), {}).update(metrics)

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def coord_check(
    make_module: Callable[[int], pl.LightningModule],
    widths: Sequence[int],
    steps: int = 3,
    batches: Union[None, Iterable[Any], Callable[[int], Iterable[Any]]] = None,
    *,
    seed: int = 0,
    include: Optional[str] = None,
    exclude: Optional[str] = None,
    prune_views: bool = True,
    capture: str = "auto",
    trainer_options: Optional[Dict[str, Any]] = None,
) -> CoordCheck:
    """Train the module at each width for a few steps, tracking every step; return the table.

    Each width gets a fresh ``make_module(width)`` built after ``seed_everything(seed)``,
    and the seed is set again before ``Trainer.fit``, so every width sees the same batches
    in the same order. The Trainer runs on the CPU with no checkpointing, progress bar,
    model summary or validation; ``ScaleMonitor(every_n_steps=1)`` records the std of
    every node forward and backward on optimizer steps ``0 .. steps - 1`` (step 0 is the
    initialisation, step k after k updates).

    Args:
        make_module: width -> a fresh ``LightningModule`` (its ``training_step`` must call
            ``self(...)``, which is what is captured).
        widths: at least two distinct positive integers.
        steps: optimizer steps to train (and track) per width, >= 1.
        batches: the training data: one DataLoader (or any iterable Lightning accepts)
            used at every width, a callable width -> DataLoader (for inputs whose size
            depends on the width), or None for the module's own ``train_dataloader``.
            Fewer batches than ``steps`` start another epoch.
        seed: the seed set before building and before training each width.
        include: regex; keep only nodes whose label matches (``ScaleMonitor(include=)``).
        exclude: regex; leave out nodes whose label matches.
        prune_views: leave out views whose statistics equal their input's.
        capture: ``ScaleMonitor(capture=)``: ``"auto"``, ``"fx"`` or ``"dynamo"``.
        trainer_options: extra ``Trainer`` arguments (e.g. ``precision``); ``callbacks``,
            ``logger`` and ``max_steps`` are set here.

    Returns:
        A ``CoordCheck``: ``rows``, ``to_csv()``, ``slopes()``, ``plot()``.

    Raises:
        ValueError: an argument outside what is allowed (the message names it).
        TypeError: ``make_module`` returned something else than a ``LightningModule``.
        RuntimeError: a width recorded nothing, or not every step (see the warnings of
            ``ScaleMonitor``).

    Example::

        result = coord_check(lambda w: MyModule(hidden=w), [64, 128, 256], steps=3, batches=loader)
        print(result.slopes(group="op"))
        result.plot(group="op").savefig("coord_check.png")
    """
    widths = _check_widths(widths)
    _check_arguments(make_module, steps, batches, seed, trainer_options)
    options = dict(include=include, exclude=exclude, prune_views=prune_views, capture=capture)
    _monitor(options)  # ScaleMonitor checks these before any width trains
    rows: List[CoordRow] = []
    parameters: Set[str] = set()
    for width in widths:
        module = _build(make_module, width, seed)
        parameters |= {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        loader = batches(width) if callable(batches) else batches
        metrics = _train(module, loader, steps, seed, _monitor(options), trainer_options or {})
        rows.extend(_rows(metrics, width, steps))
    return CoordCheck(tuple(rows), frozenset(parameters))


def _check_widths(widths: Any) -> List[int]:
    checked = arguments.int_list("widths", widths, minimum=1)
    if len(set(checked)) != len(checked) or len(checked) < 2:
        raise ValueError(
            f"`widths` must be a sequence of at least 2 distinct positive integers (none repeated), got {checked!r}"
        )
    return checked


def _check_arguments(make_module: Any, steps: Any, batches: Any, seed: Any, trainer_options: Any) -> None:
    if not callable(make_module):
        raise ValueError(f"`make_module` must be a callable width -> LightningModule, got {make_module!r}")
    arguments.positive_int("steps", steps)
    if batches is not None and not callable(batches) and not hasattr(batches, "__iter__"):
        allowed = "a DataLoader (iterable), a callable width -> DataLoader, or None"
        raise ValueError(f"`batches` must be {allowed}, got {batches!r} ({type(batches).__name__})")
    arguments.integer("seed", seed)
    if trainer_options is not None and not isinstance(trainer_options, dict):
        raise ValueError(f"`trainer_options` must be a dict of Trainer arguments, got {type(trainer_options).__name__}")
    clash = sorted(set(trainer_options or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"`trainer_options` must not set {clash}: coord_check sets {list(_RESERVED)}")


def _monitor(options: Dict[str, Any]) -> ScaleMonitor:
    # Everything but the std is off: a coordinate check reads scalars only.
    return ScaleMonitor(
        every_n_steps=1, statistics=["std"], histograms=False, figure=False, code=False, max_tags=10**9, **options
    )


def _build(make_module: Callable[[int], Any], width: int, seed: int) -> pl.LightningModule:
    seed_everything(seed, verbose=False)
    module = make_module(width)
    if not isinstance(module, pl.LightningModule):
        raise TypeError(f"`make_module` must return a LightningModule, got {type(module).__name__} for width {width}")
    return module


def _train(
    module: pl.LightningModule, loader: Any, steps: int, seed: int, monitor: ScaleMonitor, extra: Dict[str, Any]
) -> Dict[int, Dict[str, float]]:
    logger = _MemoryLogger()
    with tempfile.TemporaryDirectory() as root, _quiet():
        options: Dict[str, Any] = dict(
            accelerator="cpu",
            devices=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            log_every_n_steps=1,
            default_root_dir=root,
        )
        options.update(extra)
        trainer = pl.Trainer(max_steps=steps, logger=logger, callbacks=[monitor], **options)
        seed_everything(seed, verbose=False)  # the same batch order at every width
        trainer.fit(module, train_dataloaders=loader)
    return logger.metrics


def _rows(metrics: Dict[int, Dict[str, float]], width: int, steps: int) -> List[CoordRow]:
    rows = []
    for step, values in sorted(metrics.items()):
        for tag, value in values.items():
            m = _TAG.match(tag)
            if m is not None:
                rows.append(CoordRow(m.group(2), m.group(1), width, step, float(value)))
    seen = sorted({r.step for r in rows})
    if seen != list(range(steps)):
        expected = f"expected 0..{steps - 1}; see its warnings"
        raise RuntimeError(f"coord_check: at width {width} ScaleMonitor recorded steps {seen}, {expected}")
    return rows


@contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's per-fit banners (devices, seed) at WARNING, once per width otherwise."""
    log = logging.getLogger("lightning.pytorch")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)
