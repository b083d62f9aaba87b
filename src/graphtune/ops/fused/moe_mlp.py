"""The mixture-of-experts MLP stage of a decode layer as one tunable op, routing included.

``norm_moe_mlp(x, norm_weight, eps, router, gate_up, down, top_k=k, renormalize=r)`` is, exactly,
the unfused sequence

    h, _ = fused_add_rms_norm(x, norm_weight, eps)
    logits = gemm(h, router)
    weights, ids = route_top_k(logits, k, renormalize=r, weights_dtype=...)
    fused_moe(h, gate_up, down, weights, ids, residual=x)          # x += experts, in place

which is runner 0 (:class:`UnfusedNormMoeMlp`, tactic ``-1``): four tunable ops, each with its
own pick (the grouped GEMMs, the GEMV path or torch for the experts). At decode sizes that is
five or six kernels, most of them a few microseconds of fixed cost. :class:`TritonNormMoeMlp`
runs the stage in three:

1. ``norm_linear(x, norm_weight, eps, router)``: the router GEMV with the RMSNorm in its
   prologue (:func:`graphtune.ops.fused.norm_linear`, with its own pick, asked of the same
   tuner);
2. the GEMV path's gate/up kernel with two prologues: every program recomputes its token's
   RMSNorm and routes the token from the logits (softmax, top-k, renormalisation), and the
   programs of the first feature block write each pair's expert id and routing weight;
3. the GEMV path's down kernel, which reads those and adds the weighted experts to ``x``.

So neither ``h`` nor a routing kernel exists in the fused path. The numbers are the unfused
path's up to the summation order of the products (norm and routing round as the unfused ops do;
ties between equal probabilities go to the lowest expert id, as the Triton router's). It has
tactics only where the GEMV path has them (``T * k <= graphtune.ops.moe.gemv.MAX_PAIRS``), with
the GEMV path's tactics (:func:`~graphtune.ops.moe.gemv.moe_gemv_tactics`); above, runner 0 is
the only candidate and is picked without timing. The tuner decides per token bucket.

Tuning runs the stage on synthetic ``x``, so the routing is whatever random logits select (at
most ``MAX_PAIRS`` pairs, where the GEMV path reads one expert per pair whatever the overlap).
The op itself is timed with warm L2 (the experts it streams far exceed the cache); the inner ops
get the context's ``cold_l2``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import DynamicTensorSpec, TuningConfig
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError, InputError
from graphtune.ops._triton import device_supported, triton_available
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.fused._base import InnerOps, UnfusedRunner, resolve, runners_for
from graphtune.ops.fused.projection import norm_linear
from graphtune.ops.gemm import gemm
from graphtune.ops.moe.gemv import check_moe_gemv_tactic, launch_moe_gemv, moe_gemv_tactics
from graphtune.ops.moe.op import fused_moe
from graphtune.ops.moe.reference import check_moe_experts, torch_fused_moe
from graphtune.ops.moe.routing import MAX_TRITON_EXPERTS, route_top_k, torch_route_top_k
from graphtune.ops.registry import register_op, runner_extras
from graphtune.ops.rmsnorm import fused_add_rms_norm, torch_rms_norm

OP_NAME = "graphtune.norm_moe_mlp"
# Input order: x, norm_weight, router, gate_up, down, eps.


def _unpack(inputs: list[Any]) -> list[Any]:
    """Checks the stage's inputs; returns them."""
    x, norm_weight, router, gate_up, down, _ = inputs
    check_moe_experts(x, gate_up, down)
    hidden, experts = x.shape[1], gate_up.shape[0]
    if norm_weight.shape != (hidden,) or tuple(router.shape) != (experts, hidden):
        raise InputError(
            f"norm_moe_mlp: need norm_weight [H={hidden}] and router [E={experts}, H], got "
            f"{tuple(norm_weight.shape)} and {tuple(router.shape)}."
        )
    if not x.is_contiguous():
        raise InputError(
            "norm_moe_mlp: x must be contiguous (the experts are added to it in place); pass "
            "x.contiguous() and use the returned tensor."
        )
    return inputs


