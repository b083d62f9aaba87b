"""Tunable SiLU-and-mul on a fused ``[..., 2 * I]`` gate/up projection.

``silu_and_mul(gate_up) == silu(gate_up[..., :I]) * gate_up[..., I:]``, which is
``engine.model.swiglu``: the gate half comes first. The torch code (chunk, silu, mul: two kernels
and an intermediate tensor) is the fallback tactic ``-1``; the Triton kernel reads the row once and
writes ``[..., I]``, tactics ``{"block", "warps"}`` over a ``(rows, I / block)`` grid.

:func:`gated_activation` is the MLP activation of any model: ``act(gate) * up`` for an activation
of :data:`GATED_ACTIVATIONS`. SiLU goes through the tunable :func:`silu_and_mul` (the only one with
a Triton kernel); every other activation has one implementation, its torch code, so there is
nothing to tune and no look-up.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import DynamicTensorSpec, TuningConfig, next_power_of_two
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner, preferred_first
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError, describe_tensor
from graphtune.ops import _pruned
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops._triton import (
    KERNELS_SOURCES,
    check_block_tactic,
    device_supported,
    elementwise_tactics,
    kernels,
    run_kernel,
    triton_available,
)
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.registry import register_op

OP_NAME = "graphtune.silu_and_mul"
BLOCKS = (256, 512, 1024, 2048, 4096)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The unfused reference (``engine.model.swiglu``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: The activations a gated MLP (``act(gate) * up``) can use, by name: ``silu`` (SwiGLU), ``gelu``
#: (erf), ``gelu_tanh`` (the tanh approximation, GeGLU as Gemma runs it), ``relu``, ``relu2``
#: (squared ReLU) and ``quick_gelu`` (``x * sigmoid(1.702 x)``), each as transformers computes it.
GATED_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": F.relu,
    "relu2": _relu_squared,
    "quick_gelu": _quick_gelu,
}


def torch_gated_activation(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """``act(gate) * up`` for a fused ``[..., 2 * I]`` tensor (gate half first), in torch.

    Raises:
        ConfigError: ``activation`` is not in :data:`GATED_ACTIVATIONS`.
        InputError: ``gate_up``'s last dim is not even.
    """
    fn = GATED_ACTIVATIONS.get(activation)
    if fn is None:
        raise ConfigError(
            f"gated activation {activation!r} is not implemented; use one of "
            f"{sorted(GATED_ACTIVATIONS)}"
        )
    if not gate_up.shape or gate_up.shape[-1] % 2:  # chunk would split it unevenly
        raise InputError(
            f"gated_activation: gate_up must be [..., 2 * I] (gate half, then up half: an even "
            f"last dim), got {describe_tensor(gate_up)}."
        )
    gate, up = gate_up.chunk(2, dim=-1)
    return fn(gate) * up


def _unpack(inputs: list[Any]) -> torch.Tensor:
    (x,) = inputs
    if x.dim() != 2 or x.shape[1] % 2 or not x.dtype.is_floating_point:
        raise InputError(
            "silu_and_mul needs a float gate_up [M, 2 * I] (an even last dim), got "
            f"{tuple(x.shape)} {x.dtype}."
        )
    return x


#: Programs the preferred tactic aims for at least (see :func:`preferred_silu_tactic`).
MIN_PROGRAMS = 16


def preferred_silu_tactic(inter: int, rows: int) -> dict[str, int]:
    """The prior: the largest block up to 1024 that still gives :data:`MIN_PROGRAMS` programs
    (``rows * I / block``), 4 elements per thread. On an H200 (``tuning-h200.json``) that is the
    fastest in-graph tactic at M = 1 (512), 8 and 64 (1024) for I = 8192, or within 1% of it."""
    block = 1024
    while block > BLOCKS[0] and rows * -(-inter // block) < MIN_PROGRAMS:
        block //= 2
    return {"block": block, "warps": max(1, block // 128)}


def silu_and_mul_tactics(inter: int, rows: int = 1) -> list[dict[str, int]]:
    """Block/warp tactics for ``I`` output columns (blocks up to ``next_power_of_two(I)``, 4 to
    :data:`graphtune.ops._pruned.SILU_MAX_PER_THREAD` elements per thread), the prior
    (:func:`preferred_silu_tactic` for ``rows``) first when valid."""
    limit = max(BLOCKS[0], next_power_of_two(inter))
    blocks = [b for b in BLOCKS if b <= limit]
    per_thread = (4, _pruned.SILU_MAX_PER_THREAD)
    tactics = elementwise_tactics(blocks, warps=(1, 2, 4, 8), per_thread=per_thread)
    return preferred_first(tactics, preferred_silu_tactic(inter, rows))


class TorchSiluAndMulRunner(TunableRunner):
    """The unfused torch code."""

    def forward(
        self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any
    ) -> torch.Tensor:
        """Returns ``silu(gate) * up``."""
        return torch_silu_and_mul(_unpack(inputs))


class TritonSiluAndMulRunner(TritonRunner):
    """Fused SiLU-and-mul in one Triton kernel."""

    source_modules = (*KERNELS_SOURCES, "graphtune.ops._pruned")

    def supports(self, inputs: list[Any]) -> bool:
        """Float rows with a unit last stride, on a Triton device."""
        x = _unpack(inputs)
        return x.dtype in _DTYPES and x.stride(-1) == 1 and device_supported(x.device)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`silu_and_mul_tactics`."""
        return list(silu_and_mul_tactics(inputs[0].shape[1] // 2, inputs[0].shape[0]))

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code."""
        return torch_silu_and_mul(_unpack(inputs))

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the fused kernel; returns ``[M, I]``."""
        x = _unpack(inputs)
        check_block_tactic("TritonSiluAndMulRunner", tactic)
        rows, width = x.shape
        inter = width // 2
        out = torch.empty((rows, inter), device=x.device, dtype=x.dtype)
        if rows == 0 or inter == 0:
            return out
        block = tactic["block"]
        grid = (rows, (inter + block - 1) // block)
        args = (x, out, inter, x.stride(0), out.stride(0))
        run_kernel(
            kernels().silu_and_mul_kernel,
            grid,
            args,
            dict(BLOCK=block, num_warps=tactic["warps"]),
            warmup,
        )
        return out


@functools.lru_cache(maxsize=1)
def silu_and_mul_runners() -> tuple[TunableRunner, ...]:
    """The process-wide runners: torch first (fallback), Triton when importable."""
    runners: list[TunableRunner] = [TorchSiluAndMulRunner()]
    if triton_available():
        runners.append(TritonSiluAndMulRunner())
    return tuple(runners)


@functools.lru_cache(maxsize=64)
def silu_and_mul_config(max_m: int | None = None) -> TuningConfig:
    """Tuning config: rows of ``gate_up`` bucketed."""
    return TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=max_m)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    return silu_and_mul_runners(), silu_and_mul_config(record.config["max_value"])


register_op(OP_NAME, _rebuild)


def silu_and_mul(
    gate_up: torch.Tensor,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * I]`` tensor, through the tuner's pick.

    Args:
        gate_up: ``[..., 2 * I]``, gate half first.
        tuner: Tuner to ask; the process default when ``None``.
        max_m: Largest tuned row count (``None``: up to the live rows).
        runners: Runners to choose from; :func:`silu_and_mul_runners` when ``None``.

    Returns:
        ``[..., I]`` in ``gate_up``'s dtype.
    """
    shape = gate_up.shape
    if not shape:  # as_rows needs a last dim
        raise InputError(
            f"silu_and_mul: gate_up must be [..., 2 * I], got {describe_tensor(gate_up)}."
        )
    inputs = [as_rows(gate_up)]
    chosen = runners if runners is not None else silu_and_mul_runners()
    runner, tactic = (tuner or get_tuner()).choose_one(
        OP_NAME, chosen, silu_and_mul_config(max_m), inputs
    )
    return from_rows(runner.forward(inputs, tactic=tactic), shape[:-1], shape[-1] // 2)


def gated_activation(
    gate_up: torch.Tensor,
    activation: str = "silu",
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
) -> torch.Tensor:
    """``act(gate) * up`` for a fused ``[..., 2 * I]`` tensor, gate half first.

    ``"silu"`` runs the tunable :func:`silu_and_mul` (the tuner's pick); any other activation of
    :data:`GATED_ACTIVATIONS` runs its torch code: it has no other implementation to pick from, so
    the tuner is not asked (and the SiLU kernels never run for it).

    Raises:
        ConfigError: ``activation`` is not in :data:`GATED_ACTIVATIONS`.
        InputError: ``gate_up``'s last dim is not even.
    """
    if activation == "silu":
        return silu_and_mul(gate_up, tuner=tuner, max_m=max_m)
    return torch_gated_activation(gate_up, activation)
