"""The fused MoE MLP stage (graphtune.ops.fused.norm_moe_mlp) on the CPU interpreter.

Covered: every tactic of the Triton runner against a float64 oracle of the whole stage (RMSNorm,
router, softmax top-k, experts, residual) at T = 1, 3, 5 with K not a multiple of bk, float32 and
float16, renormalised or not, float32 or activation-dtype routing weights; the routing the
kernel writes equals the router op's; the fallback is the unfused torch code; tuning offers the
fused runner only at decode sizes and the stage's picks serve other token counts; the input and
config rules; the OpContext stage and the engine's MoE layer call it.
"""

from __future__ import annotations

import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from moe_cases import LastIsFastest, gen_seeded, poisoned_allocations, rel_error  # noqa: E402

from graphtune.autotuner import AutoTuner, TuningPolicy, autotune  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import OpContext, _triton  # noqa: E402
from graphtune.ops.fused import (  # noqa: E402
    TritonNormMoeMlp,
    UnfusedNormMoeMlp,
    norm_moe_mlp,
    norm_moe_mlp_runners,
)
from graphtune.ops.moe import gemv as moe_gemv  # noqa: E402
from graphtune.ops.moe import route_top_k  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)
EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.float16: 4e-3}


def stage_case(gen, tokens, experts, hidden, inter, dtype=torch.float32):
    """``[x, norm_weight, router, gate_up, down, eps]`` with a router whose top-k is clear."""
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    norm = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    router = (torch.randn(experts, hidden, generator=gen) * 2 * hidden**-0.5).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    return [x, norm, router, gate_up, down, EPS]


def float64_stage(inputs, top_k, renormalize):
    """The stage's math in float64: ``x + experts(rms_norm(x))`` and the routing ids."""
    x, norm, router, gate_up, down, eps = (
        t.double() if isinstance(t, torch.Tensor) else t for t in inputs
    )
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm
    probs = torch.softmax(h @ router.T, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    inter = down.shape[2]
    out = x.clone()
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            g = gate_up[e] @ h[t]
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(g[:inter]) * g[inter:]))
    return out, ids


def _fresh(inputs):
    return [inputs[0].clone(), *inputs[1:]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter, renormalize, weights_float32",
    [
        (1, 8, 2, 32, 32, True, True),
        (3, 8, 3, 40, 48, False, False),
        (5, 6, 2, 64, 40, True, False),
    ],
)
def test_every_tactic_matches_the_float64_stage(
    dtype, tokens, experts, top_k, hidden, inter, renormalize, weights_float32
):
    gen = gen_seeded()
    inputs = stage_case(gen, tokens, experts, hidden, inter, dtype)
    want, _ = float64_stage(inputs, top_k, renormalize)
    runner = TritonNormMoeMlp(top_k, renormalize, weights_float32, compile_workers=1)
    tactics = runner.get_valid_tactics(inputs, None)
    assert tactics
    for tactic in tactics:
        case = _fresh(inputs)
        with poisoned_allocations():  # unwritten ids, weights or act rows would poison x
            got = runner.forward(case, tactic)
        assert got is case[0] and got.dtype == dtype
        assert rel_error(got, want) < TOL[dtype], (tactic, gen.initial_seed())
    # The fallback is the unfused torch code, bit for bit the unfused runner's untuned path.
    fallback, unfused = _fresh(inputs), _fresh(inputs)
    runner.forward(fallback, -1)
    untuned = AutoTuner(show_progress=False)  # empty cache: every inner op runs its fallback
    UnfusedNormMoeMlp(top_k, renormalize, weights_float32, tuner=untuned).forward(unfused)
    assert torch.equal(fallback[0], unfused[0])
    assert rel_error(fallback[0], want) < TOL[dtype]


def test_the_kernel_routes_as_the_router_op():
    # Ids and weights the gate/up kernel writes are the Triton router's on the same logits.
    gen = gen_seeded()
    top_k, experts = 3, 8
    x, norm, router, gate_up, down, eps = stage_case(gen, 4, experts, 32, 32)
    logits = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (32,), norm, eps), router)
    weights, ids = route_top_k(logits, top_k, renormalize=True, weights_dtype=torch.float32)
    got_ids = torch.full((4 * top_k,), -1, dtype=torch.int64)
    got_weights = torch.full((4 * top_k,), float("nan"))
    moe_gemv.launch_moe_gemv(
        x.clone(),
        gate_up,
        down,
        torch.zeros(4, 32),
        {"bn": 8, "bk": 16, "warps": 1},
        ids=got_ids,
        route=got_weights,
        top_k=top_k,
        residual=False,
        norm=(norm, eps),
        logits=logits,
        renormalize=True,
    )
    assert torch.equal(got_ids.view(4, top_k), ids)
    torch.testing.assert_close(got_weights.view(4, top_k), weights, rtol=1e-6, atol=1e-7)


def _tuner():
    return AutoTuner(
        timer=LastIsFastest(),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0),
    )


