"""Optional Triton: availability checks, device limits, the one kernel-launch point, tactic helpers.

Triton is an optional dependency (``pip install graphtune[triton]``). Importing
:mod:`graphtune.ops` never imports Triton; the kernels module is imported the first time a Triton
runner is built or used, so a machine without Triton gets torch-only runners and every op still
works through its torch fallback tactic. The base class of the Triton runners, with their
ahead-of-time compilation, is :mod:`graphtune.ops._triton_runner`.

Batch-sized integer arguments (rows ``M``, token pairs ``P``, row blocks, a rank) are declared
``do_not_specialize`` in every kernel. Triton would otherwise compile a separate binary for a
value of 1, for a multiple of 16 and for any other value: up to three binaries per tactic while
tuning the buckets 1, 2, 4 .. 128, and a compile inside the first capture of a size such as 40
whose bucket was timed at 32. Those arguments only bound loops and masks, so one binary serves
every batch size.

Every Triton launch of graphtune goes through :func:`run_kernel`. Inside
:func:`collect_launches` it launches nothing and records what each launch would compile instead
(:func:`~graphtune.ops._launch_key.launch_key`), which is how a runner finds out which of its
(profile, tactic) pairs share one binary before compiling them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from graphtune.errors import ConfigError
from graphtune.ops._launch_key import launch_key
from graphtune.ops._pdl import pdl_meta

logger = logging.getLogger(__name__)

#: The source modules of a runner of ``graphtune.ops._kernels`` (its ``source_modules``): the
#: kernels, and the Triton device functions they import.
KERNELS_SOURCES = ("graphtune.ops._kernels", "graphtune._rope_jit", "graphtune._split_k_jit")


class TritonUnavailableError(ConfigError, ImportError):
    """A Triton runner was asked for, but Triton cannot be imported."""


@functools.lru_cache(maxsize=1)
def _import_triton() -> tuple[ModuleType | None, str | None]:
    try:
        import triton  # noqa: F401  (the import itself is the check)
        import triton.language  # noqa: F401
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return triton, None


def triton_available() -> bool:
    """Whether Triton can be imported (checked once per process)."""
    return _import_triton()[0] is not None


def require_triton(what: str) -> ModuleType:
    """Returns the ``triton`` module, or raises a clear error naming the remedy.

    Args:
        what: What needed Triton, for the message (e.g. ``"TritonGemmRunner"``).

    Raises:
        TritonUnavailableError: Triton is not installed or fails to import.
    """
    module, reason = _import_triton()
    if module is None:
        raise TritonUnavailableError(
            f"{what} needs Triton, which is not importable ({reason}). Install it with "
            "`pip install graphtune[triton]` (or `pip install triton`), or use the torch runner "
            "only: every graphtune op falls back to torch when Triton is missing."
        )
    return module


@functools.cache
def kernel_module(name: str, what: str) -> ModuleType:
    """The kernels module ``name``, imported on its first use and kept (every launch asks for its
    kernel, and a ``from ... import`` costs a microsecond each time); ``what`` names the kernels
    in the error when Triton is missing, which is raised again on every call.

    Raises:
        TritonUnavailableError: Triton cannot be imported.
    """
    require_triton(what)
    return importlib.import_module(name)


def kernels() -> ModuleType:
    """The module of Triton kernels (imported on first use; needs Triton)."""
    return kernel_module("graphtune.ops._kernels", "graphtune's Triton kernels")


@functools.lru_cache(maxsize=1)
def kernels_interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter module cannot interpret
        return False
    return isinstance(kernels().gemm_kernel, InterpretedFunction)


@functools.lru_cache(maxsize=1)
def start_cache_key_warmup() -> threading.Thread | None:
    """Imports Triton and computes its key of its own installation in a background thread, once
    per process.

    Triton hashes every file of its package (``triton.runtime.cache.triton_key``, cached per
    process) before its first compile or on-disk cache load, and importing it takes a few hundred
    milliseconds more: time that otherwise delays the first kernel launch of a restarted process.
    The engine starts this when it begins to build a model on a GPU, so both overlap the weights'
    creation (file reads and large ``hashlib`` updates release the GIL); a Triton launch that
    needs a binary first waits for the thread (:func:`wait_for_cache_key`) instead of hashing
    the same files again beside it. Nothing happens without CUDA.
    """
    global _KEY_THREAD
    if not torch.cuda.is_available():
        return None
    thread = threading.Thread(target=_warm_cache_key, name="graphtune-triton-key", daemon=True)
    thread.start()
    _KEY_THREAD = thread
    return thread


#: The warm-up thread until a launch has waited for it (then ``None``: one global read a launch).
_KEY_THREAD: threading.Thread | None = None


def _warm_cache_key() -> None:
    if not triton_available():
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton without that function: nothing to warm
        return
    triton_key()


def wait_for_cache_key() -> None:
    """Waits for :func:`start_cache_key_warmup`'s thread, if it was started and has not been
    waited for. Every launch calls this, so once the thread is done it is one global read."""
    global _KEY_THREAD
    thread = _KEY_THREAD
    if thread is None or thread is threading.current_thread():
        return
    thread.join()
    _KEY_THREAD = None


def device_supported(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or the CPU under the interpreter."""
    if not triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and kernels_interpreted())


