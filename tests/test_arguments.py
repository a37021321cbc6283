"""Every argument of ScaleMonitor is checked when it is built (leaf names when the model is
known, at fit start, before step 0), with a ValueError naming it; and the validators of
``lightning_scale.arguments`` that do the checking."""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import ScaleMonitor, arguments

# (argument, bad value, what the error must say). Every argument of ScaleMonitor.__init__
# appears at least once (test_every_argument_has_a_bad_value).
BAD = [
    ("every_n_steps", 0, r"`every_n_steps` must be a positive integer or None, got 0$"),
    ("every_n_steps", True, r"`every_n_steps` must be a positive integer or None, got True \(bool\)"),
    ("every_n_steps", 2.0, r"`every_n_steps` must be a positive integer or None, got 2.0 \(float\)"),
    ("every_n_steps", "5", r"`every_n_steps` must be a positive integer or None, got '5' \(str\)"),
    ("steps", 3, r"`steps` must be a list of non-negative integers or None, got 3 \(int\)"),
    ("steps", "12", r"`steps` must be a list of non-negative integers or None, got '12' \(str\)"),
    ("steps", [1, True], r"`steps` must hold non-negative integers, got \[True\] in \[1, True\]"),
    ("steps", (4, 2), r"`steps` must be sorted and free of repeats, got \(4, 2\)"),
    ("start_step", -1, r"`start_step` must be a non-negative integer, got -1$"),
    ("start_step", None, r"`start_step` must be a non-negative integer, got None \(NoneType\)"),
    ("start_step", False, r"`start_step` must be a non-negative integer, got False \(bool\)"),
    ("stop_step", 2.5, r"`stop_step` must be an integer or None, got 2.5 \(float\)"),
    ("stop_step", 0, r"`stop_step` must be an integer above `start_step` \(0\) or None, got 0"),
    (
        "submodule",
        5,
        r"`submodule` must be a dotted module path \(a str such as 'blocks.0.attn'\) or None, got 5 \(int\)",
    ),
    ("submodule", b"net", r"`submodule` must be a dotted module path .* or None, got b'net' \(bytes\)"),
    ("submodule", "net..0", r"`submodule` must be a dotted module path .* or None, got 'net..0'$"),
    ("submodule", "", r"`submodule` must be a dotted module path .* or None, got ''$"),
    ("capture", "jit", r"`capture` must be one of \['auto', 'fx', 'dynamo'\], got 'jit'"),
    ("capture", None, r"`capture` must be one of \['auto', 'fx', 'dynamo'\], got None"),
    (
        "statistics",
        ["std", "std"],
        r"`statistics` must name each statistic once, got \['std', 'std'\] \(repeated: \['std'\]\)",
    ),
    ("statistics", "std", r"`statistics` must be a non-empty list of statistic names, .* or None, got 'std' \(str\)"),
    ("statistics", [], r"`statistics` must be a non-empty list of statistic names, .*, got \[\]"),
    (
        "statistics",
        ["std", "skewness"],
        r"`statistics` has an unknown statistic 'skewness'; choose from \[.*'absmax'.*\], a `Statistic`",
    ),
    ("statistics", [1], r"`statistics` entries must be statistic names or `Statistic`s, got 1 \(int\)"),
    ("include", 5, r"`include` must be a regular expression \(a str\) or None, got 5 \(int\)"),
    ("include", "net([", r"`include` must be a valid regular expression, got 'net\(\['"),
    (
        "include",
        re.compile(b"fc"),
        r"`include` must be a regular expression \(a str\) or None, got re.compile\(b'fc'\)",
    ),
    ("exclude", b"fc1", r"`exclude` must be a regular expression \(a str\) or None, got b'fc1' \(bytes\)"),
    ("exclude", "*x", r"`exclude` must be a valid regular expression, got '\*x'"),
    ("prune_views", "no", r"`prune_views` must be True or False, got 'no' \(str\)"),
    ("prune_views", 1, r"`prune_views` must be True or False, got 1 \(int\)"),
    ("max_tags", True, r"`max_tags` must be a positive integer, got True \(bool\)"),
    ("max_tags", 0, r"`max_tags` must be a positive integer, got 0$"),
    ("max_tags", 1e3, r"`max_tags` must be a positive integer, got 1000.0 \(float\)"),
    ("histograms", "no", r"`histograms` must be True or False, got 'no' \(str\)"),
    ("histograms", None, r"`histograms` must be True or False, got None \(NoneType\)"),
    ("figure", 1, r"`figure` must be True or False, got 1 \(int\)"),
    ("figure_every", 0, r"`figure_every` must be a positive integer, got 0$"),
    ("figure_every", True, r"`figure_every` must be a positive integer, got True \(bool\)"),
    ("code", "yes", r"`code` must be True or False, got 'yes' \(str\)"),
    ("value_histograms", b"fc", r"`value_histograms` must be a regular expression \(a str\) or None, got b'fc'"),
    ("value_histograms", "a)", r"`value_histograms` must be a valid regular expression, got 'a\)'"),
    ("rank_spread", 0, r"`rank_spread` must be True or False, got 0 \(int\)"),
    ("track_validation", "true", r"`track_validation` must be True or False, got 'true' \(str\)"),
    ("unscale_gradients", None, r"`unscale_gradients` must be True or False, got None"),
    ("leaf_modules", "fc1", r"`leaf_modules` must be a list of str or None, got 'fc1' \(str\)"),
    ("leaf_modules", 5, r"`leaf_modules` must be a list of str or None, got 5 \(int\)"),
    ("leaf_modules", ["net.0", 3], r"`leaf_modules` must be a list of str, got \['net.0', 3\]"),
    ("leaf_modules", ["net..0"], r"`leaf_modules` must hold dotted module paths .*, got \['net..0'\] in \['net..0'\]"),
    ("anomaly_steps", -1, r"`anomaly_steps` must be a non-negative integer \(0 turns detection off\), got -1"),
    ("anomaly_steps", True, r"`anomaly_steps` must be a non-negative integer .*, got True \(bool\)"),
    ("anomaly_factor", 1, r"`anomaly_factor` must be a finite number above 1, got 1$"),
    ("anomaly_factor", math.inf, r"`anomaly_factor` must be a finite number above 1, got inf"),
    ("anomaly_factor", math.nan, r"`anomaly_factor` must be a finite number above 1, got nan"),
    ("anomaly_factor", True, r"`anomaly_factor` must be a finite number above 1, got True \(bool\)"),
    ("anomaly_factor", "10", r"`anomaly_factor` must be a finite number above 1, got '10' \(str\)"),
    ("update_ratios", "yes", r"`update_ratios` must be True or False, got 'yes' \(str\)"),
    ("verify_capture", 1, r"`verify_capture` must be True or False, got 1 \(int\)"),
    ("advise", "yes", r"`advise` must be True or False, got 'yes' \(str\)"),
    ("recipe", 5, r"`recipe` must be the path of a recipe.json file, got 5 \(int\)"),
    ("recipe", "/no/such/recipe.json", r"`recipe` must be a recipe.json file, got '/no/such/recipe.json' \(No such"),
    ("shadow", "sometimes", r"`shadow` must be one of \['auto', 'always', 'never'\], got 'sometimes'"),
    ("shadow", True, r"`shadow` must be one of \['auto', 'always', 'never'\], got True$"),
    ("strict_ranks", "yes", r"`strict_ranks` must be True or False, got 'yes' \(str\)"),
    ("max_log_bytes", 0, r"`max_log_bytes` must be a positive integer or None \(bytes\), got 0"),
    ("max_log_bytes", True, r"`max_log_bytes` must be a positive integer or None \(bytes\), got True \(bool\)"),
]


