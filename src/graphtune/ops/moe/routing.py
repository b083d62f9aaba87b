"""The router of a mixture-of-experts layer: softmax, top-k, optional renormalisation.

``route_top_k(router_logits, top_k, renormalize=..., weights_dtype=...)`` computes, per token,

    probs = softmax(float32(router_logits))          over the E experts
    weights, ids = topk(probs, k)                    (largest first)
    weights = weights / sum(weights)                 when ``renormalize``
    weights = weights.to(weights_dtype)

which is the router of transformers' Qwen3-MoE (``Qwen3MoeTopKRouter``: renormalised when the
config's ``norm_topk_prob`` is set, weights cast back to the logits' dtype) and Mixtral
(``MixtralTopKRouter``: always renormalised, weights kept in float32). Mixtral's paper writes the
router as a softmax over the top-k logits; that is the same number, since
``exp(l_i) / sum_topk exp(l_j)`` is ``p_i / sum_topk p_j``.

It is a tunable op over the token count (power-of-two buckets up to ``max_m``), with two runners:

* :class:`TorchRouteTopKRunner` (the fallback, :func:`torch_route_top_k`): the formula above in
  torch, the op transformers uses, so both select the same experts on the same device. Six or
  seven small kernels (cast, softmax, top-k, sum, divide, cast).
* :class:`TritonRouteTopKRunner`: one kernel, one program per token (``moe_route_top_k_kernel``):
  the exponentials of the softmax in float32, k rounds of one max over keys that carry the
  value and the expert id, then the division (by the sum of the k, or of all when not
  renormalising) and the cast. In a decode step of 48 MoE layers that is about 250 kernel
  launches fewer. Ties between equal probabilities go to the lowest expert id (``torch.topk``
  promises no order among ties, so the two runners may pick different experts of equal
  probability); the softmax's ``exp`` and sum may differ from torch's in the last float32 bit.
  Tactics are ``{"warps"}``.

Everything is a fixed-shape op on the device (no host synchronisation): capturable.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import DynamicTensorSpec, TuningConfig, next_power_of_two
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops._triton import device_supported, run_kernel, triton_available
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.moe._loader import router_kernels
from graphtune.ops.registry import register_op, runner_extras

OP_NAME = "graphtune.route_top_k"
#: Most experts the Triton kernel holds in one program's registers.
MAX_TRITON_EXPERTS = 1024


def _check(router_logits: torch.Tensor, top_k: Any, weights_dtype: torch.dtype) -> None:
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise InputError(
            f"route_top_k needs float router_logits [T, E], got {tuple(router_logits.shape)} "
            f"{router_logits.dtype}; flatten the leading dims of the logits first."
        )
    check_routing_rule("route_top_k", top_k, router_logits.shape[1], weights_dtype)


def check_routing_rule(op: str, top_k: Any, experts: int, weights_dtype: torch.dtype) -> None:
    """The rule's arguments of ``op`` (this op or ``graphtune.ops.moe.router``'s).

    Raises:
        ConfigError: ``top_k`` is not an int in ``[1, experts]`` or ``weights_dtype`` is not a
            float ``torch.dtype`` (a string such as ``"float32"`` is not one).
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(
            f"{op}: top_k must be an int in [1, E={experts}], got {top_k!r}; it is the "
            "config's num_experts_per_tok."
        )
    if not isinstance(weights_dtype, torch.dtype) or not weights_dtype.is_floating_point:
        raise ConfigError(
            f"{op}: weights_dtype must be a float torch.dtype, got {weights_dtype!r}; pass the "
            "logits' dtype (Qwen3-MoE) or torch.float32 (Mixtral)."
        )


def torch_route_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch router (the fallback; arguments as :func:`route_top_k`).

    Rounding points: the softmax, the top-k and the renormalisation run in float32 (the logits
    are converted once); the only rounding after that is the cast to ``weights_dtype``. Ties are
    broken as ``torch.topk`` breaks them.
    """
    _check(router_logits, top_k, weights_dtype)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class RoutingRule:
    """What a router runner computes besides its input: part of its identity (the mixin of
    this module's runners and of ``graphtune.ops.moe.router``'s)."""

    top_k: int
    renormalize: bool
    weights_float32: bool

    def _init_rule(self, top_k: int, renormalize: bool, weights_float32: bool) -> None:
        self.top_k, self.renormalize, self.weights_float32 = top_k, renormalize, weights_float32

    def cache_key_extras(self) -> tuple[Any, ...]:
        """k, renormalisation and the weights' dtype are not implied by the logits' shape."""
        return (self.top_k, self.renormalize, self.weights_float32)

    def _dtype(self, logits: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.weights_float32 else logits.dtype

    def torch_forward(self, inputs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`torch_route_top_k` on ``inputs = [router_logits]``."""
        (logits,) = inputs
        return torch_route_top_k(
            logits, self.top_k, renormalize=self.renormalize, weights_dtype=self._dtype(logits)
        )


class TorchRouteTopKRunner(RoutingRule, TunableRunner):
    """The torch router; only the fallback tactic."""

    def __init__(self, top_k: int, renormalize: bool, weights_float32: bool) -> None:
        self._init_rule(top_k, renormalize, weights_float32)

    def forward(self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any) -> Any:
        """Returns ``(weights [T, k], ids [T, k] int64)``."""
        return self.torch_forward(inputs)


