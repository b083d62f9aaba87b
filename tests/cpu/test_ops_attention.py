"""Decode attention runners agree with a float64 reference and tune through the real AutoTuner."""

from __future__ import annotations

import torch

from graphtune.autotuner import AutoTuner, autotune
from graphtune.autotuner.timing.base import Measurement
from graphtune.ops import attention


def _inputs(batch: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    kv_heads, groups, seq, dim = 2, 4, 24, 16
    q = torch.randn(batch, kv_heads, groups, dim, generator=gen, dtype=dtype)
    keys = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype)
    values = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)
    visible = torch.arange(seq)[None, :] < lengths[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(dtype)[:, None, None, :]
    return [q, keys, values, mask]


def _reference(q, keys, values, mask):
    q, keys, values, mask = (t.double() for t in (q, keys, values, mask))
    scores = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    return torch.softmax(scores, dim=-1) @ values


def test_every_runner_and_tactic_matches_float64_reference():
    for seed in range(3):
        inputs = _inputs(batch=3, seed=seed)
        want = _reference(*inputs)
        for runner in attention.RUNNERS:
            for tactic in runner.get_valid_tactics(inputs, None):
                got = runner.forward(inputs, tactic).double()
                err = (got - want).norm() / want.norm()
                assert err < 1e-5, (type(runner).__name__, tactic, float(err))


def test_low_precision_tactic_is_offered_for_half_inputs_only():
    runner = attention.MatmulAttention()
    assert "low_precision" not in runner.get_valid_tactics(_inputs(2, 0), None)
    assert "low_precision" in runner.get_valid_tactics(_inputs(2, 0, torch.bfloat16), None)
    inputs = _inputs(2, 1, torch.bfloat16)
    got = runner.forward(inputs, "low_precision").double()
    want = _reference(*inputs)
    assert (got - want).norm() / want.norm() < 2e-2


class _PreferMatmul:
    """Fake timer: the matmul runner is 'faster' (times come from the runner's class name)."""

    name = "fake"

    def __init__(self) -> None:
        self.current: str | None = None

    def measure(self, fn, *, warmup: int, repeat: int) -> Measurement:
        fn(0)
        us = 1.0 if self.current == "MatmulAttention" else 2.0
        return Measurement.from_samples([us], calls_per_sample=1, timer=self.name)


def test_tuner_picks_per_batch_bucket_and_lookups_follow_the_cache(monkeypatch):
    timer = _PreferMatmul()
    for cls in (attention.MatmulAttention, attention.SdpaAttention):
        original = cls.forward

        def tagged(self, inputs, tactic=-1, _original=original, _name=cls.__name__):
            timer.current = _name
            return _original(self, inputs, tactic)

        monkeypatch.setattr(cls, "forward", tagged)
    tuner = AutoTuner(timer=timer, show_progress=False)
    config = attention.tuning_config(max_batch_size=8)
    with autotune(tuner=tuner):
        runner, _ = tuner.choose_one(attention.OP_NAME, attention.RUNNERS, config,
                                     _inputs(batch=5, seed=0))
    assert isinstance(runner, attention.MatmulAttention)
    # Every bucket (1, 2, 4, 8) was tuned by the first miss; a later batch only looks up.
    hits = tuner.stats.hits
    out = attention.decode_attention(*_inputs(batch=2, seed=1), tuner=tuner, config=config)
    assert out.shape == (2, 2, 4, 16)
    assert tuner.stats.hits == hits + 1
