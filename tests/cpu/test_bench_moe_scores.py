"""benchmarks/moe.py's scores of the GEMV path's two tuned stages, without a GPU.

The pure helpers of ``benchmarks/_moe_scores.py`` (history records per bucket, the down stage's
pick, the cross product of gate/up tactics and down tiles, the regrets, the table's text) on
synthetic records, and ``sweep_bucket``'s configurations on the CPU: the real runners with their
kernel launches logged, and a sweep that calls each configuration once instead of profiling it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import replace as dataclass_replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _moe_scores as scores  # noqa: E402
import moe as bench  # noqa: E402

import graphtune.bench as toolkit  # noqa: E402


def test_tokens_of_a_profile_and_short_tactics():
    assert scores.tokens_of("64x2048, 128x1536x2048, 128x2048x768, 64x8, 64x8") == 64
    grouped = dict(block_m=16, block_n=64, block_k=128, group_m=1, warps=4, stages=3)
    bucket = {
        "candidates": [
            {"runner": "TorchFusedMoeRunner", "tactic": -1},
            {"runner": "TritonFusedMoeRunner", "tactic": grouped},
            {"runner": "TritonMoeGemvRunner", "tactic": {"bn": 4, "bk": 256, "warps": 2}},
        ]
    }
    assert [scores.short(bucket, i) for i in (0, 1, 2, None)] == [
        "torch",
        "grouped 16/64/128/1/4/3",
        "gemv 4/256/2",
        "none",
    ]


def record(op: str, tokens: int, tactics: list[Any], winner: int | None, runner_index=0):
    """A history record of ``op`` at ``tokens`` (tactics in order, each of one runner)."""
    from graphtune.autotuner.selection import CandidateRecord

    cands = tuple(
        CandidateRecord(
            runner=f"R{runner_index}",
            runner_index=runner_index,
            tactic=t,
            median_us=10.0 + i,
            spread=0.0,
            samples=1,
            failed=None,
            tied=False,
        )
        for i, t in enumerate(tactics)
    )
    return SimpleNamespace(
        op=op, profile=f"{tokens}x32, 4x64x32", candidates=cands, winner_index=winner
    )


def test_records_by_tokens_keeps_each_ops_last_record_per_bucket():
    history = [
        record("op", 1, [-1], 0),
        record("down", 1, [{"features": 1}], 0),
        record("op", 2, [-1], 0),
        record("op", 1, [-1, {"bn": 2}], 1),  # the bucket tuned again: its cache entry's record
    ]
    by_tokens = scores.records_by_tokens(history, "op")
    assert sorted(by_tokens) == [1, 2] and by_tokens[1] is history[3]
    assert scores.records_by_tokens(history, "down") == {1: history[1]}
    assert scores.records_by_tokens(history, "other") == {}


def test_down_choice_is_the_tile_fused_moe_runs_or_none_for_the_implied_one():
    a, b = {"features": 1, "bk": 128, "warps": 2}, {"features": 2, "bk": 128, "warps": 4}
    tiles, pick = scores.down_choice(record("down", 1, [a, b], 1))
    assert [c.tactic for c in tiles] == [a, b] and pick == 1
    assert scores.down_choice(None) == ([], None)
    tiles, pick = scores.down_choice(record("down", 1, [a, b], None))  # every tile failed
    assert len(tiles) == 2 and pick is None
    # A bucket without tiles: the lone fallback, kept untimed; choose_down gives None.
    assert scores.down_choice(record("down", 64, [-1], 0)) == ([], None)
    tiles, pick = scores.down_choice(record("down", 1, [-1, a, b], 2))
    assert [c.tactic for c in tiles] == [a, b] and pick == 1  # indices among the tiles


def test_pair_plan_is_the_cross_product_of_gemv_tactics_and_tiles():
    assert scores.pair_plan([False, True, False, True], 2) == [(1, 0), (1, 1), (3, 0), (3, 1)]
    assert scores.pair_plan([False, True], 0) == []
    assert scores.pair_plan([False, False], 3) == []


def test_pick_scores_and_regret():
    got = scores.pick_scores([12.0, 10.0, 10.0, 11.0], 3)
    assert {k: got[k] for k in ("pick", "pick_us", "best", "best_us")} == {
        "pick": 3,
        "pick_us": 11.0,
        "best": 1,  # the first of equal times
        "best_us": 10.0,
    }
    assert got["regret"] == pytest.approx(0.1)
    assert scores.pick_scores([10.0, 11.0], None)["regret"] == float("inf")
    assert scores.pick_scores([float("inf"), 11.0], 0)["regret"] == float("inf")
    assert math.isnan(scores.regret(10.0, float("inf")))  # no best: the case has no truth
    with pytest.raises(ValueError, match="no candidates"):
        scores.pick_scores([], None)


def test_step_scores_rank_the_steps_pair_against_every_configuration():
    # Op candidates: torch, grouped, gemv A, gemv B; down tiles 0 and 1.
    op_us = [50.0, 30.0, 21.0, 22.0]
    gemv = [False, False, True, True]
    pairs = scores.pair_plan(gemv, 2)  # (2, 0), (2, 1), (3, 0), (3, 1)
    pair_us = [20.0, 24.0, 19.0, 25.0]
    got = scores.step_scores(op_us, 2, gemv, pairs, pair_us, 0)
    assert got["kind"] == "pair" and got["pick"] == [2, 0] and got["pick_us"] == 20.0
    assert got["best"] == [3, 0] and got["best_us"] == 19.0
    assert got["regret"] == pytest.approx(20.0 / 19.0 - 1)
    assert got["regret_gate_up"] == pytest.approx(20.0 / 19.0 - 1)  # B is better with tile 0
    got = scores.step_scores(op_us, 2, gemv, pairs, pair_us, 1)
    assert got["pick"] == [2, 1] and got["regret_gate_up"] == pytest.approx(0.0)
    assert got["regret"] == pytest.approx(24.0 / 19.0 - 1)


def test_step_scores_without_a_down_pick_or_a_gemv_pick_score_the_ops_own_run():
    op_us, gemv = [50.0, 30.0, 21.0], [False, False, True]
    pairs, pair_us = scores.pair_plan(gemv, 1), [15.0]
    got = scores.step_scores(op_us, 2, gemv, pairs, pair_us, None)  # implied down tile
    assert got["kind"] == "op" and got["pick"] == [2, None] and got["pick_us"] == 21.0
    assert got["best"] == [2, 0] and got["regret"] == pytest.approx(21.0 / 15.0 - 1)
    assert got["regret_gate_up"] is None
    got = scores.step_scores(op_us, 1, gemv, pairs, pair_us, 0)  # grouped picked: a pair beats it
    assert got["kind"] == "op" and got["pick"] == [1, None]
    assert got["regret"] == pytest.approx(30.0 / 15.0 - 1)
    got = scores.step_scores(op_us, 1, gemv, [], [], None)  # no down stage: the old regret
    assert got["best"] == [2, None] and got["regret"] == pytest.approx(30.0 / 21.0 - 1)
    got = scores.step_scores(op_us, None, gemv, [], [], None)  # every candidate failed
    assert got["pick"] is None and got["regret"] == float("inf")


def test_step_scores_refuse_unmeasured_or_mismatched_pairs():
    with pytest.raises(ValueError, match="was not measured"):
        scores.step_scores([1.0, 2.0], 1, [False, True], [], [], 0)
    with pytest.raises(ValueError, match="2 pairs but 1 times"):
        scores.step_scores([1.0, 2.0], 1, [False, True], [(1, 0), (1, 1)], [1.0], 0)


def test_config_text_and_pct():
    bucket = {
        "candidates": [
            {"runner": "TritonMoeGemvRunner", "tactic": {"bn": 4, "bk": 256, "warps": 2}}
        ],
        "down": {"candidates": [{"tactic": {"features": 2, "bk": 128, "warps": 4}}]},
    }
    assert scores.config_text(bucket, [0, 0]) == "gemv 4/256/2 + 2/128/4"
    assert scores.config_text(bucket, [0, None]) == "gemv 4/256/2"
    assert scores.config_text(bucket, None) == "none"
    assert [scores.pct(v) for v in (0.0123, None)] == ["1.23%", "-"]


def test_sweep_bucket_runs_each_configuration_as_the_step_would(monkeypatch):
    """The GPU path's call building on the CPU: real runners whose kernel launches are logged,
    real records, a sweep that calls each configuration once and returns fixed times."""
    from graphtune.ops.moe import (
        TorchFusedMoeRunner,
        TritonFusedMoeRunner,
        TritonMoeGemvRunner,
        moe_gemv_tactics,
    )
    from graphtune.ops.moe.gemv_down import TritonMoeGemvDownRunner

    launched: list[tuple[str, Any, Any, int]] = []

    def gemv_launch(self, inputs, tactic, *, warmup=False, down=None):
        launched.append((type(self).__name__, tactic, down, inputs[0].shape[0]))
        return torch.zeros_like(inputs[0])

    def grouped_launch(self, inputs, tactic, *, warmup=False):
        launched.append(("grouped", tactic, None, inputs[0].shape[0]))
        return torch.zeros_like(inputs[0])

    monkeypatch.setattr(TritonMoeGemvRunner, "launch", gemv_launch)
    monkeypatch.setattr(TritonFusedMoeRunner, "launch", grouped_launch)
    shape = bench.ExpertShape(4, 2, 32, 32)
    g0, g1 = moe_gemv_tactics(1, 2, 32, 32, itemsize=2)[:2]
    grouped = dict(block_m=16, block_n=32, block_k=32, group_m=1, warps=4, stages=2)
    t0, t1 = {"features": 4, "bk": 32, "warps": 2}, {"features": 8, "bk": 32, "warps": 2}
    op = record("op", 1, [-1], 0)
    cands = list(op.candidates) + [
        dataclass_replace(record("op", 1, [grouped], 0, 1).candidates[0], median_us=30.0),
        *record("op", 1, [g0, g1], 0, 2).candidates,
    ]
    op = SimpleNamespace(op="op", profile=op.profile, candidates=tuple(cands), winner_index=3)
    down = record("down", 1, [t0, t1], 0)  # the step runs gate/up g1 with tile t0
    tuned = {
        "runners": (TorchFusedMoeRunner(), TritonFusedMoeRunner(), TritonMoeGemvRunner()),
        "down_runners": (TritonMoeGemvDownRunner(),),
        "live": bench.live_inputs(shape, 2, torch.device("cpu")),
        "records": {1: op},
        "down_records": {1: down},
    }
    # Configurations in order: 4 op candidates, pairs (g0,t0) (g0,t1) (g1,t0) (g1,t1), 2 tiles.
    truth_us = [40.0, 30.0, 21.0, 22.0, 20.0, 26.0, 19.0, 25.0, 18.0, 18.5]
    seen_calls = []

    def fake_sweep(fns, calls, *, replays):
        seen_calls.extend(calls)
        for fn in fns:
            fn(0)
        return [{"per_call_us": us, "error": None} for us in truth_us]

    args = SimpleNamespace(max_tokens=2, min_replay_us=200.0, replays=3)
    bucket = bench.sweep_bucket(tuned, 1, args, sweep=fake_sweep)
    gemv = "TritonMoeGemvRunner"
    down_runner = "TritonMoeGemvDownRunner"
    assert launched == [
        ("grouped", grouped, None, 1),  # the torch candidate launches nothing
        (gemv, g0, None, 1),  # the op's candidates: the implied down tile
        (gemv, g1, None, 1),
        (gemv, g0, t0, 1),
        (gemv, g0, t1, 1),
        (gemv, g1, t0, 1),
        (gemv, g1, t1, 1),
        (down_runner, g0, t0, 1),  # the down stage: its fixed gate/up tile, then each tile
        (down_runner, g0, t1, 1),
    ]
    # Calls per replay from the tuner's times: a pair uses its gate/up tactic's time.
    assert seen_calls == [20, 7, 20, 19, 20, 20, 19, 19, 20, 19]
    assert bucket["n_candidates"] == 4 and bucket["n_measured"] == 10
    assert [(p["gate_up"], p["down"]) for p in bucket["pairs"]] == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert bucket["step"]["kind"] == "pair" and bucket["step"]["pick"] == [3, 0]
    assert bucket["step"]["best"] == [3, 0] and bucket["regret"] == 0.0 and bucket["regret_pass"]
    assert bucket["regret_op"] == pytest.approx(22.0 / 21.0 - 1)  # the op's own sweep
    assert bucket["regret_gate_up"] == 0.0
    assert bucket["down"]["pick_tactic"] == t0 and bucket["down"]["gate_up_tactic"] == g0
    assert bucket["regret_down"] == 0.0
    assert bucket["pick_us"] == 22.0 and bucket["best_us"] == 21.0  # old fields: op only
    assert json.loads(json.dumps(toolkit.json_safe(bucket)))["tokens"] == 1

    # fused_moe with these picks cached runs the step's pair: gate/up g1, then down tile t0.
    from graphtune.autotuner import AutoTuner
    from graphtune.autotuner.calls import OpCall
    from graphtune.ops.moe import OP_NAME, fused_moe, fused_moe_config
    from graphtune.ops.moe.gemv_down import OP_NAME as DOWN_OP_NAME
    from graphtune.ops.moe.gemv_down import down_runners

    live = bench.live_inputs(shape, 1, torch.device("cpu"))
    config, tuner = fused_moe_config(2), AutoTuner(show_progress=False)
    tuner.pin(OpCall(OP_NAME, tuned["runners"], config, tuple(live)), 2, g1)
    tuner.pin(OpCall(DOWN_OP_NAME, down_runners(), config, tuple(live)), 0, t0)
    launched.clear()
    fused_moe(*live, tuner=tuner, max_m=2, runners=tuned["runners"])
    assert launched == [(gemv, g1, t0, 1)]
    assert (
        bucket["candidates"][3]["tactic"] == g1 and bucket["down"]["candidates"][0]["tactic"] == t0
    )
