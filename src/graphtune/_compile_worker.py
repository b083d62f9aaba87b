"""What a Triton compile worker process runs (see :mod:`graphtune.ops._compile_pool`).

This module sits outside :mod:`graphtune.ops` on purpose. A worker unpickles the functions it
runs and the jobs it gets by importing the modules that define them, and importing anything
under ``graphtune.ops`` runs that package's ``__init__``, which imports torch and every op: on
a 16-core host, 16 workers importing torch at once took about 6 s before the first compile.
Here a worker imports only this module, ``graphtune``'s own light ``__init__``, and Triton.

The kernel modules (``graphtune.ops.gemm._gemv_kernels`` and the like) import nothing but
Triton, :mod:`graphtune._rope_jit` and :mod:`graphtune._split_k_jit` (device functions several of
them share, which import nothing but Triton either), so :func:`compile_job` loads each one from
its file under its own dotted name, without running the ``__init__`` of the packages above it.
The source, and so Triton's cache key for every kernel in it, is the same as in the tuning
process, which then finds each binary in the on-disk cache.

A job may also build the kernel's host launcher (:func:`build_launcher`): Triton up to 3.6
generates a C launcher per kernel signature and builds it with the C compiler when a kernel is
first loaded: on an empty cache, a few tenths of a second of the tuning process's time per
signature, while that process has the GPU waiting. Built here, it lands in the same on-disk
cache, and the first load only reads it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class CompileJob:
    """What Triton would compile for one launch (the arguments of ``triton.compile``).

    Attributes:
        module: Module of the ``@triton.jit`` function.
        qualname: Its name in that module.
        signature: Argument name -> Triton type, as the JIT computed it.
        constants: The constexpr values by argument path.
        attrs: The specialisation attributes (divisibility) by argument path.
        options: The compile options (``num_warps``, ``num_stages``, ...), parsed by the backend.
        target: The ``triton.backends.compiler.GPUTarget``.
        ident: Text that is equal for two jobs exactly when they compile the same binary.
        path: The module's source file; ``None`` makes the worker import the module by name
            (with its packages' ``__init__``).
        launcher: Also build the kernel's host launcher (:func:`build_launcher`); the pool asks
            it of the first job of each signature.
    """

    module: str
    qualname: str
    signature: dict[str, Any]
    constants: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]
    target: Any
    ident: str
    path: str | None = None
    launcher: bool = False


@dataclass(frozen=True)
class JobResult:
    """What one worker call did, with its wall-clock span (``time.time()``, comparable across
    the processes of one host).

    Attributes:
        kind: ``"compile"`` (:func:`compile_job`) or ``"warm-up"`` (:func:`warm_up`).
        name: The compiled kernel's name (empty for a warm-up).
        error: The error text, or ``None`` when it worked.
        started: When the worker began it.
        finished: When it was done.
        pid: The worker process.
        launcher: What became of the host launcher the job asked for: ``None`` (not asked),
            ``"built"``, ``"not needed"`` (this Triton builds none) or ``"failed: <error>"``
            (the tuning process then builds it at the first load, as without workers).
    """

    kind: str
    name: str
    error: str | None
    started: float
    finished: float
    pid: int
    launcher: str | None = None


def triton_knobs() -> Any:
    """``triton.knobs``, or ``None`` without Triton (or in a Triton without knobs)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "knobs", None)


#: Niceness a worker adds to its own: it compiles while the tuning process times the ops whose
#: binaries are ready, and that process's host work (captures, launches) must not wait for a CPU.
WORKER_NICENESS = 10


def init_worker(cache_dir: str | None) -> None:
    """Process initializer: lower the worker's CPU priority, and compile into the tuning
    process's Triton cache folder."""
    try:
        os.nice(WORKER_NICENESS)
    except OSError:  # not permitted here: the worker runs at its parent's priority
        pass
    knobs = triton_knobs()
    if cache_dir and knobs is not None:
        knobs.cache.dir = cache_dir


def warm_up() -> JobResult:
    """The one-time costs of a worker's first compile (imports, Triton's hash of itself)."""
    started = time.time()
    import triton.compiler  # noqa: F401

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # kept elsewhere by this Triton: its first compile pays it instead
        pass
    else:
        triton_key()
    return JobResult("warm-up", "", None, started, time.time(), os.getpid())


def kernel_module(name: str, path: str | None) -> ModuleType:
    """The module ``name``: already loaded, else executed from ``path`` alone (its parent
    packages are not imported), else imported the usual way when there is no path."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path) if path else None
    if spec is None or spec.loader is None:
        return importlib.import_module(name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def compile_job(job: CompileJob) -> JobResult:
    """Compiles ``job`` into Triton's on-disk cache; its error text is ``None`` when it worked."""
    started = time.time()
    error: str | None = None
    try:
        import triton
        from triton.compiler import ASTSource

        function: Any = kernel_module(job.module, job.path)
        for part in job.qualname.split("."):
            function = getattr(function, part)
        source = ASTSource(function, job.signature, job.constants, job.attrs)
        kernel = triton.compile(source, target=job.target, options=dict(job.options))
    except Exception as exc:  # reported; the tuning process compiles it again and raises there
        error = f"{type(exc).__name__}: {exc}"
        kernel = None
    launcher = None
    if job.launcher and kernel is not None:
        launcher = build_launcher(kernel)
    return JobResult("compile", job.qualname, error, started, time.time(), os.getpid(), launcher)


def build_launcher(kernel: Any, launcher_cls: Any = None) -> str:
    """Builds the host launcher of ``kernel`` (a ``CompiledKernel``) into Triton's on-disk cache
    the way its first load would; returns ``"built"``, ``"not needed"`` or ``"failed: ..."``.

    Only where the launcher's constructor compiles C (``compile_module_from_src``, Triton up to
    3.6): it then needs nothing but the kernel's signature, the C compiler and ``libcuda``'s
    folder, no GPU and no torch. A constructor that compiles nothing (a generic launcher, which
    may ask the active driver and so import torch) is not called.

    Args:
        launcher_cls: The launcher class; default Triton's ``CudaLauncher`` (tests pass others).
    """
    try:
        if launcher_cls is None:
            from triton.backends.nvidia.driver import CudaLauncher

            launcher_cls = CudaLauncher
        if "compile_module_from_src" not in launcher_cls.__init__.__code__.co_names:
            return "not needed"
        launcher_cls(kernel.src, kernel.metadata)
    except Exception as exc:  # the tuning process builds it at the first load instead
        return f"failed: {type(exc).__name__}: {exc}"
    return "built"
