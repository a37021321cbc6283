"""The code reads as docs/architecture.md promises: lines of at most 120 columns and no
formatter markers (fmt skip, fmt off) anywhere; in the package, no function over 60 lines (docstring aside), no
module over 450 lines, no import of another module's underscore names and no write to
another object's private attributes. Each check is also run on a synthetic source that
breaks it, so none of them can pass by accident."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_scale"
TREES = ("lightning_scale", "tests", "benchmarks", "examples")
MAX_COLUMNS, MAX_FUNCTION, MAX_MODULE = 120, 60, 450
FORMATTER_MARKERS = tuple("# fmt" + f": {word}" for word in ("skip", "off"))  # (not written whole: this file)


def python_files(*trees: str) -> Iterator[Path]:
    for tree in trees:
        yield from sorted((ROOT / tree).rglob("*.py"))


def long_lines(source: str) -> List[int]:
    return [i for i, line in enumerate(source.splitlines(), 1) if len(line) > MAX_COLUMNS]


def long_functions(source: str) -> Dict[str, int]:
    """Functions longer than ``MAX_FUNCTION`` lines, their docstring not counted."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
        start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
        length = (node.end_lineno or start) - start + 1
        if length > MAX_FUNCTION:
            out[f"{node.name}:{node.lineno}"] = length
    return out


def private_imports(source: str) -> List[str]:
    """``from lightning_scale... import _name``: another module's private name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("lightning_scale")
            or (isinstance(node, ast.ImportFrom) and node.level)
        ):
            found += [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
    return found


#: Writes to a private attribute that an outside API asks for, each with its reason.
ALLOWED_PRIVATE_WRITES = {
    # the reference library's API: its interpreter reads function placeholders from there
    "graph._tracer_extras",
}


#: NamedTuple's API: public, though its names start with an underscore.
NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def private_uses(source: str) -> List[str]:
    """``name._x`` where ``name`` is imported from the package: another module's private
    name used through its module or class."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_scale"):
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("lightning_scale")}
    return [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in imported
        and _private(n.attr)
        and n.attr not in NAMEDTUPLE_API
    ]


def private_writes(source: str) -> List[Tuple[int, str]]:
    """Assignments to ``x._name`` (or ``setattr(x, "_name", ...)``) where ``x`` is not
    ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: List[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and _private(t.attr) and not _is_self(t.value):
                    if ast.unparse(t) in ALLOWED_PRIVATE_WRITES:
                        continue
                    found.append((t.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _private(name.value):
                if not _is_self(node.args[0]):
                    found.append((node.lineno, ast.unparse(node)))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_self(value: ast.expr) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")


# ---- the tree -------------------------------------------------------------------------


def test_lines_fit_in_120_columns_and_nothing_skips_the_formatter() -> None:
    bad = {}
    for path in python_files(*TREES):
        source = path.read_text()
        lines = long_lines(source)
        if lines or any(marker in source for marker in FORMATTER_MARKERS):
            bad[str(path.relative_to(ROOT))] = lines or "a formatter marker"
    assert bad == {}


def test_functions_and_modules_of_the_package_are_short() -> None:
    functions, modules = {}, {}
    for path in python_files("lightning_scale"):
        source = path.read_text()
        name = str(path.relative_to(ROOT))
        if len(source.splitlines()) > MAX_MODULE:
            modules[name] = len(source.splitlines())
        if found := long_functions(source):
            functions[name] = found
    assert modules == {}
    assert functions == {}


def test_no_module_imports_another_modules_private_names() -> None:
    used = {
        str(p.relative_to(ROOT)): found
        for p in python_files("lightning_scale")
        if (found := private_uses(p.read_text()))
    }
    assert used == {}
    bad = {
        str(p.relative_to(ROOT)): found
        for p in python_files("lightning_scale")
        if (found := private_imports(p.read_text()))
    }
    assert bad == {}


def test_no_module_writes_another_objects_private_attributes() -> None:
    bad = {
        str(p.relative_to(ROOT)): found
        for p in python_files("lightning_scale")
        if (found := private_writes(p.read_text()))
    }
    assert bad == {}


# ---- each check fails on a source that breaks it ----------------------------------------

BROKEN = '''
from lightning_scale.record.stats.fields import _IX, FIELDS
from .host import _dense
from lightning_scale.record import native


def long():
    """A docstring does not count."""
{body}


class C:
    def __init__(self, other):
        self._mine = 1
        other._theirs = 2
        setattr(other, "_hidden", 3)
        other.public = 4
        native._loaded = native._reason
'''


def test_each_check_fails_on_a_source_that_breaks_it() -> None:
    source = BROKEN.format(body="\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION + 1)))
    assert long_functions(source) == {"long:7": MAX_FUNCTION + 1}
    assert long_functions(BROKEN.format(body="    pass")) == {}
    assert private_imports(source) == ["lightning_scale.record.stats.fields._IX", "host._dense"]
    assert sorted(private_uses(source)) == ["native._loaded", "native._reason"]
    assert sorted(text for _, text in private_writes(source)) == [
        "native._loaded",
        "other._theirs",
        "setattr(other, '_hidden', 3)",
    ]
    assert long_lines("x = 1\n" + "y" * (MAX_COLUMNS + 1) + "\n") == [2]
