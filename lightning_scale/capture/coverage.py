"""Coverage: how much of a model a tracked step actually recorded.

A parameter is covered when it has a record of its own, or it sits inside a module run as
an opaque leaf whose output is recorded. A module call is covered when its output or an op
inside it has a record. Below ``THRESHOLD`` the report names the largest uncovered modules
and why they were missed, so that a graph break that hides half the model is not silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Set, Tuple

from torch import nn

from lightning_scale.capture.frames import strip_compiled

__all__ = ["THRESHOLD", "CoverageReport", "measure"]

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
    """

    elements: int
    covered_elements: int
    modules: int
    covered_modules: int
    uncovered: List[Tuple[str, int, str]] = field(default_factory=list)

    @property
    def parameter_fraction(self) -> float:
        return self.covered_elements / self.elements if self.elements else 1.0

    @property
    def module_fraction(self) -> float:
        return self.covered_modules / self.modules if self.modules else 1.0

    def line(self) -> str:
        """``coverage: 100% of parameter elements, 97% of module calls (32/33)``."""
        return (
            f"coverage: {self.parameter_fraction:.0%} of parameter elements, "
            f"{self.module_fraction:.0%} of module calls ({self.covered_modules}/{self.modules}) recorded"
        )

    def warning(self) -> Optional[str]:
        """None at or above the threshold, else what is missing and why."""
        if min(self.parameter_fraction, self.module_fraction) >= THRESHOLD:
            return None
        missing = "; ".join(f"`{path}` ({n} parameter elements: {why})" for path, n, why in self.uncovered)
        return f"ScaleMonitor: low coverage ({self.line()}); largest unrecorded modules: {missing}"


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
) -> CoverageReport:
    """Coverage of ``root`` given the labels that got records.

    Args:
        root: the captured module.
        recorded: labels with a record on the tracked step (module outputs included).
        opaque: module paths run as opaque leaves (their inside is not recorded).
        why: module path -> why it has no record (fallback reason, graph break, ...).
        largest: how many uncovered modules the report names.
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
        (strip_compiled(path), m) for path, m in root.named_modules() if path and not isinstance(m, _CONTAINERS) and "_orig_mod" not in path.split(".")[-1:]
    ]
    missing = [(path, m) for path, m in modules if not (_covered_path(path, labels, prefixes) or inside_leaf(path))]
    bare = [(path, m) for path, m in modules if (path, m) not in missing and _bare(path, m, labels, inside_leaf)]
    named = _largest(missing, why, largest) + _largest(bare, lambda p: "its parameters have no records", largest)
    return CoverageReport(elements, covered, len(modules), len(modules) - len(missing), sorted(named, key=lambda t: -t[1])[:largest])


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
