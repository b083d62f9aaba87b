"""The launch cache on the GPU: launches that skip ``JITFunction.run`` give the same bits as
Triton's own launch, a misaligned input gets its own binary, and cached launches capture.

Skipped without CUDA (tests/gpu/conftest.py) and without Triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from graphtune.ops import TritonRMSNormRunner  # noqa: E402
from graphtune.ops._triton import launch_cache  # noqa: E402
from graphtune.ops.gemm import TritonGemvRunner  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16


def _cases() -> list[tuple[str, object, list[object]]]:
    gen = torch.Generator(device=DEV).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, generator=gen).to(BF16)

    return [
        ("rms_norm", TritonRMSNormRunner(), [randn(3, 2048), randn(2048), randn(3, 2048), 1e-5]),
        ("gemv", TritonGemvRunner(), [randn(2, 2048), randn(3072, 2048), None, None, False]),
    ]


def _outputs(result: object) -> list[torch.Tensor]:
    return list(result) if isinstance(result, tuple) else [result]  # type: ignore[list-item]


@pytest.mark.parametrize("case", [0, 1], ids=["rms_norm", "gemv"])
def test_cached_launches_equal_tritons_own_launch_bit_for_bit(case, monkeypatch):
    _, runner, inputs = _cases()[case]
    tactics = runner.get_valid_tactics(inputs, None)
    cache = launch_cache()
    for tactic in (tactics[0], tactics[-1]):
        monkeypatch.setenv("GRAPHTUNE_FAST_LAUNCH", "0")
        want = _outputs(runner.forward(inputs, tactic))
        monkeypatch.delenv("GRAPHTUNE_FAST_LAUNCH")
        runner.forward(inputs, tactic)  # the first cached launch goes through Triton
        hits = cache.hits
        got = _outputs(runner.forward(inputs, tactic))
        assert cache.hits > hits, "the second launch did not use the cache"
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), tactic


def test_a_misaligned_input_runs_its_own_binary_and_stays_right():
    runner = TritonGemvRunner()
    gen = torch.Generator(device=DEV).manual_seed(1)
    w = torch.randn(3072, 2048, device=DEV, generator=gen).to(BF16)
    storage = torch.randn(2 * 2048 + 8, device=DEV, generator=gen).to(BF16)
    aligned = storage[: 2 * 2048].view(2, 2048)
    shifted = storage[1 : 1 + 2 * 2048].view(2, 2048)  # 2 bytes off a 16-byte boundary
    assert shifted.data_ptr() % 16 != 0
    tactic = runner.get_valid_tactics([aligned, w, None, None, False], None)[0]
    cache = launch_cache()
    runner.forward([aligned, w, None, None, False], tactic)
    runner.forward([aligned, w, None, None, False], tactic)
    misses = cache.misses
    got = runner.forward([shifted.clone().view(2, 2048)[:, :], w, None, None, False], tactic)
    got_shifted = runner.forward([shifted, w, None, None, False], tactic)
    assert cache.misses > misses, "a misaligned input reused the aligned input's binary"
    want = torch.nn.functional.linear(shifted.float(), w.float())
    assert torch.equal(got_shifted, got)
    assert float((got_shifted.float() - want).abs().max()) < 0.05 * float(want.abs().max())


def test_cached_launches_capture_and_replay_in_a_cuda_graph():
    _, runner, inputs = _cases()[0]
    tactic = runner.get_valid_tactics(inputs, None)[-1]
    want = _outputs(runner.forward(inputs, tactic))
    hits = launch_cache().hits
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner.forward(inputs, tactic)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _outputs(runner.forward(inputs, tactic))
    assert launch_cache().hits > hits
    for tensor in out:
        tensor.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(out, want, strict=True):
        assert torch.equal(g, w)
