"""The whole router of a mixture-of-experts layer as one tunable op: the router GEMM, then the
top-k routing.

``moe_router(h, router_weight, top_k, renormalize=..., weights_dtype=...)`` returns what

    logits = h @ router_weight.T                     (rounded to h's dtype, as a GEMM's output)
    route_top_k(logits, top_k, renormalize=..., weights_dtype=...)

returns (:mod:`graphtune.ops.moe.routing`). Runner 0 (:class:`UnfusedMoeRouter`, the fallback)
is exactly that: the tunable GEMM and the tunable router, each with its own pick
(:mod:`graphtune.ops.fused._base`). :class:`TritonMoeRouter` does both in one kernel
(``moe_router_kernel`` in :mod:`graphtune.ops.moe._router_kernels`): every program computes a few
experts' logits of one token and the last program of the token routes it. At decode sizes the
unfused path is three launches (a split-K GEMV, its reduction, the router kernel) for half a
megabyte of weights; the fused one is one. Its tactics are offered up to
:data:`MAX_FUSED_TOKENS` tokens: a program serves one token, so the router weights are streamed
once per token.

The fused kernel's logits are float32 sums in another order than the GEMM's, rounded to the
dtype; a logit that lands on the other side of a rounding boundary can change a tie, otherwise
the experts and weights are those of the unfused path with the Triton router.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import TuningConfig, next_power_of_two
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops import _counters
from graphtune.ops._triton import device_supported, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.fused._base import UnfusedRunner, resolve, rows_config, unfused_then_triton
from graphtune.ops.gemm import gemm
from graphtune.ops.moe._loader import moe_router_kernels
from graphtune.ops.moe.routing import (
    MAX_TRITON_EXPERTS,
    RoutingRule,
    check_routing_rule,
    route_top_k,
    torch_route_top_k,
)
from graphtune.ops.registry import register_op, runner_extras

OP_NAME = "graphtune.moe_router"
#: Most tokens the fused kernel's tactics are offered for.
MAX_FUSED_TOKENS = 16


def _unpack(inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    h, weight = inputs
    if (
        h.dim() != 2
        or weight.dim() != 2
        or h.shape[1] != weight.shape[1]
        or not h.dtype.is_floating_point
    ):
        raise InputError(
            f"moe_router: need float h [T, hidden] and router_weight [E, hidden], got h "
            f"{tuple(h.shape)} {h.dtype} and router_weight {tuple(weight.shape)}; flatten the "
            "tokens first."
        )
    return h, weight


def torch_moe_router(
    h: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(h, router_weight)`` then :func:`~graphtune.ops.moe.routing.torch_route_top_k`
    (the untuned path and the reference)."""
    h, router_weight = _unpack([h, router_weight])
    return torch_route_top_k(
        F.linear(h, router_weight), top_k, renormalize=renormalize, weights_dtype=weights_dtype
    )


