"""Property-based tests (hypothesis) of the pure parts: padding and slicing round trips, bucket
mapping, cache key stability and cache file round trips."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphtune.autotuner import (
    CacheEntry,
    CacheKey,
    DynamicTensorSpec,
    TunableRunner,
    TuningCache,
    TuningConfig,
    last_power_of_two,
    next_power_of_two,
    persist,
    power_of_two_buckets,
)
from graphtune.autotuner.entries import BlockedTactic, tactic_text
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.profiles import profile_for
from graphtune.graphs import policy
from graphtune.graphs.buffers import StaticInputs
from graphtune.graphs.outputs import StaticOutputs

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- padding and slicing


@st.composite
def padding_case(draw):
    sizes = draw(st.lists(st.integers(1, 24), min_size=1, max_size=6, unique=True))
    sizes = policy.validate_capture_sizes(sizes, max(sizes))
    n = draw(st.integers(1, sizes[-1]))
    trailing = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    pad = draw(st.sampled_from(["zeros", "repeat", -7.0]))
    return sizes, n, trailing, pad


@FAST
@given(padding_case())
def test_padding_copy_in_and_slice_out_round_trip(case) -> None:
    sizes, n, trailing, pad = case
    rows = sizes[-1]
    example = (torch.randn(rows, *trailing), {"ids": torch.arange(rows)}, 3)
    plan = StaticInputs.build(example, rows=rows, pad=pad)
    table = policy.padding_table(sizes)
    s = table[n]
    assert s == min(x for x in sizes if x >= n), "pads to the smallest captured size >= n"
    x = torch.randn(n, *trailing)
    ids = torch.arange(100, 100 + n)
    call = (x, {"ids": ids}, 3)
    plan.copy_in(plan.flatten(call), n, s, debug=True)
    static = plan.static_args(s)
    assert torch.equal(static[0][:n], x) and torch.equal(static[1]["ids"][:n], ids)
    padded = static[0][n:]
    if pad == "zeros":
        assert torch.all(padded == 0)
    elif pad == "repeat":
        assert torch.equal(padded, x[:1].expand_as(padded))
    else:
        assert torch.all(padded == pad)
    copy = plan.padded_copy(call, s)
    assert torch.equal(copy[0], static[0]) and torch.equal(copy[1]["ids"], static[1]["ids"])
    # Outputs: leading dim == s is sliced back to n; anything else is returned whole.
    outputs = StaticOutputs({"y": static[0] * 2, "total": static[0].sum().reshape(1)}, s)
    result = outputs.result(n, clone=False)
    assert torch.equal(result["y"], 2 * x)
    assert result["total"].shape == ((1,) if s != 1 else (n,))


@FAST
@given(st.lists(st.integers(1, 300), min_size=1, max_size=12, unique=True))
def test_padding_table_is_monotone_and_tight(raw) -> None:
    sizes = policy.validate_capture_sizes(raw, max(raw))
    table = policy.padding_table(sizes)
    for n in range(1, sizes[-1] + 1):
        assert table[n] in sizes and table[n] >= n
        assert table[n] >= table[n - 1]
    assert policy.padded_size(sizes[-1] + 1, sizes) is None


# ---------------------------------------------------------------- bucket mapping


@FAST
@given(st.integers(0, 1 << 20), st.integers(0, 1 << 20))
def test_power_of_two_helpers_are_monotone_and_bracket_x(a, b) -> None:
    lo, hi = sorted((a, b))
    assert last_power_of_two(lo) <= last_power_of_two(hi)
    assert next_power_of_two(lo) <= next_power_of_two(hi)
    for x in (lo, hi):
        down, up = last_power_of_two(x), next_power_of_two(x)
        assert down & (down - 1) == 0 and up & (up - 1) == 0
        assert down <= max(x, 1) <= up


@FAST
@given(st.integers(1, 5000), st.integers(1, 64))
def test_power_of_two_buckets_contract(max_value, min_value) -> None:
    buckets = power_of_two_buckets(max_value, min(min_value, max_value))
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_value
    assert all(1 <= b <= max_value for b in buckets)


@FAST
@given(
    st.one_of(st.none(), st.integers(1, 512)),
    st.lists(st.integers(1, 2048), min_size=2, max_size=2),
)
def test_bucket_of_is_monotone_capped_and_never_borrows_a_larger_pick(max_value, lives) -> None:
    spec = DynamicTensorSpec(0, 0)
    config = TuningConfig(dynamic_specs=(spec,), max_value=max_value)
    lo, hi = sorted(lives)
    assert config.bucket_of(spec, lo) <= config.bucket_of(spec, hi)
    for live in (lo, hi):
        bucket = config.bucket_of(spec, live)
        assert 1 <= bucket <= live, "the default rounds down: a live size never uses a larger pick"
        assert max_value is None or bucket <= max_value
        assert bucket in config.sweep_values(spec, live), "the live bucket is always tuned"


# ---------------------------------------------------------------- cache keys

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
hashable_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**53), 2**53), st.text(max_size=8)
)
tactics = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=5), inner, max_size=4),
        # keys that are not strings, or that look like the codec's own tags
        st.dictionaries(hashable_leaf, inner, max_size=3),
        st.dictionaries(st.sampled_from(["__tuple__", "__dict__"]), inner, max_size=1),
    ),
    max_leaves=12,
)


def typed(value):
    """``value`` with every type spelled out, so 1 != 1.0 and (1,) != [1] compare unequal."""
    if isinstance(value, dict):
        return ("dict", [(typed(k), typed(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [typed(v) for v in value])
    return (type(value).__name__, value)


shapes = st.lists(
    st.one_of(st.none(), st.lists(st.integers(0, 1 << 16), max_size=4).map(tuple)),
    min_size=1,
    max_size=4,
).map(tuple)


@st.composite
def cache_keys(draw):
    shp = draw(shapes)
    return CacheKey(
        op=draw(st.text(min_size=1, max_size=10)),
        runners=tuple(draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3))),
        shapes=shp,
        dtypes=tuple(draw(st.sampled_from(["float32", "bfloat16", "int64", "int"])) for _ in shp),
        timing=draw(st.sampled_from(["graph", "events", "wallclock", "fake"])),
        sources=draw(st.sampled_from(["", "0123456789abcdef"])),
        kwargs=draw(st.sampled_from(["", '{"gemm_idx":1}'])),
        device=draw(st.sampled_from(["cpu", "cuda"])),
    )


def listed(value):
    """The tactic spelled with lists instead of tuples (another spelling of the same tactic)."""
    if isinstance(value, (list, tuple)):
        return [listed(v) for v in value]
    if isinstance(value, dict):
        return {k: listed(v) for k, v in value.items()}
    return value


@FAST
@given(cache_keys())
def test_cache_key_json_round_trip(key) -> None:
    text = json.dumps(key.to_json(), sort_keys=True)
    back = CacheKey.from_json(json.loads(text))
    assert back == key and hash(back) == hash(key)
    assert json.dumps(back.to_json(), sort_keys=True) == text


class Extras(TunableRunner):
    def __init__(self, extras):
        self.extras = extras

    def cache_key_extras(self):
        return self.extras


@FAST
@given(st.dictionaries(st.text(max_size=5), st.integers(), max_size=5), st.randoms())
def test_runner_id_ignores_dict_order(mapping, rnd) -> None:
    items = list(mapping.items())
    rnd.shuffle(items)
    assert runner_id(Extras((mapping, "x"))) == runner_id(Extras((dict(items), "x")))


@FAST
@given(st.integers(1, 300), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_profile_key_is_a_function_of_shapes_and_dtypes_only(m, dtype) -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),))
    a = [torch.zeros(m, 8, dtype=dtype), 3]
    b = [torch.ones(m, 8, dtype=dtype), 3]  # other values, same shape: same key
    assert profile_for(config, a) == profile_for(config, b)


KEY_SCRIPT = """
import json
from graphtune.autotuner.identity import runner_id
from graphtune.autotuner.runner import TunableRunner
from graphtune.autotuner import CacheKey
class R(TunableRunner):
    def cache_key_extras(self):
        return ({"b": 1, "a": [2, 3]}, "nt")
