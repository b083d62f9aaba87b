"""Every Triton kernel of graphtune.ops against a float64 reference, on the CPU interpreter.

Shapes are small (the interpreter runs each program in numpy), inputs are fresh random numbers per
test, and each kernel is run with several tactics including split-K and the two-pass RMSNorm. The
torch fallback of each op is checked against the engine's own functions.
"""

from __future__ import annotations

import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (graphtune imports them
# lazily). On a CUDA machine the GPU tests need compiled kernels in the same process, so the
# interpreter is only forced where there is no GPU; these tests then skip.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner.identity import runner_id  # noqa: E402
from graphtune.engine import model as engine_model  # noqa: E402
from graphtune.errors import InputError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops.activation import TritonSiluAndMulRunner, torch_silu_and_mul  # noqa: E402
from graphtune.ops.gemm import TritonGemmRunner  # noqa: E402
from graphtune.ops.rmsnorm import TritonRMSNormRunner, head_rms_norm_, torch_rms_norm  # noqa: E402
from graphtune.ops.rotary import TritonRopeRunner, torch_rope_kv_cache  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

# Relative error bounds against float64 (fp32 accumulation in both dtypes).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _gen() -> torch.Generator:
    # Fresh inputs per test run; the seed is printed on failure through the assertion message.
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


GEMM_TACTICS = [
    {"bm": 16, "bn": 32, "bk": 32, "warps": 4, "stages": 2, "split_k": 1},
    {"bm": 32, "bn": 64, "bk": 64, "warps": 4, "stages": 3, "split_k": 1},
    {"bm": 16, "bn": 32, "bk": 32, "warps": 4, "stages": 2, "split_k": 2},
    {"bm": 16, "bn": 16, "bk": 32, "warps": 2, "stages": 2, "split_k": 4},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 128), (5, 48, 256), (17, 24, 100)])
def test_gemm_tactics_match_float64(dtype, m, n, k):
    gen = _gen()
    runner = TritonGemmRunner()
    a, w, bias = _randn(gen, m, k, dtype=dtype), _randn(gen, n, k, dtype=dtype), _randn(gen, n)
    bias = bias.to(dtype)
    want = a.double() @ w.double().T + bias.double()
    tried = 0
    for tactic in GEMM_TACTICS:
        if tactic["split_k"] > 1 and k % (tactic["split_k"] * tactic["bk"]):
            continue  # pruned by the split-K rule (tested in test_ops_tuning)
        got = runner.forward([a, w, bias, None, False], tactic)
        assert got.dtype == dtype and got.shape == (m, n)
        assert _rel(got, want) < TOL[dtype], (tactic, gen.initial_seed())
        tried += 1
    assert tried >= 2


def test_gemm_split_k_residual_in_place_and_out_of_place():
    gen = _gen()
    runner = TritonGemmRunner()
    m, n, k = 3, 40, 256
    a, w = _randn(gen, m, k), _randn(gen, n, k)
    for tactic in (GEMM_TACTICS[0], GEMM_TACTICS[3]):
        residual = _randn(gen, m, n)
        want = residual.double() + a.double() @ w.double().T
        got = runner.forward([a, w, None, residual, False], tactic)
        assert _rel(got, want) < TOL[torch.float32], (tactic, gen.initial_seed())
        out = runner.forward([a, w, None, residual, True], tactic)
        assert out is residual  # written in place, like residual.addmm_
        assert _rel(residual, want) < TOL[torch.float32], (tactic, gen.initial_seed())


def test_gemm_of_the_tactic_list_runs_and_torch_fallback_is_f_linear():
    gen = _gen()
    runner = TritonGemmRunner(sm_count=4, max_tactics=6, min_rows=1)
    a, w = _randn(gen, 2, 256), _randn(gen, 32, 256)
    inputs = [a, w, None, None, False]
    tactics = runner.get_valid_tactics(inputs, None)
    assert any(t["split_k"] > 1 for t in tactics)
    want = a.double() @ w.double().T
    for tactic in tactics:
        assert _rel(runner.forward(inputs, tactic), want) < TOL[torch.float32], tactic
    assert torch.equal(runner.forward(inputs, -1), torch.nn.functional.linear(a, w))


