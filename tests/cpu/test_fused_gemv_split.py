"""Split-K of the fused GEMV kernel: the arrival counters, slices of K, the one-kernel reduction.

The kernel's split paths run under Triton's interpreter (set when there is no GPU), against the
same tactic without a split; tests/cpu/test_ops_fused.py covers every mode with split tactics
against float64.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from graphtune.errors import ConfigError, InputError  # noqa: E402
from graphtune.ops import _counters, _triton  # noqa: E402
from graphtune.ops import _split_k as split_mod  # noqa: E402
from graphtune.ops.fused_gemv.family import PLAIN, launch_fused_gemv  # noqa: E402

needs_triton = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)


@pytest.mark.parametrize(
    "k,split,bk,want", [(2048, 4, 128, 512), (96, 4, 32, 32), (100, 2, 32, 64), (64, 1, 64, 64)]
)
def test_keys_per_split_shares_whole_chunks_out_evenly(k, split, bk, want):
    assert split_mod.keys_per_split(k, split, bk) == want


def test_counters_are_made_once_never_during_a_capture_and_bounded(monkeypatch):
    monkeypatch.setattr(_counters, "_buffers", {})
    cpu = torch.device("cpu")
    first = _counters.arrival_counters(cpu, 10, user="u", fix="f")
    assert first.numel() == _counters.COUNTERS and not first.any()
    assert _counters.arrival_counters(cpu, _counters.COUNTERS, user="u", fix="f") is first
    with pytest.raises(InputError, match="more than the"):
        _counters.arrival_counters(cpu, _counters.COUNTERS + 1, user="u", fix="f")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ConfigError, match="before a CUDA graph captures"):
        _counters.arrival_counters(torch.device("cuda", 0), 4, user="u", fix="f")


@needs_triton
@pytest.mark.parametrize("dot,m", [(0, 1), (1, 5)])
def test_a_split_launch_matches_the_whole_launch_and_leaves_its_counters_at_zero(dot, m):
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 256
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    res = torch.randn(m, n, generator=gen)
    base = {"bn": 16, "bk": 32, "warps": 4 if dot else 1, "dot": dot, "stages": 1 + 2 * dot}
    outs = []
    for split in (1, 2, 8):
        out = torch.full((m, n), float("nan"))
        tactic = {**base, "split": split}
        launch_fused_gemv(PLAIN, tactic, x=x, weight=w, out=out, n=n, residual=res)
        outs.append(out)
    want = (x.double() @ w.double().T + res.double()).float()
    for out in outs:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    assert not _counters.arrival_counters(torch.device("cpu"), 1, user="u", fix="f").any()
