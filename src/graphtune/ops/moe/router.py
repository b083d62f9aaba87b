"""The router of a mixture-of-experts layer as one tunable op: logits GEMM, softmax, top-k.

``route_experts(h, router_weight, top_k, renormalize=..., weights_dtype=...)`` is

    logits = gemm(h, router_weight)                  [T, E], rounded to h's dtype
    weights, ids = route_top_k(logits, top_k, ...)   (graphtune.ops.moe.routing)

Runner 0 (:class:`UnfusedRouteExperts`, the fallback) calls those two tunable ops, each with its
own pick. At decode sizes that is two or three kernels: the router GEMV is narrow (``E`` = 8 to
128 outputs), so its best tactic splits ``K`` and adds a reduction kernel, then the routing kernel
runs one program per token. :class:`TritonRouteExperts` runs one kernel
(``graphtune.ops.moe._router_kernels.moe_router_kernel``): programs of ``bn`` experts for one
token compute their logits, and the program that arrives last routes the token's row (arrival
counters, ``graphtune.ops._arrival``), so the routing is computed once and no kernel boundary
separates it from the GEMV. The logits are rounded to ``h``'s dtype before the softmax and the
routing is the same code as the routing kernel's, so both runners select the same experts
unless two logits tie after the GEMV's summation order.

Tactics ``{"bn", "bh", "warps"}`` (experts per program, hidden chunk, warps) are offered for up
to :data:`MAX_ROWS` tokens and :data:`~graphtune.ops.moe.routing.MAX_TRITON_EXPERTS` experts; a
tactic loads ``bn * bh`` weights per chunk, 16 to 64 bytes per thread (as the GEMV runner's
rule, ``graphtune.ops.gemm.gemv``), and at most :data:`MAX_TACTICS` are kept, those with the
fewest chunks per program first (:func:`route_experts_tactics`).
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import TuningConfig, next_power_of_two
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops import _arrival
from graphtune.ops._triton import device_supported, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.fused._base import UnfusedRunner, resolve, rows_config, unfused_then_triton
from graphtune.ops.gemm import gemm
from graphtune.ops.moe._loader import moe_router_kernels
from graphtune.ops.moe.routing import (
    MAX_TRITON_EXPERTS,
    check_top_k,
    route_top_k,
    torch_route_top_k,
)
from graphtune.ops.registry import register_op, runner_extras

OP_NAME = "graphtune.route_experts"
#: Most tokens the fused kernel is offered for (one program row per token re-reads the router
#: weight from L2; above decode sizes the two ops win anyway).
MAX_ROWS = 8
BN_CHOICES = (1, 2, 4, 8)
BH_CHOICES = (256, 512, 1024, 2048)
WARP_CHOICES = (1, 2, 4)
THREAD_BYTES = (16, 64)
#: Tactics timed per bucket (see :func:`route_experts_tactics`).
MAX_TACTICS = 12
_TACTIC_KEYS = frozenset({"bn", "bh", "warps"})


def _unpack(inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    h, weight = inputs
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise InputError(
            f"route_experts: need h [T, H] and router_weight [E, H], got h {tuple(h.shape)} and "
            f"router_weight {tuple(weight.shape)}; flatten the leading dims of h first."
        )
    return h, weight


class _Rule:
    """What a router runner computes besides its inputs: part of its identity."""

    def __init__(self, top_k: int, renormalize: bool, weights_float32: bool) -> None:
        self.top_k, self.renormalize, self.weights_float32 = top_k, renormalize, weights_float32

    def cache_key_extras(self) -> tuple[Any, ...]:
        """k, renormalisation and the weights' dtype are not implied by the inputs' shapes."""
        return (self.top_k, self.renormalize, self.weights_float32)

    def weights_dtype(self, h: torch.Tensor) -> torch.dtype:
        """float32 (Mixtral) or the activations' dtype (Qwen3-MoE)."""
        return torch.float32 if self.weights_float32 else h.dtype


