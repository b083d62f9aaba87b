"""The fused MoE router (graphtune.ops.moe.router): the one-kernel router GEMM + routing on the
CPU interpreter against float64, every tactic, split and unsplit, uneven K; its tactic rules;
the fused op's unfused runner and tuned pick; the step's OpContext.

Inputs are fresh random numbers per test; the seed is in the assertion message.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fake_timers import last_wins_tuner  # noqa: E402
from moe_cases import gen_seeded  # noqa: E402

from graphtune.autotuner import autotune  # noqa: E402
from graphtune.autotuner.identity import runner_id  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import OpContext, _triton  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    TritonMoeRouter,
    UnfusedMoeRouter,
    moe_router,
    moe_router_runners,
    torch_route_top_k,
)
from graphtune.ops.moe.router import MAX_TOKENS, OP_NAME, router_tactics  # noqa: E402
from graphtune.ops.moe.routing import OP_NAME as ROUTE_OP  # noqa: E402
from moe_routing_check import assert_routed_as_float64  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


# (tokens, experts, top_k, hidden): Qwen3-MoE-like routing (many experts, k = 8), Mixtral-like
# (8 experts, k = 2), an expert count that is not a power of two with a hidden size that no
# chunk divides (masked loads, a short last split), k = 1.
CASES = [(2, 128, 8, 256), (3, 8, 2, 512), (1, 60, 4, 200), (4, 16, 1, 128)]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tactic_routes_as_the_float64_product(tokens, experts, top_k, hidden, dtype):
    gen = gen_seeded()
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(dtype)
    for renormalize, weights_float32 in ((True, dtype == torch.float32), (False, True)):
        weights_dtype = torch.float32 if weights_float32 else dtype
        runner = TritonMoeRouter(top_k, renormalize, weights_float32)
        tactics = runner.get_valid_tactics([h, weight], None)
        # Split tactics everywhere; the case of 200 columns has a one-split tactic too.
        assert any(t["splits"] > 1 for t in tactics)
        for tactic in tactics:
            for _ in range(2):  # again: the arrival counters were set back to zero
                got_w, got_ids = runner.forward([h, weight], tactic=tactic)
                assert got_w.dtype == weights_dtype and got_ids.dtype == torch.int64
                assert got_ids.shape == (tokens, top_k) == got_w.shape
                label = (gen.initial_seed(), tactic)
                assert_routed_as_float64(got_w, got_ids, h, weight, top_k, renormalize, label)


def test_the_tactic_rules():
    # 128 experts: 32 or 64 weights a thread (chunks of 64 with 4 or 8 warps, of 128 with 8);
    # 8 splits at least, and every split gets a chunk: 2048 columns take up to 32 splits of 64,
    # 16 of 128.
    tactics = router_tactics(1, 128, 2048)
    assert {(t["bk"], t["warps"]) for t in tactics} == {(64, 4), (64, 8), (128, 8)}
    assert {t["splits"] for t in tactics if t["bk"] == 128} == {8, 16}
    assert {t["splits"] for t in tactics if t["bk"] == 64} == {8, 16, 32}
    # 8 experts (a 16-lane block).
    assert {(t["bk"], t["warps"]) for t in router_tactics(1, 8, 4096)} == {
        (64, 1),
        (128, 1),
        (128, 2),
        (256, 2),
        (256, 4),
    }
    # 200 columns: 4 chunks of 64 (the last one short), 2 of 128, 1 of 256: each chunk size
    # offers only its most splits.
    assert {(t["bk"], t["splits"]) for t in router_tactics(1, 60, 200)} == {
        (64, 4),
        (128, 2),
        (256, 1),
    }
    assert router_tactics(MAX_TOKENS + 1, 128, 2048) == []
    assert router_tactics(1, 512, 2048) == []
    assert router_tactics(1, 8, 0) == []  # no columns: was a ZeroDivisionError


def test_a_pick_serves_more_tokens_than_the_kernel_is_offered_for():
    # A bucket's pick serves every count that maps to it, past MAX_TOKENS too.
    gen = gen_seeded()
    h = torch.randn(MAX_TOKENS + 3, 64, generator=gen)
    weight = torch.randn(8, 64, generator=gen) / 8
    runner = TritonMoeRouter(2, True, True)
    tactic = router_tactics(1, 8, 64)[0]
    got_w, got_ids = runner.forward([h, weight], tactic=tactic)
    assert_routed_as_float64(got_w, got_ids, h, weight, 2, True, gen.initial_seed())


def test_bad_inputs_and_tactics():
    runner = TritonMoeRouter(2, True, True)
    h, weight = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ConfigError, match="TritonMoeRouter"):
        runner.forward([h, weight], tactic={"bk": 64, "splits": 3, "warps": 1})
    with pytest.raises(InputError, match="moe_router"):
        moe_router(h, torch.randn(8, 32), 2, renormalize=True)
    with pytest.raises(ConfigError, match="top_k"):
        moe_router(h, weight, 9, renormalize=True, tuner=last_wins_tuner())
    assert not runner.supports([h, torch.randn(64, 8).T])  # weight rows not contiguous
    assert runner.supports([h, weight])
    # A weights dtype that is neither float32 nor h's runs the unfused ops.
    w, _ = moe_router(h, weight, 2, renormalize=True, weights_dtype=torch.float64)
    assert w.dtype == torch.float64


def test_the_unfused_runner_is_the_gemm_then_the_routing_op():
    gen = gen_seeded()
    h = torch.randn(3, 96, generator=gen)
    weight = torch.randn(16, 96, generator=gen)
    unfused = UnfusedMoeRouter(4, False, True, tuner=last_wins_tuner())
    got_w, got_ids = unfused.forward([h, weight])
    want_w, want_ids = torch_route_top_k(h @ weight.T, 4, renormalize=False)
    assert torch.equal(got_ids, want_ids), gen.initial_seed()
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_the_tuned_op_and_the_step_context():
    gen = gen_seeded()
    h = torch.randn(3, 128, generator=gen)
    weight = torch.randn(16, 128, generator=gen) / 8
    tuner = last_wins_tuner()
    with autotune(None, tuner):
        weights, ids = OpContext(tuner, 4).moe_router(h, weight, 4, renormalize=True)
    rows = [row for row in tuner.summary_rows() if row[0] == OP_NAME]
    assert len(rows) == 3 and all("TritonMoeRouter" in row[2] for row in rows)  # 1, 2, 4
    assert_routed_as_float64(weights, ids, h, weight, 4, True, gen.initial_seed())
    # Unfused, the context runs the GEMM and the routing op: no fused-op look-up.
    unfused = last_wins_tuner()
    with autotune(None, unfused):
        OpContext(unfused, 4).unfused().moe_router(h, weight, 4, renormalize=True)
    ops_tuned = {row[0] for row in unfused.summary_rows()}
    assert OP_NAME not in ops_tuned and ROUTE_OP in ops_tuned
    # Each routing rule is its own runner identity.
    idents = {
        runner_id(r)
        for rule in ((4, True, True), (4, False, True), (2, True, False))
        for r in moe_router_runners(*rule, tuner=tuner)
    }
    assert len(idents) == 3 * len(moe_router_runners(4, True, True, tuner=tuner))