class TritonRoutingRunner(RoutingRule, TritonRunner):
    """What the runners of the router kernels (``graphtune.ops.moe._router_kernels``) share:
    the routing rule and the kernels' sources."""

    source_modules = ("graphtune.ops.moe._router_kernels", "graphtune._split_k_jit")

    def __init__(self, top_k: int, renormalize: bool, weights_float32: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._init_rule(top_k, renormalize, weights_float32)


class TritonRouteTopKRunner(TritonRoutingRunner):
    """The router in one Triton kernel (see the module docstring); tactic ``-1`` is torch."""

    def supports(self, inputs: list[Any]) -> bool:
        """At most :data:`MAX_TRITON_EXPERTS` experts of float16/bfloat16/float32 logits whose
        rows are contiguous, on a Triton device."""
        (logits,) = inputs
        return (
            logits.shape[1] <= MAX_TRITON_EXPERTS
            and logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and logits.stride(1) == 1
            and device_supported(logits.device)
        )

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """``{"warps": w}`` with at least one expert per thread."""
        block = max(16, next_power_of_two(inputs[0].shape[1]))
        return [{"warps": w} for w in (1, 2, 4, 8) if w == 1 or block >= 32 * w]

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> Any:
        """Runs (or with ``warmup`` only compiles) the kernel.

        Raises:
            ConfigError: ``tactic`` is not ``{"warps": power of two <= 8}``.
        """
        warps = tactic.get("warps") if isinstance(tactic, dict) and len(tactic) == 1 else None
        if warps not in (1, 2, 4, 8):
            raise ConfigError(
                f"TritonRouteTopKRunner: a tactic is {{'warps': 1, 2, 4 or 8}} or -1, got "
                f"{tactic!r}; pick one from get_valid_tactics."
            )
        (logits,) = inputs
        tokens, experts = logits.shape
        weights = torch.empty((tokens, self.top_k), dtype=self._dtype(logits), device=logits.device)
        ids = torch.empty((tokens, self.top_k), dtype=torch.int64, device=logits.device)
        if tokens:
            meta = dict(
                TOP_K=self.top_k,
                BLOCK_TOP=next_power_of_two(self.top_k),
                BLOCK_E=max(16, next_power_of_two(experts)),
                ROWS=warps,
                RENORMALIZE=self.renormalize,
                num_warps=warps,
            )
            args = (logits, weights, ids, experts, logits.stride(0))
            run_kernel(router_kernels().moe_route_top_k_kernel, (tokens,), args, meta, warmup)
        return weights, ids


@functools.lru_cache(maxsize=32)
def route_top_k_runners(
    top_k: int, renormalize: bool, weights_float32: bool
) -> tuple[TunableRunner, ...]:
    """The process-wide runners of one routing rule: torch first (fallback), Triton when
    importable."""
    runners: list[TunableRunner] = [TorchRouteTopKRunner(top_k, renormalize, weights_float32)]
    if triton_available():
        runners.append(TritonRouteTopKRunner(top_k, renormalize, weights_float32))
    return tuple(runners)


@functools.lru_cache(maxsize=64)
def route_top_k_config(max_m: int | None = None) -> TuningConfig:
    """Tuning config: the tokens (logits rows, input 0 dim 0) in power-of-two buckets."""
    return TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=max_m)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    top_k, renormalize, weights_float32 = runner_extras(record.runners[0])
    runners = route_top_k_runners(int(top_k), bool(renormalize), bool(weights_float32))
    return runners, route_top_k_config(record.config["max_value"])


register_op(OP_NAME, _rebuild)


def route_top_k(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selects ``top_k`` experts per token and their routing weights, through the tuner's pick
    for this token count (untuned: :func:`torch_route_top_k`).

    Args:
        router_logits: ``[T, E]`` router outputs (any float dtype).
        top_k: Experts per token, ``1 <= top_k <= E``.
        renormalize: Divide the selected probabilities by their sum (Qwen3-MoE's
            ``norm_topk_prob``; always for Mixtral).
        weights_dtype: dtype of the returned weights (Qwen3-MoE: the logits' dtype; Mixtral:
            float32). Another dtype runs the torch router only.
        tuner: The tuner to ask; the process default when ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``).
        runners: Runners to choose from; :func:`route_top_k_runners` when ``None``.

    Returns:
        ``(topk_weights [T, k] weights_dtype, topk_ids [T, k] int64)``, largest weight first.

    Raises:
        InputError: ``router_logits`` is not a 2-D float tensor.
        ConfigError: ``top_k`` is not an int in ``[1, E]`` or ``weights_dtype`` is not a float
            dtype.
    """
    _check(router_logits, top_k, weights_dtype)
    if weights_dtype not in (torch.float32, router_logits.dtype):
        return torch_route_top_k(
            router_logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype
        )
    weights_float32 = weights_dtype == torch.float32
    chosen = (
        runners
        if runners is not None
        else route_top_k_runners(top_k, bool(renormalize), weights_float32)
    )
    inputs = [router_logits]
    runner, tactic = (tuner or get_tuner()).choose_one(
        OP_NAME, chosen, route_top_k_config(max_m), inputs
    )
    return runner.forward(inputs, tactic=tactic)
