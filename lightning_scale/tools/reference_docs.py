"""The reference parts of the docs, generated from the code they describe.

- ``options_table()``: every argument of ``ScaleMonitor`` (name, type, default, meaning), from
  ``inspect.signature(ScaleMonitor.__init__)`` and the Args section of its docstring; docs/usage.md
  holds it between ``OPTIONS`` markers.
- ``help_text(argv)``: what ``lightning-scale ARGV --help`` prints at ``HELP_COLUMNS`` columns;
  docs/cli.md holds the top-level help and each subcommand's, each between ``HELP`` markers.

``python -m lightning_scale.tools.reference_docs DOCS_DIR`` rewrites those parts of
``DOCS_DIR/usage.md`` and ``DOCS_DIR/cli.md`` in place; the tests fail while a page differs
from what the code gives, so a new argument or option cannot be left out of the docs.

Example:

    >>> table = options_table()
    >>> table.splitlines()[0]
    '| argument | type | default | meaning |'
    >>> table.splitlines()[2].split(" | ")[:3]
    ['| `every_n_steps`', '`Optional[int]`', '`50`']
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import os
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from lightning_scale.callback import ScaleMonitor
from lightning_scale.tools.cli import COMMANDS, parser

__all__ = [
    "HELP_COLUMNS",
    "OPTIONS",
    "cli_help_commands",
    "docstring_args",
    "help_block",
    "help_text",
    "options_table",
    "rewrite",
    "rewrite_cli_page",
    "rewrite_usage_page",
]

#: The terminal width the help texts of docs/cli.md are rendered at (argparse wraps at COLUMNS - 2).
HELP_COLUMNS = 100
#: The markers around the options table in docs/usage.md.
OPTIONS = (
    "<!-- options: generated from ScaleMonitor's signature and docstring by "
    "`python -m lightning_scale.tools.reference_docs docs`; edit the docstring, not this table -->",
    "<!-- end of options -->",
)
_HELP_END = "<!-- end of help -->"


def docstring_args(doc: str) -> Dict[str, str]:
    """The ``Args:`` section of a Google-style docstring: argument name -> its text, the
    continuation lines joined by single spaces.

    Raises:
        ValueError: the docstring has no ``Args:`` section.

    Example:

        >>> docstring_args('''Summary.
        ...
        ...     Args:
        ...         width: the model's width,
        ...             a power of two.
        ...         depth: layers.
        ...
        ...     Raises:
        ...         ValueError: never.
        ... ''')
        {'width': "the model's width, a power of two.", 'depth': 'layers.'}
    """
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        raise ValueError(f"`doc` must hold an `Args:` section, got {doc[:60]!r}...") from None
    found: Dict[str, List[str]] = {}
    indent: Optional[int] = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        if depth < indent:  # the next section
            break
        name, sep, text = line.strip().partition(":")
        if depth == indent and sep and name.isidentifier():
            found[name] = [text.strip()]
        elif found:
            found[next(reversed(found))].append(line.strip())
    return {name: " ".join(part for part in parts if part) for name, parts in found.items()}


def _markdown(text: str) -> str:
    """A docstring's text as a markdown table cell: ``code`` as `code`, docs/X.md as a link
    relative to docs/, pipes escaped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    text = re.sub(r"docs/([\w-]+\.md)(#[\w-]+)?", r"[\1\2](\1\2)", text)
    return text.replace("|", "\\|")


def _default(value: object) -> str:
    if value is inspect.Parameter.empty:
        return "required"
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _annotation(value: object) -> str:
    text = value if isinstance(value, str) else inspect.formatannotation(value)
    return f"`{text}`".replace("|", "\\|")


