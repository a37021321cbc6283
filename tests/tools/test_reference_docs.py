"""docs/usage.md's options table and docs/cli.md's help texts are what the code gives now.

The table comes from ``ScaleMonitor``'s signature and docstring, the help texts from the
command's own ``--help``: a new argument, or an option whose help changed, fails here until
the pages are regenerated (``python -m lightning_scale.tools.reference_docs docs``).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_scale import ScaleMonitor
from lightning_scale.tools import reference_docs as ref
from lightning_scale.tools.cli import COMMANDS

DOCS = Path(__file__).resolve().parents[2] / "docs"
REGENERATE = "regenerate with: python -m lightning_scale.tools.reference_docs docs"


def _options_block(page: str) -> str:
    start, end = ref.OPTIONS
    found = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), page, re.S)
    assert found is not None, "docs/usage.md lost its options markers"
    return found.group(1)


def test_the_usage_page_holds_the_options_table_the_code_gives() -> None:
    assert _options_block((DOCS / "usage.md").read_text()) == ref.options_table(), REGENERATE


def test_the_table_has_one_row_per_argument_with_its_default() -> None:
    rows = ref.options_table().splitlines()[2:]
    params = [p for p in inspect.signature(ScaleMonitor.__init__).parameters.values() if p.name != "self"]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{p.name}`" for p in params]
    cells = {row.split(" | ")[0][3:-1]: row.split(" | ") for row in rows}
    assert cells["every_n_steps"][1:3] == ["`Optional[int]`", "`50`"]
    assert cells["capture"][2] == '`"auto"`' and cells["recipe"][2] == "`None`"
    assert "[low_precision.md](low_precision.md)" in cells["advise"][3]  # a docs path becomes a link
    assert "log2\\|x\\|" in cells["value_histograms"][3]  # pipes escaped inside a cell
    assert all(row.count(" | ") == 3 for row in rows)  # four cells, whatever the text holds


def test_every_docstring_arg_keeps_its_continuation_lines() -> None:
    args = ref.docstring_args(ScaleMonitor.__doc__ or "")
    assert list(args) == [p for p in inspect.signature(ScaleMonitor.__init__).parameters if p != "self"]
    assert args["shadow"].startswith('``"auto"``: where the probe') and args["shadow"].endswith("See docs/capture.md.")
    assert "Raises" not in " ".join(args.values())  # the next section is not an argument's text


class _Documented:
    """A class whose docstring and signature disagree.

    Args:
        width: the width.
        depth: not in the signature.
    """

    def __init__(self, width: int = 8, height: int = 2) -> None:
        self.width, self.height = width, height


def test_an_argument_the_docstring_leaves_out_fails_the_table() -> None:
    with pytest.raises(ValueError, match=r"undescribed \['height'\], described but not in the signature \['depth'\]"):
        ref.options_table(_Documented)


def test_a_docstring_without_args_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`doc` must hold an `Args:` section, got 'No arguments here.'"):
        ref.docstring_args("No arguments here.")


def test_the_cli_page_holds_every_help_text_verbatim() -> None:
    page = (DOCS / "cli.md").read_text()
    assert [argv for argv in ref.cli_help_commands()] == [[], *([name] for name in COMMANDS)]
    for argv in ref.cli_help_commands():
        assert ref.help_block(argv) in page, f"lightning-scale {' '.join(argv)} --help differs; {REGENERATE}"
    assert ref.rewrite_cli_page(page) == page


def test_a_subcommand_without_its_help_block_fails_the_page() -> None:
    page = (DOCS / "cli.md").read_text()
    without = page.replace("<!-- help: lightning-scale advise --help -->", "<!-- help: gone -->")
    with pytest.raises(ValueError, match=r"must hold a help block starting with '<!-- help: lightning-scale advise"):
        ref.rewrite_cli_page(without)


def test_help_text_is_what_the_command_prints_at_that_width() -> None:
    env = {**os.environ, "COLUMNS": str(ref.HELP_COLUMNS)}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_scale.tools.cli", "advise", "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ref.help_text(["advise"])
    assert done.stdout.startswith("usage: lightning-scale advise [-h]")


def test_help_text_ignores_the_terminal_it_runs_in(monkeypatch: pytest.MonkeyPatch) -> None:
    wide = ref.help_text(["compare"])
    monkeypatch.setenv("COLUMNS", "40")
    assert ref.help_text(["compare"]) == wide
    assert os.environ["COLUMNS"] == "40"  # restored
    assert ref.help_text(["compare"], columns=40) != wide
    assert max(len(line) for line in wide.splitlines()) <= ref.HELP_COLUMNS - 2


def test_rewrite_replaces_only_between_the_markers() -> None:
    text = "head\n<!-- a -->\nold\nlines\n<!-- b -->\ntail\n"
    assert ref.rewrite(text, "<!-- a -->", "<!-- b -->", "new") == "head\n<!-- a -->\nnew\n<!-- b -->\ntail\n"
    with pytest.raises(ValueError, match=r"`text` must hold the markers '<!-- a -->' and '<!-- c -->'"):
        ref.rewrite(text, "<!-- a -->", "<!-- c -->", "new")
