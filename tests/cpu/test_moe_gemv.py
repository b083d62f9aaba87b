"""The fused-MoE GEMV runner (graphtune.ops.moe.gemv) on the CPU interpreter against float64.

Covered: every tactic the runner lists for a bucket, at T = 1, 3, 5, in float32 and float16,
with K not a multiple of bk (H = 40, I = 48); poisoned buffers; repeated and out-of-range expert
ids; bfloat16 routing weights with int32 ids; the pruning rules; the op's runner list and tuning
(the GEMV runner competes only at decode sizes); the residual added in place. Capture by the
simulated graph backend is tested with the other runners in tests/cpu/test_moe_kernels.py. Shapes
are tiny (the interpreter runs every program in numpy).
"""

from __future__ import annotations

import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fake_timers import last_wins_tuner  # noqa: E402
from moe_cases import (  # noqa: E402
    TOL,
    float64_moe,
    gen_seeded,
    moe_case,
    poisoned_allocations,
    rel_error,
)

from graphtune.autotuner import autotune  # noqa: E402
from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops.moe import (  # noqa: E402
    TorchFusedMoeRunner,
    TritonFusedMoeRunner,
    TritonMoeGemvRunner,
    fused_moe,
    fused_moe_runners,
    gemv_down,  # noqa: E402
    moe_gemv_tactics,
    sparse_fused_moe,
)
from graphtune.ops.moe import gemv as moe_gemv  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "tokens, experts, top_k, hidden, inter",
    [(1, 4, 2, 32, 32), (3, 8, 3, 40, 48), (5, 6, 2, 64, 40)],
)
def test_every_listed_tactic_matches_float64(dtype, tokens, experts, top_k, hidden, inter):
    gen = gen_seeded()
    runner = TritonMoeGemvRunner(compile_workers=1)
    inputs = moe_case(gen, tokens, experts, hidden, inter, dtype, top_k=top_k)
    tactics = runner.get_valid_tactics(inputs, None)
    assert tactics, (tokens, experts, top_k, hidden, inter)
    want = float64_moe(*inputs)
    for tactic in tactics:
        with poisoned_allocations():
            got = runner.forward(inputs, tactic)
        assert got.dtype == dtype and got.shape == (tokens, hidden)
        assert rel_error(got, want) < TOL[dtype], (tactic, gen.initial_seed())
    assert torch.equal(runner.forward(inputs, -1), sparse_fused_moe(*inputs))


def test_repeated_and_out_of_range_ids_add_nothing_for_the_missing_expert():
    gen = gen_seeded()
    x, gate_up, down, weights, _ = moe_case(gen, 4, 5, 32, 32, top_k=3)
    ids = torch.tensor([[1, 1, 4], [0, 5, 2], [-1, 3, 3], [4, 2, 0]])
    want = float64_moe(x, gate_up, down, weights, ids)
    tactic = {"bn": 4, "bk": 32, "warps": 1}
    with poisoned_allocations():  # the act rows of ids 5 and -1 stay NaN: they must not be read
        got = TritonMoeGemvRunner().forward([x, gate_up, down, weights, ids], tactic)
    assert rel_error(got, want) < TOL[torch.float32], gen.initial_seed()


def test_bfloat16_routing_weights_and_int32_ids_are_accepted():
    gen = gen_seeded()
    inputs = moe_case(gen, 3, 4, 32, 32)
    inputs[3], inputs[4] = inputs[3].to(torch.bfloat16), inputs[4].to(torch.int32)
    got = TritonMoeGemvRunner().forward(inputs, {"bn": 8, "bk": 16, "warps": 1})
    assert rel_error(got, float64_moe(*inputs)) < 1e-5, gen.initial_seed()


@pytest.mark.parametrize(
    "tactic",
    [{"bn": 4, "bk": 32}, {"bn": 3, "bk": 32, "warps": 1}, {"bn": 4, "bk": 32, "warps": 64}],
)
def test_a_bad_tactic_is_a_config_error(tactic):
    inputs = moe_case(gen_seeded(), 2, 4, 32, 32)
    with pytest.raises(ConfigError, match="TritonMoeGemvRunner"):
        TritonMoeGemvRunner().forward(inputs, tactic)


