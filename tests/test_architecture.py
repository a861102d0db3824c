"""The shape of the code (docs/architecture.md): no import circle among daemon's and indexcore's modules,
indexcore never imports daemon, and no module or class grown past what one reader takes in at once.

Read from the source with `ast`, not by importing, so every import counts: those inside functions (the
commands import what they use when they run) and those under `if TYPE_CHECKING:` alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("daemon", "indexcore")
MODULE_MAX_LINES = 500
CLASS_MAX_LINES = 250

# Modules allowed past MODULE_MAX_LINES, each with the reason it is one module all the same.
LONG_MODULES: dict[str, str] = {
    "indexcore.indexfile": "the IndexFile format: its layout constants at the top and the IndexFile class that reads "
                           "and writes them (indexcore's rule, one module per format); a part of the class moved out "
                           "would import the layout back, a circle",
}
# Classes allowed past CLASS_MAX_LINES, each with its reason.
LONG_CLASSES: dict[str, str] = {
    "indexcore.indexfile.IndexFile": "one IndexFile: header, slots, entries, their faults and truncation, all on the "
                                     "layout of its own module (see indexcore.indexfile above)",
}


def module_files() -> dict[str, Path]:
    """Every Python module of the two packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the two packages that `name` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # `from a.b import c` imports the module a.b.c when there is one, else names of a.b
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for dotted in targets:
            target = dotted
            while target and target not in modules:  # `import a.b.C`-style names: the module that holds them
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    """The parse finds the modules and the imports the rest of this file judges."""
    graph = import_graph()
    assert {"daemon.cli", "daemon.engine.reput", "indexcore.reader"} <= set(graph)
    assert "daemon.engine.session" in graph["daemon.engine.reput"]
    assert "indexcore.reader" in graph["daemon.engine.reading"]


def test_cycles_are_found():
    """The cycle check itself: a circle is reported, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_indexcore_never_imports_daemon():
    graph = import_graph()
    assert {m: sorted(d for d in deps if d.split(".")[0] == "daemon")
            for m, deps in graph.items() if m.split(".")[0] == "indexcore"
            and any(d.split(".")[0] == "daemon" for d in deps)} == {}


def test_no_module_over_the_limit():
    long = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    over = {name: n for name, n in long.items() if n > MODULE_MAX_LINES and name not in LONG_MODULES}
    assert over == {}
    # an exception that no longer needs to be one is taken off the list
    assert [name for name in LONG_MODULES if long.get(name, 0) <= MODULE_MAX_LINES] == []


def test_no_class_over_the_limit():
    sizes = {}
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                sizes[f"{name}.{node.name}"] = node.end_lineno - first + 1
    over = {name: n for name, n in sizes.items() if n > CLASS_MAX_LINES and name not in LONG_CLASSES}
    assert over == {}
    assert [name for name in LONG_CLASSES if sizes.get(name, 0) <= CLASS_MAX_LINES] == []
