"""The package's imports form no circle, counting imports under ``TYPE_CHECKING`` and inside functions.

A circle that closes only through a type-only import still says two files each need the other; the runtime's
was upstream's helper names reaching the registry through the getter. Read from the source with ``ast``, so an
import Python never runs (a ``TYPE_CHECKING`` block, a function not yet called) counts like any other.
"""

import ast
import pathlib
from typing import Dict, List, Set

import deepspeed_zero3

SOURCE = pathlib.Path(deepspeed_zero3.__file__).parent
PACKAGE = "deepspeed_zero3"


def _module_files() -> Dict[str, pathlib.Path]:
    files = {}
    for path in SOURCE.rglob("*.py"):
        parts = (PACKAGE, ) + path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _known(name: str, modules) -> str:
    """The module of ours that ``name`` (a module or a name inside one) belongs to; "" if none."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def import_graph() -> Dict[str, Set[str]]:
    """Each module of the package, with the modules of the package it imports anywhere in its source."""
    modules = _module_files()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(_known(alias.name, modules) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from package import module` imports the module; `from module import name` the module.
                targets.update(_known(f"{node.module}.{alias.name}", modules) for alias in node.names)
        targets.discard("")
        targets.discard(name)
        graph[name] = targets
    return graph


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            step = next(targets, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_the_reader_sees_every_import_form():
    graph = import_graph()
    runtime = f"{PACKAGE}.runtime.zero"
    # a TYPE_CHECKING import, a `from package import module`, and a function-level import are all read
    assert f"{runtime}.partitioned_param_coordinator" in graph[f"{runtime}.hooks"]
    assert f"{runtime}.capabilities" in graph[f"{runtime}.ordered_dict"]
    assert f"{runtime}.registry_lookup" in graph[f"{PACKAGE}.weights"]


def test_circles_finds_a_circle_through_three_modules():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_form_no_circle():
    assert circles(import_graph()) == []
