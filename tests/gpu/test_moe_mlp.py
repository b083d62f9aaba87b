"""The fused MoE MLP stage (graphtune.ops.fused.norm_moe_mlp) on the GPU at the issue's expert
shapes (bf16): every tactic of the Triton runner against a float32 stage on the same bf16
inputs, its routing against the Triton router's, tuning with the graph timer, and capture and
replay of the tuned stage in a real CUDA graph (bit-exact against eager).

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner, autotune  # noqa: E402
from graphtune.ops.fused import TritonNormMoeMlp, norm_moe_mlp  # noqa: E402
from graphtune.ops.moe import TritonRouteTopKRunner, torch_route_top_k  # noqa: E402
from graphtune.ops.moe import gemv as moe_gemv  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
EPS = 1e-6
SHAPES = {  # name: (E, k, H, I, renormalize, weights in float32)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True, False),
    "mixtral-8x7b": (8, 2, 4096, 14336, True, True),
}
BF16_TOL = 1.5e-2  # as tests/gpu/test_moe.py: bf16 roundings against a float32 loop


@pytest.fixture(scope="module")
def weights():
    """Random bf16 norm, router and expert weights per shape, made once."""
    made = {}
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, (e, _, h, i, _, _) in SHAPES.items():
        norm = (1 + 0.1 * torch.randn(h, device=DEV, generator=gen)).to(BF16)
        router = (torch.randn(e, h, device=DEV, generator=gen) * h**-0.5).to(BF16)
        gate_up = (torch.randn(e, 2 * i, h, device=DEV, generator=gen) * h**-0.5).to(BF16)
        down = (torch.randn(e, h, i, device=DEV, generator=gen) * i**-0.5).to(BF16)
        made[name] = (norm, router, gate_up, down)
    yield made
    made.clear()
    torch.cuda.empty_cache()


def _float32_stage(x, norm, router, gate_up, down, top_k, renormalize, weights_float32):
    """``x + experts(rms_norm(x))`` with the routing of the unfused bf16 ops, the experts in
    float32 on the bf16 inputs."""
    h = F.rms_norm(x, (x.shape[1],), norm, EPS)
    dtype = torch.float32 if weights_float32 else x.dtype
    weights, ids = torch_route_top_k(
        F.linear(h, router), top_k, renormalize=renormalize, weights_dtype=dtype
    )
    inter = down.shape[2]
    out = x.float()
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            g = gate_up[e].float() @ h[t].float()
            act = F.silu(g[:inter]) * g[inter:]
            out[t] += float(weights[t, j]) * (down[e].float() @ act)
    return out


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 4])
def test_every_tactic_matches_the_float32_stage(weights, name, tokens):
    _, top_k, hidden, _, renormalize, weights_float32 = SHAPES[name]
    norm, router, gate_up, down = weights[name]
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(BF16)
    want = _float32_stage(x, norm, router, gate_up, down, top_k, renormalize, weights_float32)
    runner = TritonNormMoeMlp(top_k, renormalize, weights_float32, tuner=AutoTuner())
    inputs = [x, norm, router, gate_up, down, EPS]
    tactics = runner.get_valid_tactics(inputs, None)
    assert tactics
    for tactic in tactics:
        live = x.clone()
        got = runner.forward([live, *inputs[1:]], tactic)
        assert got is live
        err = float((got.float() - want).norm() / want.norm())
        assert err < BF16_TOL, (tactic, err)


def test_the_kernel_routes_as_the_triton_router(weights):
    _, top_k, hidden, inter, _, _ = SHAPES["qwen3-30b-a3b"]
    norm, router, gate_up, down = weights["qwen3-30b-a3b"]
    x = torch.randn(8, hidden, device=DEV).to(BF16)
    logits = F.linear(F.rms_norm(x, (hidden,), norm, EPS), router)
    router_runner = TritonRouteTopKRunner(top_k, True, False)  # the same routing code
    want_weights, want_ids = router_runner.forward([logits], {"warps": 4})
    ids = torch.full((8 * top_k,), -1, dtype=torch.int64, device=DEV)
    route = torch.zeros(8 * top_k, dtype=BF16, device=DEV)
    moe_gemv.launch_moe_gemv(
        x, gate_up, down, torch.empty_like(x), {"bn": 4, "bk": 256, "warps": 4},
        ids=ids, route=route, top_k=top_k, residual=False, norm=(norm, EPS), logits=logits,
        renormalize=True,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(ids.view(8, top_k), want_ids)
    assert torch.equal(route.view(8, top_k), want_weights)


def test_the_tuned_stage_replays_in_a_cuda_graph_bit_for_bit(weights):
    _, top_k, hidden, _, renormalize, _ = SHAPES["qwen3-30b-a3b"]
    norm, router, gate_up, down = weights["qwen3-30b-a3b"]
    tuner = AutoTuner(show_progress=False)
    call = dict(top_k=top_k, renormalize=renormalize, weights_dtype=BF16, tuner=tuner, max_m=8)
    with autotune(tuner=tuner):
        norm_moe_mlp(torch.randn(8, hidden, device=DEV).to(BF16), norm, EPS, router, gate_up,
                     down, **call)  # fmt: skip
    picks = {row[1].split("x")[0]: row[2] for row in tuner.summary_rows()
             if row[0] == "graphtune.norm_moe_mlp"}  # fmt: skip
    assert set(picks) == {"1", "2", "4", "8"}, picks
    for tokens in (1, 8):
        static = torch.randn(tokens, hidden, device=DEV).to(BF16)
        norm_moe_mlp(static.clone(), norm, EPS, router, gate_up, down, **call)  # warm, eager
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            norm_moe_mlp(static, norm, EPS, router, gate_up, down, **call)
        for _ in range(3):
            fresh = torch.randn(tokens, hidden, device=DEV).to(BF16)
            static.copy_(fresh)
            graph.replay()
            eager = norm_moe_mlp(fresh.clone(), norm, EPS, router, gate_up, down, **call)
            torch.cuda.synchronize()
            assert torch.equal(static, eager), tokens
    assert not tuner.stats.fallbacks and not tuner.stats.tactic_failures
