"""The fused MoE router (route_experts): the one-kernel Triton runner on the CPU interpreter
against the torch router on ``F.linear`` logits, its tactic rules, its errors, and the op
through an ``OpContext``: untuned and unfused it is the router GEMM then ``route_top_k``; tuned
and fused it is one look-up of its own op.

Inputs are fresh random numbers per test; the seed is in the assertion message.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import OpContext, _arrival, _triton  # noqa: E402
from graphtune.ops.moe import router  # noqa: E402
from graphtune.ops.moe.routing import MAX_TRITON_EXPERTS, torch_route_top_k  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


# (tokens, experts, hidden, top_k, renormalize): Qwen3-MoE-like (many experts), Mixtral-like (8
# experts, k=2), an expert count that is not a power of two, k = 1, and the most tokens offered.
CASES = [
    (1, 128, 256, 8, True),
    (3, 8, 192, 2, True),
    (2, 60, 96, 4, False),
    (4, 16, 64, 1, False),
    (8, 24, 128, 3, True),
]


@pytest.mark.parametrize(("tokens", "experts", "hidden", "top_k", "renormalize"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_tactic_selects_the_torch_routers_experts(
    tokens, experts, hidden, top_k, renormalize, dtype
):
    gen = _gen()
    h = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
    logits = torch.nn.functional.linear(h.double(), weight.double()).to(dtype)
    probs = torch.softmax(logits.double(), dim=-1)
    counters = _arrival.arrival_counters(
        h.device, tokens, owner="TritonRouteExperts", hint="unused"
    )
    for weights_float32 in (True, False):
        runner = router.TritonRouteExperts(top_k, renormalize, weights_float32)
        want_w, want_ids = torch_route_top_k(
            logits,
            top_k,
            renormalize=renormalize,
            weights_dtype=torch.float32 if weights_float32 else dtype,
        )
        tactics = runner.get_valid_tactics([h, weight], None)
        assert tactics
        # Every tactic once; the other weights dtype only changes the store (first and last).
        for tactic in tactics if weights_float32 else [tactics[0], tactics[-1]]:
            got_w, got_ids = runner.forward([h, weight], tactic=tactic)
            assert got_w.dtype == want_w.dtype and got_ids.dtype == torch.int64
            # The chosen probabilities (not the ids: float16 logits may tie).
            chosen = probs.gather(1, got_ids)
            seed = (gen.initial_seed(), tactic)
            torch.testing.assert_close(chosen, probs.gather(1, want_ids), rtol=1e-3, atol=1e-6)
            assert (chosen[:, :-1] >= chosen[:, 1:]).all(), seed  # largest first
            tol = 1e-5 if weights_float32 else 2e-3
            torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol, atol=tol)
            again_w, again_ids = runner.forward([h, weight], tactic=tactic)
            assert torch.equal(again_w, got_w) and torch.equal(again_ids, got_ids), seed
            assert int(counters.abs().sum()) == 0, seed  # the last program reset them


def test_tactic_rules():
    tactics = router.route_experts_tactics(1, 128, 2048, 2)
    assert 0 < len(tactics) <= router.MAX_TACTICS
    for t in tactics:
        assert router.check_route_experts_tactic(t) is None
        per_thread = t["bn"] * t["bh"] * 2 // (32 * t["warps"])
        assert router.THREAD_BYTES[0] <= per_thread <= router.THREAD_BYTES[1], t
    chunks = [-(-2048 // t["bh"]) for t in tactics]
    assert chunks == sorted(chunks)  # the fewest chunks per program first
    assert router.route_experts_tactics(router.MAX_ROWS + 1, 128, 2048, 2) == []
    assert router.route_experts_tactics(1, MAX_TRITON_EXPERTS + 1, 2048, 2) == []
    assert router.route_experts_tactics(2, 6, 40, 4)  # toy shapes still get a tactic


def test_bad_inputs_and_tactics_raise_clear_errors():
    runner = router.TritonRouteExperts(2, True, True)
    h, weight = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(ConfigError, match="TritonRouteExperts"):
        runner.forward([h, weight], tactic={"bn": 3, "bh": 64, "warps": 1})
    with pytest.raises(ConfigError, match="keys"):
        runner.forward([h, weight], tactic={"bn": 2})
    with pytest.raises(InputError, match="router_weight"):
        router.route_experts(h, torch.randn(8, 32), 2, renormalize=True)
    with pytest.raises(ConfigError, match="top_k"):
        router.route_experts(h, weight, 9, renormalize=True)
    with pytest.raises(InputError, match="arrival counters"):
        _arrival.arrival_counters(h.device, _arrival.COUNTER_ROWS + 1, owner="x", hint="y")
    assert not runner.supports([h, weight.half()])  # one dtype


def test_the_op_context_routes_through_one_fused_op_only_when_tuned_and_fused(monkeypatch):
    gen = _gen()
    h = torch.randn(3, 64, generator=gen)
    weight = torch.randn(16, 64, generator=gen) * 0.125
    logits = torch.nn.functional.linear(h, weight)
    want_w, want_ids = torch_route_top_k(logits, 4, renormalize=True)
    untuned_w, untuned_ids = OpContext().route_experts(h, weight, 4, renormalize=True)
    assert torch.equal(untuned_w, want_w) and torch.equal(untuned_ids, want_ids)

    tuner = AutoTuner(show_progress=False)
    seen: list[str] = []
    choose = tuner.choose_one

    def spy(op, runners, config, inputs):
        seen.append(op)
        return choose(op, runners, config, inputs)

    monkeypatch.setattr(tuner, "choose_one", spy)
    ops = OpContext(tuner, 4)
    # Look-ups only: every op misses and runs its fallback, the fused op's being the two ops.
    fused_w, fused_ids = ops.route_experts(h, weight, 4, renormalize=True)
    assert seen == [router.OP_NAME, "graphtune.gemm", "graphtune.route_top_k"]
    seen.clear()
    unfused_w, unfused_ids = ops.unfused().route_experts(h, weight, 4, renormalize=True)
    assert seen == ["graphtune.gemm", "graphtune.route_top_k"]
    for w, ids in ((fused_w, fused_ids), (unfused_w, unfused_ids)):
        assert torch.equal(w, want_w) and torch.equal(ids, want_ids)
    # Each routing rule is its own runner identity.
    first = router.route_experts_runners(4, True, True, tuner=tuner)
    other = router.route_experts_runners(4, False, True, tuner=tuner)
    assert [r.cache_key_extras() for r in first] != [r.cache_key_extras() for r in other]
