"""House rules that a machine checks (docs/design.md): file sizes, import direction, no cycles,
no references to files outside the repository."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "graphtune"
MAX_LINES = 500

# Which graphtune packages each package may import (function-local imports included).
ALWAYS_ALLOWED = {
    "graphtune.errors",
    "graphtune.env",
    "graphtune.atomic_files",  # atomic writes and their fallback, standard library only
    "graphtune.finite_json",  # JSON without NaN/Infinity, standard library only
    "graphtune.reporting",
    "graphtune._version",
    "graphtune.cuda_memory",
    "graphtune._compile_worker",  # imports nothing from graphtune (docs/design.md)
    "graphtune._rope_jit",  # Triton device functions kernel modules share (docs/design.md)
    "graphtune._split_k_jit",  # the same, for the one-kernel split exchange
}
# Leaf modules of Triton device functions: a runner's cache identity must hash them too.
JIT_LEAVES = {"graphtune._rope_jit", "graphtune._split_k_jit"}
ALLOWED_IMPORTS = {
    "graphs": {"graphs"},
    "autotuner": {"autotuner"},
    "ops": {"ops", "autotuner"},
    "engine": {"engine", "ops", "autotuner", "graphs"},
    "bench": {"bench", "engine", "ops", "autotuner", "graphs"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every graphtune module ``module`` imports, at any depth of its code."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from graphtune.ops import gemm`` imports the submodule when one exists; the
            # package itself counts only when a name is not a submodule (its __init__ runs code).
            subs = [f"{base}.{alias.name}" for alias in node.names]
            names = [n for n in subs if n in known]
            if len(names) < len(subs):
                names.append(base)
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith("graphtune") and name != module:
                out.add(name)
    # Importing ``a.b.c`` runs the __init__ of ``a.b`` first, so it imports that package too,
    # unless the package is one of the importer's own (then its __init__ is already running).
    own = {module.rsplit(".", k)[0] for k in range(module.count(".") + 1)}
    for name in list(out):
        parent = name.rpartition(".")[0]
        while parent and parent != "graphtune":
            if parent in known and parent not in own:
                out.add(parent)
            parent = parent.rpartition(".")[0]
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_no_python_file_exceeds_500_lines() -> None:
    # The tests and benchmarks too: a long test module is as hard to review as a long source one.
    files = [p for top in (SRC, ROOT / "tests", ROOT / "benchmarks") for p in top.rglob("*.py")]
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in files
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not too_long, f"split these files (at most {MAX_LINES} lines each): {too_long}"


def test_packages_import_only_downwards() -> None:
    broken = []
    for module, deps in _graph().items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in ALLOWED_IMPORTS:
            continue
        allowed = ALLOWED_IMPORTS[parts[1]]
        for dep in sorted(deps):
            if dep in ALWAYS_ALLOWED or dep == "graphtune":
                continue
            if dep.split(".")[1] not in allowed:
                broken.append(f"{module} -> {dep}")
    assert not broken, "imports against the direction in docs/design.md:\n" + "\n".join(broken)


def test_no_import_cycles() -> None:
    graph = _graph()
    # A package's __init__ re-exports its modules; a module importing its own package's
    # __init__ back is the cycle to avoid (import the defining module instead).
    index = 0
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(node: str) -> None:
        nonlocal index
        order[node] = low[node] = index
        index += 1
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, ()):
            if dep not in order:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], order[dep])
        if low[node] == order[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in order:
            visit(node)
    detail = [" -> ".join(_cycle_path(graph, component)) for component in cycles]
    assert not cycles, "import cycles (function-local imports count):\n" + "\n".join(detail)


def _cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One concrete cycle through a strongly connected component, for the message."""
    members = set(component)
    start = component[0]
    path = [start]
    seen = {start}
    node = start
    while True:
        nxt = sorted(d for d in graph[node] if d in members)
        back = [d for d in nxt if d == start]
        if back and len(path) > 1:
            return [*path, start]
        fresh = [d for d in nxt if d not in seen]
        if not fresh:
            return [*path, nxt[0]] if nxt else path
        node = fresh[0]
        seen.add(node)
        path.append(node)


