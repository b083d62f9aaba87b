"""The synthetic inputs that ``rope_kv_cache`` and ``norm_qkv_rope`` are tuned on are valid at
every bucket. Their caches are pinned to ``CACHE_ROWS`` rows, but a bucket writes ``B * kv_heads``
distinct rows: above ``CACHE_ROWS`` the write rows were cut to ``CACHE_ROWS``, every Triton
runner refused the inputs (``get_valid_tactics`` raised InputError) and the fallback won those
buckets untried. The normal buckets keep the canonical cache and the same write rows.

Only the inputs are made and checked here: no kernel runs at these sizes under the interpreter.
"""

from __future__ import annotations

import os

import torch

# The interpreter must be chosen before Triton decorates the kernels (see test_ops_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from graphtune.autotuner.profiles import generate_profiles, synthesize_inputs  # noqa: E402
from graphtune.errors import InputError  # noqa: E402
from graphtune.ops import _triton  # noqa: E402
from graphtune.ops._rope_inputs import check_rope_indices  # noqa: E402
from graphtune.ops.fused import TritonNormQkvRope, norm_qkv_rope_config  # noqa: E402
from graphtune.ops.rope_config import (  # noqa: E402
    CACHE_ROWS,
    TABLE_ROWS,
    canonical_rope_indices,
    rope_config,
)
from graphtune.ops.rotary import TorchRopeRunner, TritonRopeRunner  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton.device_supported(torch.device("cpu")),
    reason="Triton kernels run on the CPU only under TRITON_INTERPRET=1 (set when no GPU)",
)

H, KV, D, K = 4, 2, 8, 32
BIG = 65536  # B * KV = 131072 write rows, twice CACHE_ROWS
MAX_M = 100000  # `graphtune tune --max-batch 100000`: its own bucket, 200000 write rows


def _rope_live() -> list:
    qkv = torch.randn(3, (H + 2 * KV) * D)
    positions, rows = torch.randint(0, 8, (3,)), torch.arange(3 * KV)
    tables, caches = (torch.randn(8, D), torch.randn(8, D)), (torch.zeros(20, D),) * 2
    return [qkv, positions, *tables, *caches, rows, None, 1e-6]


def _qkv_live() -> list:
    x, norm_weight, wqkv = torch.randn(3, K), torch.randn(K), torch.randn((H + 2 * KV) * D, K)
    positions, rows = torch.randint(0, 8, (3,)), torch.arange(3 * KV)
    tables, caches = (torch.randn(8, D), torch.randn(8, D)), (torch.zeros(20, D),) * 2
    return [x, norm_weight, wqkv, None, positions, *tables, *caches, rows, 1e-5, None]


# op -> (config, live inputs, indices of positions, k_cache and write_rows)
OPS = {
    "rope_kv_cache": (lambda: rope_config(KV, MAX_M), _rope_live, 1, 4, 6),
    "norm_qkv_rope": (lambda: norm_qkv_rope_config(KV, MAX_M), _qkv_live, 4, 7, 9),
}


def _synthetic(op: str, batch: int) -> tuple[list, object]:
    """The tuner's synthetic inputs (and profile) of ``op`` at the bucket of ``batch`` rows."""
    config_of, live_of = OPS[op][:2]
    config, live = config_of(), live_of()
    (profile,) = [p for p in generate_profiles(config, live) if p.shapes[0][0] == batch]
    return synthesize_inputs(config, live, profile), profile


def _rope_part(op: str, inputs: list) -> list:
    """``[ref, positions, cos, sin, k_cache, v_cache, write_rows]`` of either op's inputs."""
    return inputs[:7] if op == "rope_kv_cache" else [inputs[0], *inputs[4:10]]


@pytest.mark.parametrize("batch", [BIG, MAX_M])
@pytest.mark.parametrize("op", sorted(OPS))
def test_inputs_are_valid_where_batch_times_kv_heads_exceeds_the_cache(op, batch):
    inputs, profile = _synthetic(op, batch)
    runner = TritonRopeRunner(H, KV) if op == "rope_kv_cache" else TritonNormQkvRope(H, KV)
    runner.get_valid_tactics(inputs, profile)  # the op's own checks: raised InputError before
    assert runner.supports(inputs)
    _, positions, _, _, k_cache, v_cache, rows = _rope_part(op, inputs)
    assert rows.shape == (batch * KV,) and positions.shape == (batch,)
    assert k_cache.shape[0] >= batch * KV and v_cache.shape == k_cache.shape
    check_rope_indices(_rope_part(op, inputs))  # in range of the tables and caches
    assert torch.unique(rows).numel() == rows.numel()  # distinct: no two programs on one row


def test_the_rope_fallback_runs_on_the_big_bucket():
    inputs, _ = _synthetic("rope_kv_cache", BIG)
    q = TorchRopeRunner(H, KV).forward(inputs)  # index_copy_ checks the write rows on the CPU
    assert q.shape == (BIG, H, D)


@pytest.mark.parametrize("batch", [1, 16, 4096, CACHE_ROWS // KV])
@pytest.mark.parametrize("op", sorted(OPS))
def test_normal_buckets_keep_the_canonical_cache(op, batch):
    pos_at, cache_at, rows_at = OPS[op][2:]
    inputs, profile = _synthetic(op, batch)
    assert profile.shapes[cache_at][0] == CACHE_ROWS == 65536
    assert profile.shapes[cache_at + 1][0] == CACHE_ROWS
    assert inputs[cache_at].shape == (CACHE_ROWS, D)
    positions, rows = inputs[pos_at], inputs[rows_at]
    want_positions, want_rows = canonical_rope_indices(
        torch.zeros(batch, dtype=torch.long),
        torch.zeros(batch * KV, dtype=torch.long),
        TABLE_ROWS,
        CACHE_ROWS,
    )
    assert torch.equal(positions, want_positions)
    assert torch.equal(rows, want_rows)


def test_more_write_rows_than_cache_rows_are_refused_not_cut():
    positions, rows = torch.zeros(5, dtype=torch.long), torch.zeros(10, dtype=torch.long)
    with pytest.raises(InputError, match="10 write rows need as many distinct cache rows"):
        canonical_rope_indices(positions, rows, TABLE_ROWS, 8)
