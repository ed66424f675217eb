"""The layering and the sizes of looptrain/ (docs/architecture.md, "Rules the tests hold").

No import circle; leaves never import the Loop, the estimator, the planner or the command lines; the estimator
never imports the planner; no module takes a name from its own package's ``__init__``; no module over 600 lines
(``loop.py`` 450), no function over 100; no test runs a script by its path. Every import counts, the lazy ones
inside functions included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "looptrain"
# Modules the Loop builds on; they never import the Loop, the planning layer or the command lines.
LEAVES = ("config", "precision", "guards", "run_log", "resume", "checkpoint", "metrics", "freeze", "unfreeze",
          "gradient_checkpointing", "distributed", "optim", "data", "memory", "batches", "ledger", "seeding",
          "strategy", "lm_loss", "lora", "errors", "cache", "compilation", "embedding_grad", "fake", "flops",
          "progress", "report", "run", "run_files", "tile_sample", "trackers")
ABOVE_THE_LEAVES = ("looptrain.loop", "looptrain.estimation", "looptrain.planning", "looptrain.cli")
TESTS = Path(__file__).resolve().parent
# The one test that runs `python scripts/finetune.py` from a checkout, the public shim (tests/test_cli.py).
SHIM_TEST = "test_the_scripts_shim_runs_from_a_checkout"


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


def imported_from(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` in module `name` imports from (relative imports resolved)."""
    base = node.module or ""
    if not node.level:
        return base
    anchor = name.split(".") if is_package else name.split(".")[:-1]
    anchor = anchor[:len(anchor) - (node.level - 1)]
    return ".".join([*anchor, base] if base else anchor)


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
                base = imported_from(node, name, is_package)
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


# The sizes a reader can hold in mind (docs/architecture.md, "Sizes").
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100
MAX_LOOP_LINES = 450


def estimation_imports_of_planning(graph: dict[str, set[str]]) -> list[str]:
    """``module -> target`` for every import of `looptrain.planning` by `looptrain.estimation`."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  if module == "looptrain.estimation" or module.startswith("looptrain.estimation.")
                  for target in targets
                  if target == "looptrain.planning" or target.startswith("looptrain.planning."))


def package_init_imports(package_root: Path) -> list[str]:
    """``module -> package: name`` for every name a module takes from the ``__init__`` of a package it lies in.

    Such an import runs the package's ``__init__`` from inside it, half-built: a module imports its neighbours'
    modules (``from looptrain.planning.search import Search``), never its own package's re-exports. Taking a
    submodule from a package (``from looptrain import strategy``) is not such an import.
    """
    modules = module_names(package_root)
    found = []
    for name, path in modules.items():
        if name.endswith(".__main__"):  # a command line's entry point, run and never imported: its package is built
            continue
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = imported_from(node, name, is_package)
            if base not in modules or modules[base].name != "__init__.py" or not name.startswith(base + "."):
                continue
            found.extend(f"{name} -> {base}: {alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" not in modules)
    return sorted(found)


def oversized(package_root: Path) -> list[str]:
    """Every module over `MAX_MODULE_LINES` (`loop.py` over `MAX_LOOP_LINES`) and function over `MAX_FUNCTION_LINES`."""
    found = []
    for name, path in module_names(package_root).items():
        text = path.read_text(encoding="utf-8")
        limit = MAX_LOOP_LINES if name == "looptrain.loop" else MAX_MODULE_LINES
        if len(text.splitlines()) > limit:
            found.append(f"{name}: {len(text.splitlines())} lines (at most {limit})")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}.{node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


RUNNERS = {"run", "Popen", "check_call", "check_output", "call", "run_path", "execv", "execvp"}
SCRIPT = re.compile(r"(^|[\"'/ ])scripts/\w+\.py")


def scripts_run_by_path(test_files: list[Path]) -> list[str]:
    """``file:line`` of every test that runs a ``scripts/*.py`` file by path (a subprocess, `runpy`, a child's code).

    Tests run the command lines as modules (``python -m looptrain.cli.finetune``) or in-process through
    ``main(argv)``; `SHIM_TEST` alone runs the shim, to prove that ``python scripts/finetune.py`` works from a checkout.
    """
    found = []
    for path in test_files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        allowed = {id(node) for function in ast.walk(tree)
                   if isinstance(function, ast.FunctionDef) and function.name == SHIM_TEST
                   for node in ast.walk(function)}
        for node in ast.walk(tree):
            if id(node) in allowed:
                continue
            if isinstance(node, ast.Call):
                function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if function in RUNNERS and any(isinstance(part, ast.Constant) and isinstance(part.value, str)
                                               and SCRIPT.match(part.value)
                                               for argument in node.args for part in ast.walk(argument)):
                    found.append(f"{path.name}:{node.lineno}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "run_path(" in node.value \
                    and SCRIPT.search(node.value):
                found.append(f"{path.name}:{node.lineno}")
    return sorted(found)


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


def test_the_estimator_never_imports_the_planner():
    assert estimation_imports_of_planning(import_graph(PACKAGE_ROOT)) == []


def test_no_module_takes_a_name_from_its_own_packages_init():
    assert package_init_imports(PACKAGE_ROOT) == []


def test_modules_and_functions_stay_readable_sizes():
    assert oversized(PACKAGE_ROOT) == []


def test_no_test_runs_a_script_by_its_path():
    # This file's own sample of what the rule catches (below) is text, not a test that runs.
    assert scripts_run_by_path(sorted(set(TESTS.glob("*.py")) - {Path(__file__).resolve()})) == []


def test_the_rules_catch_what_they_name(tmp_path):
    package = tmp_path / "looptrain"
    (package / "estimation").mkdir(parents=True)
    (package / "planning").mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text("def fit():\n" + "    pass\n" * MAX_FUNCTION_LINES + "x = 1\n" * 400)
    (package / "estimation" / "__init__.py").write_text("from looptrain.estimation.estimator import estimate\n")
    (package / "estimation" / "estimator.py").write_text(
        "def estimate():\n    from looptrain.planning import search\n")
    (package / "planning" / "__init__.py").write_text("from looptrain.planning.search import Search\n")
    (package / "planning" / "search.py").write_text("from looptrain.planning import plan\nclass Search: ...\n")
    assert estimation_imports_of_planning(import_graph(package)) == [
        "looptrain.estimation.estimator -> looptrain.planning",
        "looptrain.estimation.estimator -> looptrain.planning.search"]
    assert package_init_imports(package) == ["looptrain.planning.search -> looptrain.planning: plan"]
    assert oversized(package) == [f"looptrain.loop: {MAX_FUNCTION_LINES + 401} lines (at most {MAX_LOOP_LINES})",
                                  f"looptrain.loop.fit: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES})"]
    tests = tmp_path / "test_runs.py"
    tests.write_text(
        "import runpy, subprocess, sys\n"
        "def test_a():\n    subprocess.run([sys.executable, \"scripts/finetune.py\", \"--help\"])\n"
        "def test_b():\n    runpy.run_path(\"scripts/plan.py\")\n"
        "CHILD = 'import runpy; runpy.run_path(\"scripts/finetune.py\")'\n"
        "def test_c():\n    assert ['python', 'scripts/finetune.py'] == ['python', 'scripts/finetune.py']\n"
        f"def {SHIM_TEST}():\n    subprocess.run([sys.executable, 'scripts/finetune.py', '--help'])\n")
    assert scripts_run_by_path([tests]) == ["test_runs.py:3", "test_runs.py:5", "test_runs.py:6"]
