"""The README's cost table: a few figures of one ``make bench`` run, with its machine and date.

``run.py`` measures, writes docs/benchmarks.md, then builds a ``Cost`` from the same results
(``costs``) and rewrites the table in README.md between ``MARKERS`` (``write``). Nothing else
of the README is touched, and a figure the run did not measure is left out of the table, so
every number in it comes from that one run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

#: The lines around the table in README.md.
MARKERS = (
    "<!-- cost: written by `make bench` (benchmarks/readme_table.py) from the run of docs/benchmarks.md; "
    "do not edit by hand -->",
    "<!-- end of cost -->",
)
#: Row key -> (what, how its figure reads); the table's rows in this order.
ROWS: Dict[str, Tuple[str, str]] = {
    "untracked": ("an untracked step (`ScaleMonitor` installed, the step not tracked)", "{:.3f}x a plain step"),
    "tracked": ("a tracked step, `ScaleMonitor()`'s std", "{:.2f}x a plain step"),
    "tracked_all": ("a tracked step, every statistic group (moments, range, formats)", "{:.2f}x a plain step"),
    "tracked_fp8": ("a tracked step, std and the per-tensor FP8 what-if", "{:.2f}x a plain step"),
    "advise": ("a tracked step with `advise=True` (the precision advisor)", "{:.2f}x a plain step"),
    "compiled": ("a tracked step of a `torch.compile`d model (Inductor)", "{:.3f}x a compiled plain step"),
    "whole_fit": (
        "a whole {fit_steps}-step fit with `ScaleMonitor()` (every 50th step tracked)",
        "{:.3f}x a plain fit",
    ),
    "memory": ("peak memory of tracked steps", "{:.3f}x a plain step's"),
}


@dataclass
class Cost:
    """One run's figures for the README: where and when it ran, on what, and the ratios by row key."""

    date: str
    machine: str
    workload: str
    figures: Dict[str, float] = field(default_factory=dict)
    fit_steps: int = 0  # the whole fit's steps


def table(cost: Cost) -> str:
    """The markdown the README holds between ``MARKERS``: a line with the run, then the table.

    Raises:
        ValueError: a figure under a key ``ROWS`` does not have.
    """
    unknown = sorted(set(cost.figures) - set(ROWS))
    if unknown:
        raise ValueError(f"`cost.figures` must take its keys from {list(ROWS)}, got {unknown}")
    lines = [
        f"Measured by `make bench` on {cost.date}: {cost.machine}; {cost.workload}.",
        "",
        "| what | costs |",
        "|---|---|",
    ]
    for key, (what, how) in ROWS.items():
        if key in cost.figures:
            lines.append(f"| {what.format(fit_steps=cost.fit_steps)} | {how.format(cost.figures[key])} |")
    return "\n".join(lines)


def rewrite(text: str, cost: Cost) -> str:
    """``text`` (README.md) with the lines between ``MARKERS`` replaced by ``table(cost)``.

    Raises:
        ValueError: ``text`` lacks the markers.
    """
    start, end = MARKERS
    found = re.search(re.escape(start) + r"\n.*?" + re.escape(end), text, re.S)
    if found is None:
        raise ValueError(f"`text` must hold the lines {start!r} and {end!r}")
    return text[: found.start()] + f"{start}\n{table(cost)}\n{end}" + text[found.end() :]


def write(readme: Path, cost: Cost) -> None:
    """Rewrite the cost table of the README at ``readme`` in place."""
    readme.write_text(rewrite(readme.read_text(encoding="utf-8"), cost), encoding="utf-8")


def costs(res: Any, compiled: Optional[Any] = None, advise: Optional[Any] = None) -> Cost:
    """The README's figures from one run: ``res`` (``render.Results``), ``compiled``
    (``compiled_cost.CompiledCost``) and ``advise`` (``advise_cost.AdviseCost``); what a part
    did not measure is left out."""
    import render  # (the suite's modules: imported here, so the table's code stays light)
    from workload import MAIN

    m = res.machine
    cost = Cost(
        date=m["date"],
        machine=f"{m['cpu']}, {m['cores']} cores (torch on 1 thread), {m['memory']} memory, torch {m['torch']}",
        workload=f"a GPT of {MAIN.name}, a batch of {MAIN.batch} x {MAIN.seq} tokens, process CPU time, medians",
    )
    found: List[Tuple[str, Any]] = []
    if res.fit is not None:
        found.append(("untracked", render.fit_ratio(res)))
    if res.tracked is not None:
        t = res.tracked
        found += [(key, render.tracked_ratio(t, key)) for key in ("tracked", "tracked_all", "tracked_fp8")]
        found.append(("whole_fit", render.whole_ratio(t)))
        cost.fit_steps = t.whole_steps
    if advise is not None:
        found.append(("advise", advise.ratio("advise", "tracked")))
    if compiled is not None:
        found.append(("compiled", compiled.tracked_ratio))
    if MAIN in res.memory:
        found.append(("memory", render.memory_ratio(res, MAIN, "steps_kb")))
    cost.figures = {key: float(value) for key, value in found}
    return cost