class _RoutingRule:
    """The router's rule, part of both runners' identity (not implied by the shapes)."""

    top_k: int
    renormalize: bool
    weights_float32: bool

    def _init_rule(self, top_k: int, renormalize: bool, weights_float32: bool) -> None:
        self.top_k, self.renormalize, self.weights_float32 = top_k, renormalize, weights_float32

    def cache_key_extras(self) -> tuple[Any, ...]:
        """k, renormalisation and the routing weights' dtype."""
        return (self.top_k, self.renormalize, self.weights_float32)

    def weights_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The routing weights' dtype: float32 (Mixtral) or the activations' (Qwen3-MoE)."""
        return torch.float32 if self.weights_float32 else x.dtype


class UnfusedNormMoeMlp(_RoutingRule, UnfusedRunner):
    """Runner 0: ``fused_add_rms_norm``, ``gemm``, ``route_top_k`` and ``fused_moe``, each with
    its own pick."""

    def __init__(
        self,
        top_k: int,
        renormalize: bool,
        weights_float32: bool,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        cold_l2: bool = False,
    ) -> None:
        UnfusedRunner.__init__(self, tuner, max_m, cold_l2)
        self._init_rule(top_k, renormalize, weights_float32)

    def unfused(self, inputs: list[Any]) -> torch.Tensor:
        """The four tunable ops, through :attr:`tuner`; returns ``x`` (updated in place)."""
        x, norm_weight, router, gate_up, down, eps = _unpack(inputs)
        tuner, max_m = self.tuner, self.max_m
        h, _ = fused_add_rms_norm(x, norm_weight, eps, tuner=tuner, max_m=max_m)
        logits = gemm(h, router, tuner=tuner, max_m=max_m, cold_l2=self.cold_l2)
        weights, ids = route_top_k(
            logits,
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self.weights_dtype(x),
            tuner=tuner,
            max_m=max_m,
        )
        return fused_moe(h, gate_up, down, weights, ids, residual=x, tuner=tuner, max_m=max_m)


class TritonNormMoeMlp(_RoutingRule, InnerOps, TritonRunner):
    """The stage in three kernels (see the module docstring); tactic ``-1`` is the unfused
    torch code.

    Args:
        top_k, renormalize, weights_float32: The router's rule.
        tuner: The tuner the router's ``norm_linear`` asks (weakly held; ``None``: the default).
        max_m, cold_l2: Passed to that ``norm_linear``.
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = (
        "graphtune.ops.moe.gemv",
        "graphtune.ops.moe._gemv_kernels",
        "graphtune.ops.moe._kernels",
    )
    identity_excludes = TritonRunner.identity_excludes | InnerOps.INNER_EXCLUDES

    def __init__(
        self,
        top_k: int,
        renormalize: bool,
        weights_float32: bool,
        *,
        tuner: AutoTuner | None = None,
        max_m: int | None = None,
        cold_l2: bool = False,
        compile_workers: int | None = None,
    ) -> None:
        TritonRunner.__init__(self, compile_workers=compile_workers)
        self._init_inner(tuner, max_m, cold_l2)
        self._init_rule(top_k, renormalize, weights_float32)

    def __getstate__(self) -> dict[str, Any]:
        return self._without_tuner(TritonRunner.__getstate__(self))

    def supports(self, inputs: list[Any]) -> bool:
        """At most :data:`~graphtune.ops.moe.routing.MAX_TRITON_EXPERTS` experts, everything
        on one Triton device, a float norm weight."""
        x, norm_weight, router, gate_up, down, _ = _unpack(inputs)
        devices = {t.device for t in (x, norm_weight, router, gate_up, down)}
        return (
            gate_up.shape[0] <= MAX_TRITON_EXPERTS
            and norm_weight.dtype.is_floating_point
            and router.dtype == x.dtype
            and len(devices) == 1
            and device_supported(x.device)
        )

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """The GEMV path's tactics (:func:`~graphtune.ops.moe.gemv.moe_gemv_tactics`)."""
        x, _, _, _, down, _ = inputs
        hidden, inter = x.shape[1], down.shape[2]
        return list(
            moe_gemv_tactics(x.shape[0], self.top_k, hidden, inter, itemsize=x.element_size())
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """The unfused torch code: RMSNorm, the router, the torch routing and expert loop, then
        ``x += experts``."""
        x, norm_weight, router, gate_up, down, eps = _unpack(inputs)
        h = torch_rms_norm(x, norm_weight, eps)[0]
        weights, ids = torch_route_top_k(
            F.linear(h, router),
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=self.weights_dtype(x),
        )
        return x.add_(torch_fused_moe(h, gate_up, down, weights, ids))

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the router's ``norm_linear`` pick and the two GEMV kernels (with ``warmup``,
        only compiles the two kernels); returns ``x``, updated in place.

        Raises:
            ConfigError: ``tactic`` breaks a rule of the GEMV path's tactics.
        """
        problem = check_moe_gemv_tactic(tactic)
        if problem is not None:
            raise ConfigError(f"TritonNormMoeMlp: {problem}; pick one from get_valid_tactics.")
        x, norm_weight, router, gate_up, down, eps = _unpack(inputs)
        tokens, experts = x.shape[0], gate_up.shape[0]
        if tokens == 0 or gate_up.shape[1] < 2:
            return x
        if warmup:  # compiling needs only the logits' layout, not the router's result
            logits = torch.empty((tokens, experts), dtype=x.dtype, device=x.device)
        else:
            logits = norm_linear(
                x,
                norm_weight,
                eps,
                router,
                tuner=self.tuner,
                max_m=self.max_m,
                cold_l2=self.cold_l2,
            )
        pairs = tokens * self.top_k
        launch_moe_gemv(
            x,
            gate_up,
            down,
            x,
            tactic,
            ids=torch.empty(pairs, dtype=torch.int64, device=x.device),
            route=torch.empty(pairs, dtype=self.weights_dtype(x), device=x.device),
            top_k=self.top_k,
            residual=True,
            warmup=warmup,
            norm=(norm_weight, eps),
            logits=logits,
            renormalize=self.renormalize,
        )
        return x


def norm_moe_mlp_runners(
    top_k: int,
    renormalize: bool,
    weights_float32: bool,
    *,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    cold_l2: bool = False,
) -> tuple[TunableRunner, ...]:
    """The runners of one routing rule for one tuner, built once: unfused first (the fallback),
    then the Triton runner."""
    tuner = resolve(tuner)
    rule = (top_k, bool(renormalize), bool(weights_float32))
    inner = dict(tuner=tuner, max_m=max_m, cold_l2=cold_l2)

    def build() -> tuple[TunableRunner, ...]:
        first = UnfusedNormMoeMlp(*rule, **inner)
        return (first, TritonNormMoeMlp(*rule, **inner)) if triton_available() else (first,)

    return runners_for(tuner, (OP_NAME, *rule, max_m, cold_l2), build)


@functools.lru_cache(maxsize=64)
def norm_moe_mlp_config(max_m: int | None = None) -> TuningConfig:
    """Tuning config: the tokens (rows of ``x``, input 0) in power-of-two buckets; one untimed
    call before a measurement and one call per captured repeat (as ``fused_moe``'s: the graph
    timer raises the calls per replay of short ones itself)."""
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=max_m, warmup=1, repeat=1
    )


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    top_k, renormalize, weights_float32 = runner_extras(record.runners[0])
    max_m = record.config["max_value"]
    runners = norm_moe_mlp_runners(
        int(top_k), bool(renormalize), bool(weights_float32), tuner=tuner, max_m=max_m
    )
    return runners, norm_moe_mlp_config(max_m)


register_op(OP_NAME, _rebuild)


def norm_moe_mlp(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    tuner: AutoTuner | None = None,
    max_m: int | None = None,
    runners: tuple[TunableRunner, ...] | None = None,
    cold_l2: bool = False,
) -> torch.Tensor:
    """``x += experts(rms_norm(x))`` routed by ``router``, in place, through the tuner's pick.

    Args:
        x: ``[T, H]`` contiguous residual stream (not normalised), updated in place.
        norm_weight: ``[H]`` RMSNorm weight; ``eps`` its epsilon.
        router: ``[E, H]`` router weight (no bias), in ``x``'s dtype.
        gate_up, down: The experts, as :func:`graphtune.ops.moe.fused_moe` takes them.
        top_k, renormalize: As :func:`graphtune.ops.moe.route_top_k`.
        weights_dtype: The routing weights' dtype: float32 or ``x``'s.
        tuner: The tuner to ask (for this op and the inner ops); the process default when
            ``None``.
        max_m: Largest tuned ``T`` (``None``: buckets up to the live ``T``).
        runners: Runners to choose from; :func:`norm_moe_mlp_runners` when ``None``.
        cold_l2: Passed to the inner GEMMs' tuning (this op is timed with warm L2).

    Returns:
        ``x``.

    Raises:
        InputError: Shapes, dtypes or ``x``'s layout break the rules above.
        ConfigError: ``top_k``, ``eps`` or ``weights_dtype`` is invalid.
    """
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ConfigError(f"norm_moe_mlp: eps must be a float >= 0, got {eps!r}.")
    inputs: list[Any] = [x, norm_weight, router, gate_up, down, float(eps)]
    _unpack(inputs)
    experts = gate_up.shape[0]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ConfigError(
            f"norm_moe_mlp: top_k must be an int in [1, E={experts}], got {top_k!r}; it is the "
            "config's num_experts_per_tok."
        )
    if weights_dtype not in (torch.float32, x.dtype):
        raise ConfigError(
            f"norm_moe_mlp: weights_dtype must be torch.float32 or x's dtype {x.dtype}, got "
            f"{weights_dtype}; route with route_top_k and call fused_moe for another dtype."
        )
    tuner = resolve(tuner)
    weights_float32 = weights_dtype == torch.float32
    chosen = runners
    if chosen is None:
        chosen = norm_moe_mlp_runners(
            top_k, renormalize, weights_float32, tuner=tuner, max_m=max_m, cold_l2=cold_l2
        )
    runner, tactic = tuner.choose_one(OP_NAME, chosen, norm_moe_mlp_config(max_m), inputs)
    runner.forward(inputs, tactic=tactic)
    return x
