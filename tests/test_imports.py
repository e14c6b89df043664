"""The library's modules import one another in one direction: no circle, even through an
import inside a function (read from the source, so nothing is imported here)."""

import ast
import os

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "hvdtrain")


def _modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def _imports(module, path, modules):
    """The modules of hvdtrain that `module` imports, anywhere in its source."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                      for a in node.names}  # fmt: skip
    return {n for n in names if n in modules and n != module and n != "hvdtrain"}


def _circles(graph):
    """The groups of modules that reach one another (Tarjan's strongly connected components
    of more than one module)."""
    index, low, stack, on, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_walk_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_of_hvdtrain_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["hvdtrain.runtime.watchdog"] >= {"hvdtrain.runtime.stall"}  # the walk sees imports
    assert _circles(graph) == []


# The floors, lowest first: a module imports only modules of its own floor or lower ones
# (docs/development.md, "The map"). The entry points share a floor; `_moved` (the old module
# paths) and the package itself sit on top.
FLOORS = [
    ("errors",),
    ("runtime",),
    ("optimizers",),
    ("frontends",),
    ("data",),
    ("exchange",),
    ("recipe",),
    ("models", "mnist", "cifar10", "images"),
    ("launcher",),
    ("bench",),
    ("_moved", ""),
]


def _floor(module):
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(FLOORS) if top in names)


def test_no_import_runs_back_up_the_floors():
    modules = _modules()
    upward = [
        f"{m} imports {i}"
        for m, p in modules.items()
        for i in _imports(m, p, modules)
        if _floor(i) > _floor(m)
    ]
    assert upward == []


def test_no_file_of_the_library_is_over_600_lines():
    long = {m: n for m, p in _modules().items() if (n := len(open(p).readlines())) > 600}
    assert long == {}


def test_both_keras_frontends_implement_the_declared_interface():
    from hvdtrain.frontends import interface, keras2, keras3

    assert interface.missing(keras2) == [] and interface.missing(keras3) == []
    assert set(keras3.__all__) == set(interface.NAMES)
