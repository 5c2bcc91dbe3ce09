"""The package's imports run downhill: every module imports only from its own package or from packages on a
lower floor of `FLOORS`, and no two modules import each other, directly or around a loop. Imports inside
functions count too (deferring an import does not change who depends on whom); those under
`if TYPE_CHECKING:` do not (they exist for annotations only). docs/architecture.md draws the same floors.

The check reads the source with `ast`, so it runs without importing anything."""

from __future__ import annotations

import ast
import os
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "tokenloom")

# Bottom to top: a package (or top-level module) may import those on lower floors and its own package.
FLOORS: list[set[str]] = [
    {"model_families"},
    {"version", "device", "local_cache", "forward_batch", "model_config", "finish_reason"},
    {"sampling", "grammar", "function_call"},
    {"protocol", "kernels"},
    {"wire"},
    {"ipc"},
    {"distributed"},
    {"config"},
    {"cache"},
    {"layers"},
    {"models"},
    {"tokenizer"},
    {"executor"},
    {"scheduler"},
    {"disaggregation"},
    {"frontend", "bench"},
    {"entrypoints"},
    {"__init__", "cli", "launch_server", "bench_serving"},
]


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: str, dotted: str, modules: dict[str, str]) -> set[str]:
    """The package's modules `path` imports (outside `if TYPE_CHECKING:`)."""
    is_package = path.endswith("__init__.py")
    base = dotted.split(".") if is_package else dotted.split(".")[:-1]
    targets: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                stem = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod when there is one, else names of pkg itself
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            names = []
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != dotted:
                targets.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    with open(path, encoding="utf-8") as f:
        visit(ast.parse(f.read(), path))
    return targets


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(room: str) -> int:
    for i, rooms in enumerate(FLOORS):
        if room in rooms:
            return i
    raise AssertionError(f"tokenloom/{room} is on no floor of FLOORS: place it")


def test_every_import_runs_downhill():
    uphill = []
    for module, targets in _graph().items():
        for target in targets:
            here, there = _room(module), _room(target)
            if here != there and _floor(there) >= _floor(here):
                uphill.append(f"{module} -> {target}")
    assert not uphill, "imports that do not run downhill:\n" + "\n".join(sorted(uphill))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the current path, 2 done
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif state[nxt] == 0:
                walk(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if state[node] == 0:
            walk(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_check_sees_a_cycle_and_an_uphill_import(tmp_path, monkeypatch):
    """The check itself can fail: a package whose cache imports its scheduler, which imports the cache."""
    root = tmp_path / "tokenloom"
    for rel, text in {"__init__.py": "", "cache/__init__.py": "", "scheduler/__init__.py": "",
                      "cache/pool.py": "def f():\n    from tokenloom.scheduler import plan\n",
                      "scheduler/plan.py": "from tokenloom.cache.pool import f\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "ROOT", str(tmp_path))
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", str(root))
    graph = _graph()
    assert graph["tokenloom.cache.pool"] == {"tokenloom.scheduler.plan"}
    assert graph["tokenloom.scheduler.plan"] == {"tokenloom.cache.pool"}
    try:
        test_every_import_runs_downhill()
    except AssertionError as e:
        assert "tokenloom.cache.pool -> tokenloom.scheduler.plan" in str(e)
    else:
        raise AssertionError("an uphill import went unnoticed")
    try:
        test_no_import_cycles()
    except AssertionError as e:
        assert "tokenloom.cache.pool -> tokenloom.scheduler.plan -> tokenloom.cache.pool" in str(e)
    else:
        raise AssertionError("a cycle went unnoticed")
