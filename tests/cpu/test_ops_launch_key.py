"""graphtune.ops._launch_key: which binary a Triton launch runs.

The key is checked against real ``JITFunction`` objects (built here without the interpreter, never
launched). That it is at least as fine as Triton's own specialisation, over every launch the
runners make, is checked in ``sm90_compile.py``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The suite's convention (test_ops_kernels.py): the interpreter is chosen before Triton is first
# imported. The JITFunction objects below are built directly, so they are compiled-mode ones.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from graphtune.ops._launch_key import launch_key  # noqa: E402


def _body(x_ptr, n, rows, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):  # noqa: N803
    pass


KERNEL = JITFunction(_body, do_not_specialize=["rows"])


def _tensor(offset: int = 0) -> torch.Tensor:
    storage = torch.empty(64 + 16, dtype=torch.bfloat16)
    return storage[offset : offset + 64]


def test_tensors_are_keyed_by_dtype_and_16_byte_alignment_not_address():
    a, b = _tensor(), torch.empty(64, dtype=torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()
    assert launch_key(KERNEL, (a, 7, 3), {}) == launch_key(KERNEL, (b, 7, 3), {})
    assert launch_key(KERNEL, (a, 7, 3), {}) != launch_key(KERNEL, (_tensor(1), 7, 3), {})
    assert launch_key(KERNEL, (a, 7, 3), {}) != launch_key(KERNEL, (a.float(), 7, 3), {})


def test_ints_are_keyed_by_triton_classes_unless_declared_not_to_specialise():
    x = _tensor()

    def key(n: int, rows: int) -> Any:
        return launch_key(KERNEL, (x, n, rows), {})

    assert key(17, 3) == key(33, 3)  # neither 1 nor a multiple of 16
    assert len({key(1, 3), key(16, 3), key(17, 3), key(2**40 + 1, 3)}) == 4
    assert key(17, 1) == key(17, 16) == key(17, 40)  # rows: do_not_specialize
    assert key(17, 3) != key(17, 2**33)  # but its width counts


def test_constexpr_and_meta_values_count_and_unhashable_meta_is_refused():
    x = _tensor()
    assert launch_key(KERNEL, (x, 7, 3), {"BLOCK": 64}) != launch_key(
        KERNEL, (x, 7, 3), {"BLOCK": 128}
    )
    assert launch_key(KERNEL, (x, 7, 3, 64), {}) != launch_key(KERNEL, (x, 7, 3, 128), {})
    with pytest.raises(TypeError):
        launch_key(KERNEL, (x, 7, 3), {"BLOCK": [64]})
