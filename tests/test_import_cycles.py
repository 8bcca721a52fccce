"""flexoff's modules import one another without a cycle, and ``import flexoff`` loads no torch.

The graph is read from the source with ``ast``: every import statement, at module level or inside
a function (a deferred import still ties the two modules together), with relative imports resolved.
Imports under ``if TYPE_CHECKING:`` never run and are left out. An edge goes to the module named:
``from .models import opt`` reaches ``flexoff.models.opt`` where that is a module, else
``flexoff.models``.
"""

import ast
import sys
from pathlib import Path

from tests import processes

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexoff"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path, package.parent): path for path in sorted(package.rglob("*.py"))}


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The flexoff modules that module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import flexoff.a.b` names flexoff.a.b itself
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the list of modules along it (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_flexoff_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_graph_sees_relative_deferred_and_package_imports(tmp_path):
    """The checker itself: a cycle closed by a relative import inside a function is found, and one
    behind TYPE_CHECKING is not."""
    package = tmp_path / "flexoff"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    graph = import_graph(package)
    assert graph["flexoff.a"] == {"flexoff.sub.b"} and graph["flexoff.sub.b"] == {"flexoff.c"}
    assert find_cycle(graph) is None
    (package / "c.py").write_text("import flexoff.a\n")
    assert find_cycle(import_graph(package)) == ["flexoff.a", "flexoff.sub.b", "flexoff.c", "flexoff.a"]


def test_import_flexoff_loads_no_torch():
    code = ("import sys, flexoff; from flexoff.job import Job; Job(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('flexoff.runtime')))")
    proc = processes.run([sys.executable, "-c", code], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_top_level_names_still_import():
    code = "from flexoff import LLM, SamplingParams, Policy, FlexoffError, Metrics; print(LLM.__module__)"
    proc = processes.run([sys.executable, "-c", code], cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "flexoff.api.llm", proc.stderr
