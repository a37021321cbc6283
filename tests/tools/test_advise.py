"""The precision advisor end to end: ``ScaleMonitor(advise=True)`` in real ``Trainer`` fits of an
MLP language model with an outlier layer and of one without, ``lightning-scale advise`` on their
logs, the decisions against torchao's own emulated layers, the exported ``torchao_recipe.py``
applied by torchao (the layers it converts, a fit of the converted model), ``check_recipe`` and
``ScaleMonitor(recipe=...)`` on deliberately wrong conversions, and bad input."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import math
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor, check_recipe
from lightning_scale.dashboard import advice_log
from lightning_scale.dashboard.logdir import LogDir
from lightning_scale.tools import synthetic
from lightning_scale.tools.cli import main
from lightning_scale.tools.demo import GPTModule
from lightning_scale.tools.models import synthetic_tokens
from lightning_scale.tools.outlier_model import OutlierLM

with warnings.catch_warnings():  # (torchao warns that its CUDA extensions do not load on CPU)
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.quantization import quantize_

STEPS = 5  # tracked: 0, 2, 4
OUTLIER = "model.blocks.2.fc2"


def fit(lit: pl.LightningModule, root: Path, callbacks: List[Any], steps: int = STEPS) -> pl.Trainer:
    x, y = synthetic_tokens(96, 32, 64)  # batches of 16 x 32 = 512 tokens (MXFP8 blocks of 32 fit)
    trainer = pl.Trainer(
        max_steps=steps,
        logger=pl.loggers.TensorBoardLogger(str(root), name="run") if callbacks else False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=16))
    return trainer


class Snapshot(pl.Callback):
    """The model and batch of step ``STEPS - 1`` (tracked), as that step starts."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, i: int) -> None:
        if trainer.global_step == STEPS - 1:
            self.model, self.batch = copy.deepcopy(pl_module.model), batch


def advised(root: Path, **kwargs: Any) -> Tuple[OutlierLM, Path]:
    torch.manual_seed(0)
    lit = OutlierLM(**kwargs)
    lit.snapshot = Snapshot()
    fit(lit, root, [ScaleMonitor(every_n_steps=2, advise=True), lit.snapshot])
    return lit, root


def read_advice(root: Path) -> advice_log.AdviceRun:
    from tensorboard.context import RequestContext

    logs = LogDir(root)
    run = advice_log.read(logs.provider, RequestContext(), "", logs.run_name(None))
    assert run is not None
    return run


@pytest.fixture(scope="module")
def outlier_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[OutlierLM, Path]:
    return advised(tmp_path_factory.mktemp("outlier"))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[OutlierLM, Path]:
    return advised(tmp_path_factory.mktemp("plain"), outlier_block=-1, bias=False)


def recipe_of(root: Path, out: Path, *args: str) -> Dict[str, Any]:
    assert main(["advise", str(root), "--out", str(out), *args]) == 0
    return json.loads((out / "recipe.json").read_text())


