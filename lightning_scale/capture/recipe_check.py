"""Does a model obey a low-precision recipe? ``check_recipe(module, path)``.

A recipe file is the ``recipe.json`` that ``lightning-scale advise`` writes: a target recipe
and, per linear layer, the format it advises (``fp8-tensorwise``, ``fp8-rowwise``, ``mxfp8``
or ``keep``). A layer's *runtime form* is read from the module as torchao leaves it, without
importing torchao: a ``Float8Linear`` (``convert_to_float8_training``) is FP8 tensorwise or
rowwise by its cast configs; a weight wrapped as ``MXFP8TrainingWeightWrapperTensor``
(``quantize_`` with ``MXFP8TrainingOpConfig``; the module stays an ``nn.Linear``) is MXFP8; a
plain module is high precision (``keep``). Names are matched as ``LightningModule.named_modules()``
gives them, compiled wrappers' ``_orig_mod`` left out, from the LightningModule, the captured
submodule or any module the recipe's layers all sit in.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple, Union

from torch import nn

from lightning_scale.record.gemm_whatif import RECIPES

__all__ = ["FORMATS", "KEEP", "check_recipe", "common_prefixes", "contradictions", "load_recipe", "runtime_form"]

KEEP = "keep"
FORMATS = (*RECIPES, KEEP)
# torchao's cast configs (``CastConfig.short_str()`` of input, weight, grad_output) per recipe
_FP8_CONFIGS = {
    ("dyn_ten_e4m3", "dyn_ten_e4m3", "dyn_ten_e5m2"): "fp8-tensorwise",
    ("dyn_axs_e4m3", "dyn_axs_e4m3", "dyn_axs_e4m3"): "fp8-rowwise",
}


def load_recipe(path: Union[str, "os.PathLike[str]"], argument: str = "recipe") -> Dict[str, Any]:
    """The recipe file at ``path``, checked.

    Raises:
        ValueError: no such file, not JSON, or not a recipe (an unknown recipe or format);
            the message names ``argument``.
    """
    where = f"`{argument}`"
    if not isinstance(path, (str, os.PathLike)):  # (an int would open a file descriptor)
        raise ValueError(f"{where} must be the path of a recipe.json file, got {path!r} ({type(path).__name__})")
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as err:
        raise ValueError(f"{where} must be a recipe.json file, got {str(path)!r} ({err.strerror})") from err
    except ValueError as err:
        raise ValueError(f"{where} must be a recipe.json file, got {str(path)!r}, which is not JSON ({err})") from err
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), dict) or "recipe" not in doc:
        raise ValueError(f"{where} must be a recipe.json of `lightning-scale advise`, got {str(path)!r}")
    if doc["recipe"] not in RECIPES:
        raise ValueError(f"{where}: {str(path)!r} names the recipe {doc['recipe']!r}, not one of {list(RECIPES)}")
    bad = {
        n: l.get("format")
        for n, l in doc["layers"].items()
        if not isinstance(l, dict) or l.get("format") not in FORMATS
    }
    if bad:
        name, fmt = next(iter(bad.items()))
        raise ValueError(f"{where}: {str(path)!r} gives layer {name!r} the format {fmt!r}, not one of {list(FORMATS)}")
    return doc


def runtime_form(module: Any) -> Tuple[str, str]:
    """``(form, what it is)`` of a layer as torchao leaves it: a recipe name, ``keep`` for
    high precision, or ``fp8 (<cast configs>)`` for another FP8 configuration."""
    if isinstance(module, nn.Module) and type(module).__name__ == "Float8Linear":
        c = getattr(module, "config", None)
        try:
            key = tuple(x.short_str() for x in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output))
        except AttributeError:
            return "fp8 (unknown config)", "Float8Linear"
        form = _FP8_CONFIGS.get(key, f"fp8 ({','.join(key)})")
        disabled = getattr(getattr(c.cast_config_input_for_grad_weight, "scaling_type", None), "value", "")
        return (f"{form} (weight gradient in high precision)" if disabled == "disabled" else form), "Float8Linear"
    weight = getattr(module, "weight", module)
    kind = type(weight).__name__
    if kind == "MXFP8TrainingWeightWrapperTensor":
        return "mxfp8", f"{kind} weight"
    if kind == "Float8TrainingWeightWrapperTensor":
        recipe = getattr(getattr(weight, "config", None), "float8_linear_recipe", "rowwise")
        return f"fp8-{recipe}", f"{kind} weight"
    return KEEP, type(module).__name__


def _named(module: nn.Module) -> Dict[str, Any]:
    """Every module and parameter of ``module`` by name, ``_orig_mod`` left out."""
    from lightning_scale.capture import frames  # (here: the command-line tools import this module, not dynamo)

    out: Dict[str, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(frames.strip_compiled(name), p)
    for name, m in module.named_modules(remove_duplicate=False):
        out[frames.strip_compiled(name)] = m  # (a module before a parameter of the same name)
    return out


def common_prefixes(names: List[str]) -> List[str]:
    """``""`` and every module path that holds all of ``names`` (``model``, ``model.backbone``)."""
    parts = [n.split(".")[:-1] for n in names]
    common: List[str] = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return [""] + [".".join(common[: i + 1]) for i in range(len(common))]


def _resolve(recipe: Dict[str, Any], named: Dict[str, Any], where: str, module: nn.Module) -> Dict[str, Any]:
    """Recipe layer -> its object in ``named``, by the prefix that finds the most of them.

    Raises:
        ValueError: some layers are in no such place: a recipe of another model.
    """
    names = sorted(recipe["layers"])
    best: Dict[str, Any] = {}
    for prefix in common_prefixes(names):
        cut = len(prefix) + 1 if prefix else 0
        found = {n: named[n[cut:]] for n in names if n[cut:] in named}
        best = found if len(found) > len(best) else best
    missing = [n for n in names if n not in best]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"{where} is a recipe of another model: {len(missing)} of its {len(names)} layers "
            f"are not in this {type(module).__name__} ({shown})"
        )
    return best


def check_recipe(module: nn.Module, path: Union[str, "os.PathLike[str]"]) -> List[str]:
    """The layers of ``module`` whose runtime form contradicts the recipe at ``path``.

    Args:
        module: the model as it trains: the LightningModule, the captured submodule, or a
            compiled one, converted by torchao (or not).
        path: a ``recipe.json`` written by ``lightning-scale advise``.

    Returns:
        One line per contradicting layer, naming it: converted where the recipe keeps it in
        high precision, left in high precision where it should be converted, or converted to
        another recipe. Empty when the model obeys the recipe.

    Raises:
        ValueError: ``path`` is not a recipe file, or is a recipe of another model.

    Example::

        problems = check_recipe(model, "advice/recipe.json")  # [] when the model obeys it
    """
    return contradictions(module, load_recipe(path, "path"), f"`path` ({str(path)!r})")


def contradictions(module: nn.Module, recipe: Dict[str, Any], where: str) -> List[str]:
    """``check_recipe`` of a recipe already read (``load_recipe``); ``where`` names it in errors.

    Raises:
        ValueError: a recipe of another model.
    """
    found = _resolve(recipe, _named(module), where, module)
    out = []
    for name in sorted(found):
        want = recipe["layers"][name]["format"]
        form, what = runtime_form(found[name])
        if form == want:
            continue
        if want == KEEP:
            out.append(f"`{name}`: converted to {form} ({what}) where the recipe keeps it in high precision")
        elif form == KEEP:
            out.append(f"`{name}`: left in high precision ({what}) where the recipe says {want}")
        else:
            out.append(f"`{name}`: converted to {form} ({what}) where the recipe says {want}")
    return out
