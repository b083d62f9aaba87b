"""The op settings of one model step, bound once: which tuner to ask and the largest batch.

A model's forward calls its ops through an :class:`OpContext` (``ops.gemm(h, w)``) instead of
passing ``tuner=..., max_m=...`` to every call. Activations are 2-D (``[rows, features]``).

* **Untuned** (``OpContext()``, no tuner): every call runs the op's fallback (runner 0, tactic
  ``-1``) straight away: the torch reference function its module defines and its torch runner
  runs (``torch_gemm``, ``torch_rms_norm``, ``torch_rope_kv_cache``, ``torch_silu_and_mul``, SDPA).
  No tuner is asked, no runner list is built and nothing is counted, so the untuned step costs
  the host about what hand-written torch costs, and ``torch.compile`` traces it.
* **Tuned** (``OpContext(tuner, max_batch_size)``): every call goes through the op function of its
  module, a look-up of the tuner's pick for its batch bucket (buckets up to ``max_batch_size``).
  Outside tuning mode a shape never tuned runs the fallback and is counted in
  ``tuner.stats.fallbacks``; in tuning mode (inside :func:`graphtune.autotune`) a miss tunes every
  bucket of that op first. So running the step in tuning mode tunes exactly the keys the step
  looks up later (``graphtune.engine.tuning``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from graphtune.autotuner.config import TuningConfig
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError
from graphtune.ops import attention as attention_op
from graphtune.ops.activation import silu_and_mul, torch_gated_activation, torch_silu_and_mul
from graphtune.ops.gemm import gemm, torch_gemm
from graphtune.ops.rmsnorm import fused_add_rms_norm, head_rms_norm_, torch_rms_norm
from graphtune.ops.rotary import RopeRows, rope_kv_cache, torch_rope_kv_cache


@dataclass(frozen=True)
class OpContext:
    """Which tuner a step's ops ask, and for batches up to what size.

    Attributes:
        tuner: The :class:`~graphtune.autotuner.AutoTuner` whose picks the ops run; ``None``: the
            untuned context (every op runs its torch fallback, no look-up).
        max_batch_size: Largest batch (rows of the activations) tuned and looked up; a larger
            live batch looks up the largest bucket. Required with a tuner.
        gemm_cold_l2: Tune the GEMMs with cold-L2 rotation (``TuningConfig.cold_l2``): in a
            decode step every weight streams from HBM once, while one that fits in L2 stays there
            when the same call is timed back to back. Cache keys are the same either way.

    Raises:
        ConfigError: ``max_batch_size`` is not an int >= 1 (or missing with a tuner).
    """

    tuner: AutoTuner | None = None
    max_batch_size: int | None = None
    gemm_cold_l2: bool = False
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
    ) -> torch.Tensor:
        """Rotary q/k and the K/V cache write (:func:`graphtune.ops.rotary.rope_kv_cache`) with
        the step's signed-sin tables; returns ``q [rows, num_heads, head_dim]``."""
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

    def head_rms_norm_(
        self,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        *,
        num_heads: int,
        num_kv_heads: int,
    ) -> torch.Tensor:
        """Per-head RMSNorm of q and k in ``qkv``, in place
        (:func:`graphtune.ops.rmsnorm.head_rms_norm_`); torch code, tuned or not (no kernel of
        its own yet)."""
        return head_rms_norm_(qkv, q_weight, k_weight, eps, num_heads, num_kv_heads)

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
