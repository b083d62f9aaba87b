"""graphtune.ops on the GPU: every Triton kernel at Llama-1B decode shapes in bf16 against a
float64 reference, every valid GEMM tactic for two buckets, every valid GEMV tactic of the decode
GEMMs, every decode-attention tactic against SDPA, capture of each op in a graph, and the step-input
kernel against the torch code, bit for bit.

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphtune.autotuner import AutoTuner, autotune  # noqa: E402
from graphtune.engine.attention import causal_mask  # noqa: E402
from graphtune.ops import (  # noqa: E402
    TritonGemmRunner,
    TritonRMSNormRunner,
    TritonRopeRunner,
    TritonSiluAndMulRunner,
    attention,
    gemm,
    head_rms_norm_,
    step_inputs,
    torch_rope_kv_cache,
)
from graphtune.ops._counters import arrival_counters  # noqa: E402
from graphtune.ops.gemm import TritonGemvRunner  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
HIDDEN, INTER, HEADS, KV, DIM, VOCAB = 2048, 8192, 32, 8, 64, 128256
GEMMS = {  # name: (N, K)
    "qkv": (HEADS * DIM + 2 * KV * DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * DIM),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
# bf16 operands and a bf16 output: about 2^-8 relative rounding, summed over K in float32.
BF16_TOL = 1e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * scale).to(BF16)


@pytest.mark.parametrize("m", [2, 32])  # none for one row: the GEMV's (graphtune.ops.gemm.tiled)
def test_every_valid_gemm_tactic_on_the_qkv_shape(m):
    n, k = GEMMS["qkv"]
    runner = TritonGemmRunner(min_rows=1)
    a, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    inputs = [a, w, None, None, False]
    tactics = runner.get_valid_tactics(inputs, None)
    assert 4 <= len(tactics) <= 20
    report = runner.precompile(inputs, tactics)
    assert all(v is None for v in report.values()), report
    want = a.double() @ w.double().T
    for tactic in tactics:
        got = runner.forward(inputs, tactic)
        assert _rel(got, want) < BF16_TOL, tactic


@pytest.mark.parametrize("name", list(GEMMS))
@pytest.mark.parametrize("m", [2, 8, 64, 128])
def test_gemm_decode_shapes_with_residual_and_split_k(name, m):
    n, k = GEMMS[name]
    runner = TritonGemmRunner(min_rows=1)
    a, w = _randn(m, k), _randn(n, k, scale=k**-0.5)
    residual = _randn(m, n)
    tactics = runner.get_valid_tactics([a, w, None, residual, True], None)
    picked = [tactics[0]] + [t for t in tactics if t["split_k"] > 1]
    counters = arrival_counters(a.device, 1, user="test", fix="none")
    for tactic in picked:
        want = residual.double() + a.double() @ w.double().T
        got = runner.forward([a, w, None, residual.clone(), True], tactic)
        assert _rel(got, want) < BF16_TOL, tactic
        plain = runner.forward([a, w, None, None, False], tactic)
        assert _rel(plain, a.double() @ w.double().T) < BF16_TOL, tactic
        if tactic["split_k"] > 1:  # the last split sums in split order, whichever arrived last
            for _ in range(3):
                assert torch.equal(runner.forward([a, w, None, None, False], tactic), plain)
        assert not counters.any()  # every launch left its counters at zero


@pytest.mark.parametrize("name", ["qkv", "o_proj", "down", "gate_up"])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_every_valid_gemv_tactic_on_the_decode_shapes(name, m):
    n, k = GEMMS[name]
    runner = TritonGemvRunner(max_rows=8)
    a, w, residual = _randn(m, k), _randn(n, k, scale=k**-0.5), _randn(m, n)
    inputs = [a, w, None, residual, False]
    tactics = runner.get_valid_tactics(inputs, None)
    assert 4 <= len(tactics) <= 16
    report = runner.precompile(inputs, tactics)
    assert all(v is None for v in report.values()), report
    # torch's own result, in float32 (no TF32: torch's default for float32 matmuls).
    want = torch.nn.functional.linear(a.float(), w.float()) + residual.float()
    for tactic in tactics:
        got = runner.forward(inputs, tactic)
        assert got.dtype == BF16 and got.shape == (m, n), tactic
        assert _rel(got, want.double()) < BF16_TOL, tactic
        assert torch.equal(runner.forward(inputs, tactic), got), tactic  # deterministic
    inplace = residual.clone()
    assert runner.forward([a, w, None, inplace, True], tactics[-1]) is inplace
    assert _rel(inplace, want.double()) < BF16_TOL
    # Split-K (offered for one row only) runs any row count, its splits summed in one launch.
    counters = arrival_counters(a.device, 1, user="test", fix="none")
    split = {"bn": 4, "bk": 256, "warps": 4, "split_k": 2}
    got = runner.forward(inputs, split)
    assert _rel(got, want.double()) < BF16_TOL
    for _ in range(3):
        assert torch.equal(runner.forward(inputs, split), got)
    assert not counters.any()  # every launch left its counters at zero


def test_lm_head_gemm_shape():
    runner = TritonGemmRunner(min_rows=1)
    a, w = _randn(4, HIDDEN), _randn(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    tactic = runner.get_valid_tactics([a, w, None, None, False], None)[0]
    assert (
        _rel(runner.forward([a, w, None, None, False], tactic), a.double() @ w.double().T)
        < BF16_TOL
    )


@pytest.mark.parametrize("m", [1, 16])
def test_rms_norm_every_tactic(m, unpruned):  # the two-pass blocks too
    runner = TritonRMSNormRunner()
    x, r, w = _randn(m, HIDDEN), _randn(m, HIDDEN), (1 + 0.1 * torch.randn(HIDDEN, device=DEV))
    w = w.to(BF16)
    s = (x + r).double()
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    for tactic in runner.get_valid_tactics([x, w, r, 1e-5], None):
        out, new_res = runner.forward([x, w, r, 1e-5], tactic)
        assert _rel(out, want) < BF16_TOL, tactic
        assert torch.equal(new_res, x + r)
        ref, _ = runner.forward([x, w, r, 1e-5], -1)
        # Same float32 math as F.rms_norm up to reduction order: at most a last-bit difference.
        assert (out.float() - ref.float()).abs().max() <= 2**-6 * ref.float().abs().max()


@pytest.mark.parametrize("m", [1, 16])
def test_silu_and_mul_every_tactic(m, unpruned):
    runner = TritonSiluAndMulRunner()
    x = _randn(m, 2 * INTER)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :INTER]) * xd[:, INTER:]
    for tactic in runner.get_valid_tactics([x], None):
        assert _rel(runner.forward([x], tactic), want) < BF16_TOL, tactic


@pytest.mark.parametrize("signed", [False, True])
def test_rope_kv_cache_every_tactic(signed):
    batch, seq, slots = 8, 256, 9
    runner = TritonRopeRunner(HEADS, KV, signed)
    qkv = _randn(batch, (HEADS + 2 * KV) * DIM)
    cos, sin = _randn(seq, DIM), _randn(seq, DIM)
    positions = torch.randint(0, seq, (batch,), device=DEV)
    slot_ids = torch.randperm(slots, device=DEV)[:batch]
    rows = (
        (slot_ids[:, None] * KV + torch.arange(KV, device=DEV)[None, :]) * seq + positions[:, None]
    ).reshape(-1)
    cache_rows = slots * KV * seq
    k_ref, v_ref = torch.zeros(cache_rows, DIM, device=DEV, dtype=BF16), None
    v_ref = torch.zeros_like(k_ref)
    q_ref = torch_rope_kv_cache(qkv, positions, cos, sin, k_ref, v_ref, rows, HEADS, KV, signed)
    for tactic in runner.get_valid_tactics([qkv, positions, cos, sin, k_ref, v_ref, rows], None):
        k_cache, v_cache = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        q = runner.forward([qkv, positions, cos, sin, k_cache, v_cache, rows], tactic)
        assert _rel(q, q_ref.double()) < BF16_TOL, tactic
        assert _rel(k_cache, k_ref.double()) < BF16_TOL, tactic
        assert torch.equal(v_cache, v_ref), tactic
    # With Qwen3's per-head q/k norm inside the kernel: as head_rms_norm_ on qkv, then RoPE.
    norm = (1 + 0.1 * torch.randn(HEADS + KV, DIM, device=DEV)).to(BF16)
    k_ref.zero_()
    q_ref = torch_rope_kv_cache(
        head_rms_norm_(qkv.clone(), norm, 1e-6),
        positions,
        cos,
        sin,
        k_ref,
        v_ref,
        rows,
        HEADS,
        KV,
        signed,
    )
    for tactic in runner.get_valid_tactics([qkv, positions, cos, sin, k_ref, v_ref, rows], None):
        k_cache, v_cache = torch.zeros_like(k_ref), torch.zeros_like(v_ref)
        q = runner.forward([qkv, positions, cos, sin, k_cache, v_cache, rows, norm, 1e-6], tactic)
        assert _rel(q, q_ref.double()) < BF16_TOL, tactic
        assert _rel(k_cache, k_ref.double()) < BF16_TOL, tactic
        assert torch.equal(v_cache, v_ref), tactic


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and lazy init outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_each_op_captures_in_a_cuda_graph_and_replays_to_eager_results():
    m = 4
    a = _randn(m, HIDDEN)
    w = _randn(3072, HIDDEN, scale=HIDDEN**-0.5)
    gemm_runner = TritonGemmRunner(min_rows=1)
    split = next(
        t
        for t in gemm_runner.get_valid_tactics([a, w, None, None, False], None)
        if t["split_k"] > 1
    )
    gemv_runner = TritonGemvRunner(max_rows=8)
    # Split-K is offered for one row only; like any GEMV tactic it runs every row count.
    gemv_tactics = gemv_runner.get_valid_tactics([a[:1], w, None, None, False], None)
    gemv_split = next(t for t in gemv_tactics if t["split_k"] > 1)
    residual = _randn(m, 3072)
    x, r, nw = _randn(m, HIDDEN), _randn(m, HIDDEN), _randn(HIDDEN)
    gu = _randn(m, 2 * INTER)
    qkv = _randn(m, (HEADS + 2 * KV) * DIM)
    cos, sin = _randn(64, DIM), _randn(64, DIM)
    pos = torch.arange(m, device=DEV)
    rows = torch.arange(m * KV, device=DEV) * 3
    kc, vc = torch.zeros(m * KV * 3, DIM, device=DEV, dtype=BF16), None
    vc = torch.zeros_like(kc)
    cases = {
        "gemm split-k": lambda: gemm_runner.forward([a, w, None, None, False], split),
        "gemv": lambda: gemv_runner.forward([a, w, None, residual, False], gemv_tactics[0]),
        "gemv split-k": lambda: gemv_runner.forward([a, w, None, residual, False], gemv_split),
        "rms_norm": lambda: TritonRMSNormRunner().forward(
            [x, nw, r, 1e-5], {"block": 2048, "warps": 8}
        )[0],
        "silu_and_mul": lambda: TritonSiluAndMulRunner().forward([gu], {"block": 1024, "warps": 4}),
        "rope_kv_cache": lambda: TritonRopeRunner(HEADS, KV, True).forward(
            [qkv, pos, cos, sin, kc, vc, rows], {"heads": 4, "warps": 2}
        ),
    }
    for name, fn in cases.items():
        eager = fn().clone()
        graph, out = _capture(fn)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), name
        graph.reset()


def test_tune_then_capture_bakes_in_the_pick():
    tuner = AutoTuner(show_progress=False)
    a = _randn(8, HIDDEN)
    w = _randn(2048, HIDDEN, scale=HIDDEN**-0.5)
    with autotune(tuner=tuner):
        gemm(a, w, tuner=tuner, max_m=8)
    assert tuner.stats.profiles_tuned == 4 and not tuner.stats.tactic_failures
    fallbacks = dict(tuner.stats.fallbacks)
    eager = gemm(a, w, tuner=tuner, max_m=8)
    graph, out = _capture(lambda: gemm(a, w, tuner=tuner, max_m=8))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and tuner.stats.fallbacks == fallbacks
    graph.reset()


# --- decode attention (Triton flash-decoding) ----------------------------------------------------

SEQ = 528  # the KV cache length of the Llama-1B decode benchmark
# bf16 inputs, bf16 probabilities in the p . v product and a bf16 output: each about 2^-9
# relative; outputs of unit-variance V are averages of magnitude <= ~1, so 2e-2 absolute is a few
# bf16 ulps of slack beside SDPA (which rounds the same quantities, in another order).
ATTN_ATOL = 2e-2


def attention_mask(positions: torch.Tensor, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode step's additive mask ``[B, 1, 1, seq]``: keys at or before each position."""
    zero = torch.zeros((), device=positions.device, dtype=dtype)
    keys = torch.arange(seq, device=positions.device)
    return causal_mask(positions, keys, zero, torch.full_like(zero, float("-inf")))[
        :, None, None, :
    ]


