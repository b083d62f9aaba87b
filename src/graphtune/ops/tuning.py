"""Tune every op of a decoder's decode step for all batch buckets at once.

:func:`tune_ops` builds one live input per op at the largest batch, with the model's dimensions,
and calls each op with the tuner in tuning mode; the tuner then times every (runner, tactic) for
every power-of-two bucket up to ``max_batch`` and caches the picks under the same keys the decode
step looks up later. Used by ``graphtune tune`` and (through the same function) by the engine's
``tune=True``.

Decode attention (:mod:`graphtune.ops.attention`) is tuned too when ``ops`` names
``"attention"``; its keys and values span the KV cache's whole ``max_seq_len``, which is part of
its tuning key, so that group needs ``max_seq_len`` (the engine's, after its rounding to 16).

:class:`OpDims` holds only integers, so this module does not import the engine (the engine
imports ops); :meth:`OpDims.from_model_config` reads any object with the ``ModelConfig`` field
names.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphtune.autotuner.config import power_of_two_buckets
from graphtune.autotuner.context import get_tuner
from graphtune.autotuner.tuner import AutoTuner
from graphtune.errors import ConfigError
from graphtune.ops import attention as attention_op
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.activation import silu_and_mul, silu_and_mul_runners
from graphtune.ops.gemm import OP_NAME as GEMM_OP
from graphtune.ops.gemm import gemm_config, gemm_runners
from graphtune.ops.rmsnorm import fused_add_rms_norm, rms_norm_runners
from graphtune.ops.rotary import rope_kv_cache, rope_runners

logger = logging.getLogger(__name__)

#: Op groups tuned by default (they need only the model's dimensions).
OP_GROUPS = ("gemm", "lm_head", "rms_norm", "rope_kv_cache", "silu_and_mul")
#: Decode attention: its tuning key holds the KV cache length, so it needs ``max_seq_len``.
ATTENTION_GROUP = "attention"
#: Every name accepted by ``tune_ops(ops=...)``, in the order they are tuned.
ALL_GROUPS = (*OP_GROUPS, ATTENTION_GROUP)
#: GEMMs tuned with a residual folded in (``gemm(a, w, residual=x, inplace=True)``). None by
#: default: the tuned decode step adds its residuals in the fused add + RMSNorm that follows each
#: output projection (so tensor parallelism can all-reduce the projection alone).
RESIDUAL_GEMMS: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpDims:
    """The dimensions of a decoder that fix the shapes of its decode-step ops.

    Attributes:
        hidden_size: Model width (``K`` of the QKV / gate-up GEMMs, the norm width).
        intermediate_size: SwiGLU inner width.
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Per-head width.
        vocab_size: LM-head rows.
        rms_norm_eps: RMSNorm epsilon.
        qkv_bias: Whether the QKV projection has a bias (Qwen2).
    """

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"OpDims.{name} must be an int >= 1, got {value!r}.")
        if self.head_dim % 2:
            raise ConfigError(f"OpDims.head_dim must be even (rotary), got {self.head_dim}.")

    @classmethod
    def from_model_config(cls, config: Any) -> OpDims:
        """Reads a ``graphtune.engine.config.ModelConfig`` (or anything with its field names)."""
        head_dim = getattr(config, "dim_per_head", None) or config.head_dim
        return cls(
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_heads=int(config.num_heads),
            num_kv_heads=int(config.num_kv_heads),
            head_dim=int(head_dim),
            vocab_size=int(config.vocab_size),
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
        )

    @property
    def q_size(self) -> int:
        """Width of the query projection."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    def gemm_shapes(self) -> dict[str, tuple[int, int]]:
        """``(N, K)`` of every decode GEMM by name (the LM head included)."""
        return {
            "qkv": (self.q_size + 2 * self.kv_size, self.hidden_size),
            "o_proj": (self.hidden_size, self.q_size),
            "gate_up": (2 * self.intermediate_size, self.hidden_size),
            "down": (self.hidden_size, self.intermediate_size),
            "lm_head": (self.vocab_size, self.hidden_size),
        }


