"""The FP8 what-if of a real Trainer run on the demo GPT, read back from TensorBoard, against an
independent float64 quantisation of the same tensors taken by hooks on a twin model; and
training with the ``fp8`` group on is bit-identical to training without the monitor."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor
from lightning_scale.tools.demo import GPTModule
from lightning_scale.tools.models import synthetic_tokens

STEPS = 2
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
STATISTICS = ["std", *(f"fp8_{f}_{k}" for f in FP8 for k in ("snr_db", "flushed"))]
Key = Tuple[int, str, str]  # (step, "fwd" / "bwd", label)


def tiny_gpt() -> GPTModule:
    torch.manual_seed(0)
    return GPTModule(vocab=32, seq=16, layers=2, dim=16, heads=2)


def batches() -> List[Tuple[Tensor, Tensor]]:
    x, y = synthetic_tokens(4 * STEPS, 16, 32, seed=0)
    return list(zip(x.split(4), y.split(4)))


def fit(tmp_path: Path, monitor: Optional[ScaleMonitor]) -> Tuple[GPTModule, Optional[str]]:
    module, data = tiny_gpt(), batches()
    loader = DataLoader(TensorDataset(torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])), batch_size=4)
    logger = pl.loggers.TensorBoardLogger(str(tmp_path), name="fp8") if monitor else False
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor] if monitor else [],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    return module, trainer.logger.log_dir if monitor else None


def twin_tensors() -> Dict[Key, Tensor]:
    """Every module output and parameter of the twin, and their gradients, per step: taken by
    forward hooks and tensor hooks while the twin trains as Lightning trains it."""
    twin = tiny_gpt()
    opt = twin.configure_optimizers()
    out: Dict[Key, Tensor] = {}
    step = 0

    def keep(label: str) -> Any:
        def hook(mod: nn.Module, args: Any, y: Tensor) -> None:
            out[(step, "fwd", label)] = y.detach().clone()
            y.register_hook(lambda g: out.__setitem__((step, "bwd", label), g.detach().clone()))

        return hook

    for name, mod in twin.model.named_modules():
        mod.register_forward_hook(keep(f"model.{name}" if name else "model"))
    for step, batch in enumerate(batches()):
        for name, p in twin.named_parameters():
            out[(step, "fwd", name)] = p.detach().clone()
        twin._loss(batch).backward()
        for name, p in twin.named_parameters():
            out[(step, "bwd", name)] = p.grad.detach().clone()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
    return out


def what_if(x: Tensor, fmt: str) -> Tuple[float, float]:
    """(SNR in dB, fraction flushed) of a per-tensor amax-scaled cast of float32 ``x`` to
    ``fmt``: the scale ``max / amax`` in float32 as FP8 recipes take it, the rest in float64."""
    amax = x.abs().max()
    if amax == 0:
        return math.inf, 0.0
    scale = float(torch.tensor(torch.finfo(FP8[fmt]).max) / amax)
    y = x.double() * scale  # exact: 24-bit by 24-bit mantissas
    q = y.to(FP8[fmt]).double()
    err = math.fsum((((q - y) / scale) ** 2).flatten().tolist())
    snr = math.inf if err == 0 else 10 * math.log10(math.fsum((x.double() ** 2).flatten().tolist()) / err)
    return snr, float(((x != 0) & (q == 0)).sum()) / x.numel()


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]]:
    """The trained module, its monitor and every logged scalar ``{tag: {step: value}}``."""
    monitor = ScaleMonitor(every_n_steps=1, statistics=STATISTICS, figure=False, histograms=False, code=False)
    module, log_dir = fit(tmp_path_factory.mktemp("fp8"), monitor)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return module, monitor, {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def logged(watched: Tuple[GPTModule, ScaleMonitor, Dict[str, Dict[int, float]]]) -> Dict[str, Dict[int, float]]:
    return watched[2]


def test_logged_fp8_statistics_match_a_float64_quantisation_of_the_same_tensors(
    logged: Dict[str, Dict[int, float]],
) -> None:
    reference = twin_tensors()
    compared = set()
    for (step, d, label), x in reference.items():
        if f"fp8_e4m3_snr_db/{d}/{label}" not in logged:
            continue
        for fmt in FP8:
            snr, flushed = what_if(x, fmt)
            got_snr = logged[f"fp8_{fmt}_snr_db/{d}/{label}"][step]
            assert got_snr == pytest.approx(snr, rel=1.2e-7, abs=0), (
                step,
                d,
                label,
                fmt,
            )  # float32 in the event file: 1 ulp
            assert logged[f"fp8_{fmt}_flushed/{d}/{label}"][step] == pytest.approx(flushed, abs=1e-7), (
                step,
                d,
                label,
                fmt,
            )
        compared.add(label)
    twin = tiny_gpt()
    every_param = {n for n, _ in twin.named_parameters()}
    layers = {
        f"model.{n}" for n, m in twin.model.named_modules() if isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding))
    }
    assert every_param | layers <= compared, sorted((every_param | layers) - compared)
    assert len(compared) * 2 * STEPS * 2 > 100  # labels x directions x steps x formats


def test_the_what_if_sees_real_losses(logged: Dict[str, Dict[int, float]]) -> None:
    """Gaussian-like tensors lose ~31 dB in E4M3 and ~25 dB in E5M2 (3 and 2 mantissa bits);
    LayerNorm's initial gains (all 1) are exact; the token embedding's gradient is sparse (rows
    of tokens not in the batch are 0) and no zero counts as flushed."""
    for label in ("model.blocks.0.mlp.fc1", "model.head.weight"):
        for d in ("fwd", "bwd"):
            assert 29 < logged[f"fp8_e4m3_snr_db/{d}/{label}"][0] < 35
            assert 23 < logged[f"fp8_e5m2_snr_db/{d}/{label}"][0] < 29
    assert logged["fp8_e4m3_snr_db/fwd/model.ln_f.weight"][0] == math.inf
    assert logged["fp8_e5m2_flushed/bwd/model.tok.weight"][0] == 0.0
    # Softmax ignores a shift along the keys, so the key third of the qkv bias has a zero
    # gradient up to float32 rounding: ~1e-7 of the amax, under E4M3's 2^-17.8 range, not E5M2's
    bias = "model.blocks.0.attn.qkv.bias"
    assert logged[f"fp8_e4m3_flushed/bwd/{bias}"][0] == pytest.approx(1 / 3, rel=1e-7)
    assert logged[f"fp8_e5m2_flushed/bwd/{bias}"][0] == 0.0


def test_training_with_the_fp8_group_is_bit_identical(
    tmp_path: Path, watched: Tuple[GPTModule, ScaleMonitor, Any]
) -> None:
    plain, _ = fit(tmp_path, None)
    module, monitor, logged = watched
    assert monitor.groups == ["fp8", "moments"] and logged["fp8_e4m3_snr_db/bwd/model.head.weight"].keys() == {0, 1}
    for (name, a), (_, b) in zip(plain.state_dict().items(), module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
