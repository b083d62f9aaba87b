"""A non-contiguous tensor input's layout class (stride order, and gaps) is part of its cache key,
and its synthetic inputs have that stride order: a pick tuned on contiguous inputs was served to
a transposed live input of the same shape, and get_valid_tactics never saw the live layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from graphtune.autotuner import (
    AutoTuner,
    DynamicTensorSpec,
    TunableRunner,
    TuningConfig,
    autotune,
    check_tactics,
)
from graphtune.autotuner.calls import CallRecord, OpCall
from graphtune.autotuner.profiles import generate_profiles, profile_for, synthesize_inputs

CONFIG = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4)),), timing="wallclock")


class ContiguousOnly(TunableRunner):
    """Offers tactic "flat" for contiguous inputs only, and records the layouts it was shown."""

    def __init__(self) -> None:
        self._seen: list[bool] = []

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        self._seen.append(inputs[0].is_contiguous())
        return ["flat"] if inputs[0].is_contiguous() else [-1]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        if tactic == "flat":
            return inputs[0].view(-1).sum()  # fails on a transposed input
        return inputs[0].sum()


def test_a_transposed_input_is_not_served_the_pick_of_a_contiguous_one() -> None:
    runner = ContiguousOnly()
    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    contiguous, transposed = torch.randn(4, 8), torch.randn(8, 4).t()
    assert tuner.choose_one("op", [runner], CONFIG, [contiguous])[1] == "flat"
    tuned = len(tuner.cache)
    # Tuned apart, on synthetic inputs of the live layout (get_valid_tactics saw it).
    runner._seen.clear()
    picked, tactic = tuner.choose_one("op", [runner], CONFIG, [transposed])
    assert tactic == -1 and runner._seen and not any(runner._seen)
    picked.forward([transposed], tactic=tactic)
    assert len(tuner.cache) == 2 * tuned
    tuner.tuning_mode = False
    for _ in range(2):  # the second time from the hit memo
        assert tuner.choose_one("op", [runner], CONFIG, [transposed])[1] == -1
        assert tuner.choose_one("op", [runner], CONFIG, [contiguous])[1] == "flat"


def test_contiguous_keys_are_unchanged_and_layouts_are_classes_not_strides() -> None:
    contiguous = profile_for(CONFIG, [torch.randn(4, 8)])
    assert contiguous is not None and contiguous.dtypes == ("float32",)
    assert contiguous.layouts == () and contiguous.describe() == "4x8"
    transposed = profile_for(CONFIG, [torch.randn(8, 4).t()])
    assert transposed is not None and transposed.dtypes == ("float32 order(1,0)",)
    assert transposed.describe() == "4x8 order(1,0)"
    # Rows of a wider buffer key as row-major: at batch 1 the gap cannot be seen (torch gives a
    # size-1 dim a packed stride), so one call site keeps one key at every batch size.
    rows = profile_for(CONFIG, [torch.randn(4, 16)[:, :8]])
    assert rows is not None and rows == contiguous
    one_row = torch.randn(1, 16)[:, :8]
    assert one_row.is_contiguous() and profile_for(CONFIG, [one_row]) == profile_for(
        CONFIG, [torch.randn(1, 8)]
    )
    # A gap inside a row is its own class, and another stride of it is the same class.
    strided = profile_for(CONFIG, [torch.randn(4, 16)[:, ::2]])
    assert strided is not None and strided.dtypes == ("float32 order(0,1) gaps",)
    assert profile_for(CONFIG, [torch.randn(4, 24)[:, ::3]]) == strided
    vector = profile_for(CONFIG, [torch.randn(16)[::2]])  # one dim: its elements have gaps
    assert vector is not None and vector.dtypes == ("float32 order(0) gaps",)


def test_synthetic_inputs_have_the_live_stride_order_at_every_bucket() -> None:
    live = torch.randn(3, 8, 5).permute(2, 0, 1)  # shape (5, 3, 8), order (1, 2, 0)
    config = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0, (2, 4, 8)),))
    for profile in generate_profiles(config, [live]):
        (made,) = synthesize_inputs(config, [live], profile)
        assert made.shape == profile.shapes[0]
        strides = made.stride()
        assert sorted(range(3), key=lambda d: -strides[d]) == [1, 2, 0]
        assert profile_for(config, [made]) == profile  # its own key is the profile's


def test_a_recorded_miss_rebuilds_the_layout_it_missed_with() -> None:
    tuner = AutoTuner(show_progress=False)
    live = torch.randn(8, 4).t()
    tuner.choose_one("op", [ContiguousOnly()], CONFIG, [live])  # not tuning: a miss
    (record,) = tuner.misses.records()
    again = CallRecord.from_json(record.to_json()).make_inputs()
    call = OpCall("op", (ContiguousOnly(),), CONFIG, tuple(again))
    assert tuner._resolve(call).live_key().to_json() == record.key


def test_check_tactics_runs_and_names_the_live_layout() -> None:
    report = check_tactics("op", [ContiguousOnly()], CONFIG, [torch.randn(8, 4).t()])
    assert report.profile == "4x8 order(1,0)" and report.reference_error is None


def test_a_row_broadcast_over_the_batch_keys_as_row_major_at_every_batch_size() -> None:
    # bias.expand(B, N): contiguous at B=1 (a size-1 dim), stride 0 above; one key for both, so
    # a tuning run from either call covers the other's buckets.
    bias = torch.randn(8)
    assert profile_for(CONFIG, [bias.expand(1, 8)]).dtypes == ("float32",)
    assert profile_for(CONFIG, [bias.expand(4, 8)]).dtypes == ("float32",)


# Batch sizes 1, 2, 4 and 8: bucket 1 is where a size-1 dim can make a layout contiguous.
SWEPT = TuningConfig(dynamic_specs=(DynamicTensorSpec(0, 0),), max_value=8, timing="wallclock")


def _feature_major(n: int) -> torch.Tensor:
    """Activations stored feature-major and passed transposed: shape (n, 64), strides (1, n),
    so ``order(1,0)`` at n > 1, but contiguous at n = 1 (torch's strides (1, 1))."""
    return torch.zeros(64, n).t()


def _tuned_profiles(tuner: AutoTuner) -> list[str]:
    return sorted(record.profile for record in tuner.history)


def test_a_batch_1_call_is_served_the_pick_tuned_from_a_larger_transposed_call(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cache.json"
    tuner = AutoTuner(show_progress=False)
    with autotune(path, tuner=tuner):
        tuner.choose_one("op", [ContiguousOnly()], SWEPT, [_feature_major(8)])
    serving = AutoTuner(show_progress=False)
    with autotune(path, tuner=serving, tune=False):
        runner = ContiguousOnly()
        picks = {
            n: serving.choose_one("op", [runner], SWEPT, [_feature_major(n)]) for n in (1, 2, 8)
        }
    assert {n: tactic for n, (_, tactic) in picks.items()} == {1: "flat", 2: -1, 8: -1}
    picks[1][0].forward([_feature_major(1)], tactic="flat")  # the flat tactic fits that call
    assert serving.stats.misses == 0 and serving.stats.fallbacks == {}
    assert not serving.misses.records()
    # Bucket 1 was keyed (and its inputs made) contiguous, as the live batch-1 call is.
    assert _tuned_profiles(tuner) == [
        "1x64",
        "2x64 order(1,0)",
        "4x64 order(1,0)",
        "8x64 order(1,0)",
    ]
    # Tuning mode finds it too: nothing is tuned again.
    again = AutoTuner(show_progress=False)
    with autotune(path, tuner=again):
        assert again.choose_one("op", [ContiguousOnly()], SWEPT, [_feature_major(1)])[1] == "flat"
    assert again.history == []


@pytest.mark.parametrize(
    "producer",
    [
        _feature_major,
        lambda n: torch.zeros(64, 2 * n)[:, ::2].t(),  # transposed, with gaps: order(0,1) at n = 1
        lambda n: torch.zeros(n, 128)[:, ::2],  # a step inside each row
        lambda n: torch.zeros(2 * n, 8, 4)[::2].transpose(1, 2),  # its only gap is along dim 0
        lambda n: torch.zeros(8, 4).expand(n, 8, 4).transpose(1, 2),  # broadcast over the batch
        lambda n: torch.zeros(3, n, 4).permute(1, 2, 0),  # order(0,2,1) at n = 1
    ],
    ids=["transposed", "transposed-gaps", "row-steps", "gap-on-dim-0", "broadcast", "permuted"],
)
def test_each_bucket_keys_as_a_live_call_of_its_batch_and_is_made_in_that_layout(
    producer: Any,
) -> None:
    live = producer(8)
    profiles = generate_profiles(SWEPT, [live])
    assert [p.shapes[0][0] for p in profiles] == [1, 2, 4, 8]
    for profile in profiles:
        at_batch = producer(profile.shapes[0][0])
        assert profile_for(SWEPT, [at_batch]) == profile  # one key, whichever call tuned
        (made,) = synthesize_inputs(SWEPT, [live], profile)
        assert made.shape == at_batch.shape
        layout = profile.layouts[0] if profile.layouts else None
        if layout is None:
            assert made.is_contiguous()
            continue
        order, dense = layout
        assert made.permute(order).is_contiguous()  # dense in the bucket's stride order
        if dense:
            assert not made.is_contiguous() and _strides(made) == _strides(at_batch)


def _strides(x: torch.Tensor) -> list[int]:
    """The strides that matter: those of the dims whose size is not 1."""
    return [stride for stride, size in zip(x.stride(), x.shape, strict=True) if size != 1]


def test_bucket_strides_of_a_transposed_input() -> None:
    made = {
        p.shapes[0][0]: synthesize_inputs(SWEPT, [_feature_major(8)], p)[0]
        for p in generate_profiles(SWEPT, [_feature_major(8)])
    }
    assert {n: t.stride() for n, t in made.items()} == {1: (64, 1), 2: (1, 2), 4: (1, 4), 8: (1, 8)}


def test_a_layout_a_batch_1_call_cannot_show_misses_cleanly_and_is_tuned_at_its_buckets() -> None:
    # Tuned from batch 1, where a transposed input is contiguous: every bucket is keyed
    # contiguous, so a later transposed call at batch >= 2 misses (docs/autotuner.md, keys).
    tuner = AutoTuner(show_progress=False)
    tuner.tuning_mode = True
    runner = ContiguousOnly()
    assert tuner.choose_one("op", [runner], SWEPT, [_feature_major(1)])[1] == "flat"
    assert _tuned_profiles(tuner) == ["1x64", "2x64", "4x64", "8x64"]
    tuner.tuning_mode = False
    picked, tactic = tuner.choose_one("op", [runner], SWEPT, [_feature_major(8)])
    assert tactic == -1 and tuner.stats.fallbacks == {"op": 1}
    picked.forward([_feature_major(8)], tactic=tactic)  # never a contiguous-only pick
    (record,) = tuner.misses.records()
    assert record.key["dtypes"] == ["float32 order(1,0)"]
    # A tuning-mode call tunes the buckets it missed, not bucket 1, whose key it shares.
    tuner.tuning_mode = True
    tuner.history.clear()
    tuner.choose_one("op", [runner], SWEPT, [_feature_major(8)])
    assert _tuned_profiles(tuner) == ["2x64 order(1,0)", "4x64 order(1,0)", "8x64 order(1,0)"]
