"""Pure rules of the graph runner: capture sizes, padding choice, fallback decision."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphtune.errors import ConfigError
from graphtune.graphs import FallbackReason, default_capture_sizes, padded_size
from graphtune.graphs import validate_capture_sizes as validate
from graphtune.graphs.policy import GraphState, Route, decide, padding_table, padding_waste


def test_default_sizes_grid_up_to_256():
    sizes = default_capture_sizes(256)
    assert sizes[:4] == (1, 2, 4, 8)
    assert sizes == (1, 2, 4) + tuple(range(8, 257, 8))
    assert len(sizes) == 35


def test_default_sizes_every_16_above_256():
    sizes = default_capture_sizes(512)
    assert sizes[-3:] == (480, 496, 512)
    assert 264 not in sizes and 272 in sizes


def test_default_sizes_grow_with_the_size_above_1024():
    sizes = default_capture_sizes(4096)
    assert sizes[sizes.index(1024) - 1 :][:4] == (1008, 1024, 1088, 1152)
    assert sizes[-3:] == (3840, 3968, 4096)
    # 16 sizes per doubling: a million rows need a few hundred graphs, not 60 000.
    assert len(default_capture_sizes(2**20)) == 35 + 48 + 16 * 10
    wide = default_capture_sizes(10**7)
    assert len(wide) < 320 and wide[-1] == 10**7
    # Padding stays under 1/16 of the batch at every size above 256.
    for low, high in itertools.pairwise(wide[34:]):
        assert high - low <= high / 16


@pytest.mark.parametrize(
    "max_bs, expected_tail",
    [(1, (1,)), (3, (1, 2, 3)), (4, (1, 2, 4)), (100, (88, 96, 100)), (300, (288, 300))],
)
def test_default_sizes_include_max_when_off_grid(max_bs, expected_tail):
    sizes = default_capture_sizes(max_bs)
    assert sizes[-len(expected_tail) :] == expected_tail
    assert max(sizes) == max_bs


@given(st.integers(min_value=1, max_value=10**6))
def test_default_sizes_sorted_distinct_capped(max_bs):
    sizes = default_capture_sizes(max_bs)
    assert list(sizes) == sorted(set(sizes))
    assert sizes[0] == 1 and sizes[-1] == max_bs


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_max_batch_size_validated(bad):
    with pytest.raises(ConfigError, match="max_batch_size must be a positive int"):
        default_capture_sizes(bad)


def test_user_sizes_sorted_and_deduplicated():
    assert validate([8, 1, 4, 8, 2], 16) == (1, 2, 4, 8)
    assert validate((5,), 5) == (5,)


@pytest.mark.parametrize(
    "sizes, message",
    [
        ([], "capture_sizes is empty"),
        ([1, 0], "positive ints"),
        ([1, -2], "positive ints"),
        ([1, 2.0], "positive ints"),
        ([True], "positive ints"),
        ([1, 64], "exceeds max_batch_size=32"),
        ("1,2", "list of positive ints"),
        (7, "list of positive ints"),
    ],
)
def test_user_sizes_validation_errors_name_the_rule(sizes, message):
    with pytest.raises(ConfigError, match=message):
        validate(sizes, 32)


def test_padded_size_bisect():
    sizes = (1, 2, 4, 8, 16)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    assert padded_size(17, sizes) is None


@given(st.lists(st.integers(1, 300), min_size=1, max_size=20), st.integers(1, 300))
def test_padded_size_is_smallest_size_at_least_batch(raw, batch):
    sizes = validate(raw, 300)
    got = padded_size(batch, sizes)
    candidates = [s for s in sizes if s >= batch]
    assert got == (min(candidates) if candidates else None)


def test_padding_table_matches_bisect():
    sizes = default_capture_sizes(100)
    table = padding_table(sizes)
    assert len(table) == 101 and table[0] == 0
    assert all(table[n] == padded_size(n, sizes) for n in range(1, 101))


def test_padding_waste():
    assert padding_waste(0, 0) == 0.0
    assert padding_waste(3, 4) == pytest.approx(0.25)


BASE = dict(static_reason=None, capturing=False, refused=False, has_plan=True, lazy=False)


def test_decide_replay_when_everything_is_in_place():
    got = decide(**BASE, batch=3, largest_size=8, graph_state=GraphState.CAPTURED)
    assert got is Route.REPLAY


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(static_reason=FallbackReason.DISABLED, capturing=True), FallbackReason.DISABLED),
        (dict(static_reason=FallbackReason.NO_CUDA, refused=True), FallbackReason.NO_CUDA),
        (dict(capturing=True, refused=True), FallbackReason.NESTED_CAPTURE),
        (dict(refused=True, has_plan=False), FallbackReason.PREDICATE_REFUSED),
        (dict(has_plan=False), FallbackReason.KEY_NOT_CAPTURED),
        (dict(batch=0), FallbackReason.NO_BATCH),
        (dict(batch=9), FallbackReason.BATCH_TOO_LARGE),
        (dict(graph_state=GraphState.FAILED), FallbackReason.CAPTURE_FAILED),
        (dict(graph_state=GraphState.MISSING), FallbackReason.KEY_NOT_CAPTURED),
        (dict(graph_state=GraphState.MISSING, lazy=True), Route.CAPTURE_THEN_REPLAY),
        (dict(graph_state=GraphState.FAILED, lazy=True), FallbackReason.CAPTURE_FAILED),
        (dict(batch=9, lazy=True, has_plan=False), FallbackReason.BATCH_TOO_LARGE),
    ],
)
def test_decide_order_of_rules(changes, expected):
    args = {**BASE, "batch": 3, "largest_size": 8, "graph_state": GraphState.CAPTURED}
    args.update(changes)
    assert decide(**args) == expected


def test_fallback_reasons_are_readable_strings():
    assert str(FallbackReason.NO_CUDA) == "no CUDA"
    assert {r.value for r in FallbackReason} >= {
        "disabled",
        "no CUDA",
        "batch too large",
        "key not captured",
        "can_graph refused",
        "capture failed",
        "nested capture",
    }
