"""The package's shape: no import cycles, no private names borrowed across modules.

Read from the source with `ast` (nothing is imported), so the test also sees imports inside
functions: a lazy import that closes a loop still couples the two modules both ways. The one
deliberate exception is the CLI's lazy command loading, which is a cycle by design (the group
names its commands, each command registers on the group).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "dvfs"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# `dvfs.cli` loads its subcommand modules lazily and each of them imports the group back;
# that loop is how `dvfs --help` stays fast, so it is the one allowed.
ALLOWED_CYCLE_PREFIXES = ("dvfs.cli",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The longest dvfs module that `name` is, or lives in."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def _imports(module: str) -> tuple[set[str], list[str]]:
    """The dvfs modules `module` imports, and the private names it borrows from them."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> dvfs module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _owner(alias.name)
                if target is None:
                    continue
                edges.add(target)
                if alias.asname:
                    aliases[alias.asname] = target
                else:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if _owner(source) is None:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    edges.add(submodule)
                    aliases[alias.asname or alias.name] = submodule
                    continue
                target = _owner(source)
                assert target is not None
                edges.add(target)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    private.append(f"{module}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            head, _, rest = dotted.partition(".")
            if head not in aliases:
                continue
            target = _owner(".".join(filter(None, [aliases[head], rest])))
            if target is not None and target != module:
                private.append(f"{module}: {dotted}.{node.attr}")
    edges.discard(module)
    return edges, private


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for module in MODULES:
        graph[module], borrowed = _imports(module)
        private.extend(borrowed)
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, set(component)) for component in components]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A concrete loop through a strongly connected component, for the failure message."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for succ in sorted(graph[node] & component):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if succ not in parents:
                parents[succ] = node
                frontier.append(succ)
    return sorted(component)


def _allowed(cycle: list[str]) -> bool:
    return all(module.startswith(ALLOWED_CYCLE_PREFIXES) for module in cycle)


def test_the_walker_sees_the_package() -> None:
    graph, _ = _graph()
    assert "dvfs.campaign" in graph
    assert graph["dvfs.cube"], "a package's __init__ imports count"


def test_no_import_cycles() -> None:
    graph, _ = _graph()
    cycles = [cycle for cycle in _cycles(graph) if not _allowed(cycle)]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules() -> None:
    _, private = _graph()
    assert not private, "private names used outside their module:\n" + "\n".join(private)


def test_cycle_finder_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
