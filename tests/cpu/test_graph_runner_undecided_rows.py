"""An output with the same rows r at every captured size, at most the smallest, may be a constant
or the batch capped at r (``x[:r]``); the two differ only for a batch below r, and such a call
runs eagerly once to tell (simulated backend, CPU). Before, ``x[:4]`` captured at [8, 16] gave a
batch of 3 four rows, the last one padding."""

from __future__ import annotations

import logging

import pytest
import torch

from graphtune.errors import InputError
from graphtune.graphs import (
    CapturePolicy,
    CUDAGraphRunner,
    FallbackReason,
    SimulatedGraphBackend,
)

TABLE = torch.arange(8.0).reshape(4, 2)


def capped(x):
    return x[:4] * 10


def table(x):
    return x * 2, TABLE  # a constant [4, 2] output, returned as it is


SIZED_TABLE = torch.arange(16.0).reshape(8, 2)  # as many rows as the capture size 8


def sized_table(x):
    return x * 2, SIZED_TABLE


def runner(fn, sizes=(8, 16), **kwargs) -> CUDAGraphRunner:
    return CUDAGraphRunner(
        fn,
        max_batch_size=16,
        capture_sizes=list(sizes),
        backend=SimulatedGraphBackend(),
        **kwargs,
    )


def test_a_capped_output_never_returns_padded_rows_when_every_size_is_above_the_cap():
    r = runner(capped)
    r.capture(torch.ones(16, 1))
    for n in (3, 1, 3, 2, 5, 16):
        x = torch.arange(1.0, n + 1)[:, None]
        torch.testing.assert_close(r(x), capped(x), rtol=0, atol=0)
    # One eager call told: the batch capped at 4. Every other call replayed.
    assert r.stats.fallbacks == {FallbackReason.ROWS_UNDECIDED: 1}
    assert r.stats.replays == 5


def test_a_constant_output_with_few_rows_stays_a_constant():
    r = runner(table)
    r.capture(torch.ones(16, 2))
    for n in (3, 2, 8):
        y, t = r(torch.ones(n, 2))
        assert y.shape == (n, 2) and torch.equal(t, TABLE)
    assert r.stats.fallbacks == {FallbackReason.ROWS_UNDECIDED: 1} and r.stats.replays == 2


def test_outputs_that_tell_themselves_apart_never_run_eagerly(caplog):
    vocab = torch.randn(32)
    r = runner(lambda x: (x[:4], x.sum(), vocab), sizes=(2, 8, 16))  # 2 < 4: the cap shows
    with caplog.at_level(logging.INFO, logger="graphtune.graphs"):
        r.capture(torch.ones(16, 1))
        for n in (1, 3, 9):
            head, _, v = r(torch.ones(n, 1))
            assert head.shape == (min(n, 4), 1) and v is not None
    assert r.stats.eager_calls == 0 and r.stats.replays == 3
    assert "rows at every size" not in caplog.text


def test_the_undecided_output_is_named_in_the_log(caplog):
    r = runner(lambda x: {"logits": x[:4]})
    with caplog.at_level(logging.INFO, logger="graphtune.graphs"):
        r.capture(torch.ones(16, 1))
    assert (
        "graph outputs logits of key None have 4 rows at every size captured ([8, 16])"
        in caplog.text
    )


def test_lazy_capture_uses_the_warm_up_call_to_decide():
    r = runner(capped, lazy=True)
    for n in (3, 3, 3):
        x = torch.arange(1.0, n + 1)[:, None]
        torch.testing.assert_close(r(x), capped(x), rtol=0, atol=0)
    # The warm-up call ran eagerly at 3 rows: with the capture at 8, the cap at 4 is known.
    assert r.stats.fallbacks == {FallbackReason.WARMING_UP: 1} and r.stats.replays == 2


