"""The CPU benchmark suite: ``make bench`` (``python benchmarks/run.py --out docs/benchmarks.md``).

Step time of every variant at three GPT sizes (interleaved rounds), untracked and tracked
steps in a real Trainer fit loop, whole fits with ``ScaleMonitor()``'s defaults, peak memory
in fresh processes, and capture time of a 12-layer GPT, and the accelerator path's cost of
one record per statistic group and kernel (Triton's fused kernel or torch's;
``kernel_ops``), the compiled route's cost on a compiled GPT (``compiled_cost``), the run
comparison's: the command and the Compare view (``compare_cost``), and the precision advisor's
tracked step (``advise_cost``). Prints a markdown page and writes it to ``--out``; with ``--out``
(and without ``--quick``) it also rewrites the README's cost table from the same results
(``readme_table``). ``--quick`` runs a few rounds of everything, to check the suite itself
(minutes matter on a 2-core machine).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

import workload  # noqa: F401 - first: puts the checkout's package on sys.path
import advise_cost
import anomaly_cost
import breakdown
import capture_time
import compare_cost
import compiled_cost
import format_bytes
import kernel_ops
import fit_loop
import memory
import probe_cost
import readme_table
import render
from lightning_scale.record import native
from timing import CLOCKS, Summary, between_noise_floor, interleaved, load_average, noise_floor
from workload import MAIN, SIZES, VARIANTS, Size, Workload

#: By model width: (most rounds, wall-time budget in seconds). Each size stops at its
#: budget (after at least 6 rounds), so a loaded machine cannot stretch the suite past
#: about 10 minutes (with the tracked fits below); the page reports the rounds done.
ROUNDS = {64: (60, 20.0), 128: (30, 45.0), 256: (14, 60.0)}
QUICK_ROUNDS = {64: (4, None), 128: (3, None), 256: (2, None)}
FIT_ROUNDS, FIT_STEPS, FIT_DEADLINE_S = 6, 30, 270.0  # fit rounds stop FIT_DEADLINE_S into the run
#: Tracked steps in a Trainer fit, and whole fits with ScaleMonitor()'s defaults: at most
#: TRACKED_ROUNDS rounds (each ~65 s on an idle 2-core machine: five 45-step fits tracking
#: every 5th step, two 200-step fits), no new round after TRACKED_BUDGET_S (at least two
#: rounds). Three rounds: the std goal's margin is about the noise of two (0.01-0.02).
TRACKED_ROUNDS, TRACKED_STEPS, WHOLE_STEPS, TRACKED_BUDGET_S = 3, 45, 200, 150.0
#: Untracked steps with anomaly detection and update ratios on: at most
#: ANOMALY_ROUNDS rounds of three 30-step fits (~15 s each), none new after ANOMALY_BUDGET_S.
ANOMALY_ROUNDS, ANOMALY_STEPS, ANOMALY_BUDGET_S = 3, 30, 40.0


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> Dict[str, str]:
    cpu, cores, mem = render.machine_info()
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cores": cores,
        "memory": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": _version("lightning"),
        "unit_scaling": _version("unit-scaling"),
        "native": (native.load(), native.status())[1],
    }


def step_times(res: render.Results, size: Size, rounds: int, budget_s: Optional[float]) -> None:
    work = Workload(size)
    steps = {}
    for variant in VARIANTS:
        try:
            steps[variant] = work.step(variant)
        except ImportError as err:  # the reference needs the `bench` extra
            res.missing[variant] = f'{err}; `pip install "lightning-scale[bench]"`'
    samples = interleaved(steps, rounds, budget_s=budget_s, min_rounds=min(6, rounds))
    res.steps[size] = {clock: {name: Summary.of(t.clock(clock)) for name, t in samples.items()} for clock in CLOCKS}
    res.rounds[size] = len(samples["plain"].wall)
    res.noise[size] = {clock: noise_floor(samples["plain"].clock(clock)) for clock in CLOCKS}
    _log(
        f"{size.name}, {res.rounds[size]} rounds: "
        + ", ".join(f"{k} {render.ratio(res, size, k):.2f}x" for k in samples)
    )


def fit_times(res: render.Results, quick: bool, elapsed: float) -> None:
    try:
        if quick:
            samples, hooks = fit_loop.measure(MAIN, rounds=2, steps=12)
        else:
            budget = max(10.0, FIT_DEADLINE_S - elapsed)
            samples, hooks = fit_loop.measure(MAIN, rounds=FIT_ROUNDS, steps=FIT_STEPS, budget_s=budget)
    except Exception as err:  # noqa: BLE001 - an unfinished callback must not sink the suite
        res.fit_missing = (
            f"the fit loop with `ScaleMonitor` failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        )
        return
    res.fit = {
        clock: {name: Summary.of([t for fit in fits for t in fit.clock(clock)]) for name, fits in samples.items()}
        for clock in CLOCKS
    }
    res.fit_noise = {clock: between_noise_floor([fit.clock(clock) for fit in samples["fit"]]) for clock in CLOCKS}
    res.fit_rounds = len(samples["fit"])
    res.fit_hooks = statistics.median(hooks)
    _log(f"fit loop: monitor {render.fit_ratio(res):.3f}x CPU, {render.fit_ratio(res, 'wall'):.3f}x wall")


def tracked_fit_times(res: render.Results, quick: bool) -> None:
    try:
        if quick:
            res.tracked = fit_loop.measure_tracked(MAIN, rounds=2, steps=20, whole_steps=60)
        else:
            res.tracked = fit_loop.measure_tracked(
                MAIN, rounds=TRACKED_ROUNDS, steps=TRACKED_STEPS, whole_steps=WHOLE_STEPS, budget_s=TRACKED_BUDGET_S
            )
    except Exception as err:  # noqa: BLE001 - a failing callback must not sink the suite
        res.tracked_missing = (
            f"the fit loop with `ScaleMonitor` failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        )
        return
    t = res.tracked
    _log(
        f"tracked fit steps: std {render.tracked_ratio(t, 'tracked'):.2f}x CPU "
        f"{render.tracked_ratio(t, 'tracked', clock='wall'):.2f}x wall, "
        f"every group {render.tracked_ratio(t, 'tracked_all'):.2f}x CPU "
        f"{render.tracked_ratio(t, 'tracked_all', clock='wall'):.2f}x wall, "
        f"after it {render.tracked_ratio(t, 'after_all'):.2f}x CPU, after std "
        f"{render.tracked_ratio(t, 'after_tracked'):.2f}x CPU, "
        f"fp8 {render.tracked_ratio(t, 'tracked_fp8'):.2f}x CPU, torch kernels "
        f"{render.tracked_ratio(t, 'tracked_torch'):.2f}x CPU, "
        f"with the figure {render.tracked_ratio(t, 'tracked_figure'):.2f}x; "
        f"whole {t.whole_steps}-step fit with ScaleMonitor(): {render.whole_ratio(t):.3f}x CPU ({t.rounds} rounds, "
        f"{t.seconds:.0f} s)"
    )


def tracked_profiles(res: render.Results, quick: bool) -> None:
    try:
        for statistics_ in (["std"], fit_loop.EVERY_GROUP):
            res.profiles.append(fit_loop.profile_tracked(MAIN, statistics_, steps=6 if quick else 12))
    except Exception as err:  # noqa: BLE001 - a failing callback must not sink the suite
        _log(f"profile failed: {type(err).__name__}: {err}")
        return
    res.recorded = fit_loop.recorded_elements(MAIN)
    res.breakdowns = [breakdown.measure(MAIN, s, steps=8 if quick else 14) for s in (["std"], fit_loop.EVERY_GROUP)]
    for b in res.breakdowns:
        _log(
            f"CPU breakdown ({len(b.statistics)} statistics): "
            + ", ".join(f"{k.split(' (')[0]} {v:.2f} ms" for k, v in b.ms.items())
        )
    for p in res.profiles:
        _log(
            f"profile ({len(p.statistics)} statistics): "
            + ", ".join(f"{k.split(' (')[0]} {v:.2f} ms" for k, v in p.parts.items())
            + f", writer {p.writer_ms:.2f} ms"
        )


def anomaly_times(res: render.Results, quick: bool) -> None:
    try:
        if quick:
            res.anomaly = anomaly_cost.measure(rounds=2, steps=12)
        else:
            res.anomaly = anomaly_cost.measure(ANOMALY_ROUNDS, ANOMALY_STEPS, budget_s=ANOMALY_BUDGET_S)
    except Exception as err:  # noqa: BLE001 - a failing callback must not sink the suite
        res.anomaly_missing = f"the fit loop failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return
    a = res.anomaly
    _log(
        f"untracked with anomaly_steps and update_ratios: {a.ratio('on'):.3f}x CPU, hooks {a.hook_ratio('on'):.4f}x "
        f"({a.rounds} rounds)"
    )


def memory_peaks(res: render.Results, quick: bool) -> None:
    reps = {size: 3 if size == MAIN and not quick else 1 for size in SIZES}
    jobs = [(s.dim, s.layers, v) for s in SIZES for _ in range(reps[s]) for v in render.VARIANTS_MEMORY]
    res.memory_steps = 3 if quick else 4
    peaks = memory.measure(jobs, steps=res.memory_steps)
    for size in SIZES:
        res.memory[size] = {
            v: [p for job, p in zip(jobs, peaks) if job == (size.dim, size.layers, v)] for v in render.VARIANTS_MEMORY
        }
        _log(
            f"memory {size.name}: steps {render.memory_ratio(res, size, 'steps_kb'):.3f}x, training with the capture "
            f"{render.memory_ratio(res, size, 'training_kb'):.3f}x, steps of a shadow pass "
            f"{render.memory_ratio(res, size, 'steps_kb', 'shadow'):.3f}x"
        )


def accelerator_costs() -> str:
    """The accelerator path's cost of one record per group and kernel (``kernel_ops``)."""
    try:
        res = kernel_ops.measure()
    except Exception as err:  # noqa: BLE001 - e.g. triton not installed: say so, keep the suite
        title = "## Accelerator path: cost of one record, per kernel"
        return f"{title}\n\nNot measured: {type(err).__name__}: {str(err)[:300]}"
    for key, r in res.items():
        _log(
            f"record on the accelerator path, {key}: {r['ops']} aten ops, {r['full']} full-size, {r['launches']} "
            f"Triton launches, {r['bytes']:.2f} B/element"
        )
    return kernel_ops.section(res)


