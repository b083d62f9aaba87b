"""The op settings of one model step, bound once: which tuner to ask and the largest batch.

A model's forward calls its ops through an :class:`OpContext` (``ops.gemm(h, w)``) instead of
passing ``tuner=..., max_m=...`` to every call. Activations are 2-D (``[rows, features]``).

* **Untuned** (``OpContext()``, no tuner): every call runs the op's fallback (runner 0, tactic
  ``-1``) straight away: the torch reference function its module defines and its torch runner
  runs (``torch_gemm``, ``torch_rms_norm``, ``torch_rope_kv_cache``, ``torch_silu_and_mul``, SDPA,
  ``torch_route_top_k``, ``torch_fused_moe``).
  No tuner is asked, no runner list is built and nothing is counted, so the untuned step costs
  the host about what hand-written torch costs, and ``torch.compile`` traces it.
* **Tuned** (``OpContext(tuner, max_batch_size)``): every call goes through the op function of its
  module, a look-up of the tuner's pick for its batch bucket (buckets up to ``max_batch_size``).
  Outside tuning mode a shape never tuned runs the fallback and is counted in
  ``tuner.stats.fallbacks``; in tuning mode (inside :func:`graphtune.autotune`) a miss tunes every
  bucket of that op first. So running the step in tuning mode tunes exactly the keys the step
  looks up later (``graphtune.engine.tuning``).

The stages of a decode layer are the fused ops of :mod:`graphtune.ops.fused`
(:meth:`OpContext.norm_qkv_rope`, :meth:`~OpContext.norm_gate_up_silu`,
:meth:`~OpContext.add_projection`, :meth:`~OpContext.norm_linear`). Untuned, and in a context
built with ``fused=False`` (:meth:`OpContext.unfused`), each runs its unfused sequence of the single
ops above instead (a fused op's runner 0): the untuned step is the plain torch step, and the
tuned unfused step is the step as tuned before the fused ops existed. A stage also takes the
normalised rows when something earlier already produced them (``normed=``, tensor parallelism's
fused all-reduce + add + RMSNorm); it then skips its norm and runs the single ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError
from graphtune.ops import attention as attention_op
from graphtune.ops import fused as fused_ops
from graphtune.ops.activation import silu_and_mul, torch_gated_activation, torch_silu_and_mul
from graphtune.ops.gemm import gemm, torch_gemm
from graphtune.ops.moe.op import fused_moe
from graphtune.ops.moe.reference import torch_fused_moe
from graphtune.ops.moe.router import moe_router
from graphtune.ops.moe.routing import route_top_k, torch_route_top_k
from graphtune.ops.rmsnorm import fused_add_rms_norm, torch_rms_norm
from graphtune.ops.rotary import RopeRows, rope_kv_cache, torch_rope_kv_cache


@dataclass(frozen=True)
class OpContext:
    """Which tuner a step's ops ask, and for batches up to what size.

    Attributes:
        tuner: The :class:`~graphtune.autotuner.AutoTuner` whose picks the ops run; ``None``: the
            untuned context (every op runs its torch fallback, no look-up).
        max_batch_size: Largest batch (rows of the activations) tuned and looked up; a larger
            live batch looks up the largest bucket. Required with a tuner.
        gemm_cold_l2: Tune the GEMMs and the fused ops (GEMVs with a prologue or an epilogue)
            with cold-L2 rotation (``TuningConfig.cold_l2``): in a decode step every weight
            streams from HBM once, while one that fits in L2 stays there when the same call is
            timed back to back. Cache keys are the same either way.
        fused: With a tuner, the layer stages call the fused ops (each a tunable op whose runner
            0 is the unfused sequence, so the tuner decides per bucket); ``False``: the stages
            call the unfused sequence of single ops directly. Without a tuner the stages always
            run the unfused torch code.

    Raises:
        ConfigError: ``max_batch_size`` is not an int >= 1 (or missing with a tuner).
    """

    tuner: AutoTuner | None = None
    max_batch_size: int | None = None
    gemm_cold_l2: bool = False
    fused: bool = True
    _attention_config: TuningConfig = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = self.max_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"OpContext.max_batch_size must be an int >= 1, got {size!r}.")
        if self.tuner is not None and size is None:
            raise ConfigError(
                "OpContext(tuner=...) needs max_batch_size (the largest batch the step runs), so "
                "that tuning and look-ups use the same buckets."
            )
        # Built once: a config is part of the tuner's memo key, and building one per call would
        # make every look-up take the slow path.
        object.__setattr__(self, "_attention_config", attention_op.tuning_config(size))

    @property
    def tuned(self) -> bool:
        """Whether a tuner picks the kernels (else every op is its torch fallback)."""
        return self.tuner is not None

    def unfused(self) -> OpContext:
        """This context with ``fused=False``: the stages run their single ops, each tuned."""
        return replace(self, fused=False)

    @property
    def _fusing(self) -> bool:
        return self.fused and self.tuner is not None

    def gemm(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        *,
        inplace: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`graphtune.ops.gemm.gemm`: ``a @ weight.T (+ bias) (+ residual)``."""
        if self.tuner is None:
            return torch_gemm([a, weight, bias, residual, inplace, out])
        return gemm(
            a,
            weight,
            bias,
            residual,
            inplace=inplace,
            out=out,
            tuner=self.tuner,
            max_m=self.max_batch_size,
            cold_l2=self.gemm_cold_l2,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x`` (:func:`graphtune.ops.rmsnorm.fused_add_rms_norm` without a
        residual)."""
        if self.tuner is None:
            return torch_rms_norm(x, weight, eps)[0]
        return fused_add_rms_norm(x, weight, eps, tuner=self.tuner, max_m=self.max_batch_size)[0]

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``
        (:func:`graphtune.ops.rmsnorm.fused_add_rms_norm`)."""
        if self.tuner is None:
            return torch_rms_norm(x, weight, eps, residual)
        return fused_add_rms_norm(
            x, weight, eps, residual, tuner=self.tuner, max_m=self.max_batch_size
        )

    def rope_kv_cache(
        self,
        qkv: torch.Tensor,
        rope: RopeRows,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_rows: torch.Tensor,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_norm: torch.Tensor | None = None,
        head_norm_eps: float = 1e-6,
    ) -> torch.Tensor:
        """Rotary q/k and the K/V cache write (:func:`graphtune.ops.rotary.rope_kv_cache`) with
        the step's signed-sin tables, after the per-head q/k RMSNorm when ``head_norm`` is
        given; returns ``q [rows, num_heads, head_dim]``."""
        if self.tuner is None:
            return torch_rope_kv_cache(
                qkv,
                rope.positions,
                rope.cos,
                rope.sin,
                k_cache,
                v_cache,
                write_rows,
                num_heads,
                num_kv_heads,
                rope.signed_sin,
                rope,
                head_norm=head_norm,
                head_norm_eps=head_norm_eps,
            )
        return rope_kv_cache(
            qkv,
            rope.positions,
            rope.cos,
            rope.sin,
            k_cache,
            v_cache,
            write_rows,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            signed_sin=rope.signed_sin,
            rows=rope,
            head_norm=head_norm,
            head_norm_eps=head_norm_eps,
            tuner=self.tuner,
            max_m=self.max_batch_size,
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """:func:`graphtune.ops.activation.silu_and_mul`: ``silu(gate) * up``."""
        if self.tuner is None:
            return torch_silu_and_mul(gate_up)
        return silu_and_mul(gate_up, tuner=self.tuner, max_m=self.max_batch_size)

    def gated_activation(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """``act(gate) * up`` (:func:`graphtune.ops.activation.gated_activation`): SiLU through
        :meth:`silu_and_mul`, any other activation its torch code (nothing to pick from)."""
        if activation == "silu":
            return self.silu_and_mul(gate_up)
        return torch_gated_activation(gate_up, activation)

    def decode_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """:func:`graphtune.ops.attention.decode_attention` (one query token per request)."""
        if self.tuner is None:
            # The op's fallback: SdpaAttention with tactic -1 (PyTorch picks the backend).
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return attention_op.decode_attention(
            q, keys, values, mask, tuner=self.tuner, config=self._attention_config
        )

    def fused_moe(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`graphtune.ops.moe.fused_moe`: the experts of a mixture-of-experts layer for a
        routing (untuned: the sparse expert loop, or the dense form while a graph captures),
        added in place to ``residual`` when given (which is then returned)."""
        if self.tuner is None:
            out = torch_fused_moe(x, gate_up, down, topk_weights, topk_ids)
            return out if residual is None else residual.add_(out)
        return fused_moe(
            x,
            gate_up,
            down,
            topk_weights,
            topk_ids,
            residual=residual,
            tuner=self.tuner,
            max_m=self.max_batch_size,
        )

    def route_top_k(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        weights_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`graphtune.ops.moe.route_top_k`: ``(weights, ids)`` of the top-k experts."""
        if self.tuner is None:
            return torch_route_top_k(
                router_logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype
            )
        return route_top_k(
            router_logits,
            top_k,
            renormalize=renormalize,
            weights_dtype=weights_dtype,
            tuner=self.tuner,
            max_m=self.max_batch_size,
        )

    def moe_router(
        self,
        h: torch.Tensor,
        router_weight: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        weights_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, ids)`` of the top-k experts of ``h @ router_weight.T``: the fused op
        :func:`graphtune.ops.moe.moe_router`, or unfused :meth:`gemm` then :meth:`route_top_k`."""
        if self._fusing:
            return moe_router(
                h,
                router_weight,
                top_k,
                renormalize=renormalize,
                weights_dtype=weights_dtype,
                tuner=self.tuner,
                max_m=self.max_batch_size,
                cold_l2=self.gemm_cold_l2,
            )
        logits = self.gemm(h, router_weight)
        return self.route_top_k(logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype)

    # -- the stages of a decode layer (graphtune.ops.fused) ----------------------------------

    def norm_qkv_rope(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        wqkv: torch.Tensor,
        bqkv: torch.Tensor | None,
        rope: RopeRows,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_rows: torch.Tensor,
        *,
        num_heads: int,
        num_kv_heads: int,
        normed: torch.Tensor | None = None,
        qk_norm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm + QKV projection + RoPE + K/V cache write
        (:func:`graphtune.ops.fused.norm_qkv_rope`); returns ``q [rows, num_heads, head_dim]``.

        ``normed``: ``rms_norm(x, norm_weight, eps)`` already computed; the norm is skipped.
        ``qk_norm``: the ``[heads + kv_heads, head_dim]`` weight rows of a per-head q/k RMSNorm
        between the projection and RoPE (Qwen3, :func:`~graphtune.ops.rmsnorm.head_rms_norm_`,
        ``eps`` too): the fused op's ``head_norm`` (its kernel then holds whole heads), or with
        ``normed`` or unfused the RoPE op's (:func:`~graphtune.ops.rotary.rope_kv_cache`).
        """
        heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
        if normed is None and self._fusing:
            return fused_ops.norm_qkv_rope(
                x,
                norm_weight,
                eps,
                wqkv,
                bqkv,
                rope.positions,
                rope.cos,
                rope.sin,
                k_cache,
                v_cache,
                write_rows,
                **heads,
                signed_sin=rope.signed_sin,
                head_norm=qk_norm,
                rows=rope,
                tuner=self.tuner,
                max_m=self.max_batch_size,
                cold_l2=self.gemm_cold_l2,
            )
        qkv = self.norm_linear(x, norm_weight, eps, wqkv, bqkv, normed=normed)
        return self.rope_kv_cache(
            qkv, rope, k_cache, v_cache, write_rows, **heads, head_norm=qk_norm, head_norm_eps=eps
        )

    def add_projection(
        self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor
    ) -> torch.Tensor:
        """``x += a @ weight.T`` in place (:func:`graphtune.ops.fused.add_projection`); returns
        ``x``."""
        if self._fusing:
            return fused_ops.add_projection(
                x,
                a,
                weight,
                tuner=self.tuner,
                max_m=self.max_batch_size,
                cold_l2=self.gemm_cold_l2,
            )
        return self.gemm(a, weight, residual=x, inplace=True)

    def norm_gate_up_silu(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        w_gate_up: torch.Tensor,
        *,
        normed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm + gate/up projection + SiLU-and-mul
        (:func:`graphtune.ops.fused.norm_gate_up_silu`); ``normed`` as for
        :meth:`norm_qkv_rope`."""
        if normed is None and self._fusing:
            return fused_ops.norm_gate_up_silu(
                x,
                norm_weight,
                eps,
                w_gate_up,
                tuner=self.tuner,
                max_m=self.max_batch_size,
                cold_l2=self.gemm_cold_l2,
            )
        h = normed if normed is not None else self.rms_norm(x, norm_weight, eps)
        return self.silu_and_mul(self.gemm(h, w_gate_up))

    def norm_gate_up_act(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        w_gate_up: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str = "silu",
        *,
        normed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm + gate/up projection (+ ``bias``) + the gated ``activation``: the stage of any
        model's MLP. SiLU without a bias is :meth:`norm_gate_up_silu` (fused when tuned); a bias
        or another activation runs the single ops (:meth:`gated_activation`), which the fused
        kernels do not implement."""
        if bias is None and activation == "silu":
            return self.norm_gate_up_silu(x, norm_weight, eps, w_gate_up, normed=normed)
        h = normed if normed is not None else self.rms_norm(x, norm_weight, eps)
        return self.gated_activation(self.gemm(h, w_gate_up, bias), activation)

    def norm_linear(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        normed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """RMSNorm + a linear layer (:func:`graphtune.ops.fused.norm_linear`: the final norm and
        the LM head); ``normed`` as for :meth:`norm_qkv_rope`."""
        if normed is None and self._fusing:
            return fused_ops.norm_linear(
                x,
                norm_weight,
                eps,
                weight,
                bias,
                tuner=self.tuner,
                max_m=self.max_batch_size,
                cold_l2=self.gemm_cold_l2,
            )
        h = normed if normed is not None else self.rms_norm(x, norm_weight, eps)
        return self.gemm(h, weight, bias)
