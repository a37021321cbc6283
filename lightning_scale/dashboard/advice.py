"""The precision advisor's decisions: from a run's GEMM what-ifs (``advice_log``) to a
per-layer recipe, with the reason for each decision. Used by the SCALES dashboard's Advice
view and by ``lightning-scale advise`` alike.

For a target recipe, each linear layer gets the recipe, or ``keep`` (high precision) where:
its weight is not an ``nn.Linear``'s (torchao converts ``nn.Linear`` modules only: a bare
``F.linear``, GPT-2's ``Conv1D``); it was not measured; the recipe cannot run its shapes;
(MXFP8) it has a bias, which torchao 0.18's MXFP8 training drops; or, at any tracked step,
any of its three GEMM results falls below ``snr_db`` or an operand loses more than
``flushed`` of its nonzero values to zero. The figures are the worst over the tracked steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from lightning_scale.capture.recipe_check import KEEP
from lightning_scale.dashboard import advice_log
from lightning_scale.dashboard.advice_log import DEFAULT_FLUSHED, DEFAULT_SNR_DB, AdviceRun
from lightning_scale.record.gemm_whatif import BLOCK, FIELDS, FP8_ALIGN, GEMMS, OPERANDS, RECIPES

__all__ = ["DEFAULT_FLUSHED", "DEFAULT_SNR_DB", "KEEP", "Thresholds", "advise", "check_recipe_name", "view"]

_F = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True)
class Thresholds:
    """What a layer's GEMMs must keep in the target recipe, at every tracked step.

    Args:
        snr_db: the least SNR (dB) of each GEMM result against the model's own.
        flushed: the largest fraction of an operand's nonzero values the cast may flush to zero.

    Raises:
        ValueError: ``snr_db`` not finite, or ``flushed`` outside [0, 1].
    """

    snr_db: float = DEFAULT_SNR_DB
    flushed: float = DEFAULT_FLUSHED

    def __post_init__(self) -> None:
        if not math.isfinite(self.snr_db):
            raise ValueError(f"`snr_db` must be a finite number of dB, got {self.snr_db!r}")
        if not 0.0 <= self.flushed <= 1.0:
            raise ValueError(f"`flushed` must be a fraction in [0, 1], got {self.flushed!r}")


def check_recipe_name(recipe: str) -> str:
    """``recipe`` if it is one of ``RECIPES``.

    Raises:
        ValueError: another name (the message lists the recipes).
    """
    if recipe not in RECIPES:
        raise ValueError(f"`recipe` must be one of {list(RECIPES)}, got {recipe!r}")
    return recipe


def _finite(v: float) -> Optional[float]:
    return float(v) if math.isfinite(v) else None


def _gemm_figures(sums: np.ndarray, steps: List[int], gemm: str) -> Dict[str, Any]:
    """One GEMM's worst figures over the steps; ``sums``: ``[steps, FIELDS]`` of one recipe."""
    ran = np.nan_to_num(sums[:, _F["calls"]] - sums[:, _F["skipped"]]) > 0
    out: Dict[str, Any] = {"measured": bool(ran.any()), "snr_db": None, "step": None, "operands": {}}
    if not ran.any():
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = 10 * np.log10(sums[:, _F["signal"]] / sums[:, _F["noise"]])
    snr = np.where(ran, snr, np.inf)
    t = int(np.argmin(np.where(np.isnan(snr), -np.inf, snr)))
    out["snr_db"], out["step"], out["finite"] = _finite(snr[t]), steps[t], not np.isnan(snr[t])
    for side, operand in zip("ab", OPERANDS[gemm]):
        nonzero = np.maximum(sums[:, _F[f"{side}_nonzero"]], 1)
        flushed = np.where(ran, sums[:, _F[f"{side}_flushed"]] / nonzero, 0.0)
        saturated = np.where(ran, sums[:, _F[f"{side}_saturated"]] / nonzero, 0.0)
        f = int(np.argmax(flushed))
        out["operands"][operand] = {
            "flushed": float(flushed[f]),
            "flushed_step": steps[f],
            "saturated": float(saturated.max()),
        }
    return out


