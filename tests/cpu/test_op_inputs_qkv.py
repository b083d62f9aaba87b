"""Every ``norm_qkv_rope`` runner refuses the RoPE operands ``rope_kv_cache`` refuses, with the
same InputError, before a kernel runs: the fused kernel indexes the caches and tables by them
alone, and took a short or 2-D ``write_rows``, a wide or 3-D cache or another dtype and read or
wrote out of bounds (a segfault, or ``munmap_chunk`` aborting the process)."""

from __future__ import annotations

import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.autotuner.calls import OpCall  # noqa: E402
from graphtune.errors import InputError  # noqa: E402
from graphtune.ops import _triton, rope_kv_cache  # noqa: E402
from graphtune.ops.fused import (  # noqa: E402
    TritonNormQkvRope,
    TritonQkvRopeAfterNorm,
    TritonQkvRopeNormInLoop,
    UnfusedNormQkvRope,
    norm_qkv_rope,
    norm_qkv_rope_config,
    norm_qkv_rope_runners,
)
from graphtune.ops.fused.qkv import OP_NAME  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

H, KV, D, B, K = 4, 2, 8, 3, 32
TACTIC = {"bn": 4, "bk": 16, "warps": 1, "dot": 0, "stages": 1, "split": 1}
RUNNERS = (TritonNormQkvRope, TritonQkvRopeNormInLoop, TritonQkvRopeAfterNorm)


def _inputs() -> list:
    torch.manual_seed(0)
    x, norm_weight, wqkv = torch.randn(B, K), torch.randn(K), torch.randn((H + 2 * KV) * D, K)
    cos, sin = torch.randn(8, D), torch.randn(8, D)
    caches = torch.zeros(20, D), torch.zeros(20, D)
    positions, rows = torch.randint(0, 8, (B,)), torch.arange(B * KV)
    return [x, norm_weight, wqkv, None, positions, cos, sin, *caches, rows, 1e-5, None]


def _with(index: int, value) -> list:
    inputs = _inputs()
    inputs[index] = value
    return inputs


# (index in the op's inputs, bad value, rope_kv_cache's message)
BAD = {
    "write_rows [B]": (9, torch.arange(B), "write_rows \\[B \\* kv_heads\\]=6"),
    "write_rows 2-D": (9, torch.arange(B * KV).view(B, KV), "write_rows \\[B \\* kv_heads\\]=6"),
    "write_rows int32": (9, torch.arange(B * KV, dtype=torch.int32), "must be int64"),
    "k_cache [rows, 2D]": (7, torch.zeros(20, 2 * D), "caches must be flattened"),
    "k_cache 3-D": (7, torch.zeros(2, 10, D), "caches must be flattened"),
    "v_cache 3-D": (8, torch.zeros(2, 10, D), "caches must be flattened"),
    "k_cache float16": (7, torch.zeros(20, D).half(), "caches must have x's dtype"),
    "v_cache on meta": (8, torch.zeros(20, D, device="meta"), "v_cache must be on x's device"),
    "write_rows on meta": (9, torch.arange(B * KV, device="meta"), "write_rows must be on x's"),
    "sin float16": (6, torch.randn(8, D).half(), "cos and sin must have x's dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("cls", RUNNERS, ids=lambda c: c.__name__)
def test_fused_qkv_runners_refuse_what_rope_kv_cache_refuses(cls, case):
    index, value, fragment = BAD[case]
    runner = cls(H, KV)
    inputs = _with(index, value)
    with pytest.raises(InputError, match=f"norm_qkv_rope: .*{fragment}"):
        runner.supports(inputs)
    with pytest.raises(InputError, match=f"norm_qkv_rope: .*{fragment}"):
        runner.forward(inputs, tactic=TACTIC)
    if value.device.type != "meta":
        # The same rule in rope_kv_cache (its qkv: the projection of x).
        x = inputs[0]
        qkv = torch.randn(x.shape[0], (H + 2 * KV) * D)
        rule = fragment.replace("x's", "qkv's")
        with pytest.raises(InputError, match=f"rope_kv_cache: .*{rule}"):
            rope_kv_cache(qkv, *inputs[4:10], num_heads=H, num_kv_heads=KV, tuner=AutoTuner())


def test_the_op_refuses_them_with_a_fused_runner_pinned():
    # A short write_rows has the pinned call's key, so the op ran the fused kernel: a segfault.
    tuner = AutoTuner(show_progress=False)
    runners = norm_qkv_rope_runners(H, KV, tuner=tuner)
    good = _inputs()
    tuner.pin(OpCall(OP_NAME, runners, norm_qkv_rope_config(KV), tuple(good)), 1, TACTIC)
    index, value, fragment = BAD["write_rows [B]"]
    bad = _with(index, value)
    x, norm_weight, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows, eps, _ = bad
    with pytest.raises(InputError, match=fragment):
        norm_qkv_rope(
            x, norm_weight, eps, wqkv, bqkv, positions, cos, sin, k_cache, v_cache, rows,
            num_heads=H, num_kv_heads=KV, tuner=tuner,
        )  # fmt: skip


def test_a_weight_on_another_device_is_refused():
    for index, name in ((1, "norm_weight"), (2, "wqkv")):
        inputs = _inputs()
        inputs[index] = inputs[index].to("meta")
        for runner in (UnfusedNormQkvRope(H, KV, tuner=AutoTuner()), TritonNormQkvRope(H, KV)):
            with pytest.raises(InputError, match=f"{name} must be on x's device cpu"):
                runner.unpack(inputs)


def test_good_inputs_still_pass():
    inputs = _inputs()
    for cls in RUNNERS:
        assert cls(H, KV).supports(inputs)