_FAR = 2**30  # a row (or K) stride whose third row starts 2^31 elements in: past int32


def _far_view(shape: tuple[int, int], stride: tuple[int, int]) -> torch.Tensor:
    """A float16 view whose third row (or column) lies 2^31 elements past its first, over an
    8 GiB storage that is never filled: only the few elements the test touches get pages, so it
    costs kilobytes of memory. It starts 2^31 elements in, so an int32 offset that wraps still
    lands inside the storage (a wrong value, not a crash)."""
    try:
        storage = torch.empty(2**32 + 64, dtype=torch.float16)  # untouched: virtual only
    except RuntimeError:  # e.g. strict overcommit (vm.overcommit_memory=2) on a small machine
        pytest.skip("cannot reserve 8 GiB of address space for the int64 offset test")
    return storage.as_strided(shape, stride, 2**31 + 16)


def test_gemm_epilogue_addresses_rows_past_2_to_the_31_elements():
    # An int32 offs_m * stride_om wrapped once a row began 2^31 elements in (a float16 LM head
    # output from ~16.7k rows): row 2 was added to and stored 2^31 elements too early.
    gen = _gen()
    a, w = _randn(gen, 3, 16, dtype=torch.float16), _randn(gen, 16, 16, dtype=torch.float16)
    residual = _far_view((3, 16), (_FAR, 1))
    residual.copy_(_randn(gen, 3, 16, dtype=torch.float16))
    want = residual.double() + a.double() @ w.double().T
    tactic = {"bm": 16, "bn": 16, "bk": 16, "warps": 4, "stages": 1, "split_k": 1}
    TritonGemmRunner().launch([a, w, None, residual, True], tactic)  # reads and writes row 2
    assert _rel(residual, want) < TOL[torch.float16], gen.initial_seed()


def test_gemm_reads_a_transposed_a_whose_k_offsets_pass_2_to_the_31():
    # a [M, K] with stride M along K (a transposed activation): an int32 k * stride_ak wrapped
    # once K * M passed 2^31, so column 2 of a was read from 2^31 elements too early.
    gen = _gen()
    a = _far_view((3, 3), (1, _FAR))
    a.copy_(_randn(gen, 3, 3, dtype=torch.float16))
    w = _randn(gen, 16, 3, dtype=torch.float16)
    want = a.double() @ w.double().T
    tactic = {"bm": 16, "bn": 16, "bk": 16, "warps": 4, "stages": 1, "split_k": 1}
    got = TritonGemmRunner().launch([a, w, None, None, False], tactic)
    assert _rel(got, want) < TOL[torch.float16], gen.initial_seed()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_one_and_two_pass_match_float64(dtype, with_residual):
    gen = _gen()
    runner = TritonRMSNormRunner()
    rows, hidden, eps = 3, 80, 1e-5
    x, w = _randn(gen, rows, hidden, dtype=dtype), (1 + 0.1 * _randn(gen, hidden)).to(dtype)
    res = _randn(gen, rows, hidden, dtype=dtype) if with_residual else None
    s = x + res if res is not None else x  # the rounded sum, as torch stores it
    sd = s.double()
    want = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    tactics = ({"block": 128, "warps": 1}, {"block": 32, "warps": 1}, {"block": 16, "warps": 2})
    for tactic in tactics:
        out, new_res = runner.forward([x, w, res, eps], tactic)
        assert _rel(out, want) < TOL[dtype], (tactic, gen.initial_seed())
        assert torch.equal(new_res, s)
        ref_out, _ = torch_rms_norm(x, w, eps, res)
        assert torch.allclose(
            out.float(),
            ref_out.float(),
            rtol=2e-3 if dtype != torch.float32 else 1e-5,
            atol=1e-3 if dtype != torch.float32 else 1e-6,
        )


