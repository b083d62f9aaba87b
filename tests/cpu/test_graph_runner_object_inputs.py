"""An input object the tree walker does not look into (a dataclass, a class of your own) that
holds a tensor is refused at build time with ConfigError (simulated backend, CPU): as a constant
the graph would keep reading the tensor it held at capture."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch

from graphtune.errors import ConfigError
from graphtune.graphs import CUDAGraphRunner, SimulatedGraphBackend


@dataclasses.dataclass
class Sampling:
    temperature: torch.Tensor


class Slotted:
    __slots__ = ("scale",)

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale


class Nested:
    def __init__(self, inner: Sampling) -> None:
        self.inner = inner


class SamplingTuple(NamedTuple):
    temperature: torch.Tensor


def step(x, cfg):
    return x / cfg.temperature if hasattr(cfg, "temperature") else x * 2


def runner(**kwargs) -> CUDAGraphRunner:
    return CUDAGraphRunner(
        step, max_batch_size=8, capture_sizes=[2, 4, 8], backend=SimulatedGraphBackend(), **kwargs
    )


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (Sampling(torch.tensor(1.0)), "temperature"),
        (Slotted(torch.tensor(1.0)), "scale"),
        (Nested(Sampling(torch.tensor(1.0))), "inner"),
        ({"cfg": Sampling(torch.tensor(1.0))}, "temperature"),
    ],
)
def test_capture_refuses_an_object_input_holding_a_tensor(value, field):
    path = "1.cfg" if isinstance(value, dict) else "1"
    with pytest.raises(ConfigError, match=rf"input {path} is a \w+ whose field '{field}'"):
        runner().capture(torch.ones(8, 2), value)


def test_a_lazy_first_call_refuses_it_too_instead_of_baking_it_in():
    cfg = Sampling(torch.tensor(1.0))
    with pytest.raises(ConfigError, match="tuple, list, dict or NamedTuple"):
        runner(lazy=True)(torch.ones(3, 2), cfg)


def test_tensors_the_walker_reaches_and_plain_objects_still_replay():
    lazy = runner()
    temperature = torch.tensor(2.0)
    lazy.capture(torch.ones(8, 2), SamplingTuple(temperature))
    temperature.fill_(4.0)  # updated in place: the graph reads it
    out = lazy(torch.ones(3, 2), SamplingTuple(temperature))
    assert lazy.stats.replays == 1 and torch.equal(out, torch.full((3, 2), 0.25))
    plain = runner()
    marker = object()  # no tensor inside: a constant, compared as before
    plain.capture(torch.ones(8, 2), marker)
    assert torch.equal(plain(torch.ones(3, 2), marker), torch.full((3, 2), 2.0))
    assert plain.stats.replays == 1
