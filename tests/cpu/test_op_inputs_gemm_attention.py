"""gemm(a_3d, w, out=o) returns [..., N] as without out=, and decode_attention refuses integer
q/k/v with an InputError (they passed the layout check and failed inside torch)."""

from __future__ import annotations

import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.errors import InputError
from graphtune.ops import gemm

TUNER = AutoTuner(show_progress=False)


@pytest.mark.parametrize("lead", [(2, 3), (6,), ()], ids=str)
def test_gemm_with_out_returns_the_shape_it_returns_without(lead):
    a, w = torch.randn(*lead, 8), torch.randn(5, 8)
    out = torch.empty(max(1, a.numel() // 8), 5)
    got = gemm(a, w, out=out, tuner=TUNER)
    want = gemm(a, w, tuner=TUNER)
    assert got.shape == want.shape == (*lead, 5)
    assert got.data_ptr() == out.data_ptr()  # out's memory, not a copy
    if len(lead) == 1:
        assert got is out
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_decode_attention_refuses_integer_q_k_v(dtype):
    from graphtune.ops.attention import decode_attention, tuning_config

    q, keys = torch.ones(2, 2, 2, 16, dtype=dtype), torch.ones(2, 2, 5, 16, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 5)
    with pytest.raises(InputError, match=f"need a floating dtype, got {dtype}"):
        decode_attention(q, keys, keys.clone(), mask, tuner=TUNER, config=tuning_config(4))
