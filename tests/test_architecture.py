"""The package's shape: no import cycles, no private names borrowed across modules, and the
configuration layer below the engines, GPUs and CLI that consume it.

Read from the source with `ast` (nothing is imported), so the test also sees imports inside
functions: a lazy import that closes a loop still couples the two modules both ways. The CLI's
lazy command loading names its modules as strings (`importlib`), so it is no edge here and
needs no exception.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

PACKAGE = "dvfs"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _resolve(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    """The absolute module an `ImportFrom` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    is_package = modules[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest dvfs module that `name` is, or lives in."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _imports(
    module: str, modules: dict[str, Path] = MODULES, source: str | None = None
) -> tuple[set[str], list[str]]:
    """The dvfs modules `module` imports, and the private names it borrows from them."""
    path = modules[module]
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    edges: set[str] = set()
    private: list[str] = []
    aliases: dict[str, str] = {}  # local name -> dvfs module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _owner(alias.name, modules)
                if target is None:
                    continue
                edges.add(target)
                if alias.asname:
                    aliases[alias.asname] = target
                else:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, modules)
            if _owner(source, modules) is None:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    edges.add(submodule)
                    aliases[alias.asname or alias.name] = submodule
                    continue
                target = _owner(source, modules)
                assert target is not None
                edges.add(target)
                private_name = alias.name.startswith("_") and not alias.name.startswith("__")
                if private_name and target != module:
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
            target = _owner(".".join(filter(None, [aliases[head], rest])), modules)
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


@functools.cache
def _graph() -> tuple[dict[str, set[str]], list[str]]:
    """The package's import graph and borrowed private names, read once per test process."""
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


def test_the_walker_sees_the_package() -> None:
    graph, _ = _graph()
    assert "dvfs.campaign" in graph
    assert graph["dvfs.cube"], "a package's __init__ imports count"


def test_no_import_cycles() -> None:
    graph, _ = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules() -> None:
    _, private = _graph()
    assert not private, "private names used outside their module:\n" + "\n".join(private)


#: What the campaign (configuration) may not import: it describes a sweep, and the engines, GPU
#: backends and CLI that carry one out depend on it, never the reverse. `dvfs.gpu.base` is
#: allowed: it is pure data and helpers (the `Gpu` protocol, event-reason bits,
#: `unsupported_clock`) that a grid is checked against, and imports nothing from dvfs.
#: The cube's readers sit below its `cube info` summary, which gathers them (each says one
#: thing of a cube, for every command that says it): none imports the summary back, and
#: `dvfs.cube.attrs`, which they all read attributes through, imports nothing of dvfs.
LAYERS_BELOW: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "dvfs.campaign": (("dvfs.engines", "dvfs.gpu", "dvfs.cli"), ("dvfs.gpu.base",)),
    "dvfs.cube.attrs": (("dvfs",), ()),
    **{
        f"dvfs.cube.{reader}": (("dvfs.cube.info",), ())
        for reader in ("cells_left", "idle", "knobs", "pinning", "quality")
    },
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for layer, (forbidden, allowed) in LAYERS_BELOW.items():
        for module in sorted(m for m in graph if _within(m, layer)):
            for target in sorted(graph[module]):
                if any(_within(target, a) for a in allowed):
                    continue
                if any(_within(target, f) for f in forbidden):
                    found.append(f"{module} imports {target}")
    return found


def test_no_layer_imports_what_sits_above_it() -> None:
    """The configuration imports no engine, GPU backend or CLI; the cube's readers do not
    import its `cube info` summary (`LAYERS_BELOW`)."""
    graph, _ = _graph()
    violations = _layer_violations(graph)
    assert not violations, "a layer reaching up:\n" + "\n".join(violations)


def test_the_layer_check_finds_a_violation() -> None:
    graph = {
        "dvfs.campaign.x": {"dvfs.engines.sglang_args", "dvfs.gpu.base", "dvfs.gpu.nvml"},
        "dvfs.campaigns": {"dvfs.engines"},  # a sibling whose name shares the prefix
    }
    assert _layer_violations(graph) == [
        "dvfs.campaign.x imports dvfs.engines.sglang_args",
        "dvfs.campaign.x imports dvfs.gpu.nvml",
    ]


def test_cycle_finder_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_the_walker_reads_lazy_relative_and_submodule_imports() -> None:
    modules = {
        "dvfs.a": ROOT / "a.py",
        "dvfs.pkg": ROOT / "pkg" / "__init__.py",
        "dvfs.pkg.b": ROOT / "pkg" / "b.py",
        "dvfs.pkg.c": ROOT / "pkg" / "c.py",
    }
    source = (
        "from dvfs.pkg import c\n"
        "def f():\n"
        "    from .c import _hidden\n"
        "    from ..a import thing\n"
        "    return c._secret, thing\n"
    )
    edges, private = _imports("dvfs.pkg.b", modules, source)
    assert edges == {"dvfs.pkg.c", "dvfs.a"}  # `from dvfs.pkg import c` is the submodule
    assert private == [
        "dvfs.pkg.b: from dvfs.pkg.c import _hidden",
        "dvfs.pkg.b: c._secret",
    ]
    edges, private = _imports("dvfs.a", modules, "import dvfs.pkg.b as m\nm._x\n")
    assert edges == {"dvfs.pkg.b"}
    assert private == ["dvfs.a: m._x"]


