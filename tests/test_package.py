"""The package's public names: imported on first use, each the object its name promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_the_command_line_tools_start_without_torch_lightning_or_dynamo() -> None:
    out = fresh(
        "import sys, lightning_scale.tools.cli\n"
        "print(sorted(m for m in ('torch', 'lightning', 'torch._dynamo') if m in sys.modules))"
    )
    assert out == "[]"


def test_capture_is_the_function_whichever_name_is_imported_first() -> None:
    out = fresh(
        "from lightning_scale import ScaleMonitor\n"
        "import lightning_scale.capture.graphs, lightning_scale.coord_check\n"
        "from lightning_scale import capture\n"
        "import lightning_scale, sys, types\n"
        "print(callable(capture), capture is lightning_scale.capture, capture.__module__,\n"
        "      lightning_scale.coord_check.__module__,\n"
        "      isinstance(sys.modules['lightning_scale.capture'], types.ModuleType))"
    )
    assert out == "True True lightning_scale.capture.graphs lightning_scale.tools.coord_check True"


def test_every_public_name_resolves_and_an_unknown_one_is_an_attribute_error() -> None:
    import lightning_scale
    import lightning_scale.coord_check  # noqa: F401  (a module alias of a public name's module)

    for name in lightning_scale.__all__:
        assert getattr(lightning_scale, name).__name__ == name
    try:
        lightning_scale.no_such_name  # noqa: B018
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:  # pragma: no cover
        raise AssertionError("an unknown name resolved")
