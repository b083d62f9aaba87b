"""A dict input whose key contains "." can be named in pad= and batched= (CPU, simulated)."""

from __future__ import annotations

import pytest
import torch

from graphtune.errors import ConfigError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend
from graphtune.graphs.tree import flatten_with_paths, resolve_rules


def step(x, d):
    return x + d["slot.id"][:, None]


@pytest.mark.parametrize("pad", [{"1.slot.id": 3.0}, (None, {"slot.id": 3.0})])
def test_a_dotted_dict_key_is_named_by_its_path_string_and_structured(pad):
    runner = CUDAGraphRunner(
        step,
        max_batch_size=4,
        capture_sizes=[4],
        warmup=0,
        backend=SimulatedGraphBackend(),
        pad=pad,
    )
    runner.capture(torch.zeros(4, 2), {"slot.id": torch.zeros(4)})
    padded, n, _ = runner.padded_inputs(torch.zeros(3, 2), {"slot.id": torch.ones(3)})
    assert n == 3 and padded[1]["slot.id"].tolist() == [1.0, 1.0, 1.0, 3.0]
    out = runner(torch.zeros(3, 2), {"slot.id": torch.ones(3)})
    assert out.tolist() == [[1.0, 1.0]] * 3


def test_a_dotted_string_naming_two_inputs_is_refused():
    _, paths, _ = flatten_with_paths((0, {"a.b": 1, "a": {"b": 2}}))
    with pytest.raises(ConfigError):
        resolve_rules({"1.a.b": 5}, paths, name="pad", is_rule=lambda r: isinstance(r, int))
    rules = resolve_rules(
        (None, {"a.b": 5}), paths, name="pad", is_rule=lambda r: isinstance(r, int)
    )
    assert rules == [None, 5, None]