@dataclass
class TuneReport:
    """What :func:`tune_ops` did.

    Attributes:
        buckets: Batch buckets tuned.
        rows: The tuner's summary rows added by this call (op, bucket, winner, time, ...).
        seconds: Wall time of the whole call.
        compile_seconds: Part of it spent compiling Triton tactics ahead of timing.
        op_seconds: Wall time per op group.
    """

    buckets: tuple[int, ...]
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    seconds: float = 0.0
    compile_seconds: float = 0.0
    op_seconds: dict[str, float] = field(default_factory=dict)


def _randn(
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    gen: torch.Generator,
    scale: float = 1.0,
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def attention_mask(positions: torch.Tensor, max_seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive decode mask ``[B, 1, 1, max_seq_len]``: 0 for keys at or before each position."""
    keys = torch.arange(max_seq_len, device=positions.device)
    visible = keys[None, :] <= positions[:, None]
    zero = torch.zeros((), device=positions.device, dtype=dtype)
    return torch.where(visible, zero, torch.full_like(zero, float("-inf")))[:, None, None, :]


def _triton_runners(dims: OpDims) -> list[TritonRunner]:
    runners = [
        *gemm_runners(),
        *rms_norm_runners(),
        *silu_and_mul_runners(),
        *rope_runners(dims.num_heads, dims.num_kv_heads, False),
        *rope_runners(dims.num_heads, dims.num_kv_heads, True),
        *attention_op.RUNNERS,
    ]
    return [r for r in runners if isinstance(r, TritonRunner)]


def tune_ops(
    dims: OpDims,
    max_batch: int,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    tuner: AutoTuner | None = None,
    ops: Sequence[str] = OP_GROUPS,
    residual_gemms: Sequence[str] = RESIDUAL_GEMMS,
    rope_signed_sin: bool = True,
    max_seq_len: int | None = None,
    on_op: Callable[[str], None] | None = None,
    gemm_cold_l2: bool = False,
) -> TuneReport:
    """Tunes the decode-step ops of a model for batch buckets ``1, 2, 4, ..., max_batch``.

    The tuner is switched to tuning mode for the call (and restored after), so this works inside
    or outside :func:`graphtune.autotune`; wrap it in ``autotune(cache_path, tuner)`` to load and
    save a cache file. Entries already in the tuner's cache are not re-tuned.

    Args:
        dims: Model dimensions.
        max_batch: Largest decode batch (the ``max_m`` the decode step must pass to the ops).
        device: Device to tune on.
        dtype: Activation and weight dtype.
        tuner: The tuner; the process default when ``None``.
        ops: Op groups to tune (subset of :data:`ALL_GROUPS`; ``"attention"`` needs
            ``max_seq_len``).
        residual_gemms: GEMMs (names of :meth:`OpDims.gemm_shapes`) the step runs as
            ``gemm(a, w, residual=x, inplace=True)``; they are tuned in that form, the others
            as plain ``gemm(a, w, bias)``.
        rope_signed_sin: Tune ``rope_kv_cache`` for the engine's signed-sin tables.
        max_seq_len: KV cache length of the decode step (keys and values of attention span all
            of it); required when ``ops`` names ``"attention"``.
        on_op: Called with each op group name before it is tuned (progress display).
        gemm_cold_l2: Time the GEMMs (LM head included) with cold-L2 rotation
            (``TuningConfig.cold_l2``): in a decode step every weight matrix streams from HBM
            once per step, while a weight that fits in L2 stays there when the same call is
            timed back to back. The cache keys are the same either way.

    Returns:
        A :class:`TuneReport` with the picks of this call.
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ConfigError(f"tune_ops: max_batch must be an int >= 1, got {max_batch!r}.")
    unknown = sorted(set(ops) - set(ALL_GROUPS))
    if unknown:
        raise ConfigError(f"tune_ops: unknown op groups {unknown}; choose from {ALL_GROUPS}.")
    if ATTENTION_GROUP in ops and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1
    ):
        raise ConfigError(
            f"tune_ops: the {ATTENTION_GROUP!r} group needs max_seq_len (an int >= 1, the decode "
            f"step's KV cache length), got {max_seq_len!r}; pass it or leave {ATTENTION_GROUP!r} "
            "out of ops."
        )
    tuner = tuner or get_tuner()
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    m = max_batch
    report = TuneReport(buckets=power_of_two_buckets(max_batch))
    triton_runners = _triton_runners(dims)
    compile_before = sum(r.compile_seconds for r in triton_runners)
    first_row = len(tuner.summary_rows())
    started = time.perf_counter()

    def weight(n: int, k: int) -> torch.Tensor:
        return _randn((n, k), device, dtype, gen, k**-0.5)

    def run_gemms(names: Sequence[str]) -> None:
        for name in names:
            n, k = dims.gemm_shapes()[name]
            has_bias = name == "qkv" and dims.qkv_bias
            bias = _randn((n,), device, dtype, gen, 0.02) if has_bias else None
            a = _randn((m, k), device, dtype, gen)
            residual = _randn((m, n), device, dtype, gen) if name in residual_gemms else None
            # The inputs gemm() builds for these calls (so the keys are the ones it looks up).
            inputs = [a, weight(n, k), bias, residual, residual is not None]
            config = gemm_config(m, residual is not None)
            if gemm_cold_l2:
                config = dataclasses.replace(config, cold_l2=True)
            tuner.choose_one(GEMM_OP, gemm_runners(), config, inputs)

    def run_norm() -> None:
        x = _randn((m, dims.hidden_size), device, dtype, gen)
        w = _randn((dims.hidden_size,), device, dtype, gen, 0.1) + 1
        fused_add_rms_norm(x, w, dims.rms_norm_eps, tuner=tuner, max_m=m)
        fused_add_rms_norm(x, w, dims.rms_norm_eps, torch.randn_like(x), tuner=tuner, max_m=m)

    def run_act() -> None:
        gate_up = _randn((m, 2 * dims.intermediate_size), device, dtype, gen)
        silu_and_mul(gate_up, tuner=tuner, max_m=m)

    def run_rope() -> None:
        d, kv = dims.head_dim, dims.num_kv_heads
        qkv = _randn((m, dims.q_size + 2 * dims.kv_size), device, dtype, gen)
        table = _randn((64, d), device, dtype, gen)
        cache_rows = m * kv * 4
        k_cache = torch.zeros((cache_rows, d), device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        positions = torch.arange(m, device=device, dtype=torch.long) % 64
        rows = torch.arange(m * kv, device=device, dtype=torch.long) * 4
        rope_kv_cache(
            qkv,
            positions,
            table,
            table.flip(0),
            k_cache,
            v_cache,
            rows,
            num_heads=dims.num_heads,
            num_kv_heads=kv,
            signed_sin=rope_signed_sin,
            tuner=tuner,
            max_m=m,
        )

    def run_attention() -> None:
        assert max_seq_len is not None
        kv, d = dims.num_kv_heads, dims.head_dim
        q = _randn((m, kv, dims.num_heads // kv, d), device, dtype, gen)
        keys = _randn((m, kv, max_seq_len, d), device, dtype, gen)
        values = _randn((m, kv, max_seq_len, d), device, dtype, gen)
        mask = attention_mask(torch.full((m,), max_seq_len // 2, device=device), max_seq_len, dtype)
        attention_op.decode_attention(
            q, keys, values, mask, tuner=tuner, config=attention_op.tuning_config(m)
        )

    steps: dict[str, Callable[[], None]] = {
        "gemm": lambda: run_gemms(("qkv", "o_proj", "gate_up", "down")),
        "lm_head": lambda: run_gemms(("lm_head",)),
        "rms_norm": run_norm,
        "rope_kv_cache": run_rope,
        "silu_and_mul": run_act,
        ATTENTION_GROUP: run_attention,
    }
    previous = tuner.tuning_mode
    tuner.tuning_mode = True
    try:
        with torch.no_grad():
            for name in ALL_GROUPS:
                if name not in ops:
                    continue
                if on_op is not None:
                    on_op(name)
                op_start = time.perf_counter()
                steps[name]()
                report.op_seconds[name] = time.perf_counter() - op_start
    finally:
        tuner.tuning_mode = previous
    report.seconds = time.perf_counter() - started
    report.compile_seconds = sum(r.compile_seconds for r in triton_runners) - compile_before
    report.rows = tuner.summary_rows()[first_row:]
    logger.info(
        "tuned %d op groups for buckets %s in %.1f s (%.1f s compiling)",
        len(report.op_seconds),
        report.buckets,
        report.seconds,
        report.compile_seconds,
    )
    return report
