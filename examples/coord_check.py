"""Coordinate check of the demo GPT: standard vs unit-scaled parametrisation.

Trains ``lightning_scale.tools.demo.GPTModule`` (AdamW, lr 3e-3, synthetic tokens) at several
widths for a few steps with ``lightning_scale.tools.coord_check``, once with the standard GPT
and once with ``GPTConfig(unit_scaled=True)``; prints the slope of log2 std against log2
width per op group at the first and last step and draws both at the last step::

    python examples/coord_check.py --out docs/coord_check.png --csv coord_check.csv
"""

from __future__ import annotations

import argparse
import csv
import time
import warnings
from typing import Callable, List, Optional, Sequence

from lightning_scale import coord_check
from lightning_scale.tools.coord_check import CoordRow
from lightning_scale.tools.demo import GPTModule, token_loaders
from lightning_scale.tools.models import GPT, GPTConfig

# One group per op kind of the activations (parameters and UnitLinear's weight scaling
# are left out); the group is the op name without its numbering.
GROUPS = r"/(embedding|add|layer_norm|linear|scaled_dot_product_attention|gelu)(?:_\d+)?$"


def make_module(unit_scaled: bool, layers: int) -> Callable[[int], GPTModule]:
    """width -> the demo's GPTModule of that width, standard or unit-scaled."""

    def build(width: int) -> GPTModule:
        module = GPTModule(dim=width, layers=layers)
        if unit_scaled:
            module.model = GPT(GPTConfig(dim=width, layers=layers, unit_scaled=True))
        return module

    return build


def slope_table(results: dict, steps: Sequence[int]) -> str:
    """Markdown: slope per op group and direction, for each parametrisation and step."""
    cols = [(name, step) for name in results for step in steps]
    lines = [
        "| group | " + " | ".join(f"{name}, step {step}" for name, step in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    keys = sorted({key for r in results.values() for key in r.slopes(GROUPS, steps[0])})
    for key in keys:
        cells = [results[name].slopes(GROUPS, step).get(key, float("nan")) for name, step in cols]
        lines.append(f"| {key[0]} ({key[1]}) | " + " | ".join(f"{c:+.2f}" for c in cells) + " |")
    return "\n".join(lines)


def draw(results: dict, path: str, widths: List[int]) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    for row, (name, result) in zip(axes, results.items()):
        result.plot(GROUPS, axes=row, title=name)
    for col in range(2):  # one y range per column, so the two parametrisations compare
        lo = min(ax.get_ylim()[0] for ax in axes[:, col])
        hi = max(ax.get_ylim()[1] for ax in axes[:, col])
        for ax in axes[:, col]:
            ax.set_ylim(lo, hi)
    fig.suptitle(
        f"Coordinate check of the demo GPT (AdamW, lr 3e-3), widths {widths}; legend: slope of log2 std vs log2 width",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="coord_check.png", help="the figure (PNG)")
    parser.add_argument("--csv", default=None, help="also write both tables here (a column says which)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers|no `val_dataloader`).*")
    train, _ = token_loaders(n=1024)
    results: dict = {}
    start = time.perf_counter()
    for name, unit in (("standard", False), ("unit-scaled", True)):
        t0 = time.perf_counter()
        results[name] = coord_check(make_module(unit, args.layers), args.widths, steps=args.steps, batches=train)
        print(f"{name}: {len(results[name].rows)} rows in {time.perf_counter() - t0:.1f} s")
    print(f"total {time.perf_counter() - start:.1f} s\n")
    print(slope_table(results, [0, args.steps - 1]))
    draw(results, args.out, args.widths)
    print(f"\nfigure written to {args.out}")
    if args.csv:
        _write_csv(results, args.csv)


def _write_csv(results: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(("parametrisation", *CoordRow._fields))
        for name, result in results.items():
            writer.writerows((name, *row[:4], repr(row.std)) for row in result.rows)


if __name__ == "__main__":
    main()