def _unclosed_opens(tree: ast.AST) -> list[int]:
    """Lines of `open_dataset(...)` / `netCDF4.Dataset(...)` calls that are not the subject of
    a `with`: such a file stays open until collected."""
    managed = {
        id(item.context_expr)
        for node in ast.walk(tree)
        if isinstance(node, ast.With)
        for item in node.items
    }
    return sorted(
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and (
            node.func.attr == "open_dataset"
            or (
                node.func.attr == "Dataset"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "netCDF4"
            )
        )
        and id(node) not in managed
    )


def test_every_netcdf_file_opened_is_closed_by_a_with() -> None:
    """netCDF-C crashes (a segfault, not an error) when a file still open in the process is
    opened again (netCDF4-python issue 796, xarray issue 8289): a test that read a shared cube
    with `xr.open_dataset(...).load()` left it open, and a later test on the same xdist worker
    that ran `dvfs twin fit` on it took the worker down. Every open in dvfs and its tests is
    the subject of a `with`, which closes the file."""
    tests = Path(__file__).resolve().parent
    texts = {p: p.read_text(encoding="utf-8") for p in [*ROOT.rglob("*.py"), *tests.glob("*.py")]}
    found = {
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path, text in texts.items()
        # a file naming neither call cannot make one: most are not parsed (seconds of CPU)
        if "open_dataset" in text or ("netCDF4" in text and "Dataset" in text)
        for line in _unclosed_opens(ast.parse(text))
    }
    assert not found, sorted(found)


def test_the_open_check_finds_an_unclosed_open() -> None:
    code = (
        "ds = xr.open_dataset(p).load()\n"
        "with xr.open_dataset(p) as d, netCDF4.Dataset(p) as nc:\n"
        "    x = xr.Dataset()\n"
        "nc = netCDF4.Dataset(p)\n"
    )
    assert _unclosed_opens(ast.parse(code)) == [1, 4]


def _how_it_works() -> tuple[dict[str, set[str]], dict[str, str], str]:
    """The README's "How it works": the names its tree lists under each package (`""`: the
    top level's `*.py`), the text of each package's bullet in its file-by-file list, and the
    whole list."""
    readme = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## How it works\n", 1)[1].split("\n## ", 1)[0]
    _, tree, prose = section.split("```", 2)
    listed: dict[str, set[str]] = {"": set()}
    package = ""
    for token in re.findall(r"[\w.]+/?", tree):
        if token.endswith("/"):
            package = token[:-1]
            listed.setdefault(package, set())
        elif token.endswith(".py"):
            listed[""].add(token)
        else:
            listed[package].add(token)
    bullets = {}
    for bullet in prose.split("\n- "):
        head = re.match(r"`(\w+)/`", bullet)
        if head:
            bullets[head.group(1)] = bullet
    return listed, bullets, prose


def test_the_readmes_how_it_works_names_every_module() -> None:
    """The README's "How it works" walks the package file by file: every module is in its
    tree, under its package, and in its package's bullet of the list (a module added without
    either, as twin/limits.py and govern/servergpus.py were, leaves a reader a file the map
    lacks)."""
    listed, bullets, prose = _how_it_works()
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).parts
        if path.name == "__init__.py":
            continue
        if len(parts) == 1:
            if path.name not in listed[""] or f"`{path.name}`" not in prose:
                missing.append(path.name)
            continue
        package = parts[0]
        if path.stem not in listed.get(package, set()):
            missing.append(f"{package}/{path.name} (tree)")
        if f"`{path.name}`" not in bullets.get(package, ""):
            missing.append(f"{package}/{path.name} (list)")
    assert not missing, missing


def test_the_readmes_how_it_works_lists_an_init_where_it_holds_code() -> None:
    """The tree leaves out "`__init__.py` files that are empty or only a docstring", yet listed
    `measure/`'s, a docstring alone: a reader looked for a package face that is not there. Each
    package's `__init__` is in the tree exactly where its file holds more than a docstring."""
    listed, _, _ = _how_it_works()
    wrong = []
    for path in sorted(ROOT.rglob("__init__.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        code = [
            s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
        ]
        package = path.parent.relative_to(ROOT).as_posix()
        shown = (
            "__init__.py" in listed[""]
            if package == "."
            else "__init__" in listed.get(package, set())
        )
        if bool(code) != shown:
            held = "code" if code else "a docstring only"
            wrong.append(f"{package}: {held}, {'listed' if shown else 'not listed'}")
    assert not wrong, wrong


def test_no_text_file_keeps_a_merges_conflict_markers() -> None:
    """A merge (rev30m's) left its conflict in the README's "What a crash can cost": both
    sides' sentences between `<<<<<<< HEAD`, `=======` and `>>>>>>> rev30m` lines, which a
    reader met as the text. No Markdown, Python or TOML file of the project keeps such lines."""
    import os

    repo = ROOT.parent
    files = []
    for folder, subfolders, names in os.walk(repo):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d != "node_modules"]
        files += [Path(folder, n) for n in names if n.endswith((".md", ".py", ".toml"))]
    # (the start and end lines: a line of seven "=" may underline a Markdown title)
    marker = re.compile(r"^(<{7}|>{7}) ", re.MULTILINE)
    kept = [
        str(path.relative_to(repo))
        for path in files
        if marker.search(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert files and not kept, kept
