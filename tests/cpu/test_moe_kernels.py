"""The fused-MoE Triton kernels on the CPU interpreter against float64 and a layout oracle.

Covered: the sort step (one program and several, an expert count that is not a power of two,
repeated and out-of-range ids, every block_m) against a plain-Python layout; the runner with each
tactic shape class (streaming blocks of 16 and 32 rows, tiled blocks of 64 and 128 with the
program-id swizzle, K not a multiple of block_k) at T = 1, 3, 17 in float32 and float16; every
tactic the runner lists for a bucket; poisoned buffers (every uninitialised allocation filled
with NaN or a wild int, so a row read before it is written shows); tuning through the AutoTuner;
and capture of routing + kernels by the graph runner's simulated backend with a guard that fails
on any host-synchronising torch op.

bfloat16 is left to tests/gpu: the interpreter's ``tl.dot`` on bfloat16 operands returns garbage
(Triton 3.9), while float16 exercises the same rounding points. Shapes are tiny (the interpreter
runs every program in numpy); inputs are fresh random numbers per test, the seed is in the
assertion message.
"""

from __future__ import annotations

import contextlib
import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")


from fake_timers import LastIsFastest  # noqa: E402
from moe_cases import (  # noqa: E402
    TOL,
    NoHostSync,
    float64_moe,
    gen_seeded,
    moe_case,
    poisoned_allocations,
    rel_error,
)

from graphtune.autotuner import AutoTuner, TuningPolicy, autotune  # noqa: E402
from graphtune.errors import ConfigError  # noqa: E402
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    TorchFusedMoeRunner,
    TritonFusedMoeRunner,
    TritonMoeGemvRunner,
    dense_fused_moe,
    fused_moe,
    max_sorted_rows,
    pairs_per_program,
    route_top_k,
    sort_by_expert,
    sparse_fused_moe,
)

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


def _tactic(block_m, block_n, block_k, group_m=1, warps=4, stages=2):
    return dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        group_m=group_m,
        warps=warps,
        stages=stages,
    )


# One per tactic shape class of moe_tactics (streaming: block_m 16/32; tiled: 64/128 with and
# without the swizzle), with block_k 32 so that H or I = 40/48 leaves a partial K step.
TACTIC_CLASSES = [
    _tactic(16, 32, 64),
    _tactic(32, 64, 32, stages=3),
    _tactic(64, 32, 32, group_m=8),
    _tactic(128, 64, 32, warps=8),
]


