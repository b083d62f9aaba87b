"""The norm ops' argument checks: a residual of another shape and a bad epsilon are refused
before anything runs."""

from __future__ import annotations

import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.errors import InputError
from graphtune.ops import fused_add_rms_norm

TUNER = AutoTuner(show_progress=False)


@pytest.mark.parametrize(
    "residual",
    [torch.randn(3, 2, 8), torch.randn(6, 8), torch.randn(2, 3, 8)[:, :1]],
    ids=["transposed lead", "flattened", "fewer rows"],
)
def test_fused_add_rms_norm_refuses_a_residual_of_another_shape(residual):
    # The same numel was taken and added in another element order.
    x = torch.randn(2, 3, 8)
    with pytest.raises(InputError, match=r"residual must have x's shape \(2, 3, 8\)"):
        fused_add_rms_norm(x, torch.ones(8), 1e-6, residual, tuner=TUNER)


def test_fused_add_rms_norm_takes_a_residual_of_x_shape():
    x, residual = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    out, new_residual = fused_add_rms_norm(x, torch.ones(8), 1e-6, residual, tuner=TUNER)
    torch.testing.assert_close(new_residual, x + residual)
    assert out.shape == x.shape