def _attention_inputs(batch: int, dim: int) -> list[torch.Tensor]:
    """q, a strided K view (every other row of a larger cache), V, a random-position mask.

    Row 0 sees only its first 6 keys (its visible keys all fall in the first split).
    """
    q = _randn(batch, KV, HEADS // KV, dim)
    keys = _randn(2 * batch, KV, SEQ, dim)[::2]
    values = _randn(batch, KV, SEQ, dim)
    positions = torch.randint(0, SEQ, (batch,), device=DEV)
    positions[0] = 5
    return [q, keys, values, attention_mask(positions, SEQ, BF16)]


def _attention_reference(q, keys, values, mask) -> torch.Tensor:
    q, keys, values, mask = (t.double() for t in (q, keys, values, mask))
    scores = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("batch,dim", [(1, DIM), (8, DIM), (64, DIM), (8, 128)])
def test_decode_attention_every_triton_tactic_matches_sdpa(batch, dim):
    runner = attention.TritonDecodeAttention()
    inputs = _attention_inputs(batch, dim)
    tactics = runner.get_valid_tactics(inputs, None)
    assert 1 <= len(tactics) <= 12
    if batch == 1:
        assert max(t["splits"] for t in tactics) > 1  # 8 programs cannot fill the GPU
    report = runner.precompile(inputs, tactics)
    assert all(v is None for v in report.values()), report
    sdpa = torch.nn.functional.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3])
    want = _attention_reference(*inputs)
    for tactic in tactics:
        got = runner.forward(inputs, tactic)
        assert got.dtype == BF16 and got.shape == inputs[0].shape, tactic
        assert float((got.float() - sdpa.float()).abs().max()) < ATTN_ATOL, tactic
        assert _rel(got, want) < BF16_TOL, tactic
        assert torch.equal(runner.forward(inputs, tactic), got), tactic  # deterministic


