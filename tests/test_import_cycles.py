"""No import cycles among the project's modules (`operator/finetune_operator` and
`images/trainer/finetune_trainer`, one graph, so a cycle through both packages is caught too).

A cycle works only as long as each module of it happens to use the others' names late enough; a
new module-level use, or a different first import, and it fails with a partially initialised
module. Read from source with `ast`, importing nothing of the project. Imports inside functions
count (function-local imports were how the last cycle hid); `if TYPE_CHECKING:` blocks do not, as
they never run.

What one import statement depends on (an edge of the graph), the way Python runs it:
- `import a.b.c` and `from a.b.c import n` run `a`, `a.b` (their `__init__.py`) and `a.b.c`; when
  `a.b.c.n` is a module (`a/b/c/n.py`), `from a.b.c import n` runs it too and needs nothing more of
  `a.b.c`'s `__init__`, otherwise `n` is a name the `__init__` defines.
- A package that contains the importing module is already running (Python runs a package before
  its submodules), so passing through it adds no edge. Taking a name from it does: a submodule
  doing `from . import NAME`, where NAME is defined in the package's `__init__` that imports the
  submodule, is a real cycle (whichever is imported first, the submodule runs while the
  `__init__` is half done).
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "operator" / "finetune_operator", REPO / "images" / "trainer" / "finetune_trainer")

# Cycles allowed for now, each the set of modules of one strongly connected component, with why
# it is still here and what would break it. The test fails when one of them is gone, so the list
# only shrinks.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    where: str  # file:line of the import statement, relative to the repository


def _module_files(roots) -> dict[str, Path]:
    """Dotted module name -> file; a package is named for itself and is its `__init__.py`."""
    files = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom that can run: at module level, in classes, in functions, not in
    the body of an `if TYPE_CHECKING:` (its `else:` does run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _targets(module: str, is_package: bool, node, modules) -> list[str]:
    """The project modules one import statement of `module` runs or takes names from."""
    if isinstance(node, ast.Import):
        named = [(alias.name, None) for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        named = [(base, alias.name) for alias in node.names]
    out = []
    for dotted, name in named:
        parts = dotted.split(".")
        # Every package passed through on the way, unless it contains the importer (running already).
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in modules and not module.startswith(prefix + "."):
                out.append(prefix)
        if name is not None and f"{dotted}.{name}" in modules:
            sub = f"{dotted}.{name}"  # a submodule: its package's __init__ is only passed through
            if dotted in modules and not module.startswith(dotted + "."):
                out.append(dotted)
            out.append(sub)
        elif dotted in modules:
            out.append(dotted)  # the module itself, or a name its package's __init__ defines
    return [t for t in out if t != module]


def import_graph(roots=ROOTS) -> dict[str, dict[str, Edge]]:
    """importer -> imported -> the first statement making that edge."""
    files = _module_files(roots)
    graph: dict[str, dict[str, Edge]] = {m: {} for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = sorted(_import_nodes(tree), key=lambda n: n.lineno)
        for node in nodes:
            for target in _targets(module, path.name == "__init__.py", node, files):
                where = f"{path.relative_to(REPO).as_posix()}:{node.lineno}"
                graph[module].setdefault(target, Edge(module, target, where))
    return graph


def strongly_connected(graph: dict[str, dict[str, Edge]]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative; the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return sorted(found, key=sorted)


def _shortest_cycle(graph, component: frozenset[str], start: str) -> list[str]:
    """The shortest chain start -> ... -> start inside the component (BFS)."""
    came_from = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in component:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return path[::-1] + [start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle of {sorted(component)}")


def describe(graph, component: frozenset[str], most: int = 5) -> str:
    """The component's modules, then its shortest cycles (each edge with its file:line), shortest
    first, until every module is on one or `most` are shown: an edge that closes a large tangle
    shows up on every chain."""
    cycles = sorted((_shortest_cycle(graph, component, start) for start in sorted(component)), key=len)
    lines = [f"cycle among {len(component)} modules: {', '.join(sorted(component))}"]
    named: set[str] = set()
    for chain in cycles:
        if len(lines) > 1 and (set(chain) <= named or len(named) == len(component)):
            continue
        if sum(line.startswith("  -") for line in lines) == most:
            lines.append(f"  ... and more chains through {len(component) - len(named)} modules not shown")
            break
        named.update(chain)
        lines.append("  - " + " -> ".join(chain))
        lines += [f"      {a} -> {b}  ({graph[a][b].where})" for a, b in zip(chain, chain[1:])]
    return "\n".join(lines)


def problems(graph, known: dict[frozenset[str], str]) -> list[str]:
    """Each cycle not in `known`, described, and each known one that is gone."""
    cycles = strongly_connected(graph)
    return ([describe(graph, c) for c in cycles if c not in known]
            + [f"known cycle gone, remove it from KNOWN_CYCLES: {', '.join(sorted(c))}" for c in known
               if c not in cycles])


def test_no_import_cycles():
    found = problems(import_graph(), KNOWN_CYCLES)
    assert not found, "import cycles (break each, see tests/test_import_cycles.py):\n" + "\n".join(found)


def _fake_tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return (tmp_path / "pkg",)


def _cycles(tmp_path, files, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    graph = import_graph(_fake_tree(tmp_path, files))
    return graph, strongly_connected(graph)


def test_a_function_local_import_makes_a_cycle_and_type_checking_does_not(tmp_path, monkeypatch):
    graph, cycles = _cycles(tmp_path, {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from pkg import a\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\nelse:\n    pass\n",
        "d.py": "from .c import TYPE_CHECKING\n",
    }, monkeypatch)
    assert cycles == [frozenset({"pkg.a", "pkg.b"})]
    assert describe(graph, cycles[0]) == (
        "cycle among 2 modules: pkg.a, pkg.b\n"
        "  - pkg.a -> pkg.b -> pkg.a\n"
        "      pkg.a -> pkg.b  (pkg/a.py:1)\n"
        "      pkg.b -> pkg.a  (pkg/b.py:2)")


def test_a_submodule_taking_a_name_from_its_packages_init_is_a_cycle(tmp_path, monkeypatch):
    _, cycles = _cycles(tmp_path, {
        "__init__.py": "from .sub import f\nLIMIT = 3\n",
        "sub.py": "from . import LIMIT\n",
    }, monkeypatch)
    assert cycles == [frozenset({"pkg", "pkg.sub"})]


def test_importing_a_sibling_through_the_package_is_no_cycle(tmp_path, monkeypatch):
    graph, cycles = _cycles(tmp_path, {
        "__init__.py": "from .a import f\nfrom .inner import g\n",
        "a.py": "from . import b\nimport pkg.b\nfrom pkg.inner.c import g\n",
        "b.py": "",
        "inner/__init__.py": "from .c import g\n",
        "inner/c.py": "from .. import b\n",
    }, monkeypatch)
    assert cycles == []
    assert sorted(graph["pkg.a"]) == ["pkg.b", "pkg.inner", "pkg.inner.c"]
    assert sorted(graph["pkg.inner.c"]) == ["pkg.b"]


def test_a_known_cycle_passes_and_a_gone_one_fails(tmp_path, monkeypatch):
    graph, _ = _cycles(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": "import pkg.a\n",
                                  "c.py": ""}, monkeypatch)
    known = {frozenset({"pkg.a", "pkg.b"}): "why", frozenset({"pkg.a", "pkg.c"}): "fixed since"}
    assert problems(graph, known) == ["known cycle gone, remove it from KNOWN_CYCLES: pkg.a, pkg.c"]
