"""The package layering, read from every import statement (module-level or inside a function):

    IR (souffle/: graph, ops, lowering, models, passes) <- analysis/ <- codegen/ <- driver

The driver (souffle.compiler, souffle.compiled, souffle.cuda_model, souffle.cli) may import
anything; souffle/runtime/ loads and launches built kernels on a machine with neither TVM nor
the compiler, so it imports only itself and the IR. No import cycle among the project's modules.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("souffle", "analysis", "codegen")
DRIVER = {"souffle.compiler", "souffle.compiled", "souffle.cuda_model", "souffle.cli", "souffle.__main__"}
ALLOWED = {  # layer -> the layers it may import
    "ir": {"ir"},
    "runtime": {"runtime", "ir"},
    "analysis": {"analysis", "ir"},
    "codegen": {"codegen", "analysis", "ir", "runtime"},
    "driver": {"driver", "codegen", "analysis", "ir", "runtime"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer(module: str) -> str:
    if module in DRIVER:
        return "driver"
    if module == "souffle.runtime" or module.startswith("souffle.runtime."):
        return "runtime"
    return "ir" if module.split(".")[0] == "souffle" else module.split(".")[0]


def imports(module: str) -> list[tuple[str, int]]:
    """(imported project module, line) for every import statement in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.append((name, node.lineno))
    return found


def test_every_import_follows_the_layering():
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line}: {m} ({layer(m)}) imports {target} ({layer(target)})"
             for m in MODULES for target, line in imports(m) if layer(target) not in ALLOWED[layer(m)]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: sorted({target for target, _ in imports(m)}) for m in MODULES}
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]):
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("mutant, expected", [
    ("analysis.dependence", "codegen.staged"),  # the analysis reaching into codegen
    ("souffle.runtime.artifact", "souffle.compiler"),  # the runtime needing the compiler
    ("souffle.graph", "analysis.device"),  # the IR reaching up into the analysis
])
def test_the_checker_catches_an_import_against_the_layering(mutant, expected):
    assert layer(expected) not in ALLOWED[layer(mutant)]


def test_the_runtime_loads_without_tvm_or_the_compiler():
    runtime = [m for m in MODULES if layer(m) == "runtime"]
    code = ("import importlib, sys\n"
            f"for m in {runtime!r}: importlib.import_module(m)\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'codegen', 'analysis'))\n"
            "print(loaded[:5])\n"
            "sys.exit(1 if loaded else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"importing souffle.runtime loaded {done.stdout.strip()} {done.stderr[-2000:]}"
