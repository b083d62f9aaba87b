"""Tunable fused rotary embedding of q and k plus the K/V cache write of one decode token.

Semantics are those of ``engine/step.py`` for one layer::

    q, k, v = qkv.split((heads * D, kv_heads * D, kv_heads * D), dim=-1)
    cos_b, sin_b = cos[positions][:, None], sin[positions][:, None]
    q = apply_rope(q.view(B, heads, D), cos_b, sin_b)          # rotate-half
    k = apply_rope(k.view(B, kv_heads, D), cos_b, sin_b)
    k_cache.index_copy_(0, write_rows, k.reshape(-1, D))      # flattened cache rows
    v_cache.index_copy_(0, write_rows, v.reshape(-1, D))
    return q

with ``k_cache``/``v_cache`` the flattened ``[slots * kv_heads * max_seq, D]`` views of one
layer's cache and ``write_rows[b * kv_heads + h] = (slot_b * kv_heads + h) * max_seq + pos_b``.
That torch code is the fallback tactic ``-1``. The Triton kernel does it in one launch; tactics
``{"heads", "warps"}`` choose how many heads one program handles. With ``head_norm`` (Qwen3's
per-head q/k RMSNorm weights, ``[heads + kv_heads, D]``) the q and k heads are normalised first:
the fallback runs :func:`graphtune.ops.rmsnorm.head_rms_norm` (out of place: like the kernel,
it writes only the caches and ``q``), the kernel normalises in registers (same roundings), which
saves the two torch kernels of that norm.

Inputs of the op, in order: ``qkv, positions, cos, sin, k_cache, v_cache, write_rows,
head_norm`` (a tensor or ``None``), ``head_norm_eps`` (a float); then, outside the tuning key,
the step's :class:`RopeRows`.

Tuning keys: the tuning config (:mod:`graphtune.ops.rope_config`) pins the table and cache rows
to canonical sizes, so a tuned pick is reused for any cache size.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune import env
from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import TuningConfig, next_power_of_two
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner, preferred_first
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops._rope_inputs import CheckedRope, check_rope_indices, checked_rope_inputs
from graphtune.ops._triton import (
    KERNELS_SOURCES,
    device_supported,
    kernels,
    run_kernel,
    triton_available,
)
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.registry import register_op, runner_extras
from graphtune.ops.rmsnorm import check_eps, head_rms_norm
from graphtune.ops.rope_config import rope_config

OP_NAME = "graphtune.rope_kv_cache"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed_sin: bool) -> torch.Tensor:
    """Rotary embedding of the last dimension of ``x`` (Hugging Face's rotate-half convention).

    With ``signed_sin`` the first half of ``sin`` is already negated, which folds rotate-half's
    sign into the table: one ``flip`` of a ``[2, half]`` view and an ``addcmul``, three kernels
    instead of five. The engine's ``apply_rope`` / ``apply_rope_signed`` call this.
    """
    half = x.shape[-1] // 2
    if signed_sin:
        swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, sin)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RopeRows:
    """The cos/sin rows of one step's positions, gathered on first use and shared by its layers.

    The torch fallback of :func:`rope_kv_cache` multiplies by ``cos[positions]`` and
    ``sin[positions]``; gathering them once per step instead of once per layer saves two kernels
    per layer. The Triton kernel reads the tables by position itself and never asks, so a tuned
    step gathers nothing. Make one per step call: a step's positions are its own.

    Args:
        positions: ``[B]`` int64 position of each row.
        cos: ``[max_seq, D]`` table.
        sin: ``[max_seq, D]`` table (first half negated when ``signed_sin``).
        signed_sin: Whether ``sin`` is the signed table (``engine.model.rope_tables``).
    """

    __slots__ = ("positions", "cos", "sin", "signed_sin", "_rows")

    def __init__(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, signed_sin: bool
    ) -> None:
        self.positions = positions
        self.cos = cos
        self.sin = sin
        self.signed_sin = signed_sin
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos[positions], sin[positions])`` as ``[B, 1, D]`` each (gathered on first call)."""
        if self._rows is None:
            self._rows = (
                self.cos.index_select(0, self.positions)[:, None, :],
                self.sin.index_select(0, self.positions)[:, None, :],
            )
        return self._rows


def torch_rope_kv_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_rows: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    signed_sin: bool = False,
    rows: RopeRows | None = None,
    head_norm: torch.Tensor | None = None,
    head_norm_eps: float = 1e-6,
) -> torch.Tensor:
    """The unfused reference (the engine's decode-step code for one layer); returns ``q``.

    Queries and keys are rotated in one pass, viewed as ``[B, heads + kv_heads, D]`` (they are
    adjacent in ``qkv``). With ``signed_sin`` the ``sin`` table's first half holds ``-sin``
    (``engine.model.rope_tables(..., signed_sin=True)``) and the rotation is
    ``apply_rope_signed``'s. ``rows`` supplies ``cos[positions]`` / ``sin[positions]`` gathered
    once per step (:class:`RopeRows`); without it they are gathered here. ``head_norm``: the
    q/k heads are normalised first (``head_rms_norm``, out of place: ``qkv`` is only read).

    Raises:
        InputError: A position or write row is out of range (the CPU's index ops check them;
            CUDA's assert on the device instead).
    """
    batch, dim = qkv.shape[0], cos.shape[-1]
    qk_width = (num_heads + num_kv_heads) * dim
    try:  # the CPU's index ops check positions and write_rows (CUDA's assert on the device)
        cos_b, sin_b = (
            rows.gathered()
            if rows is not None
            else (
                cos.index_select(0, positions)[:, None, :],
                sin.index_select(0, positions)[:, None, :],
            )
        )
        if head_norm is not None:
            heads = head_rms_norm(qkv, head_norm, head_norm_eps)
        else:
            heads = qkv[:, :qk_width].reshape(batch, num_heads + num_kv_heads, dim)
        qk = rotate(heads, cos_b, sin_b, signed_sin)
        k_cache.index_copy_(0, write_rows, qk[:, num_heads:].reshape(-1, dim))
        v_cache.index_copy_(0, write_rows, qkv[:, qk_width:].reshape(-1, dim))
    except IndexError as error:
        raise InputError(
            f"rope_kv_cache: positions must index rows of cos/sin and write_rows rows of the "
            f"caches ({error}); size the tables and caches for every position and slot."
        ) from error
    return qk[:, :num_heads]


