"""The names the GEMM what-ifs (``gemm_whatif``) and their readers share, without torch: the
recipes, the three GEMMs of a linear layer and their operands, the fields of a what-if row, and
the shapes each recipe takes. The command-line tools read logs with them and start without torch."""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["BLOCK", "FIELDS", "FP8_ALIGN", "GEMMS", "OPERANDS", "RECIPES"]

RECIPES: Tuple[str, ...] = ("fp8-tensorwise", "fp8-rowwise", "mxfp8")
GEMMS: Tuple[str, ...] = ("forward", "input_grad", "weight_grad")
#: The two operands of each GEMM (a, b): the result is ``a @ b`` up to transposes.
OPERANDS: Dict[str, Tuple[str, str]] = {
    "forward": ("input", "weight"),
    "input_grad": ("grad_output", "weight"),
    "weight_grad": ("grad_output", "input"),
}
FIELDS: Tuple[str, ...] = (
    "calls",
    "skipped",
    "signal",
    "noise",
    "a_nonzero",
    "a_flushed",
    "a_saturated",
    "b_nonzero",
    "b_flushed",
    "b_saturated",
)
BLOCK = 32  # MXFP8's block along the reduction dimension
#: torchao's FP8 GEMMs (``torch._scaled_mm``, and its auto filter) take K and N multiples of 16.
FP8_ALIGN = 16
