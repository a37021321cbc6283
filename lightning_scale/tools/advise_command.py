"""``lightning-scale advise``: a per-layer low-precision recipe from a run's measured GEMMs.

Reads the precision advisor's statistics (``ScaleMonitor(advise=True)``) of one run through
TensorBoard's data provider (``dashboard.logdir.LogDir``), decides every linear layer for the
target recipe (``dashboard.advice.advise``), prints one line per layer (its format, worst
GEMM SNRs, the reason) and, with ``--out DIR``, writes ``recipe.json`` and
``torchao_recipe.py`` there (``recipe_export``).

Example::

    lightning-scale advise lightning_logs --recipe fp8-rowwise --out advice
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict

from lightning_scale.dashboard import advice_log
from lightning_scale.dashboard.logdir import LogDir

__all__ = ["add_advise"]


def add_advise(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``advise`` subcommand."""
    p = sub.add_parser(
        "advise",
        help="advise a per-layer low-precision recipe from a run's measured GEMMs",
        description="For every linear layer of a run tracked with ScaleMonitor(advise=True): the target recipe, or "
        "high precision (keep) where any of its GEMM results falls below the thresholds at a tracked step; "
        "with --out, write recipe.json and torchao_recipe.py there.",
    )
    p.add_argument("logdir", metavar="LOGDIR", help="a TensorBoard log directory, or one run's directory")
    p.add_argument("--run", dest="run_name", default=None, metavar="RUN", help="the run (default: the only one)")
    p.add_argument("--recipe", default="fp8-tensorwise", help="fp8-tensorwise (default), fp8-rowwise or mxfp8")
    p.add_argument("--out", default=None, metavar="DIR", help="write recipe.json and torchao_recipe.py into DIR")
    p.add_argument(
        "--snr-db",
        type=float,
        default=advice_log.DEFAULT_SNR_DB,
        help="least SNR of a GEMM result, in dB (default: %(default)s)",
    )
    p.add_argument(
        "--flushed",
        type=float,
        default=advice_log.DEFAULT_FLUSHED,
        help="most of an operand's nonzero values flushed to zero, a fraction (default: %(default)s)",
    )
    p.set_defaults(run=_advise)


def _advise(args: argparse.Namespace) -> int:
    from lightning_scale.dashboard import advice  # (torch: imported when the command runs)
    from lightning_scale.tools.recipe_export import write_exports

    recipe = advice.check_recipe_name(args.recipe)
    limits = advice.Thresholds(snr_db=args.snr_db, flushed=args.flushed)
    logs = LogDir(args.logdir)
    name = logs.run_name(args.run_name)
    from tensorboard.context import RequestContext

    measured = advice_log.read(logs.provider, RequestContext(), "", name)
    if measured is None:
        raise ValueError(
            f"run {name!r} under `{args.logdir}` holds no precision-advisor statistics: train it with "
            "`ScaleMonitor(advise=True)`"
        )
    result = advice.advise(measured, recipe, limits)
    _print(result)
    if args.out is not None:
        for path in write_exports(result, Path(args.out), {"logdir": str(args.logdir), "run": name}):
            print(f"wrote {path}")
    return 0


def _print(result: Dict[str, Any]) -> None:
    layers = result["layers"]
    width = max((len(n) for n in layers), default=5)
    print(f"{'layer':{width}}  {'format':14}  forward  in_grad  w_grad  reason")
    for name, d in layers.items():
        snrs = "  ".join(_snr(d["gemms"][g]["snr_db"]) for g in ("forward", "input_grad", "weight_grad"))
        print(f"{name:{width}}  {d['format']:14}  {snrs}  {d['reason']}")
    s = result["summary"]
    print(
        f"{s['low_precision']} of {s['layers']} linear layers in {result['recipe']} ({s['gemm_share']:.0%} of the "
        f"GEMMs, {s['size_share']:.0%} of their size K x N); tracked steps {result['steps']}"
    )


def _snr(value: Any) -> str:
    return f"{'exact':>7}" if value is None else f"{value:7.1f}"
