"""The hit memo checks the runners' identity on each hit: a public attribute changed in place
(``r.block = 32``) makes the runner another one for the cache, so its old pick is not served."""

from __future__ import annotations

import pytest
import torch
from fake_timers import EveryCandidateEqual

from graphtune.autotuner import AutoTuner, IdentityError, TuningConfig, runner_id
from graphtune.autotuner.runner import FALLBACK_TACTIC, TunableRunner


class Blocked(TunableRunner):
    """Its only tactic is its block size."""

    def __init__(self, block: int = 16, sizes: list[int] | None = None) -> None:
        self.block = block
        self.sizes = sizes or []
        self._scratch = torch.zeros(1)  # private: not identity, and it may change freely

    def get_valid_tactics(self, inputs, profile):
        return [self.block]

    def forward(self, inputs, tactic=FALLBACK_TACTIC):
        return inputs[0]


class Explicit(Blocked):
    """States its identity itself."""

    def cache_key_extras(self):
        return ({"b": self.block},)


def _tuned(*runners):
    tuner = AutoTuner(EveryCandidateEqual())
    x = torch.ones(4, 4)
    tuner.tuning_mode = True
    for runner in runners:
        tuner.choose_one("op", [runner], TuningConfig(), [x])
    tuner.tuning_mode = False
    return tuner, x


def _pick(tuner, runner, x):
    return tuner.choose_one("op", [runner], TuningConfig(), [x])[1]


def test_changing_a_public_attribute_in_place_is_not_served_the_old_pick() -> None:
    tuner, x = _tuned(Blocked(16), Blocked(64))
    runner = Blocked(16)
    assert _pick(tuner, runner, x) == 16
    assert _pick(tuner, runner, x) == 16  # memoised
    runner.block = 32  # never tuned: a miss
    assert _pick(tuner, runner, x) == FALLBACK_TACTIC
    runner.block = 64  # tuned: its own pick
    assert _pick(tuner, runner, x) == 64
    assert _pick(tuner, runner, x) == 64


def test_a_nested_change_an_added_attribute_and_explicit_extras_are_seen() -> None:
    tuner, x = _tuned(Blocked(16), Explicit(16))
    runner = Blocked(16)
    assert _pick(tuner, runner, x) == 16
    runner.sizes.append(8)  # the list is part of the identity
    assert _pick(tuner, runner, x) == FALLBACK_TACTIC
    other = Blocked(16)
    assert _pick(tuner, other, x) == 16
    other.extra = 1
    assert _pick(tuner, other, x) == FALLBACK_TACTIC
    explicit = Explicit(16)
    assert _pick(tuner, explicit, x) == 16
    explicit.block = 32
    assert _pick(tuner, explicit, x) == FALLBACK_TACTIC


def test_private_attributes_do_not_stop_the_memo() -> None:
    tuner, x = _tuned(Blocked(16))
    runner = Blocked(16)
    assert _pick(tuner, runner, x) == 16
    hits = tuner.stats.hits
    for _ in range(3):
        runner._scratch = torch.ones(1)  # private state, e.g. a buffer replaced per call
        assert _pick(tuner, runner, x) == 16
    assert tuner.stats.hits == hits + 3


class Slotted(TunableRunner):
    """A runner with ``__slots__``: a slot set later adds an identity attribute, no ``__dict__``."""

    __slots__ = ("block", "mode")

    def __init__(self, block: int = 16) -> None:
        self.block = block

    def get_valid_tactics(self, inputs, profile):
        return [self.block]

    def forward(self, inputs, tactic=FALLBACK_TACTIC):
        return inputs[0]


def test_a_nested_type_change_and_a_slot_set_later_are_seen() -> None:
    tuner, x = _tuned(Blocked(16, [1]), Slotted(16))
    runner = Blocked(16, [1])
    assert _pick(tuner, runner, x) == 16
    assert _pick(tuner, runner, x) == 16  # memoised
    runner.sizes[0] = 1.0  # equal to 1 in Python, another identity text
    assert _pick(tuner, runner, x) == FALLBACK_TACTIC
    slotted = Slotted(16)
    assert _pick(tuner, slotted, x) == 16
    assert _pick(tuner, slotted, x) == 16
    slotted.mode = "fast"
    assert _pick(tuner, slotted, x) == FALLBACK_TACTIC