def test_lazy_capture_of_a_smaller_size_waits_for_an_eager_call_to_tell():
    r = runner(capped, sizes=(8, 16), lazy=True, warmup=0)
    r(torch.ones(10, 1))  # captures 16: x[:4] has 4 rows, undecided below 4
    x = torch.arange(1.0, 4.0)[:, None]
    for _ in range(3):  # eager (tells), capture of 8, replay
        torch.testing.assert_close(r(x), capped(x), rtol=0, atol=0)
    assert r.stats.fallbacks == {FallbackReason.ROWS_UNDECIDED: 1}
    assert sorted(s for _, s in r.captured_keys) == [8, 16]


def linear(x):
    return x * 3 + 1


@pytest.mark.parametrize(
    ("fn", "eager_to_tell"),
    [(linear, 1), (capped, 1), (table, 2), (sized_table, 1)],
    ids=["batch", "capped", "constant", "constant-of-a-size"],
)
def test_a_lazy_capture_at_the_warm_up_calls_size_is_one_size_not_two(fn, eager_to_tell):
    # The warm-up call ran eagerly at batch 8, a capture size; the call at 5 then captured 8.
    # The warm-up's shapes at 8 were counted as a second size beside the graph's: two equal
    # shapes made the batch-sized output a constant, and the call got 8 rows, 3 of them padding.
    # With only that one size known, an output with 8 rows (the batch, or a constant of 8
    # rows) cannot be told apart: the call at 5 runs eagerly and tells; a constant of 4 rows
    # then needs a call below 4 as well (the batch capped at 4 would fit it too).
    r = runner(fn, lazy=True)
    for n in (8, 5, 3, 5, 12, 1):
        x = torch.arange(1.0, 2 * n + 1).reshape(n, 2)
        torch.testing.assert_close(r(x), fn(x), rtol=0, atol=0)
    assert r.stats.fallbacks.get(FallbackReason.WARMING_UP) == 1
    assert r.stats.fallbacks.get(FallbackReason.ROWS_UNDECIDED) == eager_to_tell
    assert sorted(s for _, s in r.captured_keys) == [8, 16]


def scaled_head(x, scale):
    return x * scale, x[:4]


BAD_INPUTS = {  # each the mistake a replay refuses with InputError, for a batch of n
    "trailing-shape": lambda n: (torch.ones(n, 5), torch.ones(n, 1)),
    "dtype": lambda n: (torch.ones(n, 2, dtype=torch.float64), torch.ones(n, 1)),
    "rows": lambda n: (torch.ones(n, 2), torch.ones(n + 1, 1)),
}


@pytest.mark.parametrize("bad", list(BAD_INPUTS.values()), ids=list(BAD_INPUTS))
@pytest.mark.parametrize("route", ["rows-undecided", "lazy-warm-up"])
def test_an_eager_call_that_tells_the_rows_refuses_what_a_replay_refuses(route, bad):
    # Such a call ran fn on the bad inputs unchecked and took its output shapes as evidence:
    # (3, 5) beside (8, 2) fit no row rule, so every graph of the key was dropped and every
    # later call ran eagerly ("capture failed"), with no InputError.
    if route == "rows-undecided":  # x[:4] is undecided below 4: a call of 3 runs eagerly
        r = runner(scaled_head)
        r.capture(torch.ones(16, 2), torch.ones(16, 1))
        n, good = 3, [3, 3, 12]
    else:  # size 16's first call is its warm-up, run eagerly
        r = runner(scaled_head, lazy=True, policy=CapturePolicy(warm_each_size=True))
        for _ in range(2):  # size 8: its warm-up, then its capture
            r(torch.ones(5, 2), torch.ones(5, 1))
        n, good = 12, [12, 12, 5]
    graphs, fallbacks = r.captured_keys, dict(r.stats.fallbacks)
    with pytest.raises(InputError, match="expected shape"):
        r(*bad(n))
    assert r.captured_keys == graphs and r.stats.fallbacks == fallbacks
    for m in good:
        x, scale = torch.arange(1.0, 2 * m + 1).reshape(m, 2), torch.full((m, 1), 2.0)
        torch.testing.assert_close(r(x, scale), scaled_head(x, scale), rtol=0, atol=0)
    assert FallbackReason.CAPTURE_FAILED not in r.stats.fallbacks
    assert r.stats.replays == (2 if route == "rows-undecided" else 3)
