"""The project's import graph, read from the source (every module's import statements, AST-parsed): packages import
one way only, and no module imports itself through others.

Every import statement counts: at module level, under `if TYPE_CHECKING:` and inside functions (a deferred import is a
dependency all the same). Importing `a.b.c` also runs the package `a.b`, so that is an edge too (except from inside
`a.b` itself). Not seen here, by design: `importlib.import_module(name)`, with which a `runtime.registry.Registry`
(the drafter kinds') loads its built-in kind modules at the first lookup, at run time, not while modules import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Lowest first: a package may import only the packages before it (ARCHITECTURE.md, "Packages and the one-way import
# rule").
PACKAGES = ("plugins", "runtime", "builder", "model_repo", "deploy", "perf")
# Third-party packages a project package must never import (the runtime has its own model; transformers is the tests'
# reference implementation and the builder's training implementation).
FORBIDDEN = {"plugins": ("transformers",), "runtime": ("transformers",)}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project packages (a package is its __init__.py)."""
    out = {}
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            parts = file.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = file
    return out


def imported_names(module: str, file: Path) -> set[str]:
    """Every dotted name `module` imports, anywhere in its source (`from X import Y` gives X.Y and X)."""
    is_package = file.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"), str(file))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (each one's enclosing packages included, see the docstring)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for module, file in mods.items():
        edges: set[str] = set()
        for name in imported_names(module, file):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in mods and target != module and not module.startswith(target + "."):
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def direction_violations(root: Path = ROOT) -> list[str]:
    """'a.b -> c.d' for every import of a package not below the importer's (or of a forbidden third-party one)."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    bad = []
    for module, file in modules(root).items():
        own = module.split(".")[0]
        for name in sorted(imported_names(module, file)):
            top = name.split(".")[0]
            if (top in rank and rank[top] > rank[own]) or top in FORBIDDEN.get(own, ()):
                bad.append(f"{module} -> {name}")
    return bad


def test_packages_import_one_way():
    assert direction_violations() == []


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "runtime.tree" in graph["runtime.draft_spec"]  # it reads the real tree
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Negative controls: each kind of import the graph must see makes a cycle or a wrong-way import it finds."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "runtime" / "low.py").write_text("import runtime.high\n")
    (tmp_path / "runtime" / "sub").mkdir()
    (tmp_path / "runtime" / "sub" / "__init__.py").write_text("from runtime.low import x\n")
    (tmp_path / "runtime" / "sub" / "leaf.py").write_text("")
    variants = {
        "module level": "from runtime import low\n",
        "TYPE_CHECKING": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from runtime.low import X\n",
        "deferred": "def f():\n    from . import low\n",
        "enclosing package": "import runtime.sub.leaf\n",
    }
    for what, source in variants.items():
        (tmp_path / "runtime" / "high.py").write_text(source)
        assert find_cycle(import_graph(tmp_path)) is not None, what
    (tmp_path / "runtime" / "high.py").write_text("")
    assert find_cycle(import_graph(tmp_path)) is None
    (tmp_path / "runtime" / "high.py").write_text("def f():\n    import builder.config\n    import transformers\n")
    assert direction_violations(tmp_path) == ["runtime.high -> builder.config", "runtime.high -> transformers"]
    (tmp_path / "plugins" / "op.py").write_text("from runtime import low\n")
    assert "plugins.op -> runtime" in direction_violations(tmp_path)


def test_the_former_cycle_is_gone():
    """runtime.tree imported runtime.protocol (CandidatePool), which names runtime.draft_spec, which imports
    runtime.tree; the pool now lives with the tree it is cut into."""
    graph = import_graph()
    assert not graph["runtime.tree"] & {"runtime.protocol", "runtime.draft_spec"}
