"""What every fused op shares: its first runner runs the unfused sequence of tunable ops.

A fused op's runner 0 (tactic ``-1``, the untuned fallback) is the unfused path: the existing ops
of :mod:`graphtune.ops` called one after the other, each through the *same* tuner, so each asks
for its own pick (and, inside :func:`graphtune.autotune`, is tuned on a miss). The tuner then
compares, per shape bucket, the fused kernel's tactics against the unfused path as it would run.

Tuning nests: timing the fused op's fallback calls the inner ops, whose first call misses the
cache and tunes them on the same (synthetic) shapes. Every timer warms a candidate up eagerly
before it measures (the graph timer before it captures), so the inner tuning happens during the
warm-up, never inside a capture, and the fallback is measured with the inner picks. The tuner's
lock is re-entrant, so the nested ``choose_one`` runs on the same thread.

The runner holds its tuner through a weak reference (the runner tuples are cached per tuner, and a
strong one would keep every tuner alive); a runner sent to a worker process
(``isolation="subprocess"``) arrives without it and asks the worker's default tuner.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from graphtune.autotuner.config import DynamicTensorSpec, TuningConfig
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.ops._triton import triton_available
from graphtune.ops.rmsnorm import fused_add_rms_norm

_RUNNERS: weakref.WeakKeyDictionary[AutoTuner, dict[tuple[Any, ...], tuple[TunableRunner, ...]]]
_RUNNERS = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def runners_for(
    tuner: AutoTuner, key: tuple[Any, ...], build: Callable[[], tuple[TunableRunner, ...]]
) -> tuple[TunableRunner, ...]:
    """The runner tuple of one fused op layout for ``tuner``, built once.

    The same objects come back for every call, so the tuner's per-call memo (keyed by the
    runner objects) hits.
    """
    with _LOCK:
        per_tuner = _RUNNERS.setdefault(tuner, {})
        found = per_tuner.get(key)
        if found is None:
            found = per_tuner[key] = build()
        return found


def unfused_then_triton(
    tuner: AutoTuner | None,
    op: str,
    unfused: Callable[[AutoTuner, int | None, bool], TunableRunner],
    triton: Callable[[AutoTuner, int | None], tuple[TunableRunner, ...]],
    max_m: int | None,
    cold_l2: bool,
) -> tuple[TunableRunner, ...]:
    """The runners of a fused op for one tuner, built once (:func:`runners_for`): the unfused
    path first (the fallback), then ``triton(tuner, max_m)``'s runners when Triton is
    importable."""
    tuner = resolve(tuner)

    def build() -> tuple[TunableRunner, ...]:
        first = unfused(tuner, max_m, cold_l2)
        return (first, *triton(tuner, max_m)) if triton_available() else (first,)

    return runners_for(tuner, (op, max_m, cold_l2), build)


@functools.lru_cache(maxsize=16)
def rows_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """The rows of input 0 bucketed (the fused ops whose only dynamic dimension is there);
    ``cold_l2`` as for ``graphtune.ops.gemm.gemm_config``."""
    return TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=max_m, cold_l2=cold_l2)


class InnerOpsTuner:
    """Mixin of a fused op's runners that call other tunable ops: the tuner those ops ask.

    The tuner is held through a weak reference (see the module docstring) and dropped when the
    runner is pickled; ``max_m`` is passed to every inner op.
    """

    # Neither is part of the cache identity: a bucket's pick does not depend on the largest
    # bucket of the step that tuned it (a cache tuned up to 128 rows serves a step of 8), nor on
    # whether its GEMM was timed with cold L2 (the GEMM's keys do not depend on it either).
    identity_excludes: ClassVar[frozenset[str]] = frozenset({"max_m", "cold_l2"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A runner that mixes this in with another base (a Triton runner) excludes both sets.
        super().__init_subclass__(**kwargs)
        bases = cls.__mro__
        cls.identity_excludes = frozenset().union(
            *(getattr(base, "identity_excludes", frozenset()) for base in bases)
        )

    def _hold_tuner(self, tuner: AutoTuner | None, max_m: int | None, cold_l2: bool) -> None:
        # Private, so not part of the cache identity: the picks do not depend on which tuner
        # the inner ops ask, and a weak reference has no stable text.
        self._tuner_ref = weakref.ref(tuner) if tuner is not None else None
        self.max_m = max_m
        self.cold_l2 = cold_l2

    @property
    def tuner(self) -> AutoTuner:
        """The inner ops' tuner (the process default when none was given or it is gone)."""
        tuner = self._tuner_ref() if self._tuner_ref is not None else None
        return tuner if tuner is not None else get_tuner()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())  # type: ignore[misc]
        state["_tuner_ref"] = None  # a weak reference cannot be pickled (subprocess isolation)
        return state


class NormPlacement:
    """Mixin of a fused GEMV runner whose op normalises its input rows: where the RMSNorm runs.

    By default the kernel normalises in a prologue (kernel ``NORM`` 1); a subclass with
    :attr:`norm_in_loop` applies it in the main loop (``NORM`` 2), and :class:`AfterNormOp` runs
    the tunable RMSNorm op first and the kernel without a norm. Class constants, so the class
    name tells the forms apart in cache keys.
    """

    norm_in_loop: ClassVar[bool] = False

    def kernel_rows(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, warmup: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows the kernel reads and the weight of its RMSNorm (``None``: no norm)."""
        return x, norm_weight


class AfterNormOp(InnerOpsTuner, NormPlacement):
    """Mixin: the tunable RMSNorm op (through the held tuner), then the kernel without a norm.

    The prologue makes every program read and reduce its whole input row before its first
    product; here one small kernel normalises each row once.
    """

    def kernel_rows(
        self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, warmup: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``rms_norm(x)`` through the tuner's pick (a compile-only launch skips it: the
        kernel's binary depends only on the rows' layout); no norm in the kernel."""
        if warmup:
            return x, None
        return fused_add_rms_norm(x, norm_weight, eps, tuner=self.tuner, max_m=self.max_m)[0], None


class UnfusedRunner(InnerOpsTuner, TunableRunner):
    """Base of a fused op's first runner: only the fallback tactic, which runs the unfused ops.

    Args:
        tuner: The tuner the inner ops ask (weakly held; ``None``: the process default).
        max_m: ``max_m`` passed to every inner op.
        cold_l2: ``cold_l2`` passed to the inner GEMM (``graphtune.ops.gemm.gemm``).
    """

    def __init__(
        self, tuner: AutoTuner | None = None, max_m: int | None = None, cold_l2: bool = False
    ) -> None:
        self._hold_tuner(tuner, max_m, cold_l2)

    def unfused(self, inputs: list[Any]) -> Any:
        """The unfused sequence of tunable ops."""
        raise NotImplementedError

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Runs :meth:`unfused` (the only tactic is ``-1``)."""
        return self.unfused(inputs)


def resolve(tuner: AutoTuner | None) -> AutoTuner:
    """``tuner``, or the process default."""
    return tuner if tuner is not None else get_tuner()
