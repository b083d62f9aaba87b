"""CUDAGraphRunner and EagerRunner on CPU.

The real capture/pad/replay/slice logic runs against SimulatedGraphBackend (its replay re-runs fn on
the static buffers and writes into the captured output tensors, as a graph replay writes memory).
Tests named ``*_no_cuda*`` use the real CUDA backend on this CUDA-less machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

import graphtune
from graphtune.errors import CaptureError, ConfigError, InputError
from graphtune.graphs import (
    CUDAGraphRunner,
    EagerRunner,
    FallbackReason,
    GraphRunnerStats,
    RunnerState,
    RunnerStats,
    SimulatedGraphBackend,
)

HIDDEN = 6
SLOTS = 32
PAD_SLOT = SLOTS - 1  # padded rows write here, never into a real row's slot


class Step:
    """A small decode-like step: MLP on x, writes into a persistent cache by slot index."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen)
        self.w2 = torch.randn(2 * HIDDEN, HIDDEN, generator=gen)
        self.cache = torch.zeros(SLOTS, HIDDEN)
        self.calls = 0

    def __call__(self, x, meta):
        self.calls += 1
        h = torch.nn.functional.silu(x @ self.w1) @ self.w2
        self.cache.index_copy_(0, meta["slot"], h)
        return {"h": h, "norm": h.norm(dim=-1)}, self.cache


def inputs(n, seed=1):
    gen = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, HIDDEN, generator=gen)
    slot = torch.randperm(PAD_SLOT, generator=gen)[:n]
    return x, {"slot": slot}


def make(step=None, backend=None, **kwargs):
    step = step or Step()
    kwargs.setdefault("max_batch_size", 16)
    kwargs.setdefault("pad", {"1.slot": PAD_SLOT})
    runner = CUDAGraphRunner(step, backend=backend or SimulatedGraphBackend(), **kwargs)
    return runner, step


def eager_reference(n, seed=1, runner=None):
    """Eager results for batch n. With ``runner``, eager runs on the inputs padded exactly as the
    graph sees them and is sliced to n: the bit-exact reference (a matmul over more rows may
    round differently in the last bit, on CPU BLAS as on cuBLAS)."""
    ref = Step()
    if runner is None:
        out, cache = ref(*inputs(n, seed))
        return out, cache.clone()
    padded, real, _ = runner.padded_inputs(*inputs(n, seed))
    out, cache = ref(*padded)
    return {k: v[:real] for k, v in out.items()}, cache.clone()


def assert_matches_eager(out, n, runner, seed=1):
    exact, _ = eager_reference(n, seed, runner)
    torch.testing.assert_close(out["h"], exact["h"], rtol=0, atol=0)
    torch.testing.assert_close(out["h"], eager_reference(n, seed)[0]["h"])


# ---------------------------------------------------------------- replay correctness


def test_replay_equals_eager_for_every_captured_and_uncaptured_size():
    runner, step = make()
    runner.capture(*inputs(16))
    assert runner.state is RunnerState.CAPTURED
    assert [s for _, s in runner.captured_keys] == [1, 2, 4, 8, 16]
    for n in [1, 2, 3, 4, 5, 7, 8, 9, 13, 16]:
        step.cache.zero_()
        out, cache = runner(*inputs(n))
        ref_out, ref_cache = eager_reference(n, runner=runner)
        assert out["h"].shape == (n, HIDDEN)
        torch.testing.assert_close(out["h"], ref_out["h"], rtol=0, atol=0)
        torch.testing.assert_close(out["norm"], ref_out["norm"], rtol=0, atol=0)
        torch.testing.assert_close(cache[:PAD_SLOT], ref_cache[:PAD_SLOT], rtol=0, atol=0)
        torch.testing.assert_close(out["h"], eager_reference(n)[0]["h"])
    assert runner.stats.replays == 10 and runner.stats.eager_calls == 0
    assert (
        runner.stats.real_rows == 68 and runner.stats.padded_rows == 1 + 2 + 4 + 4 + 8 * 3 + 16 * 3
    )


