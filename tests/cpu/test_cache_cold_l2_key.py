"""Cold L2 is part of the cache key (its ``timing`` ends in ``+cold_l2``): a pick timed with a
warm L2 is never served to a call configured for a cold one, ``cache merge`` never compares their
times, and a recorded miss is re-tuned as it was served. Warm-L2 keys are those of before."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import torch
from fake_timers import LastIsFastest

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    TuningPolicy,
    autotune,
    load_misses,
    maintenance,
)
from graphtune.cli.main import main
from graphtune.errors import ConfigError

WARM = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),))
COLD = replace(WARM, cold_l2=True)


class Scale(TunableRunner):
    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1, 0]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        return inputs[0] * 2


@pytest.fixture(autouse=True)
def _two_copies(monkeypatch) -> None:
    from graphtune.autotuner import timing

    # Cold-L2 rotation on the CPU would copy the inputs past its last-level cache.
    monkeypatch.setattr(timing, "cold_l2_copies", lambda nbytes, device: 2)


def _tuner(**kwargs: Any) -> AutoTuner:
    policy = TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0, tie_floor_us=0.0)
    return AutoTuner(timer=LastIsFastest(), show_progress=False, policy=policy, **kwargs)


def _tune(path, config: TuningConfig) -> AutoTuner:
    tuner = _tuner()
    with autotune(path, tuner):
        tuner.choose_one("op", [Scale()], config, [torch.ones(4, 64)])
    return tuner


def test_a_warm_l2_pick_is_never_served_to_a_cold_l2_call(tmp_path) -> None:
    path = tmp_path / "c.json"
    assert _tune(path, WARM).stats.profiles_tuned == 1
    cold = _tune(path, COLD)
    assert (cold.stats.hits, cold.stats.profiles_tuned) == (0, 1)  # tuned, not served warm's
    timings = sorted(e["key"]["timing"] for e in json.loads(path.read_text())["entries"])
    assert timings == ["fake", "fake+cold_l2"]  # the warm key is the key of before
    for config in (WARM, COLD):  # each call is served its own pick from the file
        again = _tune(path, config)
        assert (again.stats.hits, again.stats.profiles_tuned) == (1, 0)


def test_merge_never_compares_warm_and_cold_times_and_show_says_which(tmp_path, capsys) -> None:
    warm, cold, out = tmp_path / "warm.json", tmp_path / "cold.json", tmp_path / "out.json"
    _tune(warm, WARM)
    _tune(cold, COLD)
    report = maintenance.merge_files(warm, cold, out)
    assert report.entries == 2 and report.conflicts_kept_a == report.conflicts_kept_b == 0
    assert main(["cache", "show", str(out)]) == 0
    assert "fake+cold_l2" in capsys.readouterr().out


def test_a_timer_name_that_reads_as_cold_l2_is_refused() -> None:
    class Named(LastIsFastest):
        name = "mine+cold_l2"

    with pytest.raises(ConfigError, match=r"ends in '\+cold_l2'.*rename it"):
        AutoTuner(timer=Named())


def test_a_cold_l2_miss_is_recorded_and_re_tuned_with_cold_l2(tmp_path, monkeypatch) -> None:
    from graphtune.ops import registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_op(
        "user.scale", lambda record, tuner: ([Scale()], replace(WARM, **record.config))
    )
    misses = tmp_path / "misses.json"
    serving = _tuner()
    with autotune(None, serving, tune=False, misses_path=misses):
        serving.choose_one("user.scale", [Scale()], COLD, [torch.ones(3, 64)])
    (record,) = load_misses(misses)
    assert record.config["cold_l2"] is True and record.key["timing"] == "fake+cold_l2"
    tuner = _tuner()
    report = registry.tune_records([record], tuner)
    assert report.skipped == [] and [k.timing for k, _ in tuner.cache.items()] == ["fake+cold_l2"]
    # A record saved before cold L2 was keyed has the warm key: the serving process, once
    # updated, looks up the cold-L2 key tuned here, so it counts as tuned.
    old = replace(record, key={**record.key, "timing": "fake"})
    assert registry.tune_records([old], _tuner()).skipped == []
    # Another timer: the fix names the --timing to pass, without the suffix.
    other = replace(record, key={**record.key, "timing": "events+cold_l2"})
    ((_, reason),) = registry.tune_records([other], _tuner()).skipped
    assert "pass --timing events" in reason and "--timing events+" not in reason
