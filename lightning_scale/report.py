"""Reports: a model's code annotated with scales, and tables of every node's statistics."""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import Tensor, fx, nn

from lightning_scale import stats
from lightning_scale.capture import DEFAULT_LEAF_TYPES, DeepTracer
from lightning_scale.interpreter import ScalePair, ScaleTrackingInterpreter
from lightning_scale.recorder import BACKWARD, FORWARD

__all__ = ["analyse_module", "annotate_code", "records_table", "table_to_csv", "table_to_json"]


def annotate_code(code: str, scales: Mapping[str, ScalePair], labels: Optional[Mapping[str, str]] = None, flag: str = "fp16") -> str:
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
        return "\n".join(line + (sep + ", ".join(str(scales[n]) for n in names) if names else "") for line, sep, names in rows).strip()
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


def _annotated_line(line: str, names: Tuple[str, ...], is_def: bool, scales: Mapping[str, ScalePair]) -> Tuple[str, str, List[str]]:
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


def _aligned(rows: Sequence[Tuple[str, str, List[str]]], scales: Mapping[str, ScalePair], labels: Mapping[str, str], fmt: stats.FloatFormat) -> str:
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


def analyse_module(
    module: nn.Module,
    inputs: Union[Tensor, Tuple[Tensor, ...]],
    backward: Optional[Tensor] = None,
    recurse_modules: bool = True,
    syntax_highlight: bool = False,
    autowrap_modules: Tuple[Any, ...] = (math,),
    autowrap_functions: Tuple[Callable[..., Any], ...] = (),
    leaf_modules: Sequence[Any] = DEFAULT_LEAF_TYPES,
) -> str:
    """The module's code, each line annotated with its forward and backward std.

    Args:
        module: the module to analyse (fx-traceable; untraceable submodules stay leaves).
        inputs: fed to the forward pass.
        backward: fed to the output's ``.backward()`` (default: plain ``.backward()``,
            which needs a scalar output).
        recurse_modules: trace into submodules (else every submodule is a leaf).
        syntax_highlight: colour the code for a terminal (needs pygments).
        autowrap_modules, autowrap_functions, leaf_modules: passed to the tracer.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> print(analyse_module(nn.Linear(4, 4), torch.randn(8, 4), torch.randn(8, 4)))
        def forward(self, input : torch.Tensor) -> torch.Tensor:
            input_1 = input;  (-> 1.02, <- n/a)
            weight = self.weight;  (-> 0.246, <- 2.55)
            ...
            linear = torch._C._nn.linear(input_1, weight, bias);  (-> 0.688, <- 1.16)
            return linear
    """
    leaves = leaf_modules if recurse_modules else (nn.Module,)
    tracer = DeepTracer(autowrap_modules, autowrap_functions, leaves)
    gm = fx.GraphModule(module, tracer.trace(module))
    interp = ScaleTrackingInterpreter(gm)
    out = interp.run(*(inputs if isinstance(inputs, tuple) else (inputs,)))
    out.backward(backward)
    text = annotate_code(gm.code, interp.scales)
    if syntax_highlight:
        from pygments import highlight
        from pygments.formatters import TerminalFormatter
        from pygments.lexers import PythonLexer

        return highlight(text, PythonLexer(), TerminalFormatter())
    return text


def records_table(keys: Sequence[str], records: Tensor, names: Sequence[str] = tuple(stats.STATISTICS)) -> List[Dict[str, Any]]:
    """One dict per node and direction with every named statistic (host ``records``).

    Rows: ``{"node": label, "direction": "forward"|"backward", "std": ..., ...}``; a
    direction that saw no tensor (no gradient arrived) has no row.
    """
    records = records.detach().cpu()
    rows: List[Dict[str, Any]] = []
    values = {name: stats.statistic(records, name).tolist() for name in names}
    for i, key in enumerate(keys):
        for direction, d in (("forward", FORWARD), ("backward", BACKWARD)):
            if records[i, d, 0] > 0:
                rows.append({"node": str(key), "direction": direction, **{n: values[n][i][d] for n in names}})
    return rows


def table_to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """CSV text of ``records_table`` rows."""
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def table_to_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """JSON text of ``records_table`` rows (non-finite values as null)."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    return json.dumps(clean, indent=1)
