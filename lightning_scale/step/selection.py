"""Which nodes a tracked step reports, and where in the model it looks.

``ScaleMonitor``'s ``include`` / ``exclude`` / ``prune_views`` / ``value_histograms``
arguments as objects: checked when the callback is built (a bad regex is a clear
``ValueError`` naming the argument), applied to a capture's labels after each tracked step.
"""

from __future__ import annotations

import difflib
import re
from typing import Collection, Optional, Sequence

from torch import nn

from lightning_scale import arguments
from lightning_scale.capture import Capture

__all__ = ["Matching", "Selection", "check_leaf_modules", "compile_pattern", "resolve_submodule"]


def compile_pattern(name: str, pattern: Optional[str]) -> Optional["re.Pattern[str]"]:
    """``pattern`` compiled, or None; a ``ValueError`` naming argument ``name`` if it is no
    str regex (a bytes pattern cannot search str labels)."""
    return arguments.regex(name, pattern)


class Matching:
    """The labels a regex matches, as a container (``label in matching``): labels of a
    dynamo capture appear as it compiles, so no fixed set can be built up front."""

    def __init__(self, pattern: "re.Pattern[str]") -> None:
        self.pattern = pattern

    def __contains__(self, label: object) -> bool:
        return isinstance(label, str) and self.pattern.search(label) is not None

    def __bool__(self) -> bool:
        return True


class Selection:
    """The labels of a capture that get scalars: ``include`` / ``exclude`` regexes (searched
    anywhere in a label) and ``prune_views`` (leave out views whose record is their input's).

    Example:
        >>> sel = Selection(exclude="drop")
        >>> [sel.selects(l, aliases=set(), module_outputs=set()) for l in ["fc/linear", "drop/dropout"]]
        [True, False]
    """

    def __init__(self, include: Optional[str] = None, exclude: Optional[str] = None, prune_views: bool = True) -> None:
        self.include = compile_pattern("include", include)
        self.exclude = compile_pattern("exclude", exclude)
        self.prune_views = arguments.boolean("prune_views", prune_views)

    @property
    def narrowed(self) -> bool:
        """Whether a regex leaves nodes out (coverage is then not judged)."""
        return self.include is not None or self.exclude is not None

    def labels(self, cap: Capture) -> list:
        """The selected labels of ``cap``, in its order."""
        outputs = cap.module_outputs
        return [label for label in cap.tags if self.selects(label, cap.aliases, outputs)]

    def selects(self, label: str, aliases: Collection[str], module_outputs: Collection[str]) -> bool:
        """Whether ``label`` is reported, given the capture's view aliases and module outputs."""
        if self.include is not None and not self.include.search(label):
            return False
        if self.exclude is not None and self.exclude.search(label):
            return False
        # a module's output shares its last node's record, but is how a layer is found: kept
        return not (self.prune_views and label in aliases and label not in module_outputs)


def resolve_submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)``, or a ``ValueError`` naming ``submodule`` and the
    nearest paths that exist."""
    try:
        return root.get_submodule(path)
    except AttributeError:
        raise ValueError(
            f"`submodule` {path!r} is not a submodule of {type(root).__name__}{_hint(root, [path])}"
        ) from None


def check_leaf_modules(root: nn.Module, names: Sequence[str]) -> None:
    """A ``ValueError`` naming ``leaf_modules`` if one of ``names`` is no submodule of
    ``root`` (the captured module, whose qualified names they are), with the nearest."""
    known = {n for n, _ in root.named_modules() if n}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"`leaf_modules` must name submodules of {type(root).__name__}, got unknown {unknown}{_hint(root, unknown)}"
        )


def _hint(root: nn.Module, paths: Sequence[str]) -> str:
    names = [n for n, _ in root.named_modules() if n]
    near = [m for path in paths for m in difflib.get_close_matches(path, names, n=5, cutoff=0.3)]
    return f"; nearest: {list(dict.fromkeys(near))}" if near else f"; submodules include {names[:8]}"
