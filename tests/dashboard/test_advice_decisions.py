"""The precision advisor's decision rules (dashboard/advice.py) on what-if sums built from closed
forms: each reason to keep a layer in high precision, the worst case over steps, the thresholds."""

from __future__ import annotations

import math
from typing import Any, Dict, List

import numpy as np
import pytest

from lightning_scale.dashboard.advice import Thresholds, advise, check_recipe_name
from lightning_scale.dashboard.advice_log import AdviceRun
from lightning_scale.record.gemm_whatif import FIELDS, GEMMS, RECIPES

F = {name: i for i, name in enumerate(FIELDS)}


def sums(snr_db: float, flushed: float = 0.0, skipped: bool = False) -> np.ndarray:
    """One layer's ``[GEMMS, RECIPES, FIELDS]`` at one step: every GEMM of every recipe at
    ``snr_db`` (signal 1), 1000 nonzero values per operand of which ``flushed`` flush."""
    out = np.zeros((len(GEMMS), len(RECIPES), len(FIELDS)))
    out[..., F["calls"]] = 1
    out[..., F["skipped"]] = float(skipped)
    if not skipped:
        out[..., F["signal"]] = 1.0
        out[..., F["noise"]] = 10 ** (-snr_db / 10)
        out[..., F["a_nonzero"]] = out[..., F["b_nonzero"]] = 1000
        out[..., F["a_flushed"]] = 1000 * flushed
    return out


def layer(name: str, linear: bool = True, bias: bool = False, how: str = "linear") -> Dict[str, Any]:
    return {"name": name, "module": "Linear" if linear else "Conv1D", "linear": linear, "bias": bias, "how": how}


def run(layers: List[Dict[str, Any]], steps: List[List[np.ndarray]]) -> AdviceRun:
    return AdviceRun([10 * t for t in range(len(steps))], layers, np.stack([np.stack(s) for s in steps]))


def test_each_reason_to_keep_a_layer_and_the_worst_step() -> None:
    layers = [
        layer("a"),  # ordinary
        layer("b"),  # 25 dB, then 6 dB at step 10
        layer("c", linear=False, how="matmul"),  # GPT-2's Conv1D
        layer("d", linear=False),  # a bare F.linear
        layer("e"),  # flushes 30% of its input at step 10
        layer("f", bias=True),
        layer("g"),  # never called
    ]
    never = np.zeros((len(GEMMS), len(RECIPES), len(FIELDS)))
    first = [sums(29), sums(25), sums(29), sums(29), sums(29), sums(29), never]
    second = [sums(28), sums(6), sums(29), sums(29), sums(29, flushed=0.3), sums(29), never]
    d = advise(run(layers, [first, second]), "fp8-tensorwise")
    formats = {n: l["format"] for n, l in d["layers"].items()}
    assert formats == {
        "a": "fp8-tensorwise",
        "b": "keep",
        "c": "keep",
        "d": "keep",
        "e": "keep",
        "f": "fp8-tensorwise",
        "g": "keep",
    }
    reasons = {n: l["reason"] for n, l in d["layers"].items()}
    assert reasons["a"] == (
        "every GEMM >= 15 dB: worst forward 28.0 dB at step 10; at most 0.00% of an operand's nonzero values flushed"
    )
    assert reasons["b"].startswith("forward GEMM: SNR 6.0 dB < 15 dB at step 10")
    assert reasons["c"] == "a matmul on a weight of `Conv1D`, not an nn.Linear: torchao converts nn.Linear modules only"
    assert reasons["d"].startswith("a bare F.linear on a weight of `Conv1D`")
    assert reasons["e"] == "forward GEMM: input 30.0% of its nonzero values flushed to zero > 10% at step 10"
    assert reasons["g"].startswith("not measured on any tracked step")
    assert d["layers"]["b"]["gemms"]["forward"]["snr_db"] == pytest.approx(6.0) and d["steps"] == [0, 10]
    assert d["summary"]["low_precision"] == 2 and d["summary"]["gemm_share"] == pytest.approx(2 / 7)
    mx = advise(run(layers, [first, second]), "mxfp8")["layers"]
    assert mx["f"]["format"] == "keep" and "bias" in mx["f"]["reason"] and mx["a"]["format"] == "mxfp8"
    loose = advise(run(layers, [first, second]), "fp8-tensorwise", Thresholds(snr_db=5.0, flushed=0.5))["layers"]
    assert loose["b"]["format"] == loose["e"]["format"] == "fp8-tensorwise"


def test_shapes_a_recipe_cannot_run_keep_the_layer_with_the_dimension() -> None:
    layers = [dict(layer("k48"), k=48, n=64), dict(layer("tokens"), k=64, n=64)]
    k48 = sums(29)
    k48[0, RECIPES.index("mxfp8")] = sums(0, skipped=True)[0, 0]  # the forward GEMM reduces over K = 48
    tokens = sums(29)
    tokens[2, RECIPES.index("mxfp8")] = sums(0, skipped=True)[0, 0]  # the weight gradient: over M tokens
    d = advise(run(layers, [[sums(29), sums(29)], [k48, tokens]]), "mxfp8")["layers"]
    assert d["k48"]["reason"].startswith("K=48 is not a multiple of 32")
    assert d["tokens"]["reason"].startswith("the token count M at step 10 is not a multiple of 32")
    assert advise(run(layers, [[k48, tokens]]), "fp8-tensorwise")["layers"]["k48"]["format"] == "fp8-tensorwise"


def test_an_exact_gemm_and_non_finite_operands() -> None:
    exact, broken = sums(29), sums(29)
    exact[..., F["noise"]] = 0.0
    broken[..., F["noise"]] = math.nan
    d = advise(run([layer("exact"), layer("nan")], [[exact, broken]]), "fp8-rowwise")["layers"]
    assert d["exact"]["format"] == "fp8-rowwise" and d["exact"]["gemms"]["forward"]["snr_db"] is None
    assert d["nan"]["format"] == "keep" and "SNR not finite at step 0" in d["nan"]["reason"]


def test_bad_recipe_and_thresholds_name_the_argument() -> None:
    with pytest.raises(
        ValueError, match=r"`recipe` must be one of \['fp8-tensorwise', 'fp8-rowwise', 'mxfp8'\], got 'x'"
    ):
        check_recipe_name("x")
    with pytest.raises(ValueError, match=r"`flushed` must be a fraction in \[0, 1\], got -0.1"):
        Thresholds(flushed=-0.1)
    with pytest.raises(ValueError, match=r"`snr_db` must be a finite number of dB, got nan"):
        Thresholds(snr_db=math.nan)