def load_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"recipe_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_outlier_layer_is_kept_and_every_other_layer_converted(
    outlier_run: Tuple[OutlierLM, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lit, root = outlier_run
    recipe = recipe_of(root, tmp_path)
    layers = recipe["layers"]
    linear = sorted(n for n, m in lit.named_modules() if isinstance(m, nn.Linear))
    assert sorted(layers) == linear and recipe["steps"] == [0, 2, 4]
    assert {n: d["format"] for n, d in layers.items()} == {
        n: "keep" if n == OUTLIER else "fp8-tensorwise" for n in linear
    }
    assert layers[OUTLIER]["reason"].startswith("forward GEMM: SNR ") and "input: " in layers[OUTLIER]["reason"]
    assert layers[OUTLIER]["gemms"]["forward"]["snr_db"] < 8 < 23 < layers[OUTLIER]["gemms"]["input_grad"]["snr_db"]
    assert recipe["summary"] == {
        "layers": 9,
        "low_precision": 8,
        "gemm_share": 8 / 9,
        "size_share": pytest.approx(29 / 33),
    }
    out = capsys.readouterr().out
    assert f"{OUTLIER}  keep" in out and "8 of 9 linear layers in fp8-tensorwise" in out
    rowwise = recipe_of(root, tmp_path / "rowwise", "--recipe", "fp8-rowwise", "--snr-db", "10")
    assert "flushed to zero > 10%" in rowwise["layers"][OUTLIER]["reason"]  # ~14 dB there, but ~28% flushed
    looser = recipe_of(root, tmp_path / "looser", "--recipe", "fp8-rowwise", "--snr-db", "10", "--flushed", "0.5")
    assert all(d["format"] == "fp8-rowwise" for d in looser["layers"].values())
    assert looser["thresholds"] == {"snr_db": 10.0, "flushed": 0.5}


def layer_operands(model: nn.Module, batch: Tuple[Tensor, Tensor]) -> Dict[str, Tuple[Tensor, Tensor]]:
    """Each linear layer's input and output gradient in a float32 step of ``model`` on ``batch``."""
    seen: Dict[str, Any] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):

            def hook(m: nn.Module, i: Any, o: Tensor, name: str = name) -> None:
                seen[name] = [i[0].detach()]
                o.register_hook(lambda g: seen[name].append(g.detach()))

            handles.append(m.register_forward_hook(hook))
    idx, targets = batch
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1)).backward()
    for h in handles:
        h.remove()
    return {n: (x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])) for n, (x, g) in seen.items()}


def torchao_snrs(layer: nn.Linear, x: Tensor, g: Tensor) -> Dict[str, float]:
    """SNR (dB) of torchao's emulated tensorwise layer's three GEMM results against float32."""
    results = []
    for convert in (False, True):
        model = nn.Sequential(nn.Linear(layer.in_features, layer.out_features, bias=False))
        with torch.no_grad():
            model[0].weight.copy_(layer.weight)
        if convert:
            convert_to_float8_training(model, config=dataclasses.replace(Float8LinearConfig(), emulate=True))
        xx = x.clone().requires_grad_(True)
        out = model(xx)
        out.backward(g)
        results.append({"forward": out.detach(), "input_grad": xx.grad, "weight_grad": model[0].weight.grad})
    ref, got = results
    return {k: snr_db(ref[k], got[k]) for k in ref}


def snr_db(ref: Tensor, got: Tensor) -> float:
    return 10 * math.log10(float(ref.double().square().sum() / (got - ref).double().square().sum()))


def test_decisions_agree_with_torchaos_emulated_layers(outlier_run: Tuple[OutlierLM, Path], tmp_path: Path) -> None:
    lit, root = outlier_run
    recipe = recipe_of(root, tmp_path)
    run = read_advice(root)
    t = run.steps.index(STEPS - 1)
    signal, noise = run.sums[t, :, :, 0, 2], run.sums[t, :, :, 0, 3]  # [layers, GEMMS] of fp8-tensorwise
    operands = layer_operands(lit.snapshot.model, lit.snapshot.batch)  # the tracked step's own operands
    assert len(operands) == 9
    for inner, (x, g) in operands.items():
        measured, name = torchao_snrs(lit.snapshot.model.get_submodule(inner), x, g), f"model.{inner}"
        i = run.names.index(name)
        for k, gemm in enumerate(("forward", "input_grad", "weight_grad")):
            logged = 10 * math.log10(signal[i, k] / noise[i, k])
            assert logged == pytest.approx(measured[gemm], abs=0.01), (name, gemm)
            assert recipe["layers"][name]["gemms"][gemm]["snr_db"] <= logged  # (the worst over the steps)
        assert (min(measured.values()) < 15) == (recipe["layers"][name]["format"] == "keep"), name


