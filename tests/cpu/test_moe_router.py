"""The router as one op (moe_router): the fused Triton kernel (router GEMV + top-k in one launch)
on the CPU interpreter against float64 logits and the torch router, every tactic, the arrival
counters left at zero, the tactic rule, and the tuned op through a step's OpContext.

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

from graphtune.autotuner import autotune  # noqa: E402
from graphtune.autotuner.identity import runner_id  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import OpContext, _counters, _triton  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    TritonMoeRouter,
    UnfusedMoeRouter,
    moe_router,
    moe_router_runners,
    moe_router_tactics,
    torch_moe_router,
    torch_route_top_k,
)
from graphtune.ops.moe.router import MAX_FUSED_TOKENS  # noqa: E402
from graphtune.ops.moe.router import OP_NAME as ROUTER_OP  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


# (tokens, experts, hidden, top_k): Qwen3-30B-A3B's routing (128 experts, top 8) at a small
# hidden size, Mixtral's (8, top 2) with a hidden size that is not a multiple of any chunk, an
# expert count that is not a power of two, and k = E.
CASES = [(1, 128, 256, 8), (3, 8, 320, 2), (2, 60, 96, 4), (1, 6, 64, 6)]


@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k"), CASES)
# float16, not bfloat16: the interpreter casts float32 to bfloat16 by truncation (a GPU rounds
# to nearest even), so it would round the logits unlike the reference.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_tactic_routes_the_float64_logits_rounded_to_the_dtype(
    tokens, experts, hidden, top_k, dtype
):
    gen = _gen()
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    # The GEMM's output: the exact products, rounded once to the dtype.
    logits = (h.double() @ weight.double().T).to(dtype)
    probs = torch.softmax(logits.double(), dim=-1)
    for renormalize, weights_float32 in ((True, False), (False, True)):
        weights_dtype = torch.float32 if weights_float32 else dtype
        runner = TritonMoeRouter(top_k, renormalize, weights_float32)
        want_w, want_ids = torch_route_top_k(
            logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype
        )
        tactics = runner.get_valid_tactics([h, weight], None)
        assert tactics == moe_router_tactics(tokens, experts, hidden) and tactics
        for tactic in tactics:
            got_w, got_ids = runner.forward([h, weight], tactic=tactic)
            assert got_w.dtype == weights_dtype and got_ids.dtype == torch.int64
            assert got_w.shape == got_ids.shape == (tokens, top_k)
            # Compared by the probabilities chosen: equal logits (possible in float16) may be
            # taken in another order.
            chosen = probs.gather(1, got_ids)
            assert torch.equal(chosen, probs.gather(1, want_ids)), (gen.initial_seed(), tactic)
            assert (chosen[:, :-1] >= chosen[:, 1:]).all()  # largest first
            tol = 1e-6 if weights_dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol, atol=tol)


def test_the_counters_are_zero_after_each_call_so_the_next_call_routes_again():
    gen = _gen()
    h = torch.randn(4, 128, generator=gen)
    weight = torch.randn(16, 128, generator=gen)
    runner = TritonMoeRouter(2, True, True)
    tactic = runner.get_valid_tactics([h, weight], None)[-1]
    first = runner.forward([h, weight], tactic=tactic)
    counters = _counters.arrival_counters(h.device, 4, user="test", fix="none")
    assert not counters[:4].any()
    second = runner.forward([h, weight], tactic=tactic)
    want_w, want_ids = torch_moe_router(h, weight, 2, renormalize=True)
    for got_w, got_ids in (first, second):
        assert torch.equal(got_ids, want_ids), gen.initial_seed()
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_the_tactic_rule():
    tactics = moe_router_tactics(1, 128, 2048)
    assert tactics
    for t in tactics:
        assert t["rows"] in (1, 2) and t["block"] in (512, 1024, 2048)
        assert t["rows"] * t["block"] // (32 * t["warps"]) in (16, 32)
    # A chunk is never wider than the hidden size rounded up; few experts take few rows.
    assert {t["block"] for t in moe_router_tactics(2, 8, 100)} == {128}
    assert {t["rows"] for t in moe_router_tactics(1, 1, 64)} == {1}
    assert moe_router_tactics(MAX_FUSED_TOKENS, 128, 2048) == tactics
    assert moe_router_tactics(MAX_FUSED_TOKENS + 1, 128, 2048) == []


def test_bad_inputs_and_tactics_say_what_to_fix():
    runner = TritonMoeRouter(2, True, True)
    h, weight = torch.randn(2, 32), torch.randn(8, 32)
    with pytest.raises(ConfigError, match="TritonMoeRouter"):
        runner.forward([h, weight], tactic={"rows": 3, "block": 64, "warps": 1})
    with pytest.raises(InputError, match="moe_router"):
        moe_router(h, torch.randn(8, 16), 2, renormalize=True)
    with pytest.raises(ConfigError, match="top_k"):
        moe_router(h, weight, 9, renormalize=True)
    assert not runner.supports([torch.randn(32, 2).T, weight])  # rows not contiguous
    assert not runner.supports([h, weight.double()])  # dtypes differ
    # A weights dtype that is neither float32 nor h's runs the torch router only.
    w, _ = moe_router(h, weight, 2, renormalize=True, weights_dtype=torch.float64)
    assert w.dtype == torch.float64


def test_the_tuned_op_runs_the_pick_and_the_unfused_path_is_the_gemm_then_the_router():
    gen = _gen()
    h = torch.randn(3, 64, generator=gen)
    weight = torch.randn(16, 64, generator=gen)
    want_w, want_ids = torch_moe_router(h, weight, 4, renormalize=True)
    tuner = last_wins_tuner()
    ops = OpContext(tuner, 4)
    with autotune(None, tuner):
        weights, ids = ops.moe_router(h, weight, 4, renormalize=True)
    rows = [row for row in tuner.summary_rows() if row[0] == ROUTER_OP]
    assert len(rows) == 3 and all("TritonMoeRouter" in row[2] for row in rows)  # 1, 2, 4
    assert torch.equal(ids, want_ids), gen.initial_seed()
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    # The fallback (runner 0) asks the same tuner for the GEMM's and the router's picks.
    unfused = moe_router_runners(4, True, True, tuner=tuner, max_m=4)[0]
    assert isinstance(unfused, UnfusedMoeRouter)
    got_w, got_ids = unfused.forward([h, weight])
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    # An unfused context never looks the fused op up.
    plain = last_wins_tuner()
    with autotune(None, plain):
        OpContext(plain, 4).unfused().moe_router(h, weight, 4, renormalize=True)
    assert not [row for row in plain.summary_rows() if row[0] == ROUTER_OP]
    # Each routing rule is its own identity.
    idents = {
        runner_id(r)
        for rule in ((4, True, True), (4, False, True), (2, True, False))
        for r in moe_router_runners(*rule, tuner=tuner)
    }
    assert len(idents) == 6
