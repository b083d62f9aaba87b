"""Engine bad input on CPU: every rejected request is an InputError naming the rule, and a rejected
request leaves the engine serving the next one exactly as before."""

from __future__ import annotations

import pytest
import torch

from graphtune.engine import Engine, SamplingParams, load_model
from graphtune.errors import InputError, NumericalError

PROMPTS = [[1, 5, 9], [7, 8]]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    return Engine(load_model("tiny"), runner="graph", max_batch_size=2, max_seq_len=32)


@pytest.fixture(scope="module")
def reference(engine):
    return engine.generate(PROMPTS, 4)


@pytest.mark.parametrize(
    "prompts, limit, message",
    [
        ([[]], 2, "prompt 0 is empty"),
        ([[1, 2], []], 2, "prompt 1 is empty"),
        ([list(range(1, 40))], 1, "max_seq_len=32"),
        ([list(range(1, 30))], 8, "max_seq_len=32"),
        ([[1, -1]], 2, r"outside \[0, 256\)"),
        ([[1, 256]], 2, r"outside \[0, 256\)"),
        ([[1]], 0, "max_new_tokens must be > 0"),
        ([[1], [2]], [3], "2 prompts but 1 max_new_tokens"),
        (["text"], 2, "tokenizer"),
        ([[1, 2.7]], 2, "prompt must be integers"),
        ([[1, True]], 2, "prompt must be integers, got the bool"),
        # A bool tensor was read as ids 1 and 0, bytes as their character codes.
        (torch.tensor([[True, False]]), 2, "prompt must be integers, got the bool"),
        ([torch.tensor([True, False])], 2, "prompt must be integers, got the bool"),
        ([[1]], torch.tensor(True), "max_new_tokens must be integers, got the bool"),
        ([b"Hi"], 2, "a prompt must be text or a list of token ids, got bytes"),
        ([bytearray(b"Hi")], 2, "a prompt must be text or a list of token ids"),
        ([[1]], 2.5, "max_new_tokens must be integers"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(
    engine, reference, prompts, limit, message
):
    free_before = engine.cache.num_free
    with pytest.raises(InputError, match=message):
        engine.generate(prompts, limit)
    assert engine.cache.num_free == free_before, "a rejected request must not hold a KV slot"
    assert engine.generate(PROMPTS, 4) == reference


def test_generate_takes_prompts_as_tensors():
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert engine.generate(ids, 2) == engine.generate([[5, 6, 7], [8, 9, 10]], 2)


def test_generate_takes_a_2d_numpy_array_of_prompts_as_it_takes_a_2d_tensor():
    np = pytest.importorskip("numpy")
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    prompts = [[5, 6, 7], [8, 9, 10]]
    want = engine.generate(prompts, 3, stop_token_ids=[])
    assert engine.generate(np.array(prompts), 3, stop_token_ids=[]) == want


def test_generate_takes_per_prompt_limits_as_a_numpy_array_or_tensor():
    np = pytest.importorskip("numpy")
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    prompts = [[5, 6, 7], [8, 9, 10]]
    want = engine.generate(prompts, [2, 3], stop_token_ids=[])
    assert [len(o) for o in want] == [2, 3]
    assert engine.generate(prompts, np.array([2, 3]), stop_token_ids=[]) == want
    assert engine.generate(prompts, torch.tensor([2, 3]), stop_token_ids=[]) == want
    with pytest.raises(InputError):  # one limit per prompt: a 2-D array is no list of them
        engine.generate(prompts, np.array([[2, 3]]))
    # A one-element array is one limit for all, as an int (and as before arrays were per prompt).
    same = engine.generate(prompts, 3, stop_token_ids=[])
    assert engine.generate(prompts, torch.tensor([3]), stop_token_ids=[]) == same
    assert engine.generate(prompts, np.array([3]), stop_token_ids=[]) == same


def test_stop_token_ids_may_be_a_set_a_tensor_or_an_array():
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    # Stop ids have no order; a set, a 1-D tensor or a NumPy array is as good as a list.
    prompt = [[1, 2, 3]]
    free = engine.generate(prompt, 6, stop_token_ids=[])[0]
    stop = free[2]
    expected = free[: free.index(stop) + 1]
    np = pytest.importorskip("numpy")
    for stops in ([stop], {stop}, frozenset({stop}), torch.tensor([stop]), np.array([stop])):
        assert engine.generate(prompt, 6, stop_token_ids=stops)[0] == expected, stops
    with pytest.raises(InputError, match=r"pass \[id\] for one"):
        engine.generate(prompt, 2, stop_token_ids=torch.tensor(stop))


def test_decode_batch_above_max_is_refused_before_the_runner(engine):
    calls = engine.stats.calls
    rows = torch.zeros(3, dtype=torch.long)
    with pytest.raises(InputError, match="exceeds max_batch_size=2"):
        engine.step(rows, rows, rows)
    assert engine.stats.calls == calls


def test_more_prompts_than_max_batch_queue_instead_of_failing(engine, reference):
    out = engine.generate(PROMPTS * 3, 4)
    assert out == reference * 3


def test_failure_mid_generation_does_not_leak_kv_slots(reference):
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    real_step = engine.runner.fn

    def broken(*args):
        raise RuntimeError("injected decode failure")

    engine.runner.fn = broken
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(PROMPTS, 4)
    engine.runner.fn = real_step
    assert engine.cache.num_free == 2


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=1.0, seed=1)])
def test_a_decode_runner_returning_padded_rows_is_an_internal_error(reference, sampling):
    # Its extra row was zipped with the requests (a ValueError from zip naming nothing); when
    # sampling, the noise keys' check blamed the caller's keys first.
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    real_step = engine.runner.fn
    engine.runner.fn = lambda *args: torch.cat([real_step(*args)] * 2)
    with pytest.raises(RuntimeError, match="decode runner .EagerRunner. returned logits of 4 "):
        engine.generate(PROMPTS, 4, sampling=sampling)
    engine.runner.fn = real_step
    assert engine.cache.num_free == 2 and engine.generate(PROMPTS, 4) == reference