class _DictExtras(Blocked):
    def cache_key_extras(self):
        return {"block": self.block}  # a dict: list() of it kept only its keys


class _IntExtras(Blocked):
    def cache_key_extras(self):
        return self.block


def test_cache_key_extras_that_are_no_tuple_are_refused() -> None:
    for runner in (_DictExtras(32), _IntExtras(3)):
        with pytest.raises(IdentityError):
            runner_id(runner)
        with pytest.raises(IdentityError):
            _tuned(runner)


def _with_super(size: int) -> TunableRunner:
    """A local class whose methods use super() (a __class__ cell, new with every class object)
    and whose difference is a plain class attribute."""

    class Sized(TunableRunner):
        tactic = size

        def __init__(self) -> None:
            super().__init__()

        def get_valid_tactics(self, inputs, profile):
            return [self.tactic]

        def forward(self, inputs, tactic=FALLBACK_TACTIC):
            return inputs[0]

    return Sized()


def test_local_classes_compare_by_definition_not_by_object() -> None:
    tuner, x = _tuned(_with_super(1))
    assert _pick(tuner, _with_super(1), x) == 1  # the same body and values again: served
    with pytest.raises(IdentityError):  # another class attribute value: refused
        _pick(tuner, _with_super(2), x)


def _made(kind: str, *, explicit: bool = False) -> TunableRunner:
    """A runner class made in a function, its tactic in the closure (as a factory would)."""

    class Made(TunableRunner):
        def get_valid_tactics(self, inputs, profile):
            return [kind]

        def forward(self, inputs, tactic=FALLBACK_TACTIC):
            return inputs[0]

    class Keyed(Made):
        def cache_key_extras(self):
            return (kind,)

    return Keyed() if explicit else Made()


def test_two_classes_made_by_one_function_are_not_served_each_others_pick() -> None:
    a, again = _made("a"), _made("a")
    tuner, x = _tuned(a)
    assert _pick(tuner, a, x) == "a"
    with pytest.raises(IdentityError):  # it would have been served tactic "a"
        _pick(tuner, _made("b"), x)
    # The same body run again with the same closure values (a test per parametrization) is
    # the same runner: its pick is served.
    assert _pick(tuner, again, x) == "a"
    assert _pick(tuner, type(a)(), x) == "a"  # another instance of the same class is fine
    # A class that states what tells it apart is trusted, and gets its own pick.
    tuner, x = _tuned(_made("a", explicit=True), _made("b", explicit=True))
    assert [_pick(tuner, _made(k, explicit=True), x) for k in "ab"] == ["a", "b"]


def _bound(block: int) -> TunableRunner:
    """A runner class made in a loop, its block bound as a default argument (not a closure)."""

    class Bound(TunableRunner):
        def get_valid_tactics(self, inputs, profile, *, _block=block):
            return [_block]

        def forward(self, inputs, *, tactic=FALLBACK_TACTIC, _block=block):
            return inputs[0]

    return Bound()


def _bound_positional(block: int) -> TunableRunner:
    class BoundPositional(TunableRunner):
        def get_valid_tactics(self, inputs, profile, _block=block):
            return [_block]

        def forward(self, inputs, tactic=FALLBACK_TACTIC):
            return inputs[0]

    return BoundPositional()


@pytest.mark.parametrize("make", [_bound, _bound_positional])
def test_classes_that_differ_in_a_default_argument_are_not_served_each_others_pick(make) -> None:
    tuner, x = _tuned(make(64))
    assert _pick(tuner, make(64), x) == 64  # the same default again: the same runner
    with pytest.raises(IdentityError, match="default"):  # it would have been served 64
        _pick(tuner, make(128), x)


def _with_function_default(scale: float) -> TunableRunner:
    class WithActivation(TunableRunner):
        def get_valid_tactics(self, inputs, profile, *, _act=lambda t: t * scale):
            return [1]

        def forward(self, inputs, *, tactic=FALLBACK_TACTIC, _act=lambda t: t * scale):
            return _act(inputs[0])

    return WithActivation()


def test_a_function_default_is_compared_by_its_code_not_as_a_new_object() -> None:
    # A lambda default is a new object each time the factory runs; the same definition built
    # again is the same runner (it was refused as a different one).
    tuner, x = _tuned(_with_function_default(2.0))
    assert _pick(tuner, _with_function_default(2.0), x) == 1
