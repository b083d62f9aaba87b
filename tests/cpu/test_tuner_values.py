"""Typed values in identities and tactics: an ``IntEnum`` or ``str`` enum member keeps its
``Class.NAME`` text (tagged) in a cache key, and a tactic dict keyed by enum members is refused
(its keys would come back from the file as plain strings or ints); a dtype, device, enum member
or dataclass never shares its key text with a string or dict."""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch

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
    assert identity_value(Width.ONE, "w") == {"__enum__": "Width.ONE"}
    assert identity_value(Mode.FAST, "m") == {"__enum__": "Mode.FAST"}
    assert identity_value(Plain.ONE, "p") == {"__enum__": "Plain.ONE"}
    ids = {runner_id(Configured(v)) for v in (1, Width.ONE, "fast", Mode.FAST, Plain.ONE)}
    assert len(ids) == 5  # none collides with a plain int or string, or with another enum
    kwargs = [canonical_text(identity_value({"k": v}, "kwargs")) for v in (1, Width.ONE)]
    assert kwargs == ['{"k":1}', '{"k":{"__enum__":"Width.ONE"}}']


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


class Offers(TunableRunner):
    """Offers one tactic, named when it is built: a pick shows which call tuned it."""

    def __init__(self, tactic: str) -> None:
        self._tactic = tactic  # private: not part of the runner's identity

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [self._tactic]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        return inputs[0]


@pytest.mark.parametrize(
    ("typed", "text"),
    [
        (torch.float16, "torch.float16"),
        (torch.device("cpu"), "cpu"),
        (Plain.ONE, "Plain.ONE"),
        (Mode.FAST, "Mode.FAST"),
    ],
)
def test_a_typed_keyword_argument_and_its_text_are_two_keys(typed: Any, text: str) -> None:
    """choose_one(..., dtype=torch.float16) and dtype="torch.float16" (and devices, enum
    members) had one key: the call passing the string was served the other's pick."""
    from graphtune.autotuner import AutoTuner, TuningConfig

    x = [torch.zeros(4, 2)]
    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    tuner.choose_one("op", [Offers("typed")], TuningConfig(), x, arg=typed)
    tuner.tuning_mode = False
    # The string is not served the typed value's pick: it misses and runs the fallback.
    assert tuner.choose_one("op", [Offers("typed")], TuningConfig(), x, arg=text)[1] == -1
    assert tuner.choose_one("op", [Offers("typed")], TuningConfig(), x, arg=typed)[1] == "typed"
    texts = {canonical_text(identity_value(v, "kw")) for v in (typed, text)}
    assert len(texts) == 2


def test_typed_runner_attributes_and_their_texts_are_two_runner_ids() -> None:
    for typed, text in ((torch.bfloat16, "torch.bfloat16"), (torch.device("cpu"), "cpu")):
        assert runner_id(Configured(typed)) != runner_id(Configured(text))
    assert runner_id(Configured(torch.bfloat16)).endswith('[{"block":{"__dtype__":"bfloat16"}}]')
    assert runner_id(Configured(torch.device("cuda", 1))).endswith(
        '[{"block":{"__device__":"cuda:1"}}]'
    )
    # A plain dict that looks like a tag stays a dict; tuples and lists stay one form (intended).
    assert runner_id(Configured({"__dtype__": "bfloat16"})) != runner_id(Configured(torch.bfloat16))
    assert runner_id(Configured((64, 2))) == runner_id(Configured([64, 2]))


def test_a_dataclass_and_the_dict_of_its_fields_are_two_keys() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Point:
        x: int

    assert canonical_text(identity_value(Point(1), "p")) != canonical_text(
        identity_value({"Point": {"x": 1}}, "p")
    )