def _figures(run: AdviceRun, i: int, recipe: str) -> Dict[str, Dict[str, Any]]:
    r = RECIPES.index(recipe)
    return {g: _gemm_figures(run.sums[:, i, k, r], run.steps, g) for k, g in enumerate(GEMMS)}


def _skip_reason(run: AdviceRun, i: int, recipe: str) -> Optional[str]:
    """Why ``recipe`` cannot run layer ``i``'s shapes at some step, if so."""
    layer, r = run.layers[i], RECIPES.index(recipe)
    skipped = np.nan_to_num(run.sums[:, i, :, r, _F["skipped"]]) > 0  # [steps, GEMMS]
    if not skipped.any():
        return None
    k, n = layer.get("k"), layer.get("n")
    if recipe != "mxfp8":
        return f"K={k}, N={n}: torchao's FP8 GEMMs (`torch._scaled_mm`) take multiples of {FP8_ALIGN} only"
    if skipped[:, 0].any() or skipped[:, 1].any():
        dim = f"K={k}" if skipped[:, 0].any() else f"N={n}"
        return f"{dim} is not a multiple of {BLOCK}: MXFP8 casts blocks of {BLOCK} along each GEMM's reduction"
    step = run.steps[int(np.argmax(skipped[:, 2]))]
    return (
        f"the token count M at step {step} is not a multiple of {BLOCK}: the MXFP8 weight-gradient GEMM "
        f"reduces over the tokens in blocks of {BLOCK}"
    )


def _unconvertible(layer: Dict[str, Any]) -> Optional[str]:
    if layer.get("linear"):
        return None
    use = "a bare F.linear" if layer.get("how") == "linear" else "a matmul"
    return f"{use} on a weight of `{layer.get('module')}`, not an nn.Linear: torchao converts nn.Linear modules only"


def _violation(figures: Dict[str, Dict[str, Any]], limits: Thresholds) -> Optional[str]:
    """The worst breach of ``limits`` among the GEMMs (lowest SNR first), if any."""
    breaches: List[Tuple[float, str]] = []
    for gemm, f in figures.items():
        if not f["measured"]:
            continue
        worst = max(f["operands"].items(), key=lambda kv: kv[1]["flushed"])
        lost = f"; {worst[0]}: {worst[1]['flushed']:.1%} of its nonzero values flushed to zero"
        if not f["finite"]:
            breaches.append((-math.inf, f"{gemm} GEMM: SNR not finite at step {f['step']} (NaN or Inf operands)"))
        elif f["snr_db"] is not None and f["snr_db"] < limits.snr_db:
            snr = f"{gemm} GEMM: SNR {f['snr_db']:.1f} dB < {limits.snr_db:g} dB at step {f['step']}"
            breaches.append((f["snr_db"], snr + lost))
        for operand, o in f["operands"].items():
            if o["flushed"] > limits.flushed:
                what = f"{gemm} GEMM: {operand} {o['flushed']:.1%} of its nonzero values flushed to zero"
                breaches.append((1e6, f"{what} > {limits.flushed:.0%} at step {o['flushed_step']}"))
    return min(breaches)[1] if breaches else None


def _accepted(figures: Dict[str, Dict[str, Any]], limits: Thresholds) -> str:
    measured = {g: f for g, f in figures.items() if f["measured"]}
    gemm, f = min(measured.items(), key=lambda kv: math.inf if kv[1]["snr_db"] is None else kv[1]["snr_db"])
    snr = "exact" if f["snr_db"] is None else f"{f['snr_db']:.1f} dB"
    flushed = max(o["flushed"] for f in measured.values() for o in f["operands"].values())
    return (
        f"every GEMM >= {limits.snr_db:g} dB: worst {gemm} {snr} at step {f['step']}; "
        f"at most {flushed:.2%} of an operand's nonzero values flushed"
    )


