"""The fused-MoE op's torch parts on the CPU: the router against transformers' routers, ties and
renormalisation; the sparse and dense formulations against float64 and against transformers'
Qwen3-MoE and Mixtral sparse-MoE blocks; the input rules; the op without Triton.

Every test draws fresh random inputs; the seed is in the assertion message.
"""

from __future__ import annotations

import os

import pytest
import torch
from moe_cases import float64_moe

from graphtune.errors import ConfigError, InputError
from graphtune.ops.moe import (
    TorchFusedMoeRunner,
    balanced_routing,
    dense_fused_moe,
    fused_moe,
    route_top_k,
    sparse_fused_moe,
    torch_fused_moe,
)

# Relative error bounds against float64 of the same (rounded) inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def make_experts(gen, experts, hidden, inter, dtype=torch.float32):
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up.to(dtype), down.to(dtype)


# --- router ----------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_top_k_is_softmax_top_k_and_optional_renormalisation(renormalize):
    gen = _gen()
    logits = torch.randn(7, 6, generator=gen).to(torch.bfloat16)
    weights, ids = route_top_k(logits, 3, renormalize=renormalize, weights_dtype=torch.float64)
    probs = torch.softmax(logits.double(), dim=-1)
    assert ids.dtype == torch.int64 and ids.shape == (7, 3)
    for t in range(7):
        # bf16 logits tie now and then: compare the chosen probabilities, not the ids' order.
        chosen = probs[t, ids[t]]
        assert len(set(ids[t].tolist())) == 3, gen.initial_seed()
        torch.testing.assert_close(chosen, probs[t].sort(descending=True).values[:3])
        want = chosen / chosen.sum() if renormalize else chosen
        torch.testing.assert_close(weights[t], want, rtol=1e-6, atol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(7, dtype=torch.float64))


def test_route_top_k_ties_select_k_distinct_experts_of_the_largest_value():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = route_top_k(logits, 2, renormalize=True)
    for t in range(2):
        chosen = ids[t].tolist()
        assert len(set(chosen)) == 2
        assert all(logits[t, e] == logits[t].max() for e in chosen)
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5))  # equal probs, renormalised
    _, unnormalised = route_top_k(logits, 5, renormalize=False)
    assert sorted(unnormalised[1].tolist()) == [0, 1, 2, 3, 4]


def test_route_top_k_weights_dtype_is_the_only_rounding():
    gen = _gen()
    logits = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
    w32, ids32 = route_top_k(logits, 2, renormalize=True)
    w16, ids16 = route_top_k(logits, 2, renormalize=True, weights_dtype=torch.bfloat16)
    assert w32.dtype == torch.float32 and w16.dtype == torch.bfloat16
    assert torch.equal(ids32, ids16) and torch.equal(w32.to(torch.bfloat16), w16)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(top_k=0), ConfigError),
        (dict(top_k=9), ConfigError),
        (dict(top_k=True), ConfigError),
        (dict(top_k=2, weights_dtype=torch.int32), ConfigError),
        (dict(top_k=2, weights_dtype="float32"), ConfigError),  # was an AttributeError
    ],
)
def test_route_top_k_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error, match="route_top_k"):
        route_top_k(torch.randn(3, 8), renormalize=True, **kwargs)


def test_route_top_k_rejects_logits_that_are_not_2d_float():
    with pytest.raises(InputError, match="router_logits"):
        route_top_k(torch.randn(2, 3, 8), 2, renormalize=True)
    with pytest.raises(InputError, match="router_logits"):
        route_top_k(torch.ones(3, 8, dtype=torch.int64), 2, renormalize=True)


# --- against transformers ----------------------------------------------------------------------


def _qwen3_block(norm_topk_prob):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=32,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    return Qwen3MoeSparseMoeBlock(config), dict(renormalize=norm_topk_prob, logits_dtype=True)


def _mixtral_block():
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(
        hidden_size=32, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2
    )
    return MixtralSparseMoeBlock(config).eval(), dict(renormalize=True, logits_dtype=False)