class _RopeRunnerMixin:
    num_heads: int
    num_kv_heads: int
    signed_sin: bool
    _debug: bool

    def _init_heads(self, num_heads: int, num_kv_heads: int, signed_sin: bool) -> None:
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"rope runner: {name} must be an int >= 1, got {value!r}.")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.signed_sin = bool(signed_sin)
        # GRAPHTUNE_DEBUG, read once here (the runners are built once per head layout): per call
        # it would cost the hot path a microsecond. Private: not part of the cache identity.
        self._debug = env.debug_checks()

    def cache_key_extras(self) -> tuple[Any, ...]:
        """Head counts are not implied by the qkv width, so they are part of the identity."""
        return (self.num_heads, self.num_kv_heads, self.signed_sin)

    def _checked(self, inputs: list[Any]) -> CheckedRope:
        """:func:`~graphtune.ops._rope_inputs.checked_rope_inputs` for these heads: once per
        call, whichever path then runs."""
        return checked_rope_inputs(inputs, self.num_heads, self.num_kv_heads)

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code (with the step's gathered rows when they are given)."""
        return self._torch_checked(inputs, self._checked(inputs))

    def _torch_checked(self, inputs: list[Any], checked: CheckedRope) -> torch.Tensor:
        tensors, norm, eps = checked
        if self._debug:
            check_rope_indices(tensors)
        return torch_rope_kv_cache(
            *tensors,
            self.num_heads,
            self.num_kv_heads,
            self.signed_sin,
            inputs[9] if len(inputs) > 9 else None,
            head_norm=norm,
            head_norm_eps=eps,
        )


class TorchRopeRunner(_RopeRunnerMixin, TunableRunner):
    """The unfused torch code; only the fallback tactic."""

    def __init__(self, num_heads: int, num_kv_heads: int, signed_sin: bool = False) -> None:
        self._init_heads(num_heads, num_kv_heads, signed_sin)

    def forward(
        self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any
    ) -> torch.Tensor:
        """Returns ``q`` rotated; writes k (rotated) and v into the caches."""
        return self.torch_forward(inputs)


#: The prior, listed first so that near-ties go to it: within 0.3% of the fastest in-graph time
#: at every decode bucket on an H200 (``benchmarks/results/tuning-h200.json``).
PREFERRED_ROPE_TACTIC = {"heads": 8, "warps": 4}


def rope_tactics(num_heads: int, num_kv_heads: int, head_dim: int) -> list[dict[str, int]]:
    """``{"heads", "warps"}`` tactics: heads per program up to 16 (and to the head count), and
    warps only while every thread still has at least one element of the ``heads x D/2`` tile.
    :data:`PREFERRED_ROPE_TACTIC` comes first when valid, then the rest in size order."""
    half_block = next_power_of_two(head_dim // 2)
    limit = next_power_of_two(num_heads + num_kv_heads)
    out = []
    for heads in (1, 2, 4, 8, 16):
        if heads > limit:
            continue
        for warps in (1, 2, 4):
            if warps == 1 or 32 * warps <= heads * half_block:
                out.append({"heads": heads, "warps": warps})
    return preferred_first(out, PREFERRED_ROPE_TACTIC)


def _check_rope_tactic(tactic: Any) -> None:
    ok = (
        isinstance(tactic, dict)
        and set(tactic) == {"heads", "warps"}
        and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0
            for v in tactic.values()
        )
    )
    if not ok:
        raise ConfigError(
            "TritonRopeRunner: a tactic is {'heads': power of two, 'warps': power of two} or -1, "
            f"got {tactic!r}; pick one from get_valid_tactics."
        )


class TritonRopeRunner(_RopeRunnerMixin, TritonRunner):
    """Rotary q/k and the K/V cache write in one Triton kernel."""

    source_modules = KERNELS_SOURCES

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        signed_sin: bool = False,
        *,
        compile_workers: int | None = None,
    ) -> None:
        TritonRunner.__init__(self, compile_workers=compile_workers)
        self._init_heads(num_heads, num_kv_heads, signed_sin)

    def supports(self, inputs: list[Any]) -> bool:
        """One float dtype for qkv, tables and caches; unit last strides; contiguous positions,
        write rows and head norm (the kernel reads element ``i`` at offset ``i``); a Triton
        device."""
        return self._kernel_takes(self._checked(inputs))

    def _kernel_takes(self, checked: CheckedRope) -> bool:
        (qkv, positions, cos, sin, k_cache, v_cache, rows), norm, _ = checked
        tensors = (qkv, cos, sin, k_cache, v_cache)
        if qkv.dtype not in _DTYPES or any(t.dtype != qkv.dtype for t in tensors):
            return False
        if any(t.stride(-1) != 1 for t in tensors) or positions.dtype.is_floating_point:
            return False
        if not (positions.is_contiguous() and rows.is_contiguous()):
            return False
        if norm is not None and not norm.is_contiguous():
            return False
        return not rows.dtype.is_floating_point and device_supported(qkv.device)

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """As :meth:`TritonRunner.forward` (torch for tactic ``-1`` or inputs the kernel cannot
        take), with the inputs checked once for both the test and the launch."""
        if tactic == FALLBACK_TACTIC:
            return self.torch_forward(inputs)
        checked = self._checked(inputs)
        if not self._kernel_takes(checked):
            return self._torch_checked(inputs, checked)
        return self._launch_checked(checked, tactic, warmup=False)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`rope_tactics`."""
        return list(rope_tactics(self.num_heads, self.num_kv_heads, inputs[2].shape[-1]))

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel; returns ``q [B, heads, D]``."""
        return self._launch_checked(self._checked(inputs), tactic, warmup=warmup)

    def _launch_checked(self, checked: CheckedRope, tactic: Any, *, warmup: bool) -> torch.Tensor:
        tensors, norm, eps = checked
        qkv, positions, cos, sin, k_cache, v_cache, rows = tensors
        _check_rope_tactic(tactic)
        if self._debug and not warmup:  # the kernel would read and write out of bounds
            check_rope_indices(tensors)
        batch, dim = qkv.shape[0], cos.shape[-1]
        q_out = torch.empty((batch, self.num_heads, dim), device=qkv.device, dtype=qkv.dtype)
        if batch == 0:
            return q_out
        per_prog = tactic["heads"]
        total = self.num_heads + self.num_kv_heads
        grid = (batch, (total + per_prog - 1) // per_prog)
        args = (
            qkv,
            positions,
            cos,
            sin,
            rows,
            q_out,
            k_cache,
            v_cache,
            norm if norm is not None else qkv,  # unread without HAS_NORM
            eps,
            qkv.stride(0),
            cos.stride(0),
            sin.stride(0),
            k_cache.stride(0),
            v_cache.stride(0),
        )
        meta = dict(
            NUM_HEADS=self.num_heads,
            NUM_KV=self.num_kv_heads,
            HEAD_DIM=dim,
            HALF=dim // 2,
            HALF_BLOCK=next_power_of_two(dim // 2),
            HEADS_PER_PROG=per_prog,
            SIGNED_SIN=self.signed_sin,
            HAS_NORM=norm is not None,
            num_warps=tactic["warps"],
        )
        run_kernel(kernels().rope_kv_kernel, grid, args, meta, warmup)
        return q_out


@functools.lru_cache(maxsize=16)
def rope_runners(
    num_heads: int, num_kv_heads: int, signed_sin: bool = False
) -> tuple[TunableRunner, ...]:
    """Runners for one head layout: torch first (fallback), Triton when importable."""
    runners: list[TunableRunner] = [TorchRopeRunner(num_heads, num_kv_heads, signed_sin)]
    if triton_available():
        runners.append(TritonRopeRunner(num_heads, num_kv_heads, signed_sin))
    return tuple(runners)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    num_heads, num_kv_heads, signed_sin = runner_extras(record.runners[0])
    runners = rope_runners(int(num_heads), int(num_kv_heads), bool(signed_sin))
    return runners, rope_config(int(num_kv_heads), record.config["max_value"])


register_op(OP_NAME, _rebuild)


def rope_kv_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_rows: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    signed_sin: bool = False,
    rows: RopeRows | None = None,
    head_norm: torch.Tensor | None = None,
    head_norm_eps: float = 1e-6,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
) -> torch.Tensor:
    """Rotary q/k + K/V cache write of one decode token per row, through the tuner's pick.

    Args:
        qkv: ``[B, (num_heads + 2 * num_kv_heads) * D]`` fused projection output (q, k, v).
        positions: ``[B]`` int64 position of each token (row of ``cos``/``sin``).
        cos: ``[max_seq, D]`` table (``engine.model.rope_tables``).
        sin: ``[max_seq, D]`` table.
        k_cache: ``[rows, D]`` flattened key cache of the layer (written in place).
        v_cache: ``[rows, D]`` flattened value cache of the layer (written in place).
        write_rows: ``[B * num_kv_heads]`` int64 cache row of each (token, kv head), each in
            ``[0, rows)``, as ``positions`` must be in ``[0, max_seq)``: the Triton kernel does
            not check them (a host synchronisation; ``GRAPHTUNE_DEBUG=1`` does) and would
            write another tensor's memory.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        signed_sin: ``sin``'s first half holds ``-sin`` (the engine's ``signed_sin`` tables);
            the rotation then rounds as ``engine.model.apply_rope_signed``.
        rows: The step's :class:`RopeRows` of ``positions`` (the torch fallback reuses its
            gathered rows instead of gathering per call). Not part of the tuning key: which
            kernel is fastest does not depend on it.
        head_norm: ``[num_heads + num_kv_heads, D]`` weight rows of a per-head q/k RMSNorm
            applied before the rotation (Qwen3; :func:`graphtune.ops.rmsnorm.head_norm_weights`);
            the fallback normalises a copy of ``qkv``'s q/k heads, the kernel in registers.
        head_norm_eps: That norm's epsilon (a finite number >= 0, else ``ConfigError``).
        tuner: Tuner to ask; the process default when ``None``.
        max_m: Largest tuned batch (``None``: up to the live batch).
        runners: Runners to choose from; :func:`rope_runners` when ``None``.

    Returns:
        ``q`` rotated, ``[B, num_heads, D]`` (the torch fallback returns a view of its rotated
        ``[B, heads + kv_heads, D]`` tensor).
    """
    head_norm_eps = check_eps("rope_kv_cache", head_norm_eps)
    inputs = [qkv, positions, cos, sin, k_cache, v_cache, write_rows, head_norm, head_norm_eps]
    chosen = runners if runners is not None else rope_runners(num_heads, num_kv_heads, signed_sin)
    config = rope_config(num_kv_heads, max_m)
    runner, tactic = (tuner or get_tuner()).choose_one(OP_NAME, chosen, config, inputs)
    return runner.forward(inputs if rows is None else [*inputs, rows], tactic=tactic)