def test_a_model_without_outliers_converts_every_layer_in_every_recipe(
    plain_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    _, root = plain_run
    for recipe in ("fp8-tensorwise", "fp8-rowwise", "mxfp8"):
        layers = recipe_of(root, tmp_path / recipe, "--recipe", recipe)["layers"]
        assert len(layers) == 9 and all(d["format"] == recipe for d in layers.values()), recipe


def test_mxfp8_keeps_layers_with_a_bias_which_torchaos_mxfp8_training_drops(
    outlier_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    layers = recipe_of(outlier_run[1], tmp_path, "--recipe", "mxfp8")["layers"]
    assert all(d["format"] == "keep" and "it has a bias, which torchao 0.18" in d["reason"] for d in layers.values())
    # the fact behind the rule: the wrapped layer's output lacks its bias (when torchao fixes this, drop the rule)
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 64))
    with torch.no_grad():
        layer[0].bias.fill_(100.0)
    x = torch.randn(32, 64)
    expected = layer(x)
    config = load_mx_config()
    quantize_(layer, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear))
    assert expected.mean() > 99 and layer(x).mean().abs() < 1


def load_mx_config() -> Any:
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    return MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)


def test_each_tracked_step_measures_each_layer_once_and_training_stays_bit_identical(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = OutlierLM()
    fit(plain, tmp_path / "plain", [])
    lit, root = advised(tmp_path / "advised")
    assert plain.losses == lit.losses
    for (name, a), b in zip(plain.state_dict().items(), lit.state_dict().values()):
        assert torch.equal(a, b), name
    logs = LogDir(root)
    from tensorboard.context import RequestContext

    run = advice_log.read(logs.provider, RequestContext(), "", logs.run_name(None))
    assert run is not None and run.steps == [0, 2, 4]
    calls = run.sums[..., 0]  # [steps, layers, GEMMS, RECIPES]: one call of each GEMM per tracked step
    assert (calls == 1).all()


def test_the_exported_fp8_file_converts_exactly_the_recipes_layers_and_trains(
    outlier_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    recipe = recipe_of(outlier_run[1], tmp_path)
    exported = load_file(tmp_path / "torchao_recipe.py")
    assert exported.config.emulate and exported.LAYERS == {
        n for n, d in recipe["layers"].items() if d["format"] != "keep"
    }
    for where in ("root", "submodule", "compiled"):
        torch.manual_seed(0)
        lit = OutlierLM()
        if where == "compiled":
            lit.model = torch.compile(lit.model)
        target = lit if where == "root" else lit.model
        convert_to_float8_training(target, config=exported.config, module_filter_fn=exported.module_filter_fn)
        converted = {n.replace("_orig_mod.", "") for n, m in lit.named_modules() if type(m).__name__ == "Float8Linear"}
        assert converted == exported.LAYERS, where
        assert (
            check_recipe(lit, tmp_path / "recipe.json") == [] and check_recipe(target, tmp_path / "recipe.json") == []
        )
    torch.manual_seed(0)
    lit = OutlierLM()
    convert_to_float8_training(lit, config=exported.config, module_filter_fn=exported.module_filter_fn)
    fit(lit, tmp_path, [], steps=3)
    assert len(lit.losses) == 3 and all(math.isfinite(v) for v in lit.losses) and lit.losses[-1] < lit.losses[0]


def test_the_exported_mxfp8_file_wraps_exactly_the_recipes_layers_and_trains(
    plain_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    recipe_of(plain_run[1], tmp_path, "--recipe", "mxfp8")
    exported = load_file(tmp_path / "torchao_recipe.py")
    torch.manual_seed(0)
    lit = OutlierLM(outlier_block=-1, bias=False)
    quantize_(lit.model, exported.config, filter_fn=exported.filter_fn)  # (the submodule's names)
    wrapped = {n for n, m in lit.named_modules() if type(getattr(m, "weight", None)).__name__.startswith("MXFP8")}
    assert wrapped == exported.LAYERS and len(wrapped) == 9
    assert check_recipe(lit, tmp_path / "recipe.json") == []
    fit(lit, tmp_path, [], steps=2)
    assert all(math.isfinite(v) for v in lit.losses)


def test_a_wrong_conversion_is_named_by_check_recipe_and_by_the_monitor(
    outlier_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    recipe_of(outlier_run[1], tmp_path)
    path = tmp_path / "recipe.json"
    every = OutlierLM()
    convert_to_float8_training(every, config=dataclasses.replace(Float8LinearConfig(), emulate=True))  # no filter
    assert check_recipe(every, path) == [
        f"`{OUTLIER}`: converted to fp8-tensorwise (Float8Linear) where the recipe keeps it in high precision"
    ]
    rowwise = OutlierLM()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    convert_to_float8_training(rowwise, config=config, module_filter_fn=lambda m, fqn: fqn != "model.head")
    found = check_recipe(rowwise, path)
    assert "`model.head`: left in high precision (Linear) where the recipe says fp8-tensorwise" in found
    assert "`model.blocks.0.fc1`: converted to fp8-rowwise (Float8Linear) where the recipe says fp8-tensorwise" in found
    assert len(found) == 9
    with pytest.warns(UserWarning, match=rf"does not follow `recipe` \({path}\): `{OUTLIER}`: converted to fp8"):
        fit(every, tmp_path / "monitored", [ScaleMonitor(start_step=10, recipe=str(path))], steps=1)


def test_a_converted_model_is_tracked_under_the_layer_names_of_its_high_precision_run(
    outlier_run: Tuple[OutlierLM, Path], tmp_path: Path
) -> None:
    recipe = recipe_of(outlier_run[1], tmp_path)
    exported = load_file(tmp_path / "torchao_recipe.py")
    lit = OutlierLM()
    convert_to_float8_training(lit, config=exported.config, module_filter_fn=exported.module_filter_fn)
    fit(lit, tmp_path / "converted", [ScaleMonitor(every_n_steps=2)], steps=1)
    labels = {
        "high precision": LogDir(outlier_run[0].trainer.logger.log_dir).load().labels,
        "converted": LogDir(tmp_path / "converted").load().labels,
    }
    for name in recipe["layers"]:  # every layer's ops are recorded under its name in both runs
        for run, found in labels.items():
            assert any(label.startswith(f"{name}/") for label in found), (run, name)


def test_bad_input_is_one_line_and_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic.main(["--nodes", "4", "--steps", "2", "--logdir", str(tmp_path / "logs")])
    assert main(["advise", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no precision-advisor statistics" in err and "ScaleMonitor(advise=True)" in err
    assert main(["advise", str(tmp_path / "logs"), "--recipe", "nvfp4"]) == 2
    err = capsys.readouterr().err.strip()
    recipes = "['fp8-tensorwise', 'fp8-rowwise', 'mxfp8']"
    assert err == f"lightning-scale advise: error: `recipe` must be one of {recipes}, got 'nvfp4'"
    assert main(["advise", str(tmp_path / "logs"), "--flushed", "2"]) == 2
    assert "`flushed` must be a fraction in [0, 1], got 2.0" in capsys.readouterr().err


def test_a_recipe_of_another_model_or_no_recipe_is_refused(outlier_run: Tuple[OutlierLM, Path], tmp_path: Path) -> None:
    recipe_of(outlier_run[1], tmp_path)
    with pytest.raises(
        ValueError,
        match=r"is a recipe of another model: 8 of its 9 layers are not in this GPTModule \(model.blocks.0.fc1",
    ):
        check_recipe(GPTModule(layers=1, dim=32), tmp_path / "recipe.json")
    with pytest.raises(ValueError, match=r"`recipe` must be a recipe.json file, got '.*missing.json' \(No such file"):
        ScaleMonitor(recipe=str(tmp_path / "missing.json"))
    doc = json.loads((tmp_path / "recipe.json").read_text())
    doc["recipe"] = "fp4"
    (tmp_path / "other.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"names the recipe 'fp4', not one of \['fp8-tensorwise'"):
        check_recipe(OutlierLM(), tmp_path / "other.json")
