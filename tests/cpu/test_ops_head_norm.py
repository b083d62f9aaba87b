"""The per-head q/k RMSNorm of Qwen3 and Qwen3-MoE (graphtune.ops.head_rms_norm_): in place on the
QKV output, as transformers' Qwen3RMSNorm rounds, values untouched, bad shapes refused."""

from __future__ import annotations

import pytest
import torch

from graphtune.errors import InputError
from graphtune.ops import head_norm_weights, head_rms_norm, head_rms_norm_


def _reference(qkv: torch.Tensor, q_w, k_w, heads: int, kv_heads: int, eps: float):
    # transformers' Qwen3RMSNorm per head: float32 statistics, rounded, then times the weight.
    dim = q_w.shape[0]
    out = qkv.clone()
    for start, count, weight in ((0, heads, q_w), (heads * dim, kv_heads, k_w)):
        part = qkv[:, start : start + count * dim].unflatten(-1, (count, dim))
        x = part.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(qkv.dtype)
        out[:, start : start + count * dim] = (weight * normed).flatten(1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rms_norm_normalises_q_and_k_heads_in_place(dtype):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, rows = 4, 2, 16, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    k_w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    want = _reference(qkv, q_w, k_w, heads, kv_heads, 1e-6)
    values = qkv[:, (heads + kv_heads) * dim :].clone()
    weights = head_norm_weights(q_w, k_w, heads, kv_heads)
    assert weights.shape == (heads + kv_heads, dim)
    assert head_rms_norm_(qkv, weights, 1e-6) is qkv
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(qkv, want, rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], values)  # the values untouched


def test_bad_shapes_are_refused():
    weights = head_norm_weights(torch.ones(8), torch.ones(8), 2, 1)
    with pytest.raises(InputError, match="head_rms_norm_ needs qkv"):
        head_rms_norm_(torch.zeros(2, 16), weights, 1e-6)  # narrower than the 3 heads of 8
    with pytest.raises(InputError, match="head_rms_norm_ needs qkv"):
        head_rms_norm_(torch.zeros(32, 2).T, weights, 1e-6)  # rows not contiguous
    with pytest.raises(InputError, match="head_norm_weights needs"):
        head_norm_weights(torch.ones(8), torch.ones(4), 2, 1)
    with pytest.raises(InputError, match="head_rms_norm needs qkv"):
        head_rms_norm(torch.zeros(2, 16), torch.ones(2, 0), 1e-6)  # D = 0: was a ZeroDivisionError
    with pytest.raises(InputError, match="head_rms_norm_ needs qkv"):
        head_rms_norm_(torch.zeros(2, 16), torch.ones(16), 1e-6)  # weights not 2-D


@pytest.mark.parametrize("op", [head_rms_norm, head_rms_norm_])
def test_weights_on_another_device_are_refused(op):
    # Was torch's own RuntimeError, which names neither the op nor the operand.
    weights = torch.ones(3, 8, device="meta")
    with pytest.raises(InputError, match="weights must be on qkv's device"):
        op(torch.zeros(2, 32), weights, 1e-6)


def test_out_of_place_form_rounds_as_the_in_place_form():
    # bf16 qkv with float32 weight rows: the in-place form rounds the product to bf16 when it
    # writes back; the out-of-place one returned it in float32.
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, (2 + 2 * 1) * 8, generator=gen).to(torch.bfloat16)
    weights = 1 + 0.1 * torch.randn(3, 8, generator=gen)
    got = head_rms_norm(qkv, weights, 1e-6)
    want = head_rms_norm_(qkv.clone(), weights, 1e-6)[:, : 3 * 8].unflatten(-1, (3, 8))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
