"""The layers hold: ``lint-imports`` checks the contracts in ``pyproject.toml`` (the
library never imports Prefect, flows, tasks or deployments; only ``pipetune.cli``
reaches up; tasks below flows below deployments; the library's own layers), and no
import circle joins our modules (the library's, the flows', the tasks', the
deployments')."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_import_contract_is_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def import_circles(graph) -> list[list[str]]:
    """The import circles (strongly connected components of two or more modules) of
    ``graph``, a package's own modules. A package's ``__init__`` importing its own
    submodules (re-exporting them) is not counted: Python runs that ``__init__`` before
    any of its submodules anyway."""
    edges = {
        m: {t for t in graph.find_modules_directly_imported_by(m)
            if t in graph.modules and not t.startswith(m + ".")}
        for m in graph.modules
    }
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    for root in sorted(edges):  # Tarjan's algorithm, iterative
        if root in order:
            continue
        work = [(root, iter(sorted(edges[root])))]
        order[root] = low[root] = len(order)
        stack.append(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in order:
                    order[target] = low[target] = len(order)
                    stack.append(target)
                    work.append((target, iter(sorted(edges[target]))))
                elif target in stack:
                    low[module] = min(low[module], order[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == order[module]:
                circle = []
                while True:
                    member = stack.pop()
                    circle.append(member)
                    if member == module:
                        break
                if len(circle) > 1:
                    circles.append(sorted(circle))
    return circles


def test_no_import_circle_joins_our_modules():
    """Not in the library, nor in the flows, tasks and deployments above it; an import
    inside a function counts like any other (it only moves the circle to run time)."""
    import grimp

    graph = grimp.build_graph("pipetune", "flows", "tasks", "deployments",
                              exclude_type_checking_imports=True, cache_dir=None)
    assert {"tasks.task_runs", "flows.study", "deployments.serve"} <= graph.modules
    assert import_circles(graph) == []


def test_the_circle_finder_finds_a_circle_and_leaves_a_package_and_its_submodule_out():
    class Graph:  # grimp's graph, as import_circles reads it
        imports = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
        modules = set(imports)

        def find_modules_directly_imported_by(self, module):
            return self.imports[module]

    assert sorted(sorted(c) for c in import_circles(Graph())) == [["p.a", "p.b"]]


def private_imports_from_outside(graph) -> list[tuple[str, str]]:
    """``(importer, module)`` for each import of a private module (a path part starting
    with ``_``) from outside the package that holds it."""
    found = []
    for importer in sorted(graph.modules):
        for target in graph.find_modules_directly_imported_by(importer):
            parts = target.split(".")
            for i, part in enumerate(parts):
                if part.startswith("_") and not part.startswith("__"):
                    owner = ".".join(parts[:i])
                    if not (importer == owner or importer.startswith(owner + ".")):
                        found.append((importer, target))
                    break
    return found


def test_no_private_module_is_imported_from_outside_its_package():
    import grimp

    graph = grimp.build_graph("pipetune", "flows", "tasks", "deployments",
                              exclude_type_checking_imports=True, cache_dir=None)
    assert private_imports_from_outside(graph) == []

    class Graph:  # the finder finds one, and leaves a package's own imports alone
        imports = {"p.a": {"p.b._c"}, "p.b": {"p.b._c"}, "p.b.d": {"p.b._c"}, "p.b._c": set()}
        modules = set(imports)

        def find_modules_directly_imported_by(self, module):
            return self.imports[module]

    assert private_imports_from_outside(Graph()) == [("p.a", "p.b._c")]
