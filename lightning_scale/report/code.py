"""A graph's generated code annotated with the scales of its nodes (the ``scale_code`` text)."""

from __future__ import annotations

import functools
import math
import re
from typing import List, Mapping, Optional, Sequence, Tuple

from lightning_scale.capture.interpreter import ScalePair
from lightning_scale.record import stats

__all__ = ["annotate_code"]


def annotate_code(
    code: str, scales: Mapping[str, ScalePair], labels: Optional[Mapping[str, str]] = None, flag: str = "fp16"
) -> str:
    """Annotate each line of fx-generated ``code`` that defines a node with its scales.

    Without ``labels``: ``(-> fwd, <- bwd)`` appended to the line (unit-scaling's format).
    With ``labels`` (fx node name -> tag label): the scales in an aligned column on the
    left, then a flag, the node's tag label and the code, so long lines never hide them::

        (-> 1.02, <- 4.1e-06)   !<  blocks.0.attn.qkv/linear  linear = torch._C._nn.linear(...)

    ``!<`` marks a std below ``flag``'s smallest normal, ``!>`` one above its max.

    Raises:
        ValueError: ``flag`` is not a format of ``stats.FORMATS``.
    """
    if flag not in stats.FORMATS:
        raise ValueError(f"`flag` must be one of {sorted(stats.FORMATS)}, got {flag!r}")
    rows = [_annotated_line(line, names, is_def, scales) for line, names, is_def in _parsed(code)]
    if labels is None:
        return "\n".join(
            line + (sep + ", ".join(str(scales[n]) for n in names) if names else "") for line, sep, names in rows
        ).strip()
    return _aligned(rows, scales, labels, stats.FORMATS[flag])


def _code_lines(code: str) -> List[str]:
    lines = []
    for line in code.splitlines():
        if line.strip() and not line.startswith("torch.fx._symbolic_trace.wrap"):
            lines.append(line.split(";")[0].rstrip())  # drop fx's `;  x = None` frees
    return lines


@functools.lru_cache(maxsize=64)
def _parsed(code: str) -> Tuple[Tuple[str, Tuple[str, ...], bool], ...]:
    """(line, the node names it may define, whether it is the ``def``) per code line:
    parsed once per graph, annotated every tracked step."""
    out = []
    for line in _code_lines(code):
        words = line.strip().split(" ")
        if words and words[0] == "def":
            out.append((line, tuple(re.findall(r"(\w+)(?=\s*[,:)=])", line.split("(", 1)[1])), True))
        else:
            out.append((line, tuple(words[:1]), False))
    return tuple(out)


def _annotated_line(
    line: str, names: Tuple[str, ...], is_def: bool, scales: Mapping[str, ScalePair]
) -> Tuple[str, str, List[str]]:
    """(code, separator before the annotation, node names it defines that have scales)."""
    if names and not is_def and names[0] in scales:
        return line, ";  ", [names[0]]
    if is_def:
        return line, "  ", [a for a in names if a in scales]
    return line, "", []


def _flag(pair: ScalePair, fmt: stats.FloatFormat) -> str:
    values = [v for v in (pair.forward, pair.backward) if v is not None and math.isfinite(v)]
    if not values:
        return ""
    if 0 < min(values) < fmt.min_normal or (len(values) == 2 and 0 < max(values) < fmt.min_normal):
        return "!<"
    return "!>" if max(values) > fmt.max else ""


def _aligned(
    rows: Sequence[Tuple[str, str, List[str]]],
    scales: Mapping[str, ScalePair],
    labels: Mapping[str, str],
    fmt: stats.FloatFormat,
) -> str:
    cells = []
    for line, _, names in rows:
        if not names:  # (most lines: nothing to format)
            cells.append(("", "", "", line))
            continue
        if len(names) == 1:  # (the rest: one node per line)
            pair, name = scales[names[0]], names[0]
            cells.append((str(pair), _flag(pair, fmt), labels.get(name, name), line))
            continue
        pairs = [scales[n] for n in names]
        flags = "".join(sorted({_flag(p, fmt) for p in pairs}))
        cells.append((", ".join(map(str, pairs)), flags, ", ".join(labels.get(n, n) for n in names), line))
    width = [max((len(c[i]) for c in cells), default=0) for i in range(3)]
    return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c:<{width[2]}}  {d}".rstrip() for a, b, c, d in cells)
