"""graphtune.ops.moe on the GPU at the issue's expert shapes (bf16): every tactic the runner lists
for several buckets against a float32 loop over the selected experts, the sort step against a
torch oracle at 4096 tokens, the torch fallback's two forms, capture and replay of routing +
kernels in a real CUDA graph, tuning with the graph timer, and the Triton router against the torch
router (also inside a CUDA graph).

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner, autotune  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    TorchFusedMoeRunner,
    TritonFusedMoeRunner,
    TritonMoeGemvRunner,
    TritonMoeRouter,
    TritonRouteTopKRunner,
    balanced_routing,
    dense_fused_moe,
    fused_moe,
    max_sorted_rows,
    route_top_k,
    sort_by_expert,
    sparse_fused_moe,
    torch_route_top_k,
)
from moe_routing_check import assert_routed_as_float64  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
SHAPES = {  # name: (E, k, H, I)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
# bf16 operands, float32 accumulation, four bf16 roundings on the way (projections, silu, the
# product, the weighted output) against a float32 loop over the same bf16 inputs.
BF16_TOL = 1.5e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.fixture(scope="module")
def experts():
    """Random bf16 expert weights per shape (scaled so activations stay O(1)), made once."""
    made = {}
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, (e, _, h, i) in SHAPES.items():
        gate_up = (torch.randn(e, 2 * i, h, device=DEV, generator=gen) * h**-0.5).to(BF16)
        down = (torch.randn(e, h, i, device=DEV, generator=gen) * i**-0.5).to(BF16)
        made[name] = (gate_up, down)
    yield made
    made.clear()
    torch.cuda.empty_cache()


def _routing(name: str, tokens: int, seed: int = 1):
    e, k, h, _ = SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, h, device=DEV, generator=gen).to(BF16)
    logits = torch.randn(tokens, e, device=DEV, generator=gen)
    weights, ids = route_top_k(logits, k, renormalize=True, weights_dtype=BF16)
    return x, weights, ids


def float32_moe(x, gate_up, down, weights, ids):
    """The math in float32, one selected expert at a time (written out here, not the library's
    loop, so that it is an independent oracle)."""
    top_k, inter = ids.shape[1], down.shape[2]
    flat, flat_weights = ids.reshape(-1), weights.reshape(-1).float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(flat).tolist():
        pairs = (flat == expert).nonzero()[:, 0]
        rows = pairs // top_k
        h = x[rows].float() @ gate_up[expert].float().T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = act @ down[expert].float().T
        out.index_add_(0, rows, y * flat_weights[pairs, None])
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize(
    ("runner_class", "tokens"),
    [(TritonFusedMoeRunner, t) for t in (1, 8, 64, 512, 4096)]
    + [(TritonMoeGemvRunner, t) for t in (1, 3, 8)],
)
def test_every_listed_tactic_matches_the_float32_loop(experts, name, runner_class, tokens):
    gate_up, down = experts[name]
    x, weights, ids = _routing(name, tokens)
    inputs = [x, gate_up, down, weights, ids]
    runner = runner_class()
    tactics = runner.get_valid_tactics(inputs, None)
    assert 4 <= len(tactics) <= 24
    report = runner.precompile(inputs, tactics)
    assert all(v is None for v in report.values()), {k: v for k, v in report.items() if v}
    want = float32_moe(*inputs)
    for tactic in tactics:
        got = runner.forward(inputs, tactic)
        assert got.dtype == BF16 and got.shape == x.shape
        assert _rel(got, want) < BF16_TOL, (name, tokens, tactic)
    # Deterministic: no atomics, so a second run is bit for bit the first.
    assert torch.equal(runner.forward(inputs, tactics[0]), runner.forward(inputs, tactics[0]))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_gemv_path_lists_no_tactic_past_64_pairs(experts, name):
    gate_up, down = experts[name]
    x, weights, ids = _routing(name, 64)
    assert TritonMoeGemvRunner().get_valid_tactics([x, gate_up, down, weights, ids], None) == []


def test_sort_by_expert_at_4096_tokens_matches_a_torch_oracle():
    e, k = SHAPES["qwen3-30b-a3b"][:2]
    _, _, ids = _routing("qwen3-30b-a3b", 4096)
    ids[:100] = ids[:100] % 3  # skew: a few experts take many more rows
    for block_m in (16, 64, 128):
        blocks = sort_by_expert(ids, e, block_m)
        flat = ids.reshape(-1).cpu()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e).tolist()
        rows, block_expert, start = [], [], 0
        for expert, count in enumerate(counts):
            padded = -(-count // block_m) * block_m
            rows += order[start : start + count].tolist() + [flat.numel()] * (padded - count)
            block_expert += [expert] * (padded // block_m)
            start += count
        total = max_sorted_rows(flat.numel(), e, block_m)
        rows += [flat.numel()] * (total - len(rows))
        block_expert += [-1] * (total // block_m - len(block_expert))
        assert blocks.sorted_pairs.cpu().tolist() == rows, block_m
        assert blocks.block_expert.cpu().tolist() == block_expert, block_m


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_torch_fallback_forms_agree(experts, name):
    gate_up, down = experts[name]
    x, weights, ids = _routing(name, 8)
    want = float32_moe(x, gate_up, down, weights, ids)
    assert _rel(sparse_fused_moe(x, gate_up, down, weights, ids), want) < BF16_TOL
    assert _rel(dense_fused_moe(x, gate_up, down, weights, ids), want) < BF16_TOL


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("which", ["triton", "gemv", "torch"])
def test_routing_and_kernels_capture_in_a_cuda_graph_and_replay_new_routings(experts, name, which):
    gate_up, down = experts[name]
    e, _, h, _ = SHAPES[name]
    tokens = 8
    router = torch.randn(e, h, device=DEV).to(BF16) * h**-0.5
    runners = {"triton": TritonFusedMoeRunner, "gemv": TritonMoeGemvRunner}
    runner = runners.get(which, TorchFusedMoeRunner)()
    static_x = _routing(name, tokens)[0].clone()
    tactic = -1
    if which != "torch":
        probe = [static_x, gate_up, down, *_routing(name, tokens)[1:]]
        tactic = runner.get_valid_tactics(probe, None)[0]

    def step():
        logits = static_x @ router.T
        weights, ids = route_top_k(logits, SHAPES[name][1], renormalize=True, weights_dtype=BF16)
        return runner.forward([static_x, gate_up, down, weights, ids], tactic)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    try:
        for seed in (2, 3):
            static_x.copy_(_routing(name, tokens, seed)[0])
            graph.replay()
            logits = static_x @ router.T
            weights, ids = route_top_k(
                logits, SHAPES[name][1], renormalize=True, weights_dtype=BF16
            )
            want = float32_moe(static_x, gate_up, down, weights, ids)
            assert _rel(static_out, want) < BF16_TOL, (which, seed)
    finally:
        graph.reset()


def test_tuning_with_the_graph_timer_picks_runnable_tactics(experts):
    gate_up, down = experts["qwen3-30b-a3b"]
    tuner = AutoTuner(show_progress=False)
    runners = (TorchFusedMoeRunner(), TritonFusedMoeRunner(), TritonMoeGemvRunner())
    x, weights, ids = _routing("qwen3-30b-a3b", 8)
    with autotune(tuner=tuner):
        fused_moe(x, gate_up, down, weights, ids, tuner=tuner, max_m=8, runners=runners)
    # Buckets 1, 2, 4, 8 of the op and of its down stage (graphtune.ops.moe.gemv_down).
    assert tuner.stats.profiles_tuned == 8 and not tuner.stats.tactic_failures
    for tokens in (1, 3, 8):
        x, weights, ids = _routing("qwen3-30b-a3b", tokens, seed=tokens)
        got = fused_moe(x, gate_up, down, weights, ids, tuner=tuner, max_m=8, runners=runners)
        assert _rel(got, float32_moe(x, gate_up, down, weights, ids)) < BF16_TOL, tokens
    assert not tuner.stats.fallbacks


def test_balanced_routing_on_the_gpu_is_distinct_per_token(experts):
    gate_up, down = experts["qwen3-30b-a3b"]
    x, weights, ids = _routing("qwen3-30b-a3b", 64)
    _, _, _, new_weights, new_ids = balanced_routing([x, gate_up, down, weights, ids])
    assert new_ids.device == x.device and new_ids.shape == ids.shape
    assert all(len(set(row)) == ids.shape[1] for row in new_ids.tolist())
    torch.testing.assert_close(
        new_weights.float().sum(-1), torch.ones(64, device=DEV), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
def test_triton_router_matches_the_torch_router(name, tokens):
    experts, top_k = SHAPES[name][:2]
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    logits = torch.randn(tokens, experts, device=DEV, generator=gen).to(BF16)
    probs = torch.softmax(logits.double(), dim=-1)
    for weights_float32 in (True, False):
        dtype = torch.float32 if weights_float32 else BF16
        runner = TritonRouteTopKRunner(top_k, True, weights_float32)
        want_w, want_ids = torch_route_top_k(logits, top_k, renormalize=True, weights_dtype=dtype)
        for tactic in runner.get_valid_tactics([logits], None):
            got_w, got_ids = runner.forward([logits], tactic=tactic)
            # bf16 logits tie now and then; torch.topk orders ties its own way.
            assert torch.equal(probs.gather(1, got_ids), probs.gather(1, want_ids)), tactic
            same = (got_ids == want_ids).all(-1)
            tol = 1e-6 if weights_float32 else 8e-3
            torch.testing.assert_close(
                got_w[same].float(), want_w[same].float(), rtol=tol, atol=tol
            )


def test_triton_router_replays_in_a_cuda_graph():
    experts, top_k = SHAPES["qwen3-30b-a3b"][:2]
    runner = TritonRouteTopKRunner(top_k, True, False)
    logits = torch.randn(64, experts, device=DEV).to(BF16)
    tactic = runner.get_valid_tactics([logits], None)[0]
    runner.forward([logits], tactic=tactic)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_w, static_ids = runner.forward([logits], tactic=tactic)
    logits.copy_(torch.randn(64, experts, device=DEV).to(BF16))
    graph.replay()
    want_w, want_ids = runner.forward([logits], tactic=tactic)
    assert torch.equal(static_ids, want_ids) and torch.equal(static_w, want_w)
    graph.reset()


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_fused_router_routes_as_the_float64_product(name, tokens):
    experts, top_k, hidden = SHAPES[name][:3]
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    h = torch.randn(tokens, hidden, device=DEV, generator=gen).to(BF16)
    weight = (torch.randn(experts, hidden, device=DEV, generator=gen) * hidden**-0.5).to(BF16)
    for weights_float32 in (True, False):
        runner = TritonMoeRouter(top_k, True, weights_float32)
        tactics = runner.get_valid_tactics([h, weight], None)
        assert any(t["splits"] > 1 for t in tactics)
        for tactic in tactics:
            for _ in range(2):  # again: the arrival counters were set back to zero
                got_w, got_ids = runner.forward([h, weight], tactic=tactic)
                assert_routed_as_float64(got_w, got_ids, h, weight, top_k, True, tactic)


def test_fused_router_replays_in_a_cuda_graph():
    experts, top_k, hidden = SHAPES["qwen3-30b-a3b"][:3]
    runner = TritonMoeRouter(top_k, True, False)
    h = torch.randn(4, hidden, device=DEV).to(BF16)
    weight = (torch.randn(experts, hidden, device=DEV) * hidden**-0.5).to(BF16)
    tactic = max(runner.get_valid_tactics([h, weight], None), key=lambda t: t["splits"])
    runner.forward([h, weight], tactic=tactic)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_w, static_ids = runner.forward([h, weight], tactic=tactic)
    for _ in range(2):
        h.copy_(torch.randn(4, hidden, device=DEV).to(BF16))
        graph.replay()
        want_w, want_ids = runner.forward([h, weight], tactic=tactic)
        assert torch.equal(static_ids, want_ids) and torch.equal(static_w, want_w)
    graph.reset()
