"""The fused stages in the one forward, on the CPU: tuned with the real wall-clock timer (Triton
kernels in the interpreter), the step gives the untuned step's tokens and looks nothing up that
it did not tune; the single ops are tuned before the fused ops (no tuning nested inside another
op's timing); cold-L2 tuning reaches the fused ops; the tuned unfused step finds its picks too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from graphtune.autotuner import AutoTuner, TuningPolicy  # noqa: E402
from graphtune.autotuner.timing.base import Measurement  # noqa: E402
from graphtune.autotuner.timing.wallclock import WallClockTimer  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model, tune_step  # noqa: E402
from graphtune.ops import _triton  # noqa: E402

FUSED_OPS = {
    "graphtune.norm_qkv_rope",
    "graphtune.add_projection",
    "graphtune.norm_gate_up_silu",
    "graphtune.norm_linear",
}


def _greedy(step: DecodeStep, first: torch.Tensor, steps: int) -> list[list[int]]:
    """Greedy tokens of ``steps`` decode steps from position 0 (rows own slots 0..B-1)."""
    tokens, out = first, []
    slots = torch.arange(first.shape[0])
    with torch.inference_mode():
        for position in range(steps):
            logits = step(tokens, torch.full_like(tokens, position), slots)
            tokens = logits.argmax(-1)
            out.append(tokens.tolist())
    return out


class _OneCallWallClock:
    """The real wall-clock timer, one warm-up and one timed call per candidate (the defaults
    make 13 calls, which the interpreter takes minutes over)."""

    name = "wallclock"

    def __init__(self) -> None:
        self.timer = WallClockTimer(samples=1)

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        return self.timer.measure(fn, warmup=1, repeat=1)


def test_fused_step_tuned_with_the_wallclock_timer_gives_the_untuned_tokens(monkeypatch) -> None:
    model = load_model("tiny", seed=5)
    tuner = AutoTuner(
        timer=_OneCallWallClock(),
        policy=TuningPolicy(rounds=1, remeasure_top=0, max_extra_rounds=0),
        show_progress=False,
    )
    # Nothing is tuned while another op is being tuned: the warm-up of a fused op's unfused
    # runner (every candidate runs here) finds its single ops tuned by the unfused pass.
    depth, deepest = [0], [0]
    tune_op = tuner._run

    def counted(*args, **kwargs):
        depth[0] += 1
        deepest[0] = max(deepest[0], depth[0])
        try:
            return tune_op(*args, **kwargs)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(tuner, "_run", counted)
    tuned = DecodeStep(model, KVCache(model.config, 2, 32), contiguous_slots=True, tuner=tuner)
    report = tune_step(tuned)
    assert report.buckets == (1, 2) and not tuner.stats.tactic_failures
    assert deepest[0] == 1
    assert FUSED_OPS <= {row[0] for row in report.rows}
    ops = [record.op for record in tuner.history]
    first_fused = min(i for i, op in enumerate(ops) if op in FUSED_OPS)
    assert all(op in FUSED_OPS for op in ops[first_fused:]), ops[first_fused:]
    if _triton.device_supported(torch.device("cpu")):
        # At batch 1 every fused kernel offered there was timed beside the unfused path; the
        # residual projection and the LM head offer none at one row (graphtune.ops._pruned).
        batch_one = [r for r in tuner.history if r.op in FUSED_OPS and r.profile.startswith("1x")]
        assert len(batch_one) == 5
        unfused_only = {"graphtune.add_projection", "graphtune.norm_linear"}
        for record in batch_one:
            assert (len(record.candidates) > 1) == (record.op not in unfused_only), record
    untuned = DecodeStep(model, KVCache(model.config, 2, 32), contiguous_slots=True)
    first = torch.tensor([3, 77])
    misses = tuner.stats.misses
    for batch in (1, 2):
        assert _greedy(tuned, first[:batch], 6) == _greedy(untuned, first[:batch], 6)
    # The tuned unfused step (the step before the fused ops) finds its picks in the same cache.
    unfused = DecodeStep(
        model, KVCache(model.config, 2, 32), contiguous_slots=True, tuner=tuner, fused=False
    )
    assert _greedy(unfused, first, 3) == _greedy(untuned, first, 3)
    assert tuner.stats.fallbacks == {} and tuner.stats.misses == misses


def test_cold_l2_tuning_reaches_the_fused_ops(monkeypatch) -> None:
    model = load_model("tiny")
    tuner = AutoTuner(show_progress=False)
    seen: dict[str, set[bool]] = {}
    choose = tuner.choose_one

    def spy(op, runners, config, inputs):
        seen.setdefault(op, set()).add(config.cold_l2)
        return choose(op, runners, config, inputs)

    monkeypatch.setattr(tuner, "choose_one", spy)
    step = DecodeStep(model, KVCache(model.config, 2, 32), tuner=tuner, gemm_cold_l2=True)
    # Look-ups only (tuning with cold-L2 rotation builds thousands of input copies on the CPU):
    # every fused op misses and runs its unfused runner, whose GEMM is looked up too.
    with torch.inference_mode():
        step(*step.example_inputs(1))
        step.decode(step.ops.unfused(), *step.example_inputs(1))
    assert all(seen[op] == {True} for op in FUSED_OPS | {"graphtune.gemm"}), seen
    assert seen["graphtune.rms_norm"] == {False}  # only the weight-streaming ops rotate


def test_cold_l2_by_default_exactly_when_the_weights_exceed_the_l2(monkeypatch) -> None:
    import graphtune.engine.step as step_module

    model = load_model("tiny")
    weights = model.weight_bytes()

    def step_with_l2(l2_bytes: int, **kwargs) -> DecodeStep:
        monkeypatch.setattr(step_module, "l2_cache_bytes", lambda device: l2_bytes)
        cache = KVCache(model.config, 2, 32)
        return DecodeStep(model, cache, tuner=AutoTuner(show_progress=False), **kwargs)

    assert step_with_l2(weights - 1).ops.gemm_cold_l2 is True
    assert step_with_l2(weights).ops.gemm_cold_l2 is False
    assert step_with_l2(weights - 1, gemm_cold_l2=False).ops.gemm_cold_l2 is False
    assert step_with_l2(weights, gemm_cold_l2=True).ops.gemm_cold_l2 is True
