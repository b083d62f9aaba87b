"""The model's one forward, as a capturable decode step and as (eager) prefill.

:meth:`DecodeStep.forward` runs a flat batch of tokens with their positions and KV-cache write
rows through every layer, calling each op through an :class:`~graphtune.ops.OpContext`; only
attention differs between decode and prefill (:mod:`graphtune.engine.attention`). A layer is five
stages, each one tunable op of :mod:`graphtune.ops.fused` whose fallback is the unfused sequence:
[RMSNorm + QKV + RoPE + K/V write] -> [attention] -> [O-projection + residual] -> [RMSNorm +
gate/up + SiLU-and-mul] -> [down projection + residual]; then [final RMSNorm + LM head]. The norm
after a residual add is the next stage's prologue. Model features are small branches inside
these stages, where a stage runs its single ops when its fused kernel lacks the feature: a
per-head q/k RMSNorm (Qwen3, Qwen3-MoE) between the QKV projection and RoPE
(``OpContext.norm_qkv_rope(qk_norm=...)``); MLP biases and activations other than SiLU
(``OpContext.norm_gate_up_act``; the down projection's bias joins the residual); and a
mixture-of-experts MLP (router GEMM -> ``route_top_k`` -> ``fused_moe``, then the residual add:
:mod:`graphtune.engine.moe`) in place of the two dense MLP stages.

:class:`DecodeStep` is a pure function of three static-shaped tensors ``tokens [B]``,
``positions [B]`` and ``slots [B]`` (all int64 on the model's device) plus state that never moves
(weights, KV cache, RoPE tables). It does no host synchronisation and has no data-dependent shapes,
which is what a CUDA graph capture needs: K/V are written by index and attention covers every
cached position with a mask built from ``positions`` on the device.

Built with a tuner, every op runs the tuner's pick for its batch bucket (a fused kernel, or the
unfused sequence with each single op's own pick); without one, every op runs its torch fallback
(the same code, no look-ups): exactly the hand-written torch step. Tune by running the step in
tuning mode (:func:`graphtune.engine.tuning.tune_step`), so the keys tuned are the keys looked up.
Prefill (:mod:`graphtune.engine.prefill`) runs this forward on packed prompts with the untuned
ops and its attention as a graph break.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner.timing import l2_cache_bytes
from graphtune.engine.attention import Attention, DecodeAttention
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import DecoderModel, rope_tables
from graphtune.engine.moe import add_moe_mlp
from graphtune.errors import ConfigError
from graphtune.ops.context import OpContext
from graphtune.ops.rmsnorm import head_norm_weights
from graphtune.ops.rotary import RopeRows
from graphtune.ops.step_inputs import decode_inputs, decode_inputs_supported

logger = logging.getLogger(__name__)

#: The op context of prefill and of the untuned step: every op runs its torch fallback.
UNTUNED = OpContext()


def weights_stream_from_memory(model: DecoderModel) -> bool:
    """Whether a step of ``model`` finds its weights evicted from the last-level cache: true when
    the weights (``model.weight_bytes()``, a shard's own) exceed the L2 of their device (the
    largest CPU cache on the CPU), so each op's weights stream from memory once per step.

    The step's tuner then times its GEMMs with cold-L2 rotation: timed back to back in place, a
    weight that fits in L2 (a 1B model's QKV, O and down projections) would read from L2 and
    flatter the tactics that need the least latency hiding.
    """
    return model.weight_bytes() > l2_cache_bytes(model.device)


class DecodeStep:
    """One decode step for a batch of requests, as a callable for a graph runner.

    Args:
        model: Weights (already on the device and dtype of ``cache``).
        cache: The static KV cache the step writes and reads; its ``max_batch_size`` is the
            largest batch the step's ops are tuned and looked up for.
        contiguous_slots: When true the caller promises that row ``i`` of every call owns slot
            ``i`` (the engine keeps its live requests compacted), so attention reads the cache
            slots ``[0, B)`` as a view instead of gathering them by ``slots``; the K/V write still
            goes to ``slots`` so padded rows land in the scratch slot. When false, any slot
            mapping works and the cached K/V of the batch are gathered per layer (an extra copy
            of the batch's cache per step).
        tuner: An :class:`~graphtune.autotuner.AutoTuner` whose picks the step's ops run, tuned
            with :func:`graphtune.engine.tuning.tune_step`. An untuned shape runs the op's torch
            fallback and is counted in ``tuner.stats.fallbacks``. ``None`` (default): every op
            runs its torch fallback without a look-up.
        gemm_cold_l2: Tune the GEMMs and the fused ops with cold-L2 rotation (see
            :class:`~graphtune.ops.OpContext`). ``None`` (default): exactly when the model's
            weights exceed the device's L2 (:func:`weights_stream_from_memory`), as every
            pretrained LLM's do; the resolved choice is ``self.ops.gemm_cold_l2``.
        fused: Whether a tuned step's stages are the fused ops (default) or their unfused
            sequences of single ops (the step as tuned before the fused ops; for comparisons).

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
        gemm_cold_l2: bool | None = None,
        fused: bool = True,
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
        if tuner is None:
            self.ops = UNTUNED
        else:
            cold = weights_stream_from_memory(model) if gemm_cold_l2 is None else gemm_cold_l2
            self.ops = OpContext(tuner, cache.max_batch_size, cold, fused)
        device, dtype = model.device, model.dtype
        # Signed-sin tables: queries and keys share one RoPE pass of three kernels.
        self.cos, self.sin = rope_tables(cfg, cache.max_seq_len, device, dtype, signed_sin=True)
        # Constants built once so the step allocates nothing on the host side per call.
        self.key_positions = torch.arange(cache.max_seq_len, device=device, dtype=torch.long)
        self.kv_head_index = torch.arange(cfg.num_kv_heads, device=device, dtype=torch.long)
        self.neg_inf = torch.tensor(float("-inf"), device=device, dtype=dtype)
        self.zero = torch.tensor(0.0, device=device, dtype=dtype)
        self.groups = cfg.num_heads // cfg.num_kv_heads
        # Flattened per-layer views [slots * kv_heads * max_seq, head_dim] for the K/V writes.
        self.k_flat = [k.view(-1, cfg.dim_per_head) for k in cache.k_layers]
        self.v_flat = [v.view(-1, cfg.dim_per_head) for v in cache.v_layers]
        # The norm after each layer's MLP: the next layer's first norm, the final one at the end
        # (for a stage hook that computes it with the residual add: tensor parallelism's).
        self.next_norms = [layer.attn_norm for layer in model.layers[1:]] + [model.final_norm]
        # Qwen3's per-head q/k RMSNorm weight rows [heads + kv_heads, head_dim] per layer (the
        # QKV stage's qk_norm), None without.
        self.qk_norms = [
            None
            if layer.q_norm is None or layer.k_norm is None
            else head_norm_weights(layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads)
            for layer in model.layers
        ]

    @property
    def tuner(self) -> Any:
        """The tuner whose picks the step runs, or ``None`` (untuned)."""
        return self.ops.tuner

    @property
    def max_batch_size(self) -> int:
        """Largest batch the step serves (the KV cache's slots)."""
        return self.cache.max_batch_size

    def forward(
        self,
        ops: OpContext,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_rows: torch.Tensor,
        attention: Attention,
        *,
        logit_rows: torch.Tensor | None = None,
        embedded: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model on a flat batch of tokens; returns logits ``[rows, vocab]``.

        Args:
            ops: The op context every op is called through.
            tokens: ``[rows]`` token ids.
            positions: ``[rows]`` position of each token.
            write_rows: ``[rows * kv_heads]`` cache row of each (token, KV head) in the
                flattened per-layer cache (:meth:`write_rows`).
            attention: Decode or prefill attention (:mod:`graphtune.engine.attention`).
            logit_rows: Rows whose logits to compute (``[k]`` indices, e.g. each prompt's last
                token in prefill); ``None``: every row.
            embedded: ``embed[tokens]`` when the caller made it already (a fresh tensor: the
                layers add into it in place); ``None``: looked up here.
        """
        model, cfg = self.model, self.model.config
        eps = cfg.rms_norm_eps
        rope = RopeRows(positions, self.cos, self.sin, signed_sin=True)
        # A fresh tensor: the output projections add into it in place.
        x = F.embedding(tokens, model.embed) if embedded is None else embedded
        # rms_norm(x) when an output-projection hook produced it with the residual add (tensor
        # parallelism's fused all-reduce); the next stage then skips its norm prologue.
        normed: torch.Tensor | None = None
        for index, layer in enumerate(model.layers):
            q = ops.norm_qkv_rope(
                x,
                layer.attn_norm,
                eps,
                layer.wqkv,
                layer.bqkv,
                rope,
                self.k_flat[index],
                self.v_flat[index],
                write_rows,
                num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads,
                normed=normed,
                qk_norm=self.qk_norms[index],
            )
            x, normed = self.add_projection(
                ops, attention(index, q), layer.wo, x, layer.mlp_norm, 0
            )
            if layer.is_moe:
                x, normed = add_moe_mlp(ops, x, layer, cfg, normed), None
            else:
                act = ops.norm_gate_up_act(
                    x,
                    layer.mlp_norm,
                    eps,
                    layer.w_gate_up,
                    layer.b_gate_up,
                    cfg.hidden_act,
                    normed=normed,
                )
                if layer.b_down is not None:
                    # mlp_bias: the down projection's bias joins the residual it adds to.
                    x.add_(layer.b_down)
                x, normed = self.add_projection(
                    ops, act, layer.w_down, x, self.next_norms[index], 1
                )
        if logit_rows is not None:
            # The final norm is per row: selecting before it is selecting its result.
            x = x.index_select(0, logit_rows)
            normed = None if normed is None else normed.index_select(0, logit_rows)
        return ops.norm_linear(x, model.final_norm, eps, model.lm_head, normed=normed)

    def add_projection(
        self,
        ops: OpContext,
        a: torch.Tensor,
        weight: torch.Tensor,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        parity: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An output projection and the residual add, ``x += a @ weight.T`` in place (inside the
        GEMM: ``addmm_`` untuned), as ``(x, normed)``; ``normed`` is ``None`` here (the next
        stage normalises ``x`` in its prologue).

        The tensor-parallel step overrides this (its projections are row-parallel: an all-reduce
        after the GEMM, which may come fused with the add and ``rms_norm(x, norm_weight)``, then
        returned as ``normed``). ``parity`` alternates between the two calls of a layer (0 after
        attention, 1 after the MLP) so an override can alternate buffers.
        """
        return ops.add_projection(x, a, weight), None

    def write_rows(self, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Row of each (token, KV head) in the flattened cache: ``(slot * kv_heads + head) *
        max_seq_len + position``, as ``[rows * kv_heads]``."""
        heads = self.kv_head_index[None, :]
        rows = (slots[:, None] * self.model.config.num_kv_heads + heads) * self.cache.max_seq_len
        return (rows + positions[:, None]).reshape(-1)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        """Runs one decode step and returns logits ``[B, vocab]`` in the model dtype.

        Args:
            tokens: ``[B]`` the token each request feeds at this step.
            positions: ``[B]`` its position (= number of tokens already cached for the request).
            slots: ``[B]`` the KV-cache slot of each row (the scratch slot for padded rows).
        """
        return self.decode(self.ops, tokens, positions, slots)

    def decode(
        self,
        ops: OpContext,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step through the op context ``ops`` (``__call__`` passes the step's own;
        :func:`~graphtune.engine.tuning.tune_step` also runs it unfused)."""
        embed = self.model.embed
        x: torch.Tensor | None = None
        mask: torch.Tensor | None = None
        if ops.tuned and decode_inputs_supported(embed):
            # One kernel for the embedding rows, the KV write rows and the mask (torch: seven).
            x, write_rows, mask = decode_inputs(
                tokens,
                positions,
                slots,
                embed,
                kv_heads=self.model.config.num_kv_heads,
                max_seq=self.cache.max_seq_len,
                window=self.model.config.sliding_window,
                mask_dtype=self.zero.dtype,
            )
        else:
            write_rows = self.write_rows(positions, slots)
        attention = DecodeAttention(self, ops, positions, slots, mask=mask)
        return self.forward(ops, tokens, positions, write_rows, attention, embedded=x)

    def example_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step inputs of ``batch`` rows that write only the scratch slot (capture, tuning)."""
        device = self.model.device
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return zeros, zeros.clone(), torch.full_like(zeros, self.cache.scratch_slot)


def step_pad_rule(scratch_slot: int) -> tuple[int, int, int]:
    """Pad rule for the decode step's inputs ``(tokens, positions, slots)``.

    Padded rows feed token 0 at position 0 and write into the scratch slot, so whatever they
    compute lands where no live request reads.
    """
    return (0, 0, scratch_slot)
