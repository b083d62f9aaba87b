"""Inputs that are lists, tuples or dicts holding tensors: candidates run on copies of their
tensors, and the tensors' shapes and dtypes are part of the cache key; every other input's key
text stays as it was (the engine's ops' keys among them)."""

from __future__ import annotations

import os
from typing import Any

import torch

if not torch.cuda.is_available():  # see test_ops_kernels.py
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_tuner_semantics import CONFIG, make_tuner  # noqa: E402

from graphtune.autotuner import AutoTuner, TunableRunner, autotune  # noqa: E402
from graphtune.autotuner.entries import CacheKey  # noqa: E402
from graphtune.autotuner.profiles import generate_profiles  # noqa: E402
from graphtune.engine import DecodeStep, KVCache, load_model  # noqa: E402
from graphtune.engine.tuning import record_step_calls  # noqa: E402


class WritesNested(TunableRunner):
    """Writes into the tensor in its second input; the tactic is the cost."""

    def __init__(self, timer: Any) -> None:
        self._timer = timer

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        return [1, 2]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        inputs[1][0].add_(1.0)
        inputs[2]["w"].add_(1.0)
        self._timer.cost = float(tactic)
        return inputs[0]


def test_candidates_never_write_tensors_inside_the_callers_containers() -> None:
    tuner, timer = make_tuner()
    listed, mapped = [torch.zeros(3)], {"w": torch.zeros(2)}
    with autotune(None, tuner):
        pick = tuner.choose_one(
            "op", [WritesNested(timer)], CONFIG, [torch.zeros(4, 2), listed, mapped]
        )
    assert pick[1] == 1
    assert torch.equal(listed[0], torch.zeros(3)) and torch.equal(mapped["w"], torch.zeros(2))


class UpToRows(TunableRunner):
    """Tactics 16 and 64, valid up to the rows of the nested tensor; the bigger is faster."""

    def __init__(self, timer: Any) -> None:
        self._timer = timer

    def get_valid_tactics(self, inputs: list, profile: Any, **kwargs: Any) -> list:
        rows = inputs[1][0].shape[0]
        return [t for t in (16, 64) if t <= rows]

    def forward(self, inputs: list, *, tactic: Any = -1, **kwargs: Any) -> Any:
        assert tactic == -1 or tactic <= inputs[1][0].shape[0]
        self._timer.cost = 100.0 / tactic
        return inputs[0]


def test_nested_tensors_shapes_and_dtypes_are_part_of_the_key() -> None:
    tuner, timer = make_tuner()
    runner, x = UpToRows(timer), torch.zeros(4, 2)
    with autotune(None, tuner):
        assert tuner.choose_one("op", [runner], CONFIG, [x, [torch.zeros(64)]])[1] == 64
        assert tuner.choose_one("op", [runner], CONFIG, [x, [torch.zeros(16)]])[1] == 16
        half = [torch.zeros(64, dtype=torch.float16)]
        assert tuner.choose_one("op", [runner], CONFIG, [x, half])[1] == 64
    assert [key.dtypes[1] for key in tuner.cache] == [
        "list(float32[64])",
        "list(float32[16])",
        "list(float16[64])",
    ]
    key = next(iter(tuner.cache))
    assert CacheKey.from_json(key.to_json()) == key  # the text survives the file


def test_only_containers_holding_tensors_change_their_key_text() -> None:
    from graphtune.autotuner.profiles import input_type_text

    assert input_type_text(torch.zeros(2, dtype=torch.bfloat16)) == "bfloat16"
    for plain in (3, 1.5, True, "s", None, [1, 2], (1.0,), {"a": 1}, [], {}, [[1], (2,)]):
        assert input_type_text(plain) == type(plain).__name__
    nested = (torch.zeros(2, 3, dtype=torch.int64), {"a": [torch.zeros(())], 7: 1.0}, None)
    expected = "tuple(int64[2,3], dict('a': list(float32[]), 7: float), NoneType)"
    assert input_type_text(nested) == expected


def _old_type_text(x: Any) -> str:
    """The dtypes entry of every input before containers had their tensors in the key."""
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else type(x).__name__


def test_the_engine_ops_keys_are_those_of_before() -> None:
    # Every op call of a dense and an MoE decode step: the keys of all its profiles have the
    # dtypes text the old rule gave (the engine passes no container holding tensors); decode
    # attention's query, a view of the QKV rows, keys as row-major.
    checked = 0
    strided: set[tuple[str, int, str]] = set()
    for name in ("tiny", "qwen3-moe-tiny"):
        model = load_model(name)
        tuner = AutoTuner(show_progress=False)
        step = DecodeStep(model, KVCache(model.config, 4, 32), contiguous_slots=True, tuner=tuner)
        inputs = (torch.tensor([1, 5, 9, 7]), torch.zeros(4, dtype=torch.long), torch.arange(4))
        for call in record_step_calls(step, inputs):
            resolved = tuner._resolve(call)
            for profile in generate_profiles(call.config, list(call.inputs)):
                key = resolved.key(profile)
                for i, (text, x) in enumerate(zip(key.dtypes, call.inputs, strict=True)):
                    if text != _old_type_text(x):
                        strided.add((call.op, i, text.removeprefix(_old_type_text(x))))
                checked += 1
    assert checked > 20
    assert strided == set()
