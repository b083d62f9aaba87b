"""graphtune.bench.timeline and benchmarks/step_trace.py's tables, on synthetic CUPTI events: what
each kernel adds to a replay with overlapping (PDL) kernels, the last replay picked out of a
trace, and the per-layer block found in a step's kernel sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from graphtune.bench.cupti import DeviceEvent
from graphtune.bench.timeline import by_name, last_replay, repeating_block, timeline

ROOT = Path(__file__).resolve().parents[2]


def _kernel(name: str, start: float, duration: float, correlation: int | None = 7) -> DeviceEvent:
    return DeviceEvent(name, "kernel", start, duration, correlation)


def test_each_kernel_adds_its_end_after_the_latest_earlier_end() -> None:
    kernels = [
        _kernel("gemv", 100.0, 5.0),  # 100..105
        _kernel("norm", 104.0, 2.0),  # launched early (PDL): 104..106, adds 1
        _kernel("attn", 105.0, 0.5),  # ends inside the latest end: adds 0
        _kernel("gemv", 108.0, 3.0),  # a gap of 2 before it: adds 5
    ]
    rows = timeline(list(reversed(kernels)))  # any order in, start order out
    assert [r.name for r in rows] == ["gemv", "norm", "attn", "gemv"]
    assert [r.adds_us for r in rows] == [5.0, 1.0, 0.0, 5.0]
    assert [r.start_us for r in rows] == [0.0, 4.0, 5.0, 8.0]
    # The rows add up to the replay's span, first start to last end.
    assert sum(r.adds_us for r in rows) == 111.0 - 100.0
    table = by_name(rows)
    assert table[0] == {
        "name": "gemv",
        "calls": 2,
        "adds_us": 10.0,
        "duration_us": 8.0,
        "share": 10.0 / 11.0,
    }
    assert [e["name"] for e in table] == ["gemv", "norm", "attn"]
    assert timeline([]) == []


def test_the_last_replay_is_the_latest_of_the_largest_correlation_groups() -> None:
    events = []
    for replay in range(3):
        t = 1000.0 * replay
        events.append(_kernel("copy", t, 1.0, correlation=100 + replay))  # an input copy
        events += [_kernel(f"k{i}", t + 10 + i, 1.0, correlation=replay) for i in range(4)]
    last = last_replay(events, replays=3)
    assert [e.name for e in last] == ["k0", "k1", "k2", "k3"]
    assert all(e.start_us >= 2000.0 for e in last)
    # Without correlation ids, the widest gaps split the replays.
    plain = [DeviceEvent(e.name, e.category, e.start_us, e.duration_us) for e in events]
    assert [e.start_us for e in last_replay(plain, replays=3)][0] >= 2000.0
    with pytest.raises(ValueError, match="no device activity"):
        last_replay([], replays=3)


def test_the_repeating_layer_block_is_found_past_a_head_and_before_a_tail() -> None:
    layer = ["norm", "qkv", "attn", "o", "mlp"]
    names = ["embed", "mask"] + layer * 6 + ["final_norm", "lm_head"]
    assert repeating_block(names, 5) == (2, 5)
    # A first layer that differs (its norm fused elsewhere) still leaves the period; the block
    # then starts where the repetition does, inside that layer (a rotation of the layer).
    odd = ["embed", "qkv", "attn", "o", "mlp"] + layer * 5 + ["lm_head"]
    assert repeating_block(odd, 4) == (1, 5)
    assert repeating_block(["a", "b", "c"], 2) is None
    with pytest.raises(ValueError, match="repeats must be >= 2"):
        repeating_block(names, 1)


def test_step_trace_tables_show_one_layer_with_head_and_tail() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_trace
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    layer = ["norm", "qkv", "attn"]
    names = ["embed"] + layer * 4 + ["lm_head"]
    rows = timeline([_kernel(n, 10.0 * i, 4.0) for i, n in enumerate(names)])
    found = {
        "batches": [
            {
                "batch": 1,
                "replay_ms": 0.15,
                "span_us": sum(r.adds_us for r in rows),
                "kernels": len(rows),
                "rows": [r.__dict__ for r in rows],
                "layer": {
                    "start": 1,
                    "period": 3,
                    "blocks": 4,
                    "middle_rows": [7, 8, 9],
                    "head_rows": [0],
                    "tail_rows": [13],
                },
                "by_name": by_name(rows),
            }
        ]
    }
    text = step_trace.tables(found)
    assert "batch 1: 150.0 us a replay" in text and "14 kernels" in text
    assert "one middle layer: 3 kernels, adds 30.00 us" in text
    assert "head: 1 kernels" in text and "tail: 1 kernels" in text and "lm_head" in text
