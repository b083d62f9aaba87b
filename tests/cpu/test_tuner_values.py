"""Enum members in identities and tactics: an ``IntEnum`` or ``str`` enum member keeps its
``Class.NAME`` text in a cache key, and a tactic dict keyed by enum members is refused (its keys
would come back from the file as plain strings or ints)."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from graphtune.autotuner import TunableRunner, runner_id
from graphtune.autotuner.values import canonical_text, encode_value, identity_value


class Width(enum.IntEnum):
    ONE = 1


class Mode(str, enum.Enum):
    FAST = "fast"


class Plain(enum.Enum):
    ONE = 1


class Configured(TunableRunner):
    def __init__(self, block: Any) -> None:
        self.block = block

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [-1]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        return inputs[0]


def test_int_and_str_enum_members_keep_their_names_in_identities() -> None:
    assert identity_value(Width.ONE, "w") == "Width.ONE"
    assert identity_value(Mode.FAST, "m") == "Mode.FAST"
    assert identity_value(Plain.ONE, "p") == "Plain.ONE"
    ids = {runner_id(Configured(v)) for v in (1, Width.ONE, "fast", Mode.FAST, Plain.ONE)}
    assert len(ids) == 5  # none collides with a plain int or string, or with another enum
    kwargs = [canonical_text(identity_value({"k": v}, "kwargs")) for v in (1, Width.ONE)]
    assert kwargs == ['{"k":1}', '{"k":"Width.ONE"}']


def test_a_tactic_dict_keyed_by_str_enum_members_is_refused_not_stored_as_strings() -> None:
    with pytest.raises(TypeError, match="not subclasses"):
        encode_value({Mode.FAST: 1})
    with pytest.raises(TypeError, match="not subclasses"):
        encode_value({"a": {Mode.FAST: 1}})
    assert encode_value({"fast": 1}) == {"fast": 1}  # plain string keys as before


class TwoTactics(Configured):
    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [0, 1]


def test_negative_zero_has_the_text_of_zero_as_in_the_hit_memo() -> None:
    """The hit memo holds -0.0 and 0.0 as one key (they are ==): the cache key must too, or a
    call's pick depends on which sign was looked up first."""
    import torch
    from fake_timers import LastIsFastest

    from graphtune.autotuner import AutoTuner, DynamicTensorSpec, TuningConfig, TuningPolicy

    assert canonical_text(identity_value({"alpha": -0.0, "b": [-0.0]}, "kw")) == (
        '{"alpha":0.0,"b":[0.0]}'
    )
    assert runner_id(Configured(-0.0)) == runner_id(Configured(0.0))
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (4,)),), warmup=0, repeat=1)
    policy = TuningPolicy(rounds=1, remeasure_top=0, tie_tolerance=0.0, tie_floor_us=0.0)
    runners, x = [TwoTactics(1)], [torch.zeros(4, 2)]
    tuner = AutoTuner(timer=LastIsFastest(), show_progress=False, policy=policy)
    tuner.tuning_mode = True
    tuner.choose_one("op", runners, config, x, alpha=0.0)
    tuner.tuning_mode = False
    assert tuner.choose_one("op", runners, config, x, alpha=-0.0)[1] == 1  # the slow path
    assert tuner.stats.fallbacks == {}
