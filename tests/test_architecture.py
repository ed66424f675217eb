"""The layering of looptrain/: no import circle, and leaves never import the Loop, planning or the command lines.

Every import counts, the lazy ones inside functions included (docs/architecture.md, STYLE.md rule 2).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "looptrain"
# Modules the Loop builds on; they never import the Loop, the planning layer or the command lines.
LEAVES = ("config", "precision", "guards", "run_log", "resume", "checkpoint", "metrics", "freeze", "unfreeze",
          "gradient_checkpointing", "distributed", "optim", "data", "memory", "batches", "ledger", "seeding",
          "strategy", "lm_loss", "lora", "errors")
ABOVE_THE_LEAVES = ("looptrain.loop", "looptrain.planning", "looptrain.cli")


def module_names(package_root: Path) -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in sorted(package_root.rglob("*.py")):
        parts = path.relative_to(package_root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a module or a name inside one) lies in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package_root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at any depth of the file (function-level imports too).

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``; importing a
    submodule also runs its packages' ``__init__``, so those count as imported too.
    """
    modules = module_names(package_root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                imported = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in imported:
                module = _resolve(target, modules)
                while module:  # the module and every package above it
                    targets.add(module)
                    module = module.rpartition(".")[0]
        targets.discard(name)
        for package in list(targets):  # a module's own packages run before it: not an edge of its own
            if name.startswith(package + "."):
                targets.discard(package)
        graph[name] = targets
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    visiting, done = [], set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return visiting[visiting.index(node):] + [node]
        if node in done:
            return None
        visiting.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def leaf_violations(graph: dict[str, set[str]]) -> list[str]:
    """``leaf -> module`` for every import of the Loop, planning or the command lines by a leaf."""
    leaves = {f"looptrain.{leaf}" for leaf in LEAVES}
    # A `__main__` is a command line's entry point (`python -m looptrain.memory`), run and never imported.
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  if not module.endswith(".__main__")
                  and (module in leaves or any(module.startswith(leaf + ".") for leaf in leaves))
                  for target in targets
                  if any(target == above or target.startswith(above + ".") for above in ABOVE_THE_LEAVES))


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "looptrain"
    (package / "memory").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text("from looptrain.guards import check\n")
    (package / "guards.py").write_text("def check():\n    from looptrain import memory\n")
    (package / "memory" / "__init__.py").write_text("from .estimator import estimate\n")
    (package / "memory" / "estimator.py").write_text("def estimate():\n    import looptrain.loop\n")
    graph = import_graph(package)
    assert graph["looptrain.guards"] == {"looptrain.memory"}  # its own package, looptrain, runs first anyway
    assert graph["looptrain.memory"] == {"looptrain.memory.estimator"}
    assert find_cycle(graph) == ["looptrain.guards", "looptrain.memory", "looptrain.memory.estimator", "looptrain.loop",
                                 "looptrain.guards"]
    assert leaf_violations(graph) == ["looptrain.memory.estimator -> looptrain.loop"]


def test_no_import_circle():
    cycle = find_cycle(import_graph(PACKAGE_ROOT))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_leaves_never_import_the_loop_planning_or_the_command_lines():
    graph = import_graph(PACKAGE_ROOT)
    assert all(f"looptrain.{leaf}" in graph for leaf in LEAVES)  # the list names real modules
    assert leaf_violations(graph) == []
