"""The package's import graph follows docs/architecture.md: layers in one order, no cycles."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_scale"
DOC = ROOT / "docs" / "architecture.md"


def layer_order() -> List[str]:
    """The layers, highest first, as the architecture document states them."""
    found = re.search(r"<!-- layers: (.*?) -->", DOC.read_text())
    assert found, "docs/architecture.md has no `<!-- layers: ... -->` line"
    return [name.strip() for name in found.group(1).split(">")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: Set[str], name: str = "") -> Set[str]:
    """Every package module ``path`` imports, at any depth of the file (functions and
    ``if TYPE_CHECKING:`` blocks included). ``from a import b`` counts ``a.b`` where that
    is a module, else ``a``."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "lightning_scale")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.split(".")[0] != "lightning_scale":
                continue
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


def layer_of(module: str, order: List[str]) -> int:
    """Index of the module's layer in ``order`` (0 = highest); -1 for the package's own
    top: its ``__init__`` and the alias modules of documented import paths."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    top = top if top in order else ""
    return order.index(top) if top else -1


def graph() -> Dict[str, Set[str]]:
    known = modules()
    return {name: imports_of(path, set(known)) for name, path in known.items()}


def find_cycle(edges: Dict[str, Set[str]]) -> List[str]:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> List[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def upward_imports(edges: Dict[str, Set[str]], order: List[str]) -> List[Tuple[str, str]]:
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            a, b = layer_of(src, order), layer_of(dst, order)
            if a >= 0 and (b < 0 or b < a):
                bad.append((src, dst))
    return sorted(bad)


def test_every_layer_of_the_document_is_a_folder_or_module_of_the_package() -> None:
    order = layer_order()
    assert len(order) == len(set(order)) >= 6
    for name in order:
        assert (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file(), name


def test_no_import_cycles() -> None:
    assert find_cycle(graph()) == []


def test_imports_go_one_way() -> None:
    assert upward_imports(graph(), layer_order()) == []


def test_record_knows_nothing_of_capture_or_reporting() -> None:
    for src, targets in graph().items():
        if src.startswith("lightning_scale.record"):
            assert all(t.startswith("lightning_scale.record") for t in targets), (src, targets)


def test_only_callback_report_and_tools_import_lightning() -> None:
    allowed = (
        "lightning_scale.callback",
        "lightning_scale.report",
        "lightning_scale.tools",
        "lightning_scale.coord_check",
        "lightning_scale.demo",
    )
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        uses = [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            and any(
                (a.name if isinstance(n, ast.Import) else (n.module or "")).split(".")[0]
                in ("lightning", "pytorch_lightning")
                for a in n.names
            )
        ]
        assert not uses or name.startswith(allowed), name


def test_sizes() -> None:
    top = [p for p in PACKAGE.glob("*.py")]
    assert len(top) <= 8, sorted(p.name for p in top)
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


# The checks above must be able to fail: the same functions on graphs that break the rules.


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    order = ["callback", "report", "record"]
    edges = {
        "lightning_scale.record.a": {"lightning_scale.report.b"},  # upward
        "lightning_scale.report.b": {"lightning_scale.report.c"},
        "lightning_scale.report.c": {"lightning_scale.report.b"},  # cycle
        "lightning_scale.callback": {"lightning_scale.record.a"},  # downward: fine
    }
    assert find_cycle(edges) in (["lightning_scale.report.b", "lightning_scale.report.c", "lightning_scale.report.b"],)
    assert upward_imports(edges, order) == [("lightning_scale.record.a", "lightning_scale.report.b")]


def test_function_level_and_type_checking_imports_are_seen(tmp_path: Path) -> None:
    fake = tmp_path / "fake.py"
    fake.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_scale.report import pool\n"
        "def f():\n    import lightning_scale.callback\n    from .recorder import Recorder\n"
    )
    found = imports_of(fake, set(modules()), name="lightning_scale.record.fake")
    assert found == {"lightning_scale.report.pool", "lightning_scale.callback", "lightning_scale.record.recorder"}
    assert upward_imports({"lightning_scale.record.fake": found}, layer_order()) == [
        ("lightning_scale.record.fake", "lightning_scale.callback"),
        ("lightning_scale.record.fake", "lightning_scale.report.pool"),
    ]


@pytest.mark.parametrize("layer", ["capture", "record", "report", "step", "tools"])
def test_each_subpackage_says_what_flows_in_and_out(layer: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / layer / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 20, layer
