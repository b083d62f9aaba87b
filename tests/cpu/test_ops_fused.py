"""The fused decode GEMV kernel (graphtune.ops.fused) under Triton's interpreter, against float64.

Every mode (plain + residual, norm + linear, norm + gate/up + SiLU, norm + QKV + RoPE + K/V write)
runs on both paths, the CUDA-core path (``dot=0``, one row per program) and the swapped
tensor-core path (``dot=1``, 16 padded rows), in float32 and float16. Not bfloat16: Triton 3.9's
interpreter truncates float32 -> bfloat16 casts instead of rounding to nearest (a bias that grows
with every rounding the fused epilogues reproduce) and computes a bfloat16 ``tl.dot`` wrongly;
tests/gpu/test_fused_ops_gpu.py covers bfloat16 on the GPU. Shapes are small, inputs random and
outputs poisoned with NaN, so a value the kernel does not write shows.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
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
)
from graphtune.ops.gemm import TritonSkinnyGemmRunner

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

# Relative error against float64 of the same rounded inputs. Low precision: the normalised
# activations and the output are each rounded once (RoPE: a few roundings per element).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}
CORE = {"bn": 8, "bk": 32, "warps": 1, "dot": 0, "stages": 1, "split": 1}
CORE_DEFER = {"bn": 4, "bk": 64, "warps": 2, "dot": 0, "stages": 1, "split": 1}
DOT = {"bn": 16, "bk": 32, "warps": 4, "dot": 1, "stages": 3, "split": 1}
# Split-K: K of 64 to 96 gives 2 or 3 chunks of 32, so with 4 splits some get none.
CORE_SPLIT = {**CORE, "split": 2}
DOT_SPLIT = {**DOT, "split": 4}
# (tactic, dtype, rows): the CUDA-core path is timed only for one row but runs any row count.
CASES = [
    (CORE, torch.float32, 1),
    (CORE_DEFER, torch.float16, 1),
    (CORE, torch.float16, 3),
    (DOT, torch.float32, 3),
    (DOT, torch.float16, 1),
    (DOT, torch.float16, 18),  # two row blocks of 16
    (CORE_SPLIT, torch.float32, 2),
    (DOT_SPLIT, torch.float16, 18),
]
IDS = [f"dot{t['dot']}-bn{t['bn']}-s{t['split']}-{str(d)[6:]}-m{m}" for t, d, m in CASES]
# The runners that run the RMSNorm op first and the kernel without its prologue: the kernel's
# other paths are the ones above, so three cases cover both loops and two row blocks.
AFTER_NORM = [CASES[0], CASES[3], CASES[5], CASES[7]]
AFTER_NORM_IDS = [IDS[0], IDS[3], IDS[5], IDS[7]]


def _runner_cases(prologue: type, in_loop: type, after_norm: type | None = None) -> dict[str, Any]:
    """``parametrize`` keywords: every case for the prologue runner and the in-loop one (ids
    ``in-loop-*``), and the after-norm cases for ``after_norm`` (ids ``after-norm-*``)."""
    whole_rows = [(c, i) for c, i in zip(CASES, IDS, strict=True) if c[0]["split"] == 1]
    cases = [(*c, prologue) for c in CASES] + [(*c, in_loop) for c, _ in whole_rows]
    ids = IDS + [f"in-loop-{i}" for _, i in whole_rows]
    if after_norm is not None:
        cases += [(*c, after_norm) for c in AFTER_NORM]
        ids += [f"after-norm-{i}" for i in AFTER_NORM_IDS]
    return {"argvalues": cases, "ids": ids}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("tactic,dtype,m", CASES, ids=IDS)
def test_add_projection_updates_x_in_place(tactic, dtype, m):
    gen = _gen()
    n, k = 40, 96  # N not a multiple of bn, K not a multiple of bk
    a, w = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=0.2)
    x = _randn(gen, m, n, dtype=dtype)
    want = x.double() + a.double() @ w.double().T
    got = TritonAddProjection().forward([x, a, w], tactic)
    assert got is x
    assert _rel(x, want) < TOL[dtype], gen.initial_seed()


@pytest.mark.parametrize(
    "tactic,dtype,m,runner",
    **_runner_cases(TritonNormLinear, TritonNormLinearInLoop),
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_linear_matches_float64(tactic, dtype, m, with_bias, runner):
    gen = _gen()
    n, k, eps = 36, 80, 1e-5
    x, w = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=0.2)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    bias = _randn(gen, n, dtype=dtype) if with_bias else None
    want = _norm64(x, norm_w, eps) @ w.double().T
    if bias is not None:
        want = want + bias.double()
    got = runner().forward([x, norm_w, w, bias, eps], tactic)
    assert got.shape == (m, n) and got.dtype == dtype
    assert _rel(got, want) < TOL[dtype], gen.initial_seed()


@pytest.mark.parametrize(
    "tactic,dtype,m,runner",
    **_runner_cases(
        TritonNormGateUpSilu, TritonGateUpSiluNormInLoop, after_norm=TritonGateUpSiluAfterNorm
    ),
)
def test_norm_gate_up_silu_matches_float64(tactic, dtype, m, runner):
    gen = _gen()
    inter, k, eps = 24, 64, 1e-6
    x, w = _randn(gen, m, k, dtype=dtype), _randn(gen, 2 * inter, k, dtype=dtype, scale=0.2)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    gate_up = _norm64(x, norm_w, eps) @ w.double().T
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    got = runner().forward([x, norm_w, w, eps], tactic)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert _rel(got, want) < TOL[dtype], gen.initial_seed()


@pytest.mark.parametrize(
    "dtype,m,inter,k",
    [(torch.float32, 72, 24, 64), (torch.float16, 97, 40, 96), (torch.float16, 33, 64, 48)],
)
def test_tiled_gate_up_silu_above_thirty_two_rows_matches_float64(dtype, m, inter, k):
    gen = _gen()
    eps = 1e-6
    x, w = _randn(gen, m, k, dtype=dtype), _randn(gen, 2 * inter, k, dtype=dtype, scale=0.2)
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
    gate_up = _norm64(x, norm_w, eps) @ w.double().T
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    runner = TritonGateUpSiluTiled()
    inputs = [x, norm_w, w, eps]
    tactics = runner.get_valid_tactics(inputs, None)
    assert tactics and all(t["split_k"] == 1 for t in tactics)
    for tactic in (tactics[0], tactics[-1]):  # N and K not multiples of the blocks: masks
        got = runner.forward(inputs, tactic)
        assert got.shape == (m, inter) and got.dtype == dtype
        assert _rel(got, want) < TOL[dtype], (tactic, gen.initial_seed())
    # none up to 32 rows (TILED_ABOVE_M); a split tactic is refused with the rule named
    assert runner.get_valid_tactics([x[:32], norm_w, w, eps], None) == []
    assert runner.get_valid_tactics([x[:33], norm_w, w, eps], None)
    with pytest.raises(ConfigError, match="split_k"):
        runner.forward(inputs, {**tactics[0], "split_k": 2, "bk": 16})


def _rope64(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


class _RopeCase:
    """RoPE tables of 24 positions rounded to ``dtype`` (``sin`` signed as the engine's tables
    with ``signed_sin``; ``sin64`` the exact unsigned one), random positions, distinct cache rows
    and NaN-poisoned K/V caches of 64 rows."""

    cache_rows = 64

    def __init__(
        self,
        gen: torch.Generator,
        dtype: torch.dtype,
        m: int,
        kv_heads: int,
        dim: int,
        signed_sin: bool,
    ) -> None:
        table, half = 24, dim // 2
        angles = torch.rand(table, half, generator=gen, dtype=torch.float64) * 6.3
        self.sin64 = torch.cat((angles.sin(), angles.sin()), -1)
        signed = torch.cat((-self.sin64[:, :half], self.sin64[:, half:]), -1)
        self.cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
        self.sin = (signed if signed_sin else self.sin64).to(dtype)
        self.positions = torch.randint(0, table, (m,), generator=gen)
        self.rows = torch.randperm(self.cache_rows, generator=gen)[: m * kv_heads]
        self.k_cache = torch.full((self.cache_rows, dim), float("nan"), dtype=dtype)
        self.v_cache = self.k_cache.clone()


@pytest.mark.parametrize(
    "tactic,dtype,m,runner",
    **_runner_cases(TritonNormQkvRope, TritonQkvRopeNormInLoop, after_norm=TritonQkvRopeAfterNorm),
)
@pytest.mark.parametrize("signed_sin", [False, True])
def test_norm_qkv_rope_matches_float64(tactic, dtype, m, signed_sin, runner):
    gen = _gen()
    heads, kv_heads, dim, hidden, eps = 4, 2, 32, 48, 1e-5
    rows_total = (heads + 2 * kv_heads) * dim
    x, w = _randn(gen, m, hidden, dtype=dtype), _randn(gen, rows_total, hidden, dtype=dtype)
    w = (w.float() * 0.2).to(dtype)
    bias = _randn(gen, rows_total, dtype=dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    rope = _RopeCase(gen, dtype, m, kv_heads, dim, signed_sin)
    cos, sin, sin64, positions = rope.cos, rope.sin, rope.sin64, rope.positions
    k_cache, v_cache, write_rows, cache_rows = (
        rope.k_cache,
        rope.v_cache,
        rope.rows,
        rope.cache_rows,
    )
    inputs = [x, norm_w, w, bias, positions, cos, sin, k_cache, v_cache, write_rows, eps, None]
    q = runner(heads, kv_heads, signed_sin).forward(inputs, tactic)

    qkv = _norm64(x, norm_w, eps) @ w.double().T + bias.double()
    c, s = cos.double()[positions][:, None], sin64[positions][:, None]
    q_want = _rope64(qkv[:, : heads * dim].view(m, heads, dim), c, s)
    k_want = _rope64(qkv[:, heads * dim : (heads + kv_heads) * dim].view(m, kv_heads, dim), c, s)
    v_want = qkv[:, (heads + kv_heads) * dim :].reshape(m * kv_heads, dim)
    seed = gen.initial_seed()
    assert q.shape == (m, heads, dim) and _rel(q, q_want) < TOL[dtype], seed
    assert _rel(k_cache[write_rows], k_want.reshape(m * kv_heads, dim)) < TOL[dtype], seed
    assert _rel(v_cache[write_rows], v_want) < TOL[dtype], seed
    untouched = torch.ones(cache_rows, dtype=torch.bool)
    untouched[write_rows] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


@pytest.mark.parametrize("strided", ["positions", "write_rows"])
def test_norm_qkv_rope_served_strided_indices_runs_torch(strided):
    # The kernel indexes positions and cache rows by row alone; a strided view read that way
    # gave other positions and wrote other cache rows, with no error.
    gen = _gen()
    heads, kv_heads, dim, hidden, m = 4, 2, 32, 48, 3
    rows_total = (heads + 2 * kv_heads) * dim
    f32 = torch.float32
    x, w = _randn(gen, m, hidden, dtype=f32), _randn(gen, rows_total, hidden, dtype=f32) * 0.2
    rope = _RopeCase(gen, torch.float32, m, kv_heads, dim, False)
    inputs = [x, torch.ones(hidden), w, None, rope.positions, rope.cos, rope.sin]
    inputs += [rope.k_cache, rope.v_cache, rope.rows, 1e-5, None]
    runner = TritonQkvRopeNormInLoop(heads, kv_heads)
    tactic = runner.get_valid_tactics(inputs, None)[0]
    index = 4 if strided == "positions" else 9
    inputs[index] = torch.stack([inputs[index], inputs[index] * 0], 1)[:, 0]  # stride 2
    assert not runner.supports(inputs)
    q = runner.forward(inputs, tactic)
    c, s = rope.cos.double()[rope.positions][:, None], rope.sin64[rope.positions][:, None]
    qkv = _norm64(x, torch.ones(hidden), 1e-5) @ w.double().T
    q_want = _rope64(qkv[:, : heads * dim].view(m, heads, dim), c, s)
    k_want = _rope64(qkv[:, heads * dim : (heads + kv_heads) * dim].view(m, kv_heads, dim), c, s)
    assert _rel(q, q_want) < TOL[torch.float32]
    assert _rel(rope.k_cache[rope.rows], k_want.reshape(m * kv_heads, dim)) < TOL[torch.float32]


# Head-norm tiles hold a whole head (bn >= D / 2 = 16): exactly, and wider (clamped columns).
WHOLE_HEAD = [
    ({**CORE, "bn": 16}, torch.float32, 1),
    ({**CORE, "bn": 32, "split": 2}, torch.float16, 1),
    (DOT, torch.float16, 3),
    ({**DOT, "bn": 32}, torch.float32, 18),
    (DOT_SPLIT, torch.float32, 2),
]
WHOLE_HEAD_IDS = [
    f"dot{t['dot']}-bn{t['bn']}-s{t['split']}-{str(d)[6:]}-m{m}" for t, d, m in WHOLE_HEAD
]


@pytest.mark.parametrize("tactic,dtype,m", WHOLE_HEAD, ids=WHOLE_HEAD_IDS)
@pytest.mark.parametrize(
    "runner", [TritonNormQkvRope, TritonQkvRopeNormInLoop, TritonQkvRopeAfterNorm]
)
def test_norm_qkv_rope_with_a_head_norm_matches_float64(tactic, dtype, m, runner):
    """Qwen3's per-head q/k RMSNorm in the epilogue: q and k heads normalised, v heads not."""
    if runner is TritonQkvRopeNormInLoop and tactic["split"] > 1:
        pytest.skip("the in-loop RMSNorm takes no split-K tactics")
    gen = _gen()
    heads, kv_heads, dim, hidden, eps = 4, 2, 32, 48, 1e-5
    rows_total = (heads + 2 * kv_heads) * dim
    x = _randn(gen, m, hidden, dtype=dtype)
    w = _randn(gen, rows_total, hidden, dtype=dtype, scale=0.2)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    head_norm = (1 + 0.2 * torch.randn(heads + kv_heads, dim, generator=gen)).to(dtype)
    rope = _RopeCase(gen, dtype, m, kv_heads, dim, signed_sin=True)
    k_cache, v_cache, write_rows = rope.k_cache, rope.v_cache, rope.rows
    inputs = [x, norm_w, w, None, rope.positions, rope.cos, rope.sin, k_cache, v_cache, write_rows]
    inputs += [eps, head_norm]
    q = runner(heads, kv_heads, True).forward(inputs, tactic)

    qkv = _norm64(x, norm_w, eps) @ w.double().T
    qk = qkv[:, : (heads + kv_heads) * dim].view(m, heads + kv_heads, dim)
    qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * head_norm.double()
    c = rope.cos.double()[rope.positions][:, None]
    s = rope.sin64[rope.positions][:, None]
    q_want = _rope64(qk[:, :heads], c, s)
    k_want = _rope64(qk[:, heads:], c, s).reshape(m * kv_heads, dim)
    v_want = qkv[:, (heads + kv_heads) * dim :].reshape(m * kv_heads, dim)
    seed = gen.initial_seed()
    assert _rel(q, q_want) < TOL[dtype], seed
    assert _rel(k_cache[write_rows], k_want) < TOL[dtype], seed
    assert _rel(v_cache[write_rows], v_want) < TOL[dtype], seed


