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
