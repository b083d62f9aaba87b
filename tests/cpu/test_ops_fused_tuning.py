"""graphtune.ops.fused on the CPU: the fallback is the unfused torch step bit for bit, tuning
nests (the fused op's fallback tunes the inner ops through the same tuner, with the real
wall-clock timer), the tactic rules, and the PDL launch options (graphtune.ops._pdl).

No Triton kernel runs here unless the interpreter is on (then the fused runners' tactics are
timed too, on tiny shapes); every assertion holds either way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphtune import env
from graphtune.autotuner import AutoTuner, TuningPolicy, autotune
from graphtune.autotuner.timing.wallclock import WallClockTimer
from graphtune.engine import model as engine_model
from graphtune.errors import ConfigError
from graphtune.ops import _pdl
from graphtune.ops.fused import (
    TritonGateUpSiluNormInLoop,
    TritonNormGateUpSilu,
    add_projection,
    norm_gate_up_silu,
    norm_gate_up_silu_runners,
    norm_linear,
    norm_qkv_rope,
)
from graphtune.ops.fused_gemv import check_fused_tactic, fused_gemv_tactics
from graphtune.ops.fused_gemv.family import (
    DOT_SMEM_BYTES,
    DOT_STAGES,
    MAX_M,
    MAX_SPLIT,
    MAX_SPLIT_TACTICS,
    PLAIN,
    ROPE,
    SILU,
    SPLIT_MIN_ROWS,
    GemvShape,
    launch_fused_gemv,
    pipeline_bytes,
)
from graphtune.ops.rotary import torch_rope_kv_cache

INNER = {"graphtune.rms_norm", "graphtune.gemm", "graphtune.rope_kv_cache"}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _layer(gen: torch.Generator, batch: int, dtype: torch.dtype = torch.float32):
    heads, kv_heads, dim, hidden, inter = 4, 2, 16, 32, 48
    randn = lambda *s: torch.randn(*s, generator=gen).to(dtype)  # noqa: E731
    return dict(
        x=randn(batch, hidden),
        attn_norm=(1 + 0.1 * randn(hidden)).to(dtype),
        wqkv=randn((heads + 2 * kv_heads) * dim, hidden) * 0.2,
        bqkv=randn((heads + 2 * kv_heads) * dim),
        w_gate_up=randn(2 * inter, hidden) * 0.2,
        w_down=randn(hidden, inter) * 0.2,
        heads=heads,
        kv_heads=kv_heads,
        dim=dim,
    )


def _rope_inputs(gen: torch.Generator, batch: int, kv_heads: int, dim: int, signed: bool):
    angles = torch.rand(32, dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), -1).float()
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    if signed:
        sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), -1)
    positions = torch.randint(0, 32, (batch,), generator=gen)
    rows = torch.randperm(64, generator=gen)[: batch * kv_heads]
    caches = [torch.full((64, dim), float("nan")) for _ in range(2)]
    return positions, cos, sin.float(), caches, rows


@pytest.mark.parametrize("signed_sin", [False, True])
def test_untuned_norm_qkv_rope_is_the_unfused_torch_step_exactly(signed_sin):
    gen = _gen(11)
    p = _layer(gen, 3)
    positions, cos, sin, (kc, vc), rows = _rope_inputs(gen, 3, p["kv_heads"], p["dim"], signed_sin)
    tuner = AutoTuner(show_progress=False)
    q = norm_qkv_rope(
        p["x"],
        p["attn_norm"],
        1e-5,
        p["wqkv"],
        p["bqkv"],
        positions,
        cos,
        sin,
        kc,
        vc,
        rows,
        num_heads=p["heads"],
        num_kv_heads=p["kv_heads"],
        signed_sin=signed_sin,
        tuner=tuner,
    )
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    h = engine_model.rms_norm(p["x"], p["attn_norm"], 1e-5)
    qkv = F.linear(h, p["wqkv"], p["bqkv"])
    q2 = torch_rope_kv_cache(
        qkv, positions, cos, sin, kc2, vc2, rows, p["heads"], p["kv_heads"], signed_sin
    )
    assert torch.equal(q, q2)
    assert torch.equal(kc[rows], kc2[rows]) and torch.equal(vc[rows], vc2[rows])
    # The fused op and each inner op asked the same tuner and fell back (nothing was tuned).
    assert set(tuner.stats.fallbacks) == INNER | {"graphtune.norm_qkv_rope"}


def test_untuned_mlp_and_projections_are_the_unfused_torch_step_exactly():
    gen = _gen(12)
    p = _layer(gen, 2)
    tuner = AutoTuner(show_progress=False)
    act = norm_gate_up_silu(p["x"], p["attn_norm"], 1e-6, p["w_gate_up"], tuner=tuner)
    want_act = engine_model.swiglu(
        F.linear(engine_model.rms_norm(p["x"], p["attn_norm"], 1e-6), p["w_gate_up"])
    )
    assert torch.equal(act, want_act)

    x, x2 = p["x"].clone(), p["x"].clone()
    assert add_projection(x, act, p["w_down"], tuner=tuner) is x
    assert torch.equal(x, x2.addmm_(act, p["w_down"].t()))

    logits = norm_linear(x, p["attn_norm"], 1e-6, p["wqkv"], tuner=tuner)
    want = F.linear(engine_model.rms_norm(x2, p["attn_norm"], 1e-6), p["wqkv"])
    assert torch.equal(logits, want)
    expected = {
        "graphtune.norm_gate_up_silu",
        "graphtune.add_projection",
        "graphtune.norm_linear",
        "graphtune.rms_norm",
        "graphtune.gemm",
        "graphtune.silu_and_mul",
    }
    assert set(tuner.stats.fallbacks) == expected


def test_tuning_the_fused_op_tunes_the_inner_ops_on_the_same_shapes():
    """Nested tuning with the real wall-clock timer: the fused op's fallback runs the inner ops,
    whose first call (in the timer's warm-up) tunes them through the same tuner."""
    gen = _gen(13)
    p = _layer(gen, 1)
    tuner = AutoTuner(
        timer=WallClockTimer(samples=1),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0),
    )
    with autotune(tuner=tuner):
        act = norm_gate_up_silu(p["x"], p["attn_norm"], 1e-6, p["w_gate_up"], tuner=tuner, max_m=2)
    tuned = {key.op: key.shapes[0] for key, _ in tuner.cache.items()}
    assert set(tuned) == {
        "graphtune.norm_gate_up_silu",
        "graphtune.rms_norm",
        "graphtune.gemm",
        "graphtune.silu_and_mul",
    }
    # Buckets 1 and 2 of every op: the inner ops were tuned on the fused op's shapes.
    buckets = sorted(key.shapes[0][0] for key, _ in tuner.cache.items() if "gemm" in key.op)
    assert buckets == [1, 2]
    assert not tuner.stats.fallbacks and not tuner.stats.tactic_failures
    want = engine_model.swiglu(
        F.linear(engine_model.rms_norm(p["x"], p["attn_norm"], 1e-6), p["w_gate_up"])
    )
    torch.testing.assert_close(act, want, rtol=1e-5, atol=1e-5)
    # After tuning, a call of either bucket is a look-up, and every pick runs correctly.
    for rows in (1, 2):
        x = torch.randn(rows, p["x"].shape[1], generator=gen)
        got = norm_gate_up_silu(x, p["attn_norm"], 1e-6, p["w_gate_up"], tuner=tuner, max_m=2)
        ref = engine_model.swiglu(
            F.linear(engine_model.rms_norm(x, p["attn_norm"], 1e-6), p["w_gate_up"])
        )
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not tuner.stats.fallbacks


