"""graphtune.ops.fused on the GPU, in bf16 at the Llama-3.2-1B, Llama-3-8B and Qwen2.5-7B decode
shapes: every fused tactic against float64 and against the unfused path, the one-kernel decode
attention, the tiled gate/up + SiLU GEMM above 16 rows, a chain of fused stages captured in a
CUDA graph with PDL on (replayed on new inputs, equal to eager, with whole-K and split-K
tactics), split-K tactics giving the same bits on every call, PDL on vs off (same bits), the
Qwen3 q/k norm in the fused QKV kernel, and nested tuning with the graph timer.

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner, autotune  # noqa: E402
from graphtune.ops import _pdl, attention  # noqa: E402
from graphtune.ops._pruned import (  # noqa: E402
    ADD_PROJECTION_MIN_ROWS,
    NORM_LINEAR_IN_LOOP_MIN_ROWS,
    QKV_AFTER_NORM_MIN_ROWS,
)
from graphtune.ops.fused import (  # noqa: E402
    TritonAddProjection,
    TritonGateUpSiluAfterNorm,
    TritonGateUpSiluNormInLoop,
    TritonGateUpSiluTiled,
    TritonNormGateUpSilu,
    TritonNormLinear,
    TritonNormLinearInLoop,
    TritonNormQkvRope,
    TritonQkvRopeAfterNorm,
    TritonQkvRopeNormInLoop,
    norm_gate_up_silu,
)
from graphtune.ops.gemm import TritonSkinnyGemmRunner

DEV = "cuda"
BF16 = torch.bfloat16
# name: (hidden, intermediate, heads, kv_heads, head_dim, vocab, qkv bias)
SHAPES = {
    "llama-1b": (2048, 8192, 32, 8, 64, 128256, False),
    "llama-3-8b": (4096, 14336, 32, 8, 128, 128256, False),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064, True),
}
CASES = [("llama-1b", 1), ("llama-1b", 8), ("llama-3-8b", 1), ("qwen2.5-7b", 1)]
TOL = 1e-2  # bf16 operands, float32 sums, one or two bf16 roundings
ROPE_TOL = 2e-2  # a few more roundings in the rotation


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _tactics(runner, inputs, every: int, pruned_below: int = 1):
    """A sample of the runner's tactics, compiled; none (and none offered) when the inputs have
    fewer rows than ``pruned_below`` (graphtune.ops._pruned)."""
    tactics = runner.get_valid_tactics(inputs, None)
    if inputs[0].shape[0] < pruned_below:
        assert not tactics, type(runner).__name__
        return []
    assert tactics, type(runner).__name__
    chosen = tactics[::every] + [tactics[-1]]
    report = runner.precompile(inputs, chosen)
    assert all(error is None for error in report.values()), report
    return chosen


def _check_all(runner, inputs, want, tol, every, pruned_below=1):
    for tactic in _tactics(runner, inputs, every, pruned_below):
        got = runner.forward(inputs, tactic)
        assert _rel(got, want) < tol, (type(runner).__name__, tactic)
        if tactic["split"] > 1:  # the last split sums in split order, whichever arrived last
            for _ in range(3):
                assert torch.equal(runner.forward(inputs, tactic), got), tactic


class _Rope:
    """The engine's signed RoPE tables over 4096 positions in bf16, random positions of ``m``
    tokens, their cache rows and NaN-poisoned K/V caches; :meth:`apply` rotates a float64 tensor
    with the rounded tables, as the kernels read them."""

    def __init__(self, m: int, kv: int, dim: int) -> None:
        self.positions = torch.randint(0, 4096, (m,), device=DEV)
        angles = torch.rand(4096, dim // 2, device=DEV, dtype=torch.float64) * 6.3
        self.cos = torch.cat((angles.cos(), angles.cos()), -1).to(BF16)
        self.sin = torch.cat((-angles.sin(), angles.sin()), -1).to(BF16)
        self.rows = torch.randperm(4096 * kv, device=DEV)[: m * kv]
        self.k_cache = torch.full((4096 * kv, dim), float("nan"), device=DEV, dtype=BF16)
        self.v_cache = self.k_cache.clone()

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        c = self.cos.double()[self.positions][:, None]
        s = self.sin.double()[self.positions][:, None]
        half = t.shape[-1] // 2
        return t * c + torch.cat((t[..., half:], t[..., :half]), -1) * s


def _qkv_runners(heads: int, kv: int, m: int) -> tuple[Any, ...]:
    """The fused QKV op's Triton runners for the engine's signed tables that offer tactics for
    ``m`` rows (the norm-first one offers none below ``QKV_AFTER_NORM_MIN_ROWS``)."""
    runners = (TritonNormQkvRope(heads, kv, True), TritonQkvRopeNormInLoop(heads, kv, True))
    if m < QKV_AFTER_NORM_MIN_ROWS:
        return runners
    return (*runners, TritonQkvRopeAfterNorm(heads, kv, True))


@pytest.mark.parametrize("name,m", CASES)
def test_every_fused_tactic_matches_float64_and_the_unfused_path(name, m):
    hidden, inter, heads, kv, dim, _, has_bias = SHAPES[name]
    every = 1 if name == "llama-1b" else 3  # the 8B shapes: a sample of the tactics
    eps = 1e-5
    x, norm_w = _randn(m, hidden), (1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16)
    h64 = _norm64(x, norm_w, eps)

    w_gu = _randn(2 * inter, hidden, scale=hidden**-0.5)
    gu = h64 @ w_gu.double().T
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    inputs = [x, norm_w, w_gu, eps]
    _check_all(TritonNormGateUpSilu(), inputs, want, TOL, every)
    _check_all(TritonGateUpSiluNormInLoop(), inputs, want, TOL, every)
    _check_all(TritonGateUpSiluAfterNorm(), inputs, want, TOL, every)
    assert _rel(TritonNormGateUpSilu().forward(inputs, -1), want) < TOL

    act = _randn(m, inter)
    w_down = _randn(hidden, inter, scale=inter**-0.5)
    want = x.double() + act.double() @ w_down.double().T
    proj_in = [x.clone(), act, w_down]
    proj_tactics = _tactics(TritonAddProjection(), proj_in, every, ADD_PROJECTION_MIN_ROWS)
    for tactic in proj_tactics:
        res = x.clone()
        TritonAddProjection().forward([res, act, w_down], tactic)
        assert _rel(res, want) < TOL, tactic

    rows = (heads + 2 * kv) * dim
    w_qkv = _randn(rows, hidden, scale=hidden**-0.5)
    bias = _randn(rows) if has_bias else None
    rope = _Rope(m, kv, dim)
    k_cache, v_cache, write_rows = rope.k_cache, rope.v_cache, rope.rows
    qkv = h64 @ w_qkv.double().T + (bias.double() if bias is not None else 0.0)
    q_want = rope.apply(qkv[:, : heads * dim].view(m, heads, dim))
    k_want = rope.apply(qkv[:, heads * dim : (heads + kv) * dim].view(m, kv, dim)).reshape(-1, dim)
    v_want = qkv[:, (heads + kv) * dim :].reshape(-1, dim)
    inputs = [x, norm_w, w_qkv, bias, rope.positions, rope.cos, rope.sin, k_cache, v_cache]
    inputs += [write_rows, eps, None]
    for runner in _qkv_runners(heads, kv, m):
        for tactic in _tactics(runner, inputs, every):
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))
            q = runner.forward(inputs, tactic)
            assert _rel(q, q_want) < ROPE_TOL, tactic
            assert _rel(k_cache[write_rows], k_want) < ROPE_TOL, tactic
            assert _rel(v_cache[write_rows], v_want) < TOL, tactic
            assert int(torch.isnan(k_cache).sum()) == (k_cache.shape[0] - m * kv) * dim


@pytest.mark.parametrize("m", [1, 8])
def test_qk_norm_tactics_match_float64_at_the_qwen3_moe_shape(m):
    """Qwen3-30B-A3B's attention (hidden 2048, 32/4 heads of 128) with its per-head q/k norm in
    the fused QKV kernel: every whole-head tactic of the three runners against float64, split-K
    tactics giving the same bits on every call."""
    hidden, heads, kv, dim, eps = 2048, 32, 4, 128, 1e-6
    x, norm_w = _randn(m, hidden), (1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16)
    w_qkv = _randn((heads + 2 * kv) * dim, hidden, scale=hidden**-0.5)
    head_norm = (1 + 0.2 * torch.randn(heads + kv, dim, device=DEV)).to(BF16)
    rope = _Rope(m, kv, dim)
    k_cache, write_rows = rope.k_cache, rope.rows
    qkv = _norm64(x, norm_w, eps) @ w_qkv.double().T
    qk = qkv[:, : (heads + kv) * dim].view(m, heads + kv, dim)
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * head_norm.double()
    q_want, k_want = rope.apply(qk[:, :heads]), rope.apply(qk[:, heads:]).reshape(-1, dim)
    inputs = [x, norm_w, w_qkv, None, rope.positions, rope.cos, rope.sin, k_cache, rope.v_cache]
    inputs += [write_rows, eps, head_norm]
    runners = _qkv_runners(heads, kv, m)
    for runner in runners:
        for tactic in _tactics(runner, inputs, 1):
            assert tactic["bn"] >= dim // 2, tactic
            k_cache.fill_(float("nan"))
            q = runner.forward(inputs, tactic)
            assert _rel(q, q_want) < ROPE_TOL, tactic
            assert _rel(k_cache[write_rows], k_want) < ROPE_TOL, tactic
            if tactic["split"] > 1:
                for _ in range(3):
                    assert torch.equal(runner.forward(inputs, tactic), q), tactic
    assert _rel(runners[0].forward(inputs, -1), q_want) < ROPE_TOL


@pytest.mark.parametrize("m", [64, 96, 128])
def test_tiled_gate_up_silu_above_thirty_two_rows(m):
    hidden, inter = SHAPES["llama-1b"][:2]
    eps = 1e-5
    x, norm_w = _randn(m, hidden), (1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16)
    w_gu = _randn(2 * inter, hidden, scale=hidden**-0.5)
    gu = _norm64(x, norm_w, eps) @ w_gu.double().T
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    runner = TritonGateUpSiluTiled()
    inputs = [x, norm_w, w_gu, eps]
    for tactic in _tactics(runner, inputs, 1):
        got = runner.forward(inputs, tactic)
        assert _rel(got, want) < TOL, tactic
        assert torch.equal(runner.forward(inputs, tactic), got), tactic


@pytest.mark.parametrize("name,m", CASES)
def test_lm_head_and_skinny_gemm(name, m):
    hidden, _, _, _, _, vocab, _ = SHAPES[name]
    x, norm_w = _randn(m, hidden), (1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16)
    w = _randn(vocab, hidden, scale=hidden**-0.5)
    want = _norm64(x, norm_w, 1e-5) @ w.double().T
    _check_all(TritonNormLinear(), [x, norm_w, w, None, 1e-5], want, TOL, 4)
    in_loop = [x, norm_w, w, None, 1e-5]
    _check_all(TritonNormLinearInLoop(), in_loop, want, TOL, 4, NORM_LINEAR_IN_LOOP_MIN_ROWS)
    if m > 1:  # the skinny GEMM offers no tactics for one row (the GEMV's)
        want = x.double() @ w.double().T
        _check_all(TritonSkinnyGemmRunner(), [x, w, None, None, False], want, TOL, 2)
        # a square projection: too few wide tiles to fill the GPU, so split-K tactics too
        w_o = _randn(hidden, hidden, scale=hidden**-0.5)
        inputs = [x, w_o, None, None, False]
        assert any(t["split"] > 1 for t in TritonSkinnyGemmRunner().get_valid_tactics(inputs, 0))
        _check_all(TritonSkinnyGemmRunner(), inputs, x.double() @ w_o.double().T, TOL, 1)


@pytest.mark.parametrize("batch,seq", [(1, 512), (8, 512), (1, 4096)])
def test_one_kernel_attention_matches_sdpa(batch, seq):
    kv, groups, dim = 8, 4, 64
    q = _randn(batch, kv, groups, dim)
    keys, values = _randn(batch, kv, seq, dim), _randn(batch, kv, seq, dim)
    positions = torch.randint(seq // 2, seq, (batch,), device=DEV)
    visible = torch.arange(seq, device=DEV)[None, :] <= positions[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(BF16)[:, None, None, :]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), keys.double(), values.double(), attn_mask=mask.double()
    )
    runner = attention.TritonDecodeAttentionOneKernel()
    counters = attention.arrival_counters(q.device, batch * kv)
    for tactic in _tactics(runner, [q, keys, values, mask], 1):
        got = runner.forward([q, keys, values, mask], tactic)
        assert _rel(got, want) < TOL, tactic
        assert torch.equal(runner.forward([q, keys, values, mask], tactic), got), tactic
        assert int(counters.abs().sum()) == 0


def _layer_chain(dims, m, split_k=False):
    """A decode layer of fused stages (fixed first tactics; with ``split_k`` the first split-K
    tactic where a runner has one) and its unfused torch twin."""
    hidden, inter, heads, kv, dim, vocab, _ = dims
    eps, seq = 1e-5, 512
    w = dict(
        attn=(1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16),
        mlp=(1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16),
        qkv=_randn((heads + 2 * kv) * dim, hidden, scale=hidden**-0.5),
        o=_randn(hidden, heads * dim, scale=(heads * dim) ** -0.5),
        gu=_randn(2 * inter, hidden, scale=hidden**-0.5),
        down=_randn(hidden, inter, scale=inter**-0.5),
        head=_randn(vocab, hidden, scale=hidden**-0.5),
    )
    cos, sin = _randn(seq, dim), _randn(seq, dim)
    k_cache, v_cache = _randn(m * kv * seq, dim), _randn(m * kv * seq, dim)
    positions = torch.full((m,), seq - 8, device=DEV)
    write_rows = (torch.arange(m * kv, device=DEV) * seq + seq - 8).long()
    visible = torch.arange(seq, device=DEV)[None, :] <= positions[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(BF16)[:, None, None, :]
    runners = dict(
        qkv=TritonNormQkvRope(heads, kv, True),
        attn=attention.TritonDecodeAttentionOneKernel(),
        proj=TritonAddProjection(),
        mlp=TritonNormGateUpSilu(),
        head=TritonNormLinear(),
    )

    def first(runner: Any, inputs: list[Any]) -> Any:
        tactics = runner.get_valid_tactics(inputs, None)
        split = [t for t in tactics if t.get("split", 1) > 1]
        if not tactics:  # pruned at these rows (graphtune.ops._pruned): the torch path
            return -1
        return split[0] if split_k and split else tactics[0]

    def step(x: torch.Tensor, fused: bool) -> torch.Tensor:
        pick = first if fused else (lambda r, i: -1)
        qkv_in = [x, w["attn"], w["qkv"], None, positions, cos, sin, k_cache, v_cache]
        qkv_in += [write_rows, eps, None]
        q = runners["qkv"].forward(qkv_in, pick(runners["qkv"], qkv_in))
        keys, values = k_cache.view(m, kv, seq, dim), v_cache.view(m, kv, seq, dim)
        att_in = [q.view(m, kv, heads // kv, dim), keys, values, mask]
        att = runners["attn"].forward(att_in, pick(runners["attn"], att_in))
        proj_in = [x, att.reshape(m, heads * dim), w["o"]]
        runners["proj"].forward(proj_in, pick(runners["proj"], proj_in))
        mlp_in = [x, w["mlp"], w["gu"], eps]
        act = runners["mlp"].forward(mlp_in, pick(runners["mlp"], mlp_in))
        down_in = [x, act, w["down"]]
        runners["proj"].forward(down_in, pick(runners["proj"], down_in))
        head_in = [x, w["mlp"], w["head"], None, eps]
        return runners["head"].forward(head_in, pick(runners["head"], head_in))

    return step


@pytest.mark.parametrize("split_k", [False, True], ids=["whole-k", "split-k"])
@pytest.mark.parametrize("m", [1, 8])
def test_fused_chain_in_a_cuda_graph_with_pdl_replays_to_eager(m, split_k):
    if torch.cuda.get_device_capability() >= (9, 0):
        assert _pdl.pdl_enabled(torch.device(DEV))  # H100/H200: every fused launch uses PDL
    step = _layer_chain(SHAPES["llama-1b"], m, split_k)
    x0 = _randn(m, 2048)
    static = x0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            static.copy_(x0)
            step(static, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step(static, True)
    for _ in range(3):
        x_new = _randn(m, 2048)
        static.copy_(x_new)
        graph.replay()
        eager_x = x_new.clone()
        want = step(eager_x, True)
        torch.cuda.synchronize()
        assert torch.equal(logits, want)  # replay == eager, bit for bit
        unfused_x = x_new.clone()
        ref = step(unfused_x, False)
        assert _rel(logits, ref) < 3e-2 and _rel(static, unfused_x) < 3e-2


def test_pdl_off_gives_the_same_bits(monkeypatch):
    step = _layer_chain(SHAPES["llama-1b"], 1)
    x0 = _randn(1, 2048)
    on_x = x0.clone()
    on = step(on_x, True)
    monkeypatch.setenv("GRAPHTUNE_PDL", "0")
    assert not _pdl.pdl_enabled(torch.device(DEV))
    off_x = x0.clone()
    off = step(off_x, True)
    assert torch.equal(on, off) and torch.equal(on_x, off_x)


def test_nested_tuning_with_the_graph_timer_has_no_failures():
    hidden, inter = SHAPES["llama-1b"][:2]
    x, norm_w = _randn(1, hidden), (1 + 0.1 * torch.randn(hidden, device=DEV)).to(BF16)
    w_gu = _randn(2 * inter, hidden, scale=hidden**-0.5)
    tuner = AutoTuner(show_progress=False)
    with autotune(tuner=tuner):
        act = norm_gate_up_silu(x, norm_w, 1e-5, w_gu, tuner=tuner, max_m=1)
    ops = {key.op for key, _ in tuner.cache.items()}
    assert {"graphtune.norm_gate_up_silu", "graphtune.gemm", "graphtune.silu_and_mul"} <= ops
    assert not tuner.stats.tactic_failures and not tuner.stats.fallbacks
    gu = _norm64(x, norm_w, 1e-5) @ w_gu.double().T
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert _rel(act, want) < TOL
    print(tuner.summary_table())
