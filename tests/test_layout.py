"""The package's structure: no import cycles between its modules, none between its parts (a
subpackage, or a top-level module) either, so no arrow runs back up; and modules of one reading
(``MAX_LINES``)."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "tierstore"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports when it is imported (its top-level imports)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:  # ``from package import module`` imports the module
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {target for target in found if target in MODULES and target != name}


def part(name: str) -> str:
    """A module's part: its subpackage of ``tierstore`` (``tierstore.tiers``), or the module itself."""
    return ".".join(name.split(".")[:2])


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (a path back to its start), or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_module_imports_itself_back():
    graph = {name: imported(name, path) for name, path in MODULES.items()}
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_no_part_of_the_package_imports_one_that_imports_it_back():
    """Between subpackages and top-level modules (``tierstore/__init__`` and ``__main__``, which
    gather the rest, left out), the imports form no cycle."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name in ("tierstore", "tierstore.__main__"):
            continue
        graph.setdefault(part(name), set()).update(
            part(target) for target in imported(name, path) if part(target) not in (part(name), "tierstore")
        )
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_modules_hold_one_reading():
    lengths = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    too_long = {name: lines for name, lines in lengths.items() if lines > MAX_LINES}
    assert not too_long, f"split these along their concepts (at most {MAX_LINES} lines a module): {too_long}"


SCRIPTS = sorted((PACKAGE.parent / "bench").glob("*.py")) + sorted((PACKAGE.parent / "tools").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_benchmark_and_tool_imports_what_it_names(script, monkeypatch):
    """The scripts import the package's modules by path: a module split or renamed must take them
    along (they run only by hand, so nothing else would notice)."""
    monkeypatch.syspath_prepend(str(script.parent))  # their siblings (bench_dlrm takes bench_train's)
    spec = importlib.util.spec_from_file_location(f"_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # the scripts do their work under ``if __name__ == "__main__"``
