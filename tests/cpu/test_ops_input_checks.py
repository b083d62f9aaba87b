"""The public ops refuse operands that do not fit with an InputError that names the operand, the
rule and the fix, before anything runs (torch's own error, deep inside a runner, names none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.errors import InputError
from graphtune.ops import gemm

A, W = torch.randn(2, 3, 8), torch.randn(16, 8)
TUNER = AutoTuner(show_progress=False)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"weight": W.double()}, "weight is torch.float64 but a is torch.float32"),
        ({"bias": torch.randn(16).double()}, "bias is torch.float64"),
        ({"residual": torch.randn(2, 3, 16).double()}, "residual is torch.float64"),
        ({"bias": torch.randn(5)}, "bias must be [N] = [16]"),
        ({"residual": torch.randn(3, 2, 16)}, "residual must be a's leading shape then N"),
        ({"a": torch.tensor(1.0)}, "a must be a tensor with at least one dim"),
        ({"a": np.ones((2, 8), dtype=np.float32)}, "a must be a tensor"),
        ({"weight": W.to("meta")}, "weight must be on a's device cpu"),
        (
            {"residual": torch.randn(3, 2, 16).transpose(0, 1), "inplace": True},
            "with more than two dims must be contiguous",
        ),
    ],
)
def test_gemm_names_the_operand_that_does_not_fit(kwargs, fragment):
    args = {"a": A, "weight": W, **kwargs}
    with pytest.raises(InputError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        gemm(args.pop("a"), args.pop("weight"), tuner=TUNER, **args)


def test_gemm_takes_a_residual_with_a_leading_shape_or_flattened():
    bias = torch.randn(16)
    want = A @ W.T + bias
    for residual in (torch.zeros(2, 3, 16), torch.zeros(6, 16)):
        out = gemm(A, W, bias, residual, tuner=TUNER)
        torch.testing.assert_close(out, want)


def _attention_inputs(batch=2, kv=2, groups=2, seq=5, dim=16):
    q = torch.randn(batch, kv, groups, dim)
    keys, values = torch.randn(batch, kv, seq, dim), torch.randn(batch, kv, seq, dim)
    return q, keys, values, torch.zeros(batch, 1, 1, seq)


def test_an_output_that_shares_memory_with_an_operand_is_refused():
    # Writing the result where the op still reads an operand gave relative errors near 1, on the
    # torch path too (addmm_ does not detect it).
    from graphtune.ops.fused import add_projection

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    calls = {
        "out and a": lambda y: gemm(y, w, out=y, tuner=TUNER),
        "residual and a": lambda y: gemm(y, w, residual=y, inplace=True, tuner=TUNER),
        "residual and weight": lambda y: gemm(x, w, residual=w[:4], inplace=True, tuner=TUNER),
        "add_projection": lambda y: add_projection(y, y, w, tuner=TUNER),
    }
    both = torch.randn(8, 8)  # one storage, apart: rows 0-3 read, rows 4-7 written
    assert torch.allclose(gemm(both[:4], w, out=both[4:], tuner=TUNER), both[:4] @ w.T)
    for name, call in calls.items():
        y = x.clone()
        with pytest.raises(InputError, match="share memory"):
            call(y)
        assert torch.equal(y, x), name  # refused before anything ran


def test_a_bias_or_residual_inside_the_written_tensor_is_refused():
    # A bias in the written tensor gave wrong rows on the Triton path (one tile overwrote it
    # before another read it) and a raw torch RuntimeError on the torch path; so did an out=
    # that overlaps the residual without being it.
    a, w = torch.randn(4, 8), torch.randn(8, 8)
    calls = {
        "bias in the residual": lambda y: gemm(a, w, y[1], residual=y, inplace=True, tuner=TUNER),
        "bias in out": lambda y: gemm(a, w, y[1], out=y, tuner=TUNER),
        "residual one row off out": lambda y: gemm(a, w, residual=y[:4], out=y[1:], tuner=TUNER),
    }
    for name, call in calls.items():
        y = torch.randn(5, 8)[: 5 if "off" in name else 4]
        before = y.clone()
        with pytest.raises(InputError, match="share memory|overlaps residual"):
            call(y)
        assert torch.equal(y, before), name  # refused before anything ran
    residual = torch.randn(4, 8)
    want = residual + a @ w.T
    assert gemm(a, w, residual=residual, out=residual, tuner=TUNER) is residual  # the same view
    assert torch.allclose(residual, want, atol=1e-5)


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda q, k, v, m: (q, k, v[:, :, :-1], m), "keys == values"),
        (lambda q, k, v, m: (q, k[:, :1], v[:, :1], m), "do not match q"),
        (lambda q, k, v, m: (q, k, v, m[..., :-1]), "additive mask"),
        (lambda q, k, v, m: (q.bfloat16(), k, v, m), "one dtype"),
        (lambda q, k, v, m: (q, k, v, m.long()), "float dtype"),
        (lambda q, k, v, m: (q[0], k, v, m), "q \\[B, KV, G, D\\]"),
        (lambda q, k, v, m: (q, k, v, None), "mask must be tensors"),
    ],
)
def test_decode_attention_names_the_layout_rule_for_every_runner(change, fragment):
    from graphtune.ops.attention import decode_attention, tuning_config

    q, keys, values, mask = change(*_attention_inputs())
    with pytest.raises(InputError, match=fragment):
        decode_attention(q, keys, values, mask, tuner=TUNER, config=tuning_config(4))


def _rope_inputs(dim=8, heads=2, kv=1, batch=2):
    qkv = torch.randn(batch, (heads + 2 * kv) * dim)
    cos, sin = torch.randn(16, dim), torch.randn(16, dim)
    k_cache, v_cache = torch.zeros(64, dim), torch.zeros(64, dim)
    positions, rows = torch.arange(batch), torch.arange(batch * kv)
    return [qkv, positions, cos, sin, k_cache, v_cache, rows]


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda x: [x[0], x[1].float(), *x[2:]], "must be int64"),
        (lambda x: [*x[:4], x[4].double(), *x[5:]], "must have qkv's dtype"),
        # Unchecked, these four fail inside torch's index ops with torch's own errors.
        (lambda x: [*x[:2], x[2].double(), x[3].double(), *x[4:]], "cos and sin must have qkv"),
        (lambda x: [*x[:5], x[5][:, None], x[6]], "caches must be flattened"),
        (lambda x: [*x[:6], x[6] + 64], "write_rows rows of the caches"),
        (lambda x: [x[0], x[1] + 16, *x[2:]], "positions must index rows of cos/sin"),
        (lambda x: [*x[:4], x[4].to("meta"), *x[5:]], "k_cache must be on qkv's device cpu"),
        (lambda x: [x[0], x[1].to("meta"), *x[2:]], "positions must be on qkv's device cpu"),
        (lambda x: [*x[:2], x[2][0], *x[3:]], "cos and sin must be \\[rows, D\\] tables"),
    ],
)
def test_rope_kv_cache_names_the_input_that_does_not_fit(change, fragment):
    from graphtune.ops import rope_kv_cache

    qkv, positions, cos, sin, k_cache, v_cache, rows = change(_rope_inputs())
    with pytest.raises(InputError, match=fragment):
        rope_kv_cache(
            qkv, positions, cos, sin, k_cache, v_cache, rows, num_heads=2, num_kv_heads=1,
            tuner=TUNER,
        )  # fmt: skip


def test_rope_kv_cache_refuses_a_head_norm_on_another_device():
    from graphtune.ops import rope_kv_cache

    norm = torch.ones(3, 8, device="meta")
    with pytest.raises(InputError, match="head_norm must be .* on cpu"):
        rope_kv_cache(*_rope_inputs(), num_heads=2, num_kv_heads=1, head_norm=norm, tuner=TUNER)


def test_rope_kv_cache_refuses_an_odd_head_dim():
    from graphtune.ops import rope_kv_cache

    x = _rope_inputs(dim=7)
    with pytest.raises(InputError, match="D must be even"):
        rope_kv_cache(*x, num_heads=2, num_kv_heads=1, tuner=TUNER)


def test_norm_and_activation_name_an_integer_input():
    from graphtune.ops import fused_add_rms_norm, silu_and_mul

    ints = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(InputError, match="rms_norm needs a float x"):
        fused_add_rms_norm(ints, torch.ones(8), 1e-5, tuner=TUNER)
    with pytest.raises(InputError, match="silu_and_mul needs a float gate_up"):
        silu_and_mul(ints, tuner=TUNER)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda ops: ops.fused_add_rms_norm(torch.tensor(1.0), torch.ones(1), 1e-5, tuner=TUNER),
         "fused_add_rms_norm: x must be"),
        (lambda ops: ops.silu_and_mul(torch.tensor(1.0), tuner=TUNER),
         "silu_and_mul: gate_up must be"),
        # The torch-only activations (silu goes through silu_and_mul's checks).
        (lambda ops: ops.gated_activation(torch.randn(3, 7), "gelu", tuner=TUNER),
         "gated_activation: gate_up must be"),
        (lambda ops: ops.gated_activation(torch.randn(3, 7), "relu2", tuner=TUNER),
         "gated_activation: gate_up must be"),
    ],
)  # fmt: skip
def test_norm_and_activation_name_a_0d_input_or_an_odd_gate_up(call, fragment):
    import graphtune.ops as ops

    with pytest.raises(InputError, match=fragment):
        call(ops)


@pytest.mark.parametrize("operand", ["weight", "residual"])
def test_rms_norm_names_an_operand_on_another_device(operand):
    from graphtune.ops import fused_add_rms_norm

    x = torch.randn(3, 16)
    args = {"weight": torch.ones(16), "residual": torch.randn(3, 16)}
    args[operand] = args[operand].to("meta")
    with pytest.raises(InputError, match=f"rms_norm: {operand} must be on x's device cpu"):
        fused_add_rms_norm(x, args["weight"], 1e-6, args["residual"], tuner=TUNER)


def test_head_rms_norm_refuses_weight_rows_that_do_not_fit_the_heads():
    from graphtune.ops.rmsnorm import head_rms_norm

    qkv = torch.randn(2, (4 + 2 * 2) * 16)  # 4 query heads, 2 key/value heads, D = 16
    assert head_rms_norm(qkv, torch.ones(6, 16), 1e-6).shape == (2, 6, 16)
    with pytest.raises(InputError, match="head_rms_norm needs qkv"):
        head_rms_norm(qkv, torch.ones(3, 16), 1e-6)  # half the q/k heads
