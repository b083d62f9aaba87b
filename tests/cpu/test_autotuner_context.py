"""``autotune()`` blocks on one tuner: nested, overlapping from several threads, failing on entry
(fake runners and a fake clock, as in test_autotuner_tuner.py)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_autotuner_tuner import CONFIG, make

from graphtune.autotuner import DistributedTuning, autotune
from graphtune.errors import DistributedError


def test_overlapping_blocks_of_two_threads_tune_until_the_last_one_ends() -> None:
    tuner, runners, _ = make({-1: 5.0}, {0: 1.0})
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with autotune(None, tuner):
            a_in.set()
            b_in.wait()
        a_out.set()

    def second() -> None:
        a_in.wait()
        with autotune(None, tuner):
            b_in.set()
            a_out.wait()  # the first block ended while this one is open
            seen.append(tuner.tuning_mode)
            pick = tuner.choose_one("op", runners, CONFIG, [torch.randn(4, 2)])
            seen.append(pick == (runners[1], 0))

    threads = [threading.Thread(target=f) for f in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [True, True] and not tuner.tuning_mode


def test_a_cache_only_block_does_not_stop_another_blocks_tuning() -> None:
    tuner, _, _ = make({-1: 5.0}, {0: 1.0})
    with autotune(None, tuner):
        with autotune(None, tuner, tune=False):
            assert tuner.tuning_mode
        assert tuner.tuning_mode
    assert not tuner.tuning_mode
    with autotune(None, tuner, tune=False):
        assert not tuner.tuning_mode


def test_strategies_come_back_in_any_order_and_after_a_failed_entry() -> None:
    tuner, _, _ = make({-1: 5.0}, {0: 1.0})
    independent = DistributedTuning("independent")
    outer = autotune(None, tuner, distributed=independent)
    outer.__enter__()
    inner = autotune(None, tuner, tune=False)
    inner.__enter__()
    assert tuner.distributed is independent
    outer.__exit__(None, None, None)  # the first block ends first (another thread's)
    assert tuner.distributed is None and not tuner.tuning_mode
    inner.__exit__(None, None, None)
    assert tuner.distributed is None and not tuner.tuning_mode
    # A collective strategy without a process group fails on entry: nothing is left changed.
    with pytest.raises(DistributedError):
        with autotune(None, tuner, distributed="broadcast"):
            pass
    assert tuner.distributed is None and not tuner.tuning_mode


@pytest.mark.parametrize("argument", ["cache_path", "misses_path"])
def test_a_path_argument_that_is_no_path_is_a_config_error(argument: str) -> None:
    from graphtune.errors import ConfigError

    tuner, _, _ = make({-1: 5.0}, {0: 1.0})
    with pytest.raises(ConfigError), autotune(tuner=tuner, **{argument: 123}):
        pass
    assert not tuner.tuning_mode
