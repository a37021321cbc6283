"""``lightning-scale compare RUN_A RUN_B``: two runs node by node, as a table or as JSON.

The comparison itself is ``dashboard.compare`` (the SCALES dashboard's Compare view computes
the same); this module reads the two runs (``dashboard.event_reader.read_run``: a run's
directory, or a log directory holding exactly one run) and prints.

Example::

    lightning-scale compare lightning_logs/bf16 lightning_logs/fp8 --step 500
    lightning-scale compare runs/a runs/b --json | jq .first_divergence
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
from typing import Iterator, List, Tuple

import numpy as np

from lightning_scale.dashboard.compare import THRESHOLD, Comparison, compare, difference_key
from lightning_scale.dashboard.data import DIRS
from lightning_scale.dashboard.event_reader import read_run

__all__ = ["add_compare", "run", "table"]

#: Differences of at most this many statistics are columns of the table (else the magnitudes only).
MAX_COLUMNS = 5
_LISTED = 8  # labels named in "only in A" / "only in B" lines


def add_compare(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``compare`` on the command's subparsers."""
    p = sub.add_parser(
        "compare",
        help="compare two runs node by node: matched nodes, differences, the first divergence",
        description="Compare run B against run A node by node (matched by label) at one pair of tracked steps: "
        "the difference of log2 std and of every statistic both runs logged per node and direction, the first "
        f"node whose log2 std differs by more than --threshold octaves (default {THRESHOLD}; forward in "
        "execution order, then backward in reverse), and the nodes only one run logged. A RUN is a run's "
        "directory or a log directory holding exactly one run.",
    )
    p.add_argument("run_a", metavar="RUN_A", help="the run compared against")
    p.add_argument("run_b", metavar="RUN_B", help="the run compared: differences are B minus A")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--step",
        type=int,
        help="each run's latest tracked step at or before N (default: the latest step both runs tracked)",
        metavar="N",
    )
    when.add_argument("--steps", type=_pair, help="step A of run A against step B of run B", metavar="A,B")
    p.add_argument("--prefix", default="", help='tag prefix: "" training (default), "val_" validation')
    p.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help="octaves of std that make a divergence (default: %(default)s)",
    )
    p.add_argument(
        "--top", type=int, default=20, help="rows of the table, largest difference first (default: %(default)s; 0: all)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def _pair(text: str) -> Tuple[int, int]:
    parts = text.split(",")
    try:
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"must be two steps A,B, got {text!r}")


def run(args: argparse.Namespace) -> int:
    """Read both runs, compare, print; returns the exit status (0)."""
    if args.top < 0:
        raise ValueError(f"`--top` must be 0 (every row) or a positive number of rows, got {args.top}")
    _, a = read_run(args.run_a, args.prefix)
    _, b = read_run(args.run_b, args.prefix)
    cmp = compare(a, b, step=args.step, steps=args.steps, threshold=args.threshold)
    with _collector_paused():
        if args.json:
            body = {"a": {"run": args.run_a, "step": cmp.step_a}, "b": {"run": args.run_b, "step": cmp.step_b}}
            print(json.dumps({**body, **cmp.to_json()}, allow_nan=False))
        else:
            print("\n".join(table(cmp, args.run_a, args.run_b, args.top)))
    return 0


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector off while the rows are built: tens of thousands of small dicts
    set off its full passes, each over every object of the imported modules (torch's, Lightning's),
    ~0.5 s at 10,000 nodes; the rows hold no reference cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def table(cmp: Comparison, run_a: str, run_b: str, top: int = 20) -> List[str]:
    """The readable report: steps, matched nodes, the first divergence, then the node
    directions ranked by ``|difference of log2 std|`` (``top`` of them; 0: all)."""
    lines = [
        f"A: {run_a} at step {cmp.step_a}",
        f"B: {run_b} at step {cmp.step_b} ({cmp.how})",
        f"nodes: {len(cmp.labels)} matched, {len(cmp.only_a)} only in A, {len(cmp.only_b)} only in B",
    ]
    lines += [f"  only in {w}: {_names(labels)}" for w, labels in (("A", cmp.only_a), ("B", cmp.only_b)) if labels]
    also = [f"only A logged {', '.join(cmp.only_a_stats)}"] if cmp.only_a_stats else []
    also += [f"only B logged {', '.join(cmp.only_b_stats)}"] if cmp.only_b_stats else []
    lines.append(f"statistics compared: {', '.join(cmp.stats)}" + (f" ({'; '.join(also)})" if also else ""))
    lines += [_divergence(cmp), ""]
    return lines + _rows(cmp, top)


