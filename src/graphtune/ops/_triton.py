"""Optional Triton: availability checks, and the base class of every Triton runner.

Triton is an optional dependency (``pip install graphtune[triton]``). Importing
:mod:`graphtune.ops` never imports Triton; the kernels module is imported the first time a Triton
runner is built or used, so a machine without Triton gets torch-only runners and every op still
works through its torch fallback tactic.

:class:`TritonRunner` adds ahead-of-time compilation to :class:`TunableRunner`: the tuner asks for
valid tactics of every profile first and calls ``prepare`` before timing; the first ``prepare`` of
a profile compiles *all* of that profile's tactics at once, in parallel threads (Triton's compile
spends most of its time in LLVM and in the ``ptxas`` subprocess, which release the GIL), so the
timed rounds never include compilation.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import torch

from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.errors import ConfigError
from graphtune.ops._pdl import pdl_meta

logger = logging.getLogger(__name__)


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


def kernels() -> ModuleType:
    """The module of Triton kernels (imported on first use; needs Triton)."""
    require_triton("graphtune's Triton kernels")
    from graphtune.ops import _kernels

    return _kernels


def gemv_kernels() -> ModuleType:
    """The module of the skinny-``M`` GEMV kernel (imported on first use; needs Triton).

    A module of its own beside :func:`kernels`' so each kernel file stays small; loaded lazily for
    the same reason (importing :mod:`graphtune.ops` never imports Triton).
    """
    require_triton("graphtune's Triton GEMV kernel")
    from graphtune.ops import _gemv_kernels

    return _gemv_kernels


@functools.lru_cache(maxsize=1)
def kernels_interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter module cannot interpret
        return False
    return isinstance(kernels().gemm_kernel, InterpretedFunction)


def device_supported(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or the CPU under the interpreter."""
    if not triton_available():
        return False
    return device.type == "cuda" or (device.type == "cpu" and kernels_interpreted())


def run_kernel(
    kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], meta: dict[str, Any], warmup: bool
) -> None:
    """Launches ``kernel[grid](*args, **meta)``, or with ``warmup`` only compiles it.

    A kernel that declares ``USE_PDL`` gets it (and a PDL launch) from
    :func:`graphtune.ops._pdl.pdl_meta`.
    """
    meta = pdl_meta(kernel, args, meta)
    if warmup:
        kernel.warmup(*args, grid=grid, **meta)
    else:
        kernel[grid](*args, **meta)


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
            and block >= 16
        )
    if not ok:
        raise ConfigError(
            f"{owner}: a tactic is {{'block': power of two >= 16, 'warps': power of two <= 32}} "
            f"or -1, got {tactic!r}; pick one from get_valid_tactics."
        )


def tactic_text(tactic: Any) -> str:
    """Canonical JSON of a tactic (a dict key that survives a JSON round trip)."""
    return json.dumps(tactic, sort_keys=True, separators=(",", ":"))


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


def default_compile_workers() -> int:
    """Threads used to compile candidate tactics in parallel (``min(8, cpu_count)``)."""
    return max(1, min(8, os.cpu_count() or 1))


def triton_runners() -> list[TritonRunner]:
    """Every :class:`TritonRunner` alive in this process (reports sum their compile time)."""
    return list(_LIVE_RUNNERS)


