"""One-off analysis of a module (``analyse_module``), and tables of every node's statistics."""

from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import Tensor, fx, nn

from lightning_scale import arguments
from lightning_scale.capture import DEFAULT_LEAF_TYPES, DeepTracer
from lightning_scale.capture.interpreter import ScaleTrackingInterpreter
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD
from lightning_scale.report.code import annotate_code

__all__ = ["analyse_module", "annotate_code", "records_table", "table_to_csv", "table_to_json"]


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
        autowrap_modules, autowrap_functions, leaf_modules: passed to the tracer
            (``leaf_modules``: a list or tuple of module types or qualified names).

    Raises:
        ValueError: ``recurse_modules`` or ``syntax_highlight`` is not a bool, or
            ``leaf_modules`` is a single str or not a sequence.

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
    arguments.booleans(recurse_modules=recurse_modules, syntax_highlight=syntax_highlight)
    if isinstance(leaf_modules, (str, bytes)) or not isinstance(leaf_modules, Sequence):
        allowed = "a list or tuple of module types or qualified names"
        raise ValueError(f"`leaf_modules` must be {allowed}, got {leaf_modules!r} ({type(leaf_modules).__name__})")
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


def records_table(
    keys: Sequence[str], records: Tensor, names: Sequence[str] = tuple(stats.STATISTICS)
) -> List[Dict[str, Any]]:
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
