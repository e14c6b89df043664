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
