"""Two runs compared node by node: which nodes both logged, how far apart their statistics
are at a pair of steps, and where the runs first part.

Nodes are matched by label (an eager and a compiled run of the same model share their
labels; a node one run logged and the other did not is listed, not compared). Steps are
aligned by ``align``: by default the latest step both runs tracked; ``step=N`` takes each
run's latest tracked step at or before ``N``; ``steps=(a, b)`` a given pair. Every
statistic both runs logged is compared as run B minus run A: in octaves (log2) for the
magnitudes (``statistics.is_log2``: ``std``, ``absmax``, ``rms``, ``min_nonzero``, and user
statistics declared ``axis="log2"``), as
logged for the others (fractions, counts, dB).

**First divergence.** A node direction diverges when ``|log2 std of B - log2 std of A|``
exceeds ``threshold`` octaves (``THRESHOLD``, 0.5: a factor of 1.41 in std; a std that is
0 in one run only diverges by an infinite amount). The first divergence is the first one
in the order the step computes them: every node's forward in execution order, then every
node's backward in the backward pass's order (execution order reversed). A forward
difference travels forward and a gradient's difference travels backward, so the first one
in that order is where the two runs part: a layer whose weights differ changes its own
forward first, while the gradients of every layer before it change too.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from lightning_scale.dashboard.data import DIRS, RunData
from lightning_scale.dashboard.statistics import is_log2

__all__ = [
    "THRESHOLD",
    "Comparison",
    "Divergence",
    "align",
    "compare",
    "delta",
    "difference_key",
    "listed",
    "log2_stats",
    "matched",
]

#: Octaves of std (``|log2 std of B - log2 std of A|``) beyond which a node direction diverges.
THRESHOLD = 0.5


def difference_key(stat: str, log2: Optional[bool] = None) -> str:
    """The name of ``stat``'s difference: ``log2_std`` for a magnitude (``log2``; None: as the
    package's table declares it), else ``stat``."""
    return f"log2_{stat}" if (is_log2(stat) if log2 is None else log2) else stat


def log2_stats(a: RunData, b: RunData) -> Set[str]:
    """The statistics of either run that are magnitudes (the runs' own declarations first)."""
    meta = {**a.meta, **b.meta}
    return {s for s in {*a.stats, *b.stats} if is_log2(s, meta)}


@dataclass(frozen=True)
class Divergence:
    """Where two runs first part: ``node``'s ``direction`` (``"fwd"`` / ``"bwd"``) at
    ``step_a`` of run A and ``step_b`` of run B, whose log2 std differs by ``difference``
    octaves (B minus A; infinite where one std is 0); ``a`` and ``b``: the two stds."""

    node: str
    direction: str
    step_a: int
    step_b: int
    difference: float
    a: float
    b: float


@dataclass
class Comparison:
    """Run B against run A at one pair of steps, over the nodes both logged.

    ``a[i, d, k]`` / ``b[i, d, k]``: statistic ``stats[k]`` of node ``labels[i]`` in
    direction ``DIRS[d]`` (NaN where not logged); ``difference``: B minus A, in log2 for
    the magnitudes (``log2``; NaN where either is missing).
    """

    step_a: int
    step_b: int
    how: str  # how the steps were aligned, in words
    labels: List[str]  # matched, in run A's execution order
    only_a: List[str]
    only_b: List[str]
    stats: List[str]  # logged by both, std first
    only_a_stats: List[str]
    only_b_stats: List[str]
    parameters: List[str]  # matched labels that are parameters or buffers in either run
    a: np.ndarray
    b: np.ndarray
    difference: np.ndarray
    threshold: float
    first_divergence: Optional[Divergence]
    log2: Set[str] = field(default_factory=set)  # the statistics compared as magnitudes

    def diff(self, stat: str) -> np.ndarray:
        """``[nodes, 2]`` difference of ``stat`` (log2 for magnitudes; all NaN if not compared)."""
        if stat not in self.stats:
            return np.full((len(self.labels), 2), math.nan)
        return self.difference[..., self.stats.index(stat)]

    def rows(self) -> List[Dict[str, Any]]:
        """One row per node and direction that either run logged, in execution order: the two
        runs' statistics as logged (``a``, ``b``) and their differences (``difference``, keyed
        by ``difference_key``); None where missing or not finite."""
        keys = [difference_key(s, s in self.log2) for s in self.stats]
        a, b, diff = listed(self.a), listed(self.b), listed(self.difference)
        logged = (~(np.isnan(self.a).all(-1) & np.isnan(self.b).all(-1))).tolist()  # [nodes][2]
        out = []
        for label, a_i, b_i, diff_i, logged_i in zip(self.labels, a, b, diff, logged):
            for name, a_d, b_d, diff_d, here in zip(DIRS, a_i, b_i, diff_i, logged_i):
                if here:
                    row = {"node": label, "direction": name, "a": dict(zip(self.stats, a_d))}
                    row.update(b=dict(zip(self.stats, b_d)), difference=dict(zip(keys, diff_d)))
                    out.append(row)
        return out

    def summary(self) -> Dict[str, Any]:
        """Everything but the rows, JSON-ready: steps, matched counts, node and statistic lists, divergence."""
        div = self.first_divergence
        return {
            "steps": {"a": self.step_a, "b": self.step_b, "how": self.how},
            "matched": len(self.labels),
            "only_a": self.only_a,
            "only_b": self.only_b,
            "statistics": {"compared": self.stats, "only_a": self.only_a_stats, "only_b": self.only_b_stats},
            "threshold": self.threshold,
            "first_divergence": None if div is None else {k: _clean(v) for k, v in asdict(div).items()},
        }

    def to_json(self) -> Dict[str, Any]:
        """``summary()`` and ``rows()``: what ``lightning-scale compare --json`` prints."""
        return {**self.summary(), "rows": self.rows()}