def _declared_source_modules() -> dict[str, tuple[str, ...]]:
    """``source_modules`` of every runner class under ``graphtune.ops``, by ``module.Class``."""
    found = {}
    for module in _modules():
        if not module.startswith("graphtune.ops"):
            continue
        for name, obj in vars(importlib.import_module(module)).items():
            if isinstance(obj, type) and obj.__module__ == module and "source_modules" in vars(obj):
                found[f"{module}.{name}"] = tuple(obj.source_modules)
    return found


def test_runners_hash_the_device_functions_their_kernels_import() -> None:
    # A kernel that calls a shared device function changes when that function does; its picks
    # must then be tuned again, so the function's module is part of the runner's identity.
    graph = _graph()
    declared = _declared_source_modules()
    assert declared, "no runner declares source_modules: the scan found nothing"
    missing = [
        f"{runner} lists {module}, which imports {leaf}: add {leaf!r} to its source_modules"
        for runner, listed in sorted(declared.items())
        for module in listed
        for leaf in sorted(graph.get(module, set()) & JIT_LEAVES)
        if leaf not in listed
    ]
    assert not missing, "\n".join(missing)


# The runners whose candidates a limit of graphtune.ops._pruned decides.
PRUNED_RUNNERS = (
    "graphtune.ops.gemm.gemv.TritonGemvRunner",
    "graphtune.ops.gemm.tiled.TritonGemmRunner",
    "graphtune.ops.fused.projection.TritonAddProjection",
    "graphtune.ops.fused.projection.TritonNormLinearInLoop",
    "graphtune.ops.fused.qkv.TritonQkvRopeAfterNorm",
    "graphtune.ops.rmsnorm.TritonRMSNormRunner",
    "graphtune.ops.activation.TritonSiluAndMulRunner",
)


def _reads_pruning_limits(path: Path) -> bool:
    tree = ast.parse(path.read_text(), filename=str(path))
    return any(
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "_pruned"
        for node in ast.walk(tree)
    )


def test_runners_hash_the_pruning_limits_they_read() -> None:
    # Editing a limit changes a runner's candidates, so the picks tuned under the old limit must
    # be tuned again: the limits' module is part of the identity of every runner that reads one.
    readers = {m for m, path in _modules().items() if _reads_pruning_limits(path)}
    listed = {name.rpartition(".")[0] for name in PRUNED_RUNNERS}
    assert readers, "no module reads graphtune.ops._pruned: the scan found nothing"
    assert readers <= listed, f"add the runners of {sorted(readers - listed)} to PRUNED_RUNNERS"
    for name in PRUNED_RUNNERS:
        module, _, class_name = name.rpartition(".")
        runner = getattr(importlib.import_module(module), class_name)
        assert "graphtune.ops._pruned" in runner.source_modules, name


OUTSIDE_REFERENCES = re.compile(r"\bDESIGN\.md|\.\./shared|/work/|EXAMPLES\.md")


@pytest.mark.parametrize("folder", ["src", "docs"])
def test_no_references_outside_the_repository(folder: str) -> None:
    bad = []
    for path in sorted((ROOT / folder).rglob("*")):
        if path.suffix not in (".py", ".md"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if OUTSIDE_REFERENCES.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bad, "cite repository files only:\n" + "\n".join(bad)


def test_graph_runner_import_does_not_load_the_tuner() -> None:
    code = (
        "import sys, graphtune.graphs; "
        "print(','.join(sorted(m for m in sys.modules if m.startswith('graphtune.'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    heavy = [m for m in loaded.split(",") if m.startswith(("graphtune.autotuner", "graphtune.ops"))]
    assert not heavy, f"import graphtune.graphs loaded {heavy}"
