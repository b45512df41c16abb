"""The package's structure holds (docs/architecture.md): each layer imports only the
layers below it, no import loop ties modules together, and no module grows past its
size without saying why."""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "worqr"
MODULE_LINES = 800
CLASS_LINES = 600


def test_each_layer_imports_only_the_layers_below_it() -> None:
    """The contract in pyproject.toml ([tool.importlinter]), checked by import-linter."""
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_no_import_loop() -> None:
    """Every import counts, those under ``if TYPE_CHECKING`` too."""
    graph = grimp.build_graph("worqr", cache_dir=None)
    loops = loops_of(
        {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    )
    assert loops == [], "import loops: " + "; ".join(" -> ".join(loop) for loop in loops)


def loops_of(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(imports.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1 or module in imports.get(module, ()):
                found.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return found


def test_loops_of_finds_a_loop_and_only_loops() -> None:
    assert loops_of({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert loops_of({"a": {"b"}, "b": set(), "c": {"b"}}) == []


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _says_why(source: str) -> bool:
    """Whether a module's docstring gives a reason for its size (``Over N lines: ...``)."""
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return "Over " in docstring and " lines" in docstring


@pytest.mark.parametrize("path", _sources(), ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_or_class_is_too_big_without_a_reason(path: Path) -> None:
    source = path.read_text()
    if _says_why(source):
        return
    assert len(source.splitlines()) <= MODULE_LINES, f"{path.name}: over {MODULE_LINES} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            lines = node.end_lineno - node.lineno + 1
            assert lines <= CLASS_LINES, f"class {node.name}: {lines} lines"


REACHES_ALLOWED = {
    ("worqr/_worqr.py", "worqr._worker"),  # `runtime`: the facade hands its runtime out
    ("worqr/_worqr.py", "made._worker"),  # `twin`, on a Worqr it made
    ("worqr/_worqr.py", "base._timing"),
    ("worqr/_worqr.py", "base._given"),
    ("worqr/_worqr.py", "worqr._owned"),  # `from_url`, on the Worqr it made
    ("worqr/_worqr.py", "worqr._submit_one"),  # `submit_with`: the function layer's submit
    ("worqr/_redis/wire.py", "connection._parser"),  # redis-py's reader, for the wire
    ("worqr/_redis/wire.py", "parser._reader"),
    ("worqr/cli/read.py", "s.rate_limit._asdict"),  # a NamedTuple's public method
    ("worqr/cli/run.py", "os._exit"),
    ("worqr/cli/stopping.py", "os._exit"),
}
"""Where a module reads an underscore name of an object that is not its own ``self``."""


def test_no_module_reaches_into_another_objects_underscore_names() -> None:
    """A layer calls the one below through its public names; the facade's private
    parts reach its ways in only through `worqr._worqr.runtime` and `twin`."""
    found = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.add((str(path.relative_to(ROOT)), ast.unparse(node)))
    assert found <= REACHES_ALLOWED, sorted(found - REACHES_ALLOWED)
