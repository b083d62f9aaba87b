"""``Engine.generate``'s ``on_tokens`` hook: every token streamed as it is sampled, one finishing
event per request with its output and reason, and the finished requests kept by a caller when the
call is interrupted."""

from __future__ import annotations

import pytest

from graphtune.engine import Engine, TokenEvent, load_model
from graphtune.errors import ConfigError

PROMPTS = [[1, 5, 9], [7], [3, 4, 5, 6], [10, 11]]
LIMITS = [3, 5, 2, 4]


def _engine(batch: int = 2) -> Engine:
    return Engine(load_model("tiny"), runner="eager", max_batch_size=batch, max_seq_len=32)


def interrupt_decode_at(monkeypatch, call: int) -> None:
    """Makes the ``call``-th decode step from now raise ``KeyboardInterrupt`` (Ctrl-C mid-call)."""
    import graphtune.engine.step as step

    real, calls = step.DecodeStep.decode, []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(step.DecodeStep, "decode", interrupted)


def _replay(steps: list[list[TokenEvent]]) -> tuple[dict, dict]:
    """Each request's streamed tokens and its finishing event's (reason, output), checking that
    a request has one event per step and none after its finishing one."""
    streamed: dict[int, list] = {}
    finished: dict[int, tuple] = {}
    for events in steps:
        assert len({e.index for e in events}) == len(events)
        for event in events:
            assert event.index not in finished, "an event after the request finished"
            tokens = streamed.setdefault(event.index, [])
            if event.token is not None:
                tokens.append(event.token)
            assert event.generated == len(tokens)
            if event.finish_reason is None:
                assert event.output is None
            else:
                finished[event.index] = (event.finish_reason, list(event.output))
    return streamed, finished


def test_on_tokens_streams_every_token_and_ends_each_request_with_its_output():
    engine = _engine()
    steps: list[list[TokenEvent]] = []
    out = engine.generate(PROMPTS, LIMITS, stop_token_ids=[], on_tokens=steps.append)
    streamed, finished = _replay(steps)
    assert [streamed[i] for i in range(len(PROMPTS))] == out
    assert all(type(e.token) is int for events in steps for e in events)  # no tensors to sync
    assert finished == {i: ("length", out[i]) for i in range(len(PROMPTS))}
    assert max(len(events) for events in steps) == 2  # a step's events are its batch's rows
    assert engine.generate(PROMPTS, LIMITS, stop_token_ids=[]) == out  # the hook changes nothing


def test_a_stop_token_finishes_with_reason_stop_and_is_in_the_output():
    engine = _engine()
    full = engine.generate(PROMPTS, LIMITS, stop_token_ids=[])
    stop = full[1][1]  # request 1's second token
    steps: list[list[TokenEvent]] = []
    out = engine.generate(PROMPTS, LIMITS, stop_token_ids=[stop], on_tokens=steps.append)
    _, finished = _replay(steps)
    assert finished[1] == ("stop", full[1][:2]) == ("stop", out[1])
    for index, (reason, output) in finished.items():
        assert output == out[index]
        assert reason == ("stop" if output[-1] == stop else "length")


def test_a_request_with_non_finite_logits_finishes_as_failed():
    engine = _engine()
    real_step = engine.runner.fn

    def poisoned(tokens, positions, slots):  # row 1's logits NaN, as a broken checkpoint's
        logits = real_step(tokens, positions, slots).clone()
        if logits.shape[0] > 1:
            logits[1] = float("nan")
        return logits

    engine.runner.fn = poisoned
    steps: list[list[TokenEvent]] = []
    out = engine.generate(PROMPTS[:2], 4, stop_token_ids=[], on_tokens=steps.append)
    _, finished = _replay(steps)
    failed = [e for events in steps for e in events if e.finish_reason == "failed"]
    assert [(e.index, e.token, e.generated) for e in failed] == [(1, None, 1)]
    assert finished[1] == ("failed", out[1]) and finished[0] == ("length", out[0])


def test_an_interrupted_call_leaves_the_hook_every_request_that_finished(monkeypatch):
    engine = _engine(batch=1)  # one request at a time: they finish one after another
    reference = engine.generate(PROMPTS, LIMITS, stop_token_ids=[])
    interrupt_decode_at(monkeypatch, 7)  # requests 0 and 1 took 2 + 4 decode steps; 2 is running
    kept: dict[int, list[int]] = {}

    def keep(events):
        kept.update({e.index: list(e.output) for e in events if e.finish_reason})

    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS, LIMITS, stop_token_ids=[], on_tokens=keep)
    assert kept == {0: reference[0], 1: reference[1]}
    monkeypatch.undo()
    assert engine.cache.num_free == 1  # the interrupted request's slot was freed
    assert engine.generate(PROMPTS, LIMITS, stop_token_ids=[]) == reference


def test_a_hook_that_raises_ends_the_call_and_frees_the_slots():
    engine = _engine()

    def cancel(events):  # a client that went away
        raise RuntimeError("client gone")

    with pytest.raises(RuntimeError, match="client gone"):
        engine.generate(PROMPTS, LIMITS, on_tokens=cancel)
    assert engine.cache.num_free == 2


def test_a_hook_that_cannot_be_called_is_refused_before_any_work():
    engine = _engine()
    with pytest.raises(ConfigError, match="on_tokens must be callable or None, got int"):
        engine.generate(PROMPTS, LIMITS, on_tokens=5)
    assert engine.cache.num_free == 2 and engine.stats.eager_calls == 0
