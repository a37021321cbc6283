"""The run comparison's cost: ``lightning-scale compare`` on two runs of 10,000 nodes x 100
tracked steps, and the SCALES Compare view's server and drawing time at 2,000 nodes x 100 steps.

    python benchmarks/compare_cost.py [--quick] [--out section.md]

The runs are synthetic (``tools/synthetic.py``'s labels and records) but written through the
real writer (``ScaleWriter``) with ``ScaleMonitor``'s defaults where they matter:
``max_tags=1000`` per-node scalars, histograms, the summary counts and the records, statistics
std and absmax. Run B is run A with every node of the second half 2x larger (one octave).

The command: wall time of ``python -m lightning_scale.tools.cli compare A B --json`` as a
process (what a user waits), and inside one process the part that is the comparison's own:
reading both runs (``event_reader.read_run``), comparing, and printing the JSON and the table;
importing the package is the rest. The view: a real ``tensorboard`` and headless Chromium (as
``dashboard_load.py``); server time is one route's answer over HTTP with the runs already read,
drawing time is from moving the step slider to the view drawn with every node (a fresh fetch
and draw), for the Profile view and for the Compare view, in turns.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import workload  # noqa: F401 - first: puts the checkout's package on sys.path

import torch

from lightning_scale.record import stats
from lightning_scale.report.event_file import EventFile
from lightning_scale.report.tensorboard import ScaleWriter
from lightning_scale.report.values import StepValues
from lightning_scale.tools.synthetic import labels_of, records_of

ROOT = Path(__file__).resolve().parents[1]
COMMAND_NODES, VIEW_NODES, STEPS = 10_000, 2_000, 100
COMMAND_TARGET_S = 2.0


#: (wall seconds, CPU seconds) of one measurement, or the medians of several.
Clock = Tuple[float, float]


@dataclass
class CompareCost:
    """What one run of this benchmark measured: ``command`` holds (wall, CPU) medians of
    ``repeats``: ``process`` (the whole command as a process), ``import`` (importing the
    package's command in a fresh process), ``json`` and ``table`` (the command's own work in
    one process: reading both runs, comparing, printing), ``read`` (reading both runs)."""

    nodes: int
    steps: int
    repeats: int
    file_mb: float  # one run's event files
    command: Dict[str, Clock]
    view: Dict[str, float] = field(default_factory=dict)  # wall seconds
    load: str = "?"

    def line(self) -> str:
        command = ", ".join(f"{k} {w:.2f} s ({c:.2f} s CPU)" for k, (w, c) in self.command.items())
        view = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.view.items())
        return f"compare {self.nodes} nodes x {self.steps} steps: {command}; view: {view}"


def write_run(folder: Path, nodes: int, steps: int, factor: float = 1.0) -> Path:
    """``nodes`` synthetic nodes over ``steps`` tracked steps (every 50th step) into ``folder``;
    ``factor`` multiplies the second half's stds and absmaxes."""
    file = EventFile(str(folder), warn=print)
    labels = labels_of(nodes)
    writer = ScaleWriter(
        [file],
        statistics=["std", "absmax"],
        figure=False,
        parameters=[label for label in labels if "/" not in label],
        max_tags=1000,
    )
    m2, absmax = stats.FIELDS.index("m2"), stats.FIELDS.index("absmax")
    for k in range(steps):
        records = records_of(nodes, k, seed=k)
        records[nodes // 2 :, :, m2] *= factor**2
        records[nodes // 2 :, :, absmax] *= factor
        writer.write(k * 50, labels, StepValues(records))
        writer.flush()
    file.close()
    return folder


def _medians(samples: List[Clock]) -> Clock:
    return statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)


def _clocked(fn: Callable[[], Any]) -> Clock:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _process(args: List[str]) -> Clock:
    """Wall time and the child's CPU time (user + system) of ``python *args``."""

    def used() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    cpu, wall = used(), time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - wall, used() - cpu


def command_times(a: Path, b: Path, repeats: int) -> Dict[str, Clock]:
    """The command as a process, the package import alone, and the command's own work in this
    process (``--json``, then the table): reading both runs, comparing, printing."""
    from lightning_scale.dashboard.event_reader import read_run
    from lightning_scale.tools.cli import parser

    def inside(*extra: str) -> None:
        args = parser().parse_args(["compare", str(a), str(b), *extra])
        with contextlib.redirect_stdout(io.StringIO()):
            args.run(args)

    cmd = ["-m", "lightning_scale.tools.cli", "compare", str(a), str(b), "--json"]
    jobs: Dict[str, Callable[[], Clock]] = {
        "process": lambda: _process(cmd),
        "import": lambda: _process(["-c", "import lightning_scale.tools.cli"]),
        "json": lambda: _clocked(lambda: inside("--json")),
        "table": lambda: _clocked(inside),
        "read": lambda: _clocked(lambda: (read_run(a), read_run(b))),
    }
    samples: Dict[str, List[Clock]] = {k: [] for k in jobs}
    for _ in range(repeats):  # interleaved: a busy spell of the machine spreads over every measure
        for name, job in jobs.items():
            samples[name].append(job())
    return {k: _medians(v) for k, v in samples.items()}


def _get(url: str) -> float:
    t0 = time.perf_counter()
    json.load(urllib.request.urlopen(url, timeout=120))
    return time.perf_counter() - t0


def view_times(logdir: Path, repeats: int) -> Dict[str, Any]:
    """Server time of /profile and /compare (runs already read) and, in Chromium, the time from a
    step change to the Profile view and to the Compare view drawn with every node."""
    from playwright.sync_api import sync_playwright

    from dashboard_load import CHROMIUM, serve

    proc, url = serve(str(logdir))
    base = f"{url}/data/plugin/scales"
    try:
        q = urllib.parse.urlencode({"run": "a", "other": "b"})
        out: Dict[str, Any] = {"first compare (reads run B)": _get(f"{base}/compare?{q}")}
        steps = json.load(urllib.request.urlopen(f"{base}/profile?run=a", timeout=120))["steps"]
        picks = [steps[(7 * k) % len(steps)] for k in range(repeats)]
        out["server /profile"] = statistics.median(_get(f"{base}/profile?run=a&step={s}") for s in picks)
        out["server /compare"] = statistics.median(_get(f"{base}/compare?{q}&step={s}") for s in picks)
        out["server /heatmap"] = statistics.median(_get(f"{base}/heatmap?run=a") for _ in range(repeats))
        out["server /compare_heatmap"] = statistics.median(_get(f"{base}/compare_heatmap?{q}") for _ in range(repeats))
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            out.update(_drawing(browser, url, steps, repeats))
            browser.close()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    return out


def _drawing(browser: Any, url: str, steps: List[int], repeats: int) -> Dict[str, float]:
    page = browser.new_page(viewport={"width": 1500, "height": 950})
    page.goto(f"{url}/#scales")
    page.wait_for_function("[...document.querySelectorAll('iframe')].some((f) => f.src.includes('name=scales'))")
    frame = next(f for f in page.frames if "name=scales" in f.url)
    frame.wait_for_selector("svg.profile g.node", timeout=120_000)
    times: Dict[str, List[float]] = {"draw profile (step change)": [], "draw compare (step change)": []}
    views = (("profile", "svg.profile g.node"), ("compare", "svg.compare g.cmp-node"))
    for k in range(repeats):
        index = (5 * k + 3) % len(steps)
        for view, selector in views:
            frame.click(f"button[data-view={view}]")
            frame.wait_for_selector(selector, timeout=120_000)
            frame.evaluate("document.querySelector('#view').innerHTML = ''")  # the next draw is seen
            t0 = time.perf_counter()
            frame.eval_on_selector("#step", f"s => {{ s.value = {index}; s.dispatchEvent(new Event('input')); }}")
            frame.wait_for_selector(selector, timeout=120_000)
            times[f"draw {view} (step change)"].append(time.perf_counter() - t0)
    page.close()
    return {k: statistics.median(v) for k, v in times.items()}


def measure(quick: bool = False) -> CompareCost:
    """Write the runs (in a temporary folder), time the command and the view."""
    from timing import load_average

    repeats = 2 if quick else 5
    steps = 10 if quick else STEPS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = write_run(root / "cmd" / "a", COMMAND_NODES, steps)
        b = write_run(root / "cmd" / "b", COMMAND_NODES, steps, factor=2.0)
        size = sum(f.stat().st_size for f in a.iterdir()) / 1e6
        times = command_times(a, b, repeats)
        write_run(root / "view" / "a", VIEW_NODES, steps)
        write_run(root / "view" / "b", VIEW_NODES, steps, factor=2.0)
        view = view_times(root / "view", repeats)
    return CompareCost(COMMAND_NODES, steps, repeats, size, times, view=view, load=load_average())


def section(cost: CompareCost) -> str:
    """The benchmark page's section on the run comparison (targets judged on CPU time, as the
    page's step times: on this shared machine other jobs inflate wall times)."""

    def row(what: str, key: str, target: bool = False) -> str:
        wall, cpu = cost.command[key]
        verdict = ("**yes**" if cpu <= COMMAND_TARGET_S else "MISSED") if target else ""
        return f"| {what} | {cpu:.2f} s | {wall:.2f} s | {f'<= {COMMAND_TARGET_S:g} s' if target else ''} | {verdict} |"

    size = f"{cost.nodes} nodes x {cost.steps} steps ({cost.file_mb:.0f} MB a run)"
    rows = [
        "## The run comparison (`lightning-scale compare`, the Compare view)",
        "",
        f"`python benchmarks/compare_cost.py`: synthetic runs written through `ScaleWriter` with `ScaleMonitor`'s "
        f"defaults (`max_tags=1000` scalars, histograms, records; std and absmax), run B = run A with half its "
        f"nodes one octave larger; medians of {cost.repeats} interleaved repeats; load average {cost.load}. "
        "Targets are judged on CPU time (the process's own, or the child's), wall time beside it.",
        "",
        "| measure | CPU | wall | target | met |",
        "|---|---|---|---|---|",
        row(f"`lightning-scale compare A B --json`, {size}, the whole process", "process", True),
        row("`python -c 'import lightning_scale.tools.cli'` (numpy; not torch or Lightning)", "import"),
        row("the command's own work in one process: reading both runs, comparing, printing the JSON", "json", True),
        row("the same, printing the table", "table"),
        row("of which: reading both runs (`dashboard/event_reader.py`)", "read"),
        "",
        "The whole process is the command's import and its own work; neither imports torch, Lightning or "
        "TorchDynamo (the statistic table the comparison reads imports torch only where a value is computed).",
        "",
        f"The Compare view at {VIEW_NODES} nodes x {cost.steps} steps, against the Profile view (wall time: a real "
        "`tensorboard --load_fast=false` and headless Chromium; server: one route's answer over HTTP with both runs "
        "already read; drawing: from a move of the step slider to the view drawn with every node, a fresh fetch "
        "included):",
        "",
        "| measure | wall |",
        "|---|---|",
        *[f"| {name} | {value * 1e3:.0f} ms |" for name, value in cost.view.items()],
    ]
    return "\n".join(rows)


def main(argv: List[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 steps, 2 repeats (checks the script)")
    parser.add_argument("--out", help="also write the markdown section here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cost = measure(args.quick)
    print(cost.line(), file=sys.stderr)
    text = section(cost)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
