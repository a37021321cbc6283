"""Coverage: how much of a model a tracked step actually recorded.

A parameter is covered when it has a record of its own, or it sits inside a module run as
an opaque leaf whose output is recorded. A module call is covered when its output or an op
inside it has a record. Below ``THRESHOLD`` the report names the largest uncovered modules
and why they were missed, so that a graph break that hides half the model is not silent.

Fractions are floored, never rounded up: a miss of 64 of 28,016 elements reads "99.7%",
with "64 of 28,016 unrecorded" beside it. Modules inside a compiled submodule
(``torch.compile``) run its compiled code and are seen only at its output: they are not
counted as recorded, nor as missing, and the line says how many there are. An
``nn.Identity`` computes nothing: it counts when its output has a record (fx aliases it
to its input), and is left out otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from torch import nn

from lightning_scale.capture.frames import strip_compiled

__all__ = ["THRESHOLD", "CoverageReport", "measure", "percent", "skipped_line"]

THRESHOLD = 0.9
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass
class CoverageReport:
    """Covered parameter elements and module calls of one capture after a tracked step.

    Attributes:
        elements: parameter elements of the captured module (tied weights once).
        covered_elements: those with a record (or inside a recorded opaque leaf).
        modules: modules that compute (containers such as ``ModuleList`` left out).
        covered_modules: those whose output or an op inside has a record.
        uncovered: (module path, parameter elements, why) of the largest uncovered modules.
        opaque: compiled submodule path -> module calls inside it (not in ``modules``).
        skipped: tensors seen but not recorded (``"emb.weight grad"``) -> why (``"sparse_coo layout"``).
        note: said at the end of the line.
    """

    elements: int
    covered_elements: int
    modules: int
    covered_modules: int
    uncovered: List[Tuple[str, int, str]] = field(default_factory=list)
    opaque: Dict[str, int] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    note: str = ""  # appended to the line (the compiled route's compile time)

    @property
    def parameter_fraction(self) -> float:
        return self.covered_elements / self.elements if self.elements else 1.0

    @property
    def module_fraction(self) -> float:
        return self.covered_modules / self.modules if self.modules else 1.0

    def line(self) -> str:
        """``coverage: 99.7% of parameter elements (64 of 28,016 unrecorded), 97% of
        module calls (32/33) recorded``."""
        missed = self.elements - self.covered_elements
        unrecorded = f" ({missed:,} of {self.elements:,} unrecorded)" if missed else ""
        text = (
            f"coverage: {percent(self.covered_elements, self.elements)} of parameter elements{unrecorded}, "
            f"{percent(self.covered_modules, self.modules)} of module calls "
            f"({self.covered_modules}/{self.modules}) recorded"
        )
        for path, n in self.opaque.items():
            text += f"; {n} module calls inside compiled `{path}` run its compiled code, recorded at its output only"
        if self.skipped:
            text += f"; {skipped_line(self.skipped)}"
        return f"{text}; {self.note}" if self.note else text

    def warning(self) -> Optional[str]:
        """None at or above the threshold, else what is missing and why."""
        if min(self.parameter_fraction, self.module_fraction) >= THRESHOLD:
            return None
        missing = "; ".join(f"`{path}` ({n} parameter elements: {why})" for path, n, why in self.uncovered)
        return f"ScaleMonitor: low coverage ({self.line()}); largest unrecorded modules: {missing}"


def skipped_line(skipped: Dict[str, str]) -> str:
    """``1 node skipped: sparse_coo layout (emb.weight grad)``: what was seen but not
    recorded, by reason (``skipped``: tensor -> why)."""
    by_reason: Dict[str, List[str]] = {}
    for what, why in skipped.items():
        by_reason.setdefault(why, []).append(what)
    n = len(skipped)
    parts = [f"{why} ({', '.join(whats[:5])}{', ...' if len(whats) > 5 else ''})" for why, whats in by_reason.items()]
    return f"{n} node{'s' if n != 1 else ''} skipped: " + "; ".join(parts)


def percent(part: int, whole: int) -> str:
    """Floored: a miss never reads 100%; one decimal from 99% up."""
    if part >= whole:
        return "100%"
    p = 100 * part / whole
    return f"{math.floor(p * 10) / 10:.1f}%" if p >= 99 else f"{math.floor(p)}%"


def _covered_path(path: str, recorded: Set[str], prefixes: Set[str]) -> bool:
    return path in recorded or path in prefixes


def _prefixes(labels: Iterable[str]) -> Set[str]:
    """Every module path that some label lies in: ``a.b/linear`` -> a, a.b."""
    out: Set[str] = set()
    for label in labels:
        path = label.split("/")[0]
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            out.add(".".join(parts[:i]))
    return out


def measure(
    root: nn.Module,
    recorded: Iterable[str],
    opaque: Sequence[str] = (),
    why: Callable[[str], str] = lambda path: "no op of it recorded",
    largest: int = 5,
    compiled: Sequence[str] = (),
    skipped: Optional[Dict[str, str]] = None,
) -> CoverageReport:
    """Coverage of ``root`` given the labels that got records.

    Args:
        root: the captured module.
        recorded: labels with a record on the tracked step (module outputs included).
        opaque: module paths run as opaque leaves (their inside is not recorded).
        why: module path -> why it has no record (fallback reason, graph break, ...).
        largest: how many uncovered modules the report names.
        compiled: paths of compiled submodules (opaque: recorded at their output only).
        skipped: tensors seen on the tracked step but not recorded -> why (named in the line).
    """
    labels = set(recorded)
    prefixes = _prefixes(labels)
    leaves = tuple(opaque)  # run in the graph; their outputs (or their items) are recorded

    def inside_leaf(path: str) -> bool:
        return any(path == p or path.startswith(p + ".") for p in leaves)

    by_param = {}
    for name, p in root.named_parameters(remove_duplicate=False):
        name = strip_compiled(name)
        hit = name in labels or inside_leaf(name.rsplit(".", 1)[0] if "." in name else "")
        by_param[id(p)] = (p.numel(), by_param.get(id(p), (0, False))[1] or hit)
    elements = sum(n for n, _ in by_param.values())
    covered = sum(n for n, hit in by_param.values() if hit)
    modules = [
        (strip_compiled(path), m)
        for path, m in root.named_modules()
        if path and not isinstance(m, _CONTAINERS) and "_orig_mod" not in path.split(".")[-1:]
    ]
    opaque = {c: [p for p, _ in modules if p.startswith(c + ".")] for c in compiled}
    hidden = {p for inside in opaque.values() for p in inside}
    modules = [(p, m) for p, m in modules if p not in hidden and not (type(m) is nn.Identity and p not in labels)]
    missing = [(path, m) for path, m in modules if not (_covered_path(path, labels, prefixes) or inside_leaf(path))]
    bare = [(path, m) for path, m in modules if (path, m) not in missing and _bare(path, m, labels, inside_leaf)]
    named = _largest(missing, why, largest) + _largest(bare, lambda p: "its parameters have no records", largest)
    opaque_calls = {c: len(inside) for c, inside in opaque.items() if inside}
    return CoverageReport(
        elements,
        covered,
        len(modules),
        len(modules) - len(missing),
        sorted(named, key=lambda t: -t[1])[:largest],
        opaque_calls,
        dict(skipped or {}),
    )


def _bare(path: str, m: nn.Module, labels: Set[str], inside_leaf: Callable[[str], bool]) -> bool:
    """A called module none of whose own parameters has a record."""
    own = [f"{path}.{n}" for n, _ in m.named_parameters(recurse=False)]
    return bool(own) and not inside_leaf(path) and not any(n in labels for n in own)


def _largest(missing: List[Tuple[str, nn.Module]], why: Callable[[str], str], n: int) -> List[Tuple[str, int, str]]:
    sized = sorted(((path, sum(p.numel() for p in m.parameters())) for path, m in missing), key=lambda t: -t[1])
    out: List[Tuple[str, int, str]] = []
    for path, size in sized:
        if any(path.startswith(p + ".") for p, _, _ in out):
            continue  # its parent is already named
        out.append((path, size, why(path)))
        if len(out) == n:
            break
    return out