def test_capture_order_largest_first_and_single_warmup_at_largest():
    seen = []

    def step(x):
        seen.append(x.shape[0])
        return x * 2

    backend = SimulatedGraphBackend()
    runner = CUDAGraphRunner(step, max_batch_size=8, warmup=3, backend=backend)
    runner.capture(torch.ones(8, 2))
    assert seen == [8, 8, 8, 8, 4, 2, 1]
    assert backend.warmup_runs == 3 and backend.captures == 4


def test_outputs_are_views_overwritten_by_the_next_call_unless_cloned():
    runner, _ = make()
    runner.capture(*inputs(16))
    first, _ = runner(*inputs(4, seed=1))
    kept = first["h"].clone()
    runner(*inputs(4, seed=2))
    assert not torch.equal(first["h"], kept)  # overwritten in place

    runner, _ = make(clone_outputs=True)
    runner.capture(*inputs(16))
    first, _ = runner(*inputs(4, seed=1))
    kept = first["h"].clone()
    runner(*inputs(4, seed=2))
    assert torch.equal(first["h"], kept)


def test_stale_rows_from_a_larger_batch_are_repadded():
    seen = torch.zeros(8, 2)  # a replay runs the step's ops, not its Python: record with an op

    def step(x):
        seen[: x.shape[0]].copy_(x)
        return x + 0

    runner = CUDAGraphRunner(step, max_batch_size=8, pad=-7.0, backend=SimulatedGraphBackend())
    runner.capture(torch.ones(8, 2))
    runner(torch.full((8, 2), 5.0))
    runner(torch.full((5, 2), 3.0))
    assert torch.all(seen[:5] == 3) and torch.all(seen[5:] == -7)


def test_padded_inputs_helper_reproduces_replay():
    runner, _ = make(pad={"1.slot": PAD_SLOT, "0": "repeat"})
    runner.capture(*inputs(16))
    padded, n, size = runner.padded_inputs(*inputs(5))
    assert (n, size) == (5, 8)
    assert torch.equal(padded[0][5:], padded[0][:1].expand(3, HIDDEN))
    assert torch.all(padded[1]["slot"][5:] == PAD_SLOT)
    # What the replay computed is the step on exactly these padded inputs, padded rows included
    # (they wrote the pad slot; the capture's warm-ups wrote other slots before).
    out, cache = runner(*inputs(5))
    want, want_cache = Step()(*padded)
    written = torch.cat([padded[1]["slot"][:5], torch.tensor([PAD_SLOT])])
    assert torch.equal(out["h"], want["h"][:5])
    assert torch.equal(cache[written], want_cache[written])


# ---------------------------------------------------------------- fallbacks


def test_batch_too_large_falls_back_with_reason():
    runner, _ = make(capture_sizes=[1, 2, 4])
    runner.capture(*inputs(4))
    out, _ = runner(*inputs(5))
    assert out["h"].shape == (5, HIDDEN)
    assert runner.stats.fallbacks == {FallbackReason.BATCH_TOO_LARGE: 1}


def test_key_not_captured_before_capture_and_for_unknown_extra_key():
    runner, _ = make(key_fn=lambda inp: inp[0].shape[1])
    runner(*inputs(3))
    runner.capture(*inputs(16))
    runner(*inputs(3))
    assert runner.stats.fallbacks == {FallbackReason.KEY_NOT_CAPTURED: 1}
    assert runner.stats.replays == 1


def test_can_graph_predicate_refuses():
    runner, _ = make(can_graph=lambda inp: inp[0].shape[0] % 2 == 0)
    runner.capture(*inputs(16))
    runner(*inputs(3))
    runner(*inputs(4))
    assert runner.stats.fallbacks == {FallbackReason.PREDICATE_REFUSED: 1}
    assert runner.stats.replays == 1