def test_runners_are_built_once_per_tuner_and_layout():
    first, second = AutoTuner(show_progress=False), AutoTuner(show_progress=False)
    a = norm_gate_up_silu_runners(tuner=first)
    assert norm_gate_up_silu_runners(tuner=first) is a
    b = norm_gate_up_silu_runners(tuner=second)
    assert b is not a and b[0].tuner is second and a[0].tuner is first


# --- tactics (pure) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [
        GemvShape(PLAIN, 1, 2048, 1, 8192, 2),  # down projection, Llama-1B
        GemvShape(SILU, 1, 8192, 1, 2048, 2),  # gate/up
        GemvShape(ROPE, 1, 32, 48, 2048, 2),  # QKV, head_dim 64
        GemvShape(PLAIN, 8, 128256, 1, 2048, 2),  # LM head, batch 8
        GemvShape(ROPE, 16, 64, 56, 4096, 2),  # Llama-3-8B QKV (head_dim 128)
    ],
)
def test_fused_tactics_obey_the_pruning_rules(shape):
    tactics = fused_gemv_tactics(shape, sm_count=132)
    assert 0 < len(tactics) <= 16 + MAX_SPLIT_TACTICS
    assert all(check_fused_tactic(t) is None for t in tactics)
    assert len({tuple(t.values()) for t in tactics}) == len(tactics)
    for t in tactics:
        assert t["bn"] <= max(2, 1 << (shape.columns - 1).bit_length())
        if t["dot"]:
            assert t["bn"] >= 16 and t["bk"] >= 16 and t["warps"] == 4
            smem = pipeline_bytes(t["bn"], t["bk"], t["stages"], shape.paired, shape.itemsize)
            assert t["stages"] in DOT_STAGES and smem <= DOT_SMEM_BYTES
        else:
            assert t["stages"] == 1
            assert shape.m == 1
            per_thread = t["bn"] * t["bk"] * shape.itemsize // (32 * t["warps"])
            assert 16 <= per_thread <= 64
        if t["split"] == 1:
            assert shape.programs(t["bn"]) >= 66
    whole = [t for t in tactics if t["split"] == 1]
    assert len(whole) <= 16 and len(tactics) - len(whole) <= MAX_SPLIT_TACTICS
    kinds = {t["dot"] for t in tactics}
    assert kinds == ({0, 1} if shape.m == 1 else {1})