def test_decode_attention_triton_captures_in_a_cuda_graph_and_follows_new_inputs():
    runner = attention.TritonDecodeAttention()
    inputs = _attention_inputs(4, DIM)
    split = max(runner.get_valid_tactics(inputs, None), key=lambda t: t["splits"])
    assert split["splits"] > 1  # the two-kernel path (workspace allocated inside the capture)

    def fn():
        return runner.forward(inputs, split)

    eager = fn().clone()
    graph, out = _capture(fn)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # New K/V and positions in the same buffers: the replay attends over them.
    inputs[1].copy_(_randn(4, KV, SEQ, DIM))
    inputs[3].copy_(attention_mask(torch.tensor([0, 100, 527, 300], device=DEV), SEQ, BF16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, runner.forward(inputs, split))
    graph.reset()


def test_decode_attention_tunes_with_the_triton_runner_without_failures():
    tuner = AutoTuner(show_progress=False)
    config = attention.tuning_config(8)
    inputs = _attention_inputs(8, DIM)
    with autotune(tuner=tuner):
        out = attention.decode_attention(*inputs, tuner=tuner, config=config)
    rows = tuner.summary_rows()
    assert tuner.stats.profiles_tuned == 4, rows
    assert not tuner.stats.tactic_failures, (tuner.stats.tactic_failures, rows)
    assert float((out.float() - _attention_reference(*inputs)).abs().max()) < ATTN_ATOL
    for row in rows:  # the picks per bucket, for the log of the GPU run (pytest -s)
        print(row)


@pytest.mark.parametrize("batch,window", [(1, None), (8, None), (128, 256)])
def test_step_inputs_kernel_gives_the_torch_codes_bits(batch, window):
    max_seq = 4096
    embed = torch.randn(VOCAB, HIDDEN, device=DEV).to(BF16)
    tokens = torch.randint(0, VOCAB, (batch,), device=DEV)
    positions = torch.randint(0, max_seq, (batch,), device=DEV)
    slots = torch.randperm(batch, device=DEV)
    x, rows, mask = step_inputs.decode_inputs(
        tokens,
        positions,
        slots,
        embed,
        kv_heads=KV,
        max_seq=max_seq,
        window=window,
        mask_dtype=BF16,
    )
    assert torch.equal(x, torch.nn.functional.embedding(tokens, embed))
    heads = torch.arange(KV, device=DEV)[None, :]
    assert torch.equal(rows, ((slots[:, None] * KV + heads) * max_seq + positions[:, None]).ravel())
    zero = torch.tensor(0.0, device=DEV, dtype=BF16)
    neg_inf = torch.tensor(float("-inf"), device=DEV, dtype=BF16)
    keys = torch.arange(max_seq, device=DEV)
    assert torch.equal(mask[:, 0, 0], causal_mask(positions, keys, zero, neg_inf, window))