def compiled_route(quick: bool) -> Tuple[str, Optional[compiled_cost.CompiledCost]]:
    """The compiled route's section (``compiled_cost``): tracked / plain compiled steps, idle, compile time;
    and the figures (None where not measured)."""
    try:
        cost = compiled_cost.measure(quick=quick)
    except Exception as err:  # noqa: BLE001 - e.g. no C++ compiler for Inductor: say so, keep the suite
        title = "## The compiled route (a compiled GPT, Inductor on the CPU)"
        return f"{title}\n\nNot measured: {type(err).__name__}: {str(err).splitlines()[0][:300]}", None
    _log(cost.line())
    return compiled_cost.section(cost), cost


def run_comparison(quick: bool) -> str:
    """The run comparison's section (``compare_cost``): the command at 10,000 nodes, the Compare view at 2,000."""
    try:
        cost = compare_cost.measure(quick=quick)
    except Exception as err:  # noqa: BLE001 - e.g. no Chromium for the view: say so, keep the suite
        title = "## The run comparison (`lightning-scale compare`, the Compare view)"
        return f"{title}\n\nNot measured: {type(err).__name__}: {str(err).splitlines()[0][:300]}"
    _log(cost.line())
    return compare_cost.section(cost)


def row_labels() -> Dict[str, str]:
    """Variant -> row label, in table order: the Trainer fit rows after the tracked ones."""
    ours = [k for k in VARIANTS if k not in ("reference", "interpreter")]
    order = ours + [*render.TRACKED_FIT, render.UNTRACKED, "reference", "interpreter"]
    labels = {
        **VARIANTS,
        "fit_tracked": "tracked step in a Trainer fit, `ScaleMonitor(every_n_steps=5)`, no figure",
        "fit_tracked_all": "tracked step in a Trainer fit, every statistic group (moments, range, formats), no figure",
        "fit_tracked_fp8": "tracked step in a Trainer fit, std and the `fp8` what-if, no figure",
        "fit_tracked_figure": "tracked step in a Trainer fit, `ScaleMonitor(every_n_steps=5)`, drawing the figure",
        "fit_tracked_torch": (
            "tracked step in a Trainer fit, `ScaleMonitor(every_n_steps=5)`, no figure, "
            "torch's kernels (native kernel off)"
        ),
        render.UNTRACKED: "untracked step, `ScaleMonitor(every_n_steps=10**9)` installed",
    }
    return {k: labels[k] for k in order}


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown page here as well")
    parser.add_argument("--quick", action="store_true", help="a few rounds only (checks the suite, not the code)")
    parser.add_argument(
        "--readme",
        type=Path,
        help="rewrite the cost table of this README (default with --out, without --quick: the checkout's README.md)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    command = "make bench" if not args.quick else "python benchmarks/run.py --quick"
    res = render.Results(machine(), command, SIZES, row_labels())
    load_start = load_average()
    for size in SIZES:
        step_times(res, size, *(QUICK_ROUNDS if args.quick else ROUNDS)[size.dim])
        gc.collect()
    fit_times(res, args.quick, time.perf_counter() - start)
    tracked_fit_times(res, args.quick)
    tracked_profiles(res, args.quick)
    anomaly_times(res, args.quick)
    res.format_bytes = format_bytes.measure()
    kernel_section = accelerator_costs()
    memory_peaks(res, args.quick)
    res.capture = capture_time.measure(Size(128, 12), fx_repeats=5, dynamo_repeats=2 if args.quick else 3)
    _log(f"capture: fx {res.capture.fx_median:.3f} s, dynamo {res.capture.dynamo_median:.2f} s")
    try:  # the fidelity probe's one-off cost: demo GPT, and GPT-2 small (skipped by --quick)
        models = ["demo GPT"] if args.quick else list(probe_cost.MODELS)
        res.probe = [probe_cost.measure(name, probe_cost.MODELS[name], 2) for name in models]
    except Exception as err:  # noqa: BLE001 - e.g. transformers missing: the page says so
        res.probe_missing = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    compiled_section, compiled = compiled_route(args.quick)
    compare_section = run_comparison(args.quick)
    advice = advise_cost.measure(quick=args.quick)
    advise_section = advise_cost.section(advice)
    res.seconds = time.perf_counter() - start
    res.load = (load_start, load_average())
    sections = [render.page(res), kernel_section, compiled_section, compare_section, advise_section]
    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    readme = args.readme or (Path(workload.ROOT) / "README.md" if args.out and not args.quick else None)
    if readme is not None:
        readme_table.write(readme, readme_table.costs(res, compiled, advice))
        _log(f"cost table rewritten in {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
