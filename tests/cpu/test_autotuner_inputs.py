"""What the tuner refuses from a runner or a caller: a get_valid_tactics return that is no list
of tactics, a tactic a cache cannot store, inputs that are no list, runners that are no
instances, two specs of one dimension (fake runners on a virtual clock, as in
test_autotuner_porting.py)."""

from __future__ import annotations

import collections
import enum
import json
import logging
from typing import Any

import pytest
import torch
from test_autotuner_porting import CONFIG, Clock, Listed, X, tuner_for

from graphtune.autotuner import DynamicTensorSpec, TunableRunner, TuningConfig, autotune
from graphtune.autotuner.values import encode_value
from graphtune.errors import ConfigError

# what a runner returns -------------------------------------------------------------------------


class Returns(TunableRunner):
    """``get_valid_tactics`` returns ``found`` as it is."""

    def __init__(self, clock: Clock, found: Any) -> None:
        self._found = found
        self._clock = clock

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> Any:
        return self._found

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        self._clock.now_us += 1.0
        self._clock.calls.append(("returns", tactic))
        return inputs[0]


@pytest.mark.parametrize("found", ["abc", None, 3, {"a": 1}])
def test_a_return_that_is_no_list_of_tactics_is_a_named_failure(caplog, found) -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    tuner.tuning_mode = True
    runner = Returns(clock, found)
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        assert tuner.choose_one("op", [runner], CONFIG, X) == (runner, -1)
    assert not any(tactic in ("a", "b", "c") for _, tactic in clock.calls)
    assert any("must return a list of tactics" in r.getMessage() for r in caplog.records)


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


def test_a_tactic_the_cache_cannot_store_is_skipped_and_the_rest_saved(tmp_path, caplog) -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    good = Listed(clock, [0, 1], {-1: 9.0, 0: 1.0, 1: 2.0})
    junk = Returns(clock, [Opaque(), float("nan")])
    path = tmp_path / "cache.json"
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        with autotune(path, tuner):
            assert tuner.choose_one("good", [good], CONFIG, X) == (good, 0)
            assert tuner.choose_one("junk", [junk], CONFIG, X) == (junk, -1)
    assert ("returns", "Opaque()") not in [(n, repr(t)) for n, t in clock.calls]
    assert any("cannot be stored in a cache" in r.getMessage() for r in caplog.records)
    ops = [e["key"]["op"] for e in json.loads(path.read_text())["entries"]]
    assert ops == ["good"]


class Kind(enum.IntEnum):
    A = 1


class Name(str, enum.Enum):
    X = "x"


def test_namedtuple_and_enum_tactics_are_refused_for_they_would_come_back_retyped(
    tmp_path, caplog
) -> None:
    # Equal to a tuple, an int and a string, so a file would give them back as those.
    Cfg = collections.namedtuple("Cfg", "block warps")
    clock = Clock()
    costs = {-1: 9.0, (1, 2): 1.0, 1: 1.5, "x": 1.7, (3, 4): 2.0}
    runner = Listed(clock, [Cfg(1, 2), Kind.A, Name.X, (3, 4)], costs)
    path = tmp_path / "cache.json"
    with caplog.at_level(logging.WARNING, logger="graphtune"):
        with autotune(path, tuner_for(clock)) as tuner:
            pick = tuner.choose_one("op", [runner], CONFIG, X)[1]
    assert pick == (3, 4) and type(pick) is tuple
    assert any("Cfg(block=1, warps=2) cannot be stored" in r.getMessage() for r in caplog.records)
    for value in (Cfg(1, 2), Kind.A, Name.X, [Kind.A], {"k": Name.X}):
        with pytest.raises(TypeError, match="not subclasses"):
            encode_value(value)


def test_inputs_that_are_no_list_and_runners_that_are_no_instances_are_refused() -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    runner = Listed(clock, [0], {-1: 1.0, 0: 1.0})
    with pytest.raises(ConfigError, match="takes its inputs as a list"):
        tuner.choose_one("op", [runner], CONFIG, torch.zeros(4, 2))
    for bad in (Listed, object()):
        with pytest.raises(ConfigError, match="is not a runner"):
            tuner.choose_one("op", [bad], CONFIG, X)


def test_two_specs_naming_one_dimension_through_a_negative_index_are_refused() -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    tuner.tuning_mode = True
    twice = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, (4,)), DynamicTensorSpec(0, -2, (4,))),
        warmup=0,
        repeat=1,
    )
    with pytest.raises(ConfigError, match="name the same dimension"):
        tuner.choose_one("op", [Listed(clock, [0], {-1: 1.0, 0: 1.0})], twice, X)


def test_an_op_that_is_no_non_empty_string_is_refused_before_it_reaches_the_cache() -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    tuner.tuning_mode = True
    runner = Listed(clock, [0], {-1: 1.0, 0: 1.0})
    for bad in (7, None, "", b"op"):
        with pytest.raises(ConfigError, match="is not a non-empty str"):
            tuner.choose_one(bad, [runner], CONFIG, X)  # type: ignore[arg-type]
    assert len(tuner.cache) == 0


def test_a_lone_runner_and_a_tensor_keyword_argument_are_refused_in_one_line() -> None:
    clock = Clock()
    tuner = tuner_for(clock)
    runner = Listed(clock, [0], {-1: 1.0, 0: 1.0})
    with pytest.raises(ConfigError, match=r"takes its runners as a list; got Listed \(pass \["):
        tuner.choose_one("op", runner, CONFIG, X)  # type: ignore[arg-type]
    # not the advice for runner attributes (identity_excludes, cache_key_extras)
    with pytest.raises(ConfigError, match="keyword argument 'w' is a Tensor.*pass the tensor in"):
        tuner.choose_one("op", [runner], CONFIG, X, w=torch.zeros(1))


def test_a_tensor_nested_in_a_keyword_argument_gets_the_keyword_advice() -> None:
    """A tensor (or an object) inside a keyword value was refused with the advice for runner
    attributes (identity_excludes, cache_key_extras), naming "keyword arguments of 'op'"."""
    clock = Clock()
    tuner = tuner_for(clock)
    runner = Listed(clock, [0], {-1: 1.0, 0: 1.0})
    t = torch.zeros(1)
    for kwargs, where in (
        ({"bias": (t,)}, r"bias\[0\] is a Tensor"),
        ({"bias": {"a": [1, t]}}, r"bias\['a'\]\[1\] is a Tensor"),
        ({"bias": object()}, "bias is a object"),
    ):
        with pytest.raises(ConfigError, match=f"keyword argument {where}") as info:
            tuner.choose_one("op", [runner], CONFIG, X, **kwargs)
        message = str(info.value)
        assert "pass tensors in inputs" in message and "\n" not in message
        assert "identity_excludes" not in message and "cache_key_extras" not in message
    assert len(tuner.cache) == 0