@pytest.mark.parametrize("hidden", [1, 5, 8])
def test_rms_norm_offers_only_tactics_it_runs_on_rows_of_a_few_elements(hidden):
    # Rows of 8 or fewer elements were offered blocks below the kernel's smallest (16): every
    # tactic failed and the tuner fell back to torch.
    gen = _gen()
    x, w = _randn(gen, 2, hidden), 1 + 0.1 * _randn(gen, hidden)
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    runner = TritonRMSNormRunner()
    tactics = runner.get_valid_tactics([x, w, None, 1e-5], None)
    assert tactics
    for tactic in tactics:
        out, _ = runner.forward([x, w, None, 1e-5], tactic)
        assert _rel(out, want) < TOL[torch.float32], (tactic, gen.initial_seed())


def test_rms_norm_torch_fallback_is_the_engine_function():
    gen = _gen()
    x, r, w = _randn(gen, 4, 64), _randn(gen, 4, 64), _randn(gen, 64)
    out, s = TritonRMSNormRunner().forward([x, w, r, 1e-6], -1)
    assert torch.equal(s, x + r)
    assert torch.equal(out, engine_model.rms_norm(x + r, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_tactics_match_float64(dtype):
    gen = _gen()
    runner = TritonSiluAndMulRunner()
    x = _randn(gen, 3, 2 * 300, dtype=dtype)
    xd = x.double()
    want = torch.nn.functional.silu(xd[:, :300]) * xd[:, 300:]
    tactics = runner.get_valid_tactics([x], None) + [{"block": 128, "warps": 1}]
    for tactic in tactics:
        got = runner.forward([x], tactic)
        assert got.shape == (3, 300)
        assert _rel(got, want) < TOL[dtype], (tactic, gen.initial_seed())
    assert torch.equal(runner.forward([x], -1), engine_model.swiglu(x))
    assert torch.equal(torch_silu_and_mul(x), engine_model.swiglu(x))


def _rope_reference(qkv, positions, cos, sin, heads, kv, signed):
    """float64 rotate-half of q and k (sin un-signed first when the table is signed)."""
    dim = cos.shape[-1]
    half = dim // 2
    c = cos.double()[positions][:, None, :]
    s = sin.double()[positions][:, None, :]
    if signed:
        s = torch.cat((-s[..., :half], s[..., half:]), dim=-1)
    x = qkv.double()
    q = x[:, : heads * dim].view(-1, heads, dim)
    k = x[:, heads * dim : (heads + kv) * dim].view(-1, kv, dim)
    v = x[:, (heads + kv) * dim :].view(-1, kv, dim)

    def rot(t):
        return t * c + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * s

    return rot(q), rot(k), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("dim", [16, 12])
def test_rope_kv_cache_tactics_match_float64(dtype, signed, dim):
    gen = _gen()
    heads, kv, batch, rows_total, table = 4, 2, 3, 60, 20
    runner = TritonRopeRunner(heads, kv, signed)
    qkv = _randn(gen, batch, (heads + 2 * kv) * dim, dtype=dtype)
    cos, sin = _randn(gen, table, dim, dtype=dtype), _randn(gen, table, dim, dtype=dtype)
    positions = torch.randint(0, table, (batch,), generator=gen)
    rows = torch.randperm(rows_total, generator=gen)[: batch * kv]
    want_q, want_k, want_v = _rope_reference(qkv, positions, cos, sin, heads, kv, signed)
    blank = _randn(gen, rows_total, dim, dtype=dtype)
    inputs = [qkv, positions, cos, sin, blank, blank, rows]
    tactics = runner.get_valid_tactics(inputs, None)
    assert {t["heads"] for t in tactics} >= {1, 2, 4, 8}
    for tactic in tactics:
        k_cache, v_cache = blank.clone(), blank.clone()
        q = runner.forward([qkv, positions, cos, sin, k_cache, v_cache, rows], tactic)
        assert q.shape == (batch, heads, dim)
        assert _rel(q, want_q) < TOL[dtype], (tactic, gen.initial_seed())
        assert _rel(k_cache[rows], want_k.reshape(-1, dim)) < TOL[dtype], tactic
        assert torch.equal(v_cache[rows].double(), want_v.reshape(-1, dim))
        untouched = torch.ones(rows_total, dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(k_cache[untouched], blank[untouched])
        assert torch.equal(v_cache[untouched], blank[untouched])
        # Same math as the unfused torch path, to rounding of the last bit at most.
        k_ref, v_ref = blank.clone(), blank.clone()
        q_ref = torch_rope_kv_cache(qkv, positions, cos, sin, k_ref, v_ref, rows, heads, kv, signed)
        atol = 1e-5 if dtype == torch.float32 else 4e-3
        assert torch.allclose(q.float(), q_ref.float(), atol=atol, rtol=atol)
        assert torch.allclose(k_cache.float(), k_ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dim", [16, 12])
def test_rope_with_the_head_norm_matches_the_norm_then_the_rope(dtype, dim):
    """Qwen3's q/k norm inside the RoPE kernel: the same as head_rms_norm_ on qkv first, for
    every tactic, and neither the kernel nor the fallback writes into qkv."""
    gen = _gen()
    heads, kv, batch, rows_total, table, eps = 4, 2, 3, 60, 20, 1e-6
    runner = TritonRopeRunner(heads, kv, True)
    qkv = _randn(gen, batch, (heads + 2 * kv) * dim, dtype=dtype) * 3
    norm = (1 + 0.2 * _randn(gen, heads + kv, dim)).to(dtype)
    cos, sin = _randn(gen, table, dim, dtype=dtype), _randn(gen, table, dim, dtype=dtype)
    positions = torch.randint(0, table, (batch,), generator=gen)
    rows = torch.randperm(rows_total, generator=gen)[: batch * kv]
    blank = _randn(gen, rows_total, dim, dtype=dtype)
    normed = head_rms_norm_(qkv.clone(), norm, eps)
    k_ref, v_ref = blank.clone(), blank.clone()
    q_ref = torch_rope_kv_cache(normed, positions, cos, sin, k_ref, v_ref, rows, heads, kv, True)
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    for tactic in runner.get_valid_tactics([qkv, positions, cos, sin, blank, blank, rows], None):
        k_cache, v_cache = blank.clone(), blank.clone()
        inputs = [qkv, positions, cos, sin, k_cache, v_cache, rows, norm, eps]
        q = runner.forward(inputs, tactic)
        assert torch.allclose(q.float(), q_ref.float(), atol=atol, rtol=atol), tactic
        assert torch.allclose(k_cache.float(), k_ref.float(), atol=atol, rtol=atol), tactic
        assert torch.equal(v_cache, v_ref)
    before = qkv.clone()
    k_cache, v_cache = blank.clone(), blank.clone()
    q = runner.forward([qkv, positions, cos, sin, k_cache, v_cache, rows, norm, eps], -1)
    assert torch.equal(q, q_ref) and torch.equal(k_cache, k_ref)
    assert torch.equal(qkv, before)
    with pytest.raises(InputError, match="head_norm must be"):
        runner.forward([qkv, positions, cos, sin, blank, blank, rows, norm[:, :4], eps], -1)


def test_rope_kernel_takes_strided_positions_write_rows_and_head_norm():
    """The kernel reads positions, write rows and head-norm rows at unit strides: strided views
    (which gave other rows' tables, cache rows and weights) go to the torch code."""
    gen = _gen()
    heads, kv, dim, batch = 2, 1, 8, 3
    qkv = _randn(gen, batch, (heads + 2 * kv) * dim)
    cos, sin = _randn(gen, 16, dim), _randn(gen, 16, dim)
    positions = torch.tensor([[1, 0], [5, 0], [9, 0]])[:, 0]
    rows = torch.tensor([[0, 9], [3, 9], [6, 9]])[:, 0]
    norm = _randn(gen, heads + kv, 2 * dim)[:, :dim]
    runner = TritonRopeRunner(heads, kv)
    for extra in ([], [norm, 1e-6]):
        results = []
        for tactic in (-1, {"heads": 2, "warps": 1}):
            k_cache, v_cache = torch.zeros(16, dim), torch.zeros(16, dim)
            inputs = [qkv, positions, cos, sin, k_cache, v_cache, rows, *extra]
            results.append((runner.forward(inputs, tactic), k_cache, v_cache))
        for got, want in zip(results[1], results[0], strict=True):
            assert torch.equal(got, want), len(extra)


@pytest.mark.parametrize("tactic", [-1, {"heads": 2, "warps": 1}])
def test_rope_checks_the_index_ranges_under_graphtune_debug(monkeypatch, tactic):
    """The kernel would write past the caches: with GRAPHTUNE_DEBUG set (read when the runner
    is built) both runners check positions and write rows on the host first."""
    monkeypatch.setenv("GRAPHTUNE_DEBUG", "1")
    runner = TritonRopeRunner(2, 1)
    dim = 8
    qkv, cos, sin = torch.randn(2, 4 * dim), torch.randn(16, dim), torch.randn(16, dim)
    k_cache, v_cache = torch.zeros(4, dim), torch.zeros(4, dim)
    good = [qkv, torch.tensor([0, 15]), cos, sin, k_cache, v_cache, torch.tensor([0, 3])]
    runner.forward(good, tactic)
    bad_rows = [*good[:6], torch.tensor([0, 4])]
    with pytest.raises(InputError, match=r"write_rows must be in \[0, 4\) \(cache rows\)"):
        runner.forward(bad_rows, tactic)
    bad_positions = [good[0], torch.tensor([-1, 0]), *good[2:]]
    with pytest.raises(InputError, match=r"positions must be in \[0, 16\)"):
        runner.forward(bad_positions, tactic)
    monkeypatch.delenv("GRAPHTUNE_DEBUG")
    assert runner_id(runner) == runner_id(TritonRopeRunner(2, 1))  # debug picks are served too


@pytest.mark.parametrize("signed", [False, True])
def test_rope_torch_fallback_is_the_engine_code(signed):
    gen = _gen()
    heads, kv, dim, batch = 4, 2, 8, 2
    qkv = _randn(gen, batch, (heads + 2 * kv) * dim)
    cos, sin = _randn(gen, 10, dim), _randn(gen, 10, dim)
    positions = torch.tensor([7, 2])
    rows = torch.tensor([0, 5, 9, 11])
    k_cache, v_cache = torch.zeros(12, dim), torch.zeros(12, dim)
    q = TritonRopeRunner(heads, kv, signed).forward(
        [qkv, positions, cos, sin, k_cache, v_cache, rows], -1
    )
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    rope = engine_model.apply_rope_signed if signed else engine_model.apply_rope
    q_want = rope(qkv[:, : heads * dim].view(batch, heads, dim), c, s)
    k_want = rope(qkv[:, heads * dim : (heads + kv) * dim].view(batch, kv, dim), c, s)
    assert torch.equal(q, q_want)
    assert torch.equal(k_cache[rows], k_want.reshape(-1, dim))
    assert torch.equal(v_cache[rows], qkv[:, (heads + kv) * dim :].reshape(-1, dim))


def test_rope_forward_checks_its_inputs_once_per_call(monkeypatch):
    """Every runner call pays the shape, dtype and device checks: the kernel test (supports)
    and the launch share one pass instead of each running them."""
    from graphtune.ops import _rope_inputs, rotary

    calls = []
    for name in ("rope_tensors", "head_norm_of"):
        real = getattr(_rope_inputs, name)

        def counted(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        for module in (_rope_inputs, rotary):
            monkeypatch.setattr(module, name, counted, raising=False)
    dim = 8
    qkv, cos, sin = torch.randn(2, 4 * dim), torch.randn(16, dim), torch.randn(16, dim)
    inputs = [qkv, torch.tensor([0, 5]), cos, sin, torch.zeros(4, dim), torch.zeros(4, dim)]
    strided = torch.tensor([[0, 9], [3, 9]])[:, 0]  # the kernel does not take it: torch runs
    runner = TritonRopeRunner(2, 1)
    for tactic, rows in ((-1, torch.tensor([0, 3])), ({"heads": 2, "warps": 1}, strided)):
        runner.forward([*inputs, rows], tactic)
        assert sorted(calls) == ["head_norm_of", "rope_tensors"], tactic
        calls.clear()
    runner.forward([*inputs, torch.tensor([0, 3])], {"heads": 2, "warps": 1})
    assert sorted(calls) == ["head_norm_of", "rope_tensors"]
