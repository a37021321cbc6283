"""The README: its cost table (``benchmarks/readme_table.py``: the figures of one ``make bench`` run,
written between its markers and nowhere else; the README holds a table in exactly that form) and
its map of the docs (a line for every page)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Dict, List

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


rt = _load("readme_table")  # (the suite's other modules import each other by bare name: see the last test)

COST = rt.Cost(
    date="2031-01-02 03:04",
    machine="a test CPU, 2 cores",
    workload="a GPT of d=128, 4 layers",
    figures={"tracked": 1.1049, "untracked": 1.0004, "whole_fit": 1.0139, "compiled": 1.0751},
    fit_steps=200,
)


def test_the_table_says_the_run_and_lists_the_figures_in_row_order() -> None:
    lines = rt.table(COST).splitlines()
    assert lines[0] == "Measured by `make bench` on 2031-01-02 03:04: a test CPU, 2 cores; a GPT of d=128, 4 layers."
    assert lines[2:4] == ["| what | costs |", "|---|---|"]
    assert lines[4:] == [
        "| an untracked step (`ScaleMonitor` installed, the step not tracked) | 1.000x a plain step |",
        "| a tracked step, `ScaleMonitor()`'s std | 1.10x a plain step |",
        "| a tracked step of a `torch.compile`d model (Inductor) | 1.075x a compiled plain step |",
        "| a whole 200-step fit with `ScaleMonitor()` (every 50th step tracked) | 1.014x a plain fit |",
    ]  # what the run did not measure (every group, fp8, the advisor, memory) is left out


def test_a_figure_under_an_unknown_key_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"`cost.figures` must take its keys from \['untracked', .*\], got \['speed'\]"
    ):
        rt.table(rt.Cost("d", "m", "w", {"speed": 2.0}))


def test_rewrite_touches_only_the_lines_between_the_markers() -> None:
    start, end = rt.MARKERS
    text = f"# Title\n\nbefore\n{start}\nan old table\n| x | 9x |\n{end}\nafter\n"
    once = rt.rewrite(text, COST)
    assert once == f"# Title\n\nbefore\n{start}\n{rt.table(COST)}\n{end}\nafter\n"
    assert rt.rewrite(once, COST) == once
    with pytest.raises(ValueError, match=r"`text` must hold the lines"):
        rt.rewrite("# Title\nno markers\n", COST)


def _readme_cost() -> rt.Cost:
    """The README's table read back into a ``Cost`` (each row's figure under its key)."""
    text = (ROOT / "README.md").read_text()
    start, end = rt.MARKERS
    found = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), text, re.S)
    assert found is not None, "README.md lost its cost markers"
    head, _, *rows = found.group(1).splitlines()
    run = re.fullmatch(r"Measured by `make bench` on (\d{4}-\d\d-\d\d \d\d:\d\d): (.+?); (.+)\.", head)
    assert run is not None, head
    steps = re.search(r"a whole (\d+)-step fit", found.group(1))
    cost = rt.Cost(run[1], run[2], run[3], fit_steps=int(steps[1]) if steps else 0)
    labels = {what.format(fit_steps=cost.fit_steps): key for key, (what, _) in rt.ROWS.items()}
    for row in rows[2:]:
        what, figure = row.strip("| ").split(" | ")
        cost.figures[labels[what]] = float(figure.split("x ")[0])
    return cost


def test_the_readme_holds_a_table_as_the_writer_writes_it() -> None:
    cost = _readme_cost()
    assert len(cost.figures) >= 5  # the main figures of a run are there
    assert rt.rewrite((ROOT / "README.md").read_text(), cost) == (ROOT / "README.md").read_text()


def _samples(cpu: List[float]) -> SimpleNamespace:
    return SimpleNamespace(cpu=cpu, wall=cpu, clock=lambda name: cpu)


def test_costs_takes_each_figure_from_its_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import render
    from fit_loop import TrackedFits
    from timing import Summary
    from workload import MAIN

    machine = {"date": "2031-01-02 03:04", "cpu": "CPU X", "cores": "2", "memory": "8 GiB", "torch": "2.13.0"}
    res = render.Results(machine, "make bench", [MAIN], {})
    res.fit = {"cpu": {"fit": Summary.of([0.100, 0.102, 0.098]), "fit_monitor": Summary.of([0.101, 0.099, 0.101])}}
    kinds: Dict[str, List[float]] = {
        "plain": [0.08, 0.08],
        "tracked": [0.088],
        "tracked_all": [0.1],
        "tracked_fp8": [0.12],
    }
    res.tracked = TrackedFits(5, 2, 45, 200, 5, steps_by_kind={k: _samples(v) for k, v in kinds.items()})
    res.tracked.totals = {"fit": _samples([16.0, 16.2, 15.8]), "fit_default": _samples([16.3, 16.1, 16.2])}
    res.memory[MAIN] = {"plain": [{"steps_kb": 100}], "tracked": [{"steps_kb": 103}]}
    advise = SimpleNamespace(ratio=lambda kind, step: {("advise", "tracked"): 7.5}[(kind, step)])
    cost = rt.costs(res, SimpleNamespace(tracked_ratio=1.075), advise)
    assert cost.date == "2031-01-02 03:04" and cost.machine.startswith("CPU X, 2 cores") and cost.fit_steps == 200
    want = {
        "untracked": 0.101 / 0.100,
        "tracked": 1.1,
        "tracked_all": 1.25,
        "tracked_fp8": 1.5,
        "whole_fit": 16.2 / 16.0,
        "advise": 7.5,
        "compiled": 1.075,
        "memory": 1.03,
    }
    assert cost.figures == pytest.approx(want, rel=1e-12)
    res.fit, res.tracked, res.memory = None, None, {}
    assert list(rt.costs(res).figures) == []  # nothing measured: no row


def test_the_readme_maps_every_page_of_the_docs_once() -> None:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Documentation") :]
    listed = re.findall(r"^- \[docs/([\w-]+\.md)\]\(docs/\1\): \S", section, re.M)
    assert sorted(listed) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))
