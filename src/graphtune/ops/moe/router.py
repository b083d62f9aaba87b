"""The router of a mixture-of-experts layer as one fused op: the router GEMM, then the routing.

``moe_router(h, router_weight, top_k, renormalize=..., weights_dtype=...)`` is

    route_top_k(gemm(h, router_weight), top_k, renormalize=..., weights_dtype=...)

(:mod:`graphtune.ops.moe.routing`), a tunable op over the token count with two runners:

* :class:`UnfusedMoeRouter` (runner 0, the fallback): the tunable GEMM and the tunable routing
  op, each through the same tuner with its own pick (:mod:`graphtune.ops.fused._base`): two
  kernels, or six or seven untuned;
* :class:`TritonMoeRouter`: ``moe_router_kernel`` (``graphtune.ops.moe._router_kernels``), one
  launch: programs ``(token, split)`` stream one slice of ``K`` for every expert, and the last of
  a token's splits sums the partial logits in split order, rounds them to the activations'
  dtype (as the GEMM's output is) and routes the token. Decode sizes only (at most
  :data:`MAX_TOKENS` tokens, :data:`MAX_EXPERTS` experts). Tactics ``{"bk", "splits",
  "warps"}``: chunks of 64, 128 or 256 columns; 8, 16 or 32 splits of at least one chunk each
  (fewer only where the hidden size has fewer chunks: :data:`MIN_SPLITS`); 1 to 8 warps, those
  that give each thread 32 or 64 weights of a chunk.

The fused kernel's logits are summed in another order than the GEMM runners' (float32, then one
rounding), so a token whose two candidate experts' logits differ in the last bit of the
activations' dtype may be routed to the other one, as between two GEMM tactics; ties are
broken to the lowest expert id, as the routing kernel does. The whole-step check of
``graphtune.engine.tuning`` keeps the unfused runner where the step runs faster with it.
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
from graphtune.ops._counters import arrival_counters, split_fits
from graphtune.ops._split_k import keys_per_split, split_partials
from graphtune.ops._triton import device_supported, run_kernel, triton_available
from graphtune.ops.fused._base import UnfusedRunner, resolve, rows_config, runners_for
from graphtune.ops.gemm import gemm
from graphtune.ops.moe._loader import router_kernels
from graphtune.ops.moe.routing import (
    RoutingRule,
    TritonRoutingRunner,
    check_routing_rule,
    route_top_k,
    torch_route_top_k,
)
from graphtune.ops.registry import register_op, runner_extras

OP_NAME = "graphtune.moe_router"
#: Most tokens the fused kernel is offered for (decode sizes: each token's programs read the
#: whole router weight, so its reads grow with the tokens where a GEMM's do not).
MAX_TOKENS = 16
#: Most experts the fused kernel holds in one program's registers.
MAX_EXPERTS = 256
#: Split counts a tactic may have.
SPLITS = (1, 2, 4, 8, 16, 32)
#: Fewest splits offered when the hidden size allows that many: on the H200 every tactic with 4
#: or fewer splits took at least 28% longer than the best at 1 and 8 tokens of the Qwen3-30B-A3B
#: and Mixtral router shapes (benchmarks/results/logs/session46-call5-router-probe-ebd58fb.json).
MIN_SPLITS = 8
#: Weights of a chunk each thread may multiply (sets the warps of a tactic): enough 16-byte
#: loads in flight per thread, few enough registers.
WEIGHTS_PER_THREAD = (32, 64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _unpack(inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    h, weight = inputs
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise InputError(
            f"moe_router: need h [T, K] and router_weight [E, K], got h {tuple(h.shape)} and "
            f"router_weight {tuple(weight.shape)}; flatten the leading dims of h first."
        )
    return h, weight


class _RouterRule(RoutingRule):
    """The routing rule of a router runner, whose inputs are ``[h, router_weight]``."""

    def torch_forward(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~graphtune.ops.moe.routing.torch_route_top_k` of ``F.linear(h, weight)``."""
        logits = F.linear(*_unpack(inputs))
        return torch_route_top_k(
            logits, self.top_k, renormalize=self.renormalize, weights_dtype=self._dtype(logits)
        )


