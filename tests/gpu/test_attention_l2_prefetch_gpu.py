"""Decode attention's L2 prefetch of the next weight (``graphtune.ops._l2_prefetch``), on the
GPU: the bulk-prefetch instructions compile and run in every Triton tactic of both attention
runners, inside a CUDA graph too, and change no bit of the output.

Skipped without CUDA (tests/gpu/conftest.py), without Triton, and below compute capability 9.0
(no bulk prefetch: the kernels compile without it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphtune.ops import attention  # noqa: E402
from graphtune.ops._l2_prefetch import (  # noqa: E402
    CHUNK_BYTES,
    l2_prefetch_args,
    l2_prefetch_compiled,
)

DEV = "cuda"

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
    reason="bulk L2 prefetch needs compute capability 9.0",
)


def _inputs(batch: int, seq: int, visible: int) -> list[torch.Tensor]:
    torch.manual_seed(batch * 7 + seq)
    kv_heads, groups, dim = 8, 4, 64
    q = torch.randn(batch, kv_heads, groups, dim, device=DEV, dtype=torch.bfloat16)
    keys = torch.randn(batch, kv_heads, seq, dim, device=DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    mask = torch.full((batch, 1, 1, seq), float("-inf"), device=DEV, dtype=torch.bfloat16)
    mask[..., :visible] = 0.0
    return [q, keys, values, mask]


@pytest.mark.parametrize("batch,seq,visible", [(1, 1024, 513), (4, 512, 300)])
def test_every_tactic_gives_the_same_bits_with_the_prefetch(batch, seq, visible):
    inputs = _inputs(batch, seq, visible)
    # Not a whole number of chunks: the last chunk overlaps the one before it.
    weight = torch.randn(2050, 2048, device=DEV, dtype=torch.bfloat16)
    _, chunks, last = l2_prefetch_args(weight, inputs[1])
    nbytes = weight.numel() * 2
    assert chunks == -(-nbytes // CHUNK_BYTES) and last == nbytes - CHUNK_BYTES
    kernel = attention.attention_kernels().decode_attention_kernel
    assert l2_prefetch_compiled(kernel, inputs[0].device)
    tried = 0
    for runner in (attention.TritonDecodeAttention(), attention.TritonDecodeAttentionOneKernel()):
        for tactic in runner.get_valid_tactics(inputs, None):
            plain = runner.forward(inputs, tactic=tactic)
            fetched = runner.forward(inputs, tactic=tactic, l2_prefetch=weight)
            assert torch.equal(plain, fetched), tactic
            tried += 1
    assert tried >= 4


def test_the_prefetch_replays_in_a_cuda_graph():
    inputs = _inputs(2, 512, 200)
    weight = torch.randn(4096, 2048, device=DEV, dtype=torch.bfloat16)
    runner = attention.TritonDecodeAttentionOneKernel()
    tactic = runner.get_valid_tactics(inputs, None)[0]
    expected = runner.forward(inputs, tactic=tactic)
    runner.forward(inputs, tactic=tactic, l2_prefetch=weight)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = runner.forward(inputs, tactic=tactic, l2_prefetch=weight)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
