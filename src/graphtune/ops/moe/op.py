"""The tunable fused-MoE op: :func:`fused_moe` asks the tuner for a (runner, tactic) per bucket.

The dynamic dimension is the token count ``T`` (rows of ``x``; the routing tensors' rows follow
it), tuned in power-of-two buckets up to ``max_m``. Tuning times the runners on synthetic
inputs whose routing is replaced by :func:`balanced_routing` (each token picks k distinct experts
uniformly at random), because the time of a grouped GEMM depends on how many rows each expert
gets and random integer ids would not even be distinct per token.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune.autotuner import FALLBACK_TACTIC
from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import ConstraintSpec, DynamicTensorSpec, TuningConfig
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import InputError
from graphtune.ops.moe.gemv import TritonMoeGemvRunner
from graphtune.ops.moe.gemv_down import OP_NAME as DOWN_OP_NAME
from graphtune.ops.moe.gemv_down import choose_down, down_runners
from graphtune.ops.moe.reference import check_moe_tensors, moe_residual, unpack_moe_inputs
from graphtune.ops.moe.runners import fused_moe_runners
from graphtune.ops.registry import is_tensor, register_op

OP_NAME = "graphtune.fused_moe"
#: Seed of the synthetic routing (the same routing for every candidate of a bucket).
ROUTING_SEED = 0


def balanced_routing(inputs: list[Any]) -> list[Any]:
    """``inputs`` with a synthetic routing: k distinct uniformly random experts per token and
    positive weights summing to 1 (the ``inputs_pre_hook`` of :func:`fused_moe_config`); the
    residual, if any, is kept."""
    x, gate_up, down, weights, ids = inputs[:5]
    tokens, top_k = ids.shape
    experts = gate_up.shape[0]
    gen = torch.Generator(device=ids.device)
    gen.manual_seed(ROUTING_SEED)
    scores = torch.rand((tokens, experts), generator=gen, device=ids.device)
    new_ids = scores.topk(min(top_k, experts), dim=-1).indices.to(ids.dtype)
    new_weights = torch.rand(new_ids.shape, generator=gen, device=ids.device) + 0.5
    new_weights = new_weights / new_weights.sum(dim=-1, keepdim=True)
    return [x, gate_up, down, new_weights.to(weights.dtype), new_ids, *inputs[5:]]


def _tokens_of_x(shapes: Any) -> int:
    return int(shapes[0][0])


@functools.lru_cache(maxsize=64)
def fused_moe_config(max_m: int | None = None, residual: bool = False) -> TuningConfig:
    """Tuning config: ``T`` (input 0, dim 0) in power-of-two buckets; ``topk_weights`` and
    ``topk_ids`` (inputs 3 and 4), and the residual (input 5) when ``residual``, follow it;
    :func:`balanced_routing` as the pre-hook.

    One untimed call before a measurement and one call per captured repeat: a bucket of 4096
    tokens of a large expert shape runs for milliseconds, and the graph timer raises the calls
    per replay of short ones by itself until a replay lasts long enough to time.
    """
    follow = (3, 4, 5) if residual else (3, 4)
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=tuple(ConstraintSpec(i, 0, _tokens_of_x) for i in follow),
        max_value=max_m,
        inputs_pre_hook=balanced_routing,
        warmup=1,
        repeat=1,
    )


def fused_moe(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
) -> torch.Tensor:
    """The experts of a mixture-of-experts layer, through the tuner's pick for this token count.

    ``out[t] = sum_j topk_weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t]))``
    with ``e = topk_ids[t, j]`` (see :mod:`graphtune.ops.moe.reference` for the rounding).

    Args:
        x: ``[..., H]`` activations; leading dimensions are flattened into ``T``.
        gate_up_proj: ``[E, 2I, H]``, each expert's gate rows then its up rows (transformers'
            ``gate_up_proj``).
        down_proj: ``[E, H, I]`` (transformers' ``down_proj``).
        topk_weights: ``[T, k]`` routing weights (any float dtype), e.g. from
            :func:`~graphtune.ops.moe.routing.route_top_k`.
        topk_ids: ``[T, k]`` int32/int64 expert ids.
        residual: Optional contiguous tensor of ``x``'s shape and dtype: the output is added to
            it in place (``residual += experts``, one rounding as ``residual.add_``) and it is
            returned; the Triton runners add it in their last kernel instead of a separate add.
        tuner: The tuner to ask; the process default when ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``), as ``max_m`` of the
            other ops (the rows of their inputs are the tokens).
        runners: Runners to choose from; :func:`fused_moe_runners` when ``None``.

    Returns:
        ``[..., H]`` in ``x``'s dtype (``residual`` itself when given).

    Raises:
        InputError: An input is not a tensor or ``x`` is 0-d (``reference.check_moe_tensors``),
            shapes, dtypes or devices break the rules of ``reference.unpack_moe_inputs``, or the
            residual is not a contiguous tensor of ``x``'s shape, dtype and device
            (``reference.moe_residual``).
    """
    # Before the flattening below reads x's last dimension and topk_ids' shape.
    check_moe_tensors([x, gate_up_proj, down_proj, topk_weights, topk_ids])
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x2.shape[0]:
        raise InputError(
            f"fused_moe: topk_ids must be [T, k] with T = {x2.shape[0]} tokens of x "
            f"{tuple(shape)}, got {tuple(topk_ids.shape)}."
        )
    inputs: list[Any] = [x2, gate_up_proj, down_proj, topk_weights, topk_ids]
    unpack_moe_inputs(inputs)
    if residual is not None:
        moe_residual([x, *inputs[1:], residual])  # against x's own shape, not the rows'
        inputs.append(residual.view(x2.shape))
    chosen = runners if runners is not None else fused_moe_runners()
    config = fused_moe_config(max_m, residual is not None)
    tuner = tuner or get_tuner()
    runner, tactic = tuner.choose_one(OP_NAME, chosen, config, inputs)
    gemv = isinstance(runner, TritonMoeGemvRunner) and tactic != FALLBACK_TACTIC
    down_tile = None
    if gemv or (tuner.tuning_mode and any(isinstance(r, TritonMoeGemvRunner) for r in chosen)):
        # The down kernel's tile is an op of its own (graphtune.ops.moe.gemv_down); while
        # tuning it is asked at every call, so its buckets are tuned beside the op's own even
        # when this size's pick is another runner and a later size's is the GEMV runner.
        down_tile = choose_down(tuner, config, inputs)
    if gemv:
        out = runner.forward(inputs, tactic=tactic, down_tile=down_tile)
    else:
        out = runner.forward(inputs, tactic=tactic)
    return residual if residual is not None else out.reshape(shape)


def _recorded_config(record: CallRecord) -> TuningConfig:
    residual = len(record.inputs) > 5 and is_tensor(record, 5)
    return fused_moe_config(record.config["max_value"], residual)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    return fused_moe_runners(), _recorded_config(record)


def _rebuild_down(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    return down_runners(), _recorded_config(record)


register_op(OP_NAME, _rebuild)
register_op(DOWN_OP_NAME, _rebuild_down)
