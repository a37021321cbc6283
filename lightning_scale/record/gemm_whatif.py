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

from lightning_scale.record.gemm_names import BLOCK, FIELDS, FP8_ALIGN, GEMMS, OPERANDS, RECIPES

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


def _amax(t: Tensor, dim: "int | None" = None) -> Tensor:
    """``max |t|`` (over ``dim``, kept) without an ``abs`` copy; NaN if any is NaN."""
    if dim is None:
        low, high = torch.aminmax(t)
        return torch.maximum(-low, high)
    # (amax and amin: ~10x faster than aminmax along a strided dimension on the CPU)
    return torch.maximum(-t.amin(dim=dim, keepdim=True), t.amax(dim=dim, keepdim=True))


def _widened(q: Tensor) -> Tensor:
    """FP8 ``q`` as float32 through float16's bits (torch's CPU widening of FP8 is ~10x slower;
    ``stats/blocks.py`` does the same). E5M2 is float16's top byte; E4M3's 7 low bits shifted
    by 7 are a float16 of the same mantissa and an exponent 8 lower, subnormals included (its
    NaN turns 480: only a NaN operand gives it, and then the reference is NaN too)."""
    b = q.view(torch.uint8).to(torch.int16)
    if q.dtype == _E5M2:
        return b.mul_(256).view(torch.float16).float()
    bits = (b & 0x7F).mul_(128).bitwise_or_((b & 0x80).mul_(256))
    return bits.view(torch.float16).float().mul_(256.0)


def _saturated(scaled: Tensor, peak: Tensor, limit: float) -> Tensor:
    """Elements of ``scaled`` at or beyond ``limit`` in magnitude. ``peak`` is the scaled amax of
    each row or block (the largest scaled magnitude there): where none reaches ``limit`` none
    can, and on the host (where reading it costs nothing) the full count is skipped."""
    if scaled.device.type == "cpu" and not bool((peak >= limit).any()):
        return torch.zeros((), dtype=torch.int64)
    return torch.count_nonzero(scaled.abs() >= limit)


def _fp8_scaled(t: Tensor, amax: Tensor, dtype: torch.dtype, pow2: bool) -> Tuple[Tensor, Tensor]:
    """torchao's ``amax_to_scale`` and ``_ToFloat8ConstrFunc``: dequantized float32 values and the
    count of saturated elements."""
    top = torch.finfo(dtype).max
    scale = (top / amax.double().clamp(min=_EPS)).float()
    if pow2:  # (``_round_scale_down_to_power_of_2``)
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = t.float() * scale
    saturated = _saturated(scaled, amax.float() * scale, _overflow(dtype))
    q = _widened(scaled.clamp_(-top, top).to(dtype))
    return q.div_(scale), saturated


def _tensorwise(t: Tensor, dtype: torch.dtype, dim: int) -> Tuple[Tensor, Tensor]:
    return _fp8_scaled(t, _amax(t), dtype, pow2=False)


def _rowwise(t: Tensor, dtype: torch.dtype, dim: int) -> Tuple[Tensor, Tensor]:
    return _fp8_scaled(t, _amax(t, dim), dtype, pow2=True)


def _mx_last(t: Tensor) -> Tuple[Tensor, Tensor]:
    """torchao's ``to_mx`` with RCEIL scales (``_to_mx_rceil``, E4M3 elements) of a 2-D ``t``
    in blocks of 32 along its last dimension, dequantized: float32 values, saturated count."""
    rows, cols = t.shape
    data = t.reshape(rows, cols // BLOCK, BLOCK)
    max_abs = _amax(data, -1).float()
    data = data.float()
    top = torch.finfo(_E4M3).max
    exponent = torch.clamp(torch.ceil(torch.log2(max_abs / top)), min=-_E8M0_BIAS, max=_E8M0_BIAS) + _E8M0_BIAS
    # an all-zero (or tiny) block: biased exponent 0, scaled by 1 and dequantized by 2^-127
    rcp = torch.where(exponent == 0, 1.0, torch.exp2(_E8M0_BIAS - exponent))
    scaled = data * rcp
    saturated = _saturated(scaled, max_abs * rcp, _overflow(_E4M3))
    q = _widened(scaled.clamp_(-top, top).to(_E4M3))
    return q.mul_(torch.exp2(exponent - _E8M0_BIAS)).reshape(rows, cols), saturated


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


def _sum_squares(t: Tensor) -> Tensor:
    """``sum(t^2)`` of a float32 tensor, as one BLAS dot (float32 accumulation: SNRs good to ~1e-4 dB)."""
    flat = t.reshape(-1)
    return torch.dot(flat, flat)


class _Gemm:
    """One GEMM's reference result and its operands' nonzero counts, shared by the recipes."""

    def __init__(self, a: Tensor, b: Tensor, ref: Tensor) -> None:
        self.ref, self.signal = ref, _sum_squares(ref)
        self.nonzero = (torch.count_nonzero(a), torch.count_nonzero(b))

    def row(self, qa: Tuple[Tensor, Tensor], qb: Tuple[Tensor, Tensor], emulated: Tensor) -> Tensor:
        """``FIELDS`` (float64) of the recipe whose casts (values, saturated count) are ``qa``, ``qb``."""
        noise = _sum_squares(emulated.sub_(self.ref))
        flushed = [n - torch.count_nonzero(q[0]) for n, q in zip(self.nonzero, (qa, qb))]  # (0 stays 0)
        one = torch.ones((), device=self.ref.device)
        parts = [
            one,
            one * 0,
            self.signal,
            noise,
            self.nonzero[0],
            flushed[0],
            qa[1],
            self.nonzero[1],
            flushed[1],
            qb[1],
        ]
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
    gemm = _Gemm(x, w, x.float() @ w.float().t())  # [M, N]: x and w both reduced along K (their dim 1)
    rows = []
    for recipe in RECIPES:
        if not _fits(recipe, k, (k, n)):
            rows.append(_skipped(x.device))
            continue
        qx, qw = cast(x, recipe, "input", 1), cast(w, recipe, "weight", 1)
        rows.append(gemm.row(qx, qw, qx[0] @ qw[0].t()))
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
    tensorwise_g = cast(g, "fp8-tensorwise", "grad_output", 0)  # (one scale: the same cast in both GEMMs)
    gemms = [(_Gemm(g, w, g.float() @ w.float()), n)]  # [M, K]: reduced along N
    if weight_grad:
        gemms.append((_Gemm(g, x, g.float().t() @ x.float()), m))  # [N, K]: reduced along M
    for j, (gemm, reduced) in enumerate(gemms):
        dim = 1 - j  # (input gradient: g along its dim 1, w along its dim 0; weight gradient: both along dim 0)
        for i, recipe in enumerate(RECIPES):
            if not _fits(recipe, reduced, (k, n)):
                out[j, i] = _skipped(g.device)
                continue
            qg = tensorwise_g if recipe == "fp8-tensorwise" else cast(g, recipe, "grad_output", dim)
            if j == 0:
                qw = cast(w, recipe, "weight", 0)
                out[j, i] = gemm.row(qg, qw, qg[0] @ qw[0])
            else:
                qx = cast(x, recipe, "input", 0)
                out[j, i] = gemm.row(qg, qx, qg[0].t() @ qx[0])
    return out