def _decide(run: AdviceRun, i: int, recipe: str, limits: Thresholds) -> Tuple[str, str]:
    layer = run.layers[i]
    figures = _figures(run, i, recipe)
    ran = any(f["measured"] for f in figures.values())
    calls = np.nan_to_num(run.sums[:, i, 0, 0, _F["calls"]]).sum()
    why = _unconvertible(layer)
    if why is None and not calls:
        why = "not measured on any tracked step (not called, or run inside a compiled submodule)"
    why = why or _skip_reason(run, i, recipe)
    if why is None and recipe == "mxfp8" and layer.get("bias"):
        why = "it has a bias, which torchao 0.18's MXFP8 training drops (its F.linear override ignores the bias)"
    if why is None and ran:
        why = _violation(figures, limits)
    if why is not None or not ran:
        return KEEP, why or "no GEMM measured"
    return recipe, _accepted(figures, limits)


def advise(run: AdviceRun, recipe: str, limits: Thresholds = Thresholds()) -> Dict[str, Any]:
    """Every linear layer's decision for ``recipe`` under ``limits``, with its figures.

    Returns:
        ``{"recipe", "thresholds", "steps", "submodule", "layers": {name: {"format", "reason",
        "module", "gemms": {gemm: {"snr_db", "step", "operands": {operand: {"flushed",
        "flushed_step", "saturated"}}}}}}, "summary"}``; an SNR of None: exact (or no GEMM).

    Raises:
        ValueError: an unknown ``recipe``.
    """
    check_recipe_name(recipe)
    layers: Dict[str, Any] = {}
    for i, layer in enumerate(run.layers):
        fmt, reason = _decide(run, i, recipe, limits)
        figures = _figures(run, i, recipe)
        gemms = {g: {k: v for k, v in f.items() if k not in ("measured", "finite")} for g, f in figures.items()}
        layers[layer["name"]] = {"format": fmt, "reason": reason, "module": layer.get("module"), "gemms": gemms}
    return {
        "recipe": recipe,
        "thresholds": {"snr_db": limits.snr_db, "flushed": limits.flushed},
        "steps": list(run.steps),
        "submodule": run.submodule,
        "layers": layers,
        "summary": _summary(run, layers),
    }


def _summary(run: AdviceRun, layers: Dict[str, Any]) -> Dict[str, Any]:
    """The share of GEMMs in low precision, by count and by size (K x N: the same M for all)."""
    low = [n for n, d in layers.items() if d["format"] != KEEP]
    size = {l["name"]: float(l.get("k") or 0) * float(l.get("n") or 0) for l in run.layers}
    total = sum(size.values())
    return {
        "layers": len(layers),
        "low_precision": len(low),
        "gemm_share": len(low) / len(layers) if layers else 0.0,
        "size_share": sum(size[n] for n in low) / total if total else 0.0,
    }


def _number(args: Dict[str, str], name: str, default: float) -> float:
    raw = args.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)  # type: ignore[arg-type]
    except ValueError as e:
        raise ValueError(f"`{name}` must be a number, got {raw!r}") from e


def view(provider: Any, ctx: Any, eid: str, args: Dict[str, str]) -> Dict[str, Any]:
    """The dashboard's Advice view of run ``args["run"]``: ``advise``'s result for ``recipe``
    (default ``fp8-tensorwise``) under ``snr_db`` and ``flushed`` (defaults: the documented
    ones), with the recipes, GEMMs and defaults the view shows; ``{"available": False, ...}`` where
    the run has no advisor statistics.

    Raises:
        ValueError: an unknown recipe or a threshold out of range (the message names it).
    """
    recipe = check_recipe_name(args.get("recipe") or RECIPES[0])
    limits = Thresholds(_number(args, "snr_db", DEFAULT_SNR_DB), _number(args, "flushed", DEFAULT_FLUSHED))
    offer = {
        "recipes": list(RECIPES),
        "gemms": list(GEMMS),
        "defaults": {"snr_db": DEFAULT_SNR_DB, "flushed": DEFAULT_FLUSHED},
    }
    run = advice_log.read(provider, ctx, eid, args.get("run", ""))
    if run is None:
        why = "no precision-advisor statistics in this run: train it with ScaleMonitor(advise=True)"
        return {"available": False, **offer, "recipe": recipe, "why": why}
    return {"available": True, **offer, **advise(run, recipe, limits)}