@pytest.mark.parametrize("model", ["qwen3_moe", "qwen3_moe_unnormalised", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_and_sparse_loop_equal_transformers_blocks(model, dtype):
    pytest.importorskip("transformers")
    try:
        if model == "mixtral":
            block, routing = _mixtral_block()
        else:
            block, routing = _qwen3_block(model == "qwen3_moe")
    except (ImportError, AttributeError, TypeError) as exc:  # transformers before the 3-D experts
        pytest.skip(f"this transformers has no 3-D-expert MoE blocks ({exc})")
    if not hasattr(block.experts, "gate_up_proj"):
        pytest.skip("this transformers stores experts as modules, not [E, 2I, H] tensors")
    gen = _gen()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    block = block.to(dtype)
    x = torch.randn(1, 9, 32, generator=gen).to(dtype)
    with torch.no_grad():
        want = block(x)[0]
        logits = torch.nn.functional.linear(x[0], block.gate.weight)
        wdtype = logits.dtype if routing["logits_dtype"] else torch.float32
        weights, ids = route_top_k(
            logits, 2, renormalize=routing["renormalize"], weights_dtype=wdtype
        )
        experts = (block.experts.gate_up_proj, block.experts.down_proj)
        got = sparse_fused_moe(x[0], *experts, weights, ids)
        dense = dense_fused_moe(x[0], *experts, weights, ids)
    # Same ops in the same order: bit for bit (the phase-2 model oracle rests on this).
    assert torch.equal(got, want), gen.initial_seed()
    # The dense form sums the experts in one float32 reduction: close, not equal.
    torch.testing.assert_close(dense, want, rtol=TOL[dtype], atol=TOL[dtype])


# --- the two torch formulations ------------------------------------------------------------------


def _case(gen, tokens, experts, top_k, hidden, inter, dtype=torch.float32, weights_dtype=None):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up, down = make_experts(gen, experts, hidden, inter, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = route_top_k(
        logits, top_k, renormalize=True, weights_dtype=weights_dtype or dtype
    )
    return [x, gate_up, down, weights, ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_sparse_and_dense_match_float64(dtype, tokens):
    gen = _gen()
    inputs = _case(gen, tokens, 6, 2, 40, 24, dtype)
    want = float64_moe(*inputs)
    for form in (sparse_fused_moe, dense_fused_moe):
        got = form(*inputs)
        assert got.dtype == dtype and got.shape == inputs[0].shape
        assert _rel(got, want) < TOL[dtype], (form.__name__, gen.initial_seed())


def test_dense_chunks_tokens_and_matches_sparse(monkeypatch):
    from graphtune.ops.moe import reference

    gen = _gen()
    inputs = _case(gen, 9, 4, 2, 16, 8)
    whole = dense_fused_moe(*inputs)
    monkeypatch.setattr(reference, "DENSE_CHUNK_BYTES", 1)  # one token per chunk
    torch.testing.assert_close(dense_fused_moe(*inputs), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sparse_fused_moe(*inputs), whole, rtol=1e-5, atol=1e-6)


def test_a_token_routed_twice_to_one_expert_counts_both_slots():
    gen = _gen()
    x, gate_up, down, _, _ = _case(gen, 2, 4, 2, 16, 8)
    ids = torch.tensor([[1, 1], [3, 0]])
    weights = torch.tensor([[0.25, 0.5], [0.5, 0.5]])
    want = float64_moe(x, gate_up, down, weights, ids)
    for form in (sparse_fused_moe, dense_fused_moe):
        assert _rel(form(x, gate_up, down, weights, ids), want) < 1e-5, form.__name__


def test_out_of_range_ids_raise_in_the_sparse_loop_and_add_nothing_in_the_dense_form():
    gen = _gen()
    x, gate_up, down, weights, _ = _case(gen, 3, 4, 2, 16, 8)
    ids = torch.tensor([[0, 4], [-1, 2], [3, 1]])
    with pytest.raises(InputError, match="outside"):
        sparse_fused_moe(x, gate_up, down, weights, ids)
    kept = torch.where((ids >= 0) & (ids < 4), weights, 0)
    want = float64_moe(x, gate_up, down, kept, ids.clamp(0, 3))
    assert _rel(dense_fused_moe(x, gate_up, down, weights, ids), want) < 1e-5


@pytest.mark.parametrize("bad_id", [None, 4, -1])
def test_dense_form_masks_an_unselected_expert_that_overflows(bad_id):
    # The dense form runs every expert: one no token selects overflows fp16 to inf, and
    # weighting it by zero gave inf * 0 = NaN in every row. An out-of-range id (mapped to expert
    # 0 with weight 0) did the same with expert 0. The sparse loop never runs such an expert.
    gen = _gen()
    x, gate_up, down, _, _ = _case(gen, 2, 4, 2, 16, 8, torch.float16)
    x = x.abs() + 0.5  # every projection of the hot expert is large and positive
    hot = 3 if bad_id is None else 0
    gate_up[hot], down[hot] = 200.0, 200.0
    ids = torch.tensor([[1, 2], [2, 1]])
    weights = torch.tensor([[0.625, 0.375], [0.5, 0.5]], dtype=torch.float16)
    want = sparse_fused_moe(x, gate_up, down, weights, ids)
    assert bool(want.isfinite().all()), gen.initial_seed()
    if bad_id is not None:
        # The slot names no expert, so it adds nothing: as a cold expert with weight 0.
        kept_ids, kept_weights = ids.clone(), weights.clone()
        kept_ids[1, 0], kept_weights[1, 0] = 1, 0.0
        want = sparse_fused_moe(x, gate_up, down, kept_weights, kept_ids)
        ids[1, 0] = bad_id
    got = dense_fused_moe(x, gate_up, down, weights, ids)
    assert bool(got.isfinite().all()), gen.initial_seed()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3, msg=str(gen.initial_seed()))


def test_torch_fused_moe_picks_the_form_and_both_agree():
    gen = _gen()
    inputs = _case(gen, 5, 8, 2, 16, 16)
    torch.testing.assert_close(torch_fused_moe(*inputs), sparse_fused_moe(*inputs), rtol=0, atol=0)
    dense = torch_fused_moe(*inputs, capturable=True)
    torch.testing.assert_close(dense, dense_fused_moe(*inputs), rtol=0, atol=0)
    torch.testing.assert_close(dense, sparse_fused_moe(*inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capturable", [True, False])
def test_only_the_dense_form_captures_in_a_graph(capturable):
    # The simulated backend fails a capture on a host read, as a CUDA capture does: the sparse
    # form's loop over the selected experts reads them on the host, the dense form must not.
    from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend

    gen = _gen()
    x, gate_up, down, weights, ids = _case(gen, 4, 8, 2, 16, 16)

    def moe(x, weights, ids):
        return torch_fused_moe(x, gate_up, down, weights, ids, capturable=capturable)

    runner = CUDAGraphRunner(moe, max_batch_size=4, backend=SimulatedGraphBackend())
    runner.capture(x, weights, ids)
    assert runner.stats.graphs == (3 if capturable else 0), runner.stats.failed_captures
    for rows in (1, 3, 4):
        got = runner(x[:rows], weights[:rows], ids[:rows]).clone()
        want = sparse_fused_moe(x[:rows], gate_up, down, weights[:rows], ids[:rows])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=str(gen.initial_seed()))
    assert runner.stats.replays == (3 if capturable else 0)


# --- input rules and the op --------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda i: i.__setitem__(0, i[0][None]), "x \\[T, H\\]"),
        (lambda i: i.__setitem__(2, i[2][:, :, :-1]), "down must be"),
        (lambda i: i.__setitem__(1, i[1][:, :-1]), "down must be"),
        (lambda i: i.__setitem__(1, i[1].double()), "share one of"),
        (lambda i: i.__setitem__(3, i[3][:-1]), "topk_weights and topk_ids"),
        (lambda i: i.__setitem__(4, i[4].float()), "int32 or int64"),
        # Used to return garbage on the CPU (a meta weight is never read by the torch code).
        (lambda i: i.__setitem__(1, i[1].to("meta")), "gate_up must be on x's device"),
        (lambda i: i.__setitem__(2, i[2].to("meta")), "down must be on x's device"),
        (lambda i: i.__setitem__(3, i[3].to("meta")), "topk_weights must be on x's device"),
        # Used to raise AttributeError / IndexError instead of naming the argument.
        (lambda i: i.__setitem__(3, None), "topk_weights must be a torch.Tensor"),
        (lambda i: i.__setitem__(1, i[1].tolist()), "gate_up must be a torch.Tensor"),
        (lambda i: i.__setitem__(0, i[0][0, 0]), "at least one dimension"),
    ],
)
def test_bad_inputs_name_the_rule(change, match):
    inputs = _case(_gen(), 3, 4, 2, 16, 8)
    change(inputs)
    with pytest.raises(InputError, match=match):
        TorchFusedMoeRunner().forward(inputs)


def test_fused_moe_without_triton_runs_the_fallback_and_keeps_leading_dims():
    from graphtune.autotuner import AutoTuner

    gen = _gen()
    x, gate_up, down, weights, ids = _case(gen, 6, 4, 2, 16, 8)
    tuner = AutoTuner(show_progress=False)
    got = fused_moe(
        x.view(2, 3, 16), gate_up, down, weights, ids, tuner=tuner, runners=(TorchFusedMoeRunner(),)
    )
    assert got.shape == (2, 3, 16)
    torch.testing.assert_close(got.view(6, 16), sparse_fused_moe(x, gate_up, down, weights, ids))
    assert tuner.stats.fallbacks == {"graphtune.fused_moe": 1}
    with pytest.raises(InputError, match="T = 6 tokens"):
        fused_moe(x, gate_up, down, weights[:5], ids[:5], tuner=tuner)
    # Checked before x is flattened and topk_ids' shape is read (an IndexError and an
    # AttributeError before).
    with pytest.raises(InputError, match="x must be \\[..., H\\] with at least one dimension"):
        fused_moe(x[0, 0], gate_up, down, weights, ids, tuner=tuner)
    with pytest.raises(InputError, match="topk_ids must be a torch.Tensor, got NoneType"):
        fused_moe(x, gate_up, down, weights, None, tuner=tuner)  # type: ignore[arg-type]


def test_balanced_routing_gives_distinct_experts_and_normalised_weights():
    inputs = _case(_gen(), 50, 8, 3, 16, 8, weights_dtype=torch.bfloat16)
    inputs[4] = inputs[4].to(torch.int32)
    first = balanced_routing(list(inputs))
    again = balanced_routing(list(inputs))
    _, _, _, weights, ids = first
    assert ids.dtype == torch.int32 and weights.dtype == torch.bfloat16
    assert all(len(set(row)) == 3 for row in ids.tolist())
    assert int(ids.min()) >= 0 and int(ids.max()) < 8
    assert torch.equal(ids, again[4]) and torch.equal(weights, again[3])  # seeded
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(50), rtol=1e-2, atol=1e-2)
    assert len(torch.unique(ids)) == 8  # 150 slots over 8 experts: every expert gets rows