def _names(labels: List[str]) -> str:
    more = len(labels) - _LISTED
    return ", ".join(labels[:_LISTED]) + (f", and {more} more" if more > 0 else "")


def _divergence(cmp: Comparison) -> str:
    div = cmp.first_divergence
    if div is None:
        return f"first divergence: none (every matched node's |Δ log2 std| <= {cmp.threshold:g} octaves)"
    what = "forward" if div.direction == "fwd" else "backward"
    return (
        f"first divergence (|Δ log2 std| > {cmp.threshold:g} octaves; forward in execution order, then backward): "
        f"{div.node} {what}, {_signed(div.difference)} octaves (std {div.a:.4g} in A, {div.b:.4g} in B)"
    )


def _rows(cmp: Comparison, top: int) -> List[str]:
    shown = cmp.stats if len(cmp.stats) <= MAX_COLUMNS else [s for s in cmp.stats if difference_key(s) != s]
    head = ["#", "node", "dir", "log2 std A", "log2 std B", *[f"Δ {difference_key(s)}" for s in shown]]
    where = np.argwhere(~(np.isnan(cmp.a).all(-1) & np.isnan(cmp.b).all(-1)))  # (node, dir) either run logged
    size = np.abs(cmp.diff("std")[where[:, 0], where[:, 1]])
    order = np.argsort(-np.nan_to_num(size, nan=-1.0), kind="stable")[: top or None]  # largest first, NaN last
    log_a, log_b = _log2_std(cmp.a, cmp.stats), _log2_std(cmp.b, cmp.stats)
    diffs = {s: cmp.diff(s) for s in shown}
    div, body = cmp.first_divergence, []
    for rank, (i, d) in enumerate(where[order].tolist(), 1):
        cells = [str(rank), cmp.labels[i], DIRS[d], _num(log_a[i, d]), _num(log_b[i, d])]
        cells += [_signed(diffs[s][i, d]) for s in shown]
        first = div is not None and (div.node, div.direction) == (cmp.labels[i], DIRS[d])
        body.append(cells + (["<- first divergence"] if first else []))
    note = f"node directions ranked by |Δ log2 std|, largest first: {len(order)} of {len(where)}"
    if len(shown) < len(cmp.stats):
        note += f"; the differences of {len(cmp.stats) - len(shown)} more statistics are in --json"
    return [note, *_aligned([head, *body])]


def _log2_std(values: np.ndarray, stats: List[str]) -> np.ndarray:
    """``[nodes, 2]`` log2 std (a std of 0: -inf; NaN where not logged, or std not compared)."""
    if "std" not in stats:
        return np.full(values.shape[:2], math.nan)
    with np.errstate(divide="ignore"):
        return np.log2(values[..., stats.index("std")])


def _num(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2f}"


def _signed(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:+.2f}"


def _aligned(rows: List[List[str]]) -> List[str]:
    """Columns padded to their widest cell: text left, numbers right."""
    widths = [max(len(r[c]) for r in rows if c < len(r)) for c in range(max(map(len, rows)))]
    out = []
    for r in rows:
        cells = [
            cell.ljust(w) if c in (1, 2) or c >= len(rows[0]) else cell.rjust(w)
            for c, (cell, w) in enumerate(zip(r, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return out
