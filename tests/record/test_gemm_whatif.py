"""The precision advisor's GEMM what-ifs (record/gemm_whatif.py) against torchao 0.18: each cast
element for element against torchao's own casting functions, and each GEMM's SNR against
torchao's emulated layers (``Float8Linear``, the MXFP8-wrapped ``nn.Linear``) run forward and
backward against float32, on an outlier layer and an ordinary one."""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Dict, Tuple

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.record.gemm_whatif import FIELDS, GEMMS, RECIPES, backward_rows, cast, forward_rows
from lightning_scale.tools.outlier_model import MLPLM

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.quantization import quantize_

F = {name: i for i, name in enumerate(FIELDS)}


def wide(dtype: torch.dtype, rows: int = 64, cols: int = 96) -> Tensor:
    """Values over 9 decades (columns of growing scale), a zero row segment and a negative half."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 3, cols)
    x[3, :32] = 0
    return x.to(dtype)


def torchao_fp8(x: Tensor, dtype: torch.dtype, rowwise: bool, dim: int) -> Tensor:
    if not rowwise:
        t = hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig())
    else:
        t = hp_tensor_to_float8_dynamic(
            x,
            dtype,
            LinearMMConfig(),
            scaling_granularity=ScalingGranularity.AXISWISE,
            axiswise_dim=-1 if dim == 1 else 0,
            round_scales_to_power_of_2=True,
        )
    return t._data.float() / t._scale


def torchao_mx(x: Tensor, dim: int) -> Tensor:
    along = x if dim == 1 else x.t().contiguous()
    q = MXTensor.to_mx(along, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL).dequantize(torch.float32)
    return q if dim == 1 else q.t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_every_cast_is_torchaos_bit_for_bit(dtype: torch.dtype, dim: int) -> None:
    x = wide(dtype)
    for operand, fmt in (("input", torch.float8_e4m3fn), ("grad_output", torch.float8_e5m2)):
        assert torch.equal(cast(x, "fp8-tensorwise", operand, dim)[0], torchao_fp8(x, fmt, False, dim))
        assert torch.equal(cast(x, "fp8-rowwise", operand, dim)[0], torchao_fp8(x, torch.float8_e4m3fn, True, dim))
        assert torch.equal(cast(x, "mxfp8", operand, dim)[0], torchao_mx(x, dim))


def test_saturation_counts_only_values_the_clamp_changes() -> None:
    # E4M3's largest value is 448 (1.75 x 2^8, an ulp of 32 there): 464 and above would round past it
    x = torch.tensor([[448.0, 463.9, 464.0, -500.0] + [1.0] * 28])
    # dynamic scales never saturate: the amax maps onto the largest value
    for recipe in RECIPES:
        assert cast(x, recipe, "input", 1)[1] == 0
    from lightning_scale.record import gemm_whatif

    assert gemm_whatif._overflow(torch.float8_e4m3fn) == 464.0 and gemm_whatif._overflow(torch.float8_e5m2) == 61440.0


def snr(ref: Tensor, got: Tensor) -> float:
    ref, got = ref.double(), got.double()
    return 10 * math.log10(float(ref.square().sum() / (got - ref).square().sum()))


def row_snr(row: Tensor) -> float:
    return 10 * math.log10(float(row[F["signal"]] / row[F["noise"]]))


def operands(outlier: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(x [M, K], W [N, K], g [M, N]) of a bias-free MLPLM's layer in one forward and backward:
    block 2's fc2 (outlier channels in its input) or block 0's fc1 (ordinary)."""
    torch.manual_seed(0)
    model = MLPLM(bias=False)
    layer = model.blocks[2].fc2 if outlier else model.blocks[0].fc1
    seen: Dict[str, Tensor] = {}
    layer.register_forward_hook(lambda m, i, o: seen.update(x=i[0].detach(), out=o))
    idx = torch.randint(64, (8, 32))
    out = model(idx)
    seen["out"].register_hook(lambda g: seen.update(g=g.detach()))
    torch.nn.functional.cross_entropy(out.reshape(-1, 64), torch.randint(64, (8 * 32,))).backward()
    return seen["x"].reshape(-1, layer.in_features), layer.weight.detach(), seen["g"].reshape(-1, layer.out_features)


