"""The advisor's exports: ``recipe.json`` and ``torchao_recipe.py``, usable unedited.

``recipe.json`` holds the decisions (``dashboard.advice.advise``): the target recipe, the
thresholds, the tracked steps they rest on and, per linear layer, its format
(``fp8-tensorwise`` / ``fp8-rowwise`` / ``mxfp8`` / ``keep``), its worst GEMM figures and the
reason. ``check_recipe`` and ``ScaleMonitor(recipe=...)`` read it.

``torchao_recipe.py`` gives torchao what it takes: for the FP8 recipes ``config`` and
``module_filter_fn(module, fqn)`` for ``torchao.float8.convert_to_float8_training``; for
MXFP8 ``config`` and ``filter_fn(module, fqn)`` for ``torchao.quantization.quantize_``. The
filters take the names torchao passes when applied to the LightningModule, to any module
all the layers sit in (the captured submodule) or to a compiled one (``_orig_mod`` left
out). Where the machine cannot run the recipe natively (FP8: a CUDA GPU of compute
capability 8.9 or above; MXFP8: 10.0), ``config`` is torchao's emulation, so the same file
runs on a CPU. The file imports torchao; this package does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from lightning_scale.capture.recipe_check import KEEP, common_prefixes

__all__ = ["write_exports", "torchao_source"]

_FP8_IMPORTS = """
import dataclasses

import torch
from torchao.float8 import Float8LinearConfig
"""

_FP8 = '''
NATIVE_CAPABILITY = (8, 9)
config = Float8LinearConfig.from_recipe_name({name})
if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= NATIVE_CAPABILITY):
    config = dataclasses.replace(config, emulate=True)  # torchao's emulation: the same casts, on any device


def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
    """For ``convert_to_float8_training``: True for the layers the recipe converts."""
    return _listed(fqn)
'''

_MX_IMPORTS = """
import torch
from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
"""

_MX = '''
NATIVE_CAPABILITY = (10, 0)
_native = torch.cuda.is_available() and torch.cuda.get_device_capability() >= NATIVE_CAPABILITY
# the emulated recipe: the same RCEIL casts, GEMMs in high precision, on any device
config = MXFP8TrainingOpConfig.from_recipe(
    MXFP8TrainingRecipe.MXFP8_RCEIL if _native else MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL
)


def filter_fn(module: torch.nn.Module, fqn: str) -> bool:
    """For ``quantize_``: True for the linear layers the recipe converts (it wraps every
    parameter of a matching module, so nothing else may match)."""
    return isinstance(module, torch.nn.Linear) and _listed(fqn)
'''

_NAMES = '''

def _listed(fqn: str) -> bool:
    """Whether ``fqn`` (relative to the model the filter is applied to) is a converted layer."""
    name = ".".join(part for part in fqn.split(".") if part != "_orig_mod")
    return bool(name) and any((f"{prefix}.{name}" if prefix else name) in LAYERS for prefix in PREFIXES)
'''

_USAGE = {
    "fp8": "from torchao.float8 import convert_to_float8_training\n\n"
    "    convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)",
    "mxfp8": "from torchao.quantization import quantize_\n\n    quantize_(model, config, filter_fn=filter_fn)",
}


def torchao_source(advice: Dict[str, Any], source: str) -> str:
    """The text of ``torchao_recipe.py`` for ``advice`` (``dashboard.advice.advise``'s result);
    ``source`` says where it comes from (the log directory and run)."""
    recipe = advice["recipe"]
    converted = sorted(n for n, d in advice["layers"].items() if d["format"] != KEEP)
    kept = sorted(n for n, d in advice["layers"].items() if d["format"] == KEEP)
    mx = recipe == "mxfp8"
    t = advice["thresholds"]
    head = (
        f'"""A per-layer {recipe} recipe for torchao, advised by `lightning-scale advise`\n'
        f"from {source}.\n\n"
        f"{len(converted)} of {len(advice['layers'])} linear layers in {recipe}, the others kept in high\n"
        f"precision. Thresholds: every GEMM result >= {t['snr_db']:g} dB SNR, at most {t['flushed']:.0%} of an\n"
        f"operand's nonzero values flushed. The reason for each layer is in recipe.json.\n\n"
        f"Apply it to the model (the LightningModule, its submodule, or either compiled)::\n\n"
        f"    {_USAGE['mxfp8' if mx else 'fp8']}\n"
        f'"""\n'
    )
    names = (
        f"\nRECIPE = {json.dumps(recipe)}\n"
        f"#: the layers converted, as LightningModule.named_modules() names them\n"
        f"LAYERS = {_lines(converted)}\n"
        f"#: the layers kept in high precision (for reference)\n"
        f"KEPT = {_lines(kept)}\n"
        f"#: the module paths every layer sits in: the filters also take names relative to them\n"
        f"PREFIXES = {json.dumps(common_prefixes(sorted(advice['layers'])))}\n"
    )
    if mx:
        return head + _MX_IMPORTS + names + _MX + _NAMES
    return head + _FP8_IMPORTS + names + _FP8.format(name=json.dumps(recipe.split("-", 1)[1])) + _NAMES


def _lines(names: List[str]) -> str:
    """A set literal of ``names``, one a line."""
    return "{" + "".join(f"\n    {json.dumps(n)}," for n in names) + "\n}" if names else "set()"


def write_exports(advice: Dict[str, Any], out: Path, source: Dict[str, str]) -> List[Path]:
    """Write ``recipe.json`` and ``torchao_recipe.py`` of ``advice`` into ``out`` (created);
    ``source``: the log directory and run. Returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {k: v for k, v in advice.items() if k != "summary"}
    doc = {"recipe": doc.pop("recipe"), "thresholds": doc.pop("thresholds"), "source": source, **doc}
    doc["summary"] = advice["summary"]
    paths = [out / "recipe.json", out / "torchao_recipe.py"]
    paths[0].write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    where = f"run {source['run']!r} of {source['logdir']}"
    paths[1].write_text(torchao_source(advice, where), encoding="utf-8")
    return paths
