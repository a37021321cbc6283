"""The docs a newcomer reads: every ```python block runs, and no page narrates history.

A page's ```python blocks are one program: they run in order, as one script, in a fresh
empty folder, with this checkout's package first on the path (a fragment that cannot run
alone is a ```py block, which is not run). History (sessions, issue numbers, what the code
used to do) belongs in git log: a page says what is true now.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def python_blocks(page: Path) -> List[str]:
    return BLOCK.findall(page.read_text())


RUNNABLE = [page for page in PAGES if python_blocks(page)]


def test_the_main_pages_show_complete_examples() -> None:
    names = {page.relative_to(ROOT).as_posix() for page in RUNNABLE}
    assert {"README.md", "docs/usage.md", "docs/low_precision.md", "docs/statistics.md"} <= names


def test_a_block_is_found_as_written() -> None:
    text = "intro\n```python\nx = 1\n```\n\n```py\nfragment(\n```\n```python\nprint(x)\n```\n"
    assert BLOCK.findall(text) == ["x = 1\n", "print(x)\n"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_python_blocks_of_a_page_run_as_one_program(page: Path, tmp_path: Path) -> None:
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(python_blocks(page)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    env.pop("LIGHTNING_SCALE_CACHE", None)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, f"{page.name}'s examples failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


#: Narration of how the code got here: sessions, issue numbers, earlier versions.
NARRATION = re.compile(
    r"\b(?:first|second|third|\w+th|last|this|that|previous|earlier|next) sessions?\b"
    r"|\bsessions? \d+\b"
    r"|\bissues? #?\d+"
    r"|\bissue's\b"
    r"|\bbefore this change\b"
    r"|\bused to (?:be|read|train|label|take|cost)\b"
    r"|\bearlier (?:runs?|versions?|code)\b"
    r"|\bthe code of before\b",
    re.I,
)


def narration(text: str) -> List[str]:
    return [m.group(0) for m in NARRATION.finditer(text)]


def test_the_narration_check_finds_history() -> None:
    said = "Eleventh session, measured the same way; issue 27's row; before this change it used to be 2x."
    assert narration(said) == ["Eleventh session", "issue 27", "before this change", "used to be"]
    assert narration("the previous step's payload, an earlier graph of the forward") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_page_says_what_is_true_now(page: Path) -> None:
    assert narration(page.read_text()) == []
