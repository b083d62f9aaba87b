"""Decode attention as a tunable op: which SDPA backend, plain matmuls or a Triton
flash-decoding kernel is fastest per batch.

One decode token per request attends over a static KV cache. PyTorch's
``scaled_dot_product_attention`` picks a backend by rules, not by measurement, and for this shape
(a handful of query rows per KV head, a long key axis, an additive mask) the rule-picked backend
can be several times slower than another one at large batch. The tuner measures instead.

Inputs of every runner: ``[q, keys, values, mask]`` with ``q [B, kv_heads, groups, head_dim]``
(the query heads that share a KV head form that head's query "sequence"), ``keys`` and ``values``
``[B, kv_heads, seq, head_dim]``, and an additive ``mask [B, 1, 1, seq]`` that is ``-inf`` where a
key is masked. Every runner gives the same answer (up to rounding) for such masks, and 0 for a
row whose keys are all ``-inf`` (a padded row). A large finite value such as
``torch.finfo(dtype).min`` (a Hugging Face style mask) is not a mask here: the keys stay visible
with a tiny weight, and a row masked that way throughout is the mean of its values under the
torch runners but 0 under the Triton ones.

Runners (index 0 is the untuned fallback):

* :class:`SdpaAttention` — tactics force one SDPA backend (``-1``: PyTorch's own choice).
* :class:`MatmulAttention` — two batched matmuls around a float32 (or input-dtype) softmax.
* :class:`TritonDecodeAttention` — a Triton flash-decoding kernel (needs Triton): grid
  ``(B * kv_heads, splits)``, each program walks its slice of the key axis in ``block_n`` tiles
  with an online softmax; with ``splits > 1`` a second small kernel merges the float32 partials.
  Only the keys the mask leaves visible are read. Tactics are
  ``{"block_n", "splits", "warps", "stages"}`` (see :func:`decode_attention_tactics` for the
  pruning rules); ``-1`` is torch SDPA.

:class:`TritonDecodeAttentionOneKernel` (the same kernel's split tactics with the merge done by
the last split program of each row) is not among the op's :data:`RUNNERS`: it measured slower
(``graphtune.ops._pruned``).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from graphtune.autotuner import (
    FALLBACK_TACTIC,
    ConstraintSpec,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    get_tuner,
)
from graphtune.autotuner.calls import CallRecord
from graphtune.autotuner.config import last_power_of_two, next_power_of_two, power_of_two_buckets
from graphtune.errors import ConfigError, InputError
from graphtune.ops import _counters
from graphtune.ops._attention_layout import layout_problem, triton_layout_problem
from graphtune.ops._triton import device_limits, device_supported, kernel_module, run_kernel
from graphtune.ops._triton_runner import TritonRunner
from graphtune.ops.registry import register_op

OP_NAME = "decode_attention"


def attention_kernels() -> ModuleType:
    """The module of the decode-attention kernels (imported on first use; needs Triton)."""
    return kernel_module(
        "graphtune.ops._attention_kernels", "graphtune's Triton decode-attention kernels"
    )


def arrival_counters(device: torch.device, rows: int) -> torch.Tensor:
    """The persistent zeroed counters of the inline merge (``graphtune.ops._counters``).

    Raises:
        InputError: More than :data:`~graphtune.ops._counters.COUNTERS` rows.
    """
    return _counters.arrival_counters(
        device,
        rows,
        user="TritonDecodeAttentionOneKernel, (request, KV head) rows",
        fix="use TritonDecodeAttention for such batches",
    )


def _sdpa_backends() -> dict[str, Any]:
    """SDPA backends this torch build names (the cuDNN one arrived in torch 2.5)."""
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3: only the default dispatch is available
        return {}
    names = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
    return {
        tactic: getattr(SDPBackend, attr)
        for tactic, attr in names.items()
        if hasattr(SDPBackend, attr)
    }


class SdpaAttention(TunableRunner):
    """``F.scaled_dot_product_attention``; a tactic forces one backend.

    Tactic ``-1`` lets PyTorch choose (always valid). Flash attention is not offered: it takes no
    attention mask. A backend that rejects the shape raises, and the tuner records it as failed.
    """

    def get_valid_tactics(self, inputs: list[Any], profile: Any, **kwargs: Any) -> list[Any]:
        backends = list(_sdpa_backends()) if inputs[0].is_cuda else []
        return [FALLBACK_TACTIC, *backends]

    def forward(
        self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any
    ) -> torch.Tensor:
        q, keys, values, mask = inputs
        if tactic == FALLBACK_TACTIC:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends()[tactic]):
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class MatmulAttention(TunableRunner):
    """Attention as two batched matmuls around a float32 softmax: memory-bound like decode itself.

    Tactic ``-1`` keeps the scores in float32 through the softmax (the reference numerics);
    ``"low_precision"`` runs the softmax in the input dtype (one conversion kernel fewer). A row
    whose mask is all ``-inf`` gives 0 under both.
    """

    def get_valid_tactics(self, inputs: list[Any], profile: Any, **kwargs: Any) -> list[Any]:
        tactics: list[Any] = [FALLBACK_TACTIC]
        # The scores take the mask's dtype when they are added: a wider mask would promote them
        # and the second matmul would mix dtypes.
        if (
            inputs[0].dtype in (torch.float16, torch.bfloat16)
            and inputs[3].dtype == inputs[0].dtype
        ):
            tactics.append("low_precision")
        return tactics

    def forward(
        self, inputs: list[Any], tactic: Any = FALLBACK_TACTIC, **kwargs: Any
    ) -> torch.Tensor:
        q, keys, values, mask = inputs
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, keys.transpose(-1, -2))
        if tactic == FALLBACK_TACTIC:
            probs = torch.softmax(scores.float() * scale + mask.float(), dim=-1).to(q.dtype)
        else:
            # alpha, not a scalar tensor: a host-to-device copy cannot be captured.
            probs = torch.softmax(torch.add(mask, scores, alpha=scale), dim=-1)
        # A fully masked row (a padded one) is 0, as SDPA and the Triton kernel give, not the
        # softmax's NaN. On the device, no host sync: the test is on the mask, not the scores.
        probs = probs.masked_fill(torch.isneginf(mask).all(-1, keepdim=True), 0.0)
        return torch.matmul(probs, values)


#: ``(block_n, warps, stages)`` of the Triton tactics before the split count is chosen. Decode is
#: memory-bound: a few configs that vary the tile and the loads in flight are enough to time. The
#: small two-warp tile is for large batches, where one split per row already gives several
#: programs per SM and more of them resident beat wider tiles (on an H200 at batch 128:
#: ``benchmarks/results/logs/session35-call2-attention-sweep-probe-b128.log``,
#: ``benchmarks/results/attention-sweep-h200-b128-cea895b.json``, and the step in
#: ``benchmarks/results/decode-1b-attn-*-h200.json``).
TRITON_BASE_CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 3), (32, 2, 2))
#: A one-warp tile, offered only where the grid fills the GPU without splits (see the rules of
#: :func:`decode_attention_tactics`).
ONE_WARP_CONFIG = (32, 1, 2)
MAX_SPLITS = 64
#: Most programs per SM the split tactics aim at (see :func:`decode_attention_tactics`).
PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 132  # an H100/H200; used off-GPU
_DEFAULT_SMEM = 227 * 1024
_LOG2E = 1.4426950408889634


def decode_attention_tactics(
    batch: int,
    kv_heads: int,
    seq: int,
    head_dim: int = 64,
    *,
    itemsize: int = 2,
    sm_count: int = _DEFAULT_SMS,
    smem_bytes: int = _DEFAULT_SMEM,
) -> list[dict[str, int]]:
    """Triton decode-attention tactics worth timing for one shape (at most 15: five configs with
    the one-warp tile, three split counts each).

    Rules:

    * ``block_n`` comes from :data:`TRITON_BASE_CONFIGS`, clamped to
      ``max(16, next_power_of_two(seq))`` (a larger tile only loads padding); duplicates made by
      the clamp are dropped.
    * ``stages * 2 * block_n * head_dim * itemsize <= smem_bytes``: the pipelined K and V tiles
      fit in shared memory (an upper bound; Triton keeps ``stages - 1`` buffers). Only float32
      with ``head_dim >= 128`` loses configs; if none fits, the smallest tile with 2 stages stays.
    * ``splits`` are powers of two ``<= next_power_of_two(ceil(seq / block_n))`` (the kernel
      rounds a split's keys up to whole tiles, so the largest count gives every tile its own
      split and leaves the few splits past the last tile empty; the batch-1 steps this sped
      up: ``benchmarks/results/decode-*-splits-*.json``), ``<= MAX_SPLITS``, and
      ``<= PROGRAMS_PER_SM * sm_count / (batch * kv_heads)`` (more programs than fit on the SMs
      at once only add partials to merge; a program whose slice is one tile reads all of it
      before waiting for the kernel before, see ``graphtune.ops._attention_kernels``). Of
      those, ``1`` (one kernel, no merge), the largest and half the largest are kept.
    * :data:`ONE_WARP_CONFIG` as well when ``batch * kv_heads >= sm_count`` (one program per
      (request, KV head) already fills the GPU), with the split counts of the rule above (there
      at most 4, ``PROGRAMS_PER_SM * sm_count / programs``). At batch 128 on the H200
      (``benchmarks/results/attention-sweep-h200-b128-cea895b.json``) one-warp tiles were the
      fastest of the whole space, 3.6% ahead of the best base config.

    Args:
        batch: Batch rows (the bucket).
        kv_heads: Key/value heads.
        seq: Key axis length (the KV cache length).
        head_dim: Per-head width.
        itemsize: Bytes per K/V element.
        sm_count: Streaming multiprocessors of the GPU.
        smem_bytes: Shared memory one program may use.

    Returns:
        Tactic dicts in a fixed order (base config, then split count ascending), so ties in
        tuning go to the simpler config.
    """
    cap = max(16, next_power_of_two(seq))
    programs = max(1, batch * kv_heads)
    out: list[dict[str, int]] = []
    seen: set[tuple[int, int, int]] = set()
    bases = TRITON_BASE_CONFIGS + ((ONE_WARP_CONFIG,) if programs >= sm_count else ())
    configs = [(min(block_n, cap), warps, stages) for block_n, warps, stages in bases]
    fitting = [c for c in configs if c[2] * 2 * c[0] * head_dim * itemsize <= smem_bytes]
    for block_n, warps, stages in fitting or [(min(c[0] for c in configs), 4, 2)]:
        if (block_n, warps, stages) in seen:
            continue
        seen.add((block_n, warps, stages))
        tiles = next_power_of_two(-(-seq // block_n))
        limit = min(tiles, MAX_SPLITS, int(PROGRAMS_PER_SM * sm_count / programs))
        top = last_power_of_two(max(1, limit))
        for splits in sorted({1, max(1, top // 2), top}):
            out.append({"block_n": block_n, "splits": splits, "warps": warps, "stages": stages})
    return out


def check_decode_tactic(tactic: Any) -> str | None:
    """Why ``tactic`` is not a Triton decode-attention tactic, or ``None`` when it is one."""
    keys = {"block_n", "splits", "warps", "stages"}
    if not isinstance(tactic, dict) or set(tactic) != keys:
        return f"a tactic is a dict with keys {sorted(keys)} (or -1), got {tactic!r}"
    values = list(tactic.values())
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        return f"tactic values must be ints >= 1, got {tactic!r}"
    block_n, splits, warps = tactic["block_n"], tactic["splits"], tactic["warps"]
    if any(v & (v - 1) for v in (block_n, splits, warps)):
        return f"block_n, splits and warps must be powers of two, got {tactic!r}"
    if block_n < 16 or splits > MAX_SPLITS or warps > 16 or tactic["stages"] > 5:
        return (
            f"need block_n >= 16 (tl.dot), splits <= {MAX_SPLITS}, warps <= 16, "
            f"stages <= 5, got {tactic!r}"
        )
    return None


class TritonDecodeAttention(TritonRunner):
    """Flash-decoding in Triton (``graphtune.ops._attention_kernels.decode_attention_kernel``).

    Tactic ``-1`` is torch SDPA. Numerics follow flash attention: ``q . k`` on the input dtype
    with float32 accumulation (IEEE float32 products for float32 inputs), softmax in float32,
    probabilities rounded to the input dtype for the ``p . v`` product, one rounding of the
    output. Deterministic (no atomics) and capturable in a CUDA graph (the split workspace is
    allocated per call from the caching allocator; no host sync).

    Only keys the mask leaves visible (bias ``> -inf``) are read, so unlike SDPA its time grows
    with the decode positions, not with the cache length: a pick is timed on the tuner's
    synthetic inputs, whose random float mask leaves every key visible (the longest context).

    Args:
        sm_count: Override the device's SM count (tests, or to tune for another GPU's splits).
        compile_workers: Threads for ahead-of-time compilation.
    """

    source_modules = ("graphtune.ops._attention_kernels", "graphtune._split_k_jit")

    def __init__(self, *, sm_count: int | None = None, compile_workers: int | None = None) -> None:
        super().__init__(compile_workers=compile_workers)
        if sm_count is not None and (
            isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1
        ):
            raise ConfigError(
                f"TritonDecodeAttention: sm_count must be an int >= 1 or None, got {sm_count!r}."
            )
        self.sm_count = sm_count

    def cache_key_extras(self) -> tuple[Any, ...]:
        """An SM-count override changes the candidate set, so it is part of the identity."""
        return () if self.sm_count is None else ({"sm": self.sm_count},)

    def supports(self, inputs: list[Any]) -> bool:
        """See :func:`triton_layout_problem`; and a Triton device (CUDA, or the CPU
        interpreter)."""
        return triton_layout_problem(inputs) is None and device_supported(inputs[0].device)

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """See :func:`decode_attention_tactics`; SM count and shared memory come from the
        inputs' device (H100/H200 values off-GPU)."""
        q, keys = inputs[0], inputs[1]
        smem, sms = device_limits(q.device)
        return list(
            decode_attention_tactics(
                q.shape[0],
                q.shape[1],
                keys.shape[2],
                q.shape[3],
                itemsize=keys.element_size(),
                sm_count=self.sm_count or sms,
                smem_bytes=smem,
            )
        )

    def torch_forward(self, inputs: list[Any]) -> torch.Tensor:
        """``F.scaled_dot_product_attention``: the fallback tactic."""
        q, keys, values, mask = inputs
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    #: Whether the last split program merges the partials instead of a second kernel.
    inline_combine = False

    def launch(self, inputs: list[Any], tactic: Any, *, warmup: bool = False) -> torch.Tensor:
        """Runs the decode kernel (and with ``splits > 1`` the merge kernel, unless
        :attr:`inline_combine`); returns ``[B, KV, G, D]`` in q's dtype.

        Raises:
            InputError: Inputs the kernel cannot take (see :meth:`supports`).
            ConfigError: ``tactic`` breaks a rule of :func:`check_decode_tactic`.
        """
        problem = triton_layout_problem(inputs)
        if problem is not None:
            raise InputError(
                f"TritonDecodeAttention: {problem}; use tactic -1 (torch SDPA) or "
                "another runner for these inputs."
            )
        problem = check_decode_tactic(tactic)
        if problem is not None:
            raise ConfigError(
                f"TritonDecodeAttention: {problem}; pick a tactic from get_valid_tactics."
            )
        q, keys, values, mask = inputs
        batch, kv_heads, groups, dim = q.shape
        seq = keys.shape[2]
        out = torch.empty((batch, kv_heads, groups, dim), device=q.device, dtype=q.dtype)
        if out.numel() == 0:
            return out
        splits = tactic["splits"]
        # Float32 partials (acc, m, l) per split; with one split the kernel writes `out` itself.
        ws = (
            out
            if splits == 1
            else torch.empty(
                (batch * kv_heads, splits, groups, dim + 2), device=q.device, dtype=torch.float32
            )
        )
        inline = self.inline_combine and splits > 1
        counters = arrival_counters(q.device, batch * kv_heads) if inline else ws
        args = (
            q,
            keys,
            values,
            mask,
            out,
            ws,
            counters,
            kv_heads,
            groups,
            seq,
            _LOG2E / math.sqrt(dim),
            *q.stride(),
            *keys.stride(),
            *values.stride(),
            mask.stride(0) if mask.shape[0] > 1 else 0,
            mask.stride(3),
        )
        meta = dict(
            SPLITS=splits,
            BLOCK_G=max(16, next_power_of_two(groups)),
            HEAD_DIM=dim,
            BLOCK_N=tactic["block_n"],
            SCAN_BLOCK=max(16, min(512, next_power_of_two(seq))),
            IEEE=q.dtype == torch.float32,
            INLINE_COMBINE=inline,
            ONE_TILE=-(-seq // splits) <= tactic["block_n"],
            num_warps=tactic["warps"],
            num_stages=tactic["stages"],
        )
        kern = attention_kernels()
        run_kernel(kern.decode_attention_kernel, (batch * kv_heads, splits), args, meta, warmup)
        if splits > 1 and not inline:
            run_kernel(
                kern.decode_attention_combine_kernel,
                (batch * kv_heads * groups,),
                (ws, out, groups),
                dict(SPLITS=splits, HEAD_DIM=dim, num_warps=2),
                warmup,
            )
        return out


class TritonDecodeAttentionOneKernel(TritonDecodeAttention):
    """:class:`TritonDecodeAttention`'s split tactics (``splits > 1``) in one kernel each.

    The last split program of every (request, KV head) row merges the float32 partials in split
    order (deterministic), so there is no merge kernel and no kernel boundary before the output
    projection. The one-split tactics are the parent runner's (already one kernel), so they are
    not offered twice. Rows above ``graphtune.ops._counters.COUNTERS`` are not offered.

    It is not one of the op's :data:`RUNNERS`: measured, it lost to the split + combine pair at
    every tactic (:mod:`graphtune.ops._pruned`). ``benchmarks/attention_sweep.py`` times it.
    """

    inline_combine = True

    def tactics_for(self, inputs: list[Any]) -> list[Any]:
        """The parent's tactics with more than one split."""
        q = inputs[0]
        if q.shape[0] * q.shape[1] > _counters.COUNTERS:
            return []
        return [t for t in super().tactics_for(inputs) if t["splits"] > 1]


RUNNERS: tuple[TunableRunner, ...] = (
    SdpaAttention(),
    MatmulAttention(),
    TritonDecodeAttention(),
)


def tuning_config(max_batch_size: int) -> TuningConfig:
    """Batch is the dynamic dimension (power-of-two buckets up to ``max_batch_size``); keys,
    values and mask follow it."""
    follow_batch = [ConstraintSpec(i, 0, lambda shapes: shapes[0][0]) for i in (1, 2, 3)]
    return TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, _buckets),),
        constraint_specs=tuple(follow_batch),
        max_value=max_batch_size,
    )


def _buckets(max_value: int) -> tuple[int, ...]:
    return power_of_two_buckets(max_value)


def _rebuild(record: CallRecord, tuner: Any) -> tuple[tuple[TunableRunner, ...], TuningConfig]:
    return RUNNERS, tuning_config(record.config["max_value"])


register_op(OP_NAME, _rebuild)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    tuner: Any,
    config: TuningConfig,
) -> torch.Tensor:
    """Runs decode attention with the tuner's pick for this batch size (the fallback when untuned).

    Args:
        q, keys, values, mask: See the module docstring.
        tuner: The :class:`~graphtune.autotuner.AutoTuner` to ask; the process default when
            ``None``.
        config: From :func:`tuning_config`.

    Raises:
        InputError: The inputs do not have the layout of the module docstring.
    """
    inputs = [q, keys, values, mask]
    problem = layout_problem(inputs)
    if problem is not None:
        raise InputError(f"decode_attention: {problem}.")
    runner, tactic = (tuner or get_tuner()).choose_one(OP_NAME, RUNNERS, config, inputs)
    return runner.forward(inputs, tactic=tactic)
