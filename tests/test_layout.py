"""The package layout's rules, checked on the source (every import, function-level ones included).

Layers, lowest first: planner.errors / jsonio / sizes < planner.pipeline < planner.model < planner.profile
< planner.cost < planner.solve < planner.plan < planner.fidelity < planner.cli. A module imports only
from its own layer or lower ones. `runtime` sits beside planner.plan and planner.fidelity: it may
import any planner package except planner.solve (pulp) and planner.cli; planner never imports runtime.
planner.pipeline imports the standard library only. No import cycles between modules.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [("planner.errors", "planner.jsonio", "planner.sizes"), ("planner.pipeline",), ("planner.model",),
          ("planner.profile",), ("planner.cost",), ("planner.solve",), ("planner.plan",), ("planner.fidelity",),
          ("planner.cli",)]
RUNTIME_FORBIDDEN = ("planner.solve", "planner.cli")
# `from planner import ModelSpec` (what model entry points write) is a lazy re-export in the root package
ROOT_EXPORTS = {"planner": {"planner.model.spec"}}


def _modules() -> Dict[str, str]:
    """module name -> file, for every module of planner and runtime."""
    found = {}
    for package in ("planner", "runtime"):
        for directory, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(directory, name)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(path: str) -> Set[str]:
    """Every module name an import statement in the file names (at any depth in the code); for
    `from package import name`, package.name when that is a module."""
    names: Set[str] = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names
                         if f"{node.module}.{alias.name}" in MODULES)
    return names


def _internal(name: str) -> bool:
    return name.split(".")[0] in ("planner", "runtime")


def _layer(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer; add it to tests/test_layout.py's LAYERS")


GRAPH = {module: sorted(name for name in _imports(path) if _internal(name)) for module, path in MODULES.items()}


def test_every_import_runs_down_the_layers():
    wrong: List[str] = []
    for module, targets in GRAPH.items():
        for target in targets:
            if target in ("planner", "runtime") or target == module:
                continue
            if module in ROOT_EXPORTS:
                if target not in ROOT_EXPORTS[module]:
                    wrong.append(f"{module} -> {target} (the root package re-exports only {ROOT_EXPORTS[module]})")
            elif module.startswith("runtime"):
                if target.startswith(RUNTIME_FORBIDDEN):
                    wrong.append(f"{module} -> {target} (the runtime never imports the solver or the CLI)")
            elif target.startswith("runtime"):
                wrong.append(f"{module} -> {target} (planner never imports runtime)")
            elif _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target} (up from layer {_layer(module)} to {_layer(target)})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_pipeline_package_needs_only_the_standard_library():
    wrong = [f"{module} imports {name}" for module, path in MODULES.items() if module.startswith("planner.pipeline")
             for name in _imports(path)
             if not name.startswith(("planner.pipeline", "planner.errors"))
             and name.split(".")[0] not in sys.stdlib_module_names and name != "__future__"]
    assert not wrong, wrong


def test_no_import_cycles():
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH.get(v, []):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in GRAPH[v]:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, f"import cycles: {cycles}"


def test_package_inits_are_thin():
    """A package's __init__ imports nothing of the project: importing planner.solve.solution must
    not load the solvers (pulp), importing planner must not load torch."""
    heavy = {module: targets for module, targets in GRAPH.items()
             if MODULES[module].endswith("__init__.py") and module not in ROOT_EXPORTS and targets}
    assert not heavy, heavy


_BLOCK_AND_IMPORT = r"""
import importlib, sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

BLOCKED = set(sys.argv[1].split(","))
sys.meta_path.insert(0, Blocker())
for module in sys.argv[2:]:
    importlib.import_module(module)
loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("ok")
"""


def _import_without(blocked: str, modules: List[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", _BLOCK_AND_IMPORT, blocked, *modules], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_runtime_and_plan_files_import_without_pulp():
    """A training cluster needs torch, not the solver: every runtime module and the plan file
    package import with `import pulp` failing."""
    modules = sorted(m for m in MODULES if m.startswith(("runtime", "planner.plan")))
    result = _import_without("pulp", modules)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_the_blocker_blocks():
    """The check above can fail: a module that needs pulp does not import under the blocker."""
    result = _import_without("pulp", ["planner.solve.ilp"])
    assert result.returncode != 0 and "pulp is blocked" in result.stderr


def test_planner_and_its_schedules_import_without_torch_or_numpy():
    modules = ["planner", "planner.errors", "planner.jsonio", "planner.sizes"] + \
        sorted(m for m in MODULES if m.startswith("planner.pipeline"))
    result = _import_without("torch,numpy,pulp", modules)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