def test_pruning_rules():
    # Qwen3-30B-A3B's experts at one token: 8 pairs, bf16.
    tactics = moe_gemv_tactics(1, 8, 2048, 768, itemsize=2)
    assert 4 <= len(tactics) <= 16
    for tactic in tactics:
        per_thread = tactic["bn"] * tactic["bk"] * 2 / (32 * tactic["warps"])
        assert moe_gemv.THREAD_BYTES[0] <= per_thread <= moe_gemv.THREAD_BYTES[1], tactic
        assert tactic["bn"] in moe_gemv.BN_CHOICES and tactic["bk"] in moe_gemv.BK_CHOICES
    assert tactics == sorted(tactics, key=lambda t: (t["warps"], t["bn"], t["bk"]))
    # Past MAX_PAIRS pairs the grouped GEMMs read each expert once and the GEMV path is not timed.
    assert moe_gemv_tactics(8, 8, 2048, 768, itemsize=2)
    assert moe_gemv_tactics(9, 8, 2048, 768, itemsize=2) == []
    assert moe_gemv_tactics(32, 2, 4096, 14336, itemsize=2)
    assert moe_gemv_tactics(33, 2, 4096, 14336, itemsize=2) == []
    # Many slots per token: the down kernel's tile of all slots prunes the widest chunks.
    for tactic in moe_gemv_tactics(1, 32, 2048, 768, itemsize=2):
        rows = max(tactic["bn"], 32)
        assert rows * tactic["bk"] * 2 <= moe_gemv.DOWN_THREAD_BYTES * 32 * tactic["warps"]
    assert len(moe_gemv_tactics(1, 32, 2048, 768, itemsize=2)) < len(tactics)
    # Toy shapes clamp the tile and run small ones on one warp.
    small = moe_gemv_tactics(1, 2, 32, 48, itemsize=4)
    assert small and all(t["bk"] <= 32 and t["bn"] <= 32 for t in small)
    assert any(t["warps"] == 1 for t in small)


def test_the_op_offers_the_gemv_path_and_tuning_keeps_it_to_decode_sizes():
    assert any(isinstance(r, TritonMoeGemvRunner) for r in fused_moe_runners())
    gen = gen_seeded()
    tuner = last_wins_tuner(run=True)
    runners = (
        TorchFusedMoeRunner(),
        TritonFusedMoeRunner(compile_workers=1),
        TritonMoeGemvRunner(compile_workers=1),
    )
    # E = 8, k = 4: buckets up to T = 16 (64 pairs) get GEMV tactics, bucket 32 does not. The
    # pairs of the largest GEMV bucket, not the bucket count, set the interpreter's cost (every
    # candidate runs once per (pair, tile) program); H = I = 16 with 4 slots per token still
    # lists 3 GEMV tactics and 3 down tiles at every GEMV bucket, so each is timed (run), none
    # kept untimed as a single candidate.
    experts, top_k, hidden, inter = 8, 4, 16, 16
    x, gate_up, down, weights, ids = moe_case(gen, 32, experts, hidden, inter, top_k=top_k)
    with autotune(tuner=tuner):
        fused_moe(x, gate_up, down, weights, ids, tuner=tuner, max_m=32, runners=runners)
    rows = tuner.summary_rows()
    picks = {row[1].split("x")[0]: row[2] for row in rows if row[0] == "graphtune.fused_moe"}
    assert all("TritonMoeGemvRunner" in picks[str(t)] for t in (1, 2, 4, 8, 16)), picks
    assert "TritonFusedMoeRunner" in picks["32"], picks
    # The down tiles were tuned beside them (graphtune.ops.moe.gemv_down); bucket 32 has none
    # (its single candidate, the fallback, is kept untimed).
    downs = {row[1].split("x")[0]: row[2] for row in rows if row[0] == gemv_down.OP_NAME}
    assert set(downs) == {"1", "2", "4", "8", "16", "32"}, downs
    assert all('"features"' in downs[str(t)] for t in (1, 2, 4, 8, 16)), downs
    assert '"features"' not in downs["32"], downs
    for tokens in (1, 5, 32):
        inputs = moe_case(gen, tokens, experts, hidden, inter, top_k=top_k)
        inputs[1], inputs[2] = gate_up, down
        got = fused_moe(*inputs, tuner=tuner, max_m=32, runners=runners)
        assert rel_error(got, float64_moe(*inputs)) < TOL[torch.float32], tokens
    assert not tuner.stats.fallbacks and not tuner.stats.tactic_failures


@pytest.mark.parametrize(
    "runner_class", [TorchFusedMoeRunner, TritonFusedMoeRunner, TritonMoeGemvRunner]
)
def test_a_residual_is_added_in_place_with_the_rounding_of_a_separate_add(runner_class):
    gen = gen_seeded()
    inputs = moe_case(gen, 3, 4, 32, 32, torch.float16)
    runner = runner_class()
    tactic = (
        runner.get_valid_tactics(inputs, None)[0] if runner_class is not TorchFusedMoeRunner else -1
    )
    residual = torch.randn(3, 32, generator=gen).to(torch.float16)
    want = residual.clone().add_(runner.forward(inputs, tactic))
    got = runner.forward([*inputs, residual], tactic)
    assert got is residual and torch.equal(residual, want), gen.initial_seed()