def options_table(cls: type = ScaleMonitor) -> str:
    """The markdown table of every argument of ``cls.__init__``: name, type, default and the
    meaning its docstring's Args section gives, in the signature's order.

    Raises:
        ValueError: an argument the docstring does not describe, or one it describes that the
            signature does not have.
    """
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    meanings = docstring_args(cls.__doc__ or "")
    names = [p.name for p in params]
    missing, extra = [n for n in names if n not in meanings], [n for n in meanings if n not in names]
    if missing or extra:
        raise ValueError(
            f"`{cls.__name__}`'s docstring must describe each argument of its signature once: "
            f"undescribed {missing}, described but not in the signature {extra}"
        )
    rows = ["| argument | type | default | meaning |", "|---|---|---|---|"]
    for p in params:
        rows.append(
            f"| `{p.name}` | {_annotation(p.annotation)} | {_default(p.default)} | {_markdown(meanings[p.name])} |"
        )
    return "\n".join(rows)


@contextlib.contextmanager
def _columns(columns: int) -> Iterator[None]:
    """``COLUMNS`` set for argparse's formatter (it wraps at ``COLUMNS - 2``), then restored."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(columns)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def help_text(argv: Sequence[str] = (), columns: int = HELP_COLUMNS) -> str:
    """What ``lightning-scale *argv --help`` prints on a terminal ``columns`` wide (the parser's
    own ``--help`` action, run in this process)."""
    out = io.StringIO()
    with _columns(columns), contextlib.redirect_stdout(out):
        try:
            parser().parse_args([*argv, "--help"])
        except SystemExit:
            pass
    return out.getvalue()


def cli_help_commands() -> List[List[str]]:
    """The commands docs/cli.md shows the help of: the top level, then each subcommand."""
    return [[], *([name] for name in COMMANDS)]


def help_block(argv: Sequence[str]) -> str:
    """docs/cli.md's block of ``lightning-scale *argv --help``: its start marker, the text
    verbatim in a ``text`` fence, the end marker."""
    command = " ".join(["lightning-scale", *argv, "--help"])
    body = help_text(argv).rstrip("\n")
    return f"<!-- help: {command} -->\n```text\n$ {command}\n{body}\n```\n{_HELP_END}"


def rewrite(text: str, start: str, end: str, body: str) -> str:
    """``text`` with what lies between the line ``start`` and the line ``end`` replaced by
    ``body`` (markers kept).

    Raises:
        ValueError: ``text`` lacks either marker.
    """
    found = re.search(re.escape(start) + r"\n.*?\n" + re.escape(end), text, re.S)
    if found is None:
        raise ValueError(f"`text` must hold the markers {start!r} and {end!r}, each on its own line")
    return text[: found.start()] + f"{start}\n{body}\n{end}" + text[found.end() :]


def rewrite_usage_page(text: str) -> str:
    """docs/usage.md with its options table as the code gives it now."""
    return rewrite(text, *OPTIONS, options_table())


def rewrite_cli_page(text: str) -> str:
    """docs/cli.md with each help block as the command prints it now.

    Raises:
        ValueError: the page lacks the block of a command of ``cli_help_commands()``.
    """
    for argv in cli_help_commands():
        block = help_block(argv)
        start = block.split("\n", 1)[0]
        found = re.search(re.escape(start) + r"\n.*?" + re.escape(_HELP_END), text, re.S)
        if found is None:
            raise ValueError(f"`text` must hold a help block starting with {start!r}")
        text = text[: found.start()] + block + text[found.end() :]
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Rewrite the generated parts of ``DOCS_DIR/usage.md`` and ``DOCS_DIR/cli.md``."""
    p = argparse.ArgumentParser(description="Rewrite the generated parts of docs/usage.md and docs/cli.md.")
    p.add_argument("docs", metavar="DOCS_DIR", type=Path, help="the docs folder of a checkout")
    args = p.parse_args(argv)
    for name, fix in (("usage.md", rewrite_usage_page), ("cli.md", rewrite_cli_page)):
        page = args.docs / name
        page.write_text(fix(page.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":  # pragma: no cover - the docs' generator
    sys.exit(main())
