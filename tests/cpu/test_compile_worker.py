"""graphtune._compile_worker.kernel_module: how a compile worker loads a kernel's module.

A worker must load ``graphtune.ops.gemm._gemv_kernels`` without running the ``__init__`` of
``graphtune.ops`` (which imports torch and every op). These tests load throwaway modules under
dotted names whose parent packages do not exist, so a parent import would fail loudly.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from graphtune._compile_worker import kernel_module


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