def oracle_layout(ids, experts, block_m):
    """The sorted layout by hand: pairs by expert then pair id, each expert padded to blocks."""
    flat = ids.reshape(-1).tolist()
    pairs = len(flat)
    rows, block_expert = [], []
    for e in range(experts):
        mine = [p for p in range(pairs) if flat[p] == e]
        if mine:
            size = -(-len(mine) // block_m) * block_m
            rows += mine + [pairs] * (size - len(mine))
            block_expert += [e] * (size // block_m)
    total = max_sorted_rows(pairs, experts, block_m)
    return rows + [pairs] * (total - len(rows)), block_expert + [-1] * (
        total // block_m - len(block_expert)
    )


# --- sort step -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m",
    [
        (1, 2, 4, 16),
        (3, 2, 8, 16),
        (17, 2, 6, 32),
        (600, 2, 8, 16),
        (300, 4, 40, 64),
        (9, 3, 5, 128),
        (64, 8, 128, 16),  # Qwen3-30B-A3B's routing at 64 tokens: 16 programs of 32 pairs
    ],
)
def test_sort_by_expert_matches_the_oracle(tokens, top_k, experts, block_m):
    gen = gen_seeded()
    ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    with poisoned_allocations():
        blocks = sort_by_expert(ids, experts, block_m)
    rows, block_expert = oracle_layout(ids, experts, block_m)
    assert blocks.sorted_pairs.tolist() == rows, gen.initial_seed()
    assert blocks.block_expert.tolist() == block_expert, gen.initial_seed()
    assert blocks.num_blocks * block_m == len(rows) and blocks.pairs == tokens * top_k


def test_mid_size_routings_spread_the_sort_over_programs():
    # One program walks its steps one after another; 512 pairs in one program took 125 us per
    # layer on the H200 in the Qwen3-30B-A3B step at batch 64.
    assert pairs_per_program(8, 32) == 32  # decode: one program, one step
    assert pairs_per_program(512, 32) == 32  # 16 programs
    assert pairs_per_program(4096, 32) == 64  # 64 programs
    assert pairs_per_program(32768, 32) == 512  # 4096 tokens of top 8: 64 programs
    assert pairs_per_program(1 << 17, 32) == 1024  # past that, more programs of the largest
    assert pairs_per_program(128, 256) == 256  # few experts: one step holds many pairs


def test_sort_by_expert_skewed_repeated_and_out_of_range_ids():
    gen = gen_seeded()
    ids = torch.randint(0, 2, (700, 2), generator=gen, dtype=torch.int32)  # two experts of 6
    ids[5] = torch.tensor([1, 1], dtype=torch.int32)  # a token routed twice to one expert
    ids[7, 1], ids[650, 0] = -1, 6  # no expert: these pairs get no row
    with poisoned_allocations():
        blocks = sort_by_expert(ids, 6, 32)
    rows, block_expert = oracle_layout(ids, 6, 32)
    assert blocks.sorted_pairs.tolist() == rows and blocks.block_expert.tolist() == block_expert


def test_sort_by_expert_rejects_a_bad_block():
    with pytest.raises(ConfigError, match="block_m"):
        sort_by_expert(torch.zeros(2, 2, dtype=torch.int64), 4, 24)


# --- the runner ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens, experts, hidden, inter", [(1, 4, 32, 32), (3, 8, 40, 48), (17, 6, 64, 40)]
)
def test_every_tactic_class_matches_float64(dtype, tokens, experts, hidden, inter):
    gen = gen_seeded()
    runner = TritonFusedMoeRunner()
    inputs = moe_case(gen, tokens, experts, hidden, inter, dtype)
    want = float64_moe(*inputs)
    for tactic in TACTIC_CLASSES:
        with poisoned_allocations():
            got = runner.forward(inputs, tactic)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        assert rel_error(got, want) < TOL[dtype], (tactic, gen.initial_seed())


def test_every_listed_tactic_runs_and_the_fallback_is_the_torch_loop():
    gen = gen_seeded()
    runner = TritonFusedMoeRunner()
    inputs = moe_case(gen, 17, 6, 64, 32)
    tactics = runner.get_valid_tactics(inputs, None)
    assert len(tactics) >= 4
    report = runner.precompile(inputs, tactics, workers=1)
    assert all(error is None for error in report.values()), report
    want = float64_moe(*inputs)
    for tactic in tactics:
        assert rel_error(runner.forward(inputs, tactic), want) < TOL[torch.float32], tactic
    assert torch.equal(runner.forward(inputs, -1), sparse_fused_moe(*inputs))


def test_repeated_and_out_of_range_ids_add_like_the_dense_form():
    gen = gen_seeded()
    x, gate_up, down, weights, _ = moe_case(gen, 4, 5, 32, 32, top_k=3)
    ids = torch.tensor([[1, 1, 4], [0, 5, 2], [-1, 3, 3], [4, 2, 0]])
    want = float64_moe(x, gate_up, down, weights, ids)
    with poisoned_allocations():
        got = TritonFusedMoeRunner().forward([x, gate_up, down, weights, ids], TACTIC_CLASSES[0])
    assert rel_error(got, want) < TOL[torch.float32], gen.initial_seed()
    assert rel_error(dense_fused_moe(x, gate_up, down, weights, ids), want) < TOL[torch.float32]


