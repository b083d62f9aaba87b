"""Decode attention's runners agree on a fully masked row (a padded batch row): 0, as SDPA and
the Triton kernel give. MatmulAttention, one of the op's runners, gave NaN, so a tuned pick of it
made padded rows NaN."""

from __future__ import annotations

import pytest
import torch

from graphtune.ops.attention import MatmulAttention, SdpaAttention


def _inputs(dtype):
    torch.manual_seed(0)
    q, keys = torch.randn(2, 1, 2, 16, dtype=dtype), torch.randn(2, 1, 8, 16, dtype=dtype)
    values = torch.randn(2, 1, 8, 16, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 8, dtype=dtype)
    mask[0, ..., 6:] = float("-inf")
    mask[1] = float("-inf")  # row 1 is padding
    return [q, keys, values, mask]


@pytest.mark.parametrize(
    "dtype, tactic",
    [(torch.float32, -1), (torch.float16, -1), (torch.float16, "low_precision")],
)
def test_matmul_attention_gives_zero_for_a_fully_masked_row(dtype, tactic):
    inputs = _inputs(dtype)
    runner = MatmulAttention()
    assert tactic in runner.get_valid_tactics(inputs, None)
    out = runner.forward(inputs, tactic)
    want = SdpaAttention().forward([t.float() for t in inputs])
    assert not out.isnan().any()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(want[1], torch.zeros_like(want[1]))
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out[0].float(), want[0], rtol=tol, atol=tol)


def test_a_large_finite_mask_is_not_a_padded_row():
    q, keys, values, mask = _inputs(torch.float32)
    mask[1] = -1e30  # finite: the softmax is uniform, as SDPA's
    out = MatmulAttention().forward([q, keys, values, mask])
    torch.testing.assert_close(out, SdpaAttention().forward([q, keys, values, mask]))