def test_tuning_offers_the_fused_stage_at_decode_sizes_only(monkeypatch):
    # At most 4 pairs get GEMV tactics here (64 on a GPU), so that the interpreter tunes only
    # tiny buckets: with k = 2, buckets 1 and 2 time the fused stage and bucket 4 has only
    # runner 0 (picked untimed).
    monkeypatch.setattr(moe_gemv, "MAX_PAIRS", 4)
    gen = gen_seeded()
    tuner = _tuner()
    experts, top_k, hidden, inter = 4, 2, 32, 32
    x, norm, router, gate_up, down, eps = stage_case(gen, 4, experts, hidden, inter)
    runners = norm_moe_mlp_runners(top_k, True, True, tuner=tuner, max_m=4)
    assert isinstance(runners[0], UnfusedNormMoeMlp) and isinstance(runners[1], TritonNormMoeMlp)
    assert runners is norm_moe_mlp_runners(top_k, True, True, tuner=tuner, max_m=4)  # built once
    with autotune(tuner=tuner):
        norm_moe_mlp(
            x, norm, eps, router, gate_up, down, top_k=top_k, renormalize=True,
            tuner=tuner, max_m=4,
        )  # fmt: skip
    picks = {
        row[1].split("x")[0]: row[2]
        for row in tuner.summary_rows()
        if row[0] == "graphtune.norm_moe_mlp"
    }
    assert all("TritonNormMoeMlp" in picks[str(t)] for t in (1, 2)), picks
    assert "UnfusedNormMoeMlp" in picks["4"], picks
    # Inner ops were tuned too: the router's norm_linear and runner 0's single ops.
    ops = {row[0] for row in tuner.summary_rows()}
    assert {"graphtune.norm_linear", "graphtune.fused_moe", "graphtune.route_top_k"} <= ops
    for tokens in (1, 3, 4):
        live = torch.randn(tokens, hidden, generator=gen)
        want, _ = float64_stage([live, norm, router, gate_up, down, eps], top_k, True)
        got = norm_moe_mlp(
            live, norm, eps, router, gate_up, down, top_k=top_k, renormalize=True,
            tuner=tuner, max_m=4,
        )  # fmt: skip
        assert got is live and rel_error(got, want) < TOL[torch.float32], tokens
    assert not tuner.stats.fallbacks and not tuner.stats.tactic_failures


def test_input_and_config_rules():
    gen = gen_seeded()
    x, norm, router, gate_up, down, eps = stage_case(gen, 2, 4, 32, 32)
    tuner = AutoTuner(show_progress=False)

    def call(*args, **kwargs):
        options = dict(top_k=2, renormalize=True, tuner=tuner)
        options.update(kwargs)
        return norm_moe_mlp(*args, **options)

    with pytest.raises(InputError, match="router"):
        call(x, norm, eps, router[:3], gate_up, down)
    with pytest.raises(InputError, match="norm_weight"):
        call(x, norm[:8], eps, router, gate_up, down)
    with pytest.raises(InputError, match="contiguous"):
        call(torch.zeros(32, 2).T, norm, eps, router, gate_up, down)
    with pytest.raises(InputError, match="down must be"):
        call(x, norm, eps, router, gate_up, down[:, :, :8])
    with pytest.raises(ConfigError, match="top_k"):
        call(x, norm, eps, router, gate_up, down, top_k=5)
    with pytest.raises(ConfigError, match="weights_dtype"):
        call(x, norm, eps, router, gate_up, down, weights_dtype=torch.float16)
    with pytest.raises(ConfigError, match="eps"):
        call(x, norm, -1.0, router, gate_up, down)
    bad = {"bn": 3, "bk": 32, "warps": 1}
    with pytest.raises(ConfigError, match="TritonNormMoeMlp"):
        TritonNormMoeMlp(2, True, True).forward([x, norm, router, gate_up, down, eps], bad)


def test_the_context_stage_untuned_fused_and_unfused_agree():
    gen = gen_seeded()
    inputs = stage_case(gen, 3, 4, 32, 32)

    def stage(ops):
        case = _fresh(inputs)
        x, norm, router, gate_up, down, eps = case
        out = ops.norm_moe_mlp(
            x, norm, eps, router, gate_up, down,
            top_k=2, renormalize=False, weights_dtype=torch.float32,
        )  # fmt: skip
        assert out is x
        return x

    untuned = stage(OpContext())
    fused_tuner, unfused_tuner = AutoTuner(show_progress=False), AutoTuner(show_progress=False)
    assert torch.equal(untuned, stage(OpContext(fused_tuner, 4)))
    assert torch.equal(untuned, stage(OpContext(unfused_tuner, 4).unfused()))
    assert "graphtune.norm_moe_mlp" in fused_tuner.stats.fallbacks
    assert "graphtune.norm_moe_mlp" not in unfused_tuner.stats.fallbacks
    assert "graphtune.fused_moe" in unfused_tuner.stats.fallbacks