def test_bfloat16_routing_weights_and_int32_ids_are_accepted():
    gen = gen_seeded()
    inputs = moe_case(gen, 5, 4, 32, 32)
    inputs[3], inputs[4] = inputs[3].to(torch.bfloat16), inputs[4].to(torch.int32)
    want = float64_moe(*inputs)
    assert rel_error(TritonFusedMoeRunner().forward(inputs, TACTIC_CLASSES[1]), want) < 1e-5


def test_a_bad_tactic_is_a_config_error():
    inputs = moe_case(gen_seeded(), 2, 4, 32, 32)
    with pytest.raises(ConfigError, match="TritonFusedMoeRunner: block_m"):
        TritonFusedMoeRunner().forward(inputs, _tactic(8, 32, 32))


# --- tuning and capture ---------------------------------------------------------------------------


def test_tuning_picks_a_triton_tactic_per_bucket_and_lookups_run_it():
    gen = gen_seeded()
    tuner = AutoTuner(
        timer=LastIsFastest(run=True),
        show_progress=False,
        policy=TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0),
    )
    runners = (TorchFusedMoeRunner(), TritonFusedMoeRunner(compile_workers=1))
    x, gate_up, down, weights, ids = moe_case(gen, 4, 4, 32, 32)
    with autotune(tuner=tuner):
        fused_moe(x, gate_up, down, weights, ids, tuner=tuner, max_m=4, runners=runners)
    assert tuner.stats.profiles_tuned == 3  # buckets 1, 2, 4
    assert all("TritonFusedMoeRunner" in row[2] for row in tuner.summary_rows())
    assert not tuner.stats.tactic_failures
    for tokens in (1, 3, 5):  # 5 tokens: bucket 4 (max_m caps it)
        inputs = moe_case(gen, tokens, 4, 32, 32)
        inputs[1], inputs[2] = gate_up, down
        got = fused_moe(*inputs, tuner=tuner, max_m=4, runners=runners)
        assert rel_error(got, float64_moe(*inputs)) < TOL[torch.float32], tokens
    assert not tuner.stats.fallbacks


def test_the_guard_catches_the_sparse_loop():
    with pytest.raises(RuntimeError, match="host-synchronising"), NoHostSync():
        sparse_fused_moe(*moe_case(gen_seeded(), 3, 4, 32, 32))


@pytest.mark.parametrize("form", ["triton", "gemv", "dense"])
def test_routing_and_kernels_capture_and_replay_without_host_sync(form):
    gen = gen_seeded()
    hidden, experts = 32, 6
    _, gate_up, down, _, _ = moe_case(gen, 1, experts, hidden, 32)
    router = torch.randn(experts, hidden, generator=gen)
    backend = SimulatedGraphBackend()
    runner, tactic = {
        "triton": (TritonFusedMoeRunner(), TACTIC_CLASSES[0]),
        "gemv": (TritonMoeGemvRunner(), {"bn": 4, "bk": 32, "warps": 1}),
        "dense": (None, None),
    }[form]

    def step(x):
        guard = NoHostSync() if backend.capturing else contextlib.nullcontext()
        with guard:
            weights, ids = route_top_k(x @ router.T, 2, renormalize=True)
            if runner is None:
                return dense_fused_moe(x, gate_up, down, weights, ids)
            return runner.forward([x, gate_up, down, weights, ids], tactic)

    graphs = CUDAGraphRunner(step, max_batch_size=4, backend=backend)
    graphs.capture(torch.randn(4, hidden, generator=gen))
    assert backend.captures == 3  # 4, 2, 1
    for tokens in (1, 3, 4):
        x = torch.randn(tokens, hidden, generator=gen)
        got = graphs(x).clone()
        weights, ids = route_top_k(x @ router.T, 2, renormalize=True)
        assert rel_error(got, float64_moe(x, gate_up, down, weights, ids)) < TOL[torch.float32]
    assert graphs.stats.replays == 3 and graphs.stats.eager_calls == 0