def test_disabled_and_env_disabled(monkeypatch):
    runner, step = make(enabled=False)
    runner.capture(*inputs(16))
    assert runner.fallback_reason is FallbackReason.DISABLED and step.calls == 0
    runner(*inputs(3))
    assert runner.stats.fallbacks == {FallbackReason.DISABLED: 1}

    monkeypatch.setenv("GRAPHTUNE_DISABLE_GRAPHS", "1")
    runner, _ = make()
    assert runner.fallback_reason is FallbackReason.DISABLED


def test_nested_capture_falls_back():
    backend = SimulatedGraphBackend()
    inner, _ = make(backend=backend)
    inner.capture(*inputs(16))

    def outer_step(x, meta):
        out, _ = inner(x, meta)
        return out["h"] * 2

    outer = CUDAGraphRunner(
        outer_step, max_batch_size=16, pad={"1.slot": PAD_SLOT}, backend=backend, warmup=0
    )
    outer.capture(*inputs(16))
    # Every capture of the outer step called the inner runner while capturing.
    assert inner.stats.fallbacks == {FallbackReason.NESTED_CAPTURE: 5}
    got = outer(*inputs(3))
    torch.testing.assert_close(got, eager_reference(3, runner=outer)[0]["h"] * 2, rtol=0, atol=0)


def test_capture_inside_capture_is_an_error():
    backend = SimulatedGraphBackend()
    inner, _ = make(backend=backend)
    errors = []

    def outer_step(x):
        try:
            inner.capture(*inputs(16))
        except CaptureError as exc:
            errors.append(str(exc))
        return x

    outer = CUDAGraphRunner(outer_step, max_batch_size=2, backend=backend, warmup=0)
    outer.capture(torch.ones(2, 1))
    assert errors and "in progress" in errors[0]


def test_failed_capture_is_recorded_logged_once_and_falls_back(caplog):
    def step(x):
        y = x * 2
        if x.shape[0] == 4:
            y.sum().item()  # stands in for a host sync (the backend raises below)
        return y

    backend = SimulatedGraphBackend(fail_when=lambda args: args[0].shape[0] == 4)
    runner = CUDAGraphRunner(step, max_batch_size=8, backend=backend)
    with caplog.at_level(logging.WARNING, logger="graphtune.graphs"):
        runner.capture(torch.ones(8, 3))
        for n in (3, 4, 3, 2, 5):
            assert torch.equal(runner(torch.ones(n, 3)), torch.full((n, 3), 2.0))
    failures = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(failures) == 1
    message = failures[0].getMessage()
    assert "size 4" in message and "host synchronisation" in message
    assert "lazy=True" in message and "max_batch_size" in message
    assert runner.stats.fallbacks == {FallbackReason.CAPTURE_FAILED: 3}
    assert runner.stats.replays == 2 and runner.stats.graphs == 3
    assert len(runner.stats.failed_captures) == 1 and backend.recoveries == 1


def test_failed_capture_names_the_user_source_line():
    from graphtune.graphs.capture import describe_failure

    def step():
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    try:
        step()
    except RuntimeError as exc:
        message = describe_failure(exc, extra_key=None, size=8)
    assert "test_graphs_runner.py" in message and "in step: raise RuntimeError" in message


def test_no_batch_dimension_falls_back_in_lazy_mode_and_errors_in_capture():
    runner = CUDAGraphRunner(
        lambda s: s * 2, max_batch_size=4, lazy=True, backend=SimulatedGraphBackend()
    )
    assert runner(torch.tensor(3.0)) == 6
    assert runner.stats.fallbacks == {FallbackReason.NO_BATCH: 1}
    with pytest.raises(InputError, match="at least one batched tensor"):
        runner.capture(torch.tensor(3.0))


# ---------------------------------------------------------------- lazy, key_fn, release