class UnfusedMoeRouter(_RouterRule, UnfusedRunner):
    """Runner 0: the tunable GEMM, then the tunable routing op, through :attr:`tuner`."""

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
        """``route_top_k(gemm(h, router_weight))``, each with its own pick."""
        h, weight = _unpack(inputs)
        logits = gemm(h, weight, tuner=self.tuner, max_m=self.max_m, cold_l2=self.cold_l2)
        return route_top_k(
            logits,
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self._dtype(logits),
            tuner=self.tuner,
            max_m=self.max_m,
        )


def router_tactics(tokens: int, experts: int, k: int) -> list[dict[str, int]]:
    """The fused kernel's tactics for ``tokens`` rows, ``experts`` and hidden size ``k`` (see the
    module docstring); none above :data:`MAX_TOKENS` tokens or :data:`MAX_EXPERTS` experts."""
    if not 0 < tokens <= MAX_TOKENS or experts > MAX_EXPERTS or k < 1:
        return []  # (a hidden size of 0 has no columns to split: the torch router runs)
    block_e = max(16, next_power_of_two(experts))
    tactics = []
    for bk in (64, 128, 256):
        # Every split gets at least one chunk of columns.
        splits = [s for s in SPLITS if -(-k // keys_per_split(k, s, bk)) == s]
        fewest = min(MIN_SPLITS, max(splits))
        for warps in (1, 2, 4, 8):
            if block_e * bk // (32 * warps) in WEIGHTS_PER_THREAD:
                tactics += [{"bk": bk, "splits": s, "warps": warps} for s in splits if s >= fewest]
    return tactics


@functools.lru_cache(maxsize=64)
def _offered(experts: int, k: int) -> frozenset[tuple[tuple[str, int], ...]]:
    """The tactics any token count of these experts and hidden size may launch, as keys (the
    launch checks its tactic against this once per shape, not per call)."""
    return frozenset(tuple(sorted(t.items())) for t in router_tactics(1, experts, k))


class TritonMoeRouter(_RouterRule, TritonRoutingRunner):
    """The router GEMM and the routing in one Triton kernel; tactic ``-1`` is torch."""

    def supports(self, inputs: list[Any]) -> bool:
        """float16/bfloat16/float32 ``h`` and weight of one dtype, unit last strides, at most
        :data:`MAX_EXPERTS` experts, on a Triton device."""
        h, weight = _unpack(inputs)
        return (
            h.dtype in _FLOAT_DTYPES
            and weight.dtype == h.dtype
            and h.stride(1) == 1
            and weight.stride(1) == 1
            and weight.shape[0] <= MAX_EXPERTS
            and device_supported(h.device)
        )

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`router_tactics`."""
        h, weight = _unpack(inputs)
        return list(router_tactics(h.shape[0], weight.shape[0], h.shape[1]))

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the kernel; returns ``(weights, ids)``.

        Any token count runs (a bucket's pick serves every count that maps to the bucket); a split
        tactic runs unsplit past :data:`graphtune.ops._counters.COUNTERS` tokens.

        Raises:
            ConfigError: ``tactic`` is not one of :func:`router_tactics`'s for these experts and
                hidden size.
        """
        h, weight = _unpack(inputs)
        tokens, k = h.shape
        experts = weight.shape[0]
        if not isinstance(tactic, dict) or tuple(sorted(tactic.items())) not in _offered(
            experts, k
        ):
            raise ConfigError(
                f"TritonMoeRouter: tactic {tactic!r} is not offered for {experts} experts of "
                f"width {k}; pick one from get_valid_tactics."
            )
        dtype = self._dtype(h)
        weights = torch.empty((tokens, self.top_k), dtype=dtype, device=h.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int64, device=h.device)
        if tokens == 0:
            return weights, ids
        bk = tactic["bk"]
        # More tokens than arrival counters (a pick serving far more tokens): unsplit.
        splits = tactic["splits"] if split_fits(tokens) else 1
        block_e = max(16, next_power_of_two(experts))
        k_per_split = keys_per_split(k, splits, bk)
        # Each token's partials and, in one more row, its logits for the routing to read.
        ws = split_partials(tokens, splits + 1, block_e, False, h.device)
        counters = h  # an unread placeholder without a split
        if splits > 1:
            counters = arrival_counters(
                h.device, tokens, user="TritonMoeRouter", fix="use a tactic with splits 1"
            )
        args = (h, weight, ws, counters, weights, ids, experts, k, k_per_split)
        meta = dict(
            TOP_K=self.top_k,
            BLOCK_TOP=next_power_of_two(self.top_k),
            BLOCK_E=block_e,
            ROWS=tactic["warps"],
            BLOCK_K=bk,
            SPLITS=splits,
            EVEN_K=k_per_split * splits == k,
            RENORMALIZE=self.renormalize,
            num_warps=tactic["warps"],
            num_stages=1,
        )
        strides = (h.stride(0), weight.stride(0))
        run_kernel(
            router_kernels().moe_router_kernel, (tokens, splits), (*args, *strides), meta, warmup
        )
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
    """The runners of one routing rule for one tuner: unfused first (the fallback), then the
    fused kernel when Triton is importable."""
    tuner = resolve(tuner)
    rule = (top_k, bool(renormalize), bool(weights_float32))

    def build() -> tuple[TunableRunner, ...]:
        first = UnfusedMoeRouter(*rule, tuner=tuner, max_m=max_m, cold_l2=cold_l2)
        return (first, TritonMoeRouter(*rule)) if triton_available() else (first,)

    return runners_for(tuner, (OP_NAME, *rule, max_m, cold_l2), build)


def moe_router_config(max_m: int | None = None, cold_l2: bool = False) -> TuningConfig:
    """The tokens (rows of ``h``, input 0) in power-of-two buckets; ``cold_l2`` as for the
    GEMM."""
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
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_top_k(h @ router_weight.T)`` through the tuner's pick for this token count.

    Args:
        h: ``[T, K]`` normed activations.
        router_weight: ``[E, K]``.
        top_k: Experts per token, ``1 <= top_k <= E``.
        renormalize: As for :func:`~graphtune.ops.moe.routing.route_top_k`.
        weights_dtype: ``h``'s dtype or float32 (another one runs the unfused ops directly).
        tuner: Tuner to ask (for this op and the unfused path's inner ops); the process default
            when ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``).
        runners: Runners to choose from; :func:`moe_router_runners` when ``None``.
        cold_l2: Tune with cold-L2 rotation (this op and the unfused GEMM).

    Returns:
        ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int64)``, largest weight first.

    Raises:
        InputError: ``h`` and ``router_weight`` are not ``[T, K]`` and ``[E, K]``.
        ConfigError: ``top_k`` is not an int in ``[1, E]`` or ``weights_dtype`` is not a float
            dtype.
    """
    h, router_weight = _unpack([h, router_weight])
    check_routing_rule("moe_router", top_k, len(router_weight), weights_dtype)
    tuner = resolve(tuner)
    if weights_dtype not in (torch.float32, h.dtype) or h.dtype not in _FLOAT_DTYPES:
        logits = gemm(h, router_weight, tuner=tuner, max_m=max_m, cold_l2=cold_l2)
        return route_top_k(
            logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype, tuner=tuner
        )
    weights_float32 = weights_dtype == torch.float32
    chosen = runners
    if chosen is None:
        chosen = moe_router_runners(
            top_k, renormalize, weights_float32, tuner=tuner, max_m=max_m, cold_l2=cold_l2
        )
    inputs = [h, router_weight]
    runner, tactic = tuner.choose_one(OP_NAME, chosen, moe_router_config(max_m, cold_l2), inputs)
    result: tuple[torch.Tensor, torch.Tensor] = runner.forward(inputs, tactic=tactic)
    return result
