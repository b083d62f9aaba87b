"""graphtune.ops._launch: the binary key of a Triton launch and the launch cache's bookkeeping.

The key is checked against real ``JITFunction`` objects (built here without the interpreter, never
launched). That it is at least as fine as Triton's own specialisation, over every launch the
runners make, is checked in ``sm90_compile.py``; that cached launches give Triton's bits, in
``tests/gpu/test_launch_cache_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from graphtune import env  # noqa: E402
from graphtune.ops import _launch  # noqa: E402
from graphtune.ops._launch import LaunchCache, binary_key, trailing_values  # noqa: E402


def _body(x_ptr, n, rows, BLOCK: tl.constexpr, FLAG: tl.constexpr = True):  # noqa: N803
    pass


def _runtime_tail(x_ptr, n, scale):
    pass


KERNEL = JITFunction(_body, do_not_specialize=["rows"])
RUNTIME_TAIL = JITFunction(_runtime_tail)


def _tensor(offset: int = 0) -> torch.Tensor:
    storage = torch.empty(64 + 16, dtype=torch.bfloat16)
    return storage[offset : offset + 64]


def test_tensors_are_keyed_by_dtype_and_16_byte_alignment_not_address():
    a, b = _tensor(), torch.empty(64, dtype=torch.bfloat16)
    assert a.data_ptr() != b.data_ptr()
    assert binary_key(KERNEL, (a, 7, 3), {}) == binary_key(KERNEL, (b, 7, 3), {})
    assert binary_key(KERNEL, (a, 7, 3), {}) != binary_key(KERNEL, (_tensor(1), 7, 3), {})
    assert binary_key(KERNEL, (a, 7, 3), {}) != binary_key(KERNEL, (a.float(), 7, 3), {})


def test_ints_are_keyed_by_triton_classes_unless_declared_not_to_specialise():
    x = _tensor()

    def key(n: int, rows: int) -> Any:
        return binary_key(KERNEL, (x, n, rows), {})

    assert key(17, 3) == key(33, 3)  # neither 1 nor a multiple of 16
    assert len({key(1, 3), key(16, 3), key(17, 3), key(2**40 + 1, 3)}) == 4
    assert key(17, 1) == key(17, 16) == key(17, 40)  # rows: do_not_specialize
    assert key(17, 3) != key(17, 2**33)  # but its width counts


def test_constexpr_and_meta_values_count_and_unhashable_meta_is_refused():
    x = _tensor()
    assert binary_key(KERNEL, (x, 7, 3), {"BLOCK": 64}) != binary_key(
        KERNEL, (x, 7, 3), {"BLOCK": 128}
    )
    assert binary_key(KERNEL, (x, 7, 3, 64), {}) != binary_key(KERNEL, (x, 7, 3, 128), {})
    with pytest.raises(TypeError):
        binary_key(KERNEL, (x, 7, 3), {"BLOCK": [64]})


def test_trailing_values_come_from_meta_then_defaults_and_refuse_runtime_parameters():
    x = _tensor()
    assert trailing_values(KERNEL, (x, 7, 3), {"BLOCK": 64, "num_warps": 4}) == (64, True)
    assert trailing_values(KERNEL, (x, 7, 3), {"BLOCK": 64, "FLAG": False}) == (64, False)
    assert trailing_values(KERNEL, (x, 7, 3), {}) is None  # BLOCK has no value
    assert trailing_values(RUNTIME_TAIL, (x, 7), {"scale": 0.5}) is None


class _Compiled:
    """Stands in for Triton's ``CompiledKernel``, which only a GPU can run."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[Any, ...]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args: self.calls.append((grid, args))


def test_the_cache_launches_the_remembered_binary_with_every_parameter_and_a_3d_grid():
    cache = LaunchCache(current_device=lambda: 0)
    x = _tensor()
    meta = {"BLOCK": 64, "num_warps": 4}
    key = cache.key(KERNEL, (x, 7, 3), meta, extra=True)
    assert key is not None
    assert not cache.launch(key, (5,), (x, 7, 3))
    compiled = _Compiled()
    cache.remember(key, KERNEL, (x, 7, 3), meta, compiled)
    y = _tensor()
    assert cache.launch(cache.key(KERNEL, (y, 7, 3), meta, extra=True), (5, 2), (y, 7, 3))
    assert compiled.calls == [((5, 2, 1), (y, 7, 3, 64, True))]
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.key(KERNEL, (y, 7, 3), meta, extra=False) != key  # the PDL switch counts


def test_the_cache_skips_what_it_cannot_fix_and_what_is_not_a_plain_jit_function():
    cache = LaunchCache(current_device=lambda: 0)
    x = _tensor()
    key = cache.key(RUNTIME_TAIL, (x, 7), {"scale": 0.5}, extra=True)
    cache.remember(key, RUNTIME_TAIL, (x, 7), {"scale": 0.5}, _Compiled())
    assert not cache.launch(key, (1,), (x, 7))
    assert cache.key(_body, (x, 7, 3), {"BLOCK": 64}, extra=True) is None
    assert cache.key(KERNEL, (x, 7, 3), {"BLOCK": [64]}, extra=True) is None


def test_the_cache_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(_launch, "MAX_ENTRIES", 2)
    cache = LaunchCache(current_device=lambda: 0)
    x = _tensor()
    keys = [cache.key(KERNEL, (x, n, 3), {"BLOCK": 64}, extra=True) for n in (1, 16, 17)]
    for k in keys:
        cache.remember(k, KERNEL, (x, 7, 3), {"BLOCK": 64}, _Compiled())
    assert [cache.launch(k, (1,), (x, 7, 3)) for k in keys] == [False, False, True]


@pytest.mark.parametrize(("value", "allowed"), [(None, True), ("1", True), ("0", False)])
def test_graphtune_fast_launch_switches_the_cache(monkeypatch, value, allowed):
    if value is None:
        monkeypatch.delenv("GRAPHTUNE_FAST_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("GRAPHTUNE_FAST_LAUNCH", value)
    assert env.fast_launch_allowed() is allowed
