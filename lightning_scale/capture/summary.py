"""The capture line's parts that grow with the model: fx fallbacks grouped by reason, and
the layers a training recipe converted, counted.

A model whose sixteen ``Float8Linear`` layers (torchao's ``convert_to_float8_training``)
each fall back in fx with the same long reason reads ``fx fallbacks: 16 modules (fc1, fc2,
... and 13 more): RuntimeError: ...`` once, not sixteen times; ``converted layers: 16
Float8Linear (torchao.float8)`` says what the recipe changed. torchao is recognised by the
module path of its classes, never imported.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence

from torch import nn

__all__ = ["converted_line", "fallback_line", "names"]

_SHOWN = 3  # names listed before "and N more"
_RECIPES = ("torchao.",)  # module paths of the libraries whose layers are counted


def names(items: Sequence[str], shown: int = _SHOWN) -> str:
    """``fc1, fc2, fc3 and 13 more`` (all of them when there are few)."""
    if len(items) <= shown + 1:
        return ", ".join(items)
    return f"{', '.join(items[:shown])} and {len(items) - shown} more"


def fallback_line(fallbacks: Mapping[str, str]) -> str:
    """``fx fallbacks: fc1, fc2 (reason); head (other reason)``: one entry per distinct reason."""
    by_reason: Dict[str, List[str]] = {}
    for path, why in fallbacks.items():
        by_reason.setdefault(why, []).append(path)
    parts = []
    for why, paths in by_reason.items():
        count = f"{len(paths)} modules: " if len(paths) > _SHOWN + 1 else ""
        parts.append(f"{count}{names(paths)} ({why})")
    return "fx fallbacks: " + "; ".join(parts)


def converted_line(root: nn.Module) -> str:
    """``converted layers: 16 Float8Linear (torchao.float8)``: modules of a training recipe's
    own classes, and modules whose parameters are its tensor subclasses (torchao's MXFP8
    weight wrapper: ``2 Linear with MXFP8TrainingWeightWrapperTensor weights``); "" if none."""
    counts: Dict[str, int] = {}
    for _, m in root.named_modules():
        cls = type(m)
        if cls.__module__.startswith(_RECIPES):
            key = f"{cls.__name__} ({cls.__module__.rsplit('.', 1)[0]})"
            counts[key] = counts.get(key, 0) + 1
            continue
        wrapped = sorted({type(p).__name__ for p in m.parameters(recurse=False) if _recipe_tensor(p)})
        if wrapped:
            key = f"{cls.__name__} with {', '.join(wrapped)} weights"
            counts[key] = counts.get(key, 0) + 1
    return "converted layers: " + ", ".join(f"{n} {what}" for what, n in counts.items()) if counts else ""


def _recipe_tensor(p: nn.Parameter) -> bool:
    """A parameter of a recipe's tensor subclass (or a Parameter wrapping one)."""
    data = p.data if isinstance(p, nn.Parameter) else p
    return type(p).__module__.startswith(_RECIPES) or type(data).__module__.startswith(_RECIPES)