def test_lazy_warms_up_on_a_keys_first_call_and_captures_each_size_on_first_use():
    backend = SimulatedGraphBackend()
    runner, _ = make(backend=backend, lazy=True)
    assert runner.state is RunnerState.NEW
    runner(*inputs(3))  # the key's warm-up: this call, eagerly (fn runs once per call)
    assert runner.captured_keys == [] and runner.stats.fallbacks == {FallbackReason.WARMING_UP: 1}
    out, _ = runner(*inputs(3))
    assert_matches_eager(out, 3, runner)
    assert runner.captured_keys == [(None, 4)] and backend.captures == 1
    out, _ = runner(*inputs(4, seed=7))  # a replay of the graph captured above, new inputs
    assert_matches_eager(out, 4, runner, seed=7)
    runner(*inputs(11))  # a new size of a warmed key: captured on first use
    out, _ = runner(*inputs(13, seed=7))  # and replayed on other inputs
    assert_matches_eager(out, 13, runner, seed=7)
    assert runner.captured_keys == [(None, 4), (None, 16)]
    assert runner.stats.replays == 4 and runner.state is RunnerState.CAPTURED


def test_key_fn_gives_each_extra_key_its_own_buffers_and_graphs():
    def step(x, draft_len):
        return x[:, :draft_len] * 2

    backend = SimulatedGraphBackend()
    runner = CUDAGraphRunner(step, max_batch_size=4, key_fn=lambda inp: inp[1], backend=backend)
    runner.capture(torch.ones(4, 5), 2)
    runner.capture(torch.ones(4, 5), 3)
    assert sorted(runner.captured_keys) == [(2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (3, 4)]
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    # Each key replays its own graph on its own buffers: the other key's call between them
    # must not change what the first one returns.
    two = runner(x, 2).clone()
    three = runner(x + 1, 3)
    assert torch.equal(two, x[:, :2] * 2) and torch.equal(three, (x + 1)[:, :3] * 2)
    assert runner.stats.replays == 2
    runner(torch.ones(3, 5), 4)
    assert runner.stats.fallbacks == {FallbackReason.KEY_NOT_CAPTURED: 1}


def test_release_is_idempotent_and_allows_recapture():
    backend = SimulatedGraphBackend()
    runner, _ = make(backend=backend)
    runner.release()  # nothing held: harmless
    runner.capture(*inputs(16))
    assert runner.stats.graphs == 5 and runner.stats.buffer_bytes > 0
    runner.release()
    runner.release()
    assert runner.state is RunnerState.RELEASED and runner.captured_keys == []
    assert runner.stats.graphs == 0 and runner.stats.buffer_bytes == 0
    assert runner.stats.releases == 1 and backend.empty_cache_calls >= 1
    runner(*inputs(3))
    assert runner.stats.fallbacks == {FallbackReason.KEY_NOT_CAPTURED: 1}
    runner.capture(*inputs(16))
    out, _ = runner(*inputs(3))
    assert_matches_eager(out, 3, runner)


# ---------------------------------------------------------------- input errors


def test_wrong_dtype_raises_input_error_naming_path_and_shape():
    runner, _ = make()
    runner.capture(*inputs(16))
    x, meta = inputs(3)
    with pytest.raises(InputError, match=r"input 0: expected shape \(3, 6\), dtype torch.float32"):
        runner(x.double(), meta)
    with pytest.raises(InputError, match=r"input 1.slot"):
        runner(x, {"slot": meta["slot"].int()})
    with pytest.raises(InputError, match="structure"):
        runner(x, {"slot": meta["slot"], "extra": 1})


def test_debug_mode_checks_static_tensor_identity(monkeypatch):
    table = torch.randn(HIDDEN, HIDDEN)

    def step(x, w):
        return x @ w

    monkeypatch.setenv("GRAPHTUNE_DEBUG", "1")
    runner = CUDAGraphRunner(step, max_batch_size=4, backend=SimulatedGraphBackend())
    runner.capture(torch.randn(4, HIDDEN), table)
    runner(torch.randn(2, HIDDEN), table)
    with pytest.raises(InputError, match="input 1 changed address"):
        runner(torch.randn(2, HIDDEN), table.clone())
    quiet = CUDAGraphRunner(step, max_batch_size=4, debug=False, backend=SimulatedGraphBackend())
    quiet.capture(torch.randn(4, HIDDEN), table)
    quiet(torch.randn(2, HIDDEN), table.clone())  # not checked (documented)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_batch_size=0), "max_batch_size"),
        (dict(max_batch_size=8, capture_sizes=[16]), "exceeds max_batch_size"),
        (dict(max_batch_size=8, warmup=-1), "warmup"),
        (dict(max_batch_size=8, pad="zero"), "not a pad rule"),
        (dict(max_batch_size=8, key_fn=3), "key_fn"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        CUDAGraphRunner(lambda x: x, **kwargs)


def test_pad_path_typo_is_config_error_at_capture():
    runner, _ = make(pad={"1.slots": 0})
    with pytest.raises(ConfigError, match="1.slots"):
        runner.capture(*inputs(16))


# ---------------------------------------------------------------- no CUDA, eager runner, stats


def test_no_cuda_every_call_eager_with_same_results(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    step = Step()
    runner = CUDAGraphRunner(step, max_batch_size=16, pad={"1.slot": PAD_SLOT})
    with caplog.at_level(logging.INFO, logger="graphtune.graphs"):
        runner.capture(*inputs(16))
    assert runner.fallback_reason is FallbackReason.NO_CUDA
    assert any("no CUDA" in r.getMessage() for r in caplog.records)
    for n in (1, 3, 16, 20):
        out, _ = runner(*inputs(n))
        torch.testing.assert_close(out["h"], eager_reference(n)[0]["h"], rtol=0, atol=0)
    assert runner.stats.fallbacks == {FallbackReason.NO_CUDA: 4}
    assert runner.stats.eager_calls == 4 and runner.stats.replays == 0
    runner.release()
    runner.release()
    assert runner.state is RunnerState.RELEASED


def test_no_cuda_via_simulated_unavailable_backend():
    runner, step = make(backend=SimulatedGraphBackend(available=False))
    runner.capture(*inputs(16))
    assert step.calls == 0
    runner(*inputs(2))
    assert runner.stats.fallbacks == {FallbackReason.NO_CUDA: 1}


def test_eager_runner_parity():
    step_a, step_b = Step(), Step()
    eager = EagerRunner(step_a)
    graphs, _ = make(step=step_b)
    for runner in (eager, graphs):
        runner.capture(*inputs(16))
    for n in (1, 5, 16):
        a, _ = eager(*inputs(n))
        b, _ = graphs(*inputs(n))
        torch.testing.assert_close(a["h"], b["h"], rtol=0, atol=0)
    eager.release()
    assert eager.stats.calls == 3 and eager.stats.eager_calls == 3
    assert eager.stats.fallbacks == {FallbackReason.DISABLED: 3}  # as enabled=False counts
    assert isinstance(eager.stats, RunnerStats) and GraphRunnerStats is RunnerStats


def test_stats_table_and_dict():
    runner, _ = make(capture_sizes=[4, 8])
    runner.capture(*inputs(8))
    runner(*inputs(3))
    runner(*inputs(12))
    stats = runner.stats
    assert stats.padding_waste == pytest.approx(0.25)
    text = stats.table()
    for word in ("replays", "batch too large", "padding waste", "graphs", "capture ms"):
        assert word in text
    data = stats.as_dict()
    assert data["fallbacks"] == {"batch too large": 1} and len(data["records"]) == 2


def test_top_level_exports():
    assert graphtune.CUDAGraphRunner is CUDAGraphRunner
    assert graphtune.EagerRunner is EagerRunner
    assert graphtune.FallbackReason is FallbackReason
