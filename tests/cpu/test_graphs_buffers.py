"""Flattening, rule resolution, static buffers, pad rules and output slicing (CPU)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphtune.errors import ConfigError, InputError
from graphtune.graphs.buffers import StaticInputs
from graphtune.graphs.outputs import StaticOutputs
from graphtune.graphs.padding import is_pad_rule
from graphtune.graphs.tree import flatten_with_paths, path_str, resolve_rules

Pair = namedtuple("Pair", "a b")

# ---------------------------------------------------------------- nested structures

leaf_values = st.one_of(
    st.integers(-5, 5),
    st.none(),
    st.text(max_size=3),
    st.integers(1, 4).map(lambda n: torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)),
)
trees = st.recursive(
    leaf_values,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children, max_size=4),
        st.tuples(children, children).map(lambda t: Pair(*t)),
    ),
    max_leaves=12,
)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a is b
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_flatten_unflatten_round_trip(value):
    leaves, paths, spec = flatten_with_paths(value)
    assert len(leaves) == len(paths) == spec.num_leaves
    assert _same(spec.unflatten(leaves), value)
    assert all(a is b for a, b in zip(spec.flatten(value), leaves, strict=True))


def test_paths_are_dotted():
    value = (torch.zeros(2), {"pos": torch.zeros(2), "x": [1, Pair(3, 4)]})
    _, paths, _ = flatten_with_paths(value)
    assert [path_str(p) for p in paths] == ["0", "1.pos", "1.x.0", "1.x.1.0", "1.x.1.1"]


def test_spec_flatten_uses_recorded_dict_keys_not_order():
    _, _, spec = flatten_with_paths(({"a": 1, "b": 2},))
    assert spec.flatten(({"b": 20, "a": 10},)) == [10, 20]


@pytest.mark.parametrize(
    "other",
    [({"a": 1},), ({"a": 1, "c": 2},), ([1, 2],), ({"a": 1, "b": 2}, 3)],
)
def test_spec_flatten_mismatch_names_path(other):
    _, _, spec = flatten_with_paths(({"a": 1, "b": 2},))
    with pytest.raises(InputError, match="structure"):
        spec.flatten(other)


def test_unflatten_keeps_container_types():
    value = (OrderedDict(a=1), [2], Pair(3, 4), {"z": (5,)})
    leaves, _, spec = flatten_with_paths(value)
    rebuilt = spec.unflatten(leaves)
    assert type(rebuilt[0]) is OrderedDict and type(rebuilt[2]) is Pair and rebuilt == value


# ---------------------------------------------------------------- rule resolution

PATHS = [(0,), (1, "pos"), (1, "slot"), (2, 0)]


def test_rules_single_rule_applies_everywhere():
    assert resolve_rules("repeat", PATHS, name="pad", is_rule=is_pad_rule) == ["repeat"] * 4


def test_rules_dict_by_path_with_prefix_and_specificity():
    rules = {"1": "repeat", "1.slot": -1, 2: 7}
    got = resolve_rules(rules, PATHS, name="pad", is_rule=is_pad_rule)
    assert got == [None, "repeat", -1, 7]


def test_rules_structure_like_inputs():
    rules = (None, {"slot": 5}, ["repeat"])
    got = resolve_rules(rules, PATHS, name="pad", is_rule=is_pad_rule)
    assert got == [None, None, 5, "repeat"]


def test_rules_unknown_path_is_config_error_listing_paths():
    with pytest.raises(ConfigError, match=r"'1\.slots'.*1\.slot"):
        resolve_rules({"1.slots": 0}, PATHS, name="pad", is_rule=is_pad_rule)


def test_rules_invalid_rule_value():
    with pytest.raises(ConfigError, match="not a valid rule"):
        resolve_rules({"0": "zero"}, PATHS, name="pad", is_rule=is_pad_rule)


# ---------------------------------------------------------------- static inputs


def _inputs(n, hidden=4):
    x = torch.arange(n * hidden, dtype=torch.float32).reshape(n, hidden) + 1
    return (x, {"pos": torch.arange(n) + 10, "table": torch.ones(3, 3)}, 7)


def test_batched_detection_by_leading_dim():
    plan = StaticInputs.build(_inputs(5), rows=8)
    assert plan.batched_paths == ["0", "1.pos"]
    assert plan.batch_index == 0 and plan.rows == 8
    assert plan.nbytes == 8 * 4 * 4 + 8 * 8


def test_batched_predicate_and_mapping():
    plan = StaticInputs.build(_inputs(3), rows=4, batched=lambda path, t: path == "0")
    assert plan.batched_paths == ["0"]
    plan = StaticInputs.build(_inputs(5), rows=8, batched={"1.pos": False})
    assert plan.batched_paths == ["0"]


def test_batched_mapping_marking_a_wrong_tensor_is_an_error():
    with pytest.raises(InputError, match="1.table.*marked batched"):
        StaticInputs.build(_inputs(5), rows=8, batched={"1.table": True})


def test_no_batched_tensor_returns_none():
    assert StaticInputs.build((3, torch.tensor(2.0)), rows=4) is None
    assert StaticInputs.build((torch.zeros(0, 2),), rows=4) is None


def test_device_type_is_enforced():
    with pytest.raises(InputError, match="graphs capture cuda work only"):
        StaticInputs.build(_inputs(2), rows=4, device_type="cuda")


def _pad_rows(plan, inputs, n, s):
    leaves = plan.flatten(inputs)
    plan.copy_in(leaves, n, s, debug=False)
    return plan.static_args(s)


@pytest.mark.parametrize(
    "pad, expected_row",
    [
        (None, [0.0, 0.0, 0.0, 0.0]),
        ("zeros", [0.0, 0.0, 0.0, 0.0]),
        ({"0": -1.5}, [-1.5] * 4),  # a fraction only for the float input (the int one refuses it)
        ("repeat", [1.0, 2.0, 3.0, 4.0]),
        (lambda pad_rows, real: pad_rows.copy_(real[-1:].expand_as(pad_rows)), [9.0, 10, 11, 12]),
    ],
)
def test_pad_rules_fill_padded_rows(pad, expected_row):
    plan = StaticInputs.build(_inputs(8), rows=8, pad=pad)
    x, d, _ = _pad_rows(plan, _inputs(3), 3, 4)
    assert torch.equal(x[:3], _inputs(3)[0])
    assert x[3].tolist() == expected_row
    assert x.shape == (4, 4) and d["pos"].shape == (4,)


def test_padded_rows_refilled_after_a_larger_batch():
    plan = StaticInputs.build(_inputs(8), rows=8, pad={"0": 0, "1.pos": -1})
    _pad_rows(plan, _inputs(8), 8, 8)  # leaves real data in rows 3..7
    x, d, _ = _pad_rows(plan, _inputs(3), 3, 8)
    assert torch.all(x[3:] == 0) and torch.all(d["pos"][3:] == -1)


def test_copy_in_rejects_wrong_dtype_shape_rank_and_names_path():
    plan = StaticInputs.build(_inputs(4), rows=4)
    good = _inputs(2)
    for bad_x, what in [
        (good[0].double(), "dtype torch.float64"),
        (good[0][:, :3], r"shape \(2, 3\)"),
        (good[0].reshape(2, 2, 2), r"shape \(2, 2, 2\)"),
    ]:
        with pytest.raises(InputError, match=rf"input 0: expected shape \(2, 4\).*{what}"):
            plan.copy_in(plan.flatten((bad_x, good[1], 7)), 2, 2, debug=False)
    with pytest.raises(InputError, match="input 1.pos.*leading dim"):
        plan.copy_in(plan.flatten((good[0], {**good[1], "pos": torch.arange(3)}, 7)), 2, 2, False)


def test_changed_constant_is_an_error():
    plan = StaticInputs.build(_inputs(4), rows=4)
    x, d, _ = _inputs(2)
    with pytest.raises(InputError, match="input 2 is 8.*captured with 7.*key_fn"):
        plan.copy_in(plan.flatten((x, d, 8)), 2, 2, debug=False)


def test_debug_check_catches_moved_static_tensor():
    example = _inputs(4)
    plan = StaticInputs.build(example, rows=4)
    x, d, c = _inputs(2)
    plan.copy_in(plan.flatten((x, {**d, "table": example[1]["table"]}, c)), 2, 2, debug=True)
    moved = (x, {**d, "table": torch.ones(3, 3)}, c)
    plan.copy_in(plan.flatten(moved), 2, 2, debug=False)  # not checked outside debug mode
    with pytest.raises(InputError, match="1.table changed address"):
        plan.copy_in(plan.flatten(moved), 2, 2, debug=True)
    table = example[1]["table"]
    for view in (table.t(), table[:, :2]):  # the same address, another tensor
        viewed = (x, {**d, "table": view}, c)
        with pytest.raises(InputError, match="1.table changed address"):
            plan.copy_in(plan.flatten(viewed), 2, 2, debug=True)


@pytest.mark.parametrize("captured, called", [(1, 1.0), (1, True), (2.0, 2)])
def test_a_constant_of_another_type_is_not_the_captured_one(captured, called):
    x = torch.randn(4, 3)
    plan = StaticInputs.build((x, captured), rows=4)
    with pytest.raises(InputError, match="non-tensor inputs are baked into the graph"):
        plan.copy_in(plan.flatten((x, called)), 4, 4, debug=False)


def test_a_nan_constant_is_the_captured_nan():
    x = torch.randn(4, 3)
    plan = StaticInputs.build((x, float("nan")), rows=4)
    plan.copy_in(plan.flatten((x, float("nan"))), 4, 4, debug=False)


def test_a_bool_input_pads_with_0_or_1_only():
    with pytest.raises(ConfigError, match="0 or 1"):
        StaticInputs.build((torch.zeros(4, dtype=torch.bool),), rows=8, pad=2)
    StaticInputs.build((torch.zeros(4, dtype=torch.bool),), rows=8, pad=1)


def test_padded_copy_matches_static_args():
    plan = StaticInputs.build(_inputs(8), rows=8, pad="repeat")
    padded = plan.padded_copy(_inputs(3), 4)
    static = _pad_rows(plan, _inputs(3), 3, 4)
    assert torch.equal(padded[0], static[0]) and torch.equal(padded[1]["pos"], static[1]["pos"])


# ---------------------------------------------------------------- outputs


def test_outputs_sliced_only_where_leading_dim_is_padded_size():
    y = torch.arange(8.0).reshape(4, 2)
    cache = torch.zeros(16, 2)
    outs = StaticOutputs({"y": y, "cache": cache, "n": 3, "scalar": torch.tensor(1.0)}, size=4)
    got = outs.result(3, clone=False)
    assert got["y"].shape == (3, 2) and got["y"].data_ptr() == y.data_ptr()
    assert got["cache"] is cache and got["n"] == 3 and got["scalar"].dim() == 0
    cloned = outs.result(3, clone=True)
    assert torch.equal(cloned["y"], y[:3]) and cloned["y"].data_ptr() != y.data_ptr()


@settings(max_examples=100, deadline=None)
@given(trees, st.integers(1, 4))
def test_output_slicing_round_trip(value, n):
    size = 4
    padded = flatten_with_paths(value)[2].unflatten(
        [
            torch.cat([x, torch.zeros(size - x.shape[0], 3)]) if isinstance(x, torch.Tensor) else x
            for x in flatten_with_paths(value)[0]
        ]
    )
    got = StaticOutputs(padded, size).result(n, clone=False)
    for a, b in zip(flatten_with_paths(got)[0], flatten_with_paths(padded)[0], strict=True):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b[:n])
        else:
            assert a == b