def align(
    a: RunData,
    b: RunData,
    step: Optional[int] = None,
    steps: Optional[Tuple[int, int]] = None,
    names: Tuple[str, str] = ("A", "B"),
) -> Tuple[int, int, str]:
    """The pair of steps to compare and how it was chosen: ``steps`` as given, else each run's
    latest tracked step at or before ``step``, else the latest step both runs tracked.

    Raises:
        ValueError: both ``step`` and ``steps`` given; a step of ``steps`` its run did not
            track; ``step`` before a run's first tracked step; no ``step`` or ``steps`` and no
            step both runs tracked; a run with no tracked step.
    """
    for run, name in ((a, names[0]), (b, names[1])):
        if not run.steps:
            raise ValueError(f"run {name} tracked no step")
    if step is not None and steps is not None:
        raise ValueError(f"give `step` or `steps`, not both: got step={step} and steps={steps}")
    if steps is not None:
        return _given(a, b, steps, names)
    if step is not None:
        return _at_or_before(a, b, step, names)
    common = sorted(set(a.steps) & set(b.steps))
    if not common:
        raise ValueError(
            f"runs {names[0]} and {names[1]} tracked no step in common ({names[0]}: {_span(a.steps)}; "
            f"{names[1]}: {_span(b.steps)}): pick one with `step` (each run's latest tracked step at or before it) "
            "or a pair with `steps`"
        )
    return common[-1], common[-1], "the latest step both runs tracked"


def _given(a: RunData, b: RunData, steps: Tuple[int, int], names: Tuple[str, str]) -> Tuple[int, int, str]:
    runs = zip((a, b), steps, names)
    missing = [f"run {n} did not track step {s} (it tracked {_span(r.steps)})" for r, s, n in runs if s not in r.steps]
    if missing:
        raise ValueError(f"`steps` must name a step each run tracked, got {steps[0]},{steps[1]}: {'; '.join(missing)}")
    return steps[0], steps[1], "the given steps"


def _at_or_before(a: RunData, b: RunData, step: int, names: Tuple[str, str]) -> Tuple[int, int, str]:
    late = [f"run {n} first tracked step {r.steps[0]}" for r, n in zip((a, b), names) if r.steps[0] > step]
    if late:
        raise ValueError(f"`step` must be at or after each run's first tracked step, got {step}: {'; '.join(late)}")
    picked = [max(s for s in r.steps if s <= step) for r in (a, b)]
    return picked[0], picked[1], f"each run's latest tracked step at or before {step}"


def _span(steps: Sequence[int]) -> str:
    """``"steps 0, 10, 20"`` or, for many, ``"12 steps, 0..110"``."""
    if len(steps) <= 6:
        return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
    return f"{len(steps)} steps, {steps[0]}..{steps[-1]}"


def matched(a: RunData, b: RunData, names: Tuple[str, str] = ("A", "B")) -> List[str]:
    """The labels both runs logged, in run A's execution order.

    Raises:
        ValueError: there is none.
    """
    in_b = set(b.labels)
    labels = [label for label in a.labels if label in in_b]
    if not labels:
        raise ValueError(
            f"runs {names[0]} and {names[1]} have no node in common ({names[0]} logged {len(a.labels)} nodes, "
            f"e.g. {a.labels[:3]}; {names[1]} logged {len(b.labels)}, e.g. {b.labels[:3]})"
        )
    return labels