R.__module__ = "fixed"
key = CacheKey("gemm", (runner_id(R()),), ((16, 64), None), ("bfloat16", "int"), "graph")
print(json.dumps(key.to_json(), sort_keys=True))
"""


def test_cache_key_text_is_identical_in_another_process() -> None:
    class R(TunableRunner):
        def cache_key_extras(self):
            return ({"a": [2, 3], "b": 1}, "nt")  # other dict order than the child's

    R.__module__, R.__qualname__ = "fixed", "R"
    here = CacheKey("gemm", (runner_id(R()),), ((16, 64), None), ("bfloat16", "int"), "graph")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another string hash than this process
    out = subprocess.run(
        [sys.executable, "-c", KEY_SCRIPT], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == json.dumps(here.to_json(), sort_keys=True)


# ---------------------------------------------------------------- cache file round trips


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            cache_keys(),
            tactics,
            st.one_of(st.none(), st.floats(1e-3, 1e6)),
            st.one_of(st.none(), st.floats(1e-3, 1e6)),
        ),
        max_size=5,
    ),
    st.lists(tactics, max_size=3),
)
def test_cache_save_load_round_trip(items, blocked) -> None:
    cache = TuningCache()
    expected = {}
    for key, tactic, time_us, fallback_us in items:
        entry = CacheEntry(key.runners[0], 0, tactic, time_us, fallback_us)
        cache.put(key, entry)
        expected[key] = CacheEntry(key.runners[0], 0, tactic, time_us, fallback_us)
    for tactic in blocked:
        cache.block(BlockedTactic("m.R", tactic, "crash"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache.json"
        cache.save(path)
        first = path.read_bytes()
        loaded = persist.load_file(path, strict=True)
        assert loaded.entries == expected
        # Tactics come back with their types: tuples as tuples, ints as ints, dict keys as keys.
        assert [typed(loaded.entries[k].tactic) for k in expected] == [
            typed(e.tactic) for e in expected.values()
        ]
        assert {i: typed(b.tactic) for i, b in loaded.blocklist.items()} == {
            ("m.R", tactic_text(t)): typed(t) for t in blocked
        }
        # Saving what was loaded to another file changes nothing: the bytes depend only on the
        # content.
        again = TuningCache()
        again.load(path, strict=True)
        copy = Path(tmp) / "copy.json"
        again.save(copy)
        assert copy.read_bytes() == first


@FAST
@given(tactics)
def test_tuple_and_list_tactics_normalise_to_one_identity(tactic) -> None:
    assert tactic_text(tactic) == tactic_text(listed(tactic))
    cache = TuningCache()
    cache.block(BlockedTactic("m.R", tactic, "timeout"))
    assert cache.blocked("m.R", listed(tactic)) is not None


def test_non_string_dict_keys_keep_their_identity() -> None:
    assert tactic_text({1: "a"}) != tactic_text({"1": "a"})
    assert tactic_text({1: "a", None: 2}) == tactic_text({None: 2, 1: "a"})
