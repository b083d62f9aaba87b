"""OpContext: the untuned context runs each op's fallback directly, bit for bit what the op
function's fallback (runner 0, tactic -1) computes; the tuned one looks picks up in its tuner."""

from __future__ import annotations

import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.errors import ConfigError
from graphtune.ops import OpContext, RopeRows

HEADS, KV, DIM, ROWS = 4, 2, 8, 3


def _calls(ops: OpContext) -> list[torch.Tensor]:
    """Every OpContext method on fixed inputs; returns every output and written buffer."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    a, w, bias = randn(ROWS, 16), randn(24, 16), randn(24)
    x, out = randn(ROWS, 24), torch.empty(ROWS, 24)
    norm = randn(24)
    qkv = randn(ROWS, (HEADS + 2 * KV) * DIM)
    cos, sin = randn(32, DIM), randn(32, DIM)
    k_cache, v_cache = torch.zeros(64, DIM), torch.zeros(64, DIM)
    positions = torch.tensor([3, 0, 17])
    rows = torch.tensor([0, 5, 9, 14, 40, 63])
    q, keys, values = randn(ROWS, KV, 2, DIM), randn(ROWS, KV, 32, DIM), randn(ROWS, KV, 32, DIM)
    mask = torch.where(torch.arange(32)[None, :] <= positions[:, None], 0.0, float("-inf"))
    results = [
        ops.gemm(a, w, bias),
        ops.gemm(a, w, residual=x.clone()),
        ops.gemm(a, w, residual=x.clone(), inplace=True),
        ops.gemm(a, w, residual=x, out=out).clone(),
        ops.rms_norm(x, norm, 1e-5),
        *ops.add_rms_norm(x, norm, 1e-5, a @ w.t()),
        ops.rope_kv_cache(
            qkv,
            RopeRows(positions, cos, sin, signed_sin=True),
            k_cache,
            v_cache,
            rows,
            num_heads=HEADS,
            num_kv_heads=KV,
        ),
        k_cache,
        v_cache,
        ops.silu_and_mul(randn(ROWS, 32)),
        ops.decode_attention(q, keys, values, mask[:, None, None, :]),
    ]
    return results


def test_untuned_context_is_the_op_functions_fallback_bit_for_bit() -> None:
    tuner = AutoTuner(show_progress=False)  # empty cache, not tuning: every look-up falls back
    direct = _calls(OpContext())
    looked_up = _calls(OpContext(tuner, 4))
    assert len(direct) == len(looked_up)
    for got, want in zip(direct, looked_up, strict=True):
        assert torch.equal(got, want)
    # The tuned context asked the tuner (and counted its fallbacks); the untuned one did not.
    assert set(tuner.stats.fallbacks) == {
        "graphtune.gemm",
        "graphtune.rms_norm",
        "graphtune.rope_kv_cache",
        "graphtune.silu_and_mul",
        "decode_attention",
    }
    assert not OpContext().tuned and OpContext(tuner, 4).tuned


def test_context_rules() -> None:
    with pytest.raises(ConfigError, match="needs max_batch_size"):
        OpContext(AutoTuner(show_progress=False))
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ConfigError, match="max_batch_size must be an int >= 1"):
            OpContext(None, bad)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        OpContext().tuner = None  # type: ignore[misc]  (frozen)


FUSED = {
    "graphtune.norm_qkv_rope",
    "graphtune.add_projection",
    "graphtune.norm_gate_up_silu",
    "graphtune.norm_linear",
}


def _stage_calls(ops: OpContext, normed: bool) -> list[torch.Tensor]:
    """The four layer stages on fixed inputs (``normed``: with the norm given); every output and
    written buffer."""
    gen = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    hidden = 16
    x, norm = randn(ROWS, hidden), 1 + 0.1 * randn(hidden)
    h = OpContext().rms_norm(x, norm, 1e-5) if normed else None
    wqkv, bqkv = randn((HEADS + 2 * KV) * DIM, hidden), randn((HEADS + 2 * KV) * DIM)
    cos, sin = randn(32, DIM), randn(32, DIM)
    k_cache, v_cache = torch.zeros(64, DIM), torch.zeros(64, DIM)
    positions, rows = torch.tensor([3, 0, 17]), torch.tensor([0, 5, 9, 14, 40, 63])
    rope = RopeRows(positions, cos, sin, signed_sin=True)
    residual = x.clone()
    q = ops.norm_qkv_rope(
        x, norm, 1e-5, wqkv, bqkv, rope, k_cache, v_cache, rows,
        num_heads=HEADS, num_kv_heads=KV, normed=h,
    )  # fmt: skip
    projected = ops.add_projection(residual, randn(ROWS, 12), randn(hidden, 12))
    assert projected is residual  # in place
    act = ops.norm_gate_up_silu(x, norm, 1e-5, randn(40, hidden), normed=h)
    logits = ops.norm_linear(x, norm, 1e-5, randn(50, hidden), normed=h)
    return [q, k_cache, v_cache, residual, act, logits]


@pytest.mark.parametrize("normed", [False, True])
def test_untuned_stages_are_the_fused_ops_fallback_and_the_unfused_context_bit_for_bit(
    normed: bool,
) -> None:
    fused_tuner, unfused_tuner = AutoTuner(show_progress=False), AutoTuner(show_progress=False)
    direct = _stage_calls(OpContext(), normed)
    fused = _stage_calls(OpContext(fused_tuner, 4), normed)
    unfused = _stage_calls(OpContext(unfused_tuner, 4).unfused(), normed)
    for got, via_fused, via_unfused in zip(direct, fused, unfused, strict=True):
        assert torch.equal(got, via_fused) and torch.equal(got, via_unfused)
    # Each fused op was asked (and fell back to its unfused runner, whose single ops were asked
    # too); the unfused context asked only the single ops; a given norm skips the fused ops.
    single = {"graphtune.gemm", "graphtune.rope_kv_cache", "graphtune.silu_and_mul"}
    assert single <= set(fused_tuner.stats.fallbacks)
    assert set(unfused_tuner.stats.fallbacks) & FUSED == set()
    if normed:
        assert set(fused_tuner.stats.fallbacks) & FUSED == {"graphtune.add_projection"}
        assert "graphtune.rms_norm" not in fused_tuner.stats.fallbacks
    else:
        assert FUSED <= set(fused_tuner.stats.fallbacks)
    assert OpContext(fused_tuner, 4).fused and not OpContext(fused_tuner, 4).unfused().fused


def _qk_norm_stage(ops: OpContext) -> list[torch.Tensor]:
    """The QKV stage of a Qwen3 layer (per-head q/k RMSNorm before RoPE) on fixed inputs."""
    gen = torch.Generator().manual_seed(2)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    hidden = 16
    x, norm = randn(ROWS, hidden), 1 + 0.1 * randn(hidden)
    wqkv = randn((HEADS + 2 * KV) * DIM, hidden)
    rope = RopeRows(torch.tensor([3, 0, 17]), randn(32, DIM), randn(32, DIM), signed_sin=True)
    k_cache, v_cache = torch.zeros(64, DIM), torch.zeros(64, DIM)
    rows = torch.tensor([0, 5, 9, 14, 40, 63])
    qk_norm = 1 + 0.1 * randn(HEADS + KV, DIM)
    q = ops.norm_qkv_rope(
        x, norm, 1e-5, wqkv, None, rope, k_cache, v_cache, rows,
        num_heads=HEADS, num_kv_heads=KV, qk_norm=qk_norm,
    )  # fmt: skip
    return [q, k_cache, v_cache]


def test_a_qk_norm_stage_is_the_fused_op_with_the_head_norm() -> None:
    # Fused, the stage is one norm_qkv_rope call carrying the head norm (its fallback runs the
    # three single ops); unfused, those ops without it (the RoPE op with the head norm). Untuned
    # (empty tuner), both give the torch code's numbers exactly.
    direct = _qk_norm_stage(OpContext())
    for fused in (True, False):
        tuner = AutoTuner(show_progress=False)
        ops = OpContext(tuner, 4) if fused else OpContext(tuner, 4).unfused()
        for got, want in zip(direct, _qk_norm_stage(ops), strict=True):
            assert torch.equal(got, want)
        asked = set(tuner.stats.fallbacks)
        assert ("graphtune.norm_qkv_rope" in asked) == fused
        assert {"graphtune.rms_norm", "graphtune.gemm", "graphtune.rope_kv_cache"} <= asked
