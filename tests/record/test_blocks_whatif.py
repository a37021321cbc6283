"""The block-scaled what-ifs and the kurtosis of a real Trainer run on the demo GPT, read back from
TensorBoard, against torchao's casts and float64 moments of the same tensors taken by hooks on a
twin model (as test_fp8_whatif.py); and training with these groups on is bit-identical to training
without the monitor."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor

from lightning_scale import ScaleMonitor
from lightning_scale.tools.demo import GPTModule
from test_fp8_whatif import fit, twin_tensors

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
STATISTICS = ["std", "kurtosis", *(f"{f}_{k}" for f in FORMATS for k in ("snr_db", "flushed"))]
MX = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp4": torch.float4_e2m1fn_x2}


def torchao_cast(x: Tensor, fmt: str) -> Tensor:
    """torchao's emulated cast and back (float64) of float32 ``x`` as rows of its last dimension,
    zero-padded to whole blocks."""
    k = x.shape[-1] if x.dim() else 1
    block = 16 if fmt == "nvfp4" else 32
    rows = torch.nn.functional.pad(x.reshape(-1, k), (0, -k % block)).contiguous()
    if fmt == "nvfp4":
        q = NVFP4Tensor.to_nvfp4(rows).dequantize(torch.float32)
    else:
        q = MXTensor.to_mx(rows, MX[fmt], block).dequantize(torch.float32)
    return q[:, :k].double()


def what_if(x: Tensor, fmt: str) -> Tuple[float, float]:
    """(SNR in dB, fraction flushed) of ``x``'s cast to ``fmt``, in float64 with fsum."""
    x64 = x.double().reshape(-1, x.shape[-1] if x.dim() else 1)
    q = torchao_cast(x, fmt)
    err = math.fsum(((q - x64) ** 2).flatten().tolist())
    sq = math.fsum((x64**2).flatten().tolist())
    snr = math.inf if err == 0 else 10 * math.log10(sq / err)
    return snr, float(((x64 != 0) & (q == 0)).sum()) / x.numel()


def kurtosis64(x: Tensor) -> float:
    v = x.double().flatten().tolist()
    mean = math.fsum(v) / len(v)
    m2 = math.fsum((e - mean) ** 2 for e in v)
    m4 = math.fsum((e - mean) ** 4 for e in v)
    return len(v) * m4 / (m2 * m2) if m2 > 0 else math.nan


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]]:
    """The trained module, its monitor and every logged scalar ``{tag: {step: value}}``."""
    monitor = ScaleMonitor(every_n_steps=1, statistics=STATISTICS, figure=False, histograms=False, code=False)
    module, log_dir = fit(tmp_path_factory.mktemp("blocks"), monitor)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return module, monitor, {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_logged_block_what_ifs_and_kurtosis_match_torchao_and_float64(
    watched: Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]],
) -> None:
    logged = watched[2]
    compared = 0
    for (step, d, label), x in twin_tensors().items():
        if f"kurtosis/{d}/{label}" not in logged:
            continue
        want = kurtosis64(x)
        got = logged[f"kurtosis/{d}/{label}"][step]
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-5), (step, d, label)
        for fmt in FORMATS:
            snr, flushed = what_if(x, fmt)
            key = (step, d, label, fmt)
            assert logged[f"{fmt}_snr_db/{d}/{label}"][step] == pytest.approx(snr, abs=1e-4), key  # dB
            assert logged[f"{fmt}_flushed/{d}/{label}"][step] == pytest.approx(flushed, abs=1e-7), key
        compared += 1
    assert compared > 150  # labels x directions x steps


def test_the_block_what_ifs_see_real_losses(watched: Tuple[GPTModule, ScaleMonitor, Any]) -> None:
    """Forward, MXFP8 keeps ~31 / 25 dB, the FP4 formats ~19-20 dB, NVFP4 above MXFP4 (finer
    scales). Backward, NVFP4 without a per-tensor scale flushes the MLP's whole gradient: its
    E4M3 block scale is at least 2^-6, so values under 2^-8 round to 0 (error = x: exactly 0 dB),
    where MX's power-of-two scales follow the gradient down. LayerNorm's initial gains (all 1)
    are exact in MX; NVFP4 makes them 1.03125. Kurtosis: ~3 for the (Gaussian-like) forward activations."""
    logged = watched[2]
    label = "model.blocks.0.mlp.fc1"
    snr = {f: logged[f"{f}_snr_db/fwd/{label}"][0] for f in FORMATS}
    assert 29 < snr["mxfp8_e4m3"] < 33 and 23 < snr["mxfp8_e5m2"] < 27
    assert 17 < snr["mxfp4"] < snr["nvfp4"] < 22
    assert logged[f"nvfp4_flushed/bwd/{label}"][0] == 1.0 and logged[f"nvfp4_snr_db/bwd/{label}"][0] == 0.0
    assert 28 < logged[f"mxfp8_e4m3_snr_db/bwd/{label}"][0] < 33 and 16 < logged[f"mxfp4_snr_db/bwd/{label}"][0] < 21
    for f in FORMATS[:3]:  # (powers of two scale 1 exactly)
        assert logged[f"{f}_snr_db/fwd/model.ln_f.weight"][0] == math.inf
    # NVFP4: scale e4m3(1 / 6) = 0.171875, 1 / 0.171875 = 5.8 rounds to 6: q = 1.03125, error 1/32
    assert logged["nvfp4_snr_db/fwd/model.ln_f.weight"][0] == pytest.approx(20 * math.log10(32), abs=1e-5)
    assert 2.5 < logged[f"kurtosis/fwd/{label}"][0] < 3.5


def test_training_with_the_block_groups_is_bit_identical(
    tmp_path: Path, watched: Tuple[GPTModule, ScaleMonitor, Any]
) -> None:
    plain, _ = fit(tmp_path, None)
    module, monitor, logged = watched
    assert {"blocks", "kurtosis"} <= set(monitor.groups)
    assert logged["nvfp4_flushed/bwd/model.head.weight"].keys() == {0, 1}
    for (name, a), (_, b) in zip(plain.state_dict().items(), module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
