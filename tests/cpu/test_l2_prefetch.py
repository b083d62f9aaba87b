"""The L2 weight prefetch of the decode step (``graphtune.ops._l2_prefetch``): its launch
arguments, where decode attention issues it, and which weight the step hands over. The
instruction itself runs only on a GPU (tests/gpu/test_attention_l2_prefetch_gpu.py)."""

from __future__ import annotations

import inspect

import pytest
import torch

from graphtune.autotuner import AutoTuner
from graphtune.engine import step as step_module
from graphtune.engine.kv_cache import KVCache
from graphtune.engine.model import random_model
from graphtune.engine.presets import get_preset
from graphtune.engine.step import DecodeStep
from graphtune.ops import _l2_prefetch
from graphtune.ops import attention as attention_op
from graphtune.ops._l2_prefetch import CHUNK_BYTES, l2_prefetch_args


def test_the_chunks_cover_the_weight_and_the_last_one_ends_at_its_end(monkeypatch):
    monkeypatch.setattr(_l2_prefetch, "prefetchable", lambda weight: True)
    placeholder = torch.zeros(4)
    for rows in (2048, 2050, 8):  # whole chunks, half a chunk over, exactly one chunk
        weight = torch.zeros(rows, 1024, dtype=torch.bfloat16)
        nbytes = rows * 1024 * 2
        base, chunks, last = l2_prefetch_args(weight, placeholder)
        assert base is weight
        assert (chunks - 1) * CHUNK_BYTES < nbytes <= chunks * CHUNK_BYTES
        assert last == nbytes - CHUNK_BYTES and last % 16 == 0
        assert min((chunks - 1) * CHUNK_BYTES, last) + CHUNK_BYTES == nbytes


def test_nothing_is_issued_without_a_weight_off_the_gpu_or_when_switched_off(monkeypatch):
    placeholder = torch.zeros(4)
    weight = torch.zeros(2048, 1024, dtype=torch.bfloat16)
    assert l2_prefetch_args(None, placeholder) == (placeholder, 0, 0)
    assert l2_prefetch_args(weight, placeholder) == (placeholder, 0, 0)  # a CPU tensor
    monkeypatch.setattr(_l2_prefetch, "prefetchable", lambda weight: True)
    monkeypatch.setenv("GRAPHTUNE_L2_PREFETCH", "0")
    assert l2_prefetch_args(weight, placeholder) == (placeholder, 0, 0)
    monkeypatch.setenv("GRAPHTUNE_L2_PREFETCH", "1")
    assert l2_prefetch_args(weight, placeholder)[1] > 0


def test_attention_issues_the_prefetch_first_and_with_the_hosts_chunk_size():
    """Before gdc_wait() (a weight, which no kernel of the step writes: graphtune.ops._pdl),
    before the mask scan; the instruction's immediate size is the host's CHUNK_BYTES."""
    pytest.importorskip("triton")
    from graphtune.ops import _attention_kernels, _prefetch_kernels

    body = inspect.getsource(_attention_kernels.decode_attention_kernel.fn)
    assert body.index("prefetch_l2_share(") < body.index("for start in range(0, S")
    assert body.index("prefetch_l2_share(") < body.index("gdc_wait()")
    helper = inspect.getsource(_prefetch_kernels.prefetch_l2_share.fn)
    assert helper.count(str(CHUNK_BYTES)) == 2  # the offset step and the instruction's size


@pytest.mark.parametrize("streams", [True, False])
def test_the_step_hands_attention_wo_exactly_when_weights_stream_from_memory(monkeypatch, streams):
    monkeypatch.setattr(step_module, "weights_stream_from_memory", lambda model: streams)
    handed: list[torch.Tensor | None] = []
    real = attention_op.decode_attention

    def spy(*args, l2_prefetch=None, **kwargs):
        handed.append(l2_prefetch)
        return real(*args, l2_prefetch=l2_prefetch, **kwargs)

    monkeypatch.setattr(attention_op, "decode_attention", spy)
    model = random_model(get_preset("tiny"), seed=0)
    step = DecodeStep(model, KVCache(model.config, 2, 16), tuner=AutoTuner(show_progress=False))
    tokens, positions, slots = step.example_inputs(2)
    logits = step(tokens, positions, slots)
    assert logits.shape == (2, model.config.vocab_size)
    expected = [layer.wo if streams else None for layer in model.layers]
    assert len(handed) == len(expected)
    assert all(a is b for a, b in zip(handed, expected, strict=True))