@pytest.mark.parametrize(("name", "value", "match"), BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_a_bad_argument_is_refused_at_construction(name: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ScaleMonitor(**{name: value})


def test_every_argument_has_a_bad_value() -> None:
    """A new argument of ScaleMonitor must come with its check and a case above."""
    names = set(inspect.signature(ScaleMonitor.__init__).parameters) - {"self"}
    assert names - {n for n, _, _ in BAD} == set()


def test_the_valid_forms_still_work() -> None:
    """None where allowed, tuples where lists are, numpy integers, compiled str patterns."""
    monitor = ScaleMonitor(
        every_n_steps=None,
        steps=(0, np.int64(3)),
        start_step=np.int32(0),
        stop_step=None,
        submodule=None,
        statistics=("std", "absmax"),
        include=re.compile(r"net\.0"),
        exclude=None,
        max_tags=np.int64(5),
        value_histograms=None,
        leaf_modules=("net.0",),
        anomaly_steps=2,
        anomaly_factor=3,
    )
    assert monitor.schedule.steps == [0, 3] and all(type(s) is int for s in monitor.schedule.steps)
    assert monitor.schedule.every_n_steps is None and monitor.schedule.stop_step is None
    assert type(monitor.schedule.start_step) is int
    assert monitor.statistics == ["std", "absmax"] and monitor.groups == ["moments", "range"]
    assert monitor.include is not None and monitor.include.pattern == r"net\.0" and monitor.exclude is None
    assert monitor.leaf_modules == ["net.0"] and monitor.submodule is None
    assert monitor.anomaly_steps == 2 and monitor.anomaly_factor == 3.0 and type(monitor.anomaly_factor) is float

    defaults = ScaleMonitor(statistics=None, leaf_modules=None, submodule="blocks.0.attn")
    assert defaults.statistics == ["std"] and defaults.leaf_modules == [] and defaults.submodule == "blocks.0.attn"
    assert defaults.schedule.every_n_steps == 50 and defaults.capture_mode == "auto"
    assert defaults.anomaly_steps == 0 and defaults.update_ratios is False and defaults.verify_capture is True
    assert defaults.shadow == "auto"


# ---- leaf names: known only with the model, checked at fit start before step 0 ----------


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.steps_run = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.steps_run += 1
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LateMLP(MLP):
    """Builds its head in `configure_model`, which runs after the callbacks' `setup`."""

    def __init__(self) -> None:
        super().__init__()
        self.head: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.head is None:
            self.head = nn.Sequential(nn.Linear(2, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.net(x))


def _fit(model: MLP, root: Path, monitor: ScaleMonitor, max_steps: int = 1) -> pl.Trainer:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[monitor],
        logger=TensorBoardLogger(root, name="tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return trainer


@pytest.mark.parametrize(
    ("leaves", "match"),
    [
        (
            ["nonexistent"],
            r"`leaf_modules` must name submodules of MLP, got unknown \['nonexistent'\]; nearest: \['net'",
        ),
        (["qqqq"], r"unknown \['qqqq'\]; submodules include \['net', 'net.0', 'net.1', 'net.2'\]$"),
        (
            ["net.0", "net.O"],
            r"`leaf_modules` must name submodules of MLP, got unknown \['net.O'\]; nearest: \[.*'net.0'",
        ),
    ],
)
def test_unknown_leaf_names_raise_before_training(tmp_path: Path, leaves: List[str], match: str) -> None:
    model = MLP()
    with pytest.raises(ValueError, match=match):
        _fit(model, tmp_path, ScaleMonitor(every_n_steps=1, leaf_modules=leaves))
    assert model.steps_run == 0


def test_leaf_names_are_relative_to_the_submodule_and_may_be_built_in_configure_model(tmp_path: Path) -> None:
    model = MLP()
    trainer = _fit(model, tmp_path / "sub", ScaleMonitor(every_n_steps=1, submodule="net", leaf_modules=["0"]))
    assert trainer.global_step == 1 and model.steps_run == 1
    with pytest.raises(ValueError, match=r"`leaf_modules` must name submodules of Sequential, got unknown \['net.0'\]"):
        _fit(MLP(), tmp_path / "bad", ScaleMonitor(every_n_steps=1, submodule="net", leaf_modules=["net.0"]))
    late = LateMLP()
    assert _fit(late, tmp_path / "late", ScaleMonitor(every_n_steps=1, leaf_modules=["head.0"])).global_step == 1


def test_a_bytes_exclude_no_longer_reaches_training(tmp_path: Path) -> None:
    """It was accepted and ended the fit at the end of step 0 (`cannot use a bytes pattern`)."""
    with pytest.raises(ValueError, match=r"`exclude` must be a regular expression \(a str\) or None, got b'fc1'"):
        _fit(MLP(), tmp_path, ScaleMonitor(every_n_steps=1, exclude=b"fc1"))  # type: ignore[arg-type]


# ---- the validators ------------------------------------------------------------------------


def test_integers_refuse_bools_and_accept_numpy_integers() -> None:
    assert arguments.positive_int("n", np.int64(3)) == 3 and type(arguments.positive_int("n", np.int64(3))) is int
    assert arguments.non_negative_int("n", 0) == 0
    assert arguments.integer("n", None, allow_none=True) is None
    assert arguments.integer("n", -7) == -7
    with pytest.raises(ValueError, match=r"^`n` must be a positive integer, got True \(bool\)$"):
        arguments.positive_int("n", True)
    with pytest.raises(ValueError, match=r"^`n` must be a non-negative integer \(what 0 means\), got -1$"):
        arguments.non_negative_int("n", -1, note="what 0 means")
    with pytest.raises(ValueError, match=r"^`n` must be an integer >= 3 or None, got 2$"):
        arguments.integer("n", 2, minimum=3, allow_none=True)
    with pytest.raises(ValueError, match=r"^`n` must be an integer, got None \(NoneType\)$"):
        arguments.integer("n", None)
    with pytest.raises(ValueError, match=r"^`n` must be a positive integer, got tensor\(3\) \(Tensor\)$"):
        arguments.positive_int("n", torch.tensor(3))


def test_int_lists() -> None:
    assert arguments.int_list("w", (1, np.int64(2)), minimum=1) == [1, 2]
    assert arguments.int_list("w", range(3)) == [0, 1, 2]
    assert arguments.int_list("w", None, allow_none=True) is None
    with pytest.raises(ValueError, match=r"^`w` must hold integers >= 2, got \[1\] in \[1, 2\]$"):
        arguments.int_list("w", [1, 2], minimum=2)
    with pytest.raises(ValueError, match=r"^`w` must be a list of positive integers, got b'\\x01' \(bytes\)$"):
        arguments.int_list("w", b"\x01", minimum=1)


def test_numbers_booleans_and_choices() -> None:
    assert arguments.number("f", 2, above=1) == 2.0 and arguments.number("f", np.float32(1.5), above=1) == 1.5
    with pytest.raises(ValueError, match=r"^`f` must be a finite number above 0.5, got -inf$"):
        arguments.number("f", -math.inf, above=0.5)
    assert arguments.boolean("b", False) is False
    with pytest.raises(ValueError, match=r"^`b` must be True or False, got np.True_ \(bool\)$|got True \(bool_\)$"):
        arguments.boolean("b", np.bool_(True))
    arguments.booleans(a=True, b=False)
    with pytest.raises(ValueError, match=r"^`b` must be True or False, got 'no' \(str\)$"):
        arguments.booleans(a=True, b="no")
    assert arguments.one_of("c", "fx", ("auto", "fx")) == "fx"
    with pytest.raises(ValueError, match=r"^`c` must be one of \['auto', 'fx'\], got 'FX'$"):
        arguments.one_of("c", "FX", ("auto", "fx"))


def test_regexes_and_string_lists() -> None:
    pattern = re.compile("a|b")
    assert arguments.regex("r", pattern) is pattern and arguments.regex("r", None) is None
    assert arguments.regex("r", "a.c").pattern == "a.c"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"^`r` must be a regular expression \(a str\), got None \(NoneType\)$"):
        arguments.regex("r", None, allow_none=False)
    with pytest.raises(ValueError, match=r"^`r` must be a valid regular expression, got '\[' \(unterminated"):
        arguments.regex("r", "[")
    assert arguments.string_list("s", ("a", "a")) == ["a", "a"]  # repeats are refused only where asked
    assert arguments.string_list("s", [], allowed={"a"}) == []
    assert arguments.choices("s", ["b", "a"], {"a", "b"}) == ["b", "a"]
    with pytest.raises(
        ValueError, match=r"^`s` must name each item once, got \['a', 'b', 'a'\] \(repeated: \['a'\]\)$"
    ):
        arguments.choices("s", ["a", "b", "a"], {"a", "b"})
    with pytest.raises(ValueError, match=r"^`s` must be a non-empty list from \['a', 'b'\], got \{'a'\} \(set\)$"):
        arguments.choices("s", {"a"}, {"a", "b"})


def test_module_paths() -> None:
    assert arguments.module_path("p", "blocks.0.attn") == "blocks.0.attn"
    assert arguments.module_path("p", "layers.fc-1") == "layers.fc-1"  # ModuleDict keys may hold any character but "."
    assert arguments.module_paths("p", None) == [] and arguments.module_paths("p", ("a.b",)) == ["a.b"]
    for bad in (".a", "a.", "a. b", "a\tb"):
        with pytest.raises(
            ValueError, match=r"^`p` must be a dotted module path \(a str such as 'blocks.0.attn'\), got"
        ):
            arguments.module_path("p", bad, allow_none=False)
    with pytest.raises(ValueError, match=r"^`p` must hold dotted module paths \(such as 'blocks.0.attn'\), got \[''\]"):
        arguments.module_paths("p", ["a", ""])


def test_every_error_names_the_argument_in_backticks() -> None:
    calls: Dict[str, Any] = {
        "positive_int": ("x", 0),
        "non_negative_int": ("x", -1),
        "integer": ("x", "1"),
        "int_list": ("x", 1),
        "boolean": ("x", 1),
        "one_of": ("x", "z", ["a"]),
        "regex": ("x", b"a"),
        "string_list": ("x", "a"),
        "choices": ("x", [], ["a"]),
        "module_path": ("x", 1),
        "module_paths": ("x", "a"),
    }
    for name, args in calls.items():
        with pytest.raises(ValueError, match=r"^`x` must "):
            getattr(arguments, name)(*args)
    number_error = pytest.raises(ValueError, match=r"^`x` must ")
    with number_error:
        arguments.number("x", 0, above=1)
    assert set(arguments.__all__) == set(calls) | {"number", "booleans"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recurse_modules": "no"}, r"`recurse_modules` must be True or False, got 'no' \(str\)"),
        ({"syntax_highlight": 1}, r"`syntax_highlight` must be True or False, got 1 \(int\)"),
        ({"leaf_modules": "fc1"}, r"`leaf_modules` must be a list or tuple of module types or qualified names"),
    ],
)
def test_analyse_module_checks_its_arguments(kwargs: Dict[str, Any], match: str) -> None:
    from lightning_scale import analyse_module

    with pytest.raises(ValueError, match=match):
        analyse_module(nn.Linear(2, 2), torch.randn(3, 2), torch.randn(3, 2), **kwargs)
