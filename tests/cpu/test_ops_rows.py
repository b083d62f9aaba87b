"""graphtune.ops._rows: rows without a reshape call when there is nothing to flatten."""

from __future__ import annotations

import torch

from graphtune.ops import gemm
from graphtune.ops._rows import as_rows, from_rows
from graphtune.ops.rmsnorm import fused_add_rms_norm


def test_2d_tensors_pass_through_and_others_are_reshaped():
    x = torch.randn(4, 8)
    assert as_rows(x) is x and from_rows(x, (4,), 8) is x
    y = torch.randn(2, 3, 8)
    assert as_rows(y).shape == (6, 8) and as_rows(y).data_ptr() == y.data_ptr()
    assert from_rows(as_rows(y), (2, 3), 8).shape == (2, 3, 8)
    assert from_rows(torch.randn(6, 8), (6,), 8).shape == (6, 8)
    assert from_rows(torch.randn(2, 24), (6,), 8).shape == (6, 8)  # not its shape: reshaped


def test_ops_keep_leading_dimensions():
    a, w, x = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(2, 3, 8)
    assert torch.allclose(gemm(a, w), a @ w.T, atol=1e-6)
    out, res = fused_add_rms_norm(x, torch.ones(8), 1e-6, residual=x.clone())
    assert out.shape == res.shape == (2, 3, 8) and torch.allclose(res, 2 * x)