def convert(layer: nn.Linear, recipe: str) -> nn.Module:
    model = nn.Sequential(copy.deepcopy(layer))
    if recipe == "mxfp8":
        config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
        quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    else:
        config = Float8LinearConfig.from_recipe_name(recipe.split("-")[1])
        convert_to_float8_training(model, config=dataclasses.replace(config, emulate=True))
    return model


def gemm_results(layer: nn.Module, x: Tensor, g: Tensor) -> Dict[str, Tensor]:
    """The layer's output, input gradient and weight gradient for input ``x`` and output gradient ``g``."""
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(g)
    weight = layer[0].weight
    return {"forward": out.detach(), "input_grad": x.grad, "weight_grad": weight.grad.as_subclass(Tensor)}


@pytest.mark.parametrize("outlier", [True, False])
def test_gemm_snrs_are_those_of_torchaos_emulated_layers_against_float32(outlier: bool) -> None:
    x, w, g = operands(outlier)
    fp32 = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        fp32.weight.copy_(w)
    ref = gemm_results(nn.Sequential(fp32), x, g)
    rows = torch.cat([forward_rows(x, w)[None], backward_rows(x, w, g)])  # [GEMMS, RECIPES, FIELDS]
    for r, recipe in enumerate(RECIPES):
        got = gemm_results(convert(fp32, recipe), x, g)
        for k, gemm in enumerate(GEMMS):
            assert rows[k, r, F["calls"]] == 1 and rows[k, r, F["skipped"]] == 0
            assert row_snr(rows[k, r]) == pytest.approx(snr(ref[gemm], got[gemm]), abs=0.01), (recipe, gemm)
    tensorwise_forward = row_snr(rows[0, 0])
    if outlier:  # the outlier channels keep all the input's energy; the rest flush: the result loses most of it
        assert tensorwise_forward < 8.0 and rows[0, 0, F["a_flushed"]] / rows[0, 0, F["a_nonzero"]] > 0.5
    else:  # E4M3 forward near 29 dB, E5M2 gradients near 25 dB
        assert tensorwise_forward > 27.0 and 23.0 < row_snr(rows[1, 0]) < 27.0 and rows[0, 0, F["a_flushed"]] == 0


def test_flushed_counts_are_those_of_torchaos_cast() -> None:
    x, w, _ = operands(outlier=True)
    row = forward_rows(x, w)[0]  # tensorwise
    q = torchao_fp8(x, torch.float8_e4m3fn, False, 1)
    assert row[F["a_nonzero"]] == (x != 0).sum() and row[F["a_flushed"]] == ((x != 0) & (q == 0)).sum()


def test_shapes_a_recipe_cannot_run_are_skipped_and_counted() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, grad = torch.randn(40, 48, generator=g), torch.randn(64, 48, generator=g), torch.randn(40, 64, generator=g)
    fwd, bwd = forward_rows(x, w), backward_rows(x, w, grad)
    mx = RECIPES.index("mxfp8")
    assert fwd[mx, F["skipped"]] == 1 and fwd[mx, F["signal"]] == 0  # K = 48: not whole blocks of 32
    assert bwd[0, mx, F["skipped"]] == 0 and bwd[1, mx, F["skipped"]] == 1  # N = 64 fits; M = 40 does not
    assert fwd[0, F["skipped"]] == 0 and bwd[:, 0, F["skipped"]].sum() == 0  # FP8: K, N multiples of 16
    odd = forward_rows(torch.randn(8, 40, generator=g), torch.randn(16, 40, generator=g))
    assert odd[0, F["skipped"]] == 1 and odd[1, F["skipped"]] == 1  # K = 40: not a multiple of 16


def test_exactly_representable_operands_give_no_noise_and_a_frozen_weight_no_weight_gradient() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0] * 8] * 32)  # powers of two: exact in every recipe
    w = torch.tensor([[0.25, 1.0, -1.0, 2.0] * 8] * 16)
    rows = torch.cat([forward_rows(x, w)[None], backward_rows(x, w, x[:, :16], weight_grad=False)])
    assert (rows[0, :, F["noise"]] == 0).all() and (rows[0, :, F["signal"]] > 0).all()
    assert (rows[2] == 0).all()  # no weight gradient: nothing measured