class UnfusedMoeRouter(RoutingRule, UnfusedRunner):
    """Runner 0: the tunable GEMM, then the tunable router, each with its own pick."""

    def __init__(
        self,
        top_k: int,
        renormalize: bool,
        weights_float32: bool,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        cold_l2: bool = False,
    ) -> None:
        super().__init__(tuner, max_m, cold_l2)
        self._init_rule(top_k, renormalize, weights_float32)

    def unfused(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``gemm(h, router_weight)``, then ``route_top_k`` on its logits."""
        h, weight = _unpack(inputs)
        logits = gemm(h, weight, tuner=self.tuner, max_m=self.max_m, cold_l2=self.cold_l2)
        return route_top_k(
            logits,
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self._dtype(h),
            tuner=self.tuner,
            max_m=self.max_m,
        )


def moe_router_tactics(tokens: int, experts: int, hidden: int) -> list[dict[str, int]]:
    """The fused kernel's tactics ``{"rows", "block", "warps"}``: ``rows`` experts per program
    (1 or 2), hidden chunks of ``block`` (512, 1024 or 2048, at most the hidden size rounded up
    to a power of two) and the warps that give each thread 16 or 32 elements of the
    ``[rows, block]`` tile (at least one warp). None above :data:`MAX_FUSED_TOKENS` tokens."""
    if tokens > MAX_FUSED_TOKENS:
        return []
    widest = max(16, next_power_of_two(hidden))
    tactics = []
    for rows in (1, 2):
        if rows > 1 and rows >= 2 * experts:
            continue  # half the rows of every program would be padding
        for block in sorted({min(b, widest) for b in (512, 1024, 2048)}):
            warps = {w for w in (1, 2, 4, 8) if rows * block // (32 * w) in (16, 32)} or {1}
            tactics += [{"rows": rows, "block": block, "warps": w} for w in sorted(warps)]
    return tactics


class TritonMoeRouter(RoutingRule, TritonRunner):
    """The router GEMV and the routing in one kernel (see the module docstring); tactic ``-1``
    is :func:`torch_moe_router`."""

    source_modules = ("graphtune.ops.moe._router_kernels",)

    def __init__(self, top_k: int, renormalize: bool, weights_float32: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_rule(top_k, renormalize, weights_float32)

    def supports(self, inputs: list[Any]) -> bool:
        """float16/bfloat16/float32 ``h`` and weight of one dtype, unit last strides, at most
        :data:`~graphtune.ops.moe.routing.MAX_TRITON_EXPERTS` experts, one arrival counter per
        token available, a Triton device."""
        h, weight = _unpack(inputs)
        return (
            h.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.dtype == h.dtype
            and h.stride(1) == 1
            and weight.stride(1) == 1
            and weight.shape[0] <= MAX_TRITON_EXPERTS
            and h.shape[0] <= _counters.COUNTERS
            and device_supported(h.device)
        )

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """:func:`moe_router_tactics` for this call."""
        h, weight = _unpack(inputs)
        return moe_router_tactics(h.shape[0], weight.shape[0], h.shape[1])

    def torch_forward(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`torch_moe_router`."""
        h, weight = _unpack(inputs)
        return torch_moe_router(
            h, weight, self.top_k, renormalize=self.renormalize, weights_dtype=self._dtype(h)
        )

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the fused kernel.

        Raises:
            ConfigError: ``tactic`` is not a ``{"rows", "block", "warps"}`` dict of powers of
                two.
        """
        if not (
            isinstance(tactic, dict)
            and set(tactic) == {"rows", "block", "warps"}
            and all(isinstance(v, int) and v > 0 and v & (v - 1) == 0 for v in tactic.values())
        ):
            raise ConfigError(
                f"TritonMoeRouter: a tactic is {{'rows', 'block', 'warps'}} (powers of two) or "
                f"-1, got {tactic!r}; pick one from get_valid_tactics."
            )
        h, weight = _unpack(inputs)
        tokens, hidden = h.shape
        experts = weight.shape[0]
        weights = torch.empty((tokens, self.top_k), dtype=self._dtype(h), device=h.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int64, device=h.device)
        if tokens == 0:
            return weights, ids
        counters = _counters.arrival_counters(
            h.device, tokens, user="TritonMoeRouter, tokens", fix="route fewer tokens per call"
        )
        workspace = torch.empty((tokens, experts), dtype=torch.float32, device=h.device)
        rows = tactic["rows"]
        meta = dict(
            K=self.top_k,
            BLOCK_K=next_power_of_two(self.top_k),
            BLOCK_E=max(16, next_power_of_two(experts)),
            ROWS=rows,
            BLOCK_H=tactic["block"],
            RENORMALIZE=self.renormalize,
            num_warps=tactic["warps"],
        )
        args = (h, weight, workspace, counters, weights, ids, experts, hidden, h.stride(0))
        args += (weight.stride(0),)
        grid = ((experts + rows - 1) // rows, tokens)
        run_kernel(moe_router_kernels().moe_router_kernel, grid, args, meta, warmup)
        return weights, ids


def moe_router_runners(
    top_k: int,
    renormalize: bool,
    weights_float32: bool,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    cold_l2: bool = False,
) -> tuple[TunableRunner, ...]:
    """The runners of one routing rule for one tuner: unfused first (fallback), then Triton when
    importable."""
    rule = (top_k, renormalize, weights_float32)
    return unfused_then_triton(
        tuner,
        f"{OP_NAME}{rule}",
        lambda t, m, cold: UnfusedMoeRouter(*rule, tuner=t, max_m=m, cold_l2=cold),
        lambda _tuner, _max_m: (TritonMoeRouter(*rule),),
        max_m,
        cold_l2,
    )


@functools.lru_cache(maxsize=16)
def moe_router_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """The tokens (rows of ``h``) in power-of-two buckets; ``cold_l2`` as for the GEMM."""
    return rows_config(max_m, cold_l2)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    top_k, renormalize, weights_float32 = runner_extras(record.runners[0])
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    runners = moe_router_runners(
        int(top_k), bool(renormalize), bool(weights_float32), tuner=tuner, max_m=max_m, cold_l2=cold
    )
    return runners, moe_router_config(max_m, cold)


register_op(OP_NAME, _rebuild)


def moe_router(
    h: torch.Tensor,
    router_weight: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    cold_l2: bool = False,
    runners: tuple[TunableRunner, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router of a mixture-of-experts layer on ``h``: its ``top_k`` experts per token and
    their weights, through the tuner's pick for this token count.

    Args:
        h: ``[T, hidden]`` normalised activations.
        router_weight: ``[E, hidden]``, same dtype as ``h``.
        top_k: Experts per token, ``1 <= top_k <= E``.
        renormalize: Divide the selected probabilities by their sum.
        weights_dtype: ``h``'s dtype (Qwen3-MoE) or float32 (Mixtral); another dtype runs
            :func:`torch_moe_router`.
        tuner: The tuner to ask; the process default when ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``).
        cold_l2: Tune the inner GEMM (and this op) with cold-L2 rotation.
        runners: Runners to choose from; :func:`moe_router_runners` when ``None``.

    Returns:
        ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int64)``, largest weight first.

    Raises:
        InputError: ``h`` or ``router_weight`` is not 2-D with a shared hidden size.
        ConfigError: ``top_k`` or ``weights_dtype`` is invalid (see ``route_top_k``).
    """
    h, router_weight = _unpack([h, router_weight])
    check_routing_rule(router_weight.shape[0], top_k, weights_dtype)
    if weights_dtype not in (torch.float32, h.dtype):
        return torch_moe_router(
            h, router_weight, top_k, renormalize=renormalize, weights_dtype=weights_dtype
        )
    tuner = resolve(tuner)
    chosen = runners
    if chosen is None:
        chosen = moe_router_runners(
            top_k,
            bool(renormalize),
            weights_dtype == torch.float32,
            tuner=tuner,
            max_m=max_m,
            cold_l2=cold_l2,
        )
    inputs = [h, router_weight]
    runner, tactic = tuner.choose_one(OP_NAME, chosen, moe_router_config(max_m, cold_l2), inputs)
    return runner.forward(inputs, tactic=tactic)
