"""Every example in a docstring of the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch
from torch import fx, nn

import lightning_scale

MODULES = sorted(m.name for m in pkgutil.walk_packages(lightning_scale.__path__, "lightning_scale."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    # examples assume the usual imports, as a user's session would have them
    for test in finder.find(module, name, extraglobs={"torch": torch, "nn": nn, "fx": fx}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"


def test_examples_exist() -> None:
    """The public entry points carry examples (the parametrised test above is not vacuous)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    counted = {name: sum(len(t.examples) for t in finder.find(importlib.import_module(name), name)) for name in MODULES}
    assert all(
        counted[f"lightning_scale.{m}"] > 0
        for m in ["capture.interpreter", "tools.analyse", "step.selection", "record.stats"]
    )
