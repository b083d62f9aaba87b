"""The accuracy check: tuned and untuned bf16 steps against a float32 reference of the same
weights, with the reference's greedy tokens fed to all three."""

from __future__ import annotations

import torch

from graphtune.autotuner import AutoTuner, TuningPolicy
from graphtune.autotuner.timing.base import Measurement
from graphtune.bench.accuracy import (
    AccuracyResult,
    StepError,
    _errors,
    decode_accuracy,
    float32_copy,
)
from graphtune.engine import random_model
from graphtune.engine.config import get_preset


class _FirstWins:
    """Fake timer: every candidate takes 1 us and none runs, so every pick is the torch one."""

    name = "fake"

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        return Measurement.from_samples([1.0], calls_per_sample=1, timer=self.name)


def test_bf16_steps_against_the_float32_reference() -> None:
    model = random_model(get_preset("qwen2-tiny"), seed=2, dtype=torch.bfloat16)
    reference = float32_copy(model)
    assert reference.lm_head is reference.embed and reference.layers[0].bqkv.dtype == torch.float32
    policy = TuningPolicy(rounds=1, remeasure_top=0)
    tuner = AutoTuner(timer=_FirstWins(), policy=policy, show_progress=False)
    results = decode_accuracy(model, tuner, batch_sizes=(1, 3), steps=6, reference=reference)
    assert [r.batch_size for r in results] == [1, 3] and tuner.stats.fallbacks == {}
    for r in results:
        assert r.untuned.max_abs > 0 and r.untuned.kl_mean > 0  # bf16 is not float32
        # The picks are the torch fallbacks: the tuned step is the untuned one, bit for bit.
        assert r.tuned == r.untuned and r.ratios == {"max_abs": 1.0, "kl_mean": 1.0, "kl_max": 1.0}
        assert r.no_worse and r.as_dict()["no_worse"] is True


def test_a_worse_step_fails_the_check() -> None:
    gen = torch.Generator().manual_seed(0)
    want = [torch.randn(2, 50, generator=gen) for _ in range(4)]
    close = [w + 1e-3 * torch.randn(w.shape, generator=gen) for w in want]
    far = [w + 1e-1 * torch.randn(w.shape, generator=gen) for w in want]
    good, bad = _errors(close, want), _errors(far, want)
    assert 0 < good.max_abs < bad.max_abs and 0 < good.kl_mean < bad.kl_mean
    assert _errors(want, want) == StepError(0.0, 0.0, 0.0, 1.0)
    assert not AccuracyResult(1, 4, untuned=good, tuned=bad).no_worse
    assert AccuracyResult(1, 4, untuned=bad, tuned=good).no_worse


def test_kl_below_the_floor_counts_as_equal():
    from graphtune.bench.accuracy import KL_FLOOR, AccuracyResult, StepError

    # One-hot next-token distributions: float64 leaves KL of about -1e-119 for both steps.
    untuned = StepError(max_abs=2.5, kl_mean=-2e-119, kl_max=0.0, top1_agree=1.0)
    tuned = StepError(max_abs=2.4, kl_mean=-8e-120, kl_max=KL_FLOOR / 2, top1_agree=1.0)
    result = AccuracyResult(batch_size=1, steps=64, untuned=untuned, tuned=tuned)
    assert result.ratios == {"max_abs": 2.4 / 2.5, "kl_mean": 1.0, "kl_max": 1.0}
    assert result.no_worse
    worse = StepError(max_abs=2.4, kl_mean=3 * KL_FLOOR, kl_max=3 * KL_FLOOR, top1_agree=1.0)
    assert AccuracyResult(1, 64, untuned, worse).ratios["kl_mean"] == 3.0
