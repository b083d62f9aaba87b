"""The tunable router (route_top_k): the Triton kernel on the CPU interpreter against the torch
router, every tactic, ties, the tuner's choice and its identity per routing rule.

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
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.ops import OpContext, _triton  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    OP_NAME,
    TritonRouteTopKRunner,
    route_top_k,
    route_top_k_runners,
    torch_route_top_k,
)
from graphtune.ops.moe.routing import OP_NAME as ROUTE_OP  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


# (tokens, experts, top_k): Qwen3-30B-A3B's and Mixtral's routing, an expert count that is not a
# power of two, k = 1, and k = E.
CASES = [(3, 128, 8), (5, 8, 2), (2, 60, 4), (4, 16, 1), (1, 6, 6)]


@pytest.mark.parametrize(("tokens", "experts", "top_k"), CASES)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_tactic_matches_the_torch_router(tokens, experts, top_k, renormalize, dtype):
    gen = _gen()
    # float32 logits drawn distinct, then cast: in float16 a tie is possible, compare the
    # chosen probabilities where ids differ.
    logits = torch.randn(tokens, experts, generator=gen).to(dtype)
    for weights_float32 in (True, False):
        weights_dtype = torch.float32 if weights_float32 else dtype
        runner = TritonRouteTopKRunner(top_k, renormalize, weights_float32)
        want_w, want_ids = torch_route_top_k(
            logits, top_k, renormalize=renormalize, weights_dtype=weights_dtype
        )
        tactics = runner.get_valid_tactics([logits], None)
        assert tactics and all(set(t) == {"warps"} for t in tactics)
        probs = torch.softmax(logits.double(), dim=-1)
        for tactic in tactics:
            got_w, got_ids = runner.forward([logits], tactic=tactic)
            assert got_w.dtype == weights_dtype and got_ids.dtype == torch.int64
            assert got_ids.shape == (tokens, top_k) == got_w.shape
            chosen = probs.gather(1, got_ids)
            assert torch.equal(chosen, probs.gather(1, want_ids)), (gen.initial_seed(), tactic)
            assert (chosen[:, :-1] >= chosen[:, 1:]).all()  # largest first
            tol = 1e-6 if weights_dtype == torch.float32 else 1e-3
            torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol, atol=tol)


def test_ties_go_to_the_lowest_expert_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    runner = TritonRouteTopKRunner(2, True, True)
    weights, ids = runner.forward([logits], tactic={"warps": 1})
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))


def test_bad_tactics_and_unsupported_inputs():
    runner = TritonRouteTopKRunner(2, True, True)
    with pytest.raises(ConfigError, match="TritonRouteTopKRunner"):
        runner.forward([torch.randn(2, 8)], tactic={"warps": 3})
    assert not runner.supports([torch.randn(8, 2).T])  # rows not contiguous
    assert runner.supports([torch.randn(2, 8)])
    # A weights dtype that is neither float32 nor the logits' runs the torch router only.
    w, _ = route_top_k(torch.randn(2, 8), 2, renormalize=True, weights_dtype=torch.float64)
    assert w.dtype == torch.float64


def test_the_tuned_op_runs_the_pick_and_each_rule_has_its_own_identity():
    tuner = last_wins_tuner()
    logits = torch.randn(3, 16, generator=_gen())
    ops = OpContext(tuner, 4)
    with autotune(None, tuner):
        weights, ids = ops.route_top_k(logits, 4, renormalize=True)
    rows = [row for row in tuner.summary_rows() if row[0] == ROUTE_OP]
    assert len(rows) == 3 and all("TritonRouteTopKRunner" in row[2] for row in rows)  # 1, 2, 4
    want_w, want_ids = torch_route_top_k(logits, 4, renormalize=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    idents = {
        runner_id(r)
        for rule in ((4, True, True), (4, False, True), (2, True, False))
        for r in route_top_k_runners(*rule)
    }
    assert len(idents) == 3 * len(route_top_k_runners(4, True, True))
    assert ROUTE_OP != OP_NAME  # the router and the experts are two ops
