"""The decode step (capturable) and prefill (eager) of the reference engine.

:class:`DecodeStep` is a pure function of three static-shaped tensors ``tokens [B]``,
``positions [B]`` and ``slots [B]`` (all int64 on the model's device) plus state that never moves
(weights, KV cache, RoPE tables). It does no host synchronisation and has no data-dependent shapes,
which is what a CUDA graph capture needs: K/V are written by index (``index_copy_``) and the
attention covers every cached position with a mask built from ``positions`` on the device.

With a tuner (``DecodeStep(..., tuner=...)``) every tunable op of the step goes through
:mod:`graphtune.ops` and runs the tuner's pick for its batch bucket: RMSNorm, the QKV / gate-up /
LM-head GEMMs, the output and down GEMMs with their residual add folded in (in place, as the
untuned step's ``addmm_``), rotary + K/V write, SiLU-and-mul and decode attention. The op forms
and ``max_m`` are exactly those :func:`graphtune.ops.tuning.tune_ops` tunes, so look-ups hit.
Without a tuner the step is the plain torch code below, unchanged.

Prefill has a different length per request, so it runs eagerly, one request at a time.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import (
    DecoderModel,
    apply_rope,
    apply_rope_signed,
    rms_norm,
    rope_tables,
    swiglu,
)
from graphtune.errors import ConfigError

logger = logging.getLogger(__name__)


class DecodeStep:
    """One decode step for a batch of requests, as a callable for a graph runner.

    Args:
        model: Weights (already on the device and dtype of ``cache``).
        cache: The static KV cache the step writes and reads.
        contiguous_slots: When true the caller promises that row ``i`` of every call owns slot
            ``i`` (the engine keeps its live requests compacted), so attention reads the cache
            slots ``[0, B)`` as a view instead of gathering them by ``slots``; the K/V write still
            goes to ``slots`` so padded rows land in the scratch slot. When false, any slot
            mapping works and the cached K/V of the batch are gathered per layer (an extra copy
            of the batch's cache per step).
        tuner: An :class:`~graphtune.autotuner.AutoTuner` whose picks the step runs (see the
            module docstring), with ``max_m = cache.max_batch_size`` for every op; tune first
            with :func:`graphtune.ops.tuning.tune_ops` for the same ``max_batch`` (and
            ``max_seq_len = cache.max_seq_len`` for attention). An untuned shape runs the op's
            torch fallback and is counted in ``tuner.stats.fallbacks``. ``None`` (default): the
            untuned torch step.

    Raises:
        ConfigError: ``model`` is a tensor-parallel shard (use
            :class:`~graphtune.engine.parallel.TensorParallelDecodeStep`; the Engine picks it).
    """

    #: Whether this step class runs a sharded model (see graphtune.engine.parallel).
    tensor_parallel = False
    #: The ParallelContext of a tensor-parallel step; ``None`` here.
    parallel: Any = None

    def __init__(
        self,
        model: DecoderModel,
        cache: KVCache,
        *,
        contiguous_slots: bool = False,
        tuner: Any = None,
    ) -> None:
        cfg = model.config
        if model.parallel is not None and not self.tensor_parallel:
            raise ConfigError(
                "this model is a tensor-parallel shard; build its step with "
                "graphtune.engine.parallel.TensorParallelDecodeStep (the Engine does this)"
            )
        self.model = model
        self.cache = cache
        self.contiguous_slots = contiguous_slots
        device, dtype = model.device, model.dtype
        self.cos, self.sin = rope_tables(cfg, cache.max_seq_len, device, dtype)
        _, self.signed_sin = rope_tables(cfg, cache.max_seq_len, device, dtype, signed_sin=True)
        # Constants built once so the step allocates nothing on the host side per call.
        self.key_positions = torch.arange(cache.max_seq_len, device=device, dtype=torch.long)
        self.kv_head_index = torch.arange(cfg.num_kv_heads, device=device, dtype=torch.long)
        self.neg_inf = torch.tensor(float("-inf"), device=device, dtype=dtype)
        self.zero = torch.tensor(0.0, device=device, dtype=dtype)
        self.split = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qk_size = cfg.q_size + cfg.kv_size
        self.groups = cfg.num_heads // cfg.num_kv_heads
        # Flattened per-layer views [slots * kv_heads * max_seq, head_dim] for index_copy_.
        self.k_flat = [k.view(-1, cfg.dim_per_head) for k in cache.k_layers]
        self.v_flat = [v.view(-1, cfg.dim_per_head) for v in cache.v_layers]
        self.tuner = tuner
        self.max_m = cache.max_batch_size
        self._attention_config = None
        if tuner is not None:
            from graphtune.ops import attention as attention_op

            self._attention_config = attention_op.tuning_config(cache.max_batch_size)

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """Additive attention mask ``[B, 1, 1, max_seq]``: 0 where a key is visible, else -inf."""
        keys = self.key_positions[None, :]
        pos = positions[:, None]
        visible = keys <= pos
        window = self.model.config.sliding_window
        if window is not None:
            visible = visible & (keys > pos - window)
        return torch.where(visible, self.zero, self.neg_inf)[:, None, None, :]

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Runs one step and returns logits ``[B, vocab]`` in the model dtype.

        Args:
            tokens: ``[B]`` the token each request feeds at this step.
            positions: ``[B]`` its position (= number of tokens already cached for the request).
            slots: ``[B]`` the KV-cache slot of each row (the scratch slot for padded rows).
        """
        if self.tuner is not None:
            return self._tuned(tokens, positions, slots)
        model, cfg = self.model, self.model.config
        batch = tokens.shape[0]
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        seq = self.cache.max_seq_len
        eps = cfg.rms_norm_eps

        x = F.embedding(tokens, model.embed)
        cos = self.cos.index_select(0, positions)[:, None, :]
        sin = self.signed_sin.index_select(0, positions)[:, None, :]
        mask = self.mask(positions)
        # Row of (slot, kv_head, position) in the flattened cache, shared by all layers.
        write_rows = (
            (slots[:, None] * kv_heads + self.kv_head_index[None, :]) * seq + positions[:, None]
        ).reshape(-1)

        # Kernel count per layer matters as much as kernel speed at small batch (every launch
        # costs about a microsecond even inside a graph): queries and keys share one RoPE pass,
        # and the residual adds ride in the output GEMMs (in-place addmm, beta = 1). `x` is a
        # fresh tensor from the embedding, so updating it in place touches no input.
        for index, layer in enumerate(model.layers):
            h = rms_norm(x, layer.attn_norm, eps)
            qkv = F.linear(h, layer.wqkv, layer.bqkv)
            qk = apply_rope_signed(
                qkv[:, : self.qk_size].view(batch, heads + kv_heads, dim), cos, sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.qk_size :]
            self.k_flat[index].index_copy_(0, write_rows, k.reshape(-1, dim))
            self.v_flat[index].index_copy_(0, write_rows, v.reshape(-1, dim))
            if self.contiguous_slots:
                keys = self.cache.k_layers[index][:batch]
                values = self.cache.v_layers[index][:batch]
            else:
                keys = self.cache.k_layers[index].index_select(0, slots)
                values = self.cache.v_layers[index].index_select(0, slots)
            # Grouped-query attention without repeating K/V: the query heads that share a KV head
            # become that head's query "sequence" of length `groups` (one token per request).
            attn = F.scaled_dot_product_attention(
                q.reshape(batch, kv_heads, self.groups, dim), keys, values, attn_mask=mask
            )
            self.add_row_parallel(x, attn.reshape(batch, heads * dim), layer.wo)
            h = rms_norm(x, layer.mlp_norm, eps)
            self.add_row_parallel(x, swiglu(F.linear(h, layer.w_gate_up)), layer.w_down)
        x = rms_norm(x, model.final_norm, eps)
        return F.linear(x, model.lm_head)

    def add_row_parallel(self, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> None:
        """``x += a @ weight.T`` in place: the residual add rides in the GEMM (beta = 1).

        The output projections are the row-parallel GEMMs of tensor parallelism; the
        tensor-parallel step overrides this (and :meth:`reduce_partial`) and nothing else.
        """
        x.addmm_(a, weight.t())

    def reduce_partial(self, partial: torch.Tensor) -> torch.Tensor:
        """Combines a row-parallel GEMM's partial output across ranks (prefill); identity here."""
        return partial

    def project_add_norm(
        self,
        a: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        parity: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The tuned step's output projection and the norm after it: ``x + a @ weight.T`` and
        its RMSNorm, as ``(normed, new x)``, through the tuner's GEMM and add + RMSNorm picks.

        The tensor-parallel step overrides this (all-reduce between the two, or one fused
        all-reduce + add + RMSNorm kernel); ``parity`` alternates between consecutive calls
        (0 for the attention projection, 1 for the MLP's) so it can alternate buffers.
        """
        from graphtune.ops import fused_add_rms_norm, gemm

        delta = gemm(a, weight, tuner=self.tuner, max_m=self.max_m)
        return fused_add_rms_norm(
            delta,
            norm_weight,
            self.model.config.rms_norm_eps,
            x,
            tuner=self.tuner,
            max_m=self.max_m,
        )

    def _tuned(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """The step through :mod:`graphtune.ops` with the tuner's picks (same math as above).

        The residual adds ride in the add + RMSNorm that follows each output projection
        (:meth:`project_add_norm`), so a tensor-parallel step can all-reduce the projection alone,
        or fuse the all-reduce into that norm, and launch no extra kernel.
        """
        from graphtune.ops import attention as attention_op
        from graphtune.ops import fused_add_rms_norm, gemm, rope_kv_cache, silu_and_mul

        model, cfg = self.model, self.model.config
        tuner, max_m = self.tuner, self.max_m
        batch = tokens.shape[0]
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        seq = self.cache.max_seq_len

        x = F.embedding(tokens, model.embed)
        mask = self.mask(positions)
        write_rows = (
            (slots[:, None] * kv_heads + self.kv_head_index[None, :]) * seq + positions[:, None]
        ).reshape(-1)
        attend = None  # (runner, tactic) of decode attention, chosen once per step
        h, x = fused_add_rms_norm(
            x, model.layers[0].attn_norm, cfg.rms_norm_eps, tuner=tuner, max_m=max_m
        )
        for index, layer in enumerate(model.layers):
            # The norm that follows each projection: the next layer's, the final one at the end.
            next_norm = (
                model.layers[index + 1].attn_norm
                if index + 1 < len(model.layers)
                else model.final_norm
            )
            qkv = gemm(h, layer.wqkv, layer.bqkv, tuner=tuner, max_m=max_m)
            q = rope_kv_cache(
                qkv,
                positions,
                self.cos,
                self.signed_sin,
                self.k_flat[index],
                self.v_flat[index],
                write_rows,
                num_heads=heads,
                num_kv_heads=kv_heads,
                signed_sin=True,
                tuner=tuner,
                max_m=max_m,
            )
            if self.contiguous_slots:
                keys = self.cache.k_layers[index][:batch]
                values = self.cache.v_layers[index][:batch]
            else:
                keys = self.cache.k_layers[index].index_select(0, slots)
                values = self.cache.v_layers[index].index_select(0, slots)
            inputs = [q.reshape(batch, kv_heads, self.groups, dim), keys, values, mask]
            if attend is None:
                # Every layer has the same shapes: one look-up per step (~10 us of host time).
                attend = tuner.choose_one(
                    attention_op.OP_NAME, attention_op.RUNNERS, self._attention_config, inputs
                )
            attn = attend[0].forward(inputs, attend[1])
            h, x = self.project_add_norm(
                attn.reshape(batch, heads * dim), layer.wo, x, layer.mlp_norm, 0
            )
            act = silu_and_mul(
                gemm(h, layer.w_gate_up, tuner=tuner, max_m=max_m), tuner=tuner, max_m=max_m
            )
            h, x = self.project_add_norm(act, layer.w_down, x, next_norm, 1)
        return gemm(h, model.lm_head, tuner=tuner, max_m=max_m)


def prefill(
    step: DecodeStep, tokens: torch.Tensor, slot: int, *, all_logits: bool = False
) -> torch.Tensor:
    """Runs a prompt through the model eagerly, filling positions ``[0, L)`` of ``slot``.

    Args:
        step: The decode step whose model, cache and RoPE tables to use.
        tokens: ``[L]`` prompt token ids on the model's device.
        slot: Cache slot owned by this request.
        all_logits: Return logits for every position (tests) instead of only the last.

    Returns:
        ``[vocab]`` logits of the last position, or ``[L, vocab]`` with ``all_logits``.
    """
    model, cfg = step.model, step.model.config
    length = tokens.shape[0]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
    eps = cfg.rms_norm_eps

    x = F.embedding(tokens, model.embed)
    cos = step.cos[:length, None, :]
    sin = step.sin[:length, None, :]
    query_pos = step.key_positions[:length]
    visible = query_pos[None, :] <= query_pos[:, None]
    if cfg.sliding_window is not None:
        visible = visible & (query_pos[None, :] > query_pos[:, None] - cfg.sliding_window)
    mask = torch.where(visible, step.zero, step.neg_inf)

    for index, layer in enumerate(model.layers):
        h = rms_norm(x, layer.attn_norm, eps)
        q, k, v = F.linear(h, layer.wqkv, layer.bqkv).split(step.split, dim=-1)
        q = apply_rope(q.view(length, heads, dim), cos, sin).transpose(0, 1)
        k = apply_rope(k.view(length, kv_heads, dim), cos, sin).transpose(0, 1)
        v = v.view(length, kv_heads, dim).transpose(0, 1)
        step.cache.k_layers[index][slot, :, :length].copy_(k)
        step.cache.v_layers[index][slot, :, :length].copy_(v)
        attn = F.scaled_dot_product_attention(
            q,
            k.repeat_interleave(step.groups, dim=0),
            v.repeat_interleave(step.groups, dim=0),
            attn_mask=mask,
        )
        x = x + step.reduce_partial(
            F.linear(attn.transpose(0, 1).reshape(length, heads * dim), layer.wo)
        )
        h = rms_norm(x, layer.mlp_norm, eps)
        x = x + step.reduce_partial(F.linear(swiglu(F.linear(h, layer.w_gate_up)), layer.w_down))
    if not all_logits:
        x = x[-1]
    return F.linear(rms_norm(x, model.final_norm, eps), model.lm_head)
