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


BAD_EPS = [float("nan"), float("inf"), -1e-6, "1e-6", None, True]


def _qkv_and_weights():
    from graphtune.ops import head_norm_weights

    # 2 query heads, 1 key/value head of D = 4: qkv [3, (2 + 2) * 4].
    return torch.randn(3, 16), head_norm_weights(torch.randn(4), torch.randn(4), 2, 1)


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
@pytest.mark.parametrize("name", ["head_rms_norm", "head_rms_norm_"])
def test_head_rms_norm_checks_eps_as_the_other_norms(name, eps):
    # A NaN made every q/k head NaN; "1e-6" raised a raw TypeError inside torch.
    from graphtune import ops
    from graphtune.errors import ConfigError

    qkv, weights = _qkv_and_weights()
    before = qkv.clone()
    with pytest.raises(ConfigError, match=f"{name}: eps must be a finite float >= 0"):
        getattr(ops, name)(qkv, weights, eps)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
def test_rope_kv_cache_checks_head_norm_eps(eps):
    from graphtune.errors import ConfigError
    from graphtune.ops import rope_kv_cache
    from graphtune.ops.rotary import TorchRopeRunner

    qkv, weights = _qkv_and_weights()
    cos, sin = torch.randn(8, 4), torch.randn(8, 4)
    k_cache, v_cache = torch.zeros(4, 4), torch.zeros(4, 4)
    positions, rows = torch.arange(3), torch.arange(3)
    inputs = [qkv, positions, cos, sin, k_cache, v_cache, rows, weights, eps]
    with pytest.raises(ConfigError, match="rope_kv_cache: eps must be a finite float >= 0"):
        rope_kv_cache(
            *inputs[:7], num_heads=2, num_kv_heads=1, head_norm=weights, head_norm_eps=eps,
            tuner=TUNER,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="rope_kv_cache: eps must be a finite float >= 0"):
        TorchRopeRunner(2, 1).forward(inputs)
    assert not k_cache.any()


def test_an_int_eps_beyond_a_floats_range_is_a_short_config_error():
    # 10**400 passed 0 <= eps < inf, and float() of it raised OverflowError.
    from graphtune.errors import ConfigError
    from graphtune.ops.rmsnorm import check_eps

    with pytest.raises(ConfigError, match="rms_norm: eps must be a finite float >= 0") as caught:
        check_eps("rms_norm", 10**400)
    assert "an int of about 401 digits" in str(caught.value) and len(str(caught.value)) < 200


def test_a_tensor_passed_as_eps_is_named_by_type_and_shape_only():
    # norm_linear(x, eps, norm_weight, ...) printed the whole weight in the ConfigError.
    from graphtune.errors import ConfigError
    from graphtune.ops.fused import norm_linear

    x, norm_weight, weight = torch.randn(2, 64), torch.randn(64), torch.randn(8, 64)
    with pytest.raises(ConfigError) as caught:
        norm_linear(x, 1e-6, norm_weight, weight, tuner=TUNER)
    message = str(caught.value)
    assert "got a Tensor of shape (64,)" in message and "\n" not in message
    assert len(message) < 200, message


def test_head_rms_norm_takes_an_int_eps():
    from graphtune import ops

    qkv, weights = _qkv_and_weights()
    torch.testing.assert_close(
        ops.head_rms_norm(qkv, weights, 0), ops.head_rms_norm(qkv, weights, 0.0)
    )