def test_the_op_with_a_residual_tunes_its_own_profiles_and_checks_the_residual():
    gen = gen_seeded()
    tuner = last_wins_tuner(run=True)
    runners = (TorchFusedMoeRunner(), TritonMoeGemvRunner(compile_workers=1))
    x, gate_up, down, weights, ids = moe_case(gen, 2, 4, 32, 32)
    residual = torch.randn(1, 2, 32, generator=gen)  # leading dims as x's: [1, 2, H] for [2, H]
    before = residual.clone()
    with autotune(tuner=tuner):
        got = fused_moe(
            x.view(1, 2, 32),
            gate_up,
            down,
            weights,
            ids,
            residual=residual,
            tuner=tuner,
            max_m=2,
            runners=runners,
        )
    assert got is residual
    want = before[0].double() + float64_moe(x, gate_up, down, weights, ids)
    assert rel_error(residual[0], want) < TOL[torch.float32]
    picks = [row[2] for row in tuner.summary_rows() if row[0] == "graphtune.fused_moe"]
    assert picks and all("TritonMoeGemvRunner" in pick for pick in picks)
    assert all(row[1].endswith("2x32") or row[1].endswith("1x32") for row in tuner.summary_rows())
    with pytest.raises(InputError, match="residual must be a contiguous"):
        fused_moe(x, gate_up, down, weights, ids, residual=residual.to(torch.float16), tuner=tuner)
    with pytest.raises(InputError, match="residual must be a contiguous"):
        fused_moe(x, gate_up, down, weights, ids, residual=torch.zeros(32, 2).T, tuner=tuner)
    with pytest.raises(InputError, match="residual must be a contiguous"):  # x's rows flattened
        fused_moe(x.view(1, 2, 32), gate_up, down, weights, ids, residual=before[0], tuner=tuner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_down_tile_matches_float64_and_the_gemv_pick_runs_with_it(dtype):
    """The down stage's candidates (graphtune.ops.moe.gemv_down) run the GEMV path with their
    own down tile, and the GEMV runner runs any of them beside any gate/up tile."""
    gen = gen_seeded()
    # 2 tokens of 3 slots (4 padded). H = 20, I = 40 list the same tiles as H = 40, I = 48 and
    # run every mask: K in both kernels (20 < bk 32, 40 < bk 64) and the last program's
    # features (8-feature down tiles, the 16-row gate/up tile).
    inputs = moe_case(gen, 2, 8, 20, 40, dtype, top_k=3)
    want = float64_moe(*inputs)
    runner = gemv_down.TritonMoeGemvDownRunner(compile_workers=1)
    tiles = runner.get_valid_tactics(inputs, None)
    assert len(tiles) >= 3
    gate_up = moe_gemv_tactics(2, 3, 20, 40, itemsize=inputs[0].element_size())[-1]
    gemv = TritonMoeGemvRunner(compile_workers=1)
    for tile in tiles:
        with poisoned_allocations():
            alone = runner.forward(inputs, tile)
            paired = gemv.forward(inputs, gate_up, down_tile=tile)
        assert rel_error(alone, want) < TOL[dtype], tile
        assert rel_error(paired, want) < TOL[dtype], (gate_up, tile)


def test_down_tile_rules():
    tiles = gemv_down.down_tiles(1, 8, 2048, 768, itemsize=2)
    assert tiles and len(tiles) == len({tuple(t.items()) for t in tiles})
    for tile in tiles:
        per_thread = 8 * tile["features"] * tile["bk"] * 2 / (32 * tile["warps"])
        assert 16 <= per_thread <= 64, tile
        assert moe_gemv.check_down_tile(tile) is None
    assert {"features": 4, "bk": 256, "warps": 8} in tiles
    assert gemv_down.down_tiles(9, 8, 2048, 768, itemsize=2) == []  # 72 pairs
    assert all(
        t["bk"] <= 32 and t["features"] <= 16
        for t in gemv_down.down_tiles(1, 2, 16, 24, itemsize=4)
    )
    with pytest.raises(ConfigError, match="down tile"):
        TritonMoeGemvRunner().forward(
            moe_case(gen_seeded(), 1, 4, 32, 32),
            {"bn": 2, "bk": 32, "warps": 1},
            down_tile={"bk": 3},
        )


def test_the_op_runs_the_tuned_down_tile_with_its_gemv_pick(monkeypatch):
    """Tuned at one size, every GEMV bucket gets a down tile; the op then runs its GEMV pick with
    the down stage's tile (the last-listed one under this timer), not the implied one."""
    gen = gen_seeded()
    tuner = last_wins_tuner(run=True)
    runners = (TorchFusedMoeRunner(), TritonMoeGemvRunner(compile_workers=1))
    inputs = moe_case(gen, 2, 4, 32, 32)
    with autotune(tuner=tuner):
        fused_moe(*inputs, tuner=tuner, max_m=2, runners=runners)
    seen: list = []
    real = TritonMoeGemvRunner.launch

    def spy(self, inputs, tactic, *, warmup=False, down=None):
        seen.append(down)
        return real(self, inputs, tactic, warmup=warmup, down=down)

    monkeypatch.setattr(TritonMoeGemvRunner, "launch", spy)
    got = fused_moe(*inputs, tuner=tuner, max_m=2, runners=runners)
    assert rel_error(got, float64_moe(*inputs)) < TOL[torch.float32]
    assert seen == [gemv_down.down_tiles(2, 2, 32, 32, itemsize=4)[-1]]
    assert not tuner.stats.fallbacks
