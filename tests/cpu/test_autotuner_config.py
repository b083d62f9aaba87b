"""Bucket helpers, TuningConfig validation, profile generation and synthetic inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphtune.autotuner import (
    ConstraintSpec,
    DynamicTensorSpec,
    TuningConfig,
    last_power_of_two,
    next_power_of_two,
    power_of_two_buckets,
)
from graphtune.autotuner.profiles import (
    generate_profiles,
    input_bytes,
    profile_for,
    synthesize_inputs,
)
from graphtune.errors import ConfigError, InputError


@given(st.integers(min_value=1, max_value=1 << 40))
def test_power_of_two_helpers_bracket_x(x: int) -> None:
    up, down = next_power_of_two(x), last_power_of_two(x)
    assert up & (up - 1) == 0 and down & (down - 1) == 0
    assert down <= x <= up
    assert up < 2 * x and down > x // 2
    assert (up == x) == (down == x)


def test_power_of_two_edges() -> None:
    assert next_power_of_two(0) == 1 and last_power_of_two(0) == 1
    assert [next_power_of_two(x) for x in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [last_power_of_two(x) for x in (1, 2, 3, 5, 8, 9)] == [1, 2, 2, 4, 8, 8]
    with pytest.raises(ConfigError):
        next_power_of_two(2.5)  # type: ignore[arg-type]


def test_power_of_two_buckets() -> None:
    assert power_of_two_buckets(12) == (1, 2, 4, 8, 12)
    assert power_of_two_buckets(16) == (1, 2, 4, 8, 16)
    assert power_of_two_buckets(1) == (1,)
    assert power_of_two_buckets(64, min_value=5) == (8, 16, 32, 64)
    with pytest.raises(ConfigError, match="max_value"):
        power_of_two_buckets(0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timing": "cupti"}, "timing"),
        ({"max_value": 0}, "max_value"),
        ({"repeat": 0}, "repeat"),
        ({"warmup": -1}, "warmup"),
        ({"cold_l2": 1}, "cold_l2"),
        ({"inputs_pre_hook": 3}, "inputs_pre_hook"),
        ({"dynamic_specs": (ConstraintSpec(0, 0, len),)}, "DynamicTensorSpec"),
        (
            {
                "dynamic_specs": (DynamicTensorSpec(0, 0),),
                "constraint_specs": (ConstraintSpec(0, 0, lambda s: 1),),
            },
            "more than one",
        ),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TuningConfig(**kwargs)


def test_spec_validation() -> None:
    with pytest.raises(ConfigError, match="positive ints"):
        DynamicTensorSpec(0, 0, (0, 4))
    with pytest.raises(ConfigError, match="input_idx"):
        DynamicTensorSpec(-1, 0)
    with pytest.raises(ConfigError, match="map_to_bucket"):
        DynamicTensorSpec(0, 0, (1, 2), map_to_bucket=5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="infer"):
        ConstraintSpec(0, 0, infer=None)  # type: ignore[arg-type]
    assert DynamicTensorSpec(0, 0, [8, 2, 2, 4]).buckets == (2, 4, 8)
    config = TuningConfig(dynamic_specs=[DynamicTensorSpec(0, 0)])  # a list is accepted
    assert isinstance(config.dynamic_specs, tuple)


def test_profiles_cartesian_product_capped_plus_live() -> None:
    a = torch.randn(24, 16)
    b = torch.randn(16, 40)
    config = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, (1, 8, 64)), DynamicTensorSpec(1, -1, (16, 32))),
        max_value=48,
    )
    profiles = generate_profiles(config, [a, b])
    # dim 0 of a: buckets 1, 8 (64 > max_value); the live 24 maps to the listed 8;
    # dim -1 of b: 16, 32; the live 40 maps to the listed 32
    shapes = {p.shapes for p in profiles}
    assert shapes == {((m, 16), (16, n)) for m in (1, 8) for n in (16, 32)}
    assert all(p.dtypes == ("float32", "float32") for p in profiles)


def test_callable_buckets_get_max_value_and_live_bucket_is_capped() -> None:
    seen = []

    def buckets(max_value: int) -> tuple[int, ...]:
        seen.append(max_value)
        return power_of_two_buckets(max_value)

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, buckets),), max_value=8)
    profiles = generate_profiles(config, [torch.randn(100, 4)])
    assert seen == [8]
    assert [p.shapes[0][0] for p in profiles] == [1, 2, 4, 8]
    assert profile_for(config, [torch.randn(100, 4)]).shapes == ((8, 4),)
    assert profile_for(config, [torch.randn(5, 4)]).shapes == ((4, 4),)


def test_constraint_dims_are_inferred_from_bucketed_shapes() -> None:
    x = torch.randn(6, 32)
    scale = torch.randn(6)
    config = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4)),),
        constraint_specs=(ConstraintSpec(1, 0, lambda shapes: shapes[0][0]),),
    )
    profiles = generate_profiles(config, [x, scale, 3])
    assert [p.shapes for p in profiles] == [((2, 32), (2,), None), ((4, 32), (4,), None)]
    assert profiles[0].dtypes == ("float32", "float32", "int")
    assert profile_for(config, [x, scale, 3]).shapes == ((4, 32), (4,), None)


def test_bad_spec_indices_name_the_input() -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(2, 0),))
    with pytest.raises(InputError, match="input_idx=2"):
        profile_for(config, [torch.randn(2)])
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 3),))
    with pytest.raises(InputError, match="dim_idx=3"):
        profile_for(config, [torch.randn(2)])
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),))
    with pytest.raises(InputError, match="not a tensor"):
        profile_for(config, [7])
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, map_to_bucket=lambda n: -1),))
    with pytest.raises(ConfigError, match="int >= 0"):
        profile_for(config, [torch.randn(3)])
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, map_to_bucket=lambda n: 0.5),))
    with pytest.raises(ConfigError, match="map_to_bucket"):
        profile_for(config, [torch.randn(3)])


def test_synthetic_inputs_random_valid_and_hooked() -> None:
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    idx = torch.tensor([0, 5, 9], dtype=torch.int64)
    mask = torch.tensor([True, False])
    hooked = []

    def hook(inputs: list) -> list:
        hooked.append(len(inputs))
        return inputs

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (16,)),), inputs_pre_hook=hook)
    (profile,) = [p for p in generate_profiles(config, [x, idx, mask, "s"]) if p.shapes[0][0] == 16]
    out = synthesize_inputs(config, [x, idx, mask, "s"], profile)
    assert hooked == [4]
    assert out[0].shape == (16, 8) and out[0].dtype == torch.bfloat16
    assert out[0].abs().sum() > 0  # never zeros, even when the live tensor is
    assert out[1].dtype == torch.int64 and int(out[1].min()) >= 0 and int(out[1].max()) <= 9
    assert len(set(out[1].tolist())) > 1
    assert out[2].dtype == torch.bool and out[3] == "s"
    assert torch.equal(out[0], synthesize_inputs(config, [x, idx, mask, "s"], profile)[0])
    assert input_bytes(out) == 16 * 8 * 2 + 3 * 8 + 2


@pytest.mark.parametrize("specs", [None, 3, "0,0"])
def test_specs_that_are_no_sequence_of_specs_are_refused(specs):
    with pytest.raises(ConfigError, match="must be a DynamicTensorSpec or a tuple of them"):
        TuningConfig(dynamic_specs=specs)


def test_power_of_two_buckets_refuses_a_floor_above_the_top():
    from graphtune.autotuner import power_of_two_buckets

    assert power_of_two_buckets(64, min_value=16) == (16, 32, 64)
    with pytest.raises(ConfigError, match="min_value <= max_value"):
        power_of_two_buckets(4, min_value=16)


def test_sizes_at_or_above_max_value_look_up_its_own_bucket() -> None:
    from graphtune.autotuner.profiles import generate_profiles, profile_for

    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=12)
    tuned = [p.shapes[0][0] for p in generate_profiles(config, [torch.zeros(12, 4)])]
    assert tuned == [1, 2, 4, 8, 12]
    looked_up = {n: profile_for(config, [torch.zeros(n, 4)]).shapes[0][0] for n in (8, 11, 12, 40)}
    assert looked_up == {8: 8, 11: 8, 12: 12, 40: 12}  # 12 was tuned, and is used


def test_a_constraint_on_a_dynamic_dimension_is_refused_whatever_its_sign() -> None:
    # dim 0 and dim -2 of a 2-D input are one dimension: the constraint would overwrite the
    # swept size, so every profile would be the same shape.
    config = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0),),
        constraint_specs=(ConstraintSpec(0, -2, lambda shapes: 7),),
        max_value=64,
    )
    with pytest.raises(ConfigError, match="cannot also be constrained"):
        generate_profiles(config, [torch.randn(16, 4)])
    with pytest.raises(ConfigError, match="dim_idx=0 and ConstraintSpec dim_idx=-2 of input 0"):
        profile_for(config, [torch.randn(16, 4)])
    with pytest.raises(ConfigError, match="more than one dynamic/constraint spec"):
        TuningConfig(
            dynamic_specs=(DynamicTensorSpec(0, 0),),
            constraint_specs=(ConstraintSpec(0, 0, lambda shapes: 7),),
        )


def test_callable_buckets_that_are_not_powers_of_two_are_looked_up() -> None:
    spec = DynamicTensorSpec(0, 0, buckets=lambda m: (1, 3, 9, 27, 81))
    config = TuningConfig(dynamic_specs=(spec,), max_value=27)
    tuned = [p.shapes[0][0] for p in generate_profiles(config, [torch.randn(5, 4)])]
    assert tuned == [1, 3, 9, 27]
    # As for a tuple: a listed size hits itself, another the largest bucket below it.
    looked_up = {n: profile_for(config, [torch.randn(n, 4)]).shapes[0][0] for n in (3, 9, 20, 40)}
    assert looked_up == {3: 3, 9: 9, 20: 9, 40: 27}
    # Without max_value the list depends on the live size, so look-ups cannot follow it.
    with pytest.raises(ConfigError, match="pass max_value, or map_to_bucket"):
        generate_profiles(TuningConfig(dynamic_specs=(spec,)), [torch.randn(5, 4)])


def test_default_buckets_without_max_value_tune_only_buckets_a_look_up_uses() -> None:
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),))
    tuned = [p.shapes[0][0] for p in generate_profiles(config, [torch.zeros(12, 4)])]
    assert tuned == [1, 2, 4, 8]  # not 12: a live 12 looks up 8
    assert profile_for(config, [torch.zeros(12, 4)]).shapes == ((8, 4),)


def test_tuple_buckets_above_max_value_map_onto_a_bucket_the_sweep_tunes() -> None:
    """As with callable buckets: every live size looks up one of the swept buckets (a size >= 64
    of (1, 8, 64) capped at 32 looked up 32, tuned only when the tuning call was that large)."""
    listed = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (1, 8, 64)),), max_value=32)
    made = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, lambda m: (1, 8, 64)),), max_value=32
    )
    for cfg in (listed, made):
        spec = cfg.dynamic_specs[0]
        assert cfg.sweep_values(spec, 10) == (1, 8)
        assert [cfg.bucket_of(spec, n) for n in (1, 10, 40, 64, 100)] == [1, 8, 8, 8, 8]
        assert cfg.sweep_values(spec, 100) == (1, 8)
    above = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (64, 128)),), max_value=32)
    assert above.bucket_of(above.dynamic_specs[0], 500) == 32
    assert above.sweep_values(above.dynamic_specs[0], 5) == (32,)


def test_a_buckets_callable_that_returns_no_iterable_is_a_config_error() -> None:
    bad_returns = (
        (lambda m: 5, 8),
        (lambda m: None, None),
        (lambda m: "1,2", 8),
        (lambda m: b"\x01\x02", 8),
        (lambda m: {1: "a", 8: "b"}, 8),  # a mapping: its keys are not meant as buckets
    )
    for bad, max_value in bad_returns:
        cfg = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, bad),), max_value=max_value)
        with pytest.raises(ConfigError, match="buckets callable returned .* iterable of positive"):
            cfg.sweep_values(cfg.dynamic_specs[0], 4)


@pytest.mark.parametrize("max_value", [32, None])
def test_a_buckets_callable_may_return_a_set_or_a_generator(max_value: int | None) -> None:
    """Any iterable of positive ints, as before session 53 (validate_buckets sorts them)."""
    made = (lambda m: {8, 1, 4}, lambda m: (2**i for i in (3, 0, 2)), lambda m: [8, 1, 4, 4])
    for fn in made:
        cfg = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, fn),), max_value=max_value)
        spec = cfg.dynamic_specs[0]
        assert cfg.sweep_values(spec, 5) == (1, 4, 8)
        assert cfg.bucket_of(spec, 5) == 4


def test_a_failing_user_mapper_or_infer_keeps_its_error_and_names_the_spec() -> None:
    x, scale = torch.randn(6, 32), torch.randn(6)

    def broken_mapper(live: int) -> int:
        return live // 0

    mapped = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4), broken_mapper),))
    with pytest.raises(ZeroDivisionError) as info:
        profile_for(mapped, [x, scale])
    notes = getattr(info.value, "__notes__", [])
    if hasattr(info.value, "add_note"):  # Python 3.11+
        assert notes == ["in DynamicTensorSpec(input_idx=0, dim_idx=0).map_to_bucket(6)"]

    inferred = TuningConfig(
        dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4)),),
        constraint_specs=(ConstraintSpec(1, 0, lambda shapes: shapes[2][0]),),
    )
    with pytest.raises(TypeError) as info:
        generate_profiles(inferred, [x, scale, 3])
    if hasattr(info.value, "add_note"):
        (note,) = info.value.__notes__
        assert note.startswith("in ConstraintSpec(input_idx=1, dim_idx=0).infer(shapes=[(2, 32)")
        assert "None marks an input that is not a tensor" in note