class UnfusedRouteExperts(_Rule, UnfusedRunner):
    """Runner 0: ``gemm`` then ``route_top_k``, each with its own pick."""

    def __init__(
        self,
        top_k: int,
        renormalize: bool,
        weights_float32: bool,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        cold_l2: bool = False,
    ) -> None:
        _Rule.__init__(self, top_k, renormalize, weights_float32)
        UnfusedRunner.__init__(self, tuner, max_m, cold_l2)

    def unfused(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The two tunable ops, through :attr:`tuner`."""
        h, weight = _unpack(inputs)
        logits = gemm(h, weight, tuner=self.tuner, max_m=self.max_m, cold_l2=self.cold_l2)
        return route_top_k(
            logits,
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self.weights_dtype(h),
            tuner=self.tuner,
            max_m=self.max_m,
        )


def route_experts_tactics(
    rows: int, experts: int, hidden: int, itemsize: int, max_tactics: int = MAX_TACTICS
) -> list[Any]:
    """The fused router's tactics for one shape: none above :data:`MAX_ROWS` tokens or
    :data:`MAX_TRITON_EXPERTS` experts; otherwise the ``(bn, bh, warps)`` whose weight chunk is
    16 to 64 bytes per thread, ``bn`` at most the experts and ``bh`` at most the hidden size (both
    rounded up to a power of two). A router's weight is a few hundred KiB, so the kernel is
    bound by its chain of dependent loads rather than by bandwidth: the ``max_tactics`` with the
    fewest chunks per program are kept (then fewer experts per program, then fewer warps)."""
    if not 1 <= rows <= MAX_ROWS or experts > MAX_TRITON_EXPERTS:
        return []
    bn_cap, bh_cap = next_power_of_two(experts), next_power_of_two(hidden)
    low, high = THREAD_BYTES
    found: list[dict[str, int]] = []
    for bn in sorted({min(b, bn_cap) for b in BN_CHOICES}):
        for bh in sorted({min(b, bh_cap) for b in BH_CHOICES}):
            chunk = bn * bh * itemsize
            warps = [w for w in WARP_CHOICES if low <= chunk // (32 * w) <= high]
            if not warps and chunk < 32 * low:
                warps = [1]  # a chunk under one warp's share (toy shapes): one warp
            found += [{"bn": bn, "bh": bh, "warps": w} for w in warps]
    found.sort(key=lambda t: (-(-hidden // t["bh"]), t["bn"], t["warps"]))
    return found[:max_tactics]


def check_route_experts_tactic(tactic: Any) -> str | None:
    """Why ``tactic`` cannot run the fused router, or ``None`` when it can."""
    if not isinstance(tactic, dict) or tactic.keys() != _TACTIC_KEYS:
        return f"a tactic is a dict with keys {sorted(_TACTIC_KEYS)}, got {tactic!r}"
    for value in tactic.values():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"every value of a tactic must be a power-of-two int, got {tactic!r}"
        if value & (value - 1):
            return f"every value of a tactic must be a power-of-two int, got {tactic!r}"
    if tactic["warps"] > 32:
        return f"warps must be at most 32, got {tactic!r}"
    return None


class TritonRouteExperts(_Rule, TritonRunner):
    """The router GEMV and the routing in one kernel (see the module docstring); tactic ``-1``
    is the torch router on ``F.linear`` logits."""

    source_modules = ("graphtune.ops.moe._router_kernels", "graphtune.ops.moe._kernels")

    def __init__(self, top_k: int, renormalize: bool, weights_float32: bool, **kwargs: Any) -> None:
        _Rule.__init__(self, top_k, renormalize, weights_float32)
        TritonRunner.__init__(self, **kwargs)

    def supports(self, inputs: list[Any]) -> bool:
        """float16/bfloat16/float32 inputs of one dtype with contiguous rows, on a Triton
        device."""
        h, weight = _unpack(inputs)
        return (
            h.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and weight.dtype == h.dtype
            and h.stride(1) == 1
            and weight.stride(1) == 1
            and device_supported(h.device)
        )

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`route_experts_tactics`."""
        h, weight = _unpack(inputs)
        return route_experts_tactics(h.shape[0], weight.shape[0], h.shape[1], h.element_size())

    def torch_forward(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch_route_top_k(F.linear(h, router_weight))``."""
        h, weight = _unpack(inputs)
        return torch_route_top_k(
            torch.nn.functional.linear(h, weight),
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self.weights_dtype(h),
        )

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the kernel; returns ``(weights, ids)``.

        Raises:
            ConfigError: ``tactic`` breaks a rule of :func:`check_route_experts_tactic`.
        """
        problem = check_route_experts_tactic(tactic)
        if problem is not None:
            raise ConfigError(f"TritonRouteExperts: {problem}; pick one from get_valid_tactics.")
        h, weight = _unpack(inputs)
        tokens, hidden = h.shape
        experts = weight.shape[0]
        weights = torch.empty((tokens, self.top_k), dtype=self.weights_dtype(h), device=h.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int64, device=h.device)
        if tokens == 0:
            return weights, ids
        block_e = max(16, next_power_of_two(experts))
        workspace = torch.empty((tokens, block_e), dtype=torch.float32, device=h.device)
        counters = _arrival.arrival_counters(
            h.device,
            tokens,
            owner="TritonRouteExperts",
            hint="route that many tokens with the unfused router",
        )
        bn, bh, warps = tactic["bn"], tactic["bh"], tactic["warps"]
        args = (h, weight, workspace, counters, weights, ids, tokens, experts, hidden)
        args += (h.stride(0), weight.stride(0))
        meta = dict(
            K=self.top_k,
            BLOCK_K=next_power_of_two(self.top_k),
            BLOCK_E=block_e,
            BLOCK_N=bn,
            BLOCK_H=bh,
            RENORMALIZE=self.renormalize,
            num_warps=warps,
            num_stages=1,
        )
        grid = (-(-experts // bn), tokens)
        run_kernel(moe_router_kernels().moe_router_kernel, grid, args, meta, warmup)
        return weights, ids


def route_experts_runners(
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

    def unfused(tuner: AutoTuner, max_m: int | None, cold_l2: bool) -> TunableRunner:
        return UnfusedRouteExperts(top_k, renormalize, weights_float32, tuner, max_m, cold_l2)

    def triton() -> TunableRunner:
        return TritonRouteExperts(top_k, renormalize, weights_float32)

    layout = (OP_NAME, top_k, renormalize, weights_float32)
    return unfused_then_triton(tuner, layout, unfused, triton, max_m, cold_l2)


def route_experts_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """The tokens (rows of ``h``) in power-of-two buckets; ``cold_l2`` as for the GEMM."""
    return rows_config(max_m, cold_l2)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    top_k, renormalize, weights_float32 = runner_extras(record.runners[0])
    max_m, cold = record.config["max_value"], bool(record.config.get("cold_l2", False))
    runners = route_experts_runners(
        int(top_k), bool(renormalize), bool(weights_float32), tuner=tuner, max_m=max_m, cold_l2=cold
    )
    return runners, route_experts_config(max_m, cold)


register_op(OP_NAME, _rebuild)


def route_experts(
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
    """The top-k experts of every token and their routing weights, from the router's input,
    through the tuner's pick for this token count.

    Args:
        h: ``[T, H]`` normalised activations.
        router_weight: ``[E, H]``.
        top_k: Experts per token, ``1 <= top_k <= E``.
        renormalize: As for :func:`~graphtune.ops.moe.route_top_k`.
        weights_dtype: float32 or ``h``'s dtype (another dtype runs the two ops untuned).
        tuner: The tuner to ask (for this op and the unfused path's two ops); the process
            default when ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``).
        cold_l2: Tune with cold-L2 rotation (this op and the unfused GEMM); look-ups are the
            same.
        runners: Runners to choose from; :func:`route_experts_runners` when ``None``.

    Returns:
        ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int64)``, largest weight first.

    Raises:
        InputError: ``h`` and ``router_weight`` are not ``[T, H]`` and ``[E, H]``.
        ConfigError: ``top_k`` is not an int in ``[1, E]`` or ``weights_dtype`` not a float.
    """
    _unpack([h, router_weight])
    check_top_k(top_k, router_weight.shape[0], weights_dtype)
    if weights_dtype not in (torch.float32, h.dtype):
        logits = gemm(h, router_weight, tuner=tuner, max_m=max_m, cold_l2=cold_l2)
        return torch_route_top_k(
            logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype
        )
    tuner = resolve(tuner)
    weights_float32 = weights_dtype == torch.float32
    chosen = runners
    if chosen is None:
        chosen = route_experts_runners(
            top_k, bool(renormalize), weights_float32, tuner=tuner, max_m=max_m, cold_l2=cold_l2
        )
    inputs = [h, router_weight]
    runner, tactic = tuner.choose_one(OP_NAME, chosen, route_experts_config(max_m, cold_l2), inputs)
    result: tuple[torch.Tensor, torch.Tensor] = runner.forward(inputs, tactic=tactic)
    return result
