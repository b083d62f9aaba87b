"""graphtune._compile_worker: how a compile worker loads a kernel's module, and when it builds a
kernel's host launcher.

A worker must load ``graphtune.ops.gemm._gemv_kernels`` without running the ``__init__`` of
``graphtune.ops`` (which imports torch and every op). These tests load throwaway modules under
dotted names whose parent packages do not exist, so a parent import would fail loudly.
"""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest

from graphtune._compile_worker import build_launcher, kernel_module


def _module_file(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_module_runs_from_its_file_without_its_parent_packages(tmp_path) -> None:
    name = "no_such_package_for_graphtune.sub._kernels"
    path = _module_file(tmp_path, "_kernels", "import math\nVALUE = math.sqrt(16)\n")
    try:
        module = kernel_module(name, path)
        assert module.VALUE == 4.0 and module.__name__ == name
        assert sys.modules[name] is module
        assert "no_such_package_for_graphtune" not in sys.modules
        assert kernel_module(name, None) is module  # loaded once, then reused
    finally:
        sys.modules.pop(name, None)


def test_a_module_that_fails_to_run_is_not_left_half_loaded(tmp_path) -> None:
    name = "no_such_package_for_graphtune.broken"
    path = _module_file(tmp_path, "broken", "raise RuntimeError('kernel module failed')\n")
    with pytest.raises(RuntimeError, match="kernel module failed"):
        kernel_module(name, path)
    assert name not in sys.modules


def test_without_a_path_the_module_is_imported_by_name() -> None:
    import json

    assert kernel_module("json", None) is json
    with pytest.raises(ModuleNotFoundError):
        kernel_module("no_such_package_for_graphtune.kernels", None)


def compile_module_from_src(**kwargs) -> None:
    """Stands in for Triton's C-launcher build (the name is what build_launcher looks for)."""
    BuildingLauncher.built.append(kwargs)


class BuildingLauncher:
    """A launcher whose constructor compiles C, as Triton's CudaLauncher does up to 3.6."""

    built: list[dict] = []

    def __init__(self, src, metadata) -> None:
        compile_module_from_src(src=src, name="__triton_launcher")


class GenericLauncher:
    """A launcher that compiles nothing (and might ask the active driver, so import torch)."""

    def __init__(self, src, metadata) -> None:
        raise AssertionError("a launcher that compiles nothing must not be built in a worker")


class FailingLauncher:
    def __init__(self, src, metadata) -> None:
        compile_module_from_src(src=src)
        raise OSError("libcuda.so cannot be found")


def test_a_worker_builds_a_launcher_only_where_triton_compiles_one() -> None:
    kernel = SimpleNamespace(src="the kernel's source", metadata=None)
    BuildingLauncher.built.clear()
    assert build_launcher(kernel, BuildingLauncher) == "built"
    assert BuildingLauncher.built == [{"src": "the kernel's source", "name": "__triton_launcher"}]
    assert build_launcher(kernel, GenericLauncher) == "not needed"
    assert build_launcher(kernel, FailingLauncher).startswith("failed: OSError: libcuda")


def test_the_first_job_of_each_signature_builds_the_launcher(monkeypatch) -> None:
    from graphtune.ops import _compile_pool

    submitted = []

    class Pool:
        def submit(self, fn, job):
            submitted.append(job)
            return SimpleNamespace(add_done_callback=lambda callback: None)

    def job(ident: str, signature: dict) -> _compile_pool.CompileJob:
        return _compile_pool.CompileJob("m", "k", signature, {}, {}, {}, None, ident)

    monkeypatch.setattr(_compile_pool, "_LAUNCHERS", set())
    a, b = {"x": "*bf16", "n": "i32"}, {"x": "*bf16", "n": "constexpr"}
    for ident, signature in (("1", a), ("2", a), ("3", b), ("4", a)):
        assert _compile_pool._hand_over(Pool(), job(ident, signature)) is not None
    assert [(j.ident, j.launcher) for j in submitted] == [
        ("1", True),
        ("2", False),
        ("3", True),
        ("4", False),
    ]