# Shared memory per block by compute capability, for torch builds whose device properties lack
# ``shared_memory_per_block_optin``.
_SMEM_BY_CC = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024}
_DEFAULT_SMEM = 99 * 1024
_DEFAULT_SMS = 132  # an H100/H200; only used to size tactics off-GPU


def device_limits(device: torch.device) -> tuple[int, int]:
    """(shared memory per block, SM count) of ``device``; H100/H200 values off-GPU."""
    if device.type != "cuda":
        return 227 * 1024, _DEFAULT_SMS
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if not smem:
        smem = _SMEM_BY_CC.get((props.major, props.minor), _DEFAULT_SMEM)
    return int(smem), int(props.multi_processor_count)


_LAUNCHES: contextvars.ContextVar[list[tuple[Any, ...]] | None] = contextvars.ContextVar(
    "graphtune_triton_launches", default=None
)


@contextlib.contextmanager
def collect_launches() -> Iterator[list[tuple[Any, ...]]]:
    """Within the block (this thread), :func:`run_kernel` records :func:`launch_key` instead of
    launching or compiling; yields the list of keys."""
    keys: list[tuple[Any, ...]] = []
    token = _LAUNCHES.set(keys)
    try:
        yield keys
    finally:
        _LAUNCHES.reset(token)


def run_kernel(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], meta: dict[str, Any], warmup: bool
) -> None:
    """Launches ``kernel[grid](*args, **meta)``, or with ``warmup`` only compiles it (inside
    :func:`collect_launches`: records its :func:`~graphtune.ops._launch_key.launch_key` only).

    The binary is loaded onto the device at its first launch, in the thread that launches it:
    a load waits for the GPU work in flight, so a load in a compile thread while the tuner keeps
    the GPU busy would hold that thread (and the binaries queued behind it) until the GPU is
    idle. The host launcher that Triton builds at the first load comes from the compile workers
    (:mod:`graphtune._compile_worker`).

    A kernel that declares ``USE_PDL`` gets it (and a PDL launch) from
    :func:`graphtune.ops._pdl.pdl_meta`, in all three cases, so the binary compiled ahead of time
    (and the key that stands for it) is the one launched.
    """
    meta = pdl_meta(kernel, args, meta)
    collecting = _LAUNCHES.get()
    if collecting is not None:
        collecting.append(launch_key(kernel, args, meta))
        return
    wait_for_cache_key()
    if warmup:
        kernel.warmup(*args, grid=grid, **meta)
    else:
        kernel[grid](*args, **meta)


#: The smallest block of an elementwise ``{"block", "warps"}`` tactic (:func:`check_block_tactic`).
MIN_ELEMENTWISE_BLOCK = 16


def elementwise_tactics(
    blocks: list[int],
    warps: tuple[int, ...] = (1, 2, 4, 8, 16),
    per_thread: tuple[int, int] = (4, 16),
) -> list[dict[str, int]]:
    """``{"block", "warps"}`` tactics whose elements per thread lie within ``per_thread``.

    Fewer than ~4 elements per thread wastes threads on masked lanes; more than ~16 spills
    registers or serialises loads, so those pairs are pruned rather than timed.
    """
    low, high = per_thread
    out = []
    for block in blocks:
        for w in warps:
            if low <= block / (32 * w) <= high:
                out.append({"block": block, "warps": w})
    if not out and blocks:
        out.append({"block": min(blocks), "warps": 1})  # tiny rows: one warp still works
    return out


def check_block_tactic(owner: str, tactic: Any) -> None:
    """Checks an elementwise ``{"block", "warps"}`` tactic (power-of-two values).

    Raises:
        ConfigError: Not such a dict, or a value that is not a power of two in range.
    """
    ok = isinstance(tactic, dict) and set(tactic) == {"block", "warps"}
    if ok:
        block, warps = tactic["block"], tactic["warps"]
        ok = (
            all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0
                for v in (block, warps)
            )
            and warps <= 32
            and block >= MIN_ELEMENTWISE_BLOCK
        )
    if not ok:
        raise ConfigError(
            f"{owner}: a tactic is {{'block': power of two >= 16, 'warps': power of two <= 32}} "
            f"or -1, got {tactic!r}; pick one from get_valid_tactics."
        )


def input_signature(inputs: list[Any]) -> tuple[Any, ...]:
    """What a compiled Triton kernel depends on: each input's shape, dtype, strides and device.

    Shapes are included because Triton specialises integer arguments (``== 1``, divisible by 16),
    so a different bucket may need a different binary.
    """
    sig: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            sig.append((tuple(x.shape), str(x.dtype), tuple(x.stride()), str(x.device)))
        else:
            sig.append(type(x).__name__)
    return tuple(sig)