def _poison_row(engine, row_to_poison):
    """Makes the decode step return NaN logits for one row (as a broken checkpoint would)."""
    real_step = engine.runner.fn

    def poisoned(tokens, positions, slots):
        logits = real_step(tokens, positions, slots).clone()
        if logits.shape[0] > row_to_poison:
            logits[row_to_poison] = float("nan")
        return logits

    engine.runner.fn = poisoned
    return real_step


def test_nan_logits_stop_that_request_are_reported_and_others_finish(reference):
    engine = Engine(load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32)
    real_step = _poison_row(engine, 1)
    out = engine.generate(PROMPTS, 4, stop_token_ids=[])
    engine.runner.fn = real_step
    assert out[0] == reference[0]  # the healthy request is untouched
    assert len(out[1]) == 1  # its prefill token only: no token was drawn from NaN logits
    assert [(f.index, f.generated) for f in engine.failures] == [(1, 1)]
    assert "not finite" in engine.failures[0].reason
    assert engine.cache.num_free == 2
    assert engine.generate(PROMPTS, 4) == reference and engine.failures == []


def test_nan_logits_raise_in_strict_mode_and_free_the_slots():
    engine = Engine(
        load_model("tiny"), runner="eager", max_batch_size=2, max_seq_len=32, strict_numerics=True
    )
    _poison_row(engine, 0)
    with pytest.raises(NumericalError, match="request 0: logits were not finite"):
        engine.generate(PROMPTS, 4, stop_token_ids=[])
    assert engine.cache.num_free == 2


@pytest.mark.parametrize("strict", [False, True])
def test_a_failed_requests_nan_cache_rows_never_reach_the_slots_next_owner(strict):
    # Attention hides a slot's unused positions with an additive mask, which does not hide NaN
    # (0 x NaN is NaN): the NaN K/V a failed request leaves must not be read by the request
    # moved into its slot, nor by a later generate() that gets the slot.
    model = load_model("tiny", seed=0)
    good = [20, 21, 22]
    want = Engine(model, runner="eager", max_batch_size=2, max_seq_len=64).generate(
        [good], 6, stop_token_ids=[]
    )
    model.embed = model.embed.clone()  # the head keeps the finite rows
    model.embed[250] = float("nan")  # as an activation overflow: this prompt's K/V become NaN
    engine = Engine(model, runner="eager", max_batch_size=2, max_seq_len=64, strict_numerics=strict)
    bad = [5, 6, 7, 250, 8, 9, 10, 11, 12, 13]
    if strict:
        with pytest.raises(NumericalError):
            engine.generate([bad, good], 6, stop_token_ids=[])
    else:
        assert engine.generate([bad, good], 6, stop_token_ids=[])[1] == want[0]
    assert engine.generate([good, good], 6, stop_token_ids=[]) == [want[0], want[0]]
    assert torch.isfinite(engine.cache.k).all() and torch.isfinite(engine.cache.v).all()


