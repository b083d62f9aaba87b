"""The steps the graph benchmarks capture: the engine's own decode step, built by its factories.

``benchmarks/graph_runner.py`` and ``benchmarks/graph_capture.py`` measure the graph runner on the
step the engine serves (:func:`engine_decode_step`: ``build_step`` over a ``llama-1b-shape``
model with random weights and a KV cache of random values). To price graph breaks they need one
step the engine does not build, the same step with every layer's attention as a graph break;
it is defined here, once: :class:`AttentionBreakStep`. :func:`hand_written_graph` is the
baseline a runner's replay is compared with.
"""

from __future__ import annotations

from typing import Any

import torch

from graphtune.engine.attention import DecodeAttention
from graphtune.engine.build import build_step
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.loading import load_model
from graphtune.engine.step import DecodeStep
from graphtune.graphs import graph_break

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def engine_decode_step(
    max_batch_size: int,
    max_seq_len: int,
    *,
    model: str = "llama-1b-shape",
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    tuner: Any = None,
) -> DecodeStep:
    """The engine's decode step for ``model`` (random weights, seeded) over a KV cache of
    ``max_batch_size`` slots (plus scratch) and ``max_seq_len`` positions filled with random
    values (never time on zeros); untuned unless a ``tuner`` is given (then tune it with
    :func:`graphtune.engine.tuning.tune_step`)."""
    loaded = load_model(model, device=device, dtype=dtype, seed=seed)
    cache = KVCache(loaded.config, max_batch_size, max_seq_len, loaded.device, dtype)
    cache.fill_random(seed)
    return build_step(loaded, cache, tuner=tuner)


def step_inputs(step: Any, batch: int, position: int, seed: int = 0) -> Inputs:
    """Decode inputs of ``batch`` rows: random tokens, every row at ``position``, row ``i`` in
    slot ``i`` (the engine's compacted batch)."""
    device = step.model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, step.model.config.vocab_size, (batch,), generator=gen, device=device)
    positions = torch.full((batch,), position, dtype=torch.long, device=device)
    return tokens, positions, torch.arange(batch, device=device)


class AttentionBreakStep:
    """The engine's decode step with each layer's attention run as a graph break.

    The same forward, the same ops and the same attention as ``step``; only the call of each
    layer's attention goes through :func:`graphtune.graphs.graph_break`, so a graph runner
    captures the step as ``layers + 1`` pieces and runs the attentions eagerly in between. It
    exists to measure what a break costs (outside a capture it computes what ``step`` does).

    Args:
        step: The engine's decode step.
    """

    def __init__(self, step: DecodeStep) -> None:
        self.step = step
        self.model = step.model
        self.cache = step.cache
        self.max_batch_size = step.max_batch_size

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> torch.Tensor:
        step = self.step
        attention = DecodeAttention(step, step.ops, positions, slots)

        def breaking(layer: int, q: torch.Tensor) -> torch.Tensor:
            return graph_break(attention, layer, q)

        return step.forward(
            step.ops, tokens, positions, step.write_rows(positions, slots), breaking
        )

    def example_inputs(self, batch: int) -> Inputs:
        """The step's example inputs (write only the scratch slot)."""
        return self.step.example_inputs(batch)


def hand_written_graph(step: Any, inputs: tuple) -> tuple[torch.cuda.CUDAGraph, Any]:
    """The baseline: ``step`` captured by hand at exactly this size (no padding, no copies);
    returns the graph and its output tensors."""
    static = tuple(t.clone() for t in inputs)
    side, current = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    return graph, out