def test_a_head_norm_takes_only_whole_head_tiles():
    heads, kv_heads, dim, hidden = 4, 2, 32, 512
    # The norm-first kernel's tactics at one row, where the offered runner has none
    # (graphtune.ops._pruned): the base class has the same rules without that limit.
    runner = TritonNormQkvRope(heads, kv_heads, True)
    x, norm_w = torch.randn(1, hidden), torch.ones(hidden)
    w = torch.randn((heads + 2 * kv_heads) * dim, hidden)
    tail = [torch.zeros(1, dtype=torch.long), torch.randn(8, dim), torch.randn(8, dim)]
    tail += [torch.zeros(8, dim), torch.zeros(8, dim), torch.zeros(kv_heads, dtype=torch.long)]
    plain = [x, norm_w, w, None, *tail, 1e-5, None]
    normed = [*plain[:-1], torch.ones(heads + kv_heads, dim)]
    tactics = runner.get_valid_tactics(normed, None)
    assert tactics and all(t["bn"] >= dim // 2 for t in tactics)
    assert any(t["split"] > 1 for t in tactics)  # the heads alone do not fill the GPU
    assert any(t["bn"] < dim // 2 for t in runner.get_valid_tactics(plain, None))
    with pytest.raises(ConfigError):
        runner.forward(normed, {**CORE, "bn": 8})


def test_paths_agree_with_the_unfused_triton_kernels_to_rounding():
    """The fused RoPE epilogue rounds like rope_kv_kernel: same bits from the same qkv row."""
    gen = _gen()
    heads, kv_heads, dim, hidden = 2, 1, 32, 32
    dtype = torch.float32
    x = _randn(gen, 1, hidden, dtype=dtype)
    w = _randn(gen, (heads + 2 * kv_heads) * dim, hidden, dtype=dtype)
    norm_w = torch.ones(hidden)
    cos, sin = (_randn(gen, 8, dim, dtype=dtype) for _ in range(2))
    pos, rows = torch.tensor([5]), torch.tensor([3])
    caches = [torch.full((8, dim), float("nan")) for _ in range(4)]
    runner = TritonNormQkvRope(heads, kv_heads, True)
    fused = runner.forward([x, norm_w, w, None, pos, cos, sin, *caches[:2], rows, 0.0, None], DOT)
    torch_q = runner.forward([x, norm_w, w, None, pos, cos, sin, *caches[2:], rows, 0.0, None], -1)
    assert _rel(fused, torch_q.double()) < 1e-5
    assert _rel(caches[0][3], caches[2][3].double()) < 1e-5
    assert torch.equal(caches[1][3].isnan(), caches[3][3].isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_skinny_gemm_runner_has_the_gemm_ops_semantics(dtype, m):
    gen = _gen()
    n, k = 40, 96
    a, w = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype, scale=0.2)
    bias, residual = _randn(gen, n, dtype=dtype), _randn(gen, m, n, dtype=dtype)
    runner = TritonSkinnyGemmRunner()
    tactics = runner.get_valid_tactics([a, w, None, None, False], None)
    # No tactics for one row (the GEMV's), but any tactic runs it.
    assert all(t["dot"] == 1 for t in tactics) and bool(tactics) == (m > 1)
    product = a.double() @ w.double().T
    got = runner.forward([a, w, bias, None, False], DOT)
    assert _rel(got, product + bias.double()) < TOL[dtype], gen.initial_seed()
    want = product + residual.double()
    assert _rel(runner.forward([a, w, None, residual, False], DOT), want) < TOL[dtype]
    out = torch.full((m, n), float("nan"), dtype=dtype)
    assert runner.forward([a, w, None, None, False, out], DOT) is out
    assert _rel(out, product) < TOL[dtype]
    assert runner.forward([a, w, None, residual, True], DOT) is residual
    assert _rel(residual, want) < TOL[dtype], gen.initial_seed()


@pytest.mark.parametrize("eps", [float("nan"), float("inf"), -1e-6, True, "1e-5"])
def test_a_norm_refuses_an_eps_that_is_not_finite_and_positive(eps):
    from graphtune.ops import fused_add_rms_norm

    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(ConfigError, match="eps must be a finite float >= 0"):
        fused_add_rms_norm(x, w, eps)


def test_a_residual_of_another_dtype_is_an_input_error():
    from graphtune.ops import fused_add_rms_norm

    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(InputError, match="residual must have x's shape .* and dtype"):
        fused_add_rms_norm(x, w, 1e-5, x.double())
