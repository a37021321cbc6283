"""GEMM what-ifs: the error of a linear layer's three GEMM results if a low-precision training
recipe cast their operands, as torchao casts them.

A linear layer (input ``x [M, K]``, leading dims flattened; weight ``W [N, K]``; output gradient
``g [M, N]``) runs three GEMMs: forward ``x @ W^T``, input gradient ``g @ W`` and weight
gradient ``g^T @ x``. For each candidate recipe (``RECIPES``) every operand is cast and
dequantized exactly as torchao 0.18 does it, the GEMM is run on the dequantized operands in
float32 (torchao's emulation) and compared with the GEMM of the operands as the model holds
them (float32 arithmetic). The scaling of each recipe:

- ``fp8-tensorwise`` (``Float8LinearConfig()``): one scale per operand, ``float32(fmt.max /
  max(amax, 1e-12))`` computed in float64; E4M3 input and weight, E5M2 output gradient.
- ``fp8-rowwise`` (``Float8LinearConfig.from_recipe_name("rowwise")``): one scale per row
  along each GEMM's reduction dimension (torchao's axiswise scaling), rounded down to a power
  of two; E4M3 for all three operands.
- ``mxfp8`` (``MXFP8TrainingOpConfig``, torchao's MXFP8 linear): E4M3 elements in blocks of
  32 along each GEMM's reduction dimension, an E8M0 scale per block rounded up (RCEIL:
  ``2^ceil(log2(block amax / 448))``). The reduction dimension is K in the forward, N in the
  input gradient and M (the tokens) in the weight gradient.

Each GEMM's what-if is a row of ``FIELDS``, every one a sum (so rows of micro-batches, calls
and ranks add up exactly): the calls, the calls the recipe cannot run (shapes it does not
take), the signal ``sum(ref^2)`` and noise ``sum((emulated - ref)^2)`` of the result (SNR =
10 log10(signal / noise)), and per operand its nonzero elements, those the cast flushes to
zero and those it saturates (values that would round past the format's largest, clamped to it).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "FIELDS",
    "FP8_ALIGN",
    "GEMMS",
    "OPERANDS",
    "RECIPES",
    "backward_rows",
    "cast",
    "forward_rows",
]

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
_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the least amax a scale is taken from
_E4M3, _E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_E8M0_BIAS = 127

# (recipe, operand) -> the element format; torchao's defaults for each recipe
_FORMAT = {
    ("fp8-tensorwise", "input"): _E4M3,
    ("fp8-tensorwise", "weight"): _E4M3,
    ("fp8-tensorwise", "grad_output"): _E5M2,
}


def _overflow(dtype: torch.dtype) -> float:
    """The least magnitude that rounds past ``dtype``'s largest value: the saturating cast
    clamps it (smaller values above the largest round down to it anyway)."""
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _fp8_scaled(t: Tensor, amax: Tensor, dtype: torch.dtype, pow2: bool) -> Tuple[Tensor, Tensor]:
    """torchao's ``amax_to_scale`` and ``_ToFloat8ConstrFunc``: dequantized float32 values and the
    count of saturated elements."""
    top = torch.finfo(dtype).max
    scale = (top / amax.double().clamp(min=_EPS)).float()
    if pow2:  # (``_round_scale_down_to_power_of_2``)
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = t.float() * scale
    saturated = (scaled.abs() >= _overflow(dtype)).sum()
    q = scaled.clamp(-top, top).to(dtype)
    return q.float() / scale, saturated


def _tensorwise(t: Tensor, dtype: torch.dtype, dim: int) -> Tuple[Tensor, Tensor]:
    return _fp8_scaled(t, t.abs().max(), dtype, pow2=False)


def _rowwise(t: Tensor, dtype: torch.dtype, dim: int) -> Tuple[Tensor, Tensor]:
    return _fp8_scaled(t, t.abs().amax(dim=dim, keepdim=True), dtype, pow2=True)


def _mx_last(t: Tensor) -> Tuple[Tensor, Tensor]:
    """torchao's ``to_mx`` with RCEIL scales (``_to_mx_rceil``, E4M3 elements) of a 2-D ``t``
    in blocks of 32 along its last dimension, dequantized: float32 values, saturated count."""
    rows, cols = t.shape
    data = t.reshape(rows, cols // BLOCK, BLOCK)
    max_abs = data.abs().amax(-1, keepdim=True).float()
    data = data.float()
    top = torch.finfo(_E4M3).max
    exponent = torch.clamp(torch.ceil(torch.log2(max_abs / top)), min=-_E8M0_BIAS, max=_E8M0_BIAS) + _E8M0_BIAS
    # an all-zero (or tiny) block: biased exponent 0, scaled by 1 and dequantized by 2^-127
    rcp = torch.where(exponent == 0, 1.0, torch.exp2(_E8M0_BIAS - exponent))
    scaled = data * rcp
    saturated = (scaled.abs() >= _overflow(_E4M3)).sum()
    q = scaled.clamp(-top, top).to(_E4M3).float()
    return (q * torch.exp2(exponent - _E8M0_BIAS)).reshape(rows, cols), saturated


def _mx(t: Tensor, dtype: torch.dtype, dim: int) -> Tuple[Tensor, Tensor]:
    if dim in (-1, t.dim() - 1):
        return _mx_last(t.contiguous())
    q, saturated = _mx_last(t.t().contiguous())  # (torchao casts the transposed copy)
    return q.t(), saturated


_CASTS: Dict[str, Callable[[Tensor, torch.dtype, int], Tuple[Tensor, Tensor]]] = {
    "fp8-tensorwise": _tensorwise,
    "fp8-rowwise": _rowwise,
    "mxfp8": _mx,
}


def cast(t: Tensor, recipe: str, operand: str, dim: int) -> Tuple[Tensor, Tensor]:
    """``t`` (2-D) cast by ``recipe`` as its ``operand`` (``"input"``, ``"weight"``,
    ``"grad_output"``) of a GEMM reducing along ``dim``, and dequantized.

    Returns:
        The dequantized values (float32, ``t``'s shape) and the number of saturated elements.
    """
    return _CASTS[recipe](t, _FORMAT.get((recipe, operand), _E4M3), dim)


def _fits(recipe: str, reduced: int, other: Tuple[int, ...]) -> bool:
    """Whether torchao runs ``recipe`` on a GEMM reducing over ``reduced`` elements, with
    the other dimensions ``other`` (MXFP8: blocks of 32 along the reduction; FP8: K and N
    multiples of 16)."""
    if recipe == "mxfp8":
        return reduced % BLOCK == 0
    return all(d % FP8_ALIGN == 0 for d in other)


def _row(a: Tensor, b: Tensor, qa: Tensor, qb: Tensor, ref: Tensor, emulated: Tensor, saturated: Tensor) -> Tensor:
    """One GEMM's ``FIELDS`` (float64)."""
    diff = emulated.double() - ref.double()
    counts = []
    for t, q in ((a, qa), (b, qb)):
        nonzero = t != 0
        counts += [nonzero.sum(), (nonzero & (q == 0)).sum()]
    one = torch.ones((), dtype=torch.float64, device=ref.device)
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    signal, noise = ref.double().square().sum(), diff.square().sum()
    parts = [one, zero, signal, noise, counts[0], counts[1], saturated[0], counts[2], counts[3], saturated[1]]
    return torch.stack([p.to(torch.float64) for p in parts])


def _skipped(device: torch.device) -> Tensor:
    """The row of a call the recipe cannot run: one call, skipped, nothing else."""
    row = torch.zeros(len(FIELDS), dtype=torch.float64, device=device)
    row[:2] = 1.0
    return row


def forward_rows(x: Tensor, w: Tensor) -> Tensor:
    """The forward GEMM's what-if of every recipe: ``[len(RECIPES), len(FIELDS)]`` float64.

    Args:
        x: the input ``[M, K]``.
        w: the weight ``[N, K]``.
    """
    k, n = x.shape[1], w.shape[0]
    ref = x.float() @ w.float().t()  # [M, N]: x and w both reduced along K (their dim 1)
    rows = []
    for recipe in RECIPES:
        if not _fits(recipe, k, (k, n)):
            rows.append(_skipped(ref.device))
            continue
        qx, sx = cast(x, recipe, "input", 1)
        qw, sw = cast(w, recipe, "weight", 1)
        rows.append(_row(x, w, qx, qw, ref, qx @ qw.t(), torch.stack([sx, sw])))
    return torch.stack(rows)


def backward_rows(x: Tensor, w: Tensor, g: Tensor, weight_grad: bool = True) -> Tensor:
    """The input- and weight-gradient GEMMs' what-ifs of every recipe:
    ``[2, len(RECIPES), len(FIELDS)]`` float64 (the weight gradient's all zero without ``weight_grad``).

    Args:
        x: the input ``[M, K]``.
        w: the weight ``[N, K]``.
        g: the output gradient ``[M, N]``.
        weight_grad: the weight takes a gradient (a frozen weight runs no weight-gradient GEMM).
    """
    (m, k), n = x.shape, w.shape[0]
    out = torch.zeros(2, len(RECIPES), len(FIELDS), dtype=torch.float64, device=g.device)
    ref_in = g.float() @ w.float()  # [M, K]: reduced along N
    for i, recipe in enumerate(RECIPES):
        if not _fits(recipe, n, (k, n)):
            out[0, i] = _skipped(g.device)
            continue
        qg, sg = cast(g, recipe, "grad_output", 1)
        qw, sw = cast(w, recipe, "weight", 0)
        out[0, i] = _row(g, w, qg, qw, ref_in, qg @ qw, torch.stack([sg, sw]))
    if not weight_grad:
        return out
    ref_w = g.float().t() @ x.float()  # [N, K]: reduced along M
    for i, recipe in enumerate(RECIPES):
        if not _fits(recipe, m, (k, n)):
            out[1, i] = _skipped(g.device)
            continue
        qg, sg = cast(g, recipe, "grad_output", 0)
        qx, sx = cast(x, recipe, "input", 0)
        out[1, i] = _row(g, x, qg, qx, ref_w, qg.t() @ qx, torch.stack([sg, sx]))
    return out