@pytest.mark.parametrize(
    "shape",
    [
        GemvShape(PLAIN, 8, 2048, 1, 2048, 2),  # O projection, Llama-1B, batch 8
        GemvShape(PLAIN, 1, 2048, 1, 8192, 2),  # down projection, batch 1
        GemvShape(ROPE, 8, 32, 48, 2048, 2),  # QKV, head_dim 64
        GemvShape(SILU, 16, 8192, 1, 2048, 2),  # gate/up
    ],
)
def test_split_k_tactics_give_wide_tiles_the_programs_to_fill_the_gpu(shape):
    sms = 132
    split = [t for t in fused_gemv_tactics(shape, sm_count=sms) if t["split"] > 1]
    assert split  # every shape here has wide tiles that leave SMs idle
    for t in split:
        programs, chunks = shape.programs(t["bn"]), -(-shape.k // t["bk"])
        assert t["dot"] == 1
        assert t["bn"] * (2 if shape.paired else 1) >= SPLIT_MIN_ROWS
        assert programs < sms and t["split"] <= min(MAX_SPLIT, chunks)
        # one wave of programs, or two, unless a cap stops the split first
        wave = 1 << ((sms // programs).bit_length() - 1)
        most = min(MAX_SPLIT, 1 << (chunks.bit_length() - 1))
        assert t["split"] in (min(wave, most), min(2 * wave, most))
        assert programs * t["split"] <= 2 * sms
    no_split = fused_gemv_tactics(shape, sm_count=sms, split_k=False)
    assert no_split and all(t["split"] == 1 for t in no_split)
    assert fused_gemv_tactics(shape, sm_count=sms)[: len(no_split)] == no_split


def test_split_k_with_the_in_loop_norm_is_refused_and_its_runners_never_offer_it():
    tactic = {"bn": 16, "bk": 32, "warps": 4, "dot": 1, "stages": 3, "split": 2}
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    with pytest.raises(ConfigError, match="split"):
        launch_fused_gemv(
            PLAIN,
            tactic,
            x=x,
            weight=w,
            out=torch.empty(1, 32),
            n=32,
            norm_weight=torch.ones(64),
            norm_in_loop=True,
        )
    runner = TritonGateUpSiluNormInLoop(sm_count=132)
    inputs = [torch.randn(8, 2048), torch.ones(2048), torch.randn(2 * 8192, 2048), 1e-6]
    assert all(t["split"] == 1 for t in runner.tactics_for(inputs))


def test_no_fused_tactics_past_sixteen_rows_and_tiny_shapes_still_get_some():
    assert fused_gemv_tactics(GemvShape(PLAIN, MAX_M + 1, 64, 1, 64, 2), sm_count=132) == []
    tiny = fused_gemv_tactics(GemvShape(SILU, 1, 8, 1, 8, 4), sm_count=132)
    assert tiny and all(t["dot"] == 0 for t in tiny)  # below tl.dot's 16: CUDA cores only


@pytest.mark.parametrize(
    "tactic",
    [
        {"bn": 8, "bk": 64, "warps": 4, "dot": 0, "stages": 1},
        {"bn": 6, "bk": 64, "warps": 4, "dot": 0, "stages": 1, "split": 1},
        {"bn": 8, "bk": 64, "warps": 4, "dot": 2, "stages": 1, "split": 1},
        {"bn": 8, "bk": 64, "warps": 4, "dot": 1, "stages": 3, "split": 1},
        {"bn": 8, "bk": 64, "warps": True, "dot": 0, "stages": 1, "split": 1},
        {"bn": 8, "bk": 64, "warps": 4, "dot": 0, "stages": 3, "split": 1},
        {"bn": 8, "bk": 64, "warps": 4, "dot": 0, "stages": 1, "split": 3},
        {"bn": 8, "bk": 64, "warps": 4, "dot": 0, "stages": 1, "split": 2 * MAX_SPLIT},
    ],
)
def test_bad_fused_tactics_raise_config_error_naming_the_rule(tactic):
    assert check_fused_tactic(tactic) is not None
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    with pytest.raises(ConfigError, match="fused GEMV"):
        launch_fused_gemv(PLAIN, tactic, x=x, weight=w, out=torch.empty(1, 32), n=32)


def test_fused_runner_offers_nothing_where_triton_cannot_run():
    runner = TritonNormGateUpSilu(sm_count=4)
    x = torch.randn(1, 32, dtype=torch.float64)  # a dtype the kernels do not take
    assert runner.get_valid_tactics([x, torch.ones(32), torch.randn(16, 32), 1e-6], None) == []


# --- PDL launch options ---------------------------------------------------------------------------


class _Kernel:
    def __init__(self, *names: str) -> None:
        self.arg_names = list(names)


def test_pdl_meta_leaves_kernels_without_the_switch_alone():
    meta = {"BLOCK": 16, "num_warps": 4}
    assert _pdl.pdl_meta(_Kernel("x_ptr", "BLOCK"), (torch.ones(1),), meta) == meta


def test_pdl_is_off_on_the_cpu_and_an_explicit_switch_is_kept():
    kernel = _Kernel("x_ptr", "USE_PDL")
    off = _pdl.pdl_meta(kernel, (torch.ones(1),), {"num_warps": 4})
    assert off == {"num_warps": 4, "USE_PDL": False}
    on = _pdl.pdl_meta(kernel, (torch.ones(1),), {"USE_PDL": True})
    assert on == {"USE_PDL": True, "launch_pdl": True}
    assert not _pdl.pdl_enabled(torch.device("cpu")) and not _pdl.pdl_enabled(None)


def test_pdl_decisions_are_remembered_per_kernel_object_and_indexed_device(monkeypatch):
    asks: list[torch.device] = []
    monkeypatch.setattr(_pdl, "_DEVICES", {})
    monkeypatch.setattr(_pdl, "device_supports_pdl", lambda d: asks.append(d) or False)
    with_switch, without = _Kernel("x_ptr", "USE_PDL"), _Kernel("x_ptr", "BLOCK")
    for _ in range(3):  # each kernel object keeps its own answer, however often it launches
        assert _pdl.pdl_meta(with_switch, (torch.ones(1),), {}) == {"USE_PDL": False}
        assert _pdl.pdl_meta(without, (torch.ones(1),), {}) == {}
    assert asks == [torch.device("cpu")]
    _pdl.pdl_enabled(torch.device("cuda"))  # no index: whatever device is current, not kept
    _pdl.pdl_enabled(torch.device("cuda"))
    assert asks[1:] == [torch.device("cuda")] * 2


def test_graphtune_pdl_switch(monkeypatch):
    monkeypatch.delenv("GRAPHTUNE_PDL", raising=False)
    assert env.pdl_allowed()
    for off in ("0", "false", "off"):
        monkeypatch.setenv("GRAPHTUNE_PDL", off)
        assert not env.pdl_allowed()
        assert not _pdl.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("GRAPHTUNE_PDL", "1")
    assert env.pdl_allowed()


def test_installed_triton_accepts_pdl_and_every_fused_kernel_declares_it():
    pytest.importorskip("triton")
    assert _pdl.triton_accepts_pdl()
    from graphtune.ops.fused_gemv.family import gemv_kernels

    assert _pdl.PDL_ARG in gemv_kernels().fused_gemv_kernel.arg_names


def test_every_decode_step_kernel_waits_then_lets_its_successor_launch():
    """Each kernel of the decode step declares USE_PDL, waits for its predecessor
    unconditionally (not inside a runtime branch) and lets its successor launch after that
    wait (graphtune.ops._pdl's contract)."""
    pytest.importorskip("triton")
    import importlib
    import inspect

    names = (
        "graphtune.ops._kernels",
        "graphtune.ops.gemm._gemv_kernels",
        "graphtune.ops.fused_gemv._kernels",
        "graphtune.ops._attention_kernels",
        "graphtune.ops.moe._kernels",
        "graphtune.ops.moe._gemv_kernels",
        "graphtune.ops._step_kernels",
    )
    checked = []
    for name in names:
        module = importlib.import_module(name)
        for attr, kernel in vars(module).items():
            if not attr.endswith("_kernel") or not hasattr(kernel, "arg_names"):
                continue
            source = inspect.getsource(getattr(kernel, "fn", kernel))
            assert _pdl.PDL_ARG in kernel.arg_names, attr
            lines = source.splitlines()
            at = next(i for i, text in enumerate(lines) if "gdc_wait()" in text)
            # Directly under a top-level `if USE_PDL:` of the kernel body: no runtime branch.
            assert lines[at - 1] == "    if USE_PDL:", (attr, lines[at - 1])
            assert lines[at].startswith(" " * 8 + "tl.extra.cuda.gdc_wait()"), attr
            assert "gdc_launch_dependents()" in "\n".join(lines[at + 1 :]), attr
            checked.append(attr)
    assert {"gemv_kernel", "fused_gemv_kernel", "rms_norm_kernel", "gemm_kernel"} <= set(checked)
    assert "decode_inputs_kernel" in checked and len(checked) >= 10


def test_the_moe_down_kernel_reads_the_gate_up_output_only_after_its_wait():
    """graphtune.ops._pdl: before gdc_wait() a kernel reads only what no kernel of the step
    writes, except the MoE down kernel, which also reads the routing (complete when it starts);
    the gate/up output of the kernel just before it (``act``) only after its wait."""
    pytest.importorskip("triton")
    import inspect

    from graphtune.ops.moe import _gemv_kernels

    lines = inspect.getsource(_gemv_kernels.moe_gemv_down_kernel.fn).splitlines()
    wait = next(i for i, text in enumerate(lines) if "gdc_wait()" in text)
    early = "\n".join(lines[:wait])
    assert "tl.load(ids_ptr" in early and "tl.load(w_ptrs" in early
    assert "tl.load(a_ptrs" not in early and "tl.load(out_ptrs" not in early
    assert "tl.load(a_ptrs" in "\n".join(lines[wait:])


def test_decode_attention_reads_q_and_the_new_kv_row_only_after_its_wait():
    """graphtune.ops._pdl: decode attention reads its mask (and a split's only tile) before
    gdc_wait(); q, the newest key's K/V row (which the kernel before it writes) and the tiles
    of a longer slice only after it, and the newest row replaces its place in the early tile."""
    pytest.importorskip("triton")
    import inspect

    from graphtune.ops import _attention_kernels

    lines = inspect.getsource(_attention_kernels.decode_attention_kernel.fn).splitlines()
    wait = next(i for i, text in enumerate(lines) if "gdc_wait()" in text)
    early, late = "\n".join(lines[:wait]), "\n".join(lines[wait:])
    assert "tl.load(mask_row" in early and "tl.load(k_ptrs" in early and "tl.load(v_ptrs" in early
    assert "tl.load(q_ptrs" not in early and "newest_at" not in early and "for n in" not in early
    assert "tl.load(q_ptrs" in late and "tl.load(k_row + newest_at" in late
    assert "tl.load(v_row + newest_at" in late and "k_first = tl.where(" in late
    assert "v_first = tl.where(" in late and "for n in range(0, count" in late
