"""The house's shape: no import loop between its modules, no module over 450 lines (issue 27)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "catalog", "common", "dashboard", "health", "lightning_web", "proxy", "runs", "sandbox", "trainer")
MAX_LINES = 450


def _modules(root: Path, packages) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """Module -> the house's modules it imports anywhere in its file (blocks under `if TYPE_CHECKING` excepted)."""
    modules = _modules(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(node) for branch in ast.walk(tree)
                       if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                       for node in ast.walk(branch)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                edges |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    edges.add(full if full in modules else resolve(base))
        graph[name] = {edge for edge in edges if edge and edge != name}
    return graph


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, ()):
            if edge not in index:
                visit(edge)
                low[node] = min(low[node], low[edge])
            elif edge in on_stack:
                low[node] = min(low[node], index[edge])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_it_finds_a_loop_through_a_function_level_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n")
    (tmp_path / "pkg" / "d.py").write_text("import pkg.c\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.c"] == {"pkg.a"}  # the TYPE_CHECKING import is no edge
    assert loops(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_the_house_has_no_import_loop():
    graph = import_graph(ROOT)
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the whole house was read
    assert loops(graph) == []


@pytest.mark.parametrize("top", ["api", "bench", "catalog", "common", "dashboard", "examples", "lightning_web", "proxy",
                                 "runs", "sandbox", "trainer"])
def test_no_module_is_over_450_lines(top):
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for path in (ROOT / top).rglob("*.py") if "migrations" not in path.parts}
    assert sizes, f"{top}/ holds no module"
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}


def _house_files():
    for top in (*PACKAGES, "bench"):
        yield from ((path, top) for path in (ROOT / top).rglob("*.py") if "migrations" not in path.parts)


def private_imports(path: Path, module: str) -> list[str]:
    """`from other import _name` in the file: a private name of another module (its owner's to change)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module != module:
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


def stray_strings(path: Path) -> list[int]:
    """Lines of string statements that document nothing: not a body's first statement (a docstring) and not right
    under the assignment they describe (an attribute docstring)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        body = getattr(node, "body", None)
        for before, statement in zip(body, body[1:]) if isinstance(body, list) else ():
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant) \
                    and isinstance(statement.value.value, str) \
                    and not (isinstance(before, (ast.Assign, ast.AnnAssign)) and statement.lineno == before.end_lineno + 1):
                found.append(statement.lineno)
    return found


def test_the_checks_find_a_private_import_and_a_docstring_away_from_its_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Module."""\nfrom a.b import _hidden, shown, __version__\nfrom sample import _mine\n'
                      'X = 1\n"""X."""\nY = 2\n\n"""Y, one line too far."""\ndef f():\n    """f."""\n\n\n'
                      '"""Under f: whose?"""\n')
    assert private_imports(sample, "sample") == ["a.b._hidden"]
    assert stray_strings(sample) == [8, 13]


def test_no_module_imports_a_private_name_of_another():
    found = {}
    for path, top in _house_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if top == "bench":
            module = module.removeprefix("bench.")
        if names := private_imports(path, module):
            found[str(path.relative_to(ROOT))] = names
    assert found == {}


def test_every_docstring_sits_right_under_what_it_documents():
    found = {str(path.relative_to(ROOT)): lines for path, _ in _house_files() if (lines := stray_strings(path))}
    assert found == {}