@pytest.mark.parametrize("runner", ["eager", "graph"])
def test_strict_mode_zeroes_every_slot_it_leaves_not_only_the_failed_requests(runner):
    # Strict mode raises at the first bad row of a step: request 1's prompt is as poisoned as
    # request 0's, but its row was never checked. Its slot was freed holding NaN K/V, and the
    # next generate() that got it returned wrong tokens (the additive mask does not hide NaN).
    from graphtune.graphs import SimulatedGraphBackend

    model = load_model("tiny", seed=0)
    good = [[20, 21, 22], [30, 31, 32, 33]]
    want = Engine(model, runner="eager", max_batch_size=2, max_seq_len=64).generate(
        good, 6, stop_token_ids=[]
    )
    model.embed = model.embed.clone()  # untied: the head keeps finite rows (same tokens)
    engine = Engine(
        model,
        runner=runner,
        max_batch_size=2,
        max_seq_len=64,
        strict_numerics=True,
        graph_backend=SimulatedGraphBackend(),
    )
    healthy = model.embed[250].clone()
    with torch.no_grad():  # in place: a captured graph keeps the tensor it was captured with
        model.embed[250] = float("nan")
        # Request 1 is longer than the next owners, so its NaN K/V lie past their prompts,
        # where only the mask (no write) stands between them and the decode step.
        with pytest.raises(NumericalError, match="request 0"):
            engine.generate([[5, 250, 7], [250, *range(8, 20)]], 6, stop_token_ids=[])
        model.embed[250] = healthy
    assert engine.generate(good, 6, stop_token_ids=[]) == want
    assert engine.cache.num_free == 2


def test_a_lazy_prefill_capture_failing_after_a_break_still_answers_the_call():
    # The graph runner refuses to run fn again after pieces of it ran (a CaptureError); a
    # prefill call may be run again, since it writes the same cache rows.
    from graphtune.graphs import SimulatedGraphBackend

    class FailsSecondPiece(SimulatedGraphBackend):
        armed, ended = False, 0

        def end_capture(self, graph):
            super().end_capture(graph)
            self.ended += self.armed
            if self.ended == 2:
                raise RuntimeError("CUDA out of memory (the second piece's capture)")

    backend = FailsSecondPiece()
    engine = Engine(
        load_model("tiny", seed=0),
        runner="eager",
        prefill_runner="graph",
        lazy_capture=True,
        max_batch_size=2,
        max_seq_len=64,
        graph_backend=backend,
    )
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
    want = engine.generate(prompts, 3, stop_token_ids=[])  # the key's eager warm-up call
    backend.armed = True
    assert engine.generate(prompts, 3, stop_token_ids=[]) == want
    assert backend.ended >= 2 and engine.generate(prompts, 3, stop_token_ids=[]) == want


def test_failed_admission_frees_its_slots_for_the_next_generate():
    # NaN logits at the first sample (strict mode) raise inside the admission, before the
    # requests join the live batch; their slots must still come back.
    model = load_model("tiny")
    model.lm_head = model.lm_head.clone()
    model.lm_head[7, 0] = float("nan")
    engine = Engine(model, runner="eager", max_batch_size=2, max_seq_len=32, strict_numerics=True)
    for _ in range(3):
        with pytest.raises(NumericalError, match="after 0 generated tokens"):
            engine.generate([[5, 6]], 3)
        assert engine.cache.num_free == 2


def test_a_request_filling_every_cache_position_gives_the_longer_engines_tokens():
    # The last new token is never fed back: 30 prompt tokens + 3 new ones use 32 positions,
    # which a max_seq_len=32 engine holds (position 31 is the cache's last), as transformers'
    # generate allows.
    model = load_model("tiny")
    prompts = [list(range(3, 33)), list(range(40, 61))]
    limits = [3, 12]  # 32 positions each
    exact = Engine(model, runner="eager", max_batch_size=2, max_seq_len=32)
    assert exact.max_seq_len == 32
    roomy = Engine(model, runner="eager", max_batch_size=2, max_seq_len=64)
    out = exact.generate(prompts, limits, stop_token_ids=[])
    assert out == roomy.generate(prompts, limits, stop_token_ids=[])
    assert [len(o) for o in out] == limits
    with pytest.raises(InputError, match="need 33 positions"):
        exact.generate([prompts[0]], 4)


def test_the_position_limit_counts_all_but_the_last_new_token():
    from graphtune.engine import get_preset

    model = load_model(get_preset("tiny").replace(max_position_embeddings=24))
    engine = Engine(model, runner="eager", max_batch_size=1, max_seq_len=24)
    assert len(engine.generate([[5] * 20], 5, stop_token_ids=[])[0]) == 5  # 24 positions
    with pytest.raises(InputError, match="needs 25 positions.*max_position_embeddings=24"):
        engine.generate([[5] * 20], 6)
