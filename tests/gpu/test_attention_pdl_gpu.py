"""Decode attention's early reads under PDL, on the GPU: the kernel before it writes each
request's new K/V row late (it waits, lets attention launch, spins for two milliseconds,
then writes), so attention's first tile, read before its ``gdc_wait()``, holds the old row.
Every Triton tactic (both runners) must still give SDPA's result on the written cache: the
newest key is read again after the wait (``graphtune.ops._attention_kernels``).

Skipped without CUDA (tests/gpu/conftest.py), without Triton, and below compute capability 9.0
(no PDL, so no early start to test).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from graphtune.ops import _pdl, attention  # noqa: E402
from graphtune.ops._triton import run_kernel  # noqa: E402

DEV = "cuda"
SPIN_NS = 2_000_000  # far longer than the host's launch of attention after the writer


@triton.jit
def late_kv_writer_kernel(
    k_ptr,
    v_ptr,
    new_k_ptr,
    new_v_ptr,
    pos_ptr,
    KV,
    stride_b,
    stride_h,
    stride_s,
    spin_ns,
    HEAD_DIM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program ``b * KV + h`` writes row ``pos[b]`` of head ``h`` after spinning ``spin_ns``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    b = bh // KV
    h = bh % KV
    dims = tl.arange(0, HEAD_DIM)
    start = tl.extra.cuda.globaltimer()
    now = start
    while now - start < spin_ns:
        now = tl.extra.cuda.globaltimer()
    row = b * stride_b + h * stride_h + tl.load(pos_ptr + b).to(tl.int64) * stride_s
    tl.store(k_ptr + row + dims, tl.load(new_k_ptr + bh * HEAD_DIM + dims))
    tl.store(v_ptr + row + dims, tl.load(new_v_ptr + bh * HEAD_DIM + dims))


def _case(batch: int, kv_heads: int, groups: int, seq: int, dim: int):
    torch.manual_seed(batch * 1000 + seq)
    q = torch.randn(batch, kv_heads, groups, dim, device=DEV, dtype=torch.bfloat16)
    keys = torch.randn(batch, kv_heads, seq, dim, device=DEV, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    # Row b's token sits at a different position per request, in various tiles and splits.
    pos = torch.tensor([(seq - 1 - 37 * b) % seq for b in range(batch)], device=DEV)
    keys[torch.arange(batch, device=DEV), :, pos] = 0.0  # the old rows: far from the new ones
    values[torch.arange(batch, device=DEV), :, pos] = 0.0
    new_k = (8 * torch.randn(batch, kv_heads, dim, device=DEV)).to(torch.bfloat16)
    new_v = (8 * torch.randn(batch, kv_heads, dim, device=DEV)).to(torch.bfloat16)
    visible = torch.arange(seq, device=DEV)[None, :] <= pos[:, None]
    mask = torch.where(visible, 0.0, float("-inf")).to(torch.bfloat16)[:, None, None, :]
    return q, keys, values, mask, pos, new_k, new_v


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="PDL needs compute capability 9.0",
)
@pytest.mark.parametrize("batch,seq", [(1, 528), (3, 200), (8, 528)])
def test_attention_reads_the_new_kv_row_its_predecessor_writes_late(batch, seq):
    assert _pdl.pdl_enabled(torch.device(DEV))
    kv_heads, groups, dim = 8, 4, 64
    runners = (attention.TritonDecodeAttention(), attention.TritonDecodeAttentionOneKernel())
    checked = 0
    for runner in runners:
        q, keys, values, mask, pos, new_k, new_v = _case(batch, kv_heads, groups, seq, dim)
        for tactic in runner.tactics_for([q, keys, values, mask]):
            keys_run, values_run = keys.clone(), values.clone()
            inputs = [q, keys_run, values_run, mask]
            runner.launch(inputs, tactic)  # compiled, so the pair below launches back to back
            torch.cuda.synchronize()
            run_kernel(
                late_kv_writer_kernel,
                (batch * kv_heads,),
                (keys_run, values_run, new_k, new_v, pos, kv_heads, *keys_run.stride()[:3]),
                dict(spin_ns=SPIN_NS, HEAD_DIM=dim),
                False,
            )
            got = runner.launch(inputs, tactic)
            torch.cuda.synchronize()
            at = torch.arange(batch, device=DEV)
            assert torch.equal(keys_run[at, :, pos], new_k)  # the writer did write
            want = torch.nn.functional.scaled_dot_product_attention(
                q.double(), keys_run.double(), values_run.double(), attn_mask=mask.double()
            )
            # bf16 output rounding is relative; an old row read instead would be off by the
            # new values' size (8 standard deviations), hundreds of times this bound.
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert err < 1e-2, (type(runner).__name__, tactic, err)
            checked += 1
    assert checked >= 6