def compare(
    a: RunData,
    b: RunData,
    step: Optional[int] = None,
    steps: Optional[Tuple[int, int]] = None,
    threshold: float = THRESHOLD,
    names: Tuple[str, str] = ("A", "B"),
) -> Comparison:
    """Run ``b`` against run ``a`` node by node at the steps ``align`` picks.

    Args:
        a, b: the two runs' statistics (``data.load``, ``event_reader.read_runs``).
        step, steps: the steps to compare (see ``align``).
        threshold: octaves of std beyond which a node direction diverges.
        names: what messages call the runs.

    Raises:
        ValueError: ``threshold`` not a positive number; the steps cannot be aligned
            (``align``); the runs have no node in common.

    Example::

        >>> import numpy as np
        >>> std = np.ones((1, 2, 2, 1))  # one step, two nodes, forward and backward, one statistic
        >>> a = RunData(["x", "fc/linear"], set(), [0], ["std"], std)
        >>> b = RunData(["x", "fc/linear"], set(), [0], ["std"], std * np.array([1.0, 8.0]).reshape(1, 2, 1, 1))
        >>> div = compare(a, b).first_divergence
        >>> div.node, div.direction, div.difference
        ('fc/linear', 'fwd', 3.0)
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"`threshold` must be a positive number of octaves, got {threshold!r}")
    step_a, step_b, how = align(a, b, step, steps, names)
    labels, in_b = matched(a, b, names), set(b.labels)
    stats = sorted(set(a.stats) & set(b.stats), key=lambda s: (s != "std", s))
    va, vb = _at(a, step_a, labels, stats), _at(b, step_b, labels, stats)
    log2 = log2_stats(a, b)
    diff = delta(va, vb, np.array([s in log2 for s in stats], dtype=bool))
    in_a = set(labels)
    cmp = Comparison(
        step_a=step_a,
        step_b=step_b,
        how=how,
        labels=labels,
        only_a=[label for label in a.labels if label not in in_b],
        only_b=[label for label in b.labels if label not in in_a],
        stats=stats,
        only_a_stats=sorted(set(a.stats) - set(b.stats)),
        only_b_stats=sorted(set(b.stats) - set(a.stats)),
        parameters=[label for label in labels if label in a.parameters or label in b.parameters],
        a=va,
        b=vb,
        difference=diff,
        threshold=float(threshold),
        first_divergence=None,
        log2=log2,
    )
    cmp.first_divergence = _first_divergence(cmp)
    return cmp


def _at(run: RunData, step: int, labels: List[str], stats: List[str]) -> np.ndarray:
    """``[labels, 2, stats]`` of ``run`` at ``step``."""
    where = {label: i for i, label in enumerate(run.labels)}
    rows = [where[label] for label in labels]
    cols = [run.stats.index(s) for s in stats]
    return run.values[run.steps.index(step)][np.ix_(rows, [0, 1], cols)].astype(np.float64)


def delta(a: np.ndarray, b: np.ndarray, log2: Any) -> np.ndarray:
    """``b - a``, of the log2s where ``log2`` (a bool, or one per value of the last axis) is
    true: 0 where the two are equal (also both 0: log2 -inf), infinite where one std is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        la = np.where(log2, _log2(a), a)
        lb = np.where(log2, _log2(b), b)
        out = lb - la
    return np.where(la == lb, 0.0, out)


def _log2(values: np.ndarray) -> np.ndarray:
    """log2 where >= 0 (0 -> -inf, inf -> inf); NaN where missing or negative."""
    ok = values >= 0
    with np.errstate(divide="ignore"):
        return np.where(ok, np.log2(np.where(ok, values, 1.0)), np.nan)


def _first_divergence(cmp: Comparison) -> Optional[Divergence]:
    """The first node direction past the threshold, forward in execution order then backward in reverse."""
    d = cmp.diff("std")
    passes = np.abs(np.nan_to_num(d, nan=0.0)) > cmp.threshold  # NaN: logged in one run only
    forward, backward = np.flatnonzero(passes[:, 0]), np.flatnonzero(passes[:, 1])
    if forward.size:
        i, k = int(forward[0]), 0
    elif backward.size:
        i, k = int(backward[-1]), 1
    else:
        return None
    std = cmp.stats.index("std")
    return Divergence(
        node=cmp.labels[i],
        direction=DIRS[k],
        step_a=cmp.step_a,
        step_b=cmp.step_b,
        difference=float(d[i, k]),
        a=float(cmp.a[i, k, std]),
        b=float(cmp.b[i, k, std]),
    )


def _clean(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def listed(values: np.ndarray, digits: Optional[int] = None) -> Any:
    """``values.tolist()`` with NaN and infinities as None (rounded to ``digits`` if given)."""
    values = np.asarray(values, dtype=np.float64)
    out = (values if digits is None else np.round(values, digits)).astype(object)
    out[~np.isfinite(values)] = None
    return out.tolist()