class TritonRunner(TunableRunner):
    """Base of the Triton runners: valid-tactic bookkeeping and parallel ahead-of-time compile.

    Subclasses implement :meth:`tactics_for` (the pruned tactic list, fallback excluded) and
    :meth:`launch` (``warmup=True`` compiles without running). Tactic ``-1`` runs the op's torch
    path, so the runner honours the "fallback works on every shape" contract without Triton.

    Args:
        compile_workers: Threads for ahead-of-time compilation; ``None`` picks
            :func:`default_compile_workers`; ``1`` compiles sequentially.

    Attributes:
        compile_seconds: Wall time spent in :meth:`precompile`, summed.
        compiled: Number of (profile, tactic) binaries compiled ahead of time.
    """

    def __init__(self, *, compile_workers: int | None = None) -> None:
        if compile_workers is not None and (
            isinstance(compile_workers, bool)
            or not isinstance(compile_workers, int)
            or compile_workers < 1
        ):
            raise ConfigError(
                f"compile_workers must be an int >= 1 or None, got {compile_workers!r}."
            )
        self.compile_workers = compile_workers or default_compile_workers()
        self.compile_seconds = 0.0
        self.compiled = 0
        self._planned: dict[tuple[Any, ...], list[Any]] = {}
        self._compile_errors: dict[tuple[tuple[Any, ...], str], Exception] = {}
        self._prepared: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        _LIVE_RUNNERS.add(self)

    def __getstate__(self) -> dict[str, Any]:
        # Picklable for AutoTuner(isolation="subprocess"): the worker compiles on its own.
        state = dict(self.__dict__)
        state.update(_lock=None, _planned={}, _compile_errors={}, _prepared=set())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- subclass hooks ---------------------------------------------------------------------

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """Triton tactics valid for these inputs (the fallback ``-1`` is added by the base)."""
        raise NotImplementedError

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the Triton kernel(s) for ``tactic``."""
        raise NotImplementedError

    def torch_forward(self, inputs: list[Any]) -> Any:
        """The op's unfused torch path, run for tactic ``-1``."""
        raise NotImplementedError

    # -- TunableRunner ------------------------------------------------------------------------

    def get_valid_tactics(self, inputs: list[Any], profile: Any) -> list[Any]:
        """The pruned Triton tactics for this profile (empty without Triton)."""
        if not triton_available() or not self.supports(inputs):
            return []
        tactics = list(self.tactics_for(inputs))
        with self._lock:
            self._planned[input_signature(inputs)] = tactics
        return tactics

    def supports(self, inputs: list[Any]) -> bool:
        """Whether Triton kernels can run on these inputs at all (device, dtypes)."""
        return True

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC) -> Any:
        """Runs tactic ``-1`` with torch, any other tactic with Triton."""
        if tactic == FALLBACK_TACTIC:
            return self.torch_forward(inputs)
        return self.launch(inputs, tactic)

    def prepare(self, inputs: list[Any], tactic: Any) -> None:
        """Compiles every planned tactic of this profile on first use; re-raises its error."""
        if tactic == FALLBACK_TACTIC:
            return
        sig = input_signature(inputs)
        if sig not in self._prepared:
            planned = self._planned.get(sig) or [tactic]
            self.precompile(inputs, planned)
            self._prepared.add(sig)
        error = self._compile_errors.get((sig, tactic_text(tactic)))
        if error is not None:
            raise error

    def precompile(
        self, inputs: list[Any], tactics: list[Any], workers: int | None = None
    ) -> dict[str, str | None]:
        """Compiles ``tactics`` for ``inputs`` ahead of timing, in parallel threads.

        Args:
            inputs: Inputs of the profile (their shapes, dtypes and strides pick the binary).
            tactics: Tactics to compile (``-1`` is skipped: it is torch).
            workers: Threads; default ``compile_workers``.

        Returns:
            For each tactic (as canonical JSON), ``None`` when it compiled, else the error text.
            Errors are also kept and re-raised by :meth:`prepare` so the tuner records the
            tactic as failed.
        """
        todo = [t for t in tactics if t != FALLBACK_TACTIC]
        if not todo:
            return {}
        sig = input_signature(inputs)
        device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), None)
        workers = max(1, min(workers or self.compile_workers, len(todo)))

        def compile_one(tactic: Any) -> Exception | None:
            try:
                if device is not None and device.type == "cuda":
                    # A worker thread starts on device 0; compile for the inputs' device.
                    with torch.cuda.device(device):
                        self.launch(inputs, tactic, warmup=True)
                else:
                    self.launch(inputs, tactic, warmup=True)
            except Exception as exc:  # a config that fails to compile is a failed tactic
                return exc
            return None

        start = time.perf_counter()
        if workers == 1:
            errors = [compile_one(t) for t in todo]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="graphtune-jit") as ex:
                errors = list(ex.map(compile_one, todo))
        elapsed = time.perf_counter() - start
        report: dict[str, str | None] = {}
        with self._lock:
            self.compile_seconds += elapsed
            for tactic, error in zip(todo, errors, strict=True):
                text = tactic_text(tactic)
                report[text] = None if error is None else f"{type(error).__name__}: {error}"
                if error is None:
                    self.compiled += 1
                    self._compile_errors.pop((sig, text), None)
                else:
                    self._compile_errors[(sig, text)] = error
        failed = sum(1 for v in report.values() if v is not None)
        logger.debug(
            "%s: compiled %d tactics in %.2f s with %d threads (%d failed)",
            type(self).__name__,
            len(todo),
            elapsed,
            workers,
            failed,
        )
        return report


# Weak: a runner that nothing else holds is gone from the list (the op modules keep theirs).
_LIVE_RUNNERS: weakref.WeakSet[TritonRunner] = weakref.WeakSet()
